"""Replay a trace against a memory plan with a continuous-batching scheduler model.

The scheduler follows vLLM's shape: each step first gives every running request in decode one
token, then continues chunked prefills, then admits waiting requests while the token budget,
``max_num_seqs`` and memory allow. A request that cannot get a block preempts the most recently
admitted one, which frees everything and starts over later (recompute). Prefix-cache lookups,
state checkpoints and block accounting are done by the real :class:`HybridAllocator` on the plan.
Time advances by the roofline cost of each step (:mod:`hybridkv.costmodel`).

Chunked prefills end on multiples of the state groups' block size, as vLLM's align mode does, so
that checkpoints can be taken there.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from .alloc import HybridAllocator, PoolExhausted
from .costmodel import GPU, H100_SXM, decode_step, prefill
from .models.model import HybridModel
from .plan import MemoryPlan
from .traces import Trace


@dataclass(frozen=True)
class SimConfig:
    """Scheduler and cache options (vLLM's names where they exist)."""

    max_num_batched_tokens: int = 8192
    hash_block_size: int = 16
    checkpoint_policy: str = "align"
    enable_prefix_caching: bool = True
    gpu: GPU = H100_SXM
    max_model_len: int = 1 << 20
    sample_every: int = 16  # steps between memory samples


@dataclass(frozen=True)
class SimResult:
    """What a replay measured. Token counts are over finished requests' first admission."""

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
            "preemptions": self.preemptions,
            "peak_running": self.peak_running,
            "ttft_p50_ms": round(1e3 * float(np.median(ttft)), 3) if ttft.size else 0.0,
            "ttft_p90_ms": round(1e3 * float(np.quantile(ttft, 0.9)), 3) if ttft.size else 0.0,
            "throughput_tok_s": round(self.throughput_tok_s, 1),
            "padding_bytes": self.padding_bytes,
        }


@dataclass
class _Live:
    rid: int
    tokens: list[int]
    prompt_len: int
    output_len: int
    arrival: float
    admitted_order: int
    generated: int = 0
    first_token_s: float | None = None
    hit: int = 0
    counted: bool = False
    outputs: list[int] = field(default_factory=list)


