"""Seeded synthetic workloads: no sharing, a shared system prompt, multi-turn chat, agentic
sessions with branches.

Every generator is a pure function of its arguments: the same ``seed`` gives the same trace,
token for token. Lengths are :class:`~hybridkv.traces.dists.LogNormal` (median, sigma, clip);
arrivals are Poisson (requests or sessions per second); think and tool times are log-normal
seconds. The defaults are illustrative, not fitted to a dataset; every value used is recorded in
``Trace.params``. For scale: LMSYS-Chat-1M reports about 70 prompt and 215 response tokens per
turn and 2 turns per conversation (Zheng et al., 2023, Table 1); the chat defaults here are longer
because cache pressure comes from long sessions.

Token ids. All tokens not copied from a shared prefix are drawn uniformly from
``[0, vocab_size)``, and the *first* token of every generated segment (a system prompt, a user
message, an answer, a tool result) is distinct across the whole trace while there are fewer
segments than ids. Two prompts therefore diverge exactly where the workload says they do, so
``Request.shared_prefix_length`` is the true longest common prefix with earlier requests, not an
estimate that a chance token match could extend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .dists import LogNormal, poisson_arrivals
from .request import Request, Trace

__all__ = [
    "VOCAB_SIZE",
    "WORKLOADS",
    "agentic",
    "generate",
    "multi_turn_chat",
    "no_sharing",
    "shared_prefix",
]

#: Qwen2/Qwen3 tokenizer size (Qwen3-Next ``vocab_size``); only the id range matters here
VOCAB_SIZE = 151_936

# Default distributions (tokens, or seconds for *_S); frozen, so safe as defaults.
NO_SHARING_PROMPT = LogNormal(1024, 1.0, low=16, cap=32_768)
NO_SHARING_OUTPUT = LogNormal(256, 0.8, cap=4096)
SHARED_SYSTEM_PROMPT = LogNormal(2048, 0.5, low=256, cap=16_384)
SHARED_USER = LogNormal(128, 1.0, cap=4096)
SHARED_OUTPUT = LogNormal(128, 0.8, cap=2048)
CHAT_USER = LogNormal(96, 1.2, cap=8192)
CHAT_OUTPUT = LogNormal(256, 0.9, cap=4096)
CHAT_THINK_S = LogNormal(15.0, 1.0, low=1.0, cap=600.0)
AGENT_TASK = LogNormal(512, 1.0, cap=8192)
AGENT_ACTION = LogNormal(160, 0.8, cap=4096)
AGENT_OBSERVATION = LogNormal(600, 1.2, cap=16_384)
AGENT_STEER = LogNormal(64, 0.8, cap=1024)
AGENT_TOOL_S = LogNormal(1.5, 1.0, low=0.05, cap=120.0)


def _segments(
    rng: np.random.Generator, lengths: np.ndarray, vocab_size: int
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Tokens of all segments back to back (read-only ``int32``), their start offsets
    (``len + 1`` entries) and whether every segment starts with a distinct token."""
    lengths = np.asarray(lengths, np.int64)
    if np.any(lengths < 1):
        raise ValueError("every segment needs at least one token")
    starts = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=starts[1:])
    tokens = rng.integers(0, vocab_size, size=int(starts[-1]), dtype=np.int32)
    distinct = lengths.size <= vocab_size
    if distinct and lengths.size:
        tokens[starts[:-1]] = rng.choice(vocab_size, size=lengths.size, replace=False)
    tokens.flags.writeable = False
    return tokens, starts, distinct


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _describe(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__name__, **dataclasses.asdict(value)}
    return value


