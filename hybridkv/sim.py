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
boundary (to its end when the state layers export the checkpoint from inside the prefill:
``AllocatorOptions.prefill_checkpoint_alignment``), stopping earlier only at a junction or, with
hash units finer than the block, at the prompt's last hash boundary. With the other policies chunks
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

import dataclasses
import functools
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from tqdm import tqdm  # a text bar: in a notebook tqdm.auto would want ipywidgets

from .alloc import AllocatorOptions, HybridAllocator, MemoryBreakdown
from .alloc.breakdown import breakdown_table
from .costmodel import GPU, H100_SXM, ParamCount, StepCoster
from .models.model import HybridModel
from .plan import MemoryPlan
from .rare_gc import rare_cyclic_gc
from .replay import SERVING_ALPHA_STRIDE, AlphaTuner
from .sched import Scheduler, SchedulerConfig, Seq, StepOutput
from .traces import Trace, answer_ids

_C = TypeVar("_C")

#: :class:`SimConfig`'s allocator options unless given: a simulated request is never refused
#: for its length (the plan's memory decides what runs), and no KV events are built (nothing
#: subscribes to a simulation)
SIM_ALLOCATOR = AllocatorOptions(max_model_len=1 << 20, kv_events=False)


def _allocator_options_as_keywords(cls: type[_C]) -> type[_C]:
    """Let ``cls`` (a dataclass with an ``allocator: AllocatorOptions`` field) take each of the
    allocator's options as a keyword too: they replace those options of ``allocator=`` (default:
    the field's default). The names are :meth:`AllocatorOptions.names`, so an option added
    there is taken here without an edit. ``dataclasses.replace(config, hash_block_size=8)`` and
    ``cls(**{**config.__dict__, ...})`` go through here as well, so they work the same."""
    init = cls.__init__
    default = next(f.default for f in dataclasses.fields(cls) if f.name == "allocator")
    names = frozenset(AllocatorOptions.names())

    @functools.wraps(init)
    def __init__(self: _C, *args: Any, **kwargs: Any) -> None:
        flat = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        if flat:
            kwargs["allocator"] = kwargs.get("allocator", default).replace(**flat)
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]
    return cls


