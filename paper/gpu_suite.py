"""Everything that needs a GPU, in one command: ``python -m paper.gpu_suite``.

Run it whenever a GPU is at hand (an H200 took 4-6 minutes with the default sweep budget).
In order:

1. the GPU tests (``HYBRIDKV_TEST_GPU=1 pytest -m gpu tests/kernel_tests``): bf16 attention,
   fp8 on hardware, the fp8 saturation contract, CUDA-graph capture of every ``plan.run``;
2. the benchmark at the fixed shapes of ``paper.bench_kernels.suite_cases`` (decode on every
   page size the plans produce, GQA 1-16, batch 1 at long context, fp8, MLA, state copies,
   cache writes, prefill), beside vLLM 0.33's Triton attention and SDPA on the same caches;
3. the host time of every wrapper and ``plan.run`` call (``paper.bench_host``);
4. a config sweep (every fitting config of ``CONFIGS``, and split counts for decode) of each
   case that misses its goal, and of the DSA indexer's and the sparse decode's cases (their
   configs are not measured yet), within what is left of the time budget;
5. the goals of the kernel issues, met or missed, with the numbers.

Results, with device, date, versions and commit, go into ``paper/results/``:
``kernels-<device>.{json,csv}`` (benchmark), ``host-<device>.json``, ``sweep-<device>.json``,
``gpu-tests-<device>.txt`` and ``gpu-suite-<device>.md`` (the goals); ``--copy-to DIR`` copies
them there too. It needs torch and triton (no package registry: the project's imports beyond
torch/triton/numpy/einops are avoided on this path) and, for the vLLM peer, its files fetched
beforehand into ``paper/peers/vllm-0.33`` (``python -m paper.peers.vllm_triton --fetch`` on a
machine with PyPI; carry that git-ignored folder along).

Without a GPU, ``--smoke --out DIR`` runs the same steps at tiny sizes under the Triton
interpreter (the test suite does, so the script cannot rot): its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "paper" / "results"


def ensure_kernels_importable() -> dict[str, str]:
    """``hybridkv_kernels`` is the installed name of ``kernels/``; on a machine where the
    checkout is not installed, put a link of that name on ``PYTHONPATH`` (this process and the
    test subprocess). Returns the environment for subprocesses."""
    env = dict(os.environ)
    try:
        import hybridkv_kernels  # noqa: F401

        return env
    except ImportError:
        pass
    shim = Path(tempfile.mkdtemp(prefix="hybridkv-path-"))
    (shim / "hybridkv_kernels").symlink_to(ROOT / "kernels", target_is_directory=True)
    for path in (str(ROOT), str(shim)):
        if path not in sys.path:
            sys.path.insert(0, path)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(ROOT), env.get("PYTHONPATH", "")])
    return env


# ---- goals -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Goal:
    """A target of the kernel issues over the benchmark's rows: ``rows`` picks the rows (or
    pairs of rows) it is about and ``value`` gives each one's measure; met when every value is
    at least ``target`` (``at_most``: at most)."""

    issue: int
    name: str
    text: str
    rows: Callable[[list[dict]], list[tuple[str, float]]]
    target: float
    unit: str
    at_most: bool = False

    def evaluate(self, rows: list[dict]) -> dict:
        values = self.rows(rows)
        if not values:
            return {"goal": self.name, "issue": self.issue, "text": self.text, "status": "no data"}
        worst = (max if self.at_most else min)(values, key=lambda kv: kv[1])
        met = all((v <= self.target) if self.at_most else (v >= self.target) for _, v in values)
        missed = [
            label for label, v in values if (v > self.target if self.at_most else v < self.target)
        ]
        return {
            "goal": self.name,
            "issue": self.issue,
            "text": self.text,
            "status": "met" if met else "missed",
            "target": self.target,
            "unit": self.unit,
            "worst": {"case": worst[0], "value": round(worst[1], 3)},
            "measured": len(values),
            "missed": missed,
        }


def _label(r: dict) -> str:
    keys = ("case", "model", "layout", "block_size", "batch", "context", "q_lens", "cached")
    keys += ("kv_dtype", "heads", "op", "tokens", "row_bytes", "q_tokens", "q_dtype", "sparse")
    shown = [k for k in keys if r.get(k) not in (None, "") and not (k == "sparse" and not r[k])]
    return " ".join(f"{k}={r[k]}" for k in shown)


def _ours(rows: list[dict], case: str, **where) -> list[dict]:
    return [
        r
        for r in rows
        if r["case"] == case
        and r["impl"] == "hybridkv"
        and all((w(r.get(k)) if callable(w) else r.get(k) == w) for k, w in where.items())
    ]


def _paired(rows: list[dict], case: str, peer: str, measure: str) -> list[tuple[str, float]]:
    """peer time / our time on the same case (> 1: we are faster)."""

    def key(r):
        return tuple(
            (k, str(v)) for k, v in sorted(r.items()) if k in ("model", "layout", "batch",
            "context", "q_lens", "cached", "kv_dtype", "heads", "block_size", "sparse")
        )  # fmt: skip

    theirs = {key(r): r for r in rows if r["case"] == case and r["impl"] == peer}
    out = []
    for r in _ours(rows, case):
        if key(r) in theirs:
            out.append((_label(r), theirs[key(r)][measure] / r[measure]))
    return out


def _fp8_ratio(rows: list[dict], case: str) -> list[tuple[str, float]]:
    """fp8 e4m3 time / bf16 time for the same tokens."""
    out = []
    fp8 = _ours(rows, case, kv_dtype="float8_e4m3fn")
    for r in fp8:
        same = [
            b
            for b in _ours(rows, case, kv_dtype="bfloat16")
            if all(
                b.get(k) == r.get(k)
                for k in ("model", "layout", "batch", "context", "q_lens", "sparse")
            )
        ]
        if same:
            out.append((_label(r), r["ms"] / same[0]["ms"]))
    return out


def _dense(width: int | None) -> bool:
    """A decode row that attends every cached token (no token list; older rows lack the
    field): the dense goals leave the sparse walk's rows out."""
    return not width


