""":func:`hybridkv.traces.placement_bounds`: how much of an attention-only reference each rule
for placing recurrent states could serve (states free and never evicted). Checked against a
brute-force reading of the same rules on token tuples (no hashing) on random prefix trees, and
on hand-made traces whose answers are known."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv import traces
from hybridkv.traces import PLACEMENT_RULES, Request, Trace

UNIT = 8


def _trace(prompts: list[list[int]], outputs: list[list[int] | None] | None = None) -> Trace:
    outputs = outputs or [None] * len(prompts)
    reqs = []
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        n_out = len(o) if o is not None else 4
        out = None if o is None else np.asarray(o)
        reqs.append(Request(i, float(i), np.asarray(p), n_out, out, shared_prefix_length=None))
    return Trace("hand", tuple(reqs))


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


def _brute(trace: Trace, reference: np.ndarray, unit: int, interval: int) -> dict[str, list]:
    """The rules of the module docstring read literally: a state is a prefix (token tuple) an
    earlier request kept; a request gets the longest kept prefix of its stream within its hit."""
    kept: dict[str, set[tuple]] = {r: set() for r in PLACEMENT_RULES if r != "oracle"}
    served: dict[str, list] = {r: [] for r in PLACEMENT_RULES}
    for i, r in enumerate(trace):
        stream = list(r.prompt) + ([] if r.output_ids is None else list(r.output_ids))
        x = int(reference[i])
        for rule, states in kept.items():
            best = max((p for p in range(unit, x + 1, unit) if tuple(stream[:p]) in states),
                       default=0)  # fmt: skip
            served[rule].append(best)
        served["oracle"].append(x)
        n = r.prompt_length
        last = n - 1
        kept["every_interval"].update(tuple(stream[:p]) for p in range(interval, n, interval))
        if last // interval:
            kept["prompt_boundary"].add(tuple(stream[: last // interval * interval]))
        scale = interval
        while scale <= last:
            kept["ladder"].add(tuple(stream[: last // scale * scale]))
            scale *= 2
        if 0 < x < n:
            kept["seen_branch"].add(tuple(stream[:x]))
        if r.output_ids is not None and (len(stream) - 1) // unit:
            kept["end"].add(tuple(stream[: (len(stream) - 1) // unit * unit]))
    return served


@st.composite
def prefix_trees(draw):
    """Prompts made of shared segments (documents, histories) and their own tails, some with
    known outputs that a later prompt resends."""
    segments = [_tokens(draw(st.integers(1, 90)), seed=s) for s in range(draw(st.integers(1, 4)))]
    prompts, outputs = [], []
    for i in range(draw(st.integers(1, 12))):
        prompt: list[int] = []
        if prompts and draw(st.booleans()):  # continue an earlier request: prompt + output
            j = draw(st.integers(0, len(prompts) - 1))
            prompt = prompts[j] + (outputs[j] or [])
        for s in draw(st.lists(st.integers(0, len(segments) - 1), max_size=3)):
            prompt = prompt + segments[s]
        prompt = prompt + _tokens(draw(st.integers(1, 40)), seed=1000 + i)
        prompts.append(prompt)
        outputs.append(_tokens(draw(st.integers(1, 20)), seed=2000 + i) if draw(st.booleans())
                       else None)  # fmt: skip
    return _trace(prompts, outputs)


@settings(max_examples=60, deadline=None)
@given(prefix_trees(), st.sampled_from([UNIT, 2 * UNIT, 3 * UNIT]), st.integers(0, 400))
def test_matches_the_rules_read_literally(trace, interval, capacity):
    reference = traces.lru_cache_hits(trace, UNIT, capacity)
    got = traces.placement_bounds(trace, reference, UNIT, interval)
    want = _brute(trace, reference, UNIT, interval)
    for rule in PLACEMENT_RULES:
        assert got.served[rule].tolist() == want[rule], rule
        assert np.all(got.served[rule] <= reference)
    assert got.total() == int(reference.sum())  # the oracle is in every union
    both = got.per_request("prompt_boundary", "seen_branch")
    assert both.tolist() == np.maximum(want["prompt_boundary"], want["seen_branch"]).tolist()
    assert np.all(got.served["ladder"] >= got.served["prompt_boundary"])  # its first rung


def test_documents_asked_again():
    """A 300-token document asked two questions: the second prompt shares the document only.
    The first prompt's last multiple of 64 (320) lies in its question, so `prompt_boundary`
    serves nothing; the ladder's rung at the last multiple of 256 (256) serves 256 of the
    reference's 296; every multiple of 64 serves 256 too (288 is not one); the branch point
    the second request shows (296) serves a third question exactly."""
    doc = _tokens(300, seed=1)
    prompts = [doc + _tokens(40, seed=2), doc + _tokens(50, seed=3), doc + _tokens(60, seed=4)]
    t = _trace(prompts)
    reference = traces.lru_cache_hits(t, UNIT, 10_000)
    assert reference.tolist() == [0, 296, 296]
    b = traces.placement_bounds(t, reference, UNIT, 64)
    assert b.served["prompt_boundary"].tolist() == [0, 0, 0]
    assert b.served["ladder"].tolist() == [0, 256, 256]
    assert b.served["every_interval"].tolist() == [0, 256, 256]
    assert b.served["seen_branch"].tolist() == [0, 0, 296]
    assert b.served["end"].tolist() == [0, 0, 0]  # outputs unknown: no prompt resends one
    assert b.to_dict() == {"reference": 592, "end": 0, "prompt_boundary": 0, "ladder": 512,
                           "seen_branch": 296, "every_interval": 512, "oracle": 592}  # fmt: skip


def test_a_chat_turn_resends_the_previous_answer():
    """The next turn resends prompt + answer: the state where the first request ended serves it
    (the answer's last token is never fed back, so the state covers the 119 before it, rounded
    down to 112)."""
    first, answer = _tokens(100, seed=5), _tokens(20, seed=6)
    t = _trace([first, first + answer + _tokens(30, seed=7)], [answer, None])
    reference = traces.lru_cache_hits(t, UNIT, 10_000)
    assert reference.tolist() == [0, 120]
    b = traces.placement_bounds(t, reference, UNIT, 32)
    assert b.served["end"].tolist() == [0, 112]
    assert b.served["prompt_boundary"].tolist() == [0, 96]  # the first prompt's last 32-multiple


@pytest.mark.parametrize(
    ("reference", "interval", "match"),
    [
        ([0, 0], 12, "multiple of unit"),
        ([0, 0], 0, "multiple of unit"),
        ([0], 16, "one hit per request"),
        ([0, 12], 16, "not a whole number of 8-token units"),
        ([0, 4000], 16, "within its"),
    ],
)
def test_bad_input_is_refused(reference, interval, match):
    t = _trace([_tokens(100, 1), _tokens(100, 2)])
    with pytest.raises(ValueError, match=match):
        traces.placement_bounds(t, np.asarray(reference), UNIT, interval)


def test_unknown_rules_are_named():
    t = _trace([_tokens(100, 1)])
    b = traces.placement_bounds(t, np.zeros(1, np.int64), UNIT, 16)
    with pytest.raises(ValueError, match="unknown placement rule"):
        b.total("periodic")
