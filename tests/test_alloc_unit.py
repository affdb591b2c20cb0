"""Unit tests for hybridkv.alloc: pools, hit rules, sliding window, errors, events."""

from __future__ import annotations

import functools

import pytest
import torch

from hybridkv import models
from hybridkv.alloc import (
    BlockPool,
    DoubleFree,
    HybridAllocator,
    MaxLengthExceeded,
    PoolExhausted,
    TwoLevelPool,
    UnknownRequest,
)
from hybridkv.alloc.hashing import extend_hashes, hash_unit
from hybridkv.alloc.zmq_events import CacheIndex
from hybridkv.layouts import make_plan


@functools.cache
def plan(model: str, layout: str, memory: int = 1 << 30, seqs: int = 8):
    return make_plan(models.load(model), layout, memory=memory, max_num_seqs=seqs, block_size=16)


def test_block_pool_lru_and_refcounts():
    evicted = []
    p = BlockPool(6, "t", evicted.append)
    a = p.allocate(3)
    assert a == [1, 2, 3] and p.num_free == 2
    assert p.cache(a[0], "k1") and p.cache(a[1], "k2")
    assert not p.cache(a[2], "k1")  # no duplicate keys
    p.free(reversed(a))  # tail first
    assert p.num_free == 5
    p.touch([a[0]])  # hit keeps it out of the free lists
    assert p.ref[a[0]] == 1 and p.num_free == 4
    got = p.allocate(4)  # uncached ids first, then LRU: k2 (freed before k1 was touched)
    assert evicted == ["k2"] and p.lookup("k1") == a[0] and p.lookup("k2") is None
    assert sorted(got) == [2, 3, 4, 5]
    with pytest.raises(PoolExhausted):
        p.allocate(1)
    p.free([a[0]])
    with pytest.raises(DoubleFree):
        p.free([a[0]])


