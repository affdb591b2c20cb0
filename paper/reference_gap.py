"""Where the hybrid cache loses what attention alone would serve, on Mooncake's trace, and what
any state placement could serve: ``python -m paper.reference_gap [--requests 2000]
[--memory-gib 40 80] [--jobs N] [--out paper/results]``.

For each memory budget, layout and checkpoint policy (``paper.real_trace``: its deployment, trace
reading and hash unit), one simulation records per request the prompt tokens served and the
prefix the attention groups alone held at the lookup (``SimResult.request_hits`` /
``request_kv_hits``); :func:`hybridkv.traces.reference_gap` splits the attention-only LRU
reference of the same memory (``traces.lru_cache_hits``) into what was served, lost to a missing
state (the KV was there) and lost to missing KV. Per budget, :func:`hybridkv.traces.
placement_bounds` says how much of the reference each rule for placing states could serve with
free, never-evicted states. Writes ``reference-gap.json`` and ``reference-gap.md`` (date,
machine, commit)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np

from hybridkv import traces
from hybridkv.executors import add_executor_arguments, executor_options, open_executor

from . import data, real_trace
from .provenance import run_meta, write_results

RESULTS = Path(__file__).parent / "results"
#: the shared-pool layouts (``real_trace.PER_GROUP_CACHED``, a static split, is one more
#: ``--layouts`` value; each of its runs takes about four minutes at 2,000 requests)
LAYOUTS = ("inflate", "two_level")
POLICIES = (
    "align",
    "marconi",
    "hash_boundary 512",
    "hash_ladder",
    "hash_ladder, LRU",
    "periodic 2048",
)
#: runs beyond the real-trace figure's policies: (policy, checkpoint_interval, allocator options)
EXTRA_POLICIES = {"hash_ladder, LRU": ("hash_ladder", None, {"eviction": "lru"})}


def _policy(label: str) -> tuple[str, int | None, dict]:
    """The policy, interval and further allocator options a label names."""
    if label in EXTRA_POLICIES:
        return EXTRA_POLICIES[label]
    policy, interval = {lab: (p, i) for lab, p, i in real_trace.POLICIES}[label]
    return policy, interval, {}


def _labels() -> set[str]:
    return {label for label, _, _ in real_trace.POLICIES} | set(EXTRA_POLICIES)


#: the paper's budget and twice it
MEMORY_GIB = (40.0, 80.0)
#: the interval of the placement bounds' interval rules (the trace's hash unit)
BOUND_INTERVAL = 512


def _deployment(memory_gib: float) -> data.Deployment:
    return dataclasses.replace(real_trace.DEPLOYMENT, memory=int(memory_gib * data.GiB))


def _plan(layout: str, memory_gib: float):
    """The real-trace figure's plan of ``layout`` at ``memory_gib``."""
    return real_trace._plan(layout, _deployment(memory_gib))


@functools.cache
def _reference(n: int, unit: int, capacity: int):
    """The attention-only LRU reference of ``capacity`` tokens, once per process for every
    policy run on it (one hashing pass over the trace each)."""
    return traces.lru_cache_hits(real_trace._trace(n, "blocks"), unit, capacity)


def _run(task: tuple[int, float, str, str]) -> dict | None:
    """One simulation (a module-level function, so that an executor's worker can run it)."""
    from hybridkv.sim import SimConfig, simulate

    n, memory_gib, layout, label = task
    dep = _deployment(memory_gib)
    plan = _plan(layout, memory_gib)
    if plan is None:
        return None
    model = data.load(dep.model, dep.tp, dep.kv_dtype)
    trace = real_trace._trace(n, "blocks")
    unit = min(real_trace.HASH_UNIT, plan.block_size)
    reference = _reference(n, unit, plan.capacity.ideal_token_capacity)
    policy, interval, extra = _policy(label)
    config = SimConfig(
        checkpoint_policy=policy,
        checkpoint_interval=interval,
        hash_block_size=unit,
        breakdowns=0,
        **extra,
    )
    t0 = time.perf_counter()
    r = simulate(plan, model, trace, config)
    gap = traces.reference_gap(r.request_hits, r.request_kv_hits, reference)
    return {"memory_gib": memory_gib, "layout": layout, "block": plan.block_size,
            "policy": label, "eviction": config.allocator.resolved_eviction(),
            "marconi_alpha": r.marconi_alpha, "alpha_tuned_at": list(r.alpha_tuned_at),
            "alpha_tuning_s": round(r.alpha_tuning_s, 1),
            "prompt_tokens": int(trace.prompt_lengths().sum()),
            "ttft_p50_ms": round(1e3 * float(np.median(r.ttft_s)), 1),
            "checkpoints": r.checkpoints, "checkpoint_gib": round(r.checkpoint_bytes / 2**30, 1),
            "wall_s": round(time.perf_counter() - t0, 1), **gap.to_dict()}  # fmt: skip


