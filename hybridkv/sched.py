"""One continuous-batching scheduler for the simulator and the engine (vLLM's shape).

Each :meth:`Scheduler.schedule` builds one step:

1. **decode first**: every running request that has its prompt computed gets one token
   (``allocate_slots(rid, 1)``);
2. **chunked prefill**: running requests still in their prompt continue, oldest first, under a
   token budget (``max_num_batched_tokens``, and at most ``long_prefill_token_threshold`` per
   request): a chunk the budget cuts ends on a multiple of the plan's checkpoint granularity
   (where that is wider than the per-request limit, a prompt advances by chunks of the limit
   between multiples, as vLLM 0.33 does), and where a chunk ends is also the checkpoint policy's
   rule (below);
3. **admission**: waiting requests, first in first out, while the budget, ``max_num_seqs`` and
   memory allow, and only in a step that preempted nobody (as vLLM). An admitted request starts
   at its prefix hit (``add_request``); one whose first chunk does not fit stays waiting.

When a running request cannot get its slots, the most recently admitted running request is
preempted (possibly itself): its memory is freed and it goes back to the front of the queue, to be
recomputed from its prompt and the tokens it generated so far.

**Chunk ends per checkpoint policy** (a state is kept only where a step ends): ``align`` asks the
allocator (``split_prefill``: vLLM 0.33's ``_mamba_block_aligned_split``); ``align_every_block``
stops a prefill at the last block boundary of the request's tokens; ``last``, ``marconi``,
``periodic`` and ``hash_boundary`` stop at the allocator's ``next_checkpoint`` (the prompt's last
hash boundary, Marconi's branch point, the next kept position when the backend cannot export
states from inside a prefill).

**Executors.** The scheduler decides; an executor runs a step (:class:`Executor`): the roofline
clock of :mod:`hybridkv.sim` prices it, the model runner of :mod:`hybridkv.e2e.engine` runs the
model. Both see the same :class:`StepOutput` and the allocator sees the same calls, so a trace
gets the same schedule from both (``tests/test_sched.py``).

**Parked decoders** (``SchedulerConfig.park_decoders``, for executors that know every request's
output tokens in advance, :attr:`Seq.script`): most decode steps only take the allocator's fast
path for most requests (no new block, no cache or checkpoint work). A parked decoder is touched
again only at the step where it leaves the fast path (``fast_path_tokens``) or finishes; the
tokens in between go to the allocator in one call when it is next touched. A step in which only
parked decoders work is *quiet* (:attr:`StepOutput.quiet`): no allocator call at all. The
allocator sees the same calls that change its state, in the same order, as without parking, so
the schedule is the same.
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .alloc import HitInfo, HybridAllocator, PoolExhausted

__all__ = ["Executor", "Scheduler", "SchedulerConfig", "Seq", "StepOutput"]


@dataclass(frozen=True)
class SchedulerConfig:
    """vLLM's scheduler knobs. ``long_prefill_token_threshold``: the most prompt tokens one
    request runs per step (0: only the step's budget limits it). ``park_decoders``: see the
    module docstring; every request then needs a :attr:`Seq.script`."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    park_decoders: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0: no per-request limit), got "
                f"{self.long_prefill_token_threshold}"
            )


