"""Layout advisor: simulate a workload under each candidate configuration and rank them.

Candidates: every layout; for ``pack`` several pack sizes; for the layouts with free block sizes
(``per_group``, ``two_level``) several block sizes; each with the ``align``, ``last`` and
``marconi`` checkpoint policies. Ranked by median TTFT, then throughput, then token hit rate;
the first row is the recommendation.
"""

from __future__ import annotations

from dataclasses import dataclass

from .alloc import POLICIES
from .layouts import make_plan
from .models.model import HybridModel
from .sim import SimConfig, simulate
from .traces import Trace


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


def candidates(model: HybridModel) -> list[Candidate]:
    out = [Candidate("inflate"), Candidate("aggregate")]
    n_attn = len(model.attention_layers)
    out += [Candidate("pack", pack_size=n) for n in (2, 4) if n < n_attn and n_attn % n == 0]
    align = 64 if any(layer.spec.kind == "mla" for layer in model.attention_layers) else 16
    for layout in ("per_group", "two_level"):
        out += [Candidate(layout, block_size=b) for b in (align, 4 * align)]
    return [
        Candidate(c.layout, c.pack_size, c.block_size, policy) for c in out for policy in POLICIES
    ]


def advise(
    model: HybridModel,
    trace: Trace,
    *,
    memory: int | str,
    max_num_seqs: int = 64,
    config: SimConfig | None = None,
    progress: bool = False,
) -> list[dict]:
    """Rows (best first) of the trade-off table; plans that do not fit are reported too."""
    config = config or SimConfig()
    rows = []
    for cand in candidates(model):
        try:
            plan = make_plan(
                model,
                cand.layout,
                memory=memory,
                max_num_seqs=max_num_seqs,
                block_size=cand.block_size,
                pack_size=cand.pack_size,
                state_slots_per_seq=2 if cand.policy == "align" else 1,
                cache_state_slots=max_num_seqs if cand.layout == "per_group" else 0,
            )
        except ValueError as exc:
            rows.append({"config": cand.label, "error": str(exc)})
            continue
        sim_config = SimConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            hash_block_size=min(16, plan.block_size),
            checkpoint_policy=cand.policy,
            gpu=config.gpu,
        )
        try:
            result = simulate(plan, model, trace, sim_config, progress=progress)
        except RuntimeError as exc:
            rows.append({"config": cand.label, "error": str(exc)})
            continue
        s = result.summary()
        rows.append(
            {
                "config": cand.label,
                "block_size": plan.block_size,
                "capacity_pct": round(100 * plan.capacity.fraction_of_ideal, 2),
                "hit_rate": s["token_hit_rate"],
                "ttft_p50_ms": s["ttft_p50_ms"],
                "ttft_p90_ms": s["ttft_p90_ms"],
                "throughput_tok_s": s["throughput_tok_s"],
                "preemptions": s["preemptions"],
            }
        )
    ok = [r for r in rows if "error" not in r]
    ok.sort(key=lambda r: (r["ttft_p50_ms"], -r["throughput_tok_s"], -r["hit_rate"]))
    return ok + [r for r in rows if "error" in r]