def _pct(rs: list[dict]) -> list[tuple[str, float]]:
    return [(_label(r), r["pct_copy"]) for r in rs]


def _tflops(rs: list[dict]) -> list[tuple[str, float]]:
    return [(_label(r), r["tflops"]) for r in rs]


BF16 = "bfloat16"
GOALS = (
    Goal(
        27, "decode >= 90%",
        "Decode >= 90% of copy bandwidth at batch >= 8 and context >= 4k on every page size",
        lambda rows: _pct(_ours(rows, "decode", kv_dtype=BF16, batch=lambda b: b >= 8,
                                context=lambda c: c >= 4096, sparse=_dense)),
        90, "% copy",
    ),
    Goal(
        27, "decode batch 1 >= 60%", "Decode >= 60% at batch 1 and context >= 32k",
        lambda rows: _pct(_ours(rows, "decode", kv_dtype=BF16, batch=1,
                                context=lambda c: c >= 32768, sparse=_dense)),
        60, "% copy",
    ),
    Goal(
        27, "decode vs vLLM", "Decode never slower than vLLM 0.33's Triton attention (time ratio)",
        lambda rows: _paired(rows, "decode", "vllm_triton", "ms"), 1.0, "x",
    ),
    Goal(
        27, "fp8 decode <= 0.6x", "fp8 e4m3 decode time <= 0.6x the bf16 time for the same tokens",
        lambda rows: _fp8_ratio(rows, "decode"), 0.6, "x", at_most=True,
    ),
    Goal(
        27, "MLA >= 80%", "MLA decode >= 80% of copy bandwidth at batch >= 8 and context >= 8k",
        lambda rows: _pct(_ours(rows, "mla", batch=lambda b: b >= 8,
                                context=lambda c: c >= 8192)),
        80, "% copy",
    ),
    Goal(
        27, "states >= 85%", "State gather / scatter / copy >= 85% at batch >= 8",
        lambda rows: _pct(_ours(rows, "states", batch=lambda b: b >= 8)), 85, "% copy",
    ),
    Goal(
        27, "cache write >= 70%", "Cache write >= 70% at >= 4k tokens",
        lambda rows: _pct(_ours(rows, "write", tokens=lambda t: t >= 4096)), 70, "% copy",
    ),
    Goal(
        28, "prefill >= 450 (pages >= 64)",
        "Causal bf16 prefill / extend >= 450 TFLOP/s on pages of >= 64 tokens",
        lambda rows: _tflops(_ours(rows, "prefill", kv_dtype=BF16,
                                   block_size=lambda b: (b or 0) >= 64)),
        450, "TFLOP/s",
    ),
    Goal(
        28, "prefill >= 350 (16-token pages)",
        "Causal bf16 prefill / extend >= 350 TFLOP/s on 16-token pages",
        lambda rows: _tflops(_ours(rows, "prefill", kv_dtype=BF16, block_size=16)),
        350, "TFLOP/s",
    ),
    Goal(
        28, "prefill >= 5x vLLM", "Prefill >= 5x vLLM 0.33's Triton attention (time ratio)",
        lambda rows: _paired(rows, "prefill", "vllm_triton", "ms"), 5.0, "x",
    ),
    Goal(
        28, "fp8 prefill <= 1x", "fp8 e4m3 prefill no slower than bf16",
        lambda rows: _fp8_ratio(rows, "prefill"), 1.0, "x", at_most=True,
    ),
)  # fmt: skip

