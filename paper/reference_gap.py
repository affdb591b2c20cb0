"""Where the hybrid cache loses what attention alone would serve, on Mooncake's trace:
``python -m paper.reference_gap [--requests 600] [--out paper/results]``.

For each layout and checkpoint policy of the real-trace figure (``paper.real_trace``: its
deployment, trace reading and hash unit), one simulation records per request the prompt tokens
served and the prefix the attention groups alone held at the lookup
(``SimResult.request_hits`` / ``request_kv_hits``); :func:`hybridkv.traces.reference_gap` splits
the attention-only LRU reference of the same memory (``traces.lru_cache_hits``) into what was
served, lost to a missing state (the KV was there) and lost to missing KV. Writes
``reference-gap.json`` and ``reference-gap.md`` (date, machine, commit)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hybridkv import traces

from . import data, real_trace
from .provenance import run_meta, write_results

RESULTS = Path(__file__).parent / "results"
LAYOUTS = ("inflate", "two_level", real_trace.PER_GROUP_CACHED)
POLICIES = ("align", "last", "marconi", "hash_boundary 512", "periodic 512")


def measure(n: int, layouts: tuple[str, ...], labels: tuple[str, ...]) -> list[dict]:
    from hybridkv.sim import SimConfig, simulate

    dep = real_trace.DEPLOYMENT
    model = data.load(dep.model, dep.tp, dep.kv_dtype)
    trace = real_trace._trace(n, "blocks")
    prompts = int(trace.prompt_lengths().sum())
    policies = {label: (p, i) for label, p, i in real_trace.POLICIES}
    rows = []
    for layout in layouts:
        plan = real_trace._plan(layout)
        if plan is None:
            continue
        unit = min(real_trace.HASH_UNIT, plan.block_size)
        reference = traces.lru_cache_hits(trace, unit, plan.capacity.ideal_token_capacity)
        for label in labels:
            policy, interval = policies[label]
            config = SimConfig(
                checkpoint_policy=policy,
                checkpoint_interval=interval,
                hash_block_size=unit,
                breakdown_every=0,
            )
            t0 = time.perf_counter()
            r = simulate(plan, model, trace, config)
            gap = traces.reference_gap(r.request_hits, r.request_kv_hits, reference)
            row = {"layout": layout, "block": plan.block_size, "policy": label,
                   "prompt_tokens": prompts, "wall_s": round(time.perf_counter() - t0, 1),
                   **gap.to_dict()}  # fmt: skip
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def _pct(x: int, total: int) -> str:
    return f"{100 * x / total:.1f}" if total else "-"


def _line(row: dict) -> str:
    ref = row["reference"]
    return (
        f"{row['layout']:16} {row['policy']:18} served {_pct(row['served'], ref)}% of the "
        f"reference, lost to state {_pct(row['lost_to_state'], ref)}%, to KV "
        f"{_pct(row['lost_to_kv'], ref)}%, beyond {_pct(row['beyond'], ref)}%"
    )


def table(rows: list[dict], meta: dict) -> str:
    out = [
        "# Where the hybrid cache loses the attention-only reference (Mooncake trace)",
        "",
        f"{meta['what']}. Measured {meta['date']} on {meta['machine']} ({meta['cpus']} CPUs), "
        f"commit `{meta['commit'][:12]}`; `python -m paper.reference_gap "
        f"{' '.join(meta['argv'])}`.",
        "",
        "Percentages are of the reference's hit tokens (an attention-only LRU cache of the same "
        "memory, whole 16-token units). *lost to state*: the hybrid cache held the KV, no "
        "state let a hit reach it. *lost to KV*: the KV was evicted. *beyond*: served past the "
        "reference. served + lost to state + lost to KV - beyond = 100%.",
        "",
        "| layout | block | policy | served | lost to state | lost to KV | beyond | "
        "requests losing to state / KV |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ref = r["reference"]
        out.append(
            f"| {r['layout']} | {r['block']} | {r['policy']} | {_pct(r['served'], ref)}% | "
            f"{_pct(r['lost_to_state'], ref)}% | {_pct(r['lost_to_kv'], ref)}% | "
            f"{_pct(r['beyond'], ref)}% | {r['requests_losing_to_state']} / "
            f"{r['requests_losing_to_kv']} |"
        )
    ref = rows[0]["reference"] if rows else 0
    total = rows[0]["prompt_tokens"] if rows else 0
    out += ["", f"The reference serves {ref:,} of {total:,} prompt tokens "
            f"({_pct(ref, total)}%)." if rows else ""]  # fmt: skip
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paper.reference_gap", description=__doc__)
    ap.add_argument("--requests", type=int, default=600, help="first N requests (default 600)")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), help="(default: %(default)s)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES),
                    help="labels of paper.real_trace.POLICIES (default: %(default)s)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=RESULTS, help="(default: paper/results)")
    args = ap.parse_args(argv)
    known = {label for label, _, _ in real_trace.POLICIES}
    bad = [p for p in args.policies if p not in known]
    if bad:
        ap.error(f"unknown policy label(s) {bad}; choose from {sorted(known)}")
    if args.requests < 1:
        ap.error(f"--requests must be at least 1, got {args.requests}")
    if not real_trace.TRACE.exists():
        ap.error(f"{real_trace.TRACE} is not in this installation")
    rows = measure(args.requests, tuple(args.layouts), tuple(args.policies))
    dep = real_trace.DEPLOYMENT
    meta = run_meta(
        f"{args.requests} requests of {real_trace.TRACE.name} (arrivals x"
        f"{1 / real_trace.RATE_SCALE:.0f} apart), {dep.model}, {dep.memory / 2**30:g} GiB of "
        "cache",
        argv,
    )
    path = write_results(args.out, "reference-gap", meta, rows, table(rows, meta))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