@_allocator_options_as_keywords
@dataclass(frozen=True)
class SimConfig:
    """Scheduler and cache options (vLLM's names where they exist).

    ``allocator``: the allocator's options (:class:`~hybridkv.alloc.AllocatorOptions`, which
    documents each one), default :data:`SIM_ALLOCATOR`. They are also taken as keywords and
    read as attributes, as when ``SimConfig`` had a field for each: ``SimConfig(
    checkpoint_policy="last").checkpoint_policy`` is ``SimConfig(allocator=SIM_ALLOCATOR.replace(
    checkpoint_policy="last")).allocator.checkpoint_policy``; keywords given with ``allocator=``
    replace those of its options. The simulator gives the allocator its clock's FLOP model
    (``marconi_flops``) unless the options name one.

    Memory is sampled every ``sample_every`` steps; once ``max_samples`` samples are taken the
    interval doubles (every other sample is dropped), so long runs keep at most that many.
    ``breakdowns`` byte breakdowns of the pool (:func:`hybridkv.alloc.memory_breakdown`: live,
    cached and reachable or not, owned but empty, padding, free) are taken evenly over the run's
    progress: one each time another ``1 / breakdowns`` of the trace's requests has finished,
    at the middle of each share (0: none). Each is a pass over the cache index, so they are
    spaced by requests, whose count is known in advance, rather than thinned like the step
    samples: thinning computed two to three breakdowns for every one it kept (142 for 46 in a
    3,000-request chat run), a third of that run's time. The results report their means; 32
    samples spread over the requests measure a mean as well as 64 and cost half as much (a
    breakdown of a full 40 GiB pool of 64-token blocks takes about 0.1 s).

    Marconi's alpha (Marconi's eviction only: ``marconi``, ``hash_ladder``) is tuned online as
    Marconi's system does, unless the options fix it (``marconi_alpha``, default ``"auto"``):
    :class:`hybridkv.replay.AlphaTuner`, from 0 until the first eviction, then once, on the first
    window of finished requests (as Marconi's simulator and :func:`hybridkv.replay.replay`), or
    again after every window with ``retune_marconi_alpha`` (it loses on chat: paper section
    4.8). ``marconi_alpha_stride``: which alphas of Marconi's grid (0 to 2 by 0.1) the tuning
    replays; 1 tries all 21, as Marconi does; the default 5 tries every fifth and then the best
    one's neighbours within two places (9 replays; :func:`hybridkv.replay.coarse_to_fine`).
    The replays are Marconi's background work: they take wall time, no simulated time."""

    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0  # most prompt tokens of one request per step (0: any)
    gpu: GPU = H100_SXM
    sample_every: int = 16  # steps between memory samples
    max_samples: int = 512
    breakdowns: int = 32
    fast_decode: bool = True  # park decoding requests between allocator events (same results)
    #: the model's parameters for the roofline (default: the zoo's count for the model)
    params: ParamCount | None = None
    allocator: AllocatorOptions = SIM_ALLOCATOR
    retune_marconi_alpha: bool = False
    marconi_alpha_stride: int = SERVING_ALPHA_STRIDE

    def __post_init__(self) -> None:
        for name, least in (
            ("sample_every", 1),
            ("max_samples", 2),
            ("breakdowns", 0),
            ("marconi_alpha_stride", 1),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < least:
                raise ValueError(f"SimConfig.{name} must be an integer >= {least}, got {value!r}")

    def __getattr__(self, name: str) -> Any:
        # called only when no field has the name: the allocator's options read as they did
        # when SimConfig mirrored them (config.checkpoint_policy), with one owner of each
        if name in AllocatorOptions.names():
            return getattr(self.allocator, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


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
    #: where the pool's bytes were (:class:`~hybridkv.alloc.MemoryBreakdown`): the
    #: ``SimConfig.breakdowns`` byte breakdowns, at the times in ``breakdown_t_s``
    breakdown: tuple[MemoryBreakdown, ...] = ()
    breakdown_t_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    #: per request (trace order), at its first admission: prompt tokens served from the cache,
    #: and the prefix the attention groups alone held (``HitInfo.num_kv_cached_tokens``, capped
    #: at the prompt): ``request_kv_hits - request_hits`` is what missing states cost it
    request_hits: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    request_kv_hits: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: Marconi's alpha at the end (None under LRU eviction) and, when it was tuned online
    #: (``marconi_alpha="auto"``), the finished-request counts at which it was
    marconi_alpha: float | None = None
    alpha_tuned_at: tuple[int, ...] = ()
    #: the alpha each of those tunings chose, in order
    alpha_choices: tuple[float, ...] = ()
    #: per tuning, the prefill FLOPs each alpha it tried saved in its replay
    alpha_scores: tuple[dict[float, float], ...] = ()
    #: wall seconds the tunings' replays took (Marconi's background work: within the run's
    #: wall time, outside its simulated time)
    alpha_tuning_s: float = 0.0

    def alpha_summary(self) -> dict[str, float | list]:
        """What the run's Marconi eviction weighed: alpha at the end, when it was tuned
        (finished requests), what each tuning chose and the wall time of the tuning replays
        (empty under LRU eviction)."""
        if self.marconi_alpha is None:
            return {}
        return {
            "marconi_alpha": self.marconi_alpha,
            "alpha_tuned_at": list(self.alpha_tuned_at),
            "alpha_choices": list(self.alpha_choices),
            "alpha_tuning_s": round(self.alpha_tuning_s, 3),
        }

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


class RooflineClock:
    """The simulator's executor: prices each step by the roofline cost model and answers each
    sampled token from the trace (:attr:`Seq.script`). State copies cost nothing here."""

    def __init__(self, coster: StepCoster) -> None:
        self.coster = coster
        self.t = 0.0

    def execute(self, out: StepOutput) -> list[int]:
        dt = 0.0
        for _, start, n in out.prefill:
            dt += self.coster.prefill_s(n, start)
        if out.num_decode:
            dt += self.coster.decode_s(
                out.num_decode, out.decode_context_total, out.decode_contexts
            )
        self.t += dt
        return [seq.script[len(seq.outputs)] for seq in out.sampling]

    def checkpoint(self, copies: list[tuple[int, int, int]]) -> None:
        pass


def scheduler_config(plan: MemoryPlan, config: SimConfig) -> SchedulerConfig:
    """The shared scheduler's knobs for a simulation of ``plan`` under ``config``."""
    return SchedulerConfig(
        max_num_seqs=plan.config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        park_decoders=config.fast_decode,
    )


def simulate(
    plan: MemoryPlan,
    model: HybridModel,
    trace: Trace,
    config: SimConfig | None = None,
    *,
    progress: bool = False,
    on_step: Callable[[StepOutput], None] | None = None,
) -> SimResult:
    """Replay ``trace`` on ``plan`` (made for ``model``) and measure it. ``on_step`` sees every
    step the scheduler ran (after it ran), e.g. to record the schedule. Python's cyclic
    collector runs rarely meanwhile (:mod:`hybridkv.rare_gc`)."""
    with rare_cyclic_gc():
        return _simulate(plan, model, trace, config or SimConfig(), progress, on_step)


def _simulate(
    plan: MemoryPlan,
    model: HybridModel,
    trace: Trace,
    config: SimConfig,
    progress: bool,
    on_step: Callable[[StepOutput], None] | None,
) -> SimResult:
    """:func:`simulate`'s run."""
    coster = StepCoster(model, config.gpu, params=config.params)
    options = config.allocator
    if options.marconi_flops is None:
        # marconi weighs the FLOPs a state saves by the same cost model as the clock
        options = options.replace(marconi_flops=coster.prefill_flops)
    alloc = HybridAllocator(plan, options)
    tuner = _alpha_tuner(plan, options, alloc, config)
    # sliding-window layers: the decode cost needs every context, not just their sum
    sched = Scheduler(alloc, scheduler_config(plan, config), contexts=bool(coster.windows))
    clock = RooflineClock(coster)
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
    steps = peak = output_tokens = 0
    prompt_tokens = shared_tokens = 0
    saved_flops = 0.0
    request_hits = np.zeros(len(reqs), dtype=np.int64)
    request_kv_hits = np.zeros(len(reqs), dtype=np.int64)
    ttft: list[float] = []
    samples: list[tuple[int, float, int, int]] = []  # (step, time, kv bytes, state bytes)
    breakdowns: list[tuple[int, float, MemoryBreakdown]] = []
    # the finished-request counts at which a breakdown is taken (the middle of each share)
    share = len(reqs) / config.breakdowns if config.breakdowns > 0 else 0.0
    next_breakdown = share / 2 if share else math.inf
    stride = config.sample_every
    held: tuple[int, int] | None = None  # memory held, while known not to have changed
    bar = tqdm(total=len(reqs), disable=not progress, desc=f"simulate {plan.layout}")

    def sample() -> None:
        nonlocal held, stride
        if held is None:
            held = _held_bytes(alloc, plan)
        samples.append((steps, clock.t, *held))
        if len(samples) >= config.max_samples:
            stride *= 2
            samples[:] = [x for x in samples if x[0] % stride == 0]

    while ready or sched.has_work():
        while ready and ready[0][0] <= clock.t:
            arrive, _, rid = heapq.heappop(ready)
            req = reqs[rid]
            sched.add(
                Seq(
                    rid,
                    req.prompt,
                    int(req.output_length),
                    arrival=arrive,
                    script=answer_ids(req),
                )
            )
        if not sched.has_work():
            clock.t = max(clock.t, ready[0][0])
            continue
        out = sched.step(clock)
        if not out.has_work:
            if sched.running or not ready:
                raise RuntimeError(sched.stuck_message())
            clock.t = max(clock.t, ready[0][0])  # nothing fits until more work arrives
            continue
        if on_step is not None:
            on_step(out)
        steps += 1
        if not out.quiet:
            held = None
        peak = max(peak, len(sched.running) + len(out.finished))
        output_tokens += out.num_parked + len(out.sampling)
        for seq in out.admitted:
            if len(seq.hits) == 1:  # first admission: what the trace's prompt got
                got = min(seq.hits[0].num_cached_tokens, seq.prompt_len)
                request_hits[seq.rid] = got
                request_kv_hits[seq.rid] = min(seq.hits[0].num_kv_cached_tokens, seq.prompt_len)
                prompt_tokens += seq.prompt_len
                if got:
                    saved_flops += coster.prefill_flops(got)
                shared_tokens += reqs[seq.rid].shared_prefix_length or 0
        for seq in out.sampling:
            if len(seq.outputs) == 1:
                ttft.append(clock.t - seq.arrival)
        for seq in out.finished:
            finish_time[seq.rid] = clock.t
            if tuner is not None:  # what it sent and got, as the shadow replays resend it
                done = dataclasses.replace(
                    reqs[seq.rid],
                    output_ids=np.asarray(seq.outputs, dtype=np.int64),
                    output_length=len(seq.outputs),
                )
                tuner.observe(alloc, done)
            bar.update(1)
            for child in children.get(seq.rid, ()):
                c = reqs[child]
                heapq.heappush(ready, (max(c.arrival_s, clock.t + c.think_time_s), pushed, child))
                pushed += 1
        if steps % stride == 0:
            sample()
        if len(finish_time) >= next_breakdown:
            breakdowns.append((steps, clock.t, alloc.memory_breakdown()))
            while next_breakdown <= len(finish_time):
                next_breakdown += share
    bar.close()
    return SimResult(
        layout=plan.layout,
        num_requests=len(reqs),
        finished=len(finish_time),
        prompt_tokens=prompt_tokens,
        hit_tokens=int(request_hits.sum()),  # each request's first admission
        shared_tokens=shared_tokens,
        preemptions=sched.num_preemptions,
        peak_running=peak,
        steps=steps,
        sim_time_s=clock.t,
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
        request_hits=request_hits,
        request_kv_hits=request_kv_hits,
        marconi_alpha=alloc.marconi_alpha,
        alpha_tuned_at=tuple(tuner.tuned_at) if tuner is not None else (),
        alpha_choices=tuple(tuner.choices) if tuner is not None else (),
        alpha_scores=tuple(tuner.scores) if tuner is not None else (),
        alpha_tuning_s=tuner.seconds if tuner is not None else 0.0,
    )


def _alpha_tuner(
    plan: MemoryPlan, options: AllocatorOptions, alloc: HybridAllocator, config: SimConfig
):
    """The online tuner of Marconi's alpha where the options leave it ``"auto"`` (None where
    they fix it or nothing evicts by Marconi's utility)."""
    if not options.tunes_marconi_alpha:
        if config.retune_marconi_alpha:
            fixed = options.resolved_eviction() == "marconi"
            raise ValueError(
                f"retune_marconi_alpha tunes Marconi's alpha, which marconi_alpha="
                f"{options.marconi_alpha!r} fixes; leave marconi_alpha 'auto'"
                if fixed
                else "retune_marconi_alpha tunes Marconi's eviction, which checkpoint_policy "
                f"{options.checkpoint_policy!r} runs without (eviction='marconi' turns it on)"
            )
        return None
    return AlphaTuner(
        lambda: HybridAllocator(plan, options),
        stride=config.marconi_alpha_stride,
        retune=config.retune_marconi_alpha,
        flops=options.marconi_flops,
    )


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