def test_two_level_pages_move_between_groups():
    evicted = []
    tl = TwoLevelPool(3, {0: 4, 1: 2}, first_gid=0, on_evict=evicted.append)
    g0, g1 = tl.view(0), tl.view(1)
    a = g0.allocate(3)  # page 0 holds ids 1..3 (0 is null)
    assert all(x // 4 == 0 for x in a) and 0 not in a
    b = g1.allocate(2)  # a fresh page for group 1
    page_b = b[0] // 2
    assert tl.page_owner[page_b] == 1
    c = g0.allocate(4)  # the last page
    assert not tl.can_allocate({1: 1})
    g1.cache(b[0], "x")
    g1.free(b)
    assert tl.can_allocate({0: 4})
    d = g0.allocate(4)  # reclaims group 1's page, evicting its cached id
    assert evicted == ["x"] and tl.page_owner[page_b] == 0 and d[0] // 4 == page_b
    g0.free(a + c + d)
    assert tl.usage() == 0.0


def test_hash_chain():
    toks = list(range(40))
    hs = extend_hashes([], toks, 16)
    assert len(hs) == 2 and hs[1] == hash_unit(hs[0], toks[16:32])
    assert extend_hashes([], toks, 16, extra_keys=("lora", 1))[0] != hs[0]


def _prefill_to(a: HybridAllocator, rid, prompt, chunks):
    hit = a.add_request(rid, prompt)
    done = hit.num_cached_tokens
    for c in chunks:
        assert a.allocate_slots(rid, c - done)
        done = c
    return hit


def test_state_hit_needs_checkpoint_at_hit_length():
    p = plan("qwen3.5-0.8b", "inflate")
    B = p.groups[1].block_size  # 544: the state checkpoint granularity
    a = HybridAllocator(p, checkpoint_policy="align", max_model_len=8192)
    base = list(range(1000, 1000 + 2 * B))
    # Only 300 shared tokens: attention cannot hit a full 544 block, state has no checkpoint.
    _prefill_to(a, "a", base[:300] + [1] * 400, [700])
    a.free("a")
    assert a.add_request("b", base[:300] + [2] * 400).num_cached_tokens == 0
    a.free("b")
    # Chunked at the block boundary, align mode checkpoints the state at 544.
    _prefill_to(a, "c", base[: B + 100], [B, B + 100])
    copies = a.take_state_copies()
    assert {g for g, _, _ in copies} == {1, 2, 3}
    a.free("c")
    hit = a.add_request("d", base[: B + 200])
    assert hit.num_cached_tokens == B
    assert sorted(g for g, _, _ in hit.state_copies) == [1, 2, 3]
    ckpts = {g: c for g, _, c in copies}  # (group, running, checkpoint)
    assert all(ckpts[g] == src for g, src, _ in hit.state_copies)
    a.free("d")


def test_state_unchunked_prefill_cannot_hit_in_align_mode():
    p = plan("qwen3.5-0.8b", "inflate")
    B = p.groups[1].block_size
    a = HybridAllocator(p, max_model_len=8192)
    prompt = list(range(B + 300))
    _prefill_to(a, "a", prompt, [len(prompt)])  # state only at 844, not at 544
    a.free("a")
    assert a.add_request("b", [*prompt, 9]).num_cached_tokens == 0


def test_last_policy_checkpoints_at_free():
    p = plan("qwen3.5-0.8b", "per_group")
    a = HybridAllocator(p, checkpoint_policy="last", max_model_len=4096)
    prompt = list(range(64))
    _prefill_to(a, "a", prompt, [64])
    assert a.take_state_copies() == []
    a.free("a")
    hit = a.add_request("b", [*prompt, 5, 6])
    assert hit.num_cached_tokens == 64 and len(hit.state_copies) == 1


def test_full_attention_hit_and_block_tables():
    p = plan("qwen3.5-0.8b", "two_level")
    a = HybridAllocator(p, max_model_len=4096)
    prompt = list(range(100))
    _prefill_to(a, "a", prompt, [100])
    ids_a = a.block_ids("a")
    hit = a.add_request("b", prompt[:80] + [7] * 10)
    # attention would hit 80, but the state group has no checkpoint: fixed point is 0
    assert hit.num_cached_tokens == 0
    a.free("b")
    for t in range(12):  # decode to a block boundary (112) so align mode checkpoints
        a.append_tokens("a", [t])
        assert a.allocate_slots("a", 1)
    a.append_tokens("a", [99])
    hit = a.add_request("c", prompt + list(range(12)) + [3] * 5)
    assert hit.num_cached_tokens == 112
    assert a.block_ids("c")[0][:7] == ids_a[0][:7]
    tables = a.block_tables(["a", "c"])
    assert len(tables) == len(p.groups) and all(t.dtype == torch.int32 for t in tables)
    assert tables[0].shape[0] == 2 and tables[0][1, 7:].eq(0).all()


def test_sliding_window_frees_out_of_window_blocks():
    p = plan("recurrentgemma-2b", "per_group")
    g = next(g for g in p.groups if g.kind == "sliding_window")
    W, B = g.sliding_window, g.block_size
    a = HybridAllocator(p, max_model_len=8192)
    n = W + 5 * B
    a.add_request("a", list(range(n)))
    assert a.allocate_slots("a", n)
    pool = a.pool[g.group_id]
    used_before = pool.num_ids - 1 - pool.num_free
    a.append_tokens("a", [1])
    assert a.allocate_slots("a", 1)
    blocks = a.block_ids("a")[g.group_id]
    nulls = (n - W + 1) // B
    assert blocks[:nulls] == [0] * nulls and all(blocks[nulls:])
    assert pool.num_ids - 1 - pool.num_free == used_before - nulls + (len(blocks) > -(-n // B))
    a.free("a")
    assert pool.num_free == pool.num_ids - 1


def test_errors():
    p = plan("qwen3.5-0.8b", "per_group")
    a = HybridAllocator(p, max_model_len=64)
    with pytest.raises(UnknownRequest, match="add_request"):
        a.allocate_slots("nope", 1)
    a.add_request("a", [1, 2, 3])
    with pytest.raises(MaxLengthExceeded, match="max_model_len"):
        a.allocate_slots("a", 65)
    assert a.allocate_slots("a", 3)
    a.free("a")
    with pytest.raises(DoubleFree):
        a.free("a")
    with pytest.raises(UnknownRequest):
        a.block_ids("zzz")


def test_exhaustion_returns_false_and_changes_nothing():
    p = plan("qwen3.5-0.8b", "per_group")
    a = HybridAllocator(p, max_model_len=1 << 20)
    kv = p.pools[1].num_blocks - 1
    a.add_request("a", [1])
    assert a.allocate_slots("a", (kv - 1) * 16)
    a.add_request("b", [2])
    before = (a.block_ids("a"), a.block_ids("b"), a.usage(), a.num_tokens("b"))
    assert not a.allocate_slots("b", 17)
    assert (a.block_ids("a"), a.block_ids("b"), a.usage(), a.num_tokens("b")) == before
    assert a.allocate_slots("b", 16)
    for i in range(2, 8):
        a.add_request(i, [i])
    with pytest.raises(PoolExhausted):  # 8 state slots are all taken
        a.add_request("x", [0])


def test_events_replay_matches_cache():
    p = plan("qwen3.5-0.8b", "inflate")
    a = HybridAllocator(p, max_model_len=8192)
    idx = CacheIndex()
    B = p.groups[0].block_size
    _prefill_to(a, "a", list(range(2 * B + 10)), [B, 2 * B + 10])
    batch = a.take_events()
    stored = [(e.group_idx, h) for e in batch.events for h in e.block_hashes]
    assert len(stored) == len(set(stored))  # no duplicate hash-unit events
    for e in batch.events:  # one event per block, hash_block_size units, chained parents
        assert e.block_size == 16 and len(e.block_hashes) == B // 16
    idx.apply(batch)
    assert idx.keys == a.cached_hashes()
    a.free("a")
