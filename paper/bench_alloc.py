"""Allocator speed: ``python -m paper.bench_alloc [--out paper/results]``.

For every layout, 256 running requests of Qwen3-Next-80B-A3B (40 GiB per rank) decode: one step
appends a token to every request, allocates blocks where a request crosses a block boundary,
caches full blocks / takes checkpoints, and rebuilds the per-group block tables the kernels read.
Reports the CPU time of one such step, and allocate + free + hash operations per second.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from hybridkv import models
from hybridkv.alloc import HybridAllocator
from hybridkv.layouts import LAYOUTS, make_plan

RESULTS = Path(__file__).parent / "results"


def bench_layout(layout: str, num_reqs: int, steps: int, prompt_len: int) -> dict:
    model = models.load("qwen3-next-80b-a3b")
    plan = make_plan(model, layout, memory="40GiB", max_num_seqs=num_reqs, block_size=16)
    alloc = HybridAllocator(plan, hash_block_size=16, max_model_len=1 << 20)
    for r in range(num_reqs):
        alloc.add_request(r, list(range(r * 100_000, r * 100_000 + prompt_len)))
        assert alloc.allocate_slots(r, prompt_len)
    alloc.take_events()
    reqs = list(range(num_reqs))
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        for r in reqs:
            alloc.append_tokens(r, [step])
            if not alloc.allocate_slots(r, 1):
                raise RuntimeError("pool exhausted during the benchmark")
        alloc.block_tables(reqs)
        alloc.take_state_copies()
        alloc.take_events()
        times.append(time.perf_counter() - t0)
    times.sort()
    # churn on an empty allocator: add, allocate and free requests of two blocks each
    alloc = HybridAllocator(plan, hash_block_size=16, max_model_len=1 << 20)
    t0 = time.perf_counter()
    ops = 0
    for r in range(num_reqs, num_reqs + 2000):
        alloc.add_request(r, list(range(r, r + 17)))
        alloc.allocate_slots(r, 17)
        alloc.free(r)
        ops += 3
    churn = time.perf_counter() - t0
    return {
        "layout": layout,
        "block_size": plan.block_size,
        "requests": num_reqs,
        "decode_step_ms_median": 1e3 * times[len(times) // 2],
        "decode_step_ms_p90": 1e3 * times[int(0.9 * len(times))],
        "request_ops_per_s": ops / churn,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--requests", type=int, default=256)
    args = parser.parse_args(argv)
    rows = [bench_layout(layout, args.requests, args.steps, 1000) for layout in LAYOUTS]
    try:
        commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    meta = {
        "machine": platform.platform(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "alloc-cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    for r in rows:
        print(
            f"{r['layout']:<10} block {r['block_size']:>4}  decode step "
            f"{r['decode_step_ms_median']:.3f} ms (p90 {r['decode_step_ms_p90']:.3f})  "
            f"{r['request_ops_per_s']:,.0f} request ops/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
