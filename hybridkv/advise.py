"""Layout advisor: simulate a workload under each candidate configuration and rank them.

Candidates: every layout; for ``pack`` several pack sizes; for the layouts with free block sizes
(``per_group``, ``two_level``) several block sizes; each with the checkpoint policies of
:data:`ADVISED_POLICIES` (vLLM's ``align``, ``last``, ``marconi`` and hybridkv's ``hash_ladder``).
The caller may pin any of these choices (:class:`Pins`). Ranked
by median TTFT, then throughput, then token hit rate; the first row is the recommendation, and
rows equal to it on all three are reported as ties (the order among them means nothing).
"""

from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass, field

from tqdm import tqdm

from .alloc import POLICIES, AllocatorOptions
from .alloc.policies import ALL_POLICIES, policy_class
from .executors import Executor, LocalExecutor
from .layouts import PlanTooSmall, make_plan
from .models.model import HybridModel
from .sim import SimConfig, simulate
from .target import VllmTarget
from .traces import Trace

#: the checkpoint policies tried by default: vLLM's ``align``, the end-state ``last`` and
#: ``marconi``, and ``hash_ladder`` (states at the prompt's last multiples of a state-sized
#: interval and its doublings), which served the most of the same-memory attention-only
#: reference on the real trace of ``paper/results/reference-gap.md``
ADVISED_POLICIES = (*POLICIES, "hash_ladder")

#: the ranking key's columns, in order (smaller TTFT first, then larger throughput and hits)
RANKED_BY = ("ttft_p50_ms", "throughput_tok_s", "token_hit_rate")


@dataclass(frozen=True)
class Candidate:
    layout: str
    pack_size: int | str = "auto"
    block_size: int | None = None
    policy: str = "align"

    @property
    def label(self) -> str:
        extra = f"({self.pack_size})" if self.layout == "pack" else ""
        block = f" block={self.block_size}" if self.block_size else ""
        return f"{self.layout}{extra}{block} {self.policy}"


@dataclass(frozen=True)
class Pins:
    """Choices the caller fixes instead of letting the advisor try several (None: the
    advisor's own).

    - ``block_size``: the attention block for ``per_group``/``two_level``, and the requested
      block (vLLM's ``--block-size``, which sets the unit the shared layouts align to) for the
      others.
    - ``pack_size``: the only pack size ``pack`` is tried with.
    - ``state_slots_per_seq``: state slots per running request in every plan (default: 2 with
      ``align``, whose checkpoints need a spare, else 1).
    - ``cache_state_slots``: extra cached-state slots in every plan (default: ``max_num_seqs``
      for ``per_group``, whose fixed state pool otherwise caches nothing, else 0).
    - ``policies``: the checkpoint policies tried (default :data:`ADVISED_POLICIES`; any of
      :data:`hybridkv.alloc.policies.ALL_POLICIES`, each at its own default interval).
    """

    block_size: int | None = None
    pack_size: int | None = None
    state_slots_per_seq: int | None = None
    cache_state_slots: int | None = None
    policies: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        unknown = [p for p in self.policies or () if p not in ALL_POLICIES]
        if unknown:
            raise ValueError(
                f"unknown checkpoint policy {', '.join(map(repr, unknown))}; "
                f"choose from {', '.join(ALL_POLICIES)}"
            )
        if self.policies is not None and not self.policies:
            raise ValueError("pin at least one checkpoint policy, or none to try the defaults")


@dataclass(frozen=True)
class Advice:
    """``results`` best first; ``errors`` the candidates that do not fit or cannot run;
    ``ties`` the labels of the results ranked equal to the first (including it) when more than
    one."""

    results: list[dict]
    errors: list[dict]
    ties: list[str] = field(default_factory=list)

    @property
    def recommended(self) -> str | None:
        return self.results[0]["config"] if self.results else None


def candidates(model: HybridModel, pins: Pins | None = None) -> list[Candidate]:
    pins = pins or Pins()
    n_attn = len(model.attention_layers)
    out = [Candidate("inflate", block_size=pins.block_size)]
    out.append(Candidate("aggregate", block_size=pins.block_size))
    if pins.pack_size is not None:
        packs = [pins.pack_size]
    else:
        packs = [n for n in (2, 4) if n < n_attn and n_attn % n == 0]
    out += [Candidate("pack", pack_size=n, block_size=pins.block_size) for n in packs]
    if pins.block_size is not None:
        blocks = [pins.block_size]
    else:
        blocks = [model.kernel_alignment, 4 * model.kernel_alignment]
    for layout in ("per_group", "two_level"):
        out += [Candidate(layout, block_size=b) for b in blocks]
    policies = pins.policies or ADVISED_POLICIES
    return [
        Candidate(c.layout, c.pack_size, c.block_size, policy) for c in out for policy in policies
    ]


