"""Fingerprints of the paper's simulator and Marconi runs: ``python -m paper.fingerprint``.

A refactor of the allocator must not change what it decides. This replays the runs the
paper's simulator figures (:data:`paper.figures.SIM_TRACES` x layouts x
:data:`paper.figures.SIM_POLICIES`) and the Marconi comparison (:func:`paper.marconi_gap`'s
tasks) make, and hashes, per run, what they measured: for the simulator the steps, hits,
preemptions, checkpoints and every request's TTFT; for a replay every request's hit, the
checkpoints, evictions and the sampled byte breakdowns. Run it in a checkout of each commit and
compare the two JSON files (``--compare before.json after.json`` lists the runs that differ).
``--requests`` shrinks the runs (the paper's: 2,000 each).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hybridkv.executors import (
    ExecutorUnavailable,
    add_executor_arguments,
    executor_options,
    open_executor,
)

from .provenance import run_meta
from .registry import PACKAGES


def _digest(*parts: object) -> str:
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, np.ndarray):
            h.update(np.ascontiguousarray(part).tobytes())
        else:
            h.update(repr(part).encode())
        h.update(b"|")
    return h.hexdigest()[:16]


def sim_tasks(n: int) -> list[tuple[int, str, str, str]]:
    from . import figures

    return [
        (n, label, layout, policy)
        for label, _, _ in figures.SIM_TRACES
        for layout in figures._sim_layouts()
        for policy in figures.SIM_POLICIES
        if figures._sim_plan(layout) is not None
    ]


#: the simulator result's fields a run's hash covers, in hash order
SIM_FIELDS = (
    "steps", "finished", "prompt_tokens", "hit_tokens", "shared_tokens", "preemptions",
    "peak_running", "checkpoints", "checkpoint_bytes", "ttft_s", "kv_bytes", "state_bytes",
)  # fmt: skip


def sim_fingerprint(task: tuple[int, str, str, str]) -> tuple[str, dict]:
    from . import figures

    t0 = time.perf_counter()
    r = figures._sim_run(task)
    key = "sim " + " / ".join(map(str, task))
    values = [getattr(r, name) for name in SIM_FIELDS]
    return key, {
        "steps": r.steps,
        "hit_tokens": r.hit_tokens,
        "preemptions": r.preemptions,
        "checkpoints": r.checkpoints,
        "hash": _digest(*values),
        # one digest per field: a run that differs says which of them did
        "parts": {name: _digest(v) for name, v in zip(SIM_FIELDS, values)},
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def marconi_tasks(n: int) -> list[tuple[str, int, str, str, int]]:
    from .marconi_gap import CAPACITIES, LAYOUTS

    tasks = []
    for cap in CAPACITIES:
        tasks += [(layout, cap, "marconi", "", n) for layout in LAYOUTS]
        for layout in ("inflate", "two_level"):
            tasks += [(layout, cap, "align", "", n), (layout, cap, "marconi", "no cascade", n)]
        tasks.append(("two_level", cap, "marconi", "by group", n))
    return tasks


def marconi_fingerprint(task: tuple[str, int, str, str, int]) -> tuple[str, dict]:
    from .marconi_gap import _gap_run

    t0 = time.perf_counter()
    r = _gap_run(task)
    key = "replay " + " / ".join(map(str, task))
    if isinstance(r, str):
        return key, {"hash": _digest(r), "misfit": r}
    parts = {
        "hits": r.hits,
        "checkpoints": r.checkpoints,
        "evictions": r.evictions,
        "samples": r.samples,
        "marconi_alpha": r.marconi_alpha,
    }
    return key, {
        "hit_tokens": int(r.hits.sum()),
        "checkpoints": r.checkpoints,
        "evictions": r.evictions,
        "hash": _digest(*parts.values()),
        "parts": {name: _digest(v) for name, v in parts.items()},
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def compare(before: Path, after: Path) -> int:
    a, b = (json.loads(p.read_text())["runs"] for p in (before, after))
    differ = [k for k in a if k in b and a[k]["hash"] != b[k]["hash"]]
    missing = sorted(set(a) ^ set(b))
    for k in differ:
        pa, pb = a[k].get("parts"), b[k].get("parts")
        which = (
            f" (in {', '.join(n for n in pa if pa[n] != pb.get(n)) or 'no recorded field'})"
            if pa and pb
            else ""
        )
        print(f"differs: {k}{which}: {_brief(a[k])} -> {_brief(b[k])}")
    for k in missing:
        print(f"only in one file: {k}")
    same = len([k for k in a if k in b]) - len(differ)
    print(f"{same} runs identical, {len(differ)} differ, {len(missing)} in one file only")
    return 1 if differ or missing else 0


def _brief(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "parts"}


def _fingerprint(job: tuple[Callable[[Any], tuple[str, dict]], Any]) -> tuple[str, dict]:
    """``(fingerprint function, task)`` -> its ``(key, record)`` (module level, so an executor
    can run it in a worker)."""
    fn, task = job
    return fn(task)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests per run (default 2000)")
    ap.add_argument("--out", type=Path, default=None, help="JSON file to write (default: print)")
    add_executor_arguments(ap, "the runs")
    ap.add_argument(
        "--only", choices=("sim", "replay"), default=None, help="one kind of run (default both)"
    )
    ap.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("BEFORE", "AFTER"),
        help="list the runs two fingerprint files disagree on, and run nothing",
    )
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    options = executor_options(args, PACKAGES, ap)
    jobs: list[tuple[Callable[[Any], tuple[str, dict]], Any]] = []
    if args.only in (None, "sim"):
        jobs += [(sim_fingerprint, t) for t in sim_tasks(args.requests)]
    if args.only in (None, "replay"):
        jobs += [(marconi_fingerprint, t) for t in marconi_tasks(args.requests)]
    runs: dict[str, dict] = {}
    try:
        with open_executor(options) as executor:
            for key, value in executor.imap(_fingerprint, jobs):
                runs[key] = value
                print(key, value, flush=True)
    except ExecutorUnavailable as exc:
        ap.error(str(exc))
    # where and with what the runs were made: a file made elsewhere may differ in floats
    meta = run_meta("paper.fingerprint", argv)
    text = json.dumps(
        {"requests": args.requests, "meta": meta, "runs": runs}, indent=1, sort_keys=True
    )
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    # the module imported by name runs, so the runs it maps are paper.fingerprint.*, which a
    # worker (a Ray one too) imports by that name (see paper.figures)
    from paper.fingerprint import main as _main

    sys.exit(_main())