class _Builder:
    """Collects requests with provisional ids, then sorts them by arrival into a Trace."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, **fields: Any) -> int:
        self.rows.append(fields)
        return len(self.rows) - 1

    def finish(self, name: str, params: dict[str, Any]) -> Trace:
        arrivals = np.array([r["arrival_s"] for r in self.rows], float)
        order = np.argsort(arrivals, kind="stable")
        new_id = np.empty(len(order), np.int64)
        new_id[order] = np.arange(len(order))
        requests = []
        for i, old in enumerate(order):
            row = dict(self.rows[old])
            parent = row.get("parent_id", -1)
            row["parent_id"] = int(new_id[parent]) if parent >= 0 else -1
            requests.append(Request(request_id=i, **row))
        return Trace(name, tuple(requests), {k: _describe(v) for k, v in params.items()})


def _check_count(num_requests: int) -> None:
    if not isinstance(num_requests, (int, np.integer)) or num_requests < 1:
        raise ValueError(f"num_requests must be a positive integer, got {num_requests!r}")


# ---- no sharing ---------------------------------------------------------------------------------
def no_sharing(
    num_requests: int,
    *,
    seed: int = 0,
    rate: float = 4.0,
    prompt: LogNormal = NO_SHARING_PROMPT,
    output: LogNormal = NO_SHARING_OUTPUT,
    vocab_size: int = VOCAB_SIZE,
) -> Trace:
    """Independent requests: Poisson arrivals at ``rate`` per second, log-normal prompt and
    output lengths, no token shared with any other request."""
    _check_count(num_requests)
    params = dict(locals())
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(rng, rate, num_requests)
    p_len = prompt.sample_int(rng, num_requests)
    o_len = output.sample_int(rng, num_requests)
    lengths = np.stack([p_len, o_len], axis=1).ravel()  # prompt, output, prompt, ...
    tokens, starts, _ = _segments(rng, lengths, vocab_size)
    b = _Builder()
    for i in range(num_requests):
        s0, s1, s2 = starts[2 * i], starts[2 * i + 1], starts[2 * i + 2]
        b.add(
            arrival_s=float(arrivals[i]),
            prompt=tokens[s0:s1],
            output_length=int(o_len[i]),
            output_ids=tokens[s1:s2],
            shared_prefix_length=0,
        )
    return b.finish("no_sharing", params)


# ---- shared system prompt -----------------------------------------------------------------------
def shared_prefix(
    num_requests: int,
    *,
    seed: int = 0,
    rate: float = 8.0,
    num_prefixes: int = 4,
    zipf_s: float = 1.0,
    prefix: LogNormal = SHARED_SYSTEM_PROMPT,
    user: LogNormal = SHARED_USER,
    output: LogNormal = SHARED_OUTPUT,
    vocab_size: int = VOCAB_SIZE,
) -> Trace:
    """Many users behind a few long system prompts.

    ``num_prefixes`` system prompts, each of a log-normal length drawn once; request ``i`` picks
    prompt ``k`` with probability proportional to ``1 / (k + 1) ** zipf_s`` (``zipf_s = 0``:
    uniform) and appends a user message. Poisson arrivals at ``rate`` per second.
    """
    _check_count(num_requests)
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    params = dict(locals())
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(rng, rate, num_requests)
    sys_len = prefix.sample_int(rng, num_prefixes)
    weights = 1.0 / np.arange(1, num_prefixes + 1) ** zipf_s
    group = rng.choice(num_prefixes, size=num_requests, p=weights / weights.sum())
    u_len = user.sample_int(rng, num_requests)
    o_len = output.sample_int(rng, num_requests)
    lengths = np.concatenate([sys_len, np.stack([u_len, o_len], axis=1).ravel()])
    tokens, starts, _ = _segments(rng, lengths, vocab_size)
    systems = [tokens[starts[k] : starts[k + 1]] for k in range(num_prefixes)]
    body = starts[num_prefixes:]
    seen = np.zeros(num_prefixes, bool)
    b = _Builder()
    for i in range(num_requests):
        g = int(group[i])
        u0, o0, o1 = body[2 * i], body[2 * i + 1], body[2 * i + 2]
        b.add(
            arrival_s=float(arrivals[i]),
            # one copy per request: each prompt is its own contiguous array, as a server sees it
            prompt=_frozen(np.concatenate([systems[g], tokens[u0:o0]])),
            output_length=int(o_len[i]),
            output_ids=tokens[o0:o1],
            prefix_group=g,
            shared_prefix_length=int(sys_len[g]) if seen[g] else 0,
        )
        seen[g] = True
    return b.finish("shared_prefix", params)


# ---- multi-turn chat ----------------------------------------------------------------------------
def multi_turn_chat(
    num_requests: int,
    *,
    seed: int = 0,
    session_rate: float = 1.0,
    mean_turns: float = 4.0,
    max_turns: int = 32,
    system_prompt: int = 512,
    user: LogNormal = CHAT_USER,
    output: LogNormal = CHAT_OUTPUT,
    think_s: LogNormal = CHAT_THINK_S,
    max_prompt: int = 32_768,
    vocab_size: int = VOCAB_SIZE,
) -> Trace:
    """Chat sessions whose every turn resends the whole history plus a new user message.

    Sessions start as a Poisson process at ``session_rate`` per second and last a geometric
    number of turns (mean ``mean_turns``, at most ``max_turns``; a session also ends before a
    prompt would exceed ``max_prompt`` tokens). Every session starts with the same
    ``system_prompt`` tokens (0: none). Turn ``t``'s prompt is the system prompt, every earlier
    user message and answer, and user message ``t``; its answer is ``output_ids``. Turn ``t + 1``
    arrives ``think_s`` after turn ``t`` (open loop) and names turn ``t`` as its parent.
    """
    _check_count(num_requests)
    params = dict(locals())
    rng = np.random.default_rng(seed)
    n = num_requests
    starts_s = poisson_arrivals(rng, session_rate, n)  # at most n sessions
    turns = np.minimum(rng.geometric(1.0 / max(1.0, mean_turns), n), max_turns)
    u_len = user.sample_int(rng, n)
    o_len = output.sample_int(rng, n)
    think = think_s.sample(rng, n)

    # decide each session's turns (lengths only), consuming the pools above in order
    sessions: list[tuple[int, int]] = []  # (first pool index, turns)
    used = 0
    while used < n:
        k = int(min(turns[len(sessions)], n - used))
        prompt_ends = system_prompt + np.cumsum(u_len[used : used + k] + o_len[used : used + k])
        prompt_ends -= o_len[used : used + k]
        k = max(1, int(np.searchsorted(prompt_ends, max_prompt, side="right")))
        sessions.append((used, k))
        used += k

    seg_lengths = [np.array([system_prompt])] if system_prompt else []
    seg_lengths.append(np.stack([u_len, o_len], axis=1).ravel())
    tokens, seg_starts, _ = _segments(rng, np.concatenate(seg_lengths), vocab_size)
    base = 1 if system_prompt else 0
    sys_tokens = tokens[: seg_starts[1]] if system_prompt else tokens[:0]

    b = _Builder()
    for s, (first, k) in enumerate(sessions):
        body = tokens[seg_starts[base + 2 * first] : seg_starts[base + 2 * (first + k)]]
        transcript = _frozen(np.concatenate([sys_tokens, body]))
        pos, t, parent = system_prompt, float(starts_s[s]), -1
        shared = system_prompt if s > 0 else 0
        for j in range(k):
            i = first + j
            p_end = pos + int(u_len[i])
            if j:
                t += float(think[i])
            parent = b.add(
                arrival_s=t,
                prompt=transcript[:p_end],
                output_length=int(o_len[i]),
                output_ids=transcript[p_end : p_end + int(o_len[i])],
                session_id=s,
                turn=j,
                prefix_group=0 if system_prompt else -1,
                parent_id=parent,
                think_time_s=float(think[i]) if j else 0.0,
                shared_prefix_length=shared,
            )
            pos = p_end + int(o_len[i])
            shared = pos  # the next turn resends this turn's prompt and answer
    return b.finish("multi_turn_chat", params)


# ---- agentic sessions with branches -------------------------------------------------------------
def agentic(
    num_requests: int,
    *,
    seed: int = 0,
    session_rate: float = 0.2,
    mean_steps: float = 24.0,
    max_steps: int = 200,
    system_prompt: int = 4096,
    task: LogNormal = AGENT_TASK,
    action: LogNormal = AGENT_ACTION,
    observation: LogNormal = AGENT_OBSERVATION,
    branch_prob: float = 0.15,
    mean_branch_steps: float = 2.0,
    steer: LogNormal = AGENT_STEER,
    tool_s: LogNormal = AGENT_TOOL_S,
    max_prompt: int = 131_072,
    vocab_size: int = VOCAB_SIZE,
) -> Trace:
    """Coding-agent sessions: a trunk of tool calls with branches that fork from earlier points.

    A session starts (Poisson, ``session_rate`` per second) with the shared ``system_prompt``
    (tool definitions, the same tokens in every session) and a task. Each step sends the context
    so far and generates an ``action``; the next trunk step appends a tool ``observation``. With
    probability ``branch_prob`` a trunk step instead forks: it goes back to the prompt of a
    uniformly chosen earlier trunk step, appends a ``steer`` message (a retry or a sub-task) and
    runs a branch of geometric length (mean ``mean_branch_steps``) before the trunk resumes where
    it was. A session has a geometric number of steps (mean ``mean_steps``, at most
    ``max_steps``) and ends before a prompt would exceed ``max_prompt``. Steps are ``tool_s``
    apart (open loop); each names the previous step as its parent.
    """
    _check_count(num_requests)
    if not 0 <= branch_prob <= 1:
        raise ValueError(f"branch_prob must be in [0, 1], got {branch_prob}")
    params = dict(locals())
    rng = np.random.default_rng(seed)
    n = num_requests
    starts_s = poisson_arrivals(rng, session_rate, n)
    steps = np.minimum(rng.geometric(1.0 / max(1.0, mean_steps), n), max_steps)
    task_len = task.sample_int(rng, n)
    act_len = action.sample_int(rng, n)
    obs_len = observation.sample_int(rng, n)
    steer_len = steer.sample_int(rng, n)
    tool = tool_s.sample(rng, n)
    fork_u = rng.random(n)
    branch_len = rng.geometric(1.0 / max(1.0, mean_branch_steps), n)
    pick_u = rng.random(n)

    # pass 1: structure. A branch is (its session's trunk branch index, or -1 for a trunk; the
    # fork position in the trunk; its own segment lengths). A row points into its branch.
    branches: list[tuple[int, int, list[int]]] = []
    rows: list[dict[str, Any]] = []
    used = 0
    session = 0
    while used < n:
        s = session
        trunk = len(branches)
        branches.append((-1, 0, [int(task_len[used])]))
        trunk_len = system_prompt + int(task_len[used])
        trunk_prompts: list[int] = []  # prompt ends of trunk steps: the fork points
        last_trunk_end = 0  # trunk tokens sent and answered so far
        t = float(starts_s[s])
        parent = -1
        on_branch, branch_left, br_len = -1, 0, 0
        made = 0
        for j in range(int(min(steps[s], n - used))):
            i = used + j
            if j:
                t += float(tool[i])
            if on_branch < 0 and j and fork_u[i] < branch_prob:
                pos = trunk_prompts[int(pick_u[i] * len(trunk_prompts))]
                on_branch = len(branches)
                branches.append((trunk, pos, [int(steer_len[i])]))
                branch_left = int(branch_len[i])
                br_len, shared = pos + int(steer_len[i]), pos
            elif on_branch >= 0:
                branches[on_branch][2].append(int(obs_len[i]))
                shared = br_len
                br_len += int(obs_len[i])
            elif j:
                branches[trunk][2].append(int(obs_len[i]))
                shared = last_trunk_end
                trunk_len += int(obs_len[i])
            else:
                shared = system_prompt if s > 0 else 0
            branch, prompt_end = (on_branch, br_len) if on_branch >= 0 else (trunk, trunk_len)
            if j and prompt_end > max_prompt:
                break  # the context is full: the session ends
            a = int(act_len[i])
            branches[branch][2].append(a)
            rows.append(
                dict(
                    branch=branch,
                    prompt_end=prompt_end,
                    arrival_s=t,
                    output_length=a,
                    session_id=s,
                    turn=j,
                    branch_id=branch - trunk,
                    prefix_group=0 if system_prompt else -1,
                    parent_id=parent,
                    think_time_s=float(tool[i]) if j else 0.0,
                    shared_prefix_length=shared,
                )
            )
            parent = len(rows) - 1
            made += 1
            if on_branch >= 0:
                br_len += a
                branch_left -= 1
                if branch_left == 0:
                    on_branch = -1
            else:
                trunk_prompts.append(trunk_len)
                trunk_len += a
                last_trunk_end = trunk_len
        used += made
        session += 1

    # pass 2: tokens. Every branch's own segments, back to back, in one draw; a branch array is
    # its trunk's first ``fork`` tokens followed by its own segments.
    all_lengths = np.array(
        ([system_prompt] if system_prompt else []) + [x for br in branches for x in br[2]],
        np.int64,
    )
    tokens, seg_starts, _ = _segments(rng, all_lengths, vocab_size)
    k = 1 if system_prompt else 0
    sys_tokens = tokens[: seg_starts[1]] if system_prompt else tokens[:0]
    arrays: list[np.ndarray] = []
    for trunk_of, fork, segs in branches:
        own = tokens[seg_starts[k] : seg_starts[k + len(segs)]]
        k += len(segs)
        head = sys_tokens if trunk_of < 0 else arrays[trunk_of][:fork]
        arrays.append(_frozen(np.concatenate([head, own])))

    b = _Builder()
    for row in rows:
        arr = arrays[row.pop("branch")]
        end = row.pop("prompt_end")
        a = row["output_length"]
        b.add(prompt=arr[:end], output_ids=arr[end : end + a], **row)
    return b.finish("agentic", params)


#: name -> generator, for command lines and figure code
WORKLOADS = {
    "no_sharing": no_sharing,
    "shared_prefix": shared_prefix,
    "multi_turn_chat": multi_turn_chat,
    "agentic": agentic,
}


def generate(name: str, num_requests: int, *, seed: int = 0, **kwargs: Any) -> Trace:
    """``WORKLOADS[name](num_requests, seed=seed, **kwargs)`` with a helpful error."""
    try:
        fn = WORKLOADS[name]
    except KeyError:
        known = ", ".join(WORKLOADS)
        raise ValueError(f"unknown workload {name!r}; choose one of {known}") from None
    return fn(num_requests, seed=seed, **kwargs)
