"""``hybridkv advise``: every plan flag it lists changes what it tries, ties are reported, and
``--json`` keeps results and errors apart."""

from __future__ import annotations

import json

import pytest

from hybridkv import models, traces
from hybridkv.advise import ADVISED_POLICIES, Pins, advise, candidates
from hybridkv.cli import main
from hybridkv.layouts import PlanTooSmall, make_plan
from hybridkv.units import format_bytes

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
    # every layout is tried with every advised policy, hybridkv's hash_ladder included
    by_layout: dict[str, set[str]] = {}
    for c in candidates(models.load(MODEL)):
        by_layout.setdefault(c.layout, set()).add(c.policy)
    assert set(ADVISED_POLICIES) == {"align", "last", "marconi", "hash_ladder"}
    assert all(got == set(ADVISED_POLICIES) for got in by_layout.values()), by_layout


def test_policies_pin_and_bad_names():
    got = candidates(models.load(MODEL), Pins(policies=("periodic", "hash_ladder")))
    assert {c.policy for c in got} == {"periodic", "hash_ladder"}
    with pytest.raises(ValueError, match=r"unknown checkpoint policy 'ladder'.*hash_ladder"):
        Pins(policies=("ladder",))
    with pytest.raises(ValueError, match="at least one"):
        Pins(policies=())


def test_hash_ladder_serves_shared_prompts_that_last_cannot(capsys):
    # every request repeats one of two long system prompts (longer than the ladder's first rung,
    # the state's size in KV tokens: 2,048 here) and adds its own question: a state only at the
    # prompt's end (last) never matches another request, one on the ladder's rungs does
    model = models.load(MODEL)
    trace = traces.shared_prefix(
        12, seed=0, num_prefixes=2, prefix=traces.LogNormal(median=6000, sigma=0.1, low=5000)
    )
    pins = Pins(block_size=16, policies=("last", "hash_ladder"))
    advice = advise(model, trace, memory="4GiB", max_num_seqs=8, pins=pins)
    rows = {(r["layout"], r["policy"]): r for r in advice.results}
    assert {r["policy"] for r in advice.results + advice.errors} == {"last", "hash_ladder"}
    for layout in ("per_group", "two_level", "inflate"):
        last, ladder = rows[(layout, "last")], rows[(layout, "hash_ladder")]
        assert last["token_hit_rate"] == 0.0, last
        assert ladder["token_hit_rate"] > 0.5, ladder
    with pytest.raises(SystemExit) as exc:
        main([*BASE, "--policies", "nope"])
    assert exc.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


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
    assert all(set(r) in ({"config", "error"}, {"config", "error", "needed_bytes"})
               for r in got["errors"])  # fmt: skip
    assert got["config"]["model"] == MODEL


def test_nothing_fits_fails_naming_the_smallest_need_and_every_configuration(capsys):
    """When no configuration fits, advise exits non-zero; its error names the least memory any
    configuration needs (the plans' own figures) and has a line for every configuration, none
    left out; --json keeps each need in bytes."""
    argv = ["advise", "--model", MODEL, "--gpu-memory", "256MiB", "--trace", "multi_turn_chat",
            "--requests", "4", "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert main([*argv, "--json"]) == 1
    errors = json.loads(capsys.readouterr().out)["errors"]
    assert len(errors) > 5 and all(e["needed_bytes"] > 256 * 2**20 for e in errors)
    least = min(errors, key=lambda e: e["needed_bytes"])
    assert f"the smallest, {least['config']}, needs {format_bytes(least['needed_bytes'])}" in err
    lines = [line.strip() for line in err.splitlines()[1:]]
    assert lines == [f"{e['config']}: needs {format_bytes(e['needed_bytes'])}" for e in errors]
    with pytest.raises(PlanTooSmall) as too_small:  # the figure is the plan's own
        make_plan(models.load(MODEL), "inflate", memory="256MiB", max_num_seqs=64,
                  state_slots_per_seq=2)  # fmt: skip
    (inflate_align,) = [e for e in errors if e["config"] == "inflate align"]
    assert inflate_align["needed_bytes"] == too_small.value.needed_bytes


def test_one_progress_bar(capsys):
    assert main([*BASE, "--progress"]) == 0
    err = capsys.readouterr().err
    assert err.count("advise") >= 1 and "simulate" not in err
    assert main([*BASE]) == 0  # not a terminal: quiet
    assert capsys.readouterr().err == ""