class Seq:
    """A request the scheduler knows about (waiting, running or finished).

    ``prompt`` is any sequence of token ids (a list, a numpy array); ``outputs`` the tokens
    generated so far (a parked decoder's lag behind until it is next touched). ``script``, when
    given, lists the output tokens known in advance (the simulator's trace; at least
    ``max_new_tokens`` of them); parking needs it. A list, so that a parked decoder catches up by
    one slice rather than one call per token (millions of tokens per simulation).
    ``hits`` holds the allocator's answer at each admission, ``preempted_at`` the number of
    outputs at each preemption. ``computed``: tokens with slots (computed, or being computed in the
    step just scheduled).

    A parked decoder has ``s0``/``n0``: at the start of step ``s0`` the allocator held ``n0`` of
    its tokens and ``outputs`` was current; at step ``s >= s0`` it decodes with context
    ``n0 + (s - s0) + 1``, all on the allocator's fast path, until its event step."""

    __slots__ = (
        "arrival",
        "computed",
        "decoding",
        "hits",
        "max_new_tokens",
        "n0",
        "order",
        "outputs",
        "parked",
        "preempted_at",
        "prompt",
        "prompt_len",
        "rid",
        "running",
        "s0",
        "scheduled_at",
        "script",
        "ver",
    )

    def __init__(
        self,
        rid: Any,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        arrival: float = 0.0,
        script: list[int] | None = None,
    ) -> None:
        if len(prompt) == 0:
            raise ValueError(f"request {rid!r}: the prompt is empty")
        if max_new_tokens < 1:
            raise ValueError(f"request {rid!r}: max_new_tokens must be >= 1, got {max_new_tokens}")
        self.rid = rid
        self.prompt = prompt
        self.prompt_len = len(prompt)
        self.max_new_tokens = int(max_new_tokens)
        self.arrival = arrival
        if script is not None and len(script) < self.max_new_tokens:
            raise ValueError(
                f"request {rid!r}: its script lists {len(script)} output tokens, fewer than "
                f"max_new_tokens={self.max_new_tokens}"
            )
        self.script = script
        self.outputs: list[int] = []
        self.hits: list[HitInfo] = []
        self.preempted_at: list[int] = []
        self.order = 0  # admission order: the running list is sorted by it
        self.computed = 0
        self.scheduled_at = -1  # the last step its decode slot was allocated in
        self.running = False
        self.decoding = False  # its prompt (and outputs so far) have slots; it decodes
        self.parked = False
        self.s0 = self.n0 = 0
        self.ver = 0  # bumped to invalidate its entries in the event heap

    @property
    def num_tokens(self) -> int:
        """Prompt plus the outputs generated so far (what a re-admission prefills)."""
        return self.prompt_len + len(self.outputs)

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.max_new_tokens

    def tokens(self) -> list[int]:
        prompt = self.prompt.tolist() if hasattr(self.prompt, "tolist") else list(self.prompt)
        return prompt + self.outputs

    def token_array(self) -> array:
        """:meth:`tokens` as the C int32 array the allocator keeps (what an admission passes
        it): a NumPy prompt goes over as bytes, not as a Python int per token."""
        prompt = self.prompt
        if isinstance(prompt, np.ndarray) and prompt.dtype == np.intc:  # a trace's prompt
            out = array("i")
            out.frombytes(prompt.tobytes())
        else:  # ids past int32 raise here, as in the allocator
            out = array("i", prompt.tolist() if isinstance(prompt, np.ndarray) else prompt)
        out.extend(self.outputs)
        return out

    def token_range(self, start: int, stop: int) -> list[int]:
        """``tokens()[start:stop]`` without building the whole list (a decode step reads one)."""
        n = self.prompt_len
        head = [int(t) for t in self.prompt[start:stop]] if start < n else []
        return head + self.outputs[max(0, start - n) : max(0, stop - n)]

    def __repr__(self) -> str:
        return f"Seq({self.rid!r}, {self.num_tokens} tokens, {len(self.outputs)} generated)"


