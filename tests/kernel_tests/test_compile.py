"""Every kernel's real launches compile for sm_80 (A100) and sm_90 (H100) without a GPU, at the
config each launch runs with (its table default), with no spills, and every launch has a config
that fits the arch's shared memory.

``python -m paper.compile_kernels --quick --defaults-only`` runs in a subprocess (it needs a
process where ``TRITON_INTERPRET`` is not set; ``tests/conftest.py`` sets it here): it captures
the launches of the public wrappers on meta tensors, compiles each launch's table config with
``triton.compile(..., target=GPUTarget("cuda", cc, 32))`` and reads registers and spills from
``ptxas -v``. The MLA decode kernel's sparse walk (``token_indices``, k = 2048) is in the quick
matrix and reported as its own kernel, ``_mla_partial_kernel (sparse)``; so are the paged decode's
and prefill's attention-sink variants (``sinks=``, ``HAS_SINKS=True``) and relative-position-bias
variants (``rel_states=``/``rel_proj=``, ``HAS_REL=True``: Inkling's full and sliding layers);
the paged decode's sparse walk (``token_indices``, Qwen4-Exp's 2,063-entry QSA pick, 16-bit
and fp8 past 2**31) as ``_decode_partial_kernel (sparse)`` and the indexer's QSA pooling
(``pool="mean_norm_rope"``) as ``_indexer_scores_kernel (mean_norm_rope)``.

Why the defaults only: they are what a launch without autotuning runs (every launch in the
package and its tests). The autotune candidates (``autotune=True``, a GPU only) are about four
times as many compiles (392 rows against 94 when this was measured, 2026-11-27: about 7 minutes
on 2 cores with a cold Triton cache against about 1.5), which put the whole suite past the 15
minutes CI has. A change to a kernel or
its candidate lists is checked with ``python -m paper.compile_kernels --quick --strict`` (every
candidate of a wrapper call's first launch) or the full matrix, ``python -m paper.compile_kernels
--strict`` (see ``paper/README.md``); ``config_fits``' own tests keep the spill rules those found.
The test is marked ``slow``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _table(fails: list[dict]) -> str:
    lines = [f"{'kernel':<24} {'arch':<6} {'config':<40} case: reason"]
    lines += [
        f"{f['kernel']:<24} {f['arch']:<6} {f['config']:<40} {f['case']}: {f['reason']}"
        for f in fails
    ]
    return "\n".join(lines)


@pytest.mark.slow
def test_quick_matrix_compiles_without_spills_and_fits(tmp_path):
    # one test, so that parallel (xdist) workers do not each run the subprocess
    out = tmp_path / "compile-kernels.json"
    env = {
        k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HYBRIDKV_VALIDATE")
    }
    cmd = [
        sys.executable,
        "-m",
        "paper.compile_kernels",
        "--quick",
        "--defaults-only",
        "--jobs",
        "2",
        "--json",
        out,
    ]
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, (
        f"the check crashed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    report = json.loads(out.read_text())

    # the check itself saw every kernel on both archs
    kernels = {r["kernel"] for r in report["rows"]}
    for name in ("decode", "prefill", "mla", "write_kv", "gather", "scatter", "copy"):
        assert any(name in k for k in kernels), f"no launch of a {name} kernel was captured"
    assert {r["arch"] for r in report["rows"]} == {80, 90}
    # the MLA kernel's sparse walk (a token-index list) is compiled and reported on its own
    sparse = [r for r in report["rows"] if r["kernel"] == "_mla_partial_kernel (sparse)"]
    assert {r["arch"] for r in sparse} == {80, 90}
    assert all("topk=" in r["case"] and "SPARSE=True" in r["constexprs"] for r in sparse)
    assert {s["arch"] for s in report["summary"] if s["kernel"].endswith("(sparse)")} == {
        "sm_80",
        "sm_90",
    }
    # GLM-5-Next's NoPE MLA (DIM_R 0: no rope part) compiles on both archs
    nope = [r for r in report["rows"] if "mla" in r["kernel"] and "DIM_R=0" in r["constexprs"]]
    assert {r["arch"] for r in nope} == {80, 90}, "the NoPE MLA walk was not compiled"
    # Kimi-Linear's 32 heads padded to a warpgroup's 64 rows compile to wgmma on sm_90
    padded = [
        r for r in report["rows"] if r["kernel"] == "_mla_partial_kernel" and "hpp=64" in r["case"]
    ]
    assert padded and all(r["arch"] == 90 and r["sass_hgmma"] > 0 for r in padded), padded
    # the attention-sink variants (HAS_SINKS=True) of the paged decode and prefill compile too
    for name in ("_decode_partial_kernel", "_prefill_kernel"):
        with_sinks = [
            r
            for r in report["rows"]
            if name in r["kernel"] and "HAS_SINKS=True" in r.get("constexprs", "")
        ]
        assert {r["arch"] for r in with_sinks} == {80, 90}, f"{name} with sinks not compiled"
        # ... and the relative-position-bias variants (HAS_REL=True), windowed and not
        with_rel = [
            r
            for r in report["rows"]
            if name in r["kernel"] and "HAS_REL=True" in r.get("constexprs", "")
        ]
        assert {(r["arch"], "win=0" in r["case"]) for r in with_rel} == {
            (arch, full) for arch in (80, 90) for full in (True, False)
        }, f"{name} with a relative bias not compiled"
    prov = report["provenance"]
    for key in ("date", "triton", "torch", "ptxas_sm80", "ptxas_sm90", "commit", "machine"):
        assert prov.get(key), key

    fails = report["failures"]
    groups = {
        "COMPILE / CAPTURE ERRORS": [f for f in fails if "error" in f["reason"].split(":")[0]],
        "SPILLS (registers to local memory)": [
            f for f in fails if f["reason"].startswith("spill")
        ],
        "LAUNCHES NO CONFIG FITS (shared memory)": [
            f for f in fails if f["reason"].startswith("no config fits")
        ],
    }
    message = "\n\n".join(
        f"{title}: {len(fs)}\n{_table(fs)}" for title, fs in groups.items() if fs
    )
    assert not fails, f"{len(fails)} failing kernel configs\n\n{message}"
