"""Allocator speed: ``python -m paper.bench_alloc [--out paper/results]``.

For every layout, 256 running requests of Qwen3-Next-80B-A3B (40 GiB per rank) decode: one step
appends a token to every request, allocates blocks where a request crosses a block boundary,
caches full blocks / takes checkpoints, and rebuilds the per-group block tables the kernels read.
Reports the CPU time of one such step, and allocate + free + hash operations per second. To
compare two commits, run this in a checkout of each, back to back, and commit the earlier one's
file as ``alloc-cpu-before.json``: the table then shows both.
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
from hybridkv.alloc import AllocatorOptions, HybridAllocator
from hybridkv.alloc.hashing import extend_unit_hashes, get_hash_fn, token_array
from hybridkv.layouts import LAYOUTS, make_plan

RESULTS = Path(__file__).parent / "results"
#: the benchmark's allocator options (with each layout's policy): hash unit 16, and no request
#: refused for its length
OPTIONS = AllocatorOptions(hash_block_size=16, max_model_len=1 << 20)


def bench_layout(
    layout: str, num_reqs: int, steps: int, prompt_len: int, synchronized: bool, policy: str
) -> dict:
    """``synchronized``: every prompt has the same length, so all requests cross a block
    boundary (allocate, hash, cache, checkpoint) in the same step: the worst case. Otherwise
    prompt lengths spread over 64 tokens, as in a real batch."""
    model = models.load("qwen3-next-80b-a3b")
    plan = make_plan(model, layout, memory="40GiB", max_num_seqs=num_reqs, block_size=16)
    alloc = HybridAllocator(plan, OPTIONS.replace(checkpoint_policy=policy))
    for r in range(num_reqs):
        n = prompt_len if synchronized else prompt_len + (r * 37) % 64
        alloc.add_request(r, list(range(r * 100_000, r * 100_000 + n)))
        assert alloc.allocate_slots(r, n)
    alloc.take_state_copies()  # the prefill's commit
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
    alloc = HybridAllocator(plan, OPTIONS)
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
        "phases": "synchronized" if synchronized else "spread",
        "policy": policy,
        "block_size": plan.block_size,
        "requests": num_reqs,
        "decode_step_ms_median": 1e3 * times[len(times) // 2],
        "decode_step_ms_p90": 1e3 * times[int(0.9 * len(times))],
        "decode_step_ms_p99": 1e3 * times[int(0.99 * len(times))],
        "request_ops_per_s": ops / churn,
    }


def bench_hashing(num_tokens: int = 1 << 20, h: int = 16) -> list[dict]:
    """Chained hash units per second over one long prompt, per algorithm."""
    tokens = token_array(range(num_tokens))
    rows = []
    for algo in ("sha256", "blake2b", "builtin"):
        fn = get_hash_fn(algo)
        t0 = time.perf_counter()
        units = extend_unit_hashes([], tokens, num_tokens, h, b"", fn)
        dt_s = time.perf_counter() - t0
        rows.append(
            {
                "algo": algo,
                "hash_block_size": h,
                "units_per_s": len(units) / dt_s,
                "tokens_per_s": num_tokens / dt_s,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--requests", type=int, default=256)
    args = parser.parse_args(argv)
    rows = [
        bench_layout(layout, args.requests, args.steps, 1000, sync, policy)
        for sync, policy in ((False, "align"), (False, "last"), (True, "align"))
        for layout in LAYOUTS
    ]
    hashing = bench_hashing()
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
    (args.out / "alloc-cpu.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "hashing": hashing}, indent=1)
    )
    for r in rows:
        print(
            f"{r['layout']:<10} {r['phases']:<12} {r['policy']:<6} "
            f"block {r['block_size']:>4}  decode step "
            f"{r['decode_step_ms_median']:.3f} ms (p90 {r['decode_step_ms_p90']:.3f})  "
            f"{r['request_ops_per_s']:,.0f} request ops/s"
        )
    for r in hashing:
        print(
            f"hash {r['algo']:<8} {r['units_per_s']:,.0f} units/s "
            f"({r['tokens_per_s']:,.0f} tokens/s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