HOST_GOAL_US = 30.0


def evaluate(rows: list[dict], host: list[dict]) -> list[dict]:
    out = [g.evaluate(rows) for g in GOALS]
    runs = [h for h in host if h["call"] == "run"]
    if runs:
        worst = max(runs, key=lambda h: h["us"])
        out.append(
            {
                "goal": "host <= 30 us",
                "issue": 27,
                "text": "Host time <= 30 us per layer call (plan.run, no sync)",
                "status": "met" if worst["us"] <= HOST_GOAL_US else "missed",
                "target": HOST_GOAL_US,
                "unit": "us",
                "worst": {"case": worst["kernel"], "value": round(worst["us"], 1)},
                "measured": len(runs),
                "missed": [h["kernel"] for h in runs if h["us"] > HOST_GOAL_US],
            }
        )
        graphs = [h for h in runs if "graph_ok" in h]
        if graphs:
            bad = [h["kernel"] for h in graphs if not h["graph_ok"]]
            out.append(
                {
                    "goal": "CUDA graphs",
                    "issue": 27,
                    "text": "Every plan.run captures in a CUDA graph and replays the eager result",
                    "status": "missed" if bad else "met",
                    "measured": len(graphs),
                    "missed": bad,
                }
            )
    return out


# ---- the sweep ---------------------------------------------------------------------------------


def sweep(missed_rows: list[dict], device, deadline: float, say) -> list[dict]:
    """Every fitting config (and, for decode, split counts around the chosen one) of each case
    that missed its goal, until ``deadline``."""
    from paper import bench_kernels as bk

    results = []
    for r in missed_rows:
        if time.time() > deadline:
            results.append({"case": _label(r), "status": "not swept: out of time"})
            continue
        try:
            results.extend(bk.sweep_case(r, device, deadline))
        except Exception as e:  # one case's failure must not lose the others' results
            results.append({"case": _label(r), "status": f"error: {e!r}"[:300]})
        say(f"swept {_label(r)}")
    return results


def _unmeasured_rows(rows: list[dict], kinds: list[str] | None) -> list[dict]:
    """Our rows of the kernels with no measured config table yet (the DSA indexer, the GQA
    decode's sparse walk): swept whether or not a goal names them, after the missed goals'
    cases, when their kind is swept."""
    return [
        r
        for r in rows
        if r["impl"] == "hybridkv"
        and (r["case"] == "indexer" or (r["case"] == "decode" and r.get("sparse")))
        and (kinds is None or r["case"] in kinds)
    ]


