"""The paged prefill's two sm_90 paths side by side, compiled on a CPU: the generic kernel (what
the default table picks today) and every Hopper-path config, per shape class.

For each class (cache dtype x head dim x GQA x page size; one fresh 2,048-token request, the
class the GPU sweeps measured) the launch is captured from ``paged_prefill_attention`` on meta
tensors and compiled for sm_90 with the config forced (``paper.compile_kernels``'s capture and
compile), and the hot loop's SASS is counted: warpgroup MMAs (HGMMA/QGMMA), the waits on them
(``WARPGROUP.DEPBAR``), integer address math (IMAD + LEA + IADD3), global loads by kind
(LDG synchronous, LDGSTS cp.async, UTMALDG TMA), all instructions, each also per key of the
tile; registers, spills and shared memory from ``ptxas -v`` and the compiled metadata.

    python -m paper.compile_prefill_paths            # paper/results/compile-prefill-paths.*
    python -m paper.compile_prefill_paths --quick --out /tmp/pp   # bf16, GQA 8 only
    PYTHONPATH=<triton 3.6 site> python -m paper.compile_prefill_paths --quick --suffix=-triton3.6

The second form compiles with another Triton (the GPU image's 3.6, unpacked from its wheel with
``pip download --no-deps triton==3.6.0``): its ptxas and passes differ, and so do spills and
MMA waits (``paper/results/compile-prefill-paths-triton3.6.md``).

The Hopper configs that spill here are ``_HOPPER_PATH_SPILLS`` of ``kernels/paged_prefill.py``;
``tests/kernel_tests/test_compile_prefill_paths.py`` checks the committed report against it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from paper import compile_kernels as ck

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "paper" / "results"
ARCH = 90


def shape_classes(quick: bool) -> list[dict]:
    """The prefill cases compiled: Qwen3-Next's head dim 256 and Nemotron-H's 128, MHA-like
    GQA 1 and GQA 8, 16-token pages and vLLM's inflated 576-token pages, bf16 and e4m3."""
    out = []
    for dtype in ("bf16",) if quick else ("bf16", "e4m3"):
        for d in (128, 256):
            for gqa in (8,) if quick or dtype == "e4m3" else (1, 8):
                for bs in (16, 576):
                    out.append({"dtype": dtype, "d": d, "gqa": gqa, "bs": bs, "win": 0, "i64": 0})
    return out


def _jobs(p: dict, config, default: bool) -> list[dict]:
    """The compile job(s) of ``p``'s 2,048-token launch with ``config`` forced (the default's
    own config when ``default``)."""
    from hybridkv_kernels import paged_prefill as pp

    real = pp.choose_config
    if not default:
        pp.choose_config = lambda shape: (config, "forced")
    try:
        launches, _ = ck.capture(ck._case("prefill", **p), ARCH, autotune=False)
    finally:
        pp.choose_config = real
    return launches[-1].configs  # the batch-1 2,048-token launch


def _row(p: dict, path: str, job: dict, res: dict) -> dict:
    cx = job["constexprs"]
    block_n = cx["BLOCK_N"]
    row = {
        **{k: p[k] for k in ("dtype", "d", "gqa", "bs")},
        "path": path,
        "config": job["config"],
        "tma": bool(cx.get("KV_TMA")),
        "block_n": block_n,
        **{
            k: res.get(k)
            for k in ("status", "error", "registers", "spill_stores", "shared", "fits")
        },
    }
    for k in ("insns", "mma", "mma_waits", "int_ops", "ldg", "ldgsts", "tma"):
        row[f"loop_{k}"] = res.get(f"loop_{k}")
    if res.get("loop_insns"):
        row["insns_per_key"] = round(res["loop_insns"] / block_n, 2)
        row["int_per_key"] = round(res["loop_int_ops"] / block_n, 2)
    row["sync_loads"] = res.get("ttgir_loop_sync_loads")
    return row


def run(quick: bool, jobs: int, say=print) -> list[dict]:
    from hybridkv_kernels import paged_prefill as pp

    todo = []
    for p in shape_classes(quick):
        for job in _jobs(p, None, default=True):
            todo.append((p, "generic (table default)", job))
        for c in pp.CONFIGS:
            if c.hopper:
                for job in _jobs(p, c, default=False):
                    todo.append((p, "hopper", job))
    say(f"{len(todo)} compiles, {jobs} workers")
    ctx = multiprocessing.get_context("spawn")
    rows, t0 = [], time.time()
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=ck._worker_init) as pool:
        futures = [(p, path, job, pool.submit(ck.compile_job, job)) for p, path, job in todo]
        for i, (p, path, job, fut) in enumerate(futures, 1):
            rows.append(_row(p, path, job, fut.result()))
            if i % 10 == 0 or i == len(futures):
                say(f"  {i}/{len(futures)} ({time.time() - t0:.0f} s)")
    return rows


def markdown(rows: list[dict], prov: dict) -> str:
    lines = [
        "# Paged prefill on sm_90: generic kernel vs Hopper path (compiled, not run)",
        "",
        f"{prov['date']}, triton {prov['triton']}, ptxas {prov['ptxas_sm90']}, commit "
        f"{prov['commit']}. One fresh 2,048-token request per class; the hot loop's SASS "
        "(per iteration, and per key of the tile). `mma` = HGMMA/QGMMA, `waits` = "
        "WARPGROUP.DEPBAR, `int` = IMAD+LEA+IADD3, loads: LDG / LDGSTS (cp.async) / UTMALDG "
        "(TMA). A spilling or oversized config is not admitted by `config_fits`.",
        "",
        "| cache | d | GQA | page | path | config | TMA | regs | spill B | shared B | fits "
        "| insns | mma | waits | int | LDG/LDGSTS/TMA | insns/key | int/key |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cfg = r["config"].replace("BLOCK_M=", "").replace(",BLOCK_N=", "x")
        cfg = cfg.replace(",num_warps=", " w").replace(",num_stages=", " s")
        if r["status"] != "ok":
            lines.append(
                f"| {r['dtype']} | {r['d']} | {r['gqa']} | {r['bs']} | {r['path']} | {cfg} "
                f"| | | | | | {r['status']}: {r['error'][:80]} | | | | | | |"
            )
            continue
        lines.append(
            f"| {r['dtype']} | {r['d']} | {r['gqa']} | {r['bs']} | {r['path']} | {cfg} | "
            f"{'yes' if r['tma'] else ''} | {r['registers']} | {r['spill_stores']} | "
            f"{r['shared']} | {'yes' if r['fits'] else 'no'} | {r['loop_insns']} | "
            f"{r['loop_mma']} | {r['loop_mma_waits']} | {r['loop_int_ops']} | "
            f"{r['loop_ldg']}/{r['loop_ldgsts']}/{r['loop_tma']} | {r.get('insns_per_key')} | "
            f"{r.get('int_per_key')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="bf16, GQA 8 only")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT, help="folder for the .json and .md")
    ap.add_argument(
        "--suffix",
        default="",
        help="appended to the file names (--suffix=-triton3.6: a run under another Triton)",
    )
    args = ap.parse_args(argv)
    ck._require_compiled_mode()
    t0 = time.time()
    rows = run(args.quick, args.jobs)
    prov = ck.provenance(args.quick, time.time() - t0, (ARCH,))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"compile-prefill-paths{args.suffix}"
    (args.out / f"{stem}.json").write_text(
        json.dumps({"provenance": prov, "rows": rows}, indent=1, default=str) + "\n"
    )
    (args.out / f"{stem}.md").write_text(markdown(rows, prov))
    print(f"wrote {args.out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    raise SystemExit(main())