@dataclass
class StepOutput:
    """One scheduled step. ``decode``: decoders touched this step (one token each; parked
    decoders also decode, ``num_parked`` of them, without being listed). ``prefill``:
    ``(seq, start, num_new)`` chunks. ``admitted``: admitted this step (``seq.hits[-1]`` is the
    hit; the runner restores its state before the forward). ``sampling``: requests whose step
    produces a token (decoders and prefills reaching their end), in admission order; the executor
    returns one token for each. ``decode_context_total``: the summed context of every decoder;
    ``decode_contexts``: each one's (only with ``Scheduler(contexts=True)``). ``quiet``: only
    parked decoders work. ``finished``: filled by :meth:`Scheduler.step`."""

    step: int
    decode: list[Seq] = field(default_factory=list)
    prefill: list[tuple[Seq, int, int]] = field(default_factory=list)
    admitted: list[Seq] = field(default_factory=list)
    preempted: list[Seq] = field(default_factory=list)
    sampling: list[Seq] = field(default_factory=list)
    num_parked: int = 0
    decode_context_total: int = 0
    decode_contexts: list[int] | None = None
    quiet: bool = False
    finished: list[Seq] = field(default_factory=list)

    @property
    def num_decode(self) -> int:
        return self.num_parked + len(self.decode)

    @property
    def has_work(self) -> bool:
        return bool(self.num_decode or self.prefill)


class Executor(Protocol):
    """Runs what the scheduler decided."""

    def execute(self, out: StepOutput) -> list[int]:
        """Run the step (restore admitted hits, then the forward); the sampled token of each
        ``out.sampling`` request, in order."""
        ...

    def checkpoint(self, copies: list[tuple[int, int, int]]) -> None:
        """After the forward: the allocator's ``(group, src slot, dst slot)`` state copies."""
        ...