def _missed_rows(rows: list[dict], goals: list[dict], kinds: list[str] | None) -> list[dict]:
    """Our rows behind a missed goal, in the order of ``kinds`` (all kinds: the benchmark's
    order), one per shape class (model, page size, dtype, heads, batch), since a config that
    wins on one context length of a class wins on the others too."""
    missed = {label for g in goals if g.get("status") == "missed" for label in g["missed"]}
    picked = [r for r in rows if r["impl"] == "hybridkv" and _label(r) in missed]
    if kinds is not None:
        picked = sorted(
            (r for r in picked if r["case"] in kinds), key=lambda r: kinds.index(r["case"])
        )
    seen, out = set(), []
    for r in picked:
        key = tuple(str(r.get(k)) for k in ("case", "model", "block_size", "kv_dtype", "heads",
                                             "batch", "op", "sparse"))  # fmt: skip
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


# ---- the report --------------------------------------------------------------------------------


def markdown(meta: dict, goals: list[dict], tests: dict, sweep_rows: list[dict]) -> str:
    lines = [
        f"# GPU suite: {meta['device']} ({meta['date']})",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, commit `{meta['commit'][:10]}`"
        + (" (uncommitted changes)" if meta.get("dirty") else "")
        + f", copy bandwidth {meta['copy_bandwidth_gbps']:.0f} GB/s.",
        "",
        f"GPU tests: {tests.get('summary', 'not run')}",
        "",
        "| issue | goal | status | worst case | worst | target |",
        "|---|---|---|---|---|---|",
    ]
    for g in goals:
        worst = g.get("worst", {})
        target = g.get("target", "")
        unit = g.get("unit", "")
        lines.append(
            f"| {g['issue']} | {g['text']} | {g['status']} | {worst.get('case', '')} | "
            f"{worst.get('value', '')} {unit} | {target} {unit} |"
        )
    best = [s for s in sweep_rows if s.get("best")]
    if best:
        lines += ["", "## Sweep: the best config of each missed case", ""]
        lines += ["| case | default | best config | default | best |", "|---|---|---|---|---|"]
        for s in best:
            lines.append(
                f"| {s['case']} | {s.get('default_config', '')} | {s['config']} | "
                f"{s.get('default_value', ''):.4g} | {s['value']:.4g} {s.get('unit', '')} |"
            )
    return "\n".join(lines) + "\n"


