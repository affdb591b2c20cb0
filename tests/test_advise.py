"""``hybridkv advise``: every plan flag it lists changes what it tries, ties are reported, and
``--json`` keeps results and errors apart."""

from __future__ import annotations

import json

import pytest

from hybridkv import models, traces
from hybridkv.advise import Pins, advise, candidates
from hybridkv.cli import main

MODEL = "qwen3.5-0.8b"
BASE = ["advise", "--model", MODEL, "--gpu-memory", "4GiB", "--requests", "12", "--json"]


def _advise(capsys, *extra: str) -> dict:
    assert main([*BASE, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _all(got: dict) -> list[dict]:
    return got["results"] + got["errors"]


def test_default_candidates():
    labels = [c.label for c in candidates(models.load(MODEL))]
    assert "per_group block=16 align" in labels and "per_group block=64 last" in labels
    assert any(lbl.startswith("pack(2)") for lbl in labels)


@pytest.mark.parametrize(
    "name, blocks",
    [
        pytest.param("qwen3.5-0.8b", {16, 64}, id="gqa-16-64"),
        # MLA's kernel block (FlashMLA) is 64 tokens: the specs say so, advise follows
        pytest.param("kimi-linear-48b-a3b", {64, 256}, id="mla-64-256"),
    ],
)
def test_own_pool_candidates_follow_the_specs_kernel_alignment(name, blocks):
    model = models.load(name)
    own = {c.block_size for c in candidates(model) if c.layout in ("per_group", "two_level")}
    assert own == blocks == {model.kernel_alignment, 4 * model.kernel_alignment}


@pytest.mark.parametrize(
    ("pins", "check"),
    [
        (Pins(block_size=32), lambda c: all(x.block_size == 32 for x in c)),
        (
            Pins(pack_size=3),
            lambda c: {x.pack_size for x in c if x.layout == "pack"} == {3},
        ),
    ],
    ids=["block-size", "pack-size"],
)
def test_pins_restrict_candidates(pins, check):
    assert check(candidates(models.load(MODEL), pins))


def test_block_size_flag(capsys):
    got = _advise(capsys, "--block-size", "32")
    rows = got["results"]
    assert {r["block_size"] for r in rows if r["layout"] in ("per_group", "two_level")} == {32}
    assert all("block=32" in r["config"] for r in _all(got))


def test_pack_size_flag(capsys):
    got = _advise(capsys, "--pack-size", "3")
    packs = [r for r in got["results"] if r["layout"] == "pack"]
    assert packs and {r["pack_size"] for r in packs} == {3}


def test_state_slot_flags(capsys):
    default = _advise(capsys)
    assert {r["state_slots_per_seq"] for r in default["results"] if r["policy"] == "align"} == {2}
    pinned = _advise(capsys, "--state-slots-per-seq", "3", "--cache-state-slots", "5")
    assert {r["state_slots_per_seq"] for r in pinned["results"]} == {3}
    assert {r["cache_state_slots"] for r in pinned["results"]} == {5}


def test_bad_pack_size(capsys):
    assert main([*BASE, "--pack-size", "many"]) == 2
    assert "--pack-size must be 'auto' or a number" in capsys.readouterr().err


def test_ties_are_reported(capsys):
    # no prefix sharing: the policies cannot differ, so each layout's three rows tie
    trace = traces.no_sharing(10, seed=0)
    advice = advise(models.load(MODEL), trace, memory="2GiB", max_num_seqs=8)
    first = advice.results[0]
    tied = [
        r["config"]
        for r in advice.results
        if (r["ttft_p50_ms"], r["throughput_tok_s"], r["token_hit_rate"])
        == (first["ttft_p50_ms"], first["throughput_tok_s"], first["token_hit_rate"])
    ]
    assert len(tied) > 1 and advice.ties == tied
    assert main([*BASE[:-1], "--trace", "no_sharing"]) == 0
    out = capsys.readouterr().out
    assert "configurations tie on all three" in out


def test_json_keeps_errors_apart(capsys):
    got = _advise(capsys)
    assert set(got) >= {"config", "trace", "results", "errors", "recommended", "ties"}
    assert all("error" not in r for r in got["results"])
    assert all(set(r) == {"config", "error"} for r in got["errors"])
    assert got["config"]["model"] == MODEL


def test_one_progress_bar(capsys):
    assert main([*BASE, "--progress"]) == 0
    err = capsys.readouterr().err
    assert err.count("advise") >= 1 and "simulate" not in err
    assert main([*BASE]) == 0  # not a terminal: quiet
    assert capsys.readouterr().err == ""
