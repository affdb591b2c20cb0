"""Every figure and table of the paper, one function each, and the command that makes them.

    python -m paper.figures [--small] [--out DIR] [--only NAME ...] [--list]
                            [--jobs N] [--executor {local,ray}]

Figures go to ``paper/figures`` (the committed ones). ``--small`` runs a fast subset (three
models, short traces) for the tests and writes to ``paper/figures-small`` (git-ignored), so it
never overwrites the committed figures with small-run numbers. Figures that cannot be made (a
GPU results file that is not committed, a model missing from the zoo) are skipped with the
reason printed and written to ``MANIFEST.md``; they never draw placeholder numbers. The
figures' independent simulator runs go to ``--jobs`` local processes or, with ``--executor
ray``, to Ray (``RAY_ADDRESS``'s cluster or a local one); the files do not depend on where.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import math
import re
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from hybridkv import costmodel, models, traces, viz
from hybridkv.executors import (
    ExecutorUnavailable,
    add_executor_arguments,
    executor_options,
    open_executor,
)
from hybridkv.layouts import VllmTarget, make_plan

from . import data
from .data import Deployment, GiB, available, layout_label, markdown_table, plan
from .registry import FIGURES, PACKAGES, Context, Skip, register, run

RESULTS = Path(__file__).resolve().parent / "results"
#: the committed figures, and where ``--small`` runs go unless told otherwise (git-ignored)
OUT = Path(__file__).resolve().parent / "figures"
SMALL_OUT = Path(__file__).resolve().parent / "figures-small"

LAYOUT_COLORS = {
    "inflate": "#d62728",
    "pack": "#ff7f0e",
    "aggregate": "#bcbd22",
    "per_group": "#1f77b4",
    "two_level": "#2ca02c",
}


def _study(ctx: Context) -> list[Deployment]:
    found = available(data.SMALL_STUDY if ctx.small else data.STUDY)
    if not found:
        raise Skip("none of the study's models is in the zoo")
    return found


# ---- (i) block size per layout ------------------------------------------------------------------
@register(
    "block_sizes",
    "Sharing one page size forces attention blocks of hundreds to thousands of tokens; per-group "
    "and two-level pools keep 16.",
)
def block_sizes(ctx: Context) -> list[Path]:
    deps = _study(ctx)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(deps) + 2), 4))
    width = 0.8 / len(data.LAYOUT_ORDER)
    rows = []
    for j, layout in enumerate(data.LAYOUT_ORDER):
        xs, ys = [], []
        for i, d in enumerate(deps):
            p = plan(d, layout)
            if p is None:
                continue
            xs.append(i + (j - (len(data.LAYOUT_ORDER) - 1) / 2) * width)
            ys.append(p.block_size)
            rows.append((d.label, layout_label(p), p.block_size))
        bars = ax.bar(xs, ys, width, label=layout, color=LAYOUT_COLORS[layout])
        ax.bar_label(bars, labels=[str(y) for y in ys], fontsize=6, rotation=90, padding=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(range(len(deps)))
    ax.set_xticklabels([d.label for d in deps], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("attention block size (tokens, log scale)")
    ax.set_title("Block size per layout (vLLM's rule is 'inflate'; pack size chosen by 'auto')")
    ax.legend(fontsize=8, ncol=5, loc="upper left")
    ax.set_ylim(8, 2 ** math.ceil(math.log2(max(r[2] for r in rows)) + 2))
    table = markdown_table(
        [{"model": m, "layout": lay, "block": f"{b:,}"} for m, lay, b in rows],
        [("model", "deployment"), ("layout", "layout"), ("block", "block size (tokens)")],
    )
    return [ctx.save(fig, "block_sizes"), ctx.table("block_sizes", table)]


# ---- (ii) the pack effect -----------------------------------------------------------------------
PACK_CASES = (
    Deployment("qwen3.5-397b-a17b", tp=2),
    Deployment("qwen3.5-397b-a17b", tp=2, kv_dtype="fp8"),
    Deployment("qwen3.5-35b-a3b"),
)


@register(
    "pack_effect",
    "Packing N attention layers per page divides the inflated block by about N; what it costs in "
    "capacity depends on N (the summary is computed from the table).",
)
def pack_effect(ctx: Context) -> list[Path]:
    cases = available(PACK_CASES[2:] if ctx.small else PACK_CASES)
    if not cases:
        raise Skip("the Qwen3.5 models are not in the zoo")
    fig, (ax_b, ax_c) = plt.subplots(1, 2, figsize=(10, 3.8))
    rows = []
    facts = []  # per deployment: (label, block at N=1, smallest block and its N, caps split)
    for d in cases:
        n_attn = len(data.load(d.model, d.tp, d.kv_dtype).attention_layers)
        ns, blocks, caps = [], [], []
        for n in range(1, n_attn + 1):
            p = plan(d, "pack", n)
            if p is None:
                continue
            ns.append(n)
            blocks.append(p.block_size)
            caps.append(100 * p.capacity.fraction_of_ideal)
            rows.append(
                {
                    "deployment": d.label,
                    "n": str(n),
                    "block": f"{p.block_size:,}",
                    "cap": f"{caps[-1]:.2f}",
                }
            )
        if ns:
            k = int(np.argmin(blocks))
            divides = [c for n, c in zip(ns, caps) if n > 1 and n_attn % n == 0]
            other = [c for n, c in zip(ns, caps) if n_attn % n]
            facts.append((d.label, blocks[0], blocks[k], ns[k], caps[0], divides, other))
        (line,) = ax_b.plot(ns, blocks, marker="o", ms=3, label=d.label)
        ax_c.plot(ns, caps, marker="o", ms=3, color=line.get_color(), label=d.label)
        ax_b.annotate(
            f"{blocks[0]}",
            (ns[0], blocks[0]),
            textcoords="offset points",
            xytext=(4, 2),
            fontsize=7,
            color=line.get_color(),
        )
        if 4 in ns:
            k = ns.index(4)
            ax_b.annotate(
                f"{blocks[k]}",
                (4, blocks[k]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
                color=line.get_color(),
            )
    ax_b.set_yscale("log", base=2)
    ax_b.set_xlabel("pack size N (attention layers per page)")
    ax_b.set_ylabel("block size (tokens, log scale)")
    ax_b.set_title("Block size vs pack size (N=1 is vLLM's inflate)")
    ax_c.set_xlabel("pack size N (attention layers per page)")
    ax_c.set_ylabel("token capacity (% of ideal)")
    ax_c.set_title("Capacity vs pack size (40 GiB/rank, 256 requests)")
    ax_b.legend(fontsize=8)
    table = markdown_table(
        rows,
        [
            ("deployment", "deployment"),
            ("n", "pack size N"),
            ("block", "block size (tokens)"),
            ("cap", "capacity (% of ideal)"),
        ],
    )
    summary = ctx.summary("pack_effect", _pack_summary(facts))
    return [ctx.save(fig, "pack_effect"), ctx.table("pack_effect", f"{summary}\n\n{table}")]


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.0f}%" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f}%"


def _pack_summary(facts: list) -> str:
    """What the pack-size table shows, in words, from its numbers."""
    parts = []
    for label, b1, bmin, nmin, cap1, divides, other in facts:
        text = (
            f"{label}: block {b1:,} at N=1 (capacity {cap1:.0f}% of ideal), {bmin:,} at N={nmin}"
        )
        if divides:
            text += f"; capacity {_span(divides)} where N divides the attention layers"
        if other:
            text += f", {_span(other)} where it does not"
        parts.append(text)
    worst = min((min(f[5] + f[6]) for f in facts if f[5] or f[6]), default=None)
    tail = (
        f" Capacity falls as low as {worst:.0f}% of ideal: a smaller block can cost real capacity."
        if worst is not None and worst < 90
        else ""
    )
    return (
        "Packing N attention layers per page divides the block by about N. "
        + "; ".join(parts)
        + "."
        + tail
    )


# ---- (iii) capacity as % of ideal ---------------------------------------------------------------
@register(
    "capacity",
    "At a fixed budget most layouts keep over 97% of the ideal token capacity; the outliers are "
    "padding: inflate's padded state pages and aggregate's whole-kind pages.",
)
def capacity(ctx: Context) -> list[Path]:
    deps = _study(ctx)
    grid = np.full((len(deps), len(data.LAYOUT_ORDER)), np.nan)
    packs: dict[tuple[int, int], int] = {}  # the pack size auto chose, per cell
    rows = []
    for i, d in enumerate(deps):
        for j, layout in enumerate(data.LAYOUT_ORDER):
            p = plan(d, layout)
            if p is None:
                continue
            grid[i, j] = 100 * p.capacity.fraction_of_ideal
            if layout == "pack":
                packs[i, j] = p.pack_size
            rows.append(
                {
                    "deployment": d.label,
                    "layout": layout_label(p),
                    "tokens": f"{p.capacity.token_capacity:,}",
                    "ideal": f"{p.capacity.ideal_token_capacity:,}",
                    "pct": f"{grid[i, j]:.2f}",
                }
            )
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(deps) + 1.6))
    finite = grid[np.isfinite(grid)]
    im = ax.imshow(grid, cmap="viridis", vmin=float(finite.min()), vmax=100, aspect="auto")
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            v = grid[i, j]
            text = "n/a" if np.isnan(v) else f"{v:.1f}"
            if (i, j) in packs:
                text += f" ({packs[i, j]})"
            # dark text on the light (yellow-green) end of viridis, white on the dark end
            r, g, b, _ = im.cmap(im.norm(v)) if np.isfinite(v) else (0, 0, 0, 1)
            light = 0.299 * r + 0.587 * g + 0.114 * b > 0.5
            ax.text(j, i, text, ha="center", va="center", fontsize=7,
                    color="black" if light else "white")  # fmt: skip
    ax.set_xticks(range(len(data.LAYOUT_ORDER)))
    ax.set_xticklabels(["pack(N)" if x == "pack" else x for x in data.LAYOUT_ORDER])
    ax.set_yticks(range(len(deps)))
    ax.set_yticklabels([d.label for d in deps], fontsize=8)
    ax.grid(False)
    ax.set_title(
        "Token capacity, % of ideal (40 GiB/rank, 256 running requests' states);\n"
        "pack(N): N attention layers a page, as auto picks it (in brackets)",
        fontsize=9,
    )
    fig.colorbar(im, ax=ax, label="% of ideal token capacity")
    table = markdown_table(
        rows,
        [
            ("deployment", "deployment"),
            ("layout", "layout"),
            ("tokens", "token capacity"),
            ("ideal", "ideal"),
            ("pct", "% of ideal"),
        ],
    )
    return [ctx.save(fig, "capacity"), ctx.table("capacity", table)]


#: the families transformers ships that the zoo has no released config of (issue: the newest
#: hybrids), planned at their config classes' default sizes
NEW_FAMILIES = (
    "glm5_next",
    "qwen4_exp",
    "bailing_hybrid",
    "lfm3",
    "granite_swa",
    "granitemoe_swa",
    "rwkv",
    "xlstm",
    "inkling_mm_model",
    "zaya",
)


#: requests of the chat workload each new family is simulated with (small: a smoke run of one
#: small family, whose parameters transformers builds in a fraction of a second)
NEW_FAMILY_REQUESTS = 300
NEW_FAMILIES_SMALL = ("lfm3",)


def _new_family_model(family: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return models.from_hf_config(CONFIG_MAPPING[family]().to_dict())


def _new_family_run(task: tuple[str, str, int]) -> dict[str, Any]:
    """``(family, layout, requests)`` -> what the simulator measured on the chat workload with
    vLLM's ``align`` (module level: :meth:`Context.map` runs it in a worker process), and the
    parameters the roofline priced it with (counted from the config)."""
    from hybridkv import costmodel, traces
    from hybridkv.layouts import make_plan
    from hybridkv.sim import SimConfig, simulate

    family, layout, n = task
    model = _new_family_model(family)
    try:
        params = costmodel.param_count(model)
    except ValueError as exc:  # transformers cannot build the config: no roofline for it
        return {"why": f"- {family}: not simulated: {exc}"}
    plan = make_plan(model, layout, memory="40GiB", max_num_seqs=256)
    trace = traces.multi_turn_chat(n, seed=0)
    config = SimConfig(checkpoint_policy="align", breakdowns=0, params=params)
    summary = simulate(plan, model, trace, config).summary()
    return {
        "hit": f"{100 * summary['token_hit_rate']:.1f}",
        "ttft": f"{summary['ttft_p50_ms']:,.0f}",
        "params": f"{params.total / 1e9:,.2f} / {params.active / 1e9:,.2f}",
    }


@register(
    "new_families",
    "The newest families at transformers' default sizes (not released checkpoints): what each "
    "layer kind keeps, the block and token capacity each layout gives them in 40 GiB, and the "
    "simulator's hit rate and TTFT on the chat workload.",
)
def new_families(ctx: Context) -> list[Path]:
    from hybridkv.layouts import make_plan

    rows, refused, runs = [], [], []
    n = 20 if ctx.small else NEW_FAMILY_REQUESTS
    for family in NEW_FAMILIES_SMALL if ctx.small else NEW_FAMILIES:
        model = _new_family_model(family)
        kinds = ", ".join(f"{n} {k}" for k, n in model.layer_kinds.items())
        for layout in data.LAYOUT_ORDER:
            try:
                p = make_plan(model, layout, memory="40GiB", max_num_seqs=256)
            except ValueError as exc:
                block, tokens, pct = "does not fit", "-", "-"
                refused.append(f"- {family}, {layout}: {exc}")
            else:
                block = f"{p.block_size:,}"
                tokens = f"{p.capacity.token_capacity:,}"
                pct = f"{100 * p.capacity.fraction_of_ideal:.1f}"
                runs.append((len(rows), (family, layout, n)))
                if not model.attention_layers:  # states only: no token is cached per token
                    block, tokens, pct = "-", "no KV", "-"
            rows.append(
                {
                    "family": family,
                    "layers": kinds,
                    "kv": f"{model.kv_bytes_per_token:,}",
                    "state": f"{model.state_bytes_per_seq:,}"
                    f" ({model.state_bytes_per_seq / 2**20:.1f} MiB)",
                    "layout": layout,
                    "block": block,
                    "tokens": tokens,
                    "pct": pct,
                    "params": "-",
                    "hit": "-",
                    "ttft": "-",
                }
            )
    unsimulated = []
    for (i, _), measured in zip(runs, ctx.map(_new_family_run, [task for _, task in runs])):
        why = measured.pop("why", None)
        if why is not None and why not in unsimulated:
            unsimulated.append(why)
        rows[i].update(measured)
    table = markdown_table(
        rows,
        [
            ("family", "model_type"),
            ("layers", "cache layers"),
            ("kv", "KV B/token"),
            ("state", "state B/request"),
            ("layout", "layout"),
            ("block", "block (tokens)"),
            ("tokens", "token capacity"),
            ("pct", "% of ideal"),
            ("params", "params B (total / active)"),
            ("hit", f"chat hit % ({n} req.)"),
            ("ttft", "TTFT p50 ms"),
        ],
    )
    note = (
        "Sizes: transformers' config classes' defaults (`CONFIG_MAPPING[model_type]()`), read by "
        "`hybridkv.models.from_hf_config` (bf16, TP 1; 40 GiB of cache, 256 running requests' "
        "states). They are not released checkpoints' configs: Qwen4-Exp's defaults have no QSA "
        "indexer and no PLE layers. Indexer keys in transformers' per-token layout (vLLM 0.33's "
        "pooled layout is not modelled). Simulated: `traces.multi_turn_chat(n, seed=0)` with "
        "vLLM's `align` on each plan that fits, H100 roofline, the parameters counted from the "
        "config by transformers on the meta device (`hybridkv.models.param_count`: routed "
        "experts at top_k / num_experts, vision towers left out)."
    )
    why = "\n".join(["", "", "Plans that do not fit:", "", *refused]) if refused else ""
    if unsimulated:
        why += "\n".join(["", "", "Not simulated:", "", *unsimulated])
    return [ctx.table("new_families", f"{note}\n\n{table}{why}")]


# ---- (iv) padding -------------------------------------------------------------------------------
@register(
    "padding",
    "Padded state pages and unfilled packs are where shared-page layouts lose memory; dedicated "
    "pools pad only to 16 bytes.",
)
def padding(ctx: Context) -> list[Path]:
    deps = _study(ctx)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(deps) + 2), 4))
    width = 0.8 / len(data.LAYOUT_ORDER)
    rows = []
    for j, layout in enumerate(data.LAYOUT_ORDER):
        xs, pad, unusable = [], [], []
        for i, d in enumerate(deps):
            p = plan(d, layout)
            if p is None:
                continue
            xs.append(i + (j - (len(data.LAYOUT_ORDER) - 1) / 2) * width)
            pad.append(100 * p.capacity.padding_bytes / p.config.memory_bytes)
            unusable.append(100 * p.capacity.unusable_bytes / p.config.memory_bytes)
            rows.append(
                {
                    "deployment": d.label,
                    "layout": layout_label(p),
                    "pad": f"{pad[-1]:.3f}",
                    "unusable": f"{unusable[-1]:.3f}",
                }
            )
        ax.bar(xs, pad, width, color=LAYOUT_COLORS[layout], label=f"{layout}: padding")
        ax.bar(
            xs,
            unusable,
            width,
            bottom=pad,
            color=LAYOUT_COLORS[layout],
            alpha=0.35,
            hatch="//",
            edgecolor="white",
        )
    ax.set_xticks(range(len(deps)))
    ax.set_xticklabels([d.label for d in deps], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("% of the cache budget")
    ax.set_title("Padding (solid) and unusable tail (hatched) by layout, 40 GiB/rank")
    ax.legend(fontsize=7, ncol=3)
    table = markdown_table(
        rows,
        [
            ("deployment", "deployment"),
            ("layout", "layout"),
            ("pad", "padding (% of budget)"),
            ("unusable", "unusable (% of budget)"),
        ],
    )
    return [ctx.save(fig, "padding"), ctx.table("padding", table)]


# ---- (v) memory maps ----------------------------------------------------------------------------
MAP_MODELS = ("qwen3.5-0.8b", "qwen3.5-4b", "qwen3-next-80b-a3b")


@register(
    "memory_maps",
    "Where each layer's K, V and state bytes sit in one allocation unit of each layout, drawn "
    "from the plans' placements.",
)
def memory_maps(ctx: Context) -> list[Path]:
    zoo = [m for m in MAP_MODELS if m in set(data.models.list_models())]
    if not zoo:
        raise Skip("none of the memory-map models is in the zoo")
    d = Deployment(zoo[0], memory=8 * GiB, max_num_seqs=16)
    plans = {}
    for layout in data.LAYOUT_ORDER:
        p = plan(d, layout, 2 if layout == "pack" else "auto")
        if p is not None:
            plans[layout_label(p)] = p
    fig = viz.memory_map_figure(plans, model_label=d.model)
    return [ctx.save(fig, "memory_maps")]


# ---- (vi) the seeds' numbers --------------------------------------------------------------------
@register(
    "seed_numbers",
    "hybridkv reproduces the block sizes reported in the seeds and issues (2096, 1056, 528, "
    "544/272, 672, pack 4 -> 272), each under the vLLM mode that produced it.",
)
def seed_numbers(ctx: Context) -> list[Path]:
    rows = data.seed_rows(small=ctx.small)
    table = markdown_table(
        rows,
        [
            ("quoted", "quoted"),
            ("source", "source"),
            ("configuration", "configuration"),
            ("pc_on", "hybridkv, vLLM 0.33 default (prefix caching on)"),
            ("pc_off", "hybridkv, prefix caching off (= vLLM 0.32)"),
            ("holds", "the quoted number holds under"),
        ],
    )
    note = (
        "\n\nvLLM 0.33 turns prefix caching on by default for hybrid models, which puts the Mamba "
        "cache in align mode; on Hopper, Qwen3-Next and Qwen3.5 then prefill their GDN layers "
        "with FlashInfer, whose checkpoints fall every 64 tokens, and the block becomes a "
        "multiple of lcm(16, 64) (`Platform._align_hybrid_block_size`). Without prefix "
        "caching, and in vLLM 0.32 either way, the block is a multiple of 16. Mamba-2, "
        "Mamba-1, short-conv and linear-attention models get the same block in both modes."
    )
    return [ctx.table("seed_numbers", table + note)]


@register(
    "hit_rate_anchors",
    "Measured hit rates on repeated prompts follow floor(P/B)*B/P with hybridkv's block sizes.",
)
def hit_rate_anchors(ctx: Context) -> list[Path]:
    table = markdown_table(
        data.hit_rate_rows(),
        [
            ("quoted", "measured hit rate"),
            ("source", "source"),
            ("prompt", "repeated prompt P (tokens)"),
            ("block", "block size B here"),
            ("full", "floor(P/B)*B/P"),
            ("align", "align rule"),
        ],
    )
    note = (
        "\n\nPR #35703's prompts are a 2,000-token shared prefix plus a suffix whose length the "
        "thread does not give, so its rates are over whole prompts; the formula column is over "
        "the prefix."
    )
    return [ctx.table("hit_rate_anchors", table + note)]


# ---- workloads ----------------------------------------------------------------------------------
def _workloads(ctx: Context) -> dict[str, traces.Trace]:
    n = 300 if ctx.small else 3000
    return {name: traces.generate(name, n, seed=0) for name in traces.WORKLOADS}


@register(
    "workloads",
    "The four synthetic workloads: sizes, lengths and how much of their prompts is shared.",
)
def workloads(ctx: Context) -> list[Path]:
    rows = []
    for name, tr in _workloads(ctx).items():
        s = tr.summary()
        rows.append(
            {
                "name": f"`{name}`",
                "requests": f"{int(s['requests']):,}",
                "sessions": f"{int(s['sessions']):,}",
                "median": f"{s['prompt_median']:,.0f}",
                "p99": f"{s['prompt_p99']:,.0f}",
                "out": f"{s['output_median']:,.0f}",
                "shared": f"{100 * s.get('shared_fraction', 0):.1f}",
            }
        )
    table = markdown_table(
        rows,
        [
            ("name", "workload"),
            ("requests", "requests"),
            ("sessions", "sessions"),
            ("median", "median prompt (tokens)"),
            ("p99", "p99 prompt (tokens)"),
            ("out", "median output (tokens)"),
            ("shared", "shared prompt tokens (%)"),
        ],
    )
    note = (
        "\n\nGenerated with `hybridkv.traces.generate(name, n, seed=0)` and the default "
        "parameters documented in `hybridkv/traces/synthetic.py`."
    )
    return [ctx.table("workloads", table + note)]


# ---- prefix reuse bound -------------------------------------------------------------------------
BLOCKS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@register(
    "prefix_reuse_bound",
    "Block granularity alone caps the prefix-cache hit rate: with an unlimited cache, 2096-token "
    "blocks serve far less of the shared prompt tokens than 16-token blocks.",
)
def prefix_reuse_bound(ctx: Context) -> list[Path]:
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = []
    for name, tr in _workloads(ctx).items():
        full = [100 * traces.hit_fraction(tr, b, "full") for b in BLOCKS]
        align = [100 * traces.hit_fraction(tr, b, "align") for b in BLOCKS]
        (line,) = ax.plot(BLOCKS, full, marker="o", ms=3, label=f"{name}")
        ax.plot(BLOCKS, align, ls="--", color=line.get_color(), lw=1)
        for b, f, a in zip(BLOCKS, full, align):
            rows.append({"w": name, "b": str(b), "f": f"{f:.1f}", "a": f"{a:.1f}"})
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens, log scale)")
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Upper bound on token hit rate, unlimited cache (dashed: vLLM align rule)")
    ax.legend(fontsize=8)
    table = markdown_table(
        rows,
        [("w", "workload"), ("b", "block size"), ("f", "full blocks (%)"), ("a", "align (%)")],
    )
    return [ctx.save(fig, "prefix_reuse_bound"), ctx.table("prefix_reuse_bound", table)]


# ---- roofline TTFT and decode throughput --------------------------------------------------------
#: a dense and a mixture-of-experts model of similar size, each at TP2 (weights + 40 GiB of cache
#: per rank fit an 80 GB H100)
COST_MODELS = (Deployment("qwen3.5-27b", tp=2), Deployment("qwen3.5-35b-a3b", tp=2))


def _cost_deployments(ctx: Context) -> list[Deployment]:
    found = available(COST_MODELS[1:] if ctx.small else COST_MODELS)
    if not found:
        raise Skip("the cost-model deployments' models are not in the zoo")
    return found


@register(
    "ttft_roofline",
    "Prompt tokens that block granularity keeps out of the cache are recomputed: it shows in "
    "TTFT where prefill is compute-bound (dense), hardly where it is bound by reading an MoE's "
    "weights.",
)
def ttft_roofline(ctx: Context) -> list[Path]:
    deps = _cost_deployments(ctx)
    gpu = costmodel.H100_SXM
    suffix = 256
    prefixes = np.arange(0, 16385, 256 if ctx.small else 64)
    fig, axes = plt.subplots(1, len(deps), figsize=(5.2 * len(deps), 3.8), squeeze=False)
    rows = []
    for d, ax in zip(deps, axes[0]):
        model = data.load(d.model, d.tp, d.kv_dtype)
        cases = []
        for layout in ("per_group", "pack", "inflate"):
            p = plan(d, layout, 4 if layout == "pack" else "auto")
            if p is not None:
                cases.append((f"{layout_label(p)}: {p.block_size}-token blocks", p, "full"))
        inflate = plan(d, "inflate")
        if inflate is not None:
            cases.append((f"inflate, align rule: {inflate.block_size}", inflate, "align"))
        for label, p, mode in cases:
            t = [
                1e3
                * costmodel.ttft(
                    model,
                    gpu,
                    int(pfx) + suffix,
                    int(traces.block_hit_tokens(int(pfx), p.block_size, mode)),
                )
                for pfx in prefixes
            ]
            color = LAYOUT_COLORS[p.layout] if mode == "full" else "black"
            ax.plot(prefixes, t, label=label, ls=":" if mode == "align" else "-", color=color)
            for pfx in (512, 1024, 2048, 4096, 8192, 16384):
                k = int(np.searchsorted(prefixes, pfx))
                rows.append({"d": d.label, "case": label, "p": f"{pfx:,}", "t": f"{t[k]:.2f}"})
        ax.set_xlabel("shared prefix already in the cache (tokens)")
        ax.set_ylabel("roofline TTFT (ms)")
        ax.set_title(f"{d.label} on {gpu.name}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"TTFT of a {suffix}-token question after a cached shared prefix", fontsize=10)
    fig.tight_layout()
    table = markdown_table(
        rows,
        [
            ("d", "deployment"),
            ("case", "layout"),
            ("p", "shared prefix (tokens)"),
            ("t", "TTFT (ms)"),
        ],
    )
    return [ctx.save(fig, "ttft_roofline"), ctx.table("ttft_roofline", table)]


@register(
    "decode_roofline",
    "Roofline decode throughput follows the batch each layout can hold at a given context; the "
    "layouts' capacities differ by little, so their throughputs do too.",
)
def decode_roofline(ctx: Context) -> list[Path]:
    deps = _cost_deployments(ctx)
    gpu = costmodel.H100_SXM
    contexts = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
    fig, axes = plt.subplots(1, len(deps), figsize=(5.2 * len(deps), 3.8), squeeze=False)
    rows = []
    for d, ax in zip(deps, axes[0]):
        model = data.load(d.model, d.tp, d.kv_dtype)
        for layout in data.LAYOUT_ORDER:
            p = plan(d, layout)
            if p is None:
                continue
            batch = [costmodel.requests_that_fit(p, c) for c in contexts]
            tput = [costmodel.decode_throughput(model, gpu, b, c) for b, c in zip(batch, contexts)]
            ax.plot(
                contexts,
                tput,
                marker="o",
                ms=3,
                label=layout_label(p),
                color=LAYOUT_COLORS[layout],
            )
            for c, b, t in zip(contexts, batch, tput):
                rows.append(
                    {
                        "d": d.label,
                        "l": layout_label(p),
                        "c": f"{c:,}",
                        "b": str(b),
                        "t": f"{t:,.0f}",
                    }
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context per request (tokens, log scale)")
        ax.set_ylabel("decode throughput (tokens/s per rank, log scale)")
        ax.set_title(f"{d.label}, 40 GiB/rank, at most {d.max_num_seqs} requests", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"Roofline decode throughput with the batch each layout holds ({gpu.name})", fontsize=10
    )
    fig.tight_layout()
    table = markdown_table(
        rows,
        [
            ("d", "deployment"),
            ("l", "layout"),
            ("c", "context (tokens)"),
            ("b", "requests that fit"),
            ("t", "tokens/s per rank"),
        ],
    )
    return [ctx.save(fig, "decode_roofline"), ctx.table("decode_roofline", table)]


# ---- (vii) kernel results -----------------------------------------------------------------------
@register(
    "kernels",
    "Measured kernels on a GPU: the goals of the kernel issues met or missed, and every "
    "benchmark row (from paper/results/[run/]kernels-*.json and gpu-suite-*.json, when "
    "committed).",
)
def kernels(ctx: Context) -> list[Path]:
    # a GPU suite run's files sit together, in paper/results/ or a folder of their own
    runs = sorted(RESULTS.glob("kernels-*.json")) + sorted(RESULTS.glob("*/kernels-*.json"))
    before = RESULTS / "kernels-before-h200-2026-11-26.md"
    if not runs:
        note = (
            "No GPU results for the current kernels: no `paper/results/kernels-*.json` is "
            "committed yet, so the paper reports no measured time for them. Run "
            "`python -m paper.gpu_suite` on a GPU and rerun `python -m paper.figures`."
        )
        if before.exists():
            note += (
                f" The kernels before the plan/run rework were measured on one H200: "
                f"`paper/results/{before.name}`."
            )
        return [ctx.table("kernels", note)]
    sections, out = [], []
    for path in runs:
        run = json.loads(path.read_text())
        meta, rows = run["meta"], run["rows"]
        tag = path.stem.removeprefix("kernels-")
        folder = "" if path.parent == RESULTS else f"{path.parent.name}: "
        head = (
            f"### {folder}{meta['device']} ({meta['date'][:10]}, torch {meta['torch']}, triton "
            f"{meta['triton']}, commit `{meta['commit'][:10]}`"
            + (", uncommitted changes" if meta.get("dirty") else "")
            + f"; copy bandwidth {meta['copy_bandwidth_gbps']:.0f} GB/s)"
        )
        suite = path.parent / f"gpu-suite-{tag}.json"
        goals = json.loads(suite.read_text())["goals"] if suite.exists() else []
        goal_rows = [
            {
                "issue": g["issue"],
                "goal": g["text"],
                "status": g["status"],
                "worst": f"{g['worst']['value']} {g.get('unit', '')}" if "worst" in g else "",
                "case": g.get("worst", {}).get("case", ""),
            }
            for g in goals
        ]
        cols = [(c, c) for c in ("case", "impl", "model", "layout", "block_size", "batch")]
        cols += [(c, c) for c in ("context", "q_lens", "kv_dtype", "ms", "pct_copy", "tflops")]
        cols += [("config", "config")]
        shown = [{k: _fmt(r.get(k)) for k, _ in cols} for r in rows]
        text = head + "\n\n"
        if goal_rows:
            text += markdown_table(goal_rows, [(c, c) for c in goal_rows[0]]) + "\n\n"
        sections.append(text + markdown_table(shown, cols))
        # bandwidth-bound rows only: a row that also counts FLOPs (a prefill chunk) is judged
        # by its TFLOP/s, and its bytes' share would read as a slow kernel
        bw = [r for r in rows if r.get("pct_copy") is not None and r.get("tflops") is None]
        if bw:
            keys = ("case", "impl", "layout", "op", "batch", "context", "tokens", "q_dtype")
            labels = [" ".join(str(r[k]) for k in keys if r.get(k) is not None) for r in bw]
            fig, ax = plt.subplots(figsize=(7, 0.22 * len(bw) + 1.5))
            ax.barh(range(len(bw)), [r["pct_copy"] for r in bw])
            ax.set_yticks(range(len(bw)))
            ax.set_yticklabels(labels, fontsize=5)
            ax.invert_yaxis()
            ax.set_xlabel("% of the device's copy bandwidth")
            ax.set_title(f"Kernel bandwidth: {meta['device']}")
            name = tag if path.parent == RESULTS else f"{path.parent.name}_{tag}"
            out.append(ctx.save(fig, f"kernels_{name}"))
    out.append(ctx.table("kernels", "\n\n".join(sections)))
    return out


def _fmt(v: object) -> object:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return "x".join(map(str, v))
    return "" if v is None else v


@register(
    "kernels_compiled",
    "Compiled for A100 (sm_80) and H100 (sm_90) without a GPU, every launch of every kernel "
    "has a config that fits and none spills; the table gives registers, shared memory and the "
    "hot loop's address math per MMA.",
)
def kernels_compiled(ctx: Context) -> list[Path]:
    from paper import compile_kernels

    report = _bench("compile-kernels.json")
    text = compile_kernels.markdown(report["summary"], report["provenance"], report["failures"])
    before = RESULTS / "compile-kernels-before.json"
    if before.exists():  # the kernels before the page walk, for comparison
        old = json.loads(before.read_text())
        prov = old["provenance"]
        text += (
            f"\n## Before: the kernels at commit `{prov['kernels_commit'][:10]}`\n\n"
            "The same check on the kernels as they were before the changes this table "
            "describes (quick matrix).\n\n"
            + compile_kernels.markdown(old["summary"], prov, old["failures"])
            + "\n## Attention hot loops, case by case\n\n"
            "Each attention case of the quick matrix before and after: the best config's "
            "integer instructions (IMAD + LEA + IADD3) in the SASS hot loop per key it "
            "processes (one warp's instruction stream; loop count / BLOCK_N), the most K/V "
            "(or latent) tiles a config keeps in shared memory (the pipeliner's buffers; "
            "`0` where tiles go through registers only), and the largest spill. `error`: no "
            "config compiled.\n\n"
            + _compile_compare(old["rows"], _csv_rows(RESULTS / "compile-kernels.csv"))
        )
    return [ctx.table("kernels_compiled", text)]


def _csv_rows(path: Path) -> list[dict]:
    if not path.exists():
        raise Skip(f"paper/results/{path.name} is not committed")
    with path.open() as f:
        return list(csv.DictReader(f))


def _compile_compare(before: list[dict], after: list[dict]) -> str:
    def per_case(rows: list[dict]) -> dict[tuple[str, int], dict]:
        out: dict[tuple[str, int], dict] = {}
        for r in rows:
            family = r["case"].split("/")[0]
            if family not in ("decode", "prefill", "mla") or "reduce" in r["kernel"]:
                continue
            d = out.setdefault((r["case"], int(r["arch"])), {"ops": [], "bufs": [0], "spill": 0})
            if r["status"] != "ok":
                continue
            block_n = int(re.search(r"BLOCK_N=(\d+)", r["config"]).group(1))
            if r.get("loop_int_ops") not in (None, ""):
                d["ops"].append(float(r["loop_int_ops"]) / block_n)
            # multi-buffered tiles are 3-D memdescs (buffers x rows x cols); 2-D ones are single
            dims = [b.split("x")[:-1] for b in str(r.get("ttgir_buffers") or "").split()]
            d["bufs"].append(max([int(x[0]) for x in dims if len(x) == 3] or [0]))
            d["spill"] = max(d["spill"], int(r.get("spill_stores") or 0))
        return out

    old, new = per_case(before), per_case(after)

    def cell(d: dict | None, key: str) -> str:
        if d is None:
            return "-"
        if key == "ops":
            return f"{min(d[key]):.2g}" if d[key] else "error"
        return str(max(d["bufs"])) if key == "bufs" else str(d["spill"])

    rows = [
        {
            "case": case,
            "arch": f"sm_{arch}",
            **{f"{k}_{w}": cell(src.get((case, arch)), k) for k in ("ops", "bufs", "spill")
               for w, src in (("old", old), ("new", new))},
        }
        for case, arch in sorted(old)
    ]  # fmt: skip
    return markdown_table(
        rows,
        [
            ("case", "case"),
            ("arch", "arch"),
            ("ops_old", "int ops / key, before"),
            ("ops_new", "int ops / key, now"),
            ("bufs_old", "K/V buffers, before"),
            ("bufs_new", "K/V buffers, now"),
            ("spill_old", "spill B, before"),
            ("spill_new", "spill B, now"),
        ],
    )


# ---- CPU benchmarks of the allocator and the simulator ------------------------------------------
def _bench(name: str) -> dict:
    path = RESULTS / name
    if not path.exists():
        raise Skip(f"paper/results/{name} is not committed")
    return json.loads(path.read_text())


def _before(name: str, keys: tuple[str, ...]) -> tuple[dict[tuple, dict], dict] | None:
    """The benchmark's rows at an earlier commit (``<name>-before.json``, measured right before
    ``<name>.json`` on the same machine), by ``keys``, and its meta; None when not committed."""
    path = RESULTS / name.replace(".json", "-before.json")
    if not path.exists():
        return None
    got = json.loads(path.read_text())
    return {tuple(r.get(k) for k in keys): r for r in got["rows"]}, got["meta"]


def _before_note(meta: dict, now: dict) -> str:
    """Says which commit the *before* columns ran and whether they ran back to back with the
    current ones (within two hours on the same machine) or are an earlier measurement."""
    then, this = str(meta.get("commit", "?"))[:10], str(now.get("commit", "?"))[:10]
    try:
        gap = abs(
            dt.datetime.fromisoformat(str(now["date"]))
            - dt.datetime.fromisoformat(str(meta["date"]))
        )
    except (KeyError, ValueError):
        gap = None
    if gap is not None and gap <= dt.timedelta(hours=2):
        return (
            f"*before*: the same benchmark at commit `{then}` ({meta.get('date', '?')}), run on "
            f"the same machine just before this one (`{this}`), so the two columns compare "
            "code, not machines."
        )
    return (
        f"*before*: the same benchmark at commit `{then}`, an earlier measurement "
        f"({meta.get('date', '?')}, {meta.get('machine', 'machine not recorded')}), not run "
        f"back to back with this one (`{this}`): the columns compare code and runs."
    )


def _bench_meta(meta: dict) -> str:
    return (
        f"Measured on {meta.get('cpus', '?')} CPU cores ({meta.get('machine', '?')}), "
        f"{meta.get('date', '?')}, commit `{str(meta.get('commit', '?'))[:10]}`."
    )


@register(
    "alloc_overhead",
    "The allocator's bookkeeping for a decode step of 256 requests takes a median 0.1-0.6 ms of "
    "one CPU core, over every layout and policy.",
)
def alloc_overhead(ctx: Context) -> list[Path]:
    data_ = _bench("alloc-cpu.json")
    rows = [
        {
            **r,
            "median": f"{r['decode_step_ms_median']:.3f}",
            "p90": f"{r['decode_step_ms_p90']:.3f}",
            "p99": f"{r.get('decode_step_ms_p99', float('nan')):.3f}",
            "ops": f"{r['request_ops_per_s']:,.0f}",
        }
        for r in data_["rows"]
    ]
    cols = [
        ("layout", "layout"),
        ("block_size", "block (tokens)"),
        ("policy", "policy"),
        ("phases", "block crossings"),
        ("median", "step median (ms)"),
        ("p90", "step p90 (ms)"),
        ("p99", "step p99 (ms)"),
        ("ops", "add+allocate+free ops/s"),
    ]
    before = _before("alloc-cpu.json", ("layout", "policy", "phases"))
    if before is not None:
        for r in rows:
            b = before[0].get((r["layout"], r["policy"], r["phases"]))
            r["median_before"] = f"{b['decode_step_ms_median']:.3f}" if b else "-"
            r["ops_before"] = f"{b['request_ops_per_s']:,.0f}" if b else "-"
        cols.insert(5, ("median_before", "step median before (ms)"))
        cols.append(("ops_before", "ops/s before"))
    table = markdown_table(rows, cols)
    hashing = markdown_table(
        [
            {**h, "units": f"{h['units_per_s']:,.0f}", "tokens": f"{h['tokens_per_s']:,.0f}"}
            for h in data_.get("hashing", [])
        ],
        [("algo", "hash"), ("units", "hash units/s"), ("tokens", "tokens/s")],
    )
    text = (
        "Bookkeeping of one decode step (append a token to each of 256 running requests of "
        "Qwen3-Next-80B-A3B, allocate, commit cached blocks and checkpoints, build the block "
        "tables, take the KV events). *spread*: prompt lengths spread over 64 tokens, so a few "
        "requests cross a block boundary per step; *synchronized*: all cross it in the same "
        "step (the worst case).\n\n"
        f"{table}\n\n{hashing}\n\n{_bench_meta(data_['meta'])}"
    )
    if before is not None:
        text += f" {_before_note(before[1], data_['meta'])}"
    return [ctx.table("alloc_overhead", text)]


@register(
    "sim_speed",
    "The simulator's wall time for 10,000 chat requests per layout and checkpoint policy "
    "(each layout at its own block size; the range is in the summary).",
)
def sim_speed(ctx: Context) -> list[Path]:
    data_ = _bench("sim-cpu.json")
    rows = [
        {
            **r,
            "wall": f"{r['wall_s']:.1f}",
            "steps_": f"{r['steps']:,}",
            "block": f"{r['block_size']:,}" if "block_size" in r else "not recorded",
        }
        for r in data_["rows"]
    ]
    cols = [
        ("layout", "layout"),
        ("block", "block (tokens)"),
        ("policy", "policy"),
        ("requests", "requests"),
        ("steps_", "scheduler steps"),
        ("wall", "wall time (s)"),
    ]
    before = _before("sim-cpu.json", ("layout", "policy"))
    if before is not None:
        for r in rows:
            b = before[0].get((r["layout"], r["policy"]))
            r["wall_before"] = f"{b['wall_s']:.1f}" if b else "-"
            r["steps_before"] = f"{b['steps']:,}" if b else "-"
        cols += [("steps_before", "steps before"), ("wall_before", "wall time before (s)")]
    table = markdown_table(rows, cols)
    walls = [r["wall_s"] for r in data_["rows"]]
    blocks = sorted({r["block_size"] for r in data_["rows"] if "block_size" in r}, reverse=True)
    summary = ctx.summary(
        "sim_speed",
        f"{data_['rows'][0]['requests']:,} simulated chat requests take {min(walls):.0f}-"
        f"{max(walls):.0f} s of wall time per layout and checkpoint policy. The rows differ in "
        f"block size ({', '.join(f'{b:,}' for b in blocks)} tokens): each layout runs at its own, "
        "and a smaller block means more allocator events per token, so this compares the "
        "layouts as deployed, not at equal block size.",
    )
    return [
        ctx.table(
            "sim_speed",
            f"{data_['meta'].get('what', '')}\n\n{summary}\n\n{table}\n\n"
            f"{_bench_meta(data_['meta'])}"
            + (f" {_before_note(before[1], data_['meta'])}" if before is not None else ""),
        )
    ]


# ---- simulator ----------------------------------------------------------------------------------
#: the deployment the simulator figures replay (40 GiB of cache, at most 256 running requests)
SIM_DEPLOYMENT = Deployment("qwen3-next-80b-a3b")
#: ``align`` is vLLM 0.33's (one chunk to the last cacheable block, only that state and
#: shared-prefix junctions kept); ``align_every_block`` keeps a state at every block boundary a
#: step ends on (hybridkv's earlier ``align``, not vLLM's)
SIM_POLICIES = ("align", "align_every_block", "last", "marconi")
#: the workloads: (label, generator, parameters); seed 0
SIM_TRACES = (
    ("chat", "multi_turn_chat", {}),
    ("shared system prompt", "shared_prefix", {}),
    ("agentic sessions", "agentic", {}),
)
#: per_group with as many cached-checkpoint slots as running ones (the advisor's per_group)
PER_GROUP_CACHED = "per_group+cache"
POLICY_HATCH = {"align": "", "align_every_block": "xx", "last": "//", "marconi": ".."}
_SIM_RUNS: dict[tuple, object] = {}


def _sim_requests(ctx: Context) -> int:
    return 60 if ctx.small else 2000


#: ``--small`` (a smoke run, minutes) simulates vLLM's align and the end-state policy only:
#: align_every_block takes a prefill step per block on the 16-token layouts, marconi tunes
SMALL_SIM_POLICIES = ("align", "last")


def _sim_policies(ctx: Context) -> tuple[str, ...]:
    return SMALL_SIM_POLICIES if ctx.small else SIM_POLICIES


@cache
def _sim_plan(layout: str):
    d = SIM_DEPLOYMENT
    if layout == PER_GROUP_CACHED:
        from hybridkv.layouts import make_plan

        return make_plan(
            data.load(d.model, d.tp, d.kv_dtype),
            "per_group",
            memory=d.memory,
            max_num_seqs=d.max_num_seqs,
            cache_state_slots=d.max_num_seqs,
        )
    return plan(d, layout)


def _sim(ctx: Context, trace_label: str, layout: str, policy: str):
    """One simulator run ``(plan, result)``, memoised: the three simulator figures share their
    runs (:func:`_sim_prefetch` makes them all at once, over ``ctx.jobs`` processes)."""
    key = (ctx.small, trace_label, layout, policy)
    if key not in _SIM_RUNS:
        p = _sim_plan(layout)
        if p is None:
            raise Skip(f"{SIM_DEPLOYMENT.label} has no {layout} plan in {SIM_DEPLOYMENT.memory} B")
        _SIM_RUNS[key] = (p, _sim_run((_sim_requests(ctx), trace_label, layout, policy)))
    return _SIM_RUNS[key]


def _sim_run(task: tuple[int, str, str, str]):
    """``(requests, workload, layout, policy)`` -> the simulator's result (module level, so
    :meth:`Context.map` can run it in a worker process)."""
    from hybridkv.sim import SimConfig, simulate

    n, trace_label, layout, policy = task
    gen, params = next((g, p) for lab, g, p in SIM_TRACES if lab == trace_label)
    trace = _sim_trace(n, gen, tuple(sorted(params.items())))
    model = data.load(SIM_DEPLOYMENT.model, SIM_DEPLOYMENT.tp, SIM_DEPLOYMENT.kv_dtype)
    # no figure draws the byte breakdown, which took ~40% of a long run
    config = SimConfig(checkpoint_policy=policy, breakdowns=0)
    return simulate(_sim_plan(layout), model, trace, config)


def _sim_prefetch(ctx: Context, runs: Sequence[tuple[str, str, str]] | None = None) -> None:
    """Make the simulator runs ``runs`` (``(workload, layout, policy)``; default: every one the
    figures draw) that are not made yet, side by side."""
    if runs is None:
        runs = [
            (label, layout, policy)
            for label, _, _ in SIM_TRACES
            for layout in _sim_layouts()
            for policy in _sim_policies(ctx)
        ]
    todo = [
        (ctx.small, *wanted)
        for wanted in runs
        if (ctx.small, *wanted) not in _SIM_RUNS and _sim_plan(wanted[1]) is not None
    ]
    results = ctx.map(_sim_run, [(_sim_requests(ctx), *key[1:]) for key in todo])
    for key, result in zip(todo, results):
        _SIM_RUNS[key] = (_sim_plan(key[2]), result)


_TRACES: dict[tuple, traces.Trace] = {}


def _sim_trace(n: int, gen: str, params: tuple) -> traces.Trace:
    key = (n, gen, params)
    if key not in _TRACES:
        _TRACES[key] = traces.generate(gen, n, seed=0, **dict(params))
    return _TRACES[key]


def _sim_available() -> None:
    if SIM_DEPLOYMENT.model not in set(data.models.list_models()):
        raise Skip(f"{SIM_DEPLOYMENT.model} is not in the zoo")


def _sim_layouts() -> list[str]:
    return [*data.LAYOUT_ORDER, PER_GROUP_CACHED]


def _layout_color(layout: str) -> str:
    return LAYOUT_COLORS.get(layout, "#17becf")


@register(
    "sim_hit_rate",
    "Under a 40 GiB budget the checkpoint policy decides the hit rate as much as the layout (the "
    "summary, computed from the table, names the best and worst per workload).",
)
def sim_hit_rate(ctx: Context) -> list[Path]:
    _sim_available()
    _sim_prefetch(ctx)
    layouts = _sim_layouts()
    fig, axes = plt.subplots(1, len(SIM_TRACES), figsize=(6.2 * len(SIM_TRACES), 4), sharey=True)
    policies = _sim_policies(ctx)
    width = 0.8 / len(policies)
    rows = []
    for ax, (label, _, _) in zip(np.atleast_1d(axes), SIM_TRACES):
        shared = None
        marks = []
        for j, policy in enumerate(policies):
            xs, ys = [], []
            for i, layout in enumerate(layouts):
                p, r = _sim(ctx, label, layout, policy)
                shared = 100 * r.shared_tokens / max(1, r.prompt_tokens)
                xs.append(i + (j - (len(policies) - 1) / 2) * width)
                ys.append(100 * r.token_hit_rate)
                rows.append(
                    {
                        "trace": label,
                        "layout": layout,
                        "block": str(p.block_size),
                        "policy": policy,
                        "hit": f"{100 * r.token_hit_rate:.1f}",
                        "tokens": f"{r.hit_tokens:,}",
                        "pflop": f"{r.saved_flops / 1e15:,.1f}",
                        "pre": str(r.preemptions),
                    }
                )
            ax.bar(
                xs,
                ys,
                width,
                color=[_layout_color(lay) for lay in layouts],
                hatch=POLICY_HATCH[policy],
                edgecolor="black",
                linewidth=0.4,
            )
            marks.append((xs, ys))
        if shared is not None:
            ax.axhline(shared, ls="--", color="gray", lw=1)
        ax.set_xticks(range(len(layouts)))
        ax.set_xticklabels(layouts, rotation=25, ha="right", fontsize=8)
        ax.set_ylim(0, 100)
        for xs, ys in marks:  # a 0% run gets a "0", so it does not read as one left out
            data.mark_bars(ax, xs, ys)
        ax.set_title(f"{label} ({_sim_requests(ctx):,} requests)", fontsize=9)
    np.atleast_1d(axes)[0].set_ylabel("prompt tokens served from the prefix cache (%)")
    handles = [
        Patch(facecolor="white", edgecolor="black", hatch=POLICY_HATCH[p], label=f"{p} policy")
        for p in policies
    ]
    handles.append(Line2D([], [], ls="--", color="gray", label="prompt tokens shared at all"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(
        f"Simulated token hit rate, {SIM_DEPLOYMENT.label}, 40 GiB, at most "
        f"{SIM_DEPLOYMENT.max_num_seqs} requests (H100 roofline)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    table = markdown_table(
        rows,
        [
            ("trace", "workload"),
            ("layout", "layout"),
            ("block", "block (tokens)"),
            ("policy", "policy"),
            ("hit", "token hit rate (%)"),
            ("tokens", "prompt tokens saved"),
            ("pflop", "prefill PFLOP saved"),
            ("pre", "preemptions"),
        ],
    )
    note = (
        f"\n\n`{PER_GROUP_CACHED}`: per_group with "
        f"`cache_state_slots={SIM_DEPLOYMENT.max_num_seqs}` (a state slot for a cached "
        "checkpoint per running request); every other plan has "
        "`cache_state_slots=0` and one state slot per request. Traces: "
        "`hybridkv.traces.generate(name, n, seed=0)`; PFLOP: prefill FLOPs of the hit tokens on "
        "one rank (`hybridkv.costmodel.prefill_flops`)."
    )
    summary = ctx.summary("sim_hit_rate", _hit_summary(rows))
    return [
        ctx.save(fig, "sim_hit_rate"),
        ctx.table("sim_hit_rate", f"{summary}\n\n{table}{note}"),
    ]


def _hit_summary(rows: list[dict]) -> str:
    """Per workload: each policy's hit-rate range over the layouts, best first."""
    parts = []
    for label in dict.fromkeys(r["trace"] for r in rows):
        spans = {}
        for pol in SIM_POLICIES:
            hits = [float(r["hit"]) for r in rows if r["trace"] == label and r["policy"] == pol]
            if hits:
                spans[pol] = (min(hits), max(hits))
        order = sorted(spans, key=lambda p: -sum(spans[p]))
        text = ", ".join(
            f"{p} {lo:.0f}-{hi:.0f}%" for p, (lo, hi) in ((p, spans[p]) for p in order)
        )
        parts.append(f"{label}: {text}")
    return (
        "Token hit rate per policy over the layouts (best first) -- " + "; ".join(parts) + ". "
        "The spread within a policy is the layouts'; between policies, the checkpoints'."
    )


