"""Marconi's alpha fixed or tuned online, in the simulator (batched serving, not one request at
a time): ``python -m paper.alpha_online [--requests 600] [--out paper/results]``.

Multi-turn chat (``traces.multi_turn_chat(n, seed)``, seeds 0 and 1) on Qwen3.5-4B with 3 GiB
of cache and 16 running requests at most (small enough that the cache evicts within a few
hundred requests), ``marconi`` with alpha fixed at 1.0 (the allocator's default until
2026-12-07), fixed at 0.0 (Marconi's tuner's start), tuned once on the first window with all 21
values of Marconi's grid (``marconi_alpha_stride=1``, Marconi's simulator), tuned once with the
simulator's default coarse-to-fine search (9 of them) and tuned on every window
(``retune_marconi_alpha``, Marconi's system), on two_level and inflate. Records token hit
rate, the prefill FLOPs the hits saved (the tuner's own objective), TTFT, when it was tuned and
what each tuning chose, the first tuning's replay score per alpha tried, and the wall time with
the tuning's part of it.
Writes ``alpha-online.json`` and ``alpha-online.md`` (date, machine, commit)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hybridkv import models, traces
from hybridkv.layouts import make_plan

from .provenance import run_meta, write_results

RESULTS = Path(__file__).parent / "results"
MODEL, MEMORY, MAX_NUM_SEQS = "qwen3.5-4b", "3GiB", 16
LAYOUTS = ("two_level", "inflate")
#: chat traces: two seeds, so that a choice that holds on one is checked on another
SEEDS = (0, 1)
#: label: the simulator's options (alpha fixed or ``"auto"``, retuning, the search's stride):
#: fixed, tuned once on the first window (Marconi's simulator: its whole grid; the default:
#: coarse to fine), tuned on every window (Marconi's system)
SETTINGS = {
    "alpha 1.0": {"marconi_alpha": 1.0},
    "alpha 0.0": {"marconi_alpha": 0.0},
    "tuned once, 21 alphas": {"marconi_alpha_stride": 1},
    "tuned once (default)": {},
    "tuned online": {"retune_marconi_alpha": True},
}


def measure(n: int) -> list[dict]:
    from hybridkv.sim import SimConfig, simulate

    model = models.load(MODEL)
    rows = []
    for seed in SEEDS:
        trace = traces.multi_turn_chat(n, seed=seed)
        for layout in LAYOUTS:
            plan = make_plan(model, layout, memory=MEMORY, max_num_seqs=MAX_NUM_SEQS)
            for label, settings in SETTINGS.items():
                config = SimConfig(checkpoint_policy="marconi", **settings)
                t0 = time.perf_counter()
                r = simulate(plan, model, trace, config)
                s = r.summary()
                rows.append({
                    "seed": seed, "layout": layout, "setting": label,
                    "token_hit_rate": r.token_hit_rate,
                    "compute_saved_pflop": s["compute_saved_pflop"],
                    "ttft_p50_ms": s["ttft_p50_ms"], "ttft_p90_ms": s["ttft_p90_ms"],
                    "alpha_end": r.marconi_alpha, "tuned_at": list(r.alpha_tuned_at),
                    "choices": list(r.alpha_choices),
                    "wall_s": round(time.perf_counter() - t0, 1),
                    "alpha_tuning_s": round(r.alpha_tuning_s, 1),
                    # per tuning, the replay's prefill PFLOP saved per alpha tried
                    "scores": [
                        {f"{a:g}": round(v / 1e15, 4) for a, v in sorted(sc.items())}
                        for sc in r.alpha_scores
                    ],
                })  # fmt: skip
                print(rows[-1], flush=True)
    return rows


def table(rows: list[dict], meta: dict) -> str:
    out = [
        "# marconi's alpha: fixed or tuned online, in the simulator",
        "",
        f"{meta['what']}. Measured {meta['date']} on {meta['machine']} ({meta['cpus']} CPUs, "
        "other jobs running: wall times are comparable within this table only), commit "
        f"`{meta['commit'][:12]}`; `python -m paper.alpha_online {' '.join(meta['argv'])}`.",
        "",
        "| seed | layout | alpha | token hit rate | prefill saved (PFLOP) | TTFT p50 / p90 (ms) "
        "| tuned after (finished requests): alpha chosen | wall (s) | of it tuning (s) |",
        "|---:|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        tuned = ", ".join(f"{n}: {a:.1f}" for n, a in zip(r["tuned_at"], r["choices"])) or "-"
        out.append(
            f"| {r['seed']} | {r['layout']} | {r['setting']} | {100 * r['token_hit_rate']:.1f}% "
            f"| {r['compute_saved_pflop']:.2f} | {r['ttft_p50_ms']:.0f} / "
            f"{r['ttft_p90_ms']:.0f} | {tuned} | {r['wall_s']:.1f} | {r['alpha_tuning_s']:.1f} |"
        )
    firsts = [r for r in rows if r["scores"]]
    if firsts:
        alphas = sorted({a for r in firsts for a in r["scores"][0]}, key=float)
        out += [
            "",
            "## The first tuning's replay scores",
            "",
            "Prefill PFLOP each alpha saved in the first tuning's replay (the tuner's objective; "
            "blank: not tried by that search).",
            "",
            "| seed | layout | alpha | " + " | ".join(alphas) + " |",
            "|---:|---|---|" + "---:|" * len(alphas),
        ]
        for r in firsts:
            first = r["scores"][0]
            cells = " | ".join(f"{first[a]:.3f}" if a in first else "" for a in alphas)
            out.append(f"| {r['seed']} | {r['layout']} | {r['setting']} | {cells} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paper.alpha_online", description=__doc__)
    ap.add_argument("--requests", type=int, default=600, help="(default: %(default)s)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="(default: paper/results)")
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error(f"--requests must be at least 1, got {args.requests}")
    rows = measure(args.requests)
    meta = run_meta(
        f"multi_turn_chat({args.requests}, seed=0 and 1), {MODEL}, {MEMORY} of cache, "
        f"max_num_seqs={MAX_NUM_SEQS}, checkpoint_policy marconi",
        argv,
    )
    path = write_results(args.out, "alpha-online", meta, rows, table(rows, meta))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