def candidate_options(
    base: AllocatorOptions, cand: Candidate, block_size: int
) -> AllocatorOptions:
    """``base`` with what the advisor picks for ``cand`` on a plan of ``block_size``: its
    checkpoint policy, and a hash unit of ``min(16, block_size)`` (it must divide the block,
    which varies across candidates). ``checkpoint_interval`` is unset: each policy runs at its
    own default (``hash_ladder``'s first rung is the state's size in KV tokens on that plan,
    ``periodic``'s and ``hash_boundary``'s 512 tokens)."""
    return base.replace(
        checkpoint_policy=cand.policy,
        hash_block_size=min(16, block_size),
        checkpoint_interval=None,
    )


def _key(row: dict) -> tuple[float, float, float]:
    return (row["ttft_p50_ms"], -row["throughput_tok_s"], -row["token_hit_rate"])


@dataclass(frozen=True)
class _Sweep:
    """What every candidate's run shares (sent to each worker once): the model, the workload
    and the deployment it is planned for."""

    model: HybridModel
    trace: Trace
    memory: int | str
    max_num_seqs: int
    config: SimConfig
    pins: Pins
    target: VllmTarget | None


def _run_candidate(sweep: _Sweep, cand: Candidate) -> dict:
    """One candidate planned and simulated: its result row, or ``{"config", "error"}`` when it
    does not fit or cannot run (module level, so an executor can run it in a worker)."""
    model, pins, max_num_seqs = sweep.model, sweep.pins, sweep.max_num_seqs
    slots = pins.state_slots_per_seq
    cached = pins.cache_state_slots
    try:
        plan = make_plan(
            model,
            cand.layout,
            memory=sweep.memory,
            max_num_seqs=max_num_seqs,
            block_size=cand.block_size,
            pack_size=cand.pack_size,
            state_slots_per_seq=(
                slots if slots is not None else policy_class(cand.policy).state_slots_per_request
            ),
            cache_state_slots=cached
            if cached is not None
            else (max_num_seqs if cand.layout == "per_group" else 0),
            target=sweep.target,
        )
    except PlanTooSmall as exc:  # how much it would need, for a caller to name the smallest
        return {"config": cand.label, "error": str(exc), "needed_bytes": exc.needed_bytes}
    except ValueError as exc:
        return {"config": cand.label, "error": str(exc)}
    config = sweep.config
    sim_config = SimConfig(
        max_num_batched_tokens=config.max_num_batched_tokens,
        gpu=config.gpu,
        allocator=candidate_options(config.allocator, cand, plan.block_size),
    )
    try:
        result = simulate(plan, model, sweep.trace, sim_config)
    except (RuntimeError, ValueError) as exc:
        return {"config": cand.label, "error": str(exc)}
    s = result.summary()
    return {
        "config": cand.label,
        "layout": cand.layout,
        "policy": cand.policy,
        "block_size": plan.block_size,
        "pack_size": plan.pack_size if cand.layout == "pack" else None,
        "state_slots_per_seq": plan.config.state_slots_per_seq,
        "cache_state_slots": plan.config.cache_state_slots,
        "capacity_fraction": round(plan.capacity.fraction_of_ideal, 4),
        "token_hit_rate": s["token_hit_rate"],
        "ttft_p50_ms": s["ttft_p50_ms"],
        "ttft_p90_ms": s["ttft_p90_ms"],
        "throughput_tok_s": s["throughput_tok_s"],
        "preemptions": s["preemptions"],
    }


def advise(
    model: HybridModel,
    trace: Trace,
    *,
    memory: int | str,
    max_num_seqs: int = 64,
    config: SimConfig | None = None,
    pins: Pins | None = None,
    target: VllmTarget | None = None,
    progress: bool = False,
    executor: Executor | None = None,
) -> Advice:
    """Simulate every candidate and rank them (see the module docstring). ``progress``: one bar
    over the candidates, naming the one being simulated (awaited, when they run side by side).
    ``target``: the vLLM whose rules the shared-pool layouts follow (default vLLM 0.33's).
    ``config``: its ``max_num_batched_tokens``, ``gpu`` and allocator options apply to every
    candidate, but for what the advisor picks per candidate (:func:`candidate_options`).
    ``executor``: where the candidates' runs execute (:mod:`hybridkv.executors`: worker
    processes, Ray; default this process); the advice does not depend on it."""
    sweep = _Sweep(
        model, trace, memory, max_num_seqs, config or SimConfig(), pins or Pins(), target
    )
    cands = candidates(model, sweep.pins)
    results: list[dict] = []
    errors: list[dict] = []
    bar = tqdm(total=len(cands), desc="advise", unit="config", disable=not progress, leave=False)
    rows = (executor or LocalExecutor()).imap(_run_candidate, cands, shared=sweep)
    with closing(rows):
        for cand in cands:
            bar.set_postfix_str(cand.label, refresh=False)
            row = next(rows)  # in this process, the run itself: the bar names the one running
            (errors if "error" in row else results).append(row)
            bar.update()
    bar.close()
    results.sort(key=_key)
    ties = [r["config"] for r in results if _key(r) == _key(results[0])] if results else []
    return Advice(results, errors, ties if len(ties) > 1 else [])