@register(
    "sim_ttft",
    "Simulated TTFT and output throughput per layout and policy; whether TTFT follows the hit "
    "rate is computed in the summary (rank correlation per workload).",
)
def sim_ttft(ctx: Context) -> list[Path]:
    _sim_available()
    _sim_prefetch(ctx)
    layouts = _sim_layouts()
    policy = "align"
    fig, axes = plt.subplots(2, len(SIM_TRACES), figsize=(6.2 * len(SIM_TRACES), 6.4))
    axes = np.asarray(axes).reshape(2, len(SIM_TRACES))
    rows = []
    for col, (label, _, _) in enumerate(SIM_TRACES):
        p50, p90, tput = [], [], []
        for layout in layouts:
            for pol in _sim_policies(ctx):
                _, r = _sim(ctx, label, layout, pol)
                s = r.summary()
                rows.append(
                    {
                        "trace": label,
                        "layout": layout,
                        "policy": pol,
                        "hit": f"{100 * r.token_hit_rate:.1f}",
                        "p50": f"{s['ttft_p50_ms']:,.1f}",
                        "p90": f"{s['ttft_p90_ms']:,.1f}",
                        "tput": f"{s['throughput_tok_s']:,.0f}",
                        "peak": str(r.peak_running),
                    }
                )
                if pol == policy:
                    p50.append(s["ttft_p50_ms"])
                    p90.append(s["ttft_p90_ms"])
                    tput.append(s["throughput_tok_s"])
        x = np.arange(len(layouts))
        colors = [_layout_color(lay) for lay in layouts]
        ax = axes[0, col]
        ax.bar(x - 0.2, p50, 0.4, color=colors, edgecolor="black", linewidth=0.4, label="p50")
        ax.bar(
            x + 0.2,
            p90,
            0.4,
            color=colors,
            edgecolor="black",
            linewidth=0.4,
            hatch="//",
            alpha=0.6,
            label="p90",
        )
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"{label}: time to first token, {policy} policy", fontsize=9)
        ax.set_xticks(x)
        ax.set_xticklabels(layouts, rotation=25, ha="right", fontsize=8)
        ax.legend(fontsize=7)
        ax = axes[1, col]
        ax.bar(x, tput, 0.6, color=colors, edgecolor="black", linewidth=0.4)
        ax.set_ylabel("output throughput (tokens/s per rank)")
        ax.set_title(f"{label}: output tokens per simulated second", fontsize=9)
        ax.set_xticks(x)
        ax.set_xticklabels(layouts, rotation=25, ha="right", fontsize=8)
    fig.suptitle(
        f"Simulated TTFT and throughput, {SIM_DEPLOYMENT.label}, 40 GiB ({_sim_requests(ctx):,} "
        "requests per workload, H100 roofline)",
        fontsize=10,
    )
    fig.tight_layout()
    table = markdown_table(
        rows,
        [
            ("trace", "workload"),
            ("layout", "layout"),
            ("policy", "policy"),
            ("hit", "token hit rate (%)"),
            ("p50", "TTFT p50 (ms)"),
            ("p90", "TTFT p90 (ms)"),
            ("tput", "tokens/s"),
            ("peak", "peak running"),
        ],
    )
    note = (
        "\n\nTTFT counts from the moment a request is sent (a chat turn: its think time after "
        "the previous turn finished) to the end of the step that computes its last prompt token."
    )
    summary = ctx.summary("sim_ttft", _ttft_summary(rows))
    return [ctx.save(fig, "sim_ttft"), ctx.table("sim_ttft", f"{summary}\n\n{table}{note}")]


