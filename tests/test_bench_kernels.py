"""The kernel benchmark runs end to end (CPU smoke mode: the numbers mean nothing here)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_bench_kernels_quick(tmp_path):
    from paper.bench_kernels import main

    assert main(["--quick", "--out", str(tmp_path), "--reps", "1"]) == 0
    (path,) = tmp_path.glob("kernels-*.json")
    data = json.loads(path.read_text())
    kernels = {r["kernel"] for r in data["rows"]}
    want = {"paged_decode", "sdpa_contiguous", "gather_states", "write_kv_cache", "mla_decode"}
    assert want <= kernels
    layouts = {r["layout"] for r in data["rows"] if r["kernel"] == "paged_decode"}
    assert layouts == {"unpacked", "inflate", "pack", "aggregate", "per_group", "two_level"}
    assert data["meta"]["interpreter"] is True
    assert all(r["seconds"] > 0 for r in data["rows"])


def test_bench_refuses_to_write_cpu_numbers_into_results():
    from paper.bench_kernels import main

    with pytest.raises(SystemExit):
        main(["--quick"])
