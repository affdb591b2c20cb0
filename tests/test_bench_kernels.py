"""The kernel benchmark, the host-time benchmark and the GPU suite run end to end on the CPU
(smoke mode under the Triton interpreter: the numbers mean nothing here, the plumbing does)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_bench_kernels_quick(tmp_path):
    from paper.bench_kernels import main

    assert main(["--set", "quick", "--out", str(tmp_path), "--reps", "1"]) == 0
    (path,) = tmp_path.glob("kernels-*.json")
    data = json.loads(path.read_text())
    rows = data["rows"]
    kernels = {r["case"] for r in rows if r["impl"] == "hybridkv"}
    assert kernels == {"decode", "prefill", "mla", "states", "write", "indexer"}
    assert {r["impl"] for r in rows} >= {"hybridkv", "torch_sdpa", "torch"}
    decode = [r for r in rows if r["case"] == "decode" and r["impl"] == "hybridkv"]
    assert {r["layout"] for r in decode} == {"per_group", "inflate", "flat"}
    for r in decode:  # what the plan chose is recorded beside the time
        assert r["config"].startswith("BLOCK_N=") and r["config_source"] and r["num_splits"] >= 1
    # the sparse walk: its bytes are the listed tokens', not the context's; no peer runs it
    (sparse,) = [r for r in rows if r["case"] == "decode" and r["sparse"]]
    (dense,) = [r for r in decode if r["layout"] == "per_group" and not r["sparse"]]
    assert sparse["impl"] == "hybridkv" and (sparse["batch"], sparse["context"]) == (2, 70)
    assert sparse["bytes"] * dense["context"] == dense["bytes"] * sparse["sparse"]
    assert data["meta"]["interpreter"] is True and data["meta"]["commit"]
    assert all(r["ms"] > 0 for r in rows)
    assert all(r["pct_copy"] > 0 for r in rows if "bytes" in r)


def test_bench_refuses_to_write_cpu_numbers_into_results(tmp_path):
    from paper.bench_kernels import main

    with pytest.raises(SystemExit):
        main(["--set", "quick"])
    with pytest.raises(SystemExit):  # the GPU shape sets need a GPU
        main(["--set", "suite", "--out", str(tmp_path / "nowhere")])


def test_suite_covers_every_goal_shape():
    """The GPU suite's fixed set has every page size the plans produce, both head dims, GQA 1
    and 16, batch 1 at long context, fp8 beside bf16, MLA at batch >= 8, the copy kernels at
    batch >= 8 and writes at >= 4k tokens, and the prefill shapes of the prefill issue."""
    from hybridkv import models
    from hybridkv.layouts import make_plan
    from paper import bench_kernels as bk

    cases = bk.suite_cases()
    pages = set()
    for c in cases:
        if isinstance(c, bk.Decode) and c.layout != "flat":
            model = models.load(c.model)
            pages.add(make_plan(model, c.layout, fit_tokens=c.batch * c.context,
                                max_num_seqs=c.batch).block_size)  # fmt: skip
    assert {16, 64, 192, 576, 272, 528, 1040} <= pages
    decode = [c for c in cases if isinstance(c, bk.Decode)]
    assert {c.heads[0] // c.heads[1] for c in decode if c.heads} == {1, 16}
    assert any(c.batch == 1 and c.context >= 32768 for c in decode)
    assert any(c.kv_dtype == "float8_e4m3fn" for c in decode)
    prefill = [c for c in cases if isinstance(c, bk.Prefill)]
    assert any(len(c.q_lens) > 1 and len(set(c.q_lens)) > 1 for c in prefill)  # unequal varlen
    assert any(c.cached[0] > 0 for c in prefill)  # an extend
    assert any(isinstance(c, bk.Mla) and c.batch >= 8 for c in cases)
    assert {c.op for c in cases if isinstance(c, bk.States)} == {"gather", "scatter", "copy"}
    assert any(isinstance(c, bk.Write) and c.tokens >= 4096 for c in cases)


def test_goals_are_judged_from_rows():
    """Goal bookkeeping on hand-made rows: met, missed with the worst case named, paired
    ratios against a peer, fp8 against bf16, and no data."""
    from paper.gpu_suite import GOALS, evaluate

    def decode(impl, ms, pct, dtype="bfloat16", batch=8, layout="per_group"):
        return {"case": "decode", "impl": impl, "model": "m", "layout": layout,
                "block_size": 16, "batch": batch, "context": 8192, "kv_dtype": dtype,
                "ms": ms, "pct_copy": pct}  # fmt: skip

    rows = [
        decode("hybridkv", 1.0, 95.0),
        decode("hybridkv", 1.0, 80.0, layout="pack"),
        decode("vllm_triton", 1.5, 60.0),
        decode("hybridkv", 0.55, 86.0, dtype="float8_e4m3fn"),
    ]
    goals = {g["goal"]: g for g in evaluate(rows, host=[])}
    assert goals["decode >= 90%"]["status"] == "missed"
    assert goals["decode >= 90%"]["worst"]["value"] == 80.0
    assert "layout=pack" in goals["decode >= 90%"]["worst"]["case"]
    assert goals["decode vs vLLM"]["status"] == "met"  # 1.5 ms / 1.0 ms
    assert goals["fp8 decode <= 0.6x"]["status"] == "met"  # 0.55 / 1.0
    assert goals["MLA >= 80%"]["status"] == "no data"
    assert len(goals) == len(GOALS)
    host = [{"kernel": "paged_decode", "call": "run", "us": 12.0, "graph_ok": True},
            {"kernel": "mla_decode", "call": "run", "us": 31.0, "graph_ok": False}]  # fmt: skip
    goals = {g["goal"]: g for g in evaluate(rows, host)}
    assert goals["host <= 30 us"]["missed"] == ["mla_decode"]
    assert goals["CUDA graphs"]["missed"] == ["mla_decode"]
    # a sparse decode row at the same shape is no dense row: the dense goals ignore it, it pairs
    # with no vLLM row and no fp8 row, and its label says it is sparse
    slow_sparse = {**decode("hybridkv", 9.0, 5.0), "sparse": 2063}
    goals = {g["goal"]: g for g in evaluate([*rows, slow_sparse], host=[])}
    assert goals["decode >= 90%"]["worst"]["value"] == 80.0
    assert goals["decode >= 90%"]["measured"] == 2
    assert goals["decode vs vLLM"]["status"] == "met"
    assert goals["fp8 decode <= 0.6x"]["status"] == "met"
    from paper.gpu_suite import _label

    assert "sparse=2063" in _label(slow_sparse) and "sparse" not in _label(rows[0])


@pytest.mark.slow
def test_gpu_suite_smoke(tmp_path):
    """Every step of ``python -m paper.gpu_suite`` on tiny shapes under the interpreter: the
    tests (skipped without a GPU), the benchmark, host times, a time-boxed sweep, the report."""
    from paper.gpu_suite import main

    assert main(["--smoke", "--out", str(tmp_path), "--budget-s", "1", "--skip-tests"]) == 0
    names = {p.name for p in tmp_path.iterdir()}
    tag = "cpu-interpreter"
    for stem in ("kernels", "host", "sweep", "gpu-suite"):
        assert f"{stem}-{tag}.json" in names, names
    report = json.loads((tmp_path / f"gpu-suite-{tag}.json").read_text())
    assert {g["goal"] for g in report["goals"]} >= {"decode >= 90%", "host <= 30 us"}
    host = json.loads((tmp_path / f"host-{tag}.json").read_text())["rows"]
    assert {h["kernel"] for h in host} == {
        "paged_decode", "paged_prefill", "mla_decode", "write_kv_cache", "gather_states",
        "scatter_states", "copy_states",
    }  # fmt: skip
    assert "| issue | goal |" in (tmp_path / f"gpu-suite-{tag}.md").read_text()


def test_indexer_cases_are_swept_without_a_goal():
    """The indexer has no measured config table: the suite sweeps its cases whatever the
    goals say, unless ``--sweep`` leaves the kind out; its sweep tries every other config."""
    import torch

    from paper import bench_kernels as bk
    from paper.gpu_suite import _unmeasured_rows

    rows = [
        {"case": "indexer", "impl": "hybridkv", "batch": 2},
        {"case": "decode", "impl": "hybridkv", "batch": 2, "sparse": 0},
        {"case": "indexer", "impl": "torch", "batch": 2},
        {"case": "decode", "impl": "hybridkv", "batch": 2, "sparse": 47},  # the sparse walk
    ]
    assert _unmeasured_rows(rows, None) == [rows[0], rows[3]]
    assert _unmeasured_rows(rows, ["indexer"]) == rows[:1]
    assert _unmeasured_rows(rows, ["decode", "prefill"]) == rows[3:]
    assert _unmeasured_rows(rows, ["mla"]) == []
    row = {"case": "indexer", "impl": "hybridkv", "batch": 1, "context": 40, "q_tokens": 3,
           "q_dtype": "float32", "ms": 1.0, "pct_copy": 1.0}  # fmt: skip
    swept = bk.sweep_case(row, torch.device("cpu"), deadline=float("inf"))
    from hybridkv_kernels.indexer_scores import CONFIGS

    assert len(swept) == len(CONFIGS)  # the interpreter's pinned config is not in CONFIGS
    assert {r["config"] for r in swept} == {str(c) for c in CONFIGS}
    assert all(r["value"] > 0 for r in swept)


def test_sparse_decode_sweep_and_qsa_lists():
    """The sparse decode's benchmark lists are QSA's picks (whole 16-token groups of the
    context plus the open group's tail, each position once); its sweep plans every candidate
    with the list and runs."""
    import torch

    from paper import bench_kernels as bk

    lists = bk.qsa_token_lists(3, 70, 2 * bk.QSA_RATIO + 15, torch.device("cpu"))
    assert lists.shape == (3, 47) and lists.dtype == torch.int32
    for row in lists.tolist():
        listed = [t for t in row if t >= 0]
        assert len(listed) == len(set(listed)) == 2 * 16 + 70 % 16
        groups = listed[:32]
        assert all(g[0] % 16 == 0 and g == list(range(g[0], g[0] + 16)) for g in
                   (groups[:16], groups[16:]))  # fmt: skip
        assert listed[32:] == list(range(64, 70)) and row[38:] == [-1] * 9
    assert bk.qsa_token_lists(1, 70, 0, torch.device("cpu")) is None
    with pytest.raises(ValueError, match="16-token groups"):
        bk.qsa_token_lists(1, 70, 40, torch.device("cpu"))
    row = {"case": "decode", "impl": "hybridkv", "model": "qwen3.5-0.8b", "layout": "per_group",
           "batch": 2, "context": 70, "kv_dtype": "float16", "sparse": 47, "ms": 1.0,
           "pct_copy": 1.0}  # fmt: skip
    swept = bk.sweep_case(row, torch.device("cpu"), deadline=float("inf"))
    assert swept and all(r["value"] > 0 for r in swept), swept


@pytest.mark.parametrize("capability, padded", [((9, 0), True), ((8, 0), False)])
def test_mla_sweep_tries_heads_padded_to_a_warpgroup_on_hopper(capability, padded, monkeypatch):
    """On sm_90 the MLA sweep tries Kimi-Linear's 32 heads padded to 64 rows (wgmma) first, with
    every config that fits 64 rows; on sm_80, where 64 rows spill, it does not; every candidate
    plans."""
    import torch

    from hybridkv_kernels import mla_decode
    from paper import bench_kernels as bk

    monkeypatch.setattr(mla_decode, "_capability", lambda device: capability)
    case = bk.Mla(model="kimi-linear-48b-a3b", layout="per_group", batch=2, context=256)
    prep = bk.prepare_mla(case, torch.device("cpu"))
    default = prep.plan()
    assert default.shape.block_h == 32
    cands = prep.candidates(default)
    wide = [c for c in cands if c.get("heads_per_program") == 64]
    assert bool(wide) == padded
    if padded:
        assert cands[: len(wide)] == wide  # before the configs swept in earlier runs
        fits = {str(c) for c in mla_decode.CONFIGS}
        for c in wide:
            plan = prep.plan(**c)
            assert plan.shape.block_h == 64 and plan.num_head_blocks == 1
            assert str(plan.config) in fits
            assert prep.info(plan)["heads_per_program"] == 64
    assert all(prep.plan(**c).shape.block_h == 32 for c in cands if c not in wide)