def _spearman(x: list[float], y: list[float]) -> float:
    rx = np.argsort(np.argsort(x)).astype(float)
    ry = np.argsort(np.argsort(y)).astype(float)
    if rx.std() == 0 or ry.std() == 0:
        return 0.0
    return float(np.corrcoef(rx, ry)[0, 1])


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def _ttft_summary(rows: list[dict]) -> str:
    """Whether TTFT follows the hit rate, and which policy is fastest and slowest, per workload
    (medians over the layouts)."""
    parts = []
    for label in dict.fromkeys(r["trace"] for r in rows):
        sel = [r for r in rows if r["trace"] == label]
        rho = _spearman([_num(r["hit"]) for r in sel], [_num(r["p50"]) for r in sel])
        med = {
            pol: float(np.median([_num(r["p50"]) for r in sel if r["policy"] == pol]))
            for pol in SIM_POLICIES
            if any(r["policy"] == pol for r in sel)
        }
        fast, slow = min(med, key=med.get), max(med, key=med.get)
        parts.append(
            f"{label}: rank correlation of hit rate and TTFT p50 {rho:+.2f}; median TTFT p50 "
            f"lowest with {fast} ({med[fast]:,.0f} ms), highest with {slow} ({med[slow]:,.0f} ms)"
        )
    return (
        "Does TTFT follow the hit rate? (a rank correlation near -1 would mean more hits, lower "
        "TTFT; medians over the layouts) -- " + "; ".join(parts) + "."
    )


