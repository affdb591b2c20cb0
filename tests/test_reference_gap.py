"""Where a hybrid cache's hits part from attention's: ``HitInfo.num_kv_cached_tokens`` (the
prefix the attention groups alone hold at a lookup), the per-request arrays the simulator and
replay record from it, and :func:`hybridkv.traces.reference_gap`'s split of a reference's hits
into tokens served, lost to missing states and lost to missing KV."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv import models, traces
from hybridkv.alloc.hashing import token_array
from hybridkv.doctor import prefix_trace
from hybridkv.layouts import make_plan
from hybridkv.replay import replay
from hybridkv.sim import SimConfig, simulate
from hybridkv.traces import PLACEMENT_RULES

MODEL = "qwen3-next-80b-a3b"


@pytest.fixture(scope="module")
def plan():
    return make_plan(models.load(MODEL), "per_group", memory="40GiB", max_num_seqs=16)


def test_a_state_kept_only_at_the_end_loses_the_shared_prefix(plan):
    # eight 1,000-token prompts sharing 900 tokens: every later one finds the KV of the 896
    # tokens of whole 16-token units, but under `last` no state sits at 896 (each request keeps
    # its end), so nothing is served; `align` keeps the junction's state for the third on
    trace = prefix_trace(1000, 900, 8)
    last = replay(plan, trace, checkpoint_policy="last")
    assert last.hits.tolist() == [0] * 8
    assert last.kv_hits.tolist() == [0] + [896] * 7
    align = replay(plan, trace, checkpoint_policy="align")
    assert align.kv_hits.tolist() == [0] + [896] * 7
    assert align.hits.tolist() == [0, 0] + [896] * 6
    gap = traces.reference_gap(last.hits, last.kv_hits, align.kv_hits)
    assert (gap.served, gap.lost_to_state, gap.lost_to_kv) == (0, 7 * 896, 0)
    assert gap.requests_losing_to_state == 7


def test_replay_reads_unknown_answers_as_the_simulator_does(plan):
    """A trace that records no answers (Mooncake's): replay feeds back ids no prompt holds,
    unique per request (``traces.answer_ids``, the simulator's reading), instead of refusing;
    the same trace with those ids written in replays identically."""
    chat = traces.multi_turn_chat(40, seed=5)
    bare = traces.Trace("bare", tuple(dataclasses.replace(r, output_ids=None) for r in chat))
    spelt = traces.Trace("spelt", tuple(
        dataclasses.replace(r, output_ids=np.asarray(traces.answer_ids(r))) for r in bare
    ))  # fmt: skip
    a = replay(plan, bare, checkpoint_policy="hash_ladder")
    b = replay(plan, spelt, checkpoint_policy="hash_ladder")
    assert a.hits.tolist() == b.hits.tolist() and a.checkpoints == b.checkpoints > 0
    ids = traces.answer_ids(bare[3])
    assert len(ids) == bare[3].output_length == len(set(ids)) and min(ids) >= 2**30
    assert max(ids) < 2**31  # int32, as the allocator hashes token ids
    assert ids[0] != traces.answer_ids(bare[4])[0]  # answers differ from their first token


def test_made_up_answers_stay_int32_past_17509_requests():
    """A trace with more requests than the old id scheme fit in int32 (request 17,510 on
    generated ids past ``2**31``, and the allocator's int32 token array raised OverflowError)
    gets answer ids that fit, distinct per request from the first token on; ids past
    ``2**29`` requests are refused with what to do instead."""

    def bare(rid: int, n: int = 300) -> traces.Request:
        return traces.Request(rid, 0.0, np.arange(8, dtype=np.int32), n)

    ids = [traces.answer_ids(bare(rid)) for rid in (0, 17_510, 2**29 - 1)]
    assert all(min(x) >= 2**30 and max(x) < 2**31 and len(set(x)) == 300 for x in ids)
    assert len({x[0] for x in ids}) == 3
    assert len(token_array(ids[1])) == 300  # no OverflowError
    with pytest.raises(ValueError, match="request ids below 536,870,912"):
        traces.answer_ids(bare(2**29))
    with pytest.raises(ValueError, match="answers shorter"):
        traces.answer_ids(bare(3, 2**29))


def test_the_simulator_records_both_per_request(plan):
    trace = traces.multi_turn_chat(60, seed=3)
    r = simulate(plan, models.load(MODEL), trace, SimConfig(checkpoint_policy="last"))
    assert r.request_hits.shape == r.request_kv_hits.shape == (len(trace),)
    assert int(r.request_hits.sum()) == r.hit_tokens
    assert np.all(r.request_kv_hits >= r.request_hits)
    assert np.all(r.request_kv_hits <= trace.prompt_lengths())
    # multi-turn chat resends whole conversations: the KV is there far more often than states
    assert r.request_kv_hits.sum() > r.request_hits.sum() > 0


@given(
    st.lists(
        st.tuples(st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 5000)),
        min_size=1,
        max_size=40,
    )
)
def test_the_split_adds_up_to_the_reference(rows):
    hits = np.array([a for a, _, _ in rows])
    kv = hits + np.array([b for _, b, _ in rows])  # the attention prefix bounds every hit
    reference = np.array([c for _, _, c in rows])
    gap = traces.reference_gap(hits, kv, reference)
    assert gap.served + gap.lost_to_state + gap.lost_to_kv - gap.beyond == gap.reference
    assert min(gap.lost_to_state, gap.lost_to_kv, gap.beyond) >= 0
    assert gap.requests_losing_to_state <= len(rows)


@pytest.mark.parametrize(
    ("hits", "kv", "reference", "message"),
    [
        ([1, 2], [1, 2], [1], "one length"),
        ([5], [3], [9], "request 0: kv_hits 3 < hits 5"),
    ],
    ids=["lengths", "kv-below-hit"],
)
def test_bad_arrays_are_refused(hits, kv, reference, message):
    with pytest.raises(ValueError, match=message):
        traces.reference_gap(np.array(hits), np.array(kv), np.array(reference))


def test_paper_reference_gap_writes_its_table(tmp_path):
    import json

    from paper import reference_gap

    args = ["--requests", "60", "--layouts", "two_level", "--policies", "last", "periodic 512"]
    args += ["--memory-gib", "40", "80"]
    assert reference_gap.main([*args, "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "reference-gap.json").read_text())["rows"]
    rows = data["simulations"]
    assert [(r["memory_gib"], r["policy"]) for r in rows] == [
        (40.0, "last"),
        (40.0, "periodic 512"),
        (80.0, "last"),
        (80.0, "periodic 512"),
    ]
    for r in rows:
        total = r["served"] + r["lost_to_state"] + r["lost_to_kv"] - r["beyond"]
        assert total == r["reference"] > 0
    # the bounds: one per budget, each rule at most the reference, the oracle exactly it
    assert [b["memory_gib"] for b in data["bounds"]] == [40.0, 80.0]
    for b in data["bounds"]:
        assert b["oracle"] == b["reference"] > 0
        assert all(0 <= b[rule] <= b["reference"] for rule in PLACEMENT_RULES)
    text = (tmp_path / "reference-gap.md").read_text()
    assert "| 40 | two_level | 16 | last | lru |" in text and "commit `" in text
    assert "| `every_interval`: every multiple of 512" in text
    assert "One state of qwen3-next-80b-a3b (TP 1) is 37.7 MiB" in text
    # the Markdown again from the JSON alone: the same file, nothing run
    again = tmp_path / "again"
    assert reference_gap.main(["--render", str(tmp_path / "reference-gap.json"),
                               "--out", str(again)]) == 0  # fmt: skip
    assert (again / "reference-gap.md").read_text() == text


def test_paper_reference_gap_names_the_alpha_it_ran():
    from paper.reference_gap import _eviction

    assert _eviction({"eviction": "lru", "marconi_alpha": None}) == "lru"
    untuned = {"eviction": "marconi", "marconi_alpha": 0.0, "alpha_tuned_at": []}
    assert _eviction(untuned) == "marconi, alpha 0"
    tuned = {"eviction": "marconi", "marconi_alpha": 0.3, "alpha_tuned_at": [1540]}
    assert _eviction(tuned) == "marconi, alpha 0.3 (tuned after 1,540)"


def test_paper_reference_gap_refuses_bad_budgets(capsys):
    from paper import reference_gap

    with pytest.raises(SystemExit):
        reference_gap.main(["--memory-gib", "0"])
    assert "--memory-gib must be positive" in capsys.readouterr().err