def bounds(n: int, memory_gib: float) -> dict:
    """What each placement rule could serve of the same-memory reference (free states)."""
    trace = real_trace._trace(n, "blocks")
    plan = _plan("inflate", memory_gib)
    reference = _reference(n, real_trace.HASH_UNIT, plan.capacity.ideal_token_capacity)
    b = traces.placement_bounds(trace, reference, real_trace.HASH_UNIT, BOUND_INTERVAL)
    return {"memory_gib": memory_gib, "interval": BOUND_INTERVAL,
            "token_capacity": plan.capacity.ideal_token_capacity, **b.to_dict(),
            "prompt_boundary+seen_branch": b.total("prompt_boundary", "seen_branch")}  # fmt: skip


def _eviction(row: dict) -> str:
    """The eviction a row ran, with Marconi's alpha: the one chosen and when, if tuned."""
    if row.get("marconi_alpha") is None:  # LRU (or a file written before alpha was recorded)
        return row["eviction"]
    tuned = row.get("alpha_tuned_at")
    when = f" (tuned after {tuned[0]:,})" if tuned else ""
    return f"{row['eviction']}, alpha {row['marconi_alpha']:g}{when}"


def _pct(x: int, total: int) -> str:
    return f"{100 * x / total:.1f}" if total else "-"


def _line(row: dict) -> str:
    ref = row["reference"]
    return (
        f"{row['memory_gib']:g} GiB {row['layout']:16} {row['policy']:18} served "
        f"{_pct(row['served'], ref)}% of the reference, lost to state "
        f"{_pct(row['lost_to_state'], ref)}%, to KV {_pct(row['lost_to_kv'], ref)}%, TTFT p50 "
        f"{row['ttft_p50_ms']} ms ({row['wall_s']} s)"
    )


BOUND_LABELS = (
    ("end", "`end`: where each earlier request ended (`last`)"),
    ("prompt_boundary", "`prompt_boundary`: each earlier prompt's last multiple of 512 "
     "(`hash_boundary 512`)"),
    ("ladder", "`ladder`: its last multiple of 512, 1,024, 2,048, ... (`hash_ladder 512`)"),
    ("seen_branch", "`seen_branch`: where an earlier request's own reference hit stopped "
     "(branch points, `marconi`'s admission)"),
    ("prompt_boundary+seen_branch", "both of the two above"),
    ("every_interval", "`every_interval`: every multiple of 512 inside each prompt "
     "(`periodic 512`)"),
)  # fmt: skip


def _state_line() -> str:
    """What one state weighs in KV tokens (facts of the model, not a measurement)."""
    dep = real_trace.DEPLOYMENT
    model = data.load(dep.model, dep.tp, dep.kv_dtype)
    state, kv = model.state_bytes_per_seq, model.kv_bytes_per_token
    return (
        f"One state of {dep.model} (TP {dep.tp}) is {state / 2**20:.1f} MiB, as much as "
        f"{state / kv:,.0f} tokens of its KV ({kv / 2**10:g} KiB a token): a state every "
        f"{BOUND_INTERVAL} tokens weighs {state / kv / BOUND_INTERVAL:.2f} times those tokens' KV."
    )