SIM_MEMORY_LAYOUTS = ("inflate", "per_group", "two_level")


@register(
    "sim_memory",
    "Cached checkpoints take most of a pool they share with KV (inflate, two_level); per_group's "
    "state pool stays at its max_num_seqs slots.",
)
def sim_memory(ctx: Context) -> list[Path]:
    _sim_available()
    label, policy = SIM_TRACES[0][0], "align"
    _sim_prefetch(ctx, [(label, layout, policy) for layout in SIM_MEMORY_LAYOUTS])
    fig, axes = plt.subplots(
        1, len(SIM_MEMORY_LAYOUTS), figsize=(4.6 * len(SIM_MEMORY_LAYOUTS), 3.6), sharey=True
    )
    rows = []
    for ax, layout in zip(np.atleast_1d(axes), SIM_MEMORY_LAYOUTS):
        p, r = _sim(ctx, label, layout, policy)
        t = r.sample_t_s
        kv, st = r.kv_bytes / GiB, r.state_bytes / GiB
        ax.stackplot(
            t,
            kv,
            st,
            labels=["attention KV", "recurrent states"],
            colors=["#1f77b4", "#ff7f0e"],
            alpha=0.8,
        )
        ax.axhline(r.memory_bytes / GiB, color="black", ls="--", lw=1, label="cache budget")
        ax.set_xlabel("simulated time (s)")
        ax.set_title(f"{layout} (block {p.block_size})", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
        if t.size:
            rows.append(
                {
                    "layout": layout,
                    "kv": f"{kv.mean():.2f}",
                    "kvmax": f"{kv.max():.2f}",
                    "st": f"{st.mean():.2f}",
                    "stmax": f"{st.max():.2f}",
                    "n": str(t.size),
                }
            )
    np.atleast_1d(axes)[0].set_ylabel("memory held, in use or cached (GiB)")
    fig.suptitle(
        f"Cache memory over a simulated {label} run ({_sim_requests(ctx):,} requests, "
        f"{policy} policy), {SIM_DEPLOYMENT.label}",
        fontsize=10,
    )
    fig.tight_layout()
    table = markdown_table(
        rows,
        [
            ("layout", "layout"),
            ("kv", "KV mean (GiB)"),
            ("kvmax", "KV max (GiB)"),
            ("st", "states mean (GiB)"),
            ("stmax", "states max (GiB)"),
            ("n", "samples"),
        ],
    )
    return [ctx.save(fig, "sim_memory"), ctx.table("sim_memory", table)]


#: models whose KV TP 8 replicates (2 KV heads, or MLA's one latent), planned with vLLM 0.33's
#: --decode-context-parallel-size at 1 and at the largest size its checks pass
DCP_MODELS = ("qwen3-next-80b-a3b", "qwen3.5-397b-a17b", "nemotron-3-super-120b-a12b",
              "kimi-linear-48b-a3b", "glm5_next")  # fmt: skip
DCP_TP = 8
#: GLM-5-Next at transformers' default sizes (no released config is stored): sparse MLA with
#: a k-pooled indexer, planned in vLLM 0.33's cache formats (latent and pooled keys sharded,
#: the tail ring not) with the least interleave vLLM accepts
DCP_GLM5_NEXT = Path(__file__).parents[1] / "examples" / "glm5_next-defaults.json"


def _dcp_model(name: str, size: int) -> models.HybridModel:
    """``name`` at TP :data:`DCP_TP` and DCP ``size`` (with the interleave its indexer needs)."""
    if name != "glm5_next":
        return models.load(name, tp_size=DCP_TP, dcp_size=size)
    model = models.from_hf_config(DCP_GLM5_NEXT, tp_size=DCP_TP)
    interleave = model.dcp_interleave_unit if size > 1 else 1
    return model.configure(tp_size=DCP_TP, dcp_size=size, cp_kv_cache_interleave_size=interleave)


@register(
    "dcp_capacity",
    "Decode context parallelism multiplies the tokens a rank holds, not its states: the ranks "
    "that kept copies of a KV head shard its tokens, attention blocks span that many times "
    "their rows, and a request's states weigh that many times more tokens of KV.",
)
def dcp_capacity(ctx: Context) -> list[Path]:
    rows = []
    facts = []
    for name in DCP_MODELS[:1] if ctx.small else DCP_MODELS:
        largest = _dcp_model(name, 1).largest_dcp_size()
        target = VllmTarget(cache_formats="vllm")  # GLM-5-Next's indexer as vLLM keeps it
        base = None
        for size in sorted({1, largest}):
            model = _dcp_model(name, size)
            p = make_plan(model, "inflate", memory=40 * GiB, max_num_seqs=256, target=target)
            (span,) = {g.block_size for g in p.token_groups}
            base = base or p
            weight = size * model.state_bytes_per_seq / p.kv_bytes_per_token
            share = p.capacity.state_reserved_bytes / p.config.memory_bytes
            rows.append(
                {
                    "model": f"{name} TP{DCP_TP}",
                    "dcp": str(size),
                    "block": f"{p.block_size:,}",
                    "span": f"{span:,}",
                    "tokens": f"{p.capacity.token_capacity:,}",
                    "ratio": f"{p.capacity.token_capacity / base.capacity.token_capacity:.2f}",
                    "share": f"{100 * share:.1f}",
                    "weight": f"{weight:,.0f}",
                }
            )
        facts.append(f"{name} {rows[-1]['ratio']}x at DCP {largest}")
    ctx.summaries["dcp_capacity"] = (
        f"At TP {DCP_TP}, 40 GiB a rank and 256 running requests (inflate, vLLM 0.33's rules), "
        f"the largest decode context parallel size vLLM accepts gives {'; '.join(facts)} the "
        "tokens; the states, not sharded, keep their bytes, so each request's states weigh "
        "that many times more tokens of KV, and a state page (one attention page) stands for "
        "a block of that many times the tokens."
    )
    table = markdown_table(
        rows,
        [
            ("model", "model"),
            ("dcp", "DCP"),
            ("block", "block (a rank's rows)"),
            ("span", "attention block (tokens)"),
            ("tokens", "token capacity"),
            ("ratio", "x DCP 1"),
            ("share", "states' share of the budget (%)"),
            ("weight", "a request's states, in tokens of KV"),
        ],
    )
    note = (
        "\n\n`inflate` with vLLM 0.33's rules and defaults, 40 GiB per rank, 256 running "
        "requests' states reserved (one slot each, as in `capacity.md`). DCP reuses the TP ranks "
        "that would hold copies of one KV head (or of MLA's latent) to shard its tokens: a rank "
        "keeps one token in DCP, its pages the same bytes, so an attention block spans DCP times "
        "its rows; vLLM's hash unit is the gcd of the blocks' spans (the state block), where a "
        "resend or an extension of a prompt still hits, while a prefix that different prompts "
        "share hits in whole attention blocks (vLLM keys a block at its end and a prompt at "
        "its tail). The decode's query gather and partial-attention merge across the ranks are "
        "not priced by the roofline. glm5_next: transformers' default sizes "
        "(`examples/glm5_next-defaults.json`; no released config is stored) in vLLM's cache "
        "formats: its latent and k-pooled indexer keys are sharded, its tail rings (one block a "
        "request, in the states' share here) and KDA states are not; vLLM requires "
        "`--cp-kv-cache-interleave-size` to cover whole k-pools (16 tokens) and serves the "
        "sparse MLA with FlashMLA's backend under DCP (bfloat16 latents only)."
    )
    return [ctx.table("dcp_capacity", table + note)]


from . import real_trace  # noqa: E402, F401  (registers the real-trace figure, after the others)

# isort: split
from . import marconi_gap  # noqa: E402, F401  (registers the Marconi comparison, last)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m paper.figures", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="a smoke run (about 1.5 min with --jobs 2 on 2 cores; the tests run it); "
        f"written to {SMALL_OUT.name}/ unless --out says otherwise",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"where to write (default {OUT.parent.name}/{OUT.name}, the committed figures; "
        f"with --small {OUT.parent.name}/{SMALL_OUT.name}, which git ignores)",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one progress bar over the figures (default: when stderr is a terminal)",
    )
    parser.add_argument("--only", nargs="+", metavar="NAME", help="make only these figures")
    add_executor_arguments(parser, "a figure's independent simulator runs")
    parser.add_argument("--list", action="store_true", help="list the figures and exit")
    parser.add_argument(
        "--run-cache",
        type=Path,
        metavar="DIR",
        help="keep each simulator run's result in DIR (e.g. paper/.run-cache, git-ignored), "
        "keyed by the run and a hash of the code and data: a regeneration stopped half way "
        "resumes from the runs it finished (default: keep nothing)",
    )
    args = parser.parse_args(argv)
    if args.list:
        for f in FIGURES.values():
            print(f"{f.name:<22} {f.message}")
        return 0
    options = executor_options(args, PACKAGES, parser)
    out = args.out or (SMALL_OUT if args.small else OUT)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    try:
        with open_executor(options) as executor:
            ctx = Context(
                out,
                small=args.small,
                jobs=args.jobs or 1,
                executor=executor,
                run_cache=args.run_cache,
            )
            run(ctx, args.only, progress=progress)
    except (ValueError, ExecutorUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    # `python -m paper.figures` runs this file as __main__; main() is the one of the module
    # imported by name, so the functions the figures map are paper.figures.*, which a worker
    # (a Ray one too) imports by that name, and not __main__.*, which only a spawned one can
    from paper.figures import main as _main

    sys.exit(_main())