def site_packages() -> list[str]:
    """This interpreter's package folders."""
    import site

    return [p for p in (*site.getsitepackages(), site.getusersitepackages()) if p]


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def run_tests(env: dict, out: Path, tag: str, smoke: bool, limit_s: float, say) -> dict:
    """The GPU tests in a subprocess (their own interpreter setting), output saved."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/kernel_tests", "-q"]
    cmd += ["-p", "no:cacheprovider", "-rs"]
    if not smoke and importlib.util.find_spec("xdist") is not None:
        # the tests are mostly Triton compiles, which run in parallel on the host's cores
        cmd += ["-n", str(min(8, os.cpu_count() or 1))]
    if not smoke and importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", "180"]  # a hung kernel fails its test, not the whole suite
    env = dict(env)
    if not smoke:
        env["HYBRIDKV_TEST_GPU"] = "1"
        env.pop("TRITON_INTERPRET", None)
    t0 = time.time()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s
        )
        text, returncode = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text = f"{_text(e.stdout)}{_text(e.stderr)}\nstopped after {limit_s:.0f} s in total"
        returncode = -1
    # the machine's install paths (warnings quote them) say nothing about the kernels
    for site in sorted(set(site_packages()), key=len, reverse=True):
        text = text.replace(site, "<site-packages>")
    text = text.replace(sys.executable, "<python>")
    (out / f"gpu-tests-{tag}.txt").write_text(text)
    summary = next(
        (
            line.strip("= ")
            for line in reversed(text.splitlines())
            if re.search(r"\b\d+ (passed|failed|skipped|deselected|errors?)\b.* in ", line)
        ),
        "no summary",
    )
    say(f"GPU tests: {summary} ({time.time() - t0:.0f} s)")
    return {"returncode": returncode, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    ap.add_argument("--copy-to", type=Path, help="also copy the result files here")
    ap.add_argument("--budget-s", type=float, default=450, help="stop sweeping after this")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes under the interpreter")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument(
        "--bench",
        help="benchmark only these case kinds (e.g. prefill,indexer: a rerun after a change)",
    )
    ap.add_argument(
        "--sweep",
        help="sweep only these case kinds, in this order (e.g. prefill,mla,write,states)",
    )
    ap.add_argument(
        "--tests-limit-s",
        type=float,
        default=300,
        help="stop the GPU tests after this (the benchmark runs even if a test hangs)",
    )
    args = ap.parse_args(argv)
    t_start = time.time()
    env = ensure_kernels_importable()
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        ap.error("no GPU: run it where one is, or pass --smoke --out DIR for the CPU check")
    if args.smoke:
        if args.out == RESULTS:
            ap.error("--smoke numbers mean nothing: pass --out to a scratch folder")
        os.environ.setdefault("TRITON_INTERPRET", "1")
        env["TRITON_INTERPRET"] = "1"
    from paper import bench_host
    from paper import bench_kernels as bk

    def say(msg: str) -> None:
        print(f"[{time.time() - t_start:6.0f} s] {msg}", flush=True)

    device = torch.device("cpu" if args.smoke else "cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    tests = {"summary": "skipped (--skip-tests)"}
    if not args.skip_tests:
        tag_for_tests = (
            "cpu-interpreter" if args.smoke else torch.cuda.get_device_name().replace(" ", "-")
        )
        tests = run_tests(env, args.out, tag_for_tests, args.smoke, args.tests_limit_s, say)
    cases = bk.quick_cases() if args.smoke else bk.suite_cases()
    if args.bench:
        benched = args.bench.split(",")
        unknown = set(benched) - {type(c).__name__.lower() for c in cases}
        if unknown:
            ap.error(f"--bench: the suite has no cases of kind {sorted(unknown)}")
        cases = [c for c in cases if type(c).__name__.lower() in benched]
    meta, rows, extra = bk.run_set(cases, device, 1 if args.smoke else None, True, say)
    meta["set"] = "quick" if args.smoke else "suite"
    tag = bk.device_tag(meta)
    files = [bk.write_results(args.out, meta, rows, **extra)]
    files.append(args.out / f"kernels-{tag}.csv")
    host = bench_host.measure(device, say)
    host_path = args.out / f"host-{tag}.json"
    host_path.write_text(json.dumps({"meta": meta, "rows": host}, indent=1))
    files.append(host_path)
    goals = evaluate(rows, host)
    deadline = t_start + args.budget_s
    kinds = args.sweep.split(",") if args.sweep else None
    to_sweep = _missed_rows(rows, goals, kinds) + _unmeasured_rows(rows, kinds)
    sweep_rows = sweep(to_sweep, device, deadline, say)
    sweep_path = args.out / f"sweep-{tag}.json"
    sweep_path.write_text(json.dumps({"meta": meta, "rows": sweep_rows}, indent=1, default=str))
    files.append(sweep_path)
    report = {"meta": meta, "tests": tests, "goals": goals}
    (args.out / f"gpu-suite-{tag}.json").write_text(json.dumps(report, indent=1, default=str))
    md = markdown(meta, goals, tests, sweep_rows)
    md_path = args.out / f"gpu-suite-{tag}.md"
    md_path.write_text(md)
    files += [args.out / f"gpu-suite-{tag}.json", md_path, args.out / f"gpu-tests-{tag}.txt"]
    if args.copy_to:
        args.copy_to.mkdir(parents=True, exist_ok=True)
        for f in files:
            if f.exists():
                shutil.copy(f, args.copy_to / f.name)
    print(md)
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
