"""Replay a trace one request at a time: the cache-policy replay of Marconi's simulator.

Each request in trace order looks up its longest prefix hit, runs its prompt and then its answer
alone, and is freed, so its tokens stay cached for the requests after it. There is no batching,
no clock and no preemption: what is measured is the cache policy and the layout, at exactly the
same request sequence and memory as another simulator that replays requests this way (Marconi's
``policy_exploration.py`` does: ``match_prefix`` then ``insert`` per request). For serving
behaviour (batches, TTFT, preemption) use :func:`hybridkv.sim.simulate`.

The allocator sees the calls an engine would make: prefill chunks end where the policy wants a
checkpoint (:meth:`~hybridkv.alloc.HybridAllocator.prefill_chunk`, the question the simulator's
scheduler asks too), every step is committed, and decode
steps with no allocator work are handed over together (the allocator's fast path, as the
simulator does). The answer's last token is appended but never computed: a server samples it
and stops.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from .alloc import AllocatorOptions, HitInfo, HybridAllocator, MemoryBreakdown
from .alloc.breakdown import breakdown_table
from .alloc.marconi import tokens_as_flops
from .plan import MemoryPlan
from .rare_gc import rare_cyclic_gc
from .traces import Request, Trace, answer_ids

__all__ = [
    "MARCONI_ALPHAS",
    "REPLAY_OPTIONS",
    "SERVING_ALPHA_STRIDE",
    "AlphaTuner",
    "ReplayResult",
    "alpha_scores",
    "best_alpha",
    "coarse_to_fine",
    "replay",
    "serve",
    "tune_marconi_alpha",
]


@dataclass(frozen=True)
class ReplayResult:
    """Per-request hits of a :func:`replay`, with the memory breakdowns it sampled.

    ``hits[i]`` / ``prompts[i]``: cached and prompt tokens of request ``i`` (trace order).
    ``samples[j]`` is the pool's :class:`~hybridkv.alloc.MemoryBreakdown` after request
    ``sample_at[j]`` was freed (what the cache holds when the next request looks it up)."""

    layout: str
    policy: str
    hits: np.ndarray
    prompts: np.ndarray
    samples: tuple[MemoryBreakdown, ...] = ()
    sample_at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    checkpoints: int = 0
    evictions: int = 0
    #: ``marconi``'s alpha at the end, and after which request it was tuned (None: fixed)
    marconi_alpha: float | None = None
    alpha_tuned_at: int | None = None
    #: per request, the prefix the attention groups alone held at its lookup
    #: (``HitInfo.num_kv_cached_tokens``): ``kv_hits - hits`` is what missing states cost it
    kv_hits: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def token_hit_rate(self) -> float:
        return float(self.hits.sum()) / max(1, int(self.prompts.sum()))

    def breakdown_mean(self, after: float = 0.5) -> dict[str, float]:
        """Mean bytes per breakdown field over the samples taken after the first ``after``
        fraction of the requests (default: the second half, once the cache is full)."""
        first = int(after * len(self.hits))
        picked = [s for s, i in zip(self.samples, self.sample_at) if i >= first]
        return breakdown_table(picked)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "layout": self.layout,
            "policy": self.policy,
            "requests": len(self.hits),
            "token_hit_rate": round(self.token_hit_rate, 4),
            "checkpoints": self.checkpoints,
            "evictions": self.evictions,
        }
        if self.marconi_alpha is not None:
            out["marconi_alpha"] = self.marconi_alpha
            out["alpha_tuned_at"] = self.alpha_tuned_at
        if self.samples:
            mean = self.breakdown_mean()
            out["breakdown_gb"] = {
                k: round(v / 1e9, 3) for k, v in mean.items() if k != "cached_states"
            }
            out["cached_states_mean"] = round(mean["cached_states"], 1)
        return out


def _requests(trace: Trace | Iterable[Request]) -> Sequence[Request]:
    return trace.requests if isinstance(trace, Trace) else list(trace)


#: Marconi's grid for ``alpha`` (its ``ConfigTuner.tune_config``)
MARCONI_ALPHAS = tuple(round(0.1 * i, 1) for i in range(21))
#: the serving path's search over that grid (:func:`coarse_to_fine`): every fifth value, then
#: the best one's neighbours within two places, 9 replays of Marconi's 21 (its whole grid
#: multiplied a chat simulation's wall time by up to seven)
SERVING_ALPHA_STRIDE = 5


#: :func:`replay`'s allocator options unless it is given some: Marconi's policy, as its simulator
REPLAY_OPTIONS = AllocatorOptions(checkpoint_policy="marconi")


def replay(
    plan: MemoryPlan,
    trace: Trace | Iterable[Request],
    options: AllocatorOptions | None = None,
    *,
    sample_every: int = 0,
    progress: bool = False,
    alpha_grid: Sequence[float] = MARCONI_ALPHAS,
    alpha_stride: int = 1,
    bootstrap_multiplier: int = 5,
    tuning_last: int = 500,
    **overrides: Any,
) -> ReplayResult:
    """Replay ``trace`` on ``plan`` one request at a time (see the module docstring).

    ``options``: the allocator's (default :data:`REPLAY_OPTIONS`); keyword ``overrides``
    replace some of them (``checkpoint_policy="last"``, ``evict_unreachable=False``,
    ``marconi_alpha=0.5``, ...). Replay sets ``max_model_len`` itself, to the trace's longest
    request. ``sample_every`` > 0 records the memory breakdown after every that many requests
    (0: none). Requests need ``output_ids`` (the answer's tokens) when ``output_length`` > 0:
    later turns of a conversation resend them. A request that does not fit in the plan's
    memory alone raises ``ValueError``.

    Under Marconi's eviction with ``marconi_alpha="auto"`` (the options' default) alpha is tuned
    as Marconi does (:func:`tune_marconi_alpha`): it starts at 0, and once
    ``bootstrap_multiplier`` times as many requests as were served before the first eviction
    have been seen, those requests are replayed from an empty cache with each value of
    ``alpha_grid`` (``alpha_stride`` > 1: :func:`coarse_to_fine`'s fewer); the value that saved
    the most prefill FLOPs over the last ``tuning_last`` of them is used from then on."""
    reqs = _requests(trace)
    options = (options or REPLAY_OPTIONS).replace(**overrides)
    # every request of the trace fits its length: only the plan's memory may refuse one
    options = options.replace(
        max_model_len=max((len(r.prompt) + r.output_length for r in reqs), default=1)
    )

    def make() -> HybridAllocator:
        return HybridAllocator(plan, options)

    alloc = make()
    tuner = None
    if options.tunes_marconi_alpha:
        tuner = AlphaTuner(
            make,
            grid=alpha_grid,
            stride=alpha_stride,
            bootstrap_multiplier=bootstrap_multiplier,
            tuning_last=tuning_last,
            flops=options.marconi_flops,
        )
    hits = np.zeros(len(reqs), dtype=np.int64)
    kv_hits = np.zeros(len(reqs), dtype=np.int64)
    samples: list[MemoryBreakdown] = []
    sample_at: list[int] = []
    bar = tqdm(total=len(reqs), desc=f"replay {plan.layout}", disable=not progress)
    with rare_cyclic_gc():  # the collector would walk the allocator's index again and again
        for i, req in enumerate(reqs):
            info = _serve(alloc, req, i)
            hits[i], kv_hits[i] = info.num_cached_tokens, info.num_kv_cached_tokens
            bar.update()
            if tuner is not None:
                tuner.observe(alloc, req)
            if sample_every and (i + 1) % sample_every == 0:
                samples.append(alloc.memory_breakdown())
                sample_at.append(i)
    bar.close()
    prompts = np.asarray([len(r.prompt) for r in reqs], dtype=np.int64)
    stats = alloc.stats()
    return ReplayResult(
        layout=plan.layout,
        policy=options.checkpoint_policy,
        hits=hits,
        prompts=prompts,
        samples=tuple(samples),
        sample_at=np.asarray(sample_at, dtype=np.int64),
        checkpoints=stats["checkpoints"],
        evictions=_evictions(alloc),
        marconi_alpha=alloc.marconi_alpha,
        alpha_tuned_at=tuner.tuned_at[0] - 1 if tuner is not None and tuner.tuned_at else None,
        kv_hits=kv_hits,
    )


def _evictions(alloc: HybridAllocator) -> int:
    return sum(p.get("evictions", 0) for p in alloc.stats()["pools"].values())


class AlphaTuner:
    """Marconi's online tuning of ``marconi``'s alpha, fed the requests a cache has served (in
    the order they finished) and the allocator serving them.

    Until the first eviction nothing is tuned (the allocator starts at Marconi's 0). Once
    ``bootstrap_multiplier`` times as many requests as had finished at the first eviction have
    finished (the *window*), the last window of them is replayed from an empty cache with
    alphas of ``grid`` (:func:`tune_marconi_alpha`, made by ``make``; ``stride`` says which) and
    the best is set on the allocator. With ``retune`` it tunes again after every further window,
    on the last window, so alpha follows a workload that drifts; without, once (Marconi's
    simulator, :func:`replay`). ``tuned_at``: the finished-request counts at which it tuned;
    ``choices``: the alpha each tuning chose; ``scores``: per tuning, the prefill FLOPs each
    alpha tried saved; ``seconds``: the wall time its replays took in all (Marconi's system runs
    them in the background, so a benchmark of the serving path can count them apart)."""

    def __init__(
        self,
        make: Callable[[], HybridAllocator],
        *,
        grid: Sequence[float] = MARCONI_ALPHAS,
        stride: int = 1,
        bootstrap_multiplier: int = 5,
        tuning_last: int = 500,
        retune: bool = False,
        flops: Callable[[int, int], float] | None = None,
    ) -> None:
        if bootstrap_multiplier < 1:
            raise ValueError(f"bootstrap_multiplier must be >= 1, got {bootstrap_multiplier}")
        _check_search(grid, stride)
        # no FLOP model (the options' marconi_flops None): every token costs the same
        self.flops = flops or tokens_as_flops
        self.make, self.grid, self.stride = make, tuple(grid), stride
        self.bootstrap_multiplier, self.tuning_last, self.retune = (
            bootstrap_multiplier, tuning_last, retune,
        )  # fmt: skip
        self.count = 0
        self.window: int | None = None
        self.tuned_at: list[int] = []
        self.choices: list[float] = []
        self.scores: list[dict[float, float]] = []
        self.seconds = 0.0
        self._seen: deque[Request] = deque()

    def observe(self, alloc: HybridAllocator, req: Request) -> None:
        """``req`` finished on ``alloc`` (with its answer's ``output_ids``): tune if it is time."""
        self.count += 1
        if self.tuned_at and not self.retune:  # tuned once, for good: nothing to keep
            return
        self._seen.append(req)
        if self.window is None:
            if not _evictions(alloc):
                return
            self.window = self.bootstrap_multiplier * self.count
        while len(self._seen) > self.window:  # only the last window is ever replayed
            self._seen.popleft()
        last = self.tuned_at[-1] if self.tuned_at else None
        due = self.count >= self.window if last is None else (
            self.retune and self.count - last >= self.window
        )  # fmt: skip
        if due:
            t0 = time.perf_counter()
            scores = alpha_scores(
                self.make, list(self._seen), self.grid, self.tuning_last,
                stride=self.stride, flops=self.flops,
            )  # fmt: skip
            alloc.marconi_alpha = best_alpha(scores, self.grid)
            self.tuned_at.append(self.count)
            self.choices.append(alloc.marconi_alpha)
            self.scores.append(scores)
            self.seconds += time.perf_counter() - t0


def _check_search(grid: Sequence[float], stride: int) -> None:
    if not grid:
        raise ValueError("alpha_grid is empty; give at least one value")
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise ValueError(f"the alpha search's stride must be an integer >= 1, got {stride!r}")


def coarse_to_fine(grid: Sequence[float], stride: int, score: Callable[[float], float]) -> None:
    """Call ``score`` on the values of ``grid`` a search of ``stride`` tries: with stride 1,
    every value; else every ``stride``-th value and the last (the coarse pass), then the values
    within ``stride // 2`` places of the best of those on either side (the fine pass). Each
    value is scored at most once (``score`` memoises nothing itself)."""
    n = len(grid)
    coarse = sorted({*range(0, n, stride), n - 1})
    seen: dict[int, float] = {}

    def at(i: int) -> float:
        if i not in seen:
            seen[i] = score(grid[i])
        return seen[i]

    for i in coarse:
        at(i)
    if stride > 1:
        # the first best in grid order, as the whole search picks ties
        best = max(coarse, key=lambda i: (seen[i], -i))
        for i in range(max(0, best - stride // 2), min(n, best + stride // 2 + 1)):
            at(i)


def alpha_scores(
    make: Callable[[], HybridAllocator],
    requests: Sequence[Request],
    grid: Sequence[float] = MARCONI_ALPHAS,
    last: int = 500,
    *,
    stride: int = 1,
    flops: Callable[[int, int], float] = tokens_as_flops,
) -> dict[float, float]:
    """Marconi's retrospective replays: ``requests`` replayed on a fresh allocator from ``make``
    (an empty cache, as Marconi's snapshot taken before its first request) with each alpha
    :func:`coarse_to_fine` picks from ``grid``; per alpha tried, the prefill FLOPs its hits
    saved over the last ``last`` requests."""
    _check_search(grid, stride)
    scores: dict[float, float] = {}

    def score(alpha: float) -> float:
        alloc = make()
        alloc.marconi_alpha = alpha
        hits = [serve(alloc, r, index=i) for i, r in enumerate(requests)]
        scores[float(alpha)] = sum(flops(h, 0) for h in hits[-last:] if h)
        return scores[float(alpha)]

    coarse_to_fine(grid, stride, score)
    return scores


def best_alpha(scores: dict[float, float], grid: Sequence[float]) -> float:
    """The alpha of most FLOPs saved (the first such in grid order on a tie)."""
    tried = [float(a) for a in grid if float(a) in scores]
    return max(tried, key=lambda a: (scores[a], -tried.index(a)))


def tune_marconi_alpha(
    make: Callable[[], HybridAllocator],
    requests: Sequence[Request],
    grid: Sequence[float] = MARCONI_ALPHAS,
    last: int = 500,
    *,
    stride: int = 1,
    flops: Callable[[int, int], float] = tokens_as_flops,
) -> float:
    """Marconi's retrospective tuning (:func:`alpha_scores`): the alpha whose hits saved the
    most prefill FLOPs over the last ``last`` requests (the first such in grid order on a
    tie)."""
    scores = alpha_scores(make, requests, grid, last, stride=stride, flops=flops)
    return best_alpha(scores, grid)


def serve(alloc: HybridAllocator, req: Request, *, index: int | None = None) -> int:
    """Run one request alone on ``alloc``, from prefix lookup to free; returns its cached
    (hit) prompt tokens. ``index`` names it in errors (default: its request id)."""
    i = req.request_id if index is None else index
    return _serve(alloc, req, i).num_cached_tokens


def _serve(alloc: HybridAllocator, req: Request, i: Any) -> HitInfo:
    """:func:`serve`, returning the allocator's whole answer at admission."""
    prompt = req.prompt.tolist()
    rid = req.request_id
    hit = alloc.add_request(rid, prompt)
    done = hit.num_cached_tokens
    while done < len(prompt):
        # offered every remaining token (no token budget): the policy cuts where it wants a
        # checkpoint (align: where vLLM's scheduler would)
        n = alloc.prefill_chunk(rid, len(prompt) - done)
        if n <= 0:  # pragma: no cover - an allocator that cuts nothing would loop forever
            raise RuntimeError(f"request {i}: the policy leaves a prefill chunk of {n} tokens")
        _step(alloc, rid, n, i, len(prompt))
        done += n
    _decode(alloc, req, i)
    alloc.free(rid)
    return hit


def _step(alloc: HybridAllocator, rid: Any, n: int, i: int, length: int) -> None:
    if not alloc.allocate_slots(rid, n):
        raise ValueError(
            f"request {i} ({length:,} tokens and its answer) does not fit in the plan's memory "
            "even alone; give the plan more memory or leave such long requests out"
        )
    alloc.take_state_copies()


def _decode(alloc: HybridAllocator, req: Request, i: int) -> None:
    """The answer: every token but the last is computed (its KV and state are kept)."""
    k = int(req.output_length)
    if k <= 0:
        return
    # the trace's answer where it knows it (a later turn resends it), else ids no prompt holds
    out = answer_ids(req)
    rid = req.request_id
    j = 0
    while j < k - 1:
        free_run = min(alloc.fast_path_tokens(rid), k - 1 - j)
        if free_run > 1:  # decode steps with no allocator work, in one call
            alloc.append_tokens(rid, out[j : j + free_run])
            _step(alloc, rid, free_run, i, len(req.prompt))
            j += free_run
            continue
        alloc.append_tokens(rid, [out[j]])
        _step(alloc, rid, 1, i, len(req.prompt))
        j += 1
    alloc.append_tokens(rid, [out[k - 1]])
