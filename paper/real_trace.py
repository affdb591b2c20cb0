"""The real-trace figure: Mooncake's synthetic workload replayed on every layout and checkpoint
policy, against what an attention-only cache would serve.

The trace (shipped as :data:`hybridkv.traces.MOONCAKE_SYNTHETIC`, with its README) records
prompts as 512-token block hashes, so which tokens two prompts share is known only to a block.
It is read both ways the loader offers (``shared_length``): ``blocks``, exactly the shared hash
blocks, and ``continuation``, a prompt that extends every whole block of an earlier one resends
all of it. Registered into :data:`paper.registry.FIGURES` by importing this module
(``paper.figures`` does).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from hybridkv import traces

from . import data
from .registry import Context, Skip, register

TRACE = traces.MOONCAKE_SYNTHETIC
#: one GPU's share: the cluster trace's arrivals 20x further apart
RATE_SCALE = 0.05
#: (label, policy, checkpoint_interval)
POLICIES = (
    ("align", "align", None),
    ("align_every_block", "align_every_block", None),
    ("last", "last", None),
    ("marconi", "marconi", None),
    ("hash_boundary 512", "hash_boundary", 512),
    ("hash_ladder", "hash_ladder", None),
    ("hash_ladder 512", "hash_ladder", 512),
    ("periodic 2048", "periodic", 2048),
    ("periodic 512", "periodic", 512),
)
SMALL_POLICIES = ("align", "hash_boundary 512", "periodic 512")
#: the continuation reading is replayed on these layouts only (run time)
CONTINUATION_LAYOUTS = ("inflate", "per_group+cache")
HASH_UNIT = 16  # the simulator's hash unit: hits at any 16-token boundary


def _requests(ctx: Context) -> int:
    return 60 if ctx.small else 2000


@cache
def _trace(n: int, shared_length: str) -> traces.Trace:
    return traces.load_jsonl(TRACE, limit=n, rate_scale=RATE_SCALE, shared_length=shared_length)


#: the simulator figures' deployment (``paper.figures.SIM_DEPLOYMENT``; a test checks)
DEPLOYMENT = data.Deployment("qwen3-next-80b-a3b")
#: per_group with as many cached-state slots as running requests (plain per_group's state pool
#: holds only running states, so it caches none)
PER_GROUP_CACHED = "per_group+cache"
LAYOUTS = (*(x for x in data.LAYOUT_ORDER if x != "per_group"), PER_GROUP_CACHED)


def _plan(layout: str, d: data.Deployment = DEPLOYMENT):
    """The figure's plan of ``layout`` (another deployment: ``paper.reference_gap``'s budgets)."""
    if layout != PER_GROUP_CACHED:
        return data.plan(d, layout)
    from hybridkv.layouts import make_plan

    return make_plan(
        data.load(d.model, d.tp, d.kv_dtype),
        "per_group",
        memory=d.memory,
        max_num_seqs=d.max_num_seqs,
        cache_state_slots=d.max_num_seqs,
    )


@register(
    "real_trace",
    "On Mooncake's trace the hybrid cache serves a small part of what an attention-only cache "
    "of the same memory would: later prompts share earlier ones at 512-token hash boundaries "
    "where vLLM's align, last and marconi keep no state. States kept inside prompts "
    "(hash_boundary, periodic) recover part of it, at the memory their pages take.",
)
def real_trace(ctx: Context) -> list[Path]:
    if not TRACE.exists():
        raise Skip(f"{TRACE.name} is not in this installation")
    dep = DEPLOYMENT
    layouts = list(CONTINUATION_LAYOUTS if ctx.small else LAYOUTS)
    names: dict[str, str] = {}
    policies = [p for p in POLICIES if not ctx.small or p[0] in SMALL_POLICIES]
    readings = ("blocks", "continuation")
    n = _requests(ctx)
    bounds, tasks = {}, []
    for reading in readings:
        trace = _trace(n, reading)
        for layout in layouts:
            if reading == "continuation" and layout not in CONTINUATION_LAYOUTS:
                continue
            plan = _plan(layout)
            if plan is None:
                continue
            names[layout] = data.layout_label(plan) if layout in data.LAYOUT_ORDER else layout
            if reading not in bounds:
                cap = plan.capacity.ideal_token_capacity
                total = int(trace.prompt_lengths().sum())
                lru = int(np.sum(traces.lru_cache_hits(trace, HASH_UNIT, cap)))
                bounds[reading] = {
                    "infinite": 100 * traces.hit_fraction(trace, HASH_UNIT),
                    "same_memory": 100 * lru / total,
                    "capacity": cap,
                }
            tasks += [(n, reading, layout, *p) for p in policies]
    rows = ctx.map(_run, tasks)
    for row in rows:
        same = bounds[row["reading"]]["same_memory"]
        row["of_same"] = f"{100 * row['hit'] / same:.0f}%" if same else "-"
    if not rows:
        raise Skip(f"{dep.label} has no plan in {dep.memory} B")

    fig, axes = plt.subplots(
        1,
        len(readings),
        figsize=(7.5 + 3.5 * (len(readings) - 1), 4.2),
        sharey=True,
        gridspec_kw={"width_ratios": [len(layouts), len(CONTINUATION_LAYOUTS)]},
    )
    width = 0.8 / len(policies)
    cmap = plt.get_cmap("tab10")
    for ax, reading in zip(np.atleast_1d(axes), readings):
        shown = [
            x for x in layouts if any(r["layout"] == x and r["reading"] == reading for r in rows)
        ]
        marks = []  # (xs, ys, missing) per policy, drawn once the y range is set
        for j, (label, _, _) in enumerate(policies):
            xs, ys, missing = [], [], []
            for i, layout in enumerate(shown):
                hit = next(
                    (
                        r["hit"]
                        for r in rows
                        if (r["reading"], r["layout"], r["policy"]) == (reading, layout, label)
                    ),
                    None,
                )
                x = i + (j - (len(policies) - 1) / 2) * width
                if hit is not None:
                    xs.append(x)
                    ys.append(hit)
                else:
                    missing.append(x)
            ax.bar(xs, ys, width, color=cmap(j), label=label)
            marks.append((ax, xs, ys, missing))
        b = bounds[reading]
        ax.axhline(
            b["same_memory"], color="k", ls=":", lw=1.2, label="attention-only, same memory (LRU)"
        )
        ax.set_xticks(range(len(shown)), [names[x] for x in shown])
        # the unlimited bound is far above every bar: written, not drawn
        ax.set_title(
            f"shared length: {reading}\n(attention-only, unlimited memory: {b['infinite']:.1f}%)",
            fontsize=9,
        )
    top = max([r["hit"] for r in rows] + [b["same_memory"] for b in bounds.values()])
    axes[0].set_ylim(0, 1.15 * top)
    for ax, xs, ys, missing in marks:
        data.mark_bars(ax, xs, ys, missing)
    axes[0].set_ylabel("prompt tokens served from the cache (%)")
    # one legend below both panels, where it hides no bar
    handles, labels = np.atleast_1d(axes)[-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7)
    fig.suptitle(
        f"Mooncake synthetic trace, first {n} requests, arrivals x{1 / RATE_SCALE:.0f} apart: "
        f"{dep.label}, {dep.memory / data.GiB:.0f} GiB per rank",
        fontsize=10,
    )
    # room above the panel titles for the suptitle, below the panels for the legend
    fig.tight_layout(rect=(0, 0.13, 1, 0.95))
    png = ctx.save(fig, "real_trace")

    cols = [
        ("reading", "shared length"),
        ("layout", "layout"),
        ("block", "block"),
        ("policy", "policy"),
        ("hit_pct", "hit %"),
        ("of_same", "of attention-only, same memory"),
        ("ttft_p50", "TTFT p50 ms"),
        ("ttft_p90", "TTFT p90 ms"),
        ("checkpoints", "checkpoints"),
        ("ckpt_gib", "checkpoint GiB written"),
        ("state_gib", "state GiB held (mean)"),
        ("kv_gib", "KV GiB held (mean)"),
        ("preempt", "preemptions"),
    ]
    params = {k: v for k, v in _trace(n, "blocks").params.items() if k != "path"}
    summary = ctx.summary("real_trace", _summary(rows, bounds, n))
    lines = [
        summary,
        "",
        f"Trace: Mooncake FAST'25 release, synthetic_trace.jsonl (commit 3b5a594, Apache-2.0), "
        f"first {n} of 3,993 requests; timestamps in ms; arrivals divided by {RATE_SCALE} "
        f"(rate scale); prompts synthesised per 512-token hash id (seed 0). "
        f"Model {dep.label}, {dep.memory / data.GiB:.0f} GiB of cache per rank, "
        f"max_num_seqs {dep.max_num_seqs}; simulator hash unit {HASH_UNIT} tokens; "
        f"{PER_GROUP_CACHED} = per_group with {dep.max_num_seqs} cached-state slots.",
        "",
        f"Loader parameters: {params}.",
        "",
        "Bounds (attention-only, so no state is needed for a hit; prompt tokens served, %):",
        "",
        data.markdown_table(
            [
                {
                    "reading": k,
                    "inf": f"{v['infinite']:.1f}",
                    "same": f"{v['same_memory']:.1f}",
                    "cap": f"{v['capacity']:,}",
                }
                for k, v in bounds.items()
            ],
            [
                ("reading", "shared length"),
                ("inf", "unlimited memory"),
                ("same", "same memory (LRU)"),
                ("cap", "tokens that memory holds"),
            ],
        ),
        "",
        data.markdown_table(rows, cols),
    ]
    md = ctx.table("real_trace", "\n".join(lines))
    return [png, md]


def _run(task: tuple[int, str, str, str, str, int | None]) -> dict:
    """One replay: ``(requests, reading, layout, label, policy, interval)`` -> its table row
    (module level, so :meth:`Context.map` can run it in a worker process)."""
    from hybridkv.sim import SimConfig, simulate

    n, reading, layout, label, policy, interval = task
    dep = DEPLOYMENT
    plan = _plan(layout)
    config = SimConfig(
        checkpoint_policy=policy,
        checkpoint_interval=interval,
        hash_block_size=min(HASH_UNIT, plan.block_size),
        breakdowns=0,  # the table shows no byte breakdown; it took ~40% of a run
    )
    r = simulate(plan, data.load(dep.model, dep.tp, dep.kv_dtype), _trace(n, reading), config)
    s = r.summary()
    return {
        "reading": reading,
        "layout": layout,
        "block": str(plan.block_size),
        "policy": label,
        "hit": 100 * r.token_hit_rate,
        "hit_pct": f"{100 * r.token_hit_rate:.1f}",
        "ttft_p50": f"{s['ttft_p50_ms']:.0f}",
        "ttft_p90": f"{s['ttft_p90_ms']:.0f}",
        "checkpoints": f"{r.checkpoints:,}",
        "ckpt_gib": f"{s['checkpoint_gib']:.0f}",
        "state_gib": f"{s['state_gib_mean']:.1f}",
        "kv_gib": f"{s['kv_gib_mean']:.1f}",
        "preempt": str(r.preemptions),
    }


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.1f}%" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f}%"


def _summary(rows: list[dict], bounds: dict, n: int) -> str:
    """What the table shows, in words, from its numbers."""
    b = bounds["blocks"]
    sel = [r for r in rows if r["reading"] == "blocks"]
    layouts = list(dict.fromkeys(r["layout"] for r in sel))
    best = {
        lay: max((r for r in sel if r["layout"] == lay), key=lambda r: r["hit"]) for lay in layouts
    }
    winners: dict[str, list[str]] = {}
    for lay, r in best.items():
        winners.setdefault(r["policy"], []).append(lay)
    won = "; ".join(f"{p} on {', '.join(lays)}" for p, lays in winners.items())

    def hits(policy: str, reading: str = "blocks") -> list[float]:
        return [r["hit"] for r in rows if r["policy"] == policy and r["reading"] == reading]

    text = (
        f"First {n:,} requests, shared length read as whole hash blocks: attention alone could "
        f"serve {b['infinite']:.1f}% of prompt tokens with unlimited memory but "
        f"{b['same_memory']:.1f}% from an LRU cache of the same memory"
        + (", so memory is the first limit" if b["same_memory"] < 0.5 * b["infinite"] else "")
        + f". Within it the hybrid cache serves {_span([r['hit'] for r in sel])}; the best "
        f"policy per layout: {won}. vLLM's align serves {_span(hits('align'))}"
    )
    for policy in ("hash_boundary 512", "periodic 2048", "periodic 512", "marconi", "last"):
        if hits(policy):
            text += f", {policy} {_span(hits(policy))}"
    text += "."
    cont = [r for r in rows if r["reading"] == "continuation"]
    if cont:
        changes = []
        for r in cont:
            before = next(
                x["hit"] for x in sel if (x["layout"], x["policy"]) == (r["layout"], r["policy"])
            )
            if abs(r["hit"] - before) >= 0.5:
                changes.append(f"{r['policy']} on {r['layout']} {before:.1f}% -> {r['hit']:.1f}%")
        text += (
            " Reading continuations as resending the earlier prompt "
            + ("changes " + ", ".join(changes) if changes else "changes no row by 0.5 points")
            + "."
        )
    return text