def _output_id(req, i: int) -> int:
    """The ``i``-th generated token (0-based): the trace's when known, else an id no prompt
    contains, unique per request."""
    if req.output_ids is not None and i < len(req.output_ids):
        return int(req.output_ids[i])
    return 1_000_000_000 + req.request_id * 65_536 + i


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
    alloc = HybridAllocator(
        plan,
        enable_prefix_caching=config.enable_prefix_caching,
        hash_block_size=config.hash_block_size,
        checkpoint_policy=config.checkpoint_policy,
        max_model_len=config.max_model_len,
    )
    align = math.lcm(*(g.block_size for g in plan.state_groups)) if plan.state_groups else 1
    max_seqs = plan.config.max_num_seqs
    reqs = trace.requests
    finish_time: dict[int, float] = {}
    ready: list[tuple[float, int]] = []  # (time it may arrive, request id), kept sorted
    children: dict[int, list[int]] = {}
    for r in reqs:
        if r.parent_id >= 0:
            children.setdefault(r.parent_id, []).append(r.request_id)
        else:
            ready.append((r.arrival_s, r.request_id))
    ready.sort()
    ready_q = deque(ready)
    waiting: deque[_Live] = deque()
    running: list[_Live] = []
    t = 0.0
    steps = preemptions = peak = order = output_tokens = 0
    prompt_tokens = hit_tokens = shared_tokens = 0
    ttft: list[float] = []
    kv_samples: list[int] = []
    state_samples: list[int] = []
    bar = tqdm(total=len(reqs), disable=not progress, desc=f"simulate {plan.layout}")

    def preempt_one() -> bool:
        nonlocal preemptions
        if len(running) <= 1:
            return False
        victim = max(running, key=lambda x: x.admitted_order)
        running.remove(victim)
        alloc.free(victim.rid)
        victim.tokens = victim.tokens[: victim.prompt_len] + victim.outputs
        waiting.appendleft(victim)
        preemptions += 1
        return True

    while ready_q or waiting or running:
        while ready_q and ready_q[0][0] <= t:
            _, rid = ready_q.popleft()
            r = reqs[rid]
            waiting.append(
                _Live(
                    rid, [int(x) for x in r.prompt], len(r.prompt), r.output_length, r.arrival_s, 0
                )
            )
        if not running and not waiting:
            t = max(t, ready_q[0][0])
            continue
        budget = config.max_num_batched_tokens
        decode_ctx: list[int] = []
        prefill_work: list[tuple[int, int]] = []  # (new tokens, cached tokens)
        # 1. decode: one token for every request whose prefill is done
        for live in list(running):
            if live not in running or live.first_token_s is None:
                continue  # preempted meanwhile, or still prefilling
            if alloc.num_tokens(live.rid) >= len(live.tokens):
                continue
            while not alloc.allocate_slots(live.rid, 1):
                if not preempt_one() or live not in running:
                    break
            if live not in running or alloc.num_tokens(live.rid) < len(live.tokens):
                continue
            decode_ctx.append(alloc.num_tokens(live.rid))
            budget -= 1
        # 2. prefill chunks of running requests, then admissions
        for live in list(running):
            if budget <= 0:
                break
            done = alloc.num_tokens(live.rid)
            if done >= len(live.tokens):
                continue
            chunk = _chunk(len(live.tokens) - done, budget, done, align)
            if chunk and alloc.allocate_slots(live.rid, chunk):
                prefill_work.append((chunk, done))
                budget -= chunk
        while waiting and budget > 0 and len(running) < max_seqs:
            live = waiting[0]
            try:
                hit = alloc.add_request(live.rid, live.tokens)
            except PoolExhausted:
                break
            waiting.popleft()
            order += 1
            live.admitted_order = order
            if not live.counted:
                live.counted = True
                live.hit = hit.num_cached_tokens
                prompt_tokens += live.prompt_len
                hit_tokens += min(hit.num_cached_tokens, live.prompt_len)
                shared_tokens += reqs[live.rid].shared_prefix_length or 0
            running.append(live)
            done = hit.num_cached_tokens
            chunk = _chunk(len(live.tokens) - done, budget, done, align)
            if chunk and alloc.allocate_slots(live.rid, chunk):
                prefill_work.append((chunk, done))
                budget -= chunk
        peak = max(peak, len(running))
        if not decode_ctx and not prefill_work:
            if running and not preempt_one():
                raise RuntimeError(
                    f"request {running[0].rid} cannot fit in the plan's memory even alone; "
                    f"give the plan more memory or lower max_model_len"
                )
            if not running and waiting and not ready_q:
                raise RuntimeError(
                    "a waiting request can never be admitted: the plan is too small"
                )
            if not running:
                t = ready_q[0][0] if ready_q else t
            continue
        # 3. advance time by the step's roofline cost
        dt_s = sum(prefill(model, config.gpu, n, c).time_s for n, c in prefill_work)
        if decode_ctx:
            dt_s += decode_step(model, config.gpu, decode_ctx).time_s
        t += dt_s
        steps += 1
        alloc.take_state_copies()
        alloc.take_events()
        # 4. tokens produced: requests that finished their prompt or decoded
        for live in list(running):
            if alloc.num_tokens(live.rid) < len(live.tokens):
                continue
            if live.first_token_s is None:
                live.first_token_s = t
                ttft.append(t - live.arrival)
            if live.generated >= live.output_len:
                continue
            live.generated += 1
            output_tokens += 1
            if live.generated >= live.output_len:
                running.remove(live)
                alloc.free(live.rid)
                finish_time[live.rid] = t
                bar.update(1)
                for child in children.get(live.rid, ()):
                    c = reqs[child]
                    _insert(ready_q, (max(c.arrival_s, t + c.think_time_s), child))
                continue
            tok = _output_id(reqs[live.rid], live.generated - 1)
            live.outputs.append(tok)
            live.tokens.append(tok)
            alloc.append_tokens(live.rid, [tok])
        if steps % config.sample_every == 0:
            kv, st = _held_bytes(alloc, plan)
            kv_samples.append(kv)
            state_samples.append(st)
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
        kv_bytes=np.asarray(kv_samples, dtype=np.int64),
        state_bytes=np.asarray(state_samples, dtype=np.int64),
        padding_bytes=plan.capacity.padding_bytes,
        memory_bytes=plan.config.memory_bytes,
    )


def _chunk(remaining: int, budget: int, done: int, align: int) -> int:
    """Prefill tokens this step: all that fit; a partial chunk ends on a checkpoint boundary."""
    if remaining <= budget:
        return remaining
    end = (done + budget) // align * align
    return max(0, end - done)


def _insert(queue: deque, item: tuple[float, int]) -> None:
    i = len(queue)
    while i > 0 and queue[i - 1][0] > item[0]:
        i -= 1
    queue.insert(i, item)


def _held_bytes(alloc: HybridAllocator, plan: MemoryPlan) -> tuple[int, int]:
    """Bytes held (by running requests or as cache) by attention groups and by state groups."""
    held: list[set[int]] = [set() for _ in plan.groups]
    for req in alloc.reqs.values():
        for gid, blocks in enumerate(req.blocks):
            held[gid].update(b for b in blocks if b)
    seen = set()
    for pool in alloc.pool.values():
        if id(pool) in seen:
            continue
        seen.add(id(pool))
        for (gid, _), bid in pool.cached_items().items():
            held[gid].add(bid)
    kv = state = 0
    for g in plan.groups:
        pool = plan.pool_of(g.group_id)
        # one id covers a whole block of the pool, except in a two-level pool (one small page)
        size = g.page_bytes if pool.kind == "two_level" else pool.block_bytes
        if g.is_state:
            state += len(held[g.group_id]) * size
        else:
            kv += len(held[g.group_id]) * size
    return kv, state
