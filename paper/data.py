"""The configurations the paper studies, and the plans and numbers computed from them.

Everything here is computed from the zoo and the layouts; the only literal numbers are the ones
quoted from sources (the seeds and the reference facts), each with where it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from hybridkv import models
from hybridkv.layouts import LAYOUTS, make_plan
from hybridkv.models.model import HybridModel
from hybridkv.plan import MemoryPlan
from hybridkv.target import VllmTarget

GiB = 2**30

#: layouts in the order figures show them
LAYOUT_ORDER = LAYOUTS


@dataclass(frozen=True)
class Deployment:
    """A model served at ``tp`` ranks with ``kv_dtype`` KV, ``memory`` bytes of cache per rank and
    at most ``max_num_seqs`` running requests."""

    model: str
    tp: int = 1
    kv_dtype: str = "auto"
    memory: int = 40 * GiB
    max_num_seqs: int = 256

    @property
    def label(self) -> str:
        kv = "" if self.kv_dtype == "auto" else f" {self.kv_dtype}"
        tp = f" TP{self.tp}" if self.tp > 1 else ""
        return f"{self.model}{tp}{kv}"


#: the zoo models the layout figures compare (those missing from the zoo are left out)
STUDY = (
    Deployment("qwen3-next-80b-a3b"),
    Deployment("qwen3.5-4b"),
    Deployment("qwen3.5-35b-a3b"),
    Deployment("qwen3.5-397b-a17b", tp=2),
    Deployment("nemotron-nano-12b-v2"),
    Deployment("nemotron-3-nano-30b-a3b"),
    Deployment("granite-4.0-h-small"),
    Deployment("jamba-1.5-mini"),
    Deployment("falcon-h1-7b"),
    Deployment("kimi-linear-48b-a3b"),
    Deployment("minimax-text-01", tp=8),
    Deployment("lfm2-1.2b"),
)
SMALL_STUDY = STUDY[:3]


def available(deployments: tuple[Deployment, ...]) -> list[Deployment]:
    """The deployments whose model is in the zoo."""
    zoo = set(models.list_models())
    return [d for d in deployments if d.model in zoo]


@cache
def load(model: str, tp: int = 1, kv_dtype: str = "auto") -> HybridModel:
    return models.load(model, tp_size=tp, kv_dtype=kv_dtype)


@cache
def plan(d: Deployment, layout: str, pack_size: int | str = "auto") -> MemoryPlan | None:
    """The plan of ``d`` with ``layout``, or None when the budget cannot hold it."""
    try:
        return make_plan(
            load(d.model, d.tp, d.kv_dtype),
            layout,
            memory=d.memory,
            max_num_seqs=d.max_num_seqs,
            pack_size=pack_size,
        )
    except ValueError:
        return None


def layout_label(p: MemoryPlan) -> str:
    return f"{p.layout}({p.pack_size})" if p.layout == "pack" else p.layout


# ---- the seeds' numbers -------------------------------------------------------------------------
@dataclass(frozen=True)
class SeedNumber:
    """A block size someone reported, and the configuration that reproduces it here."""

    quoted: int
    source: str
    what: str
    deployment: Deployment | None  # None: the source names no model
    layout: str = "inflate"
    pack_size: int | str = "auto"
    observed: bool = True  # False: the source derived it by arithmetic, nobody logged it
    family: str = ""  # unnamed model: list only zoo models whose name contains this


SEED_NUMBERS = (
    SeedNumber(
        2096,
        "seed 001 (vLLM PR #35703)",
        "Qwen3.5-397B-A17B-FP8, TP2 (FP8 weights, bf16 KV)",
        Deployment("qwen3.5-397b-a17b", tp=2),
    ),
    SeedNumber(
        1056,
        "seed 001 (vLLM PR #35703 benchmark)",
        "Qwen3.6-35B-A3B, main",
        Deployment("qwen3.6-35b-a3b"),
    ),
    SeedNumber(
        272,
        "seed 001 (vLLM PR #35703 benchmark)",
        "the same with --attn-pack-size 4",
        Deployment("qwen3.6-35b-a3b"),
        layout="pack",
        pack_size=4,
    ),
    SeedNumber(
        528,
        "vLLM issue #40696 (facts section 7)",
        "Qwen3.5-4B, bf16 KV",
        Deployment("qwen3.5-4b"),
    ),
    SeedNumber(
        1056,
        "facts section 1.4 (arithmetic)",
        "Qwen3.5-4B, fp8 KV",
        Deployment("qwen3.5-4b", kv_dtype="fp8"),
        observed=False,
    ),
    SeedNumber(
        544,
        "facts section 1.7 (arithmetic)",
        "Qwen3-Next-80B-A3B, TP1, bf16 state",
        Deployment("qwen3-next-80b-a3b"),
        observed=False,
    ),
    SeedNumber(
        272,
        "facts section 1.7 (arithmetic)",
        "Qwen3-Next-80B-A3B, TP4",
        Deployment("qwen3-next-80b-a3b", tp=4),
        observed=False,
    ),
    SeedNumber(
        672,
        "facts section 1.7 (PyTorch blog via a third-party note)",
        "Nemotron-Nano-12B-v2, bf16 SSM state",
        None,  # needs ssm_dtype=bfloat16; filled in by seed_rows()
    ),
    SeedNumber(
        784,
        "vLLM issue #36010; LMCache PR #5079 (facts sections 7-8)",
        "Qwen3.6-27B (Qwen3.5-27B's dimensions, the same block)",
        Deployment("qwen3.6-27b"),
    ),
    SeedNumber(400, "seed 000 (vLLM PR #21123)", '"~400 tokens", no model named', None),
    SeedNumber(2176, "seed 003 (vLLM PR #43258)", "a hybrid model, not named", None),
    SeedNumber(
        2096,
        "vLLM issue #53749 (facts section 7)",
        "NVIDIA-Nemotron-3.5-Lightning-30B-A3B-BF16, TP1",
        Deployment("nemotron-3.5-lightning-30b-a3b"),
    ),
    SeedNumber(
        8320, "vLLM issue #48401 (facts section 7)", "a NemotronH model", None, family="nemotron"
    ),
    SeedNumber(
        864,
        "vLLM issue #51250 (facts section 7)",
        "Qwen3.6-35B-A3B, runtime not given",
        None,
        family="qwen",
    ),
)


@dataclass(frozen=True)
class HitRateAnchor:
    """A prefix-cache hit rate someone measured for a repeated prompt of ``prompt`` tokens."""

    quoted: str
    source: str
    deployment: Deployment
    layout: str
    prompt: int
    pack_size: int | str = "auto"


HIT_RATE_ANCHORS = (
    HitRateAnchor(
        "0%", "vLLM issue #40696 (below 528 tokens)", Deployment("qwen3.5-4b"), "inflate", 500
    ),
    HitRateAnchor("~95%", "vLLM issue #40696", Deployment("qwen3.5-4b"), "inflate", 552),
    HitRateAnchor("~54%", "vLLM issue #40696", Deployment("qwen3.5-4b"), "inflate", 979),
    HitRateAnchor("52.6%", "vLLM PR #35703, main", Deployment("qwen3.6-35b-a3b"), "inflate", 2000),
    HitRateAnchor(
        "94.9%",
        "vLLM PR #35703, --attn-pack-size 4",
        Deployment("qwen3.6-35b-a3b"),
        "pack",
        2000,
        4,
    ),
)


def hit_rate_rows() -> list[dict[str, str]]:
    """The anchors next to ``floor(P/B)*B/P`` and the align rule with our block sizes."""
    from hybridkv.traces import block_hit_tokens

    zoo = set(models.list_models())
    rows = []
    for a in HIT_RATE_ANCHORS:
        row = {"quoted": a.quoted, "source": a.source, "prompt": f"{a.prompt:,}"}
        # the anchors were measured on vLLM runs whose block sizes are the prefix-caching-off
        # ones (table 1: 528 for Qwen3.5-4B, 1,056 for Qwen3.5-35B-A3B), so compare with those
        b = (
            _block_size(a.deployment, a.layout, a.pack_size, PC_OFF)
            if a.deployment.model in zoo
            else None
        )
        if b is None:
            row.update(block="model not in zoo", full="-", align="-")
        else:
            label = f"pack({a.pack_size})" if a.layout == "pack" else a.layout
            row["block"] = f"{b:,} ({a.deployment.model}, {label})"
            row["full"] = f"{100 * block_hit_tokens(a.prompt, b) / a.prompt:.1f}%"
            row["align"] = f"{100 * block_hit_tokens(a.prompt, b, 'align') / a.prompt:.1f}%"
        rows.append(row)
    return rows


#: the two vLLM modes table 1 reports: vLLM 0.33's default (prefix caching on, so the Mamba
#: cache in align mode; on Hopper a GDN model's block is then a multiple of lcm(16, 64)), and
#: prefix caching off, whose block sizes are also vLLM 0.32's with or without prefix caching
PC_ON = VllmTarget()
PC_OFF = VllmTarget(enable_prefix_caching=False)


def _block_size(
    d: Deployment,
    layout: str,
    pack_size: int | str = "auto",
    target: VllmTarget = PC_ON,
    **cfg,
) -> int | None:
    try:
        model = models.load(d.model, tp_size=d.tp, kv_dtype=d.kv_dtype, **cfg)
        return make_plan(
            model, layout, memory=d.memory, max_num_seqs=1, pack_size=pack_size, target=target
        ).block_size
    except (ValueError, KeyError):
        return None


def holds_under(quoted: int, pc_on: int | None, pc_off: int | None) -> str:
    """Under which vLLM mode a quoted block size is what hybridkv computes."""
    on, off = quoted == pc_on, quoted == pc_off
    if on and off:
        return "both modes"
    if off:
        return "prefix caching off, or vLLM <= 0.32"
    if on:
        return "vLLM 0.33 default (prefix caching on)"
    return "**neither**"


def inflate_block_sizes(target: VllmTarget = PC_ON) -> dict[tuple[str, int, str], int]:
    """Inflate block size of every zoo model at TP 1, 2, 4, 8 and bf16/fp8 KV (where valid)."""
    out = {}
    for name in models.list_models():
        for tp in (1, 2, 4, 8):
            for kv in ("auto", "fp8"):
                b = _block_size(Deployment(name, tp, kv), "inflate", target=target)
                if b is not None:
                    out[(name, tp, kv)] = b
    return out


def seed_rows(small: bool = False) -> list[dict[str, str]]:
    """One row per quoted number: the source, our configuration, our number under vLLM 0.33's
    default and with prefix caching off, and the mode under which the two agree. Numbers without
    a named model list the zoo configurations that give them, with the mode."""
    zoo = set(models.list_models())
    census: dict[str, dict] = {}
    rows = []
    for s in SEED_NUMBERS:
        row = {
            "quoted": f"{s.quoted:,}" + ("" if s.observed else " (derived)"),
            "source": s.source,
            "configuration": s.what,
        }
        if s.deployment is not None or s.quoted == 672:
            d = s.deployment or Deployment("nemotron-nano-12b-v2")
            cfg = {"ssm_dtype": "bfloat16"} if s.quoted == 672 else {}
            layout = f"pack({s.pack_size})" if s.layout == "pack" else s.layout
            if d.model not in zoo:
                row.update(pc_on="model not in zoo", pc_off="-", holds="-")
            else:
                on = _block_size(d, s.layout, s.pack_size, PC_ON, **cfg)
                off = _block_size(d, s.layout, s.pack_size, PC_OFF, **cfg)
                row["pc_on"] = f"{on:,} ({layout})" if on else "-"
                row["pc_off"] = f"{off:,} ({layout})" if off else "-"
                row["holds"] = holds_under(s.quoted, on, off)
        elif small:
            row.update(pc_on="(full run only)", pc_off="(full run only)", holds="-")
        else:
            for key, target in (("pc_on", PC_ON), ("pc_off", PC_OFF)):
                if key not in census:
                    census[key] = inflate_block_sizes(target)
                tol = 16 if s.quoted == 400 else 0  # "~400": within one alignment step
                hits = sorted(
                    f"{m} TP{tp}{'' if kv == 'auto' else ' fp8'}"
                    for (m, tp, kv), b in census[key].items()
                    if abs(b - s.quoted) <= tol and s.family in m
                )
                shown = ", ".join(hits[:4]) + (
                    f" and {len(hits) - 4} more" if len(hits) > 4 else ""
                )
                row[key] = f"inflate gives it for: {shown}" if hits else "no zoo configuration"
            on_hit = not row["pc_on"].startswith("no zoo")
            off_hit = not row["pc_off"].startswith("no zoo")
            row["holds"] = (
                "both modes (consistent)"
                if on_hit and off_hit
                else "prefix caching off (consistent)"
                if off_hit
                else "vLLM 0.33 default (consistent)"
                if on_hit
                else "-"
            )
        rows.append(row)
    return rows


def markdown_table(rows: list[dict[str, str]], columns: list[tuple[str, str]]) -> str:
    head = "| " + " | ".join(h for _, h in columns) + " |"
    rule = "| " + " | ".join("---" for _ in columns) + " |"
    body = ["| " + " | ".join(str(r[k]) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def mark_bars(ax, xs: list[float], ys: list[float], missing: list[float] = ()) -> None:
    """Say what a bar chart cannot show: a bar of height 0 gets a "0" over its slot, a run that
    was not made an "n/a", so neither reads as a bar left out."""
    top = ax.get_ylim()[1]
    for x, y in zip(xs, ys):
        if y == 0:
            ax.text(x, 0.01 * top, "0", ha="center", va="bottom", fontsize=6)
    for x in missing:
        ax.text(x, 0.01 * top, "n/a", ha="center", va="bottom", fontsize=6, rotation=90)