def table(rows: list[dict], bound_rows: list[dict], meta: dict) -> str:
    out = [
        "# Where the hybrid cache loses the attention-only reference (Mooncake trace)",
        "",
        f"{meta['what']}. Measured {meta['date']} on {meta['machine']} ({meta['cpus']} CPUs), "
        f"commit `{meta['commit'][:12]}`; `python -m paper.reference_gap "
        f"{' '.join(meta['argv'])}`.",
        "",
        "## What each state placement could serve",
        "",
        "Per budget, the attention-only LRU reference of the same memory (whole 16-token units) "
        "and the part of it a hybrid cache could serve with states kept only where a rule puts "
        "them, the states costing no memory and never evicted "
        "(`hybridkv.traces.placement_bounds`).",
        "",
        _state_line(),
        "",
        "| rule | " + " | ".join(f"{b['memory_gib']:g} GiB" for b in bound_rows) + " |",
        "|---|" + "---:|" * len(bound_rows),
        "| reference (tokens) | " + " | ".join(f"{b['reference']:,}" for b in bound_rows) + " |",
    ]
    for key, label in BOUND_LABELS:
        cells = " | ".join(f"{_pct(b[key], b['reference'])}%" for b in bound_rows)
        out.append(f"| {label} | {cells} |")
    out += [
        "",
        "## What the simulator serves",
        "",
        "Percentages are of the reference's hit tokens. *lost to state*: the hybrid cache held "
        "the KV, no state let a hit reach it. *lost to KV*: the KV was evicted. *beyond*: "
        "served past the reference. served + lost to state + lost to KV - beyond = 100%. "
        "`hash_ladder` without an interval starts its ladder at the state's size in KV tokens "
        "(2,048 here); its own eviction is Marconi's, its alpha tuned online once (the "
        "simulator's default; *eviction* says what it chose after how many finished requests), "
        "`, LRU` runs it with the "
        "pools' LRU. vLLM 0.33's default is `inflate` with `align`. The reference evicts by "
        "LRU: an eviction that weighs what a prefix saves can serve more than it (*beyond*).",
        "",
        "| GiB | layout | block | policy | eviction | served | of prompt tokens | lost to state | "
        "lost to KV | beyond | TTFT p50 ms | checkpoints (GiB) | requests losing to state / KV |",
        "|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ref = r["reference"]
        out.append(
            f"| {r['memory_gib']:g} | {r['layout']} | {r['block']} | {r['policy']} | "
            f"{_eviction(r)} | {_pct(r['served'], ref)}% | "
            f"{_pct(r['served'], r['prompt_tokens'])}% | {_pct(r['lost_to_state'], ref)}% | "
            f"{_pct(r['lost_to_kv'], ref)}% | {_pct(r['beyond'], ref)}% | {r['ttft_p50_ms']} | "
            f"{r['checkpoints']:,} ({r['checkpoint_gib']:,}) | "
            f"{r['requests_losing_to_state']} / {r['requests_losing_to_kv']} |"
        )
    total = rows[0]["prompt_tokens"] if rows else 0
    if total:
        refs = ", ".join(
            f"{b['reference']:,} ({_pct(b['reference'], total)}%) at {b['memory_gib']:g} GiB"
            for b in bound_rows
        )
        out += ["", f"Of {total:,} prompt tokens the reference serves {refs}."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paper.reference_gap", description=__doc__)
    ap.add_argument("--requests", type=int, default=2000, help="first N requests (default 2000)")
    ap.add_argument("--memory-gib", type=float, nargs="+", default=list(MEMORY_GIB),
                    help="cache budgets per rank (default: %(default)s)")  # fmt: skip
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), help="(default: %(default)s)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES),
                    help="labels of paper.real_trace.POLICIES or EXTRA_POLICIES "
                         "(default: %(default)s)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=RESULTS, help="(default: paper/results)")
    ap.add_argument("--render", type=Path, metavar="JSON",
                    help="only write the Markdown again from a results JSON this script wrote "
                         "(its meta and rows kept), running nothing")  # fmt: skip
    add_executor_arguments(ap, "the simulations")
    args = ap.parse_args(argv)
    if args.render is not None:
        saved = json.loads(args.render.read_text())
        rows, meta = saved["rows"], saved["meta"]
        md = table(rows["simulations"], rows["bounds"], meta)
        path = write_results(args.out, "reference-gap", meta, rows, md)
        print(f"wrote {path}")
        return 0
    known = _labels()
    bad = [p for p in args.policies if p not in known]
    if bad:
        ap.error(f"unknown policy label(s) {bad}; choose from {sorted(known)}")
    if args.requests < 1:
        ap.error(f"--requests must be at least 1, got {args.requests}")
    if any(m <= 0 for m in args.memory_gib):
        ap.error(f"--memory-gib must be positive, got {args.memory_gib}")
    if not real_trace.TRACE.exists():
        ap.error(f"{real_trace.TRACE} is not in this installation")
    tasks = [(args.requests, m, layout, label) for m in args.memory_gib
             for layout in args.layouts for label in args.policies]  # fmt: skip
    rows = []
    with open_executor(executor_options(args, ("hybridkv", "paper"), ap)) as executor:
        for row in executor.imap(_run, tasks):
            if row is not None:
                rows.append(row)
                print(_line(row), flush=True)
    bound_rows = [bounds(args.requests, m) for m in args.memory_gib]
    dep = real_trace.DEPLOYMENT
    meta = run_meta(
        f"{args.requests} requests of {real_trace.TRACE.name} (arrivals x"
        f"{1 / real_trace.RATE_SCALE:.0f} apart), {dep.model}, "
        f"{' and '.join(f'{m:g}' for m in args.memory_gib)} GiB of cache",
        argv,
    )
    payload = {"simulations": rows, "bounds": bound_rows}
    path = write_results(args.out, "reference-gap", meta, payload, table(rows, bound_rows, meta))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    # run under its importable name, so that executor workers find paper.reference_gap._run
    from paper.reference_gap import main as _main

    sys.exit(_main())
