"""The committed sm_90 compile report of the prefill's two paths
(``paper/results/compile-prefill-paths.json``, from ``python -m paper.compile_prefill_paths``)
agrees with the rules that admit Hopper configs: ``config_fits`` admits exactly the Hopper
configs that compiled without spills and within shared memory there, and the report's TMA
column is what the plan does (TMA where the tile is one page segment)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv_kernels import paged_prefill
from hybridkv_kernels.paged_prefill import CONFIGS, PrefillConfig, PrefillShape, config_fits

REPORT = Path(__file__).resolve().parents[2] / "paper" / "results" / "compile-prefill-paths.json"


def _config(label: str, hopper: bool) -> PrefillConfig:
    kv = dict(part.split("=") for part in label.split(",") if "=" in part)
    return PrefillConfig(
        int(kv["BLOCK_M"]),
        int(kv["BLOCK_N"]),
        int(kv["num_warps"]),
        int(kv["num_stages"]),
        hopper=hopper,
    )


def _rows() -> list[dict]:
    if not REPORT.exists():
        pytest.fail(f"{REPORT} is missing: run python -m paper.compile_prefill_paths")
    return json.loads(REPORT.read_text())["rows"]


def _shape(row: dict) -> PrefillShape:
    page = min(row["bs"] & -row["bs"], 64)
    cache = "16bit" if row["dtype"] in ("bf16", "fp16") else "fp8"
    return PrefillShape(90, page, row["gqa"], row["d"], cache, 2048, 2048)


def test_report_covers_every_hopper_config_and_compiled():
    rows = _rows()
    hopper = {c for c in CONFIGS if c.hopper}
    seen = {_config(r["config"], True) for r in rows if r["path"] == "hopper"}
    assert seen == hopper, "the report predates CONFIGS: python -m paper.compile_prefill_paths"
    failed = [r for r in rows if r["status"] != "ok"]
    assert not failed, failed[:3]


def test_config_fits_admits_only_clean_hopper_configs():
    """What the rule admits compiled without spills and within shared memory. It keys its
    exceptions by cache and head dim only, so it may reject a config in a class where it compiles
    well (never admit one that spills): then the same config spills or overflows in another
    class of that cache and head dim in the report."""
    rows = [r for r in _rows() if r["path"] == "hopper"]

    def clean(r: dict) -> bool:
        return r["spill_stores"] == 0 and r["fits"]

    for row in rows:
        config, shape = _config(row["config"], True), _shape(row)
        if config_fits(config, shape):
            assert clean(row), row
        elif clean(row):
            kin = [
                r for r in rows
                if (r["dtype"], r["d"], r["config"]) == (row["dtype"], row["d"], row["config"])
            ]  # fmt: skip
            assert not all(clean(r) for r in kin), (row, paged_prefill._HOPPER_PATH_SPILLS)


def test_hopper_mmas_are_asynchronous():
    """The Hopper path waits on its warpgroup MMAs at most twice an iteration (the two dots'
    dependencies), where the generic kernel at head dim 256 on 16-token pages waits on every
    one (the committed report: 18-20 waits an iteration)."""
    for row in _rows():
        if row["path"] == "hopper" and row["status"] == "ok":
            assert row["loop_mma_waits"] <= 2, row


def test_tma_exactly_where_a_tile_is_one_page_segment():
    for row in _rows():
        if row["path"] == "hopper":
            page = min(row["bs"] & -row["bs"], 64)
            assert row["tma"] == (page >= row["block_n"]), row
            assert row["loop_tma"] == (2 if row["tma"] else 0), row
        else:
            assert not row["tma"] and row["loop_tma"] == 0, row
