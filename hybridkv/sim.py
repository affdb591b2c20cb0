"""Replay a trace against a memory plan with a continuous-batching scheduler model.

The scheduler follows vLLM's shape: each step first gives every running request in decode one
token, then continues chunked prefills, then admits waiting requests while the token budget,
``max_num_seqs`` and memory allow. A request that cannot get a block preempts the most recently
admitted one, which frees everything and starts over later (recompute). Prefix-cache lookups,
state checkpoints and block accounting are done by the real :class:`HybridAllocator` on the plan.
Time advances by the roofline cost of each step (:mod:`hybridkv.costmodel`).

With the ``align`` policy, where a prefill chunk ends is vLLM 0.33's rule
(``Scheduler._mamba_block_aligned_split``, asked through the allocator's ``split_prefill``; the
rules are listed in :class:`hybridkv.alloc.policies.VllmAlign`): a chunk the token budget cuts
ends on a block multiple, and a prompt that fits runs in one chunk to its last cacheable block
boundary (to its end when the state layers export the checkpoint from inside the prefill,
``SimConfig.prefill_checkpoint_alignment``), stopping earlier only at a junction or, with hash
units finer than the block, at the prompt's last hash boundary. With the other policies chunks
the budget cuts end on multiples of the state groups' block size; ``align_every_block`` also
stops a prefill at the last block boundary of the request's tokens (as hybridkv's ``align`` did
before it followed vLLM 0.33), ``marconi`` at the request's pending branch point
(the allocator's ``next_checkpoint``), where Marconi checkpoints a shared prefix's state,
``periodic`` / ``hash_boundary`` at their next kept position when the backend cannot export
states from inside a prefill (else those states are exported and the prefill is not cut), and
``last``, ``marconi``, ``periodic`` and ``hash_boundary`` at the prompt's last hash boundary, so
that a request whose answer is too short to reach the next one still leaves an end state.

**Speed.** Most steps are decode steps in which most requests only take the allocator's fast
path (no new block, no cache or checkpoint work), which changes nothing but a counter. So a
decoding request is *parked*: the simulator asks the allocator how many tokens it can add on the
fast path, and touches the request again only at the step where it leaves the fast path (a block
boundary, a checkpoint position) or finishes; in between its tokens are given to the allocator in
one call when it is next touched. Steps in which no request needs attention, nothing is waiting
to be admitted and nothing arrives are priced and counted in a tight loop. The allocator sees the
same calls that change its state, in the same order, as with one call per token and step, so the
results are the same (``SimConfig(fast_decode=False)`` touches every request every step; the
tests compare the two).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm  # a text bar: in a notebook tqdm.auto would want ipywidgets

from .alloc import RECOVERY_POLICIES, HybridAllocator, MemoryBreakdown, PoolExhausted
from .alloc.breakdown import breakdown_table
from .costmodel import GPU, H100_SXM, StepCoster
from .models.model import HybridModel
from .plan import MemoryPlan
from .traces import Trace


@dataclass(frozen=True)
class SimConfig:
    """Scheduler and cache options (vLLM's names where they exist).

    ``hash_block_size`` is vLLM's ``prefix_match_unit`` (vLLM's default is the block size, which
    turns hits inside a block off). ``prefix_cache_retention_interval`` and
    ``prefill_checkpoint_alignment`` apply to the ``align`` policy (see
    :class:`hybridkv.alloc.HybridAllocator`); the latter is ``None`` for state layers whose
    prefill cannot export a checkpoint (vLLM 0.32's Gated DeltaNet, or any GPU without
    FlashInfer's GDN prefill), 1 for Mamba-2, and for vLLM 0.33's Gated DeltaNet under
    FlashInfer the block size (``lcm(hash_block_size, 64)`` with hits inside a block); the
    default ``"auto"`` takes it from the plan's vLLM target. ``checkpoint_interval`` is where the
    ``periodic`` and ``hash_boundary`` policies keep states inside a prompt (exported from inside
    the prefill when the alignment divides it, else prefill chunks end there).

    Memory is sampled every ``sample_every`` steps; once ``max_samples`` samples are taken the
    interval doubles (every other sample is dropped), so long runs keep at most that many. Every
    ``breakdown_every``-th sample also records the pool's full byte breakdown
    (:func:`hybridkv.alloc.memory_breakdown`: live, cached and reachable or not, owned but
    empty, padding, free; one pass over the cache index, hence not every sample; 0: never)."""

    max_num_batched_tokens: int = 8192
    hash_block_size: int = 16
    checkpoint_policy: str = "align"
    enable_prefix_caching: bool = True
    gpu: GPU = H100_SXM
    max_model_len: int = 1 << 20
    sample_every: int = 16  # steps between memory samples
    max_samples: int = 512
    breakdown_every: int = 8
    fast_decode: bool = True  # park decoding requests between allocator events (same results)
    prefix_cache_retention_interval: int | None = 0
    prefill_checkpoint_alignment: int | str | None = "auto"
    checkpoint_interval: int | None = None  # periodic / hash_boundary (default 512)


@dataclass(frozen=True)
class SimResult:
    """What a replay measured. Token counts are over finished requests' first admission.

    ``saved_flops``: prefill FLOPs (one rank) of the prompt tokens served from the prefix cache,
    :func:`hybridkv.costmodel.prefill_flops` of each admission's hit. ``sample_t_s``: the
    simulated time of each memory sample. ``checkpoints``: state checkpoints cached over the
    run (at one position, in every state group), ``checkpoint_bytes`` the pages they took (a
    checkpoint lives until evicted, so this is memory *churn*; ``state_bytes`` is what is
    held)."""

    layout: str
    num_requests: int
    finished: int
    prompt_tokens: int
    hit_tokens: int
    shared_tokens: int
    preemptions: int
    peak_running: int
    steps: int
    sim_time_s: float
    ttft_s: np.ndarray
    output_tokens: int
    kv_bytes: np.ndarray  # sampled bytes held by attention groups (in use or cached)
    state_bytes: np.ndarray  # sampled bytes held by state groups
    padding_bytes: int
    memory_bytes: int
    saved_flops: float = 0.0
    sample_t_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    checkpoints: int = 0  # state checkpoints cached (every state group at one position)
    checkpoint_bytes: int = 0  # the state memory those checkpoints were given, in total
    #: where the pool's bytes were (:class:`~hybridkv.alloc.MemoryBreakdown`), every
    #: ``breakdown_every`` memory samples, at the times in ``breakdown_t_s``
    breakdown: tuple[MemoryBreakdown, ...] = ()
    breakdown_t_s: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def breakdown_mean(self) -> dict[str, float]:
        """Mean bytes per breakdown field over the run's breakdown samples."""
        return breakdown_table(list(self.breakdown))

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / max(1, self.prompt_tokens)

    @property
    def throughput_tok_s(self) -> float:
        return self.output_tokens / max(1e-12, self.sim_time_s)

    def summary(self) -> dict[str, float | int | str]:
        ttft = self.ttft_s
        return {
            "layout": self.layout,
            "finished": self.finished,
            "token_hit_rate": round(self.token_hit_rate, 4),
            "compute_saved_tokens": self.hit_tokens,
            "compute_saved_pflop": round(self.saved_flops / 1e15, 3),
            "preemptions": self.preemptions,
            "peak_running": self.peak_running,
            "ttft_p50_ms": round(1e3 * float(np.median(ttft)), 3) if ttft.size else 0.0,
            "ttft_p90_ms": round(1e3 * float(np.quantile(ttft, 0.9)), 3) if ttft.size else 0.0,
            "throughput_tok_s": round(self.throughput_tok_s, 1),
            "padding_bytes": self.padding_bytes,
            "checkpoints": self.checkpoints,
            "checkpoint_gib": round(self.checkpoint_bytes / 2**30, 3),
            "state_gib_mean": round(float(self.state_bytes.mean()) / 2**30, 3)
            if self.state_bytes.size
            else 0.0,
            "kv_gib_mean": round(float(self.kv_bytes.mean()) / 2**30, 3)
            if self.kv_bytes.size
            else 0.0,
            **{
                f"{k}_gib_mean": round(v / 2**30, 3)
                for k, v in self.breakdown_mean().items()
                if k in ("reachable", "unreachable", "owned_empty", "free") and self.breakdown
            },
        }


class _Live:
    """A request the scheduler knows about (waiting or running).

    A parked decoder has ``s0``/``n0``: at the start of step ``s0`` the allocator held ``n0`` of
    its tokens and ``generated`` was current; at step ``s >= s0`` it decodes with context
    ``n0 + (s - s0) + 1``, all on the allocator's fast path, until its event step."""

    __slots__ = (
        "arrival",
        "counted",
        "decoding",
        "first_token_s",
        "generated",
        "n0",
        "order",
        "output_len",
        "parked",
        "prompt_len",
        "req",
        "rid",
        "running",
        "s0",
        "ver",
    )

    def __init__(self, req, arrival: float) -> None:
        self.req = req
        self.rid = req.request_id
        self.prompt_len = len(req.prompt)
        self.output_len = int(req.output_length)
        self.arrival = arrival
        self.order = 0  # admission order: the running list is sorted by it
        self.generated = 0
        self.first_token_s: float | None = None
        self.counted = False
        self.running = False
        self.decoding = False  # its prompt (and outputs so far) have slots; it decodes
        self.parked = False
        self.s0 = self.n0 = 0
        self.ver = 0  # bumped to invalidate its entries in the event heap

    @property
    def num_tokens(self) -> int:
        """Prompt plus the outputs generated so far (what a re-admission prefills)."""
        return self.prompt_len + self.generated

    def tokens(self) -> list[int]:
        return self.req.prompt.tolist() + [_output_id(self.req, i) for i in range(self.generated)]


def _output_id(req, i: int) -> int:
    """The ``i``-th generated token (0-based): the trace's when known, else an id no prompt
    contains, unique per request."""
    if req.output_ids is not None and i < len(req.output_ids):
        return int(req.output_ids[i])
    return 1_000_000_000 + req.request_id * 65_536 + i


def _headroom(alloc: HybridAllocator, rid: int) -> int:
    """Tokens ``allocate_slots`` can add to ``rid`` on its fast path (no block, cache or
    checkpoint work)."""
    return alloc.fast_path_tokens(rid)


def simulate(
    plan: MemoryPlan,
    model: HybridModel,
    trace: Trace,
    config: SimConfig | None = None,
    *,
    progress: bool = False,
) -> SimResult:
    """Replay ``trace`` on ``plan`` (made for ``model``) and measure it."""
    config = config or SimConfig()
    coster = StepCoster(model, config.gpu)
    alloc = HybridAllocator(
        plan,
        enable_prefix_caching=config.enable_prefix_caching,
        hash_block_size=config.hash_block_size,
        checkpoint_policy=config.checkpoint_policy,
        max_model_len=config.max_model_len,
        prefix_cache_retention_interval=config.prefix_cache_retention_interval,
        prefill_checkpoint_alignment=config.prefill_checkpoint_alignment,
        checkpoint_interval=config.checkpoint_interval,
        # marconi weighs the FLOPs a state saves by the same cost model as the clock
        marconi_flops=coster.prefill_flops,
    )
    windows = bool(coster.windows)  # sliding-window layers: decode cost needs every context
    fast = config.fast_decode
    align = math.lcm(*(g.block_size for g in plan.state_groups)) if plan.state_groups else 1
    caching = config.enable_prefix_caching and bool(plan.state_groups)
    vllm_split = caching and config.checkpoint_policy == "align"
    stop_last_block = caching and config.checkpoint_policy == "align_every_block"
    # marconi's branch points; periodic / hash_boundary positions when not exported
    stop_next = caching and config.checkpoint_policy in ("last", "marconi", *RECOVERY_POLICIES)
    max_seqs = plan.config.max_num_seqs
    max_prefill = config.max_num_batched_tokens
    reqs = trace.requests
    finish_time: dict[int, float] = {}
    children: dict[int, list[int]] = {}
    roots: list[tuple[float, int]] = []
    for r in reqs:
        if r.parent_id >= 0:
            children.setdefault(r.parent_id, []).append(r.request_id)
        else:
            roots.append((r.arrival_s, r.request_id))
    roots.sort()
    # (time it may arrive, insertion number, request id): ties leave in insertion order
    ready: list[tuple[float, int, int]] = [(a, i, rid) for i, (a, rid) in enumerate(roots)]
    pushed = len(ready)
    waiting: deque[_Live] = deque()
    running: list[_Live] = []  # by admission order
    prefilling: list[_Live] = []  # running requests not decoding, by admission order
    parked: dict[int, _Live] = {}  # order -> parked decoder (for sliding-window contexts)
    events: list[tuple[int, int, int, _Live]] = []  # heap: (event step, order, ver, live)
    n_parked = 0  # parked decoders, and the sum of their n0 - s0
    base = 0
    t = 0.0
    steps = preemptions = peak = order = output_tokens = 0
    prompt_tokens = hit_tokens = shared_tokens = 0
    saved_flops = 0.0
    blocked = False  # the head of `waiting` failed to be admitted and nothing changed since
    ttft: list[float] = []
    samples: list[tuple[int, float, int, int]] = []  # (step, time, kv bytes, state bytes)
    breakdowns: list[tuple[int, float, MemoryBreakdown]] = []
    every = max(0, config.breakdown_every)
    stride = max(1, config.sample_every)
    held: tuple[int, int] | None = None  # memory held, while known not to have changed
    bar = tqdm(total=len(reqs), disable=not progress, desc=f"simulate {plan.layout}")

    def park(live: _Live, s: int) -> None:
        """``live`` decodes from step ``s`` on; schedule the step it needs attention."""
        nonlocal n_parked, base
        live.decoding = live.parked = True
        live.s0, live.n0 = s, alloc.num_tokens(live.rid)
        room = _headroom(alloc, live.rid) if fast else 0
        live.ver += 1
        heapq.heappush(
            events,
            (s + min(room, live.output_len - live.generated - 1), live.order, live.ver, live),
        )
        n_parked += 1
        base += live.n0 - s
        parked[live.order] = live

    def unpark(live: _Live) -> None:
        nonlocal n_parked, base
        live.parked = False
        live.ver += 1
        n_parked -= 1
        base -= live.n0 - live.s0
        del parked[live.order]

    def catch_up(live: _Live, s: int) -> None:
        """Give the allocator a decoder's fast-path tokens up to the start of step ``s``."""
        lag = s - live.s0
        if lag > 0:
            if not alloc.allocate_slots(live.rid, lag):  # pragma: no cover - allocator changed
                raise RuntimeError("the allocator refused tokens it promised on its fast path")
            g = live.generated
            alloc.append_tokens(live.rid, [_output_id(live.req, i) for i in range(g, g + lag)])
            live.generated = g + lag
            live.n0 += lag
            live.s0 = s

    def decode_cost(s: int, n: int, extra: list[int]) -> float:
        """One decode step ``s``: the parked decoders plus ``extra`` contexts."""
        total = base + n_parked * (s + 1) + sum(extra)
        ctx = None
        if windows:
            ctx = [x.n0 + (s - x.s0) + 1 for x in parked.values()] + extra
        return coster.decode_s(n, total, ctx)

    def preempt_one(s: int) -> bool:
        nonlocal preemptions
        if len(running) <= 1:
            return False
        victim = running.pop()  # the most recently admitted
        victim.running = False
        if victim.parked:
            unpark(victim)
        if victim.decoding:
            catch_up(victim, s)  # it has not had its turn in step s yet
            victim.decoding = False
        else:
            prefilling.remove(victim)
        alloc.free(victim.rid)
        waiting.appendleft(victim)
        preemptions += 1
        return True

    def finish(live: _Live) -> None:
        nonlocal pushed
        running.remove(live)
        live.running = live.decoding = False
        alloc.free(live.rid)
        finish_time[live.rid] = t
        bar.update(1)
        for child in children.get(live.rid, ()):
            c = reqs[child]
            heapq.heappush(ready, (max(c.arrival_s, t + c.think_time_s), pushed, child))
            pushed += 1

    def chunk_of(live: _Live, done: int, budget: int) -> int:
        """Prefill tokens of ``live`` this step, ``done`` already having slots."""
        remaining = live.num_tokens - done
        if vllm_split:
            return alloc.split_prefill(live.rid, min(remaining, budget), max_prefill)
        if stop_last_block:
            # a prefill that would cross the last block boundary of the request's tokens stops
            # there first, so that boundary's state is kept (budget cuts already end on blocks)
            stop = live.num_tokens // align * align
        else:
            stop = (alloc.next_checkpoint(live.rid) or 0) if stop_next else 0
        return _chunk(remaining, budget, done, align, stop)

    def sample() -> None:
        nonlocal held, stride
        if held is None:
            held = _held_bytes(alloc, plan)
        samples.append((steps, t, *held))
        if every and steps % (stride * every) == 0:
            breakdowns.append((steps, t, alloc.memory_breakdown()))
        if len(samples) >= config.max_samples:
            stride *= 2
            samples[:] = [x for x in samples if x[0] % stride == 0]
            breakdowns[:] = [x for x in breakdowns if x[0] % (stride * every) == 0]

    while ready or waiting or running:
        while ready and ready[0][0] <= t:
            arrive, _, rid = heapq.heappop(ready)
            waiting.append(_Live(reqs[rid], arrive))
        if not running and not waiting:
            t = max(t, ready[0][0])
            continue
        while events and events[0][2] != events[0][3].ver:
            heapq.heappop(events)  # stale: preempted or re-parked
        # 0. a run of steps in which only parked decoders work: price and count them
        if (
            n_parked
            and not prefilling
            and (not waiting or blocked or len(running) >= max_seqs)
            and events[0][0] > steps
        ):
            stop = events[0][0]
            arrival = ready[0][0] if ready else math.inf
            while steps < stop and t < arrival:
                t += decode_cost(steps, n_parked, [])
                steps += 1
                output_tokens += n_parked
                if steps % stride == 0:
                    sample()
            continue
        s = steps
        held = None
        blocked = False
        budget = config.max_num_batched_tokens
        # 1. decode: parked decoders take their token on the fast path; those whose event is
        # this step are touched in admission order (a failed allocation preempts)
        due: list[_Live] = []
        while events and events[0][0] <= s:
            _, _, ver, live = heapq.heappop(events)
            if ver == live.ver:
                unpark(live)
                due.append(live)
        decoded: list[_Live] = []
        extra: list[int] = []
        for live in due:
            if not live.running:
                continue  # preempted by an earlier one this step
            catch_up(live, s)
            while not alloc.allocate_slots(live.rid, 1):
                if not preempt_one(s) or not live.running:
                    break
            if not live.running:
                continue
            if alloc.num_tokens(live.rid) < live.num_tokens:  # no memory: retry as a prefill
                live.decoding = False
                _insort(prefilling, live)
                continue
            decoded.append(live)
            extra.append(live.num_tokens)
            budget -= 1
        budget -= n_parked
        # 2. prefill chunks of running requests, then admissions
        prefill_work: list[tuple[int, int]] = []  # (new tokens, cached tokens)
        admitted = False
        for live in list(prefilling):
            if budget <= 0:
                break
            done = alloc.num_tokens(live.rid)
            if done >= live.num_tokens:
                continue
            chunk = chunk_of(live, done, budget)
            if chunk and alloc.allocate_slots(live.rid, chunk):
                prefill_work.append((chunk, done))
                budget -= chunk
        while waiting and budget > 0 and len(running) < max_seqs:
            live = waiting[0]
            try:
                hit = alloc.add_request(live.rid, live.tokens(), num_prompt_tokens=live.prompt_len)
            except PoolExhausted:
                blocked = True
                break
            waiting.popleft()
            admitted = True
            order += 1
            live.order = order
            if not live.counted:
                live.counted = True
                got = min(hit.num_cached_tokens, live.prompt_len)
                prompt_tokens += live.prompt_len
                hit_tokens += got
                if got:
                    saved_flops += coster.prefill_flops(got)
                shared_tokens += live.req.shared_prefix_length or 0
            live.running = True
            running.append(live)
            prefilling.append(live)
            done = hit.num_cached_tokens
            chunk = chunk_of(live, done, budget)
            if chunk and alloc.allocate_slots(live.rid, chunk):
                prefill_work.append((chunk, done))
                budget -= chunk
        peak = max(peak, len(running))
        batch = n_parked + len(decoded)
        if not batch and not prefill_work:
            if running and not preempt_one(s):
                raise RuntimeError(
                    f"request {running[0].rid} ({running[0].num_tokens:,} tokens) cannot fit in "
                    "the plan's memory even alone; give the plan more memory (--gpu-memory) "
                    "or leave such long requests out of the trace"
                )
            if not running and waiting and not ready:
                raise RuntimeError(
                    "a waiting request can never be admitted: the plan is too small"
                )
            if not running:
                t = ready[0][0] if ready else t
            continue
        # 3. advance time by the step's roofline cost
        dt_s = 0.0
        for n, c in prefill_work:
            dt_s += coster.prefill_s(n, c)
        if batch:
            dt_s += decode_cost(s, batch, extra)
        t += dt_s
        steps += 1
        output_tokens += n_parked
        alloc.take_state_copies()
        alloc.take_events()
        if decoded or prefill_work or admitted:
            blocked = False  # the pools may have changed since the failed admission
        # 4. tokens produced: requests that decoded or finished their prompt, in admission order
        touched = sorted(decoded + prefilling, key=_by_order) if prefilling else decoded
        for live in touched:
            if not live.decoding:
                if alloc.num_tokens(live.rid) < live.num_tokens:
                    continue  # still prefilling
                prefilling.remove(live)
                if live.first_token_s is None:
                    live.first_token_s = t
                    ttft.append(t - live.arrival)
            live.generated += 1
            output_tokens += 1
            if live.generated >= live.output_len:
                blocked = False
                finish(live)
                continue
            alloc.append_tokens(live.rid, [_output_id(live.req, live.generated - 1)])
            park(live, s + 1)
        if steps % stride == 0:
            sample()
    bar.close()
    return SimResult(
        layout=plan.layout,
        num_requests=len(reqs),
        finished=len(finish_time),
        prompt_tokens=prompt_tokens,
        hit_tokens=hit_tokens,
        shared_tokens=shared_tokens,
        preemptions=preemptions,
        peak_running=peak,
        steps=steps,
        sim_time_s=t,
        ttft_s=np.asarray(ttft),
        output_tokens=output_tokens,
        kv_bytes=np.asarray([x[2] for x in samples], dtype=np.int64),
        state_bytes=np.asarray([x[3] for x in samples], dtype=np.int64),
        padding_bytes=plan.capacity.padding_bytes,
        memory_bytes=plan.config.memory_bytes,
        saved_flops=saved_flops,
        sample_t_s=np.asarray([x[1] for x in samples], dtype=np.float64),
        breakdown=tuple(x[2] for x in breakdowns),
        breakdown_t_s=np.asarray([x[1] for x in breakdowns], dtype=np.float64),
        checkpoints=alloc.num_checkpoints,
        checkpoint_bytes=alloc.num_checkpoint_ids * _state_id_bytes(plan),
    )


def _by_order(live: _Live) -> int:
    return live.order


def _insort(lives: list[_Live], live: _Live) -> None:
    i = len(lives)
    while i > 0 and lives[i - 1].order > live.order:
        i -= 1
    lives.insert(i, live)


def _chunk(remaining: int, budget: int, done: int, align: int, stop: int = 0) -> int:
    """Prefill tokens this step: all that fit; a partial chunk ends on a checkpoint boundary;
    a chunk that would cross ``stop`` ends there."""
    n = remaining if remaining <= budget else max(0, (done + budget) // align * align - done)
    if done < stop < done + n:
        n = stop - done
    return n


def _state_id_bytes(plan: MemoryPlan) -> int:
    """Bytes one state id takes, averaged over the state groups (equal in every layout but
    ``per_group`` with mixed state kinds)."""
    sizes = [plan.id_bytes(g.group_id) for g in plan.state_groups]
    return sum(sizes) // len(sizes) if sizes else 0


def _held_bytes(alloc: HybridAllocator, plan: MemoryPlan) -> tuple[int, int]:
    """Bytes held (by running requests or as cache) by attention groups and by state groups;
    see :meth:`HybridAllocator.ids_in_use` for what an id counts."""
    count = alloc.ids_in_use()
    kv = state = 0
    for g in plan.groups:
        size = plan.id_bytes(g.group_id)
        if g.is_state:
            state += count[g.group_id] * size
        else:
            kv += count[g.group_id] * size
    return kv, state