class Scheduler:
    """Schedules :class:`Seq` requests over ``alloc``; see the module docstring.

    ``contexts``: fill :attr:`StepOutput.decode_contexts` (an executor pricing sliding-window
    layers needs each decoder's context, not just their sum)."""

    def __init__(
        self, alloc: HybridAllocator, config: SchedulerConfig, *, contexts: bool = False
    ) -> None:
        self.alloc = alloc
        self.config = config
        self.contexts = contexts
        #: tokens between positions where a state can be kept; a budget narrower than it
        #: advances a prompt by sub-block chunks between them (``prefill_chunk``)
        self.align = alloc.plan.checkpoint_granularity
        # the most prompt tokens of one request a step may run (vLLM's max_prefill_tokens in
        # _mamba_block_aligned_split)
        self.max_prefill_tokens = config.max_num_batched_tokens
        if config.long_prefill_token_threshold:
            self.max_prefill_tokens = min(
                self.max_prefill_tokens, config.long_prefill_token_threshold
            )
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []  # by admission order
        self.prefilling: list[Seq] = []  # running requests not decoding, by admission order
        self.parked: dict[int, Seq] = {}  # order -> parked decoder
        self._events: list[tuple[int, int, int, Seq]] = []  # heap: (event step, order, ver, seq)
        self.n_parked = 0
        self._base = 0  # sum of n0 - s0 over parked decoders
        self.step_index = 0
        self._order = 0
        # the head of `waiting` failed to be admitted for memory and nothing changed since
        self.blocked = False
        self.num_preemptions = 0

    # ---- queue ------------------------------------------------------------------------------
    def add(self, seq: Seq) -> None:
        if self.config.park_decoders and seq.script is None:
            raise ValueError(
                f"request {seq.rid!r} has no script of its outputs; parking decoders needs them "
                "(SchedulerConfig(park_decoders=False) otherwise)"
            )
        # a blocked head of the queue blocks those behind it too: `blocked` stands
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stuck_message(self) -> str:
        """Why a step that scheduled nothing cannot be followed by one that does."""
        if self.running:
            seq = self.running[0]
            return f"request {seq.rid!r} is running but could not be given a token"
        seq = self.waiting[0]
        return (
            f"request {seq.rid!r} ({seq.num_tokens:,} tokens) cannot fit in the plan's memory "
            "even alone; give the plan more memory (--gpu-memory) or leave such long requests "
            "out of the trace"
        )

    # ---- one step ---------------------------------------------------------------------------
    def step(self, executor: Executor) -> StepOutput:
        """Schedule one step, run it on ``executor``, commit it; the step's output."""
        out = self.schedule()
        tokens = executor.execute(out) if out.has_work else []
        if not out.quiet:
            copies = self.alloc.take_state_copies()
            self.alloc.take_events()
            if copies:
                executor.checkpoint(copies)
        self.update(out, tokens)
        return out

    def schedule(self) -> StepOutput:
        s = self.step_index
        events = self._events
        while events and events[0][2] != events[0][3].ver:
            heapq.heappop(events)  # stale: preempted or re-parked
        if (
            self.n_parked
            and not self.prefilling
            and (not self.waiting or self.blocked or len(self.running) >= self.config.max_num_seqs)
            and events[0][0] > s
        ):
            return self._decode_out(StepOutput(step=s, quiet=True, num_parked=self.n_parked), [])
        self.blocked = False
        out = StepOutput(step=s)
        budget = self.config.max_num_batched_tokens
        # 1. decode: decoders whose event is this step, in admission order
        due: list[Seq] = []
        while events and events[0][0] <= s:
            _, _, ver, seq = heapq.heappop(events)
            if ver == seq.ver:
                self._unpark(seq)
                due.append(seq)
        extra: list[int] = []
        for seq in due:
            if not seq.running:
                continue  # preempted by an earlier one this step
            self._catch_up(seq, s)
            if not self._allocate(seq, 1, out):
                continue
            seq.computed += 1
            seq.scheduled_at = s
            out.decode.append(seq)
            extra.append(seq.num_tokens)
            budget -= 1
        budget -= self.n_parked
        out.num_parked = self.n_parked
        # 2. prefill chunks of running requests
        for seq in list(self.prefilling):
            if budget <= 0:
                break
            if not seq.running:
                continue
            done = self.alloc.num_tokens(seq.rid)
            chunk = self._chunk(seq, done, budget)
            if chunk and self._allocate(seq, chunk, out):
                seq.computed = done + chunk
                out.prefill.append((seq, done, chunk))
                budget -= chunk
        # 3. admissions, in a step that preempted nobody
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            try:
                hit = self.alloc.add_request(
                    seq.rid, seq.token_array(), num_prompt_tokens=seq.prompt_len
                )
            except PoolExhausted:
                self.blocked = True
                break
            done = hit.num_cached_tokens
            chunk = self._chunk(seq, done, budget)
            if not chunk:
                self.alloc.free(seq.rid)  # the budget left is too small: next step
                break
            if not self.alloc.allocate_slots(seq.rid, chunk):
                self.alloc.free(seq.rid)  # stays waiting; its hit was never used
                self.blocked = True
                break
            self.waiting.popleft()
            self._order += 1
            seq.order = self._order
            seq.running = True
            seq.hits.append(hit)
            seq.computed = done + chunk
            self.running.append(seq)
            self.prefilling.append(seq)
            out.admitted.append(seq)
            out.prefill.append((seq, done, chunk))
            budget -= chunk
        if out.decode or out.prefill:
            self.blocked = False  # the pools may have changed since the failed admission
        # what this step samples: decoders and prefills that reach the end of their tokens
        ends = [seq for seq, start, n in out.prefill if start + n >= seq.num_tokens]
        out.sampling = sorted(out.decode + ends, key=_by_order) if ends else out.decode
        return self._decode_out(out, extra)

    def _decode_out(self, out: StepOutput, extra: list[int]) -> StepOutput:
        s = out.step
        out.decode_context_total = self._base + self.n_parked * (s + 1) + sum(extra)
        if self.contexts:
            out.decode_contexts = [x.n0 + (s - x.s0) + 1 for x in self.parked.values()] + extra
        return out

    def update(self, out: StepOutput, tokens: list[int]) -> None:
        """The step ran: hand its sampled ``tokens`` (one per ``out.sampling``) to the requests;
        finished ones leave (``out.finished``), the others decode from the next step."""
        self.step_index += 1
        if out.quiet:
            return
        if len(tokens) != len(out.sampling):
            raise ValueError(
                f"the executor returned {len(tokens)} tokens for {len(out.sampling)} requests"
            )
        s = out.step
        for seq, token in zip(out.sampling, tokens):
            if not seq.decoding:
                self.prefilling.remove(seq)
            seq.outputs.append(int(token))
            if seq.done:
                self._finish(seq)
                out.finished.append(seq)
                self.blocked = False
                continue
            self.alloc.append_tokens(seq.rid, [int(token)])
            self._park(seq, s + 1)

    # ---- pieces -----------------------------------------------------------------------------
    def _chunk(self, seq: Seq, done: int, budget: int) -> int:
        """Prefill tokens of ``seq`` this step, ``done`` already having slots: what the budget
        allows, cut where the checkpoint policy says (a chunk the budget cuts ends on the
        checkpoint granularity; where the policy wants a state, the chunk ends there:
        :meth:`HybridAllocator.prefill_chunk <hybridkv.alloc.HybridAllocator.prefill_chunk>`)."""
        limit = self.max_prefill_tokens
        offered = min(seq.num_tokens - done, budget, limit)
        return self.alloc.prefill_chunk(seq.rid, offered, limit)

    def _allocate(self, seq: Seq, n: int, out: StepOutput) -> bool:
        """Slots for ``n`` more tokens of running ``seq``, preempting the newest running request
        while they do not fit; False if ``seq`` itself was preempted, or if the newest is a
        decoder already given its slot this step (decode comes first: a prefill waits for
        memory rather than undo a decode the step already holds)."""
        while not self.alloc.allocate_slots(seq.rid, n):
            victim = self.running[-1]
            if victim.scheduled_at == out.step:
                return False
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Seq, out: StepOutput) -> None:
        self.running.pop()
        seq.running = False
        if seq.parked:
            self._unpark(seq)
        if seq.decoding:
            self._catch_up(seq, out.step)  # it has not had its turn in this step yet
            seq.decoding = False
        else:
            self.prefilling.remove(seq)
        self.alloc.free(seq.rid)
        seq.computed = 0
        seq.preempted_at.append(len(seq.outputs))
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def _finish(self, seq: Seq) -> None:
        self.running.remove(seq)
        seq.running = seq.decoding = False
        self.alloc.free(seq.rid)

    def _park(self, seq: Seq, s: int) -> None:
        """``seq`` decodes from step ``s`` on; schedule the step it needs attention."""
        seq.decoding = seq.parked = True
        seq.s0, seq.n0 = s, self.alloc.num_tokens(seq.rid)
        room = self.alloc.fast_path_tokens(seq.rid) if self.config.park_decoders else 0
        seq.ver += 1
        event = s + min(room, seq.max_new_tokens - len(seq.outputs) - 1)
        heapq.heappush(self._events, (event, seq.order, seq.ver, seq))
        self.n_parked += 1
        self._base += seq.n0 - s
        self.parked[seq.order] = seq

    def _unpark(self, seq: Seq) -> None:
        seq.parked = False
        seq.ver += 1
        self.n_parked -= 1
        self._base -= seq.n0 - seq.s0
        del self.parked[seq.order]

    def _catch_up(self, seq: Seq, s: int) -> None:
        """Give the allocator a parked decoder's fast-path tokens up to the start of step
        ``s``."""
        lag = s - seq.s0
        if lag > 0:
            if not self.alloc.allocate_slots(seq.rid, lag):  # pragma: no cover - allocator bug
                raise RuntimeError("the allocator refused tokens it promised on its fast path")
            g = len(seq.outputs)
            new = seq.script[g : g + lag]  # type: ignore[index]
            self.alloc.append_tokens(seq.rid, new)
            seq.outputs += new
            seq.n0 += lag
            seq.s0 = s
            seq.computed += lag


def _by_order(seq: Seq) -> int:
    return seq.order
