"""Mooncake's synthetic trace as shipped, the loader's options for real traces (time unit, load
factor, request limit, the shared-length reading) and the attention-only LRU reference."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hybridkv import traces
from hybridkv.traces.jsonl import _key

N = 150  # requests read in most tests: the first 150 hold shared documents


@pytest.fixture(scope="module")
def readings() -> dict[str, traces.Trace]:
    return {r: traces.load_mooncake(limit=N, shared_length=r) for r in traces.SHARED_LENGTHS}


def _raw(n: int) -> list[dict]:
    with traces.MOONCAKE_SYNTHETIC.open() as fh:
        return [json.loads(next(fh)) for _ in range(n)]


def test_shipped_trace_is_the_release():
    with traces.MOONCAKE_SYNTHETIC.open() as fh:
        lines = fh.readlines()
    assert len(lines) == 3993
    first = json.loads(lines[0])
    assert set(first) == {"timestamp", "input_length", "output_length", "hash_ids"}
    assert (traces.MOONCAKE_SYNTHETIC.parent / "README.md").read_text().count("Apache") >= 1


def test_milliseconds_recognised_and_stated(readings):
    t = readings["blocks"]
    raw = _raw(N)
    assert t.params["time_scale"] == 1e-3 and "milliseconds" in t.params["time_unit"]
    want = np.array([r["timestamp"] for r in raw]) * 1e-3
    np.testing.assert_allclose(t.arrivals(), want - want[0])
    assert len(t) == N and t.params["limit"] == N
    assert [r.prompt_length for r in t] == [r["input_length"] for r in raw]


def test_rate_scale_and_explicit_time_scale():
    slow = traces.load_mooncake(limit=20, rate_scale=0.05)
    base = traces.load_mooncake(limit=20)
    np.testing.assert_allclose(slow.arrivals(), 20 * base.arrivals())
    as_s = traces.load_mooncake(limit=20, time_scale=1.0)
    np.testing.assert_allclose(as_s.arrivals(), 1000 * base.arrivals())
    assert as_s.params["time_unit"] == "as given"


def test_other_traces_default_to_seconds(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 2, "input_length": 5, "output_length": 1}\n' * 2)
    t = traces.load_jsonl(p, rebase=False)
    assert t.params["time_scale"] == 1.0 and "seconds" in t.params["time_unit"]
    assert t.arrivals().tolist() == [2.0, 2.0]


def test_limit_stops_reading(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\nnot json\n')
    assert len(traces.load_jsonl(p, limit=1)) == 1
    with pytest.raises(ValueError, match="not valid JSON"):
        traces.load_jsonl(p)


@pytest.mark.parametrize(
    ("option", "value", "match"),
    [
        ("shared_length", "exact", "shared_length must be one of blocks, continuation"),
        ("rate_scale", 0, "rate_scale must be a finite number > 0"),
        ("rate_scale", -1.0, "rate_scale"),
        ("rate_scale", math.nan, "rate_scale"),
        ("time_scale", 0.0, "time_scale must be a number > 0"),
        ("limit", 0, "limit must be a positive number"),
        ("limit", 2.5, "limit"),
    ],
    ids=lambda v: str(v),
)
def test_bad_options(option, value, match):
    with pytest.raises(ValueError, match=match):
        traces.load_mooncake(**{option: value})


def test_blocks_reading_tokens(readings):
    """``blocks``: a block's tokens depend only on its hash id and position."""
    t, raw = readings["blocks"], _raw(N)
    for r, line in zip(t.requests[:20], raw):
        h = line["hash_ids"][0]
        want = traces.synthetic_tokens(_key("hash", h, 0), min(512, r.prompt_length))
        np.testing.assert_array_equal(r.prompt[: want.size], want)
    assert all(r.output_ids is None for r in t)


@pytest.mark.parametrize("reading", traces.SHARED_LENGTHS)
def test_shared_lengths_are_exact(readings, reading):
    """Each request's shared length is where it stops matching every earlier prompt followed by
    its known answer: checked with independent 16-token block hashes."""
    t = readings[reading]
    shared = np.array([r.shared_prefix_length for r in t])
    np.testing.assert_array_equal(traces.hashed_shared_prefix(t, 16), shared // 16 * 16)


def test_continuation_extends_blocks(readings):
    b, c = readings["blocks"], readings["continuation"]
    sb = np.array([r.shared_prefix_length for r in b])
    sc = np.array([r.shared_prefix_length for r in c])
    assert (sc >= sb).all() and (sc > sb).any()
    # blocks: sharing ends on a hash block (or an earlier prompt's end inside one, when the ids
    # agree); continuation: more often at an earlier prompt's (or answer's) end
    assert np.count_nonzero(sc % 512) > np.count_nonzero(sb % 512)
    # parents answer with synthesised ids that their continuations resend
    assert any(r.output_ids is not None for r in c)
    raw = _raw(N)
    # prompts whose hash ids agree share those blocks' tokens in both readings
    for t in (b, c):
        for i in range(1, 40):
            for j in range(i):
                k = 0
                a, z = raw[i]["hash_ids"], raw[j]["hash_ids"]
                while k < min(len(a), len(z)) and a[k] == z[k]:
                    k += 1
                m = min(k * 512, t[i].prompt_length, t[j].prompt_length)
                np.testing.assert_array_equal(t[i].prompt[:m], t[j].prompt[:m])


def test_lru_reference():
    t = traces.load_mooncake(limit=N)
    total = int(t.prompt_lengths().sum())
    inf = traces.infinite_cache_hits(t, 16)
    np.testing.assert_array_equal(traces.lru_cache_hits(t, 16, 10**12), inf)
    hits = [int(traces.lru_cache_hits(t, 16, c).sum()) for c in (0, 10**5, 10**6, 10**7)]
    assert hits[0] == 0 and hits == sorted(hits) and hits[-1] <= inf.sum() <= total
    assert hits[1] < hits[-1]


def test_lru_evicts_least_recent():
    blk = [np.arange(16) + 100 * k for k in range(4)]  # four distinct 16-token blocks

    def req(i, *parts):
        return traces.Request(i, float(i), np.concatenate(parts), 1, shared_prefix_length=None)

    # A = b0 b1; B = b2 b3 (evicts b0 from a 3-block cache); C = b0 b1 finds nothing; D = b2 b3
    # finds b2 b3 (refreshed by nothing else since)
    t = traces.Trace(
        "t",
        (
            req(0, blk[0], blk[1]),
            req(1, blk[2], blk[3]),
            req(2, blk[0], blk[1]),
            req(3, blk[2], blk[3]),
        ),
    )
    assert traces.lru_cache_hits(t, 16, 3 * 16).tolist() == [0, 0, 0, 0]
    assert traces.lru_cache_hits(t, 16, 4 * 16).tolist() == [0, 0, 32, 32]
    with pytest.raises(ValueError, match="capacity_tokens"):
        traces.lru_cache_hits(t, 16, -1)
