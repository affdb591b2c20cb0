"""Unit tests for hybridkv.alloc: pools, hashes, hit rules, checkpoint policies, partial-block
hits, sliding windows, errors, events. The random-sequence checks are in
test_alloc_state_machine.py."""

from __future__ import annotations

import functools
import heapq

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv import models
from hybridkv.alloc import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    CacheIndex,
    ConfigError,
    DoubleFree,
    DuplicateRequest,
    HybridAllocator,
    MaxLengthExceeded,
    PoolExhausted,
    TwoLevelPool,
    UnknownRequest,
)
from hybridkv.alloc.check import check_consistency
from hybridkv.alloc.hashing import (
    encode_extra_keys,
    extend_unit_hashes,
    get_hash_fn,
    hash_tokens,
    token_array,
)
from hybridkv.alloc.marconi import MarconiScorer, Ranking, _normalise
from hybridkv.layouts import make_plan


@functools.cache
def plan(model: str, layout: str, memory: int = 1 << 30, seqs: int = 8, ckpt_slots: int = 0):
    return make_plan(
        models.load(model),
        layout,
        memory=memory,
        max_num_seqs=seqs,
        block_size=16,
        cache_state_slots=ckpt_slots,
    )


def _step(a: HybridAllocator, copies: list | None = None) -> list:
    """The end of one forward pass: commit, keep the checkpoint copies, check everything."""
    got = a.take_state_copies()
    if copies is not None:
        copies.extend(got)
    check_consistency(a)
    return got


def _prefill_to(a: HybridAllocator, rid, prompt, chunks, copies: list | None = None):
    hit = a.add_request(rid, prompt)
    done = hit.num_cached_tokens
    for c in chunks:
        assert a.allocate_slots(rid, c - done)
        _step(a, copies)
        done = c
    return hit


def _decode(a: HybridAllocator, rid, tokens, copies: list | None = None) -> None:
    for t in tokens:
        a.append_tokens(rid, [t])
        assert a.allocate_slots(rid, 1)
        _step(a, copies)


# ---- pools ------------------------------------------------------------------------------------
def test_block_pool_lru_and_refcounts():
    evicted = []
    p = BlockPool(6, "t", lambda key, bid: evicted.append(key))
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
    with pytest.raises(ValueError, match="at least 2 ids"):
        BlockPool(1)


def test_two_level_pages_move_between_groups():
    evicted = []
    tl = TwoLevelPool(3, {0: 4, 1: 2}, first_gid=0, on_evict=lambda key, bid: evicted.append(key))
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
    d = g0.allocate(4)  # reclaims group 1's idle page, evicting its cached id
    assert evicted == ["x"] and tl.page_owner[page_b] == 0 and d[0] // 4 == page_b
    g0.free(a + c + d)
    assert tl.usage() == 0.0


def test_two_level_takes_a_free_page_before_evicting_cached_blocks():
    evicted = []
    tl = TwoLevelPool(10, {0: 4, 1: 1}, 0, "p", lambda key, sid: evicted.append(key))
    v = tl.view(0)
    ids = v.allocate(3)  # page 0: ids 1..3
    for i, s in enumerate(ids):
        v.cache(s, (0, b"k%d" % i))
    v.free(ids)
    v.allocate(1)  # 9 pages are free: the cached ids stay
    assert evicted == [] and len(tl.free_pages) == 8


def test_two_level_multi_group_allocation_keeps_pages_for_the_group_that_needs_them():
    """Group 0 has a cached free id and one page is free; group 1 needs that page. Without a
    reservation group 0 would take the page to spare its cached id and group 1 would fail half
    way through an allocation that can_allocate accepted."""
    evicted = []
    tl = TwoLevelPool(3, {0: 4, 1: 2}, 0, "p", lambda key, sid: evicted.append(key))
    g0, g1 = tl.view(0), tl.view(1)
    a = g0.allocate(3)  # fills page 0 (ids 1..3)
    b = g1.allocate(2)  # page for group 1
    g0.cache(a[0], "x")
    g0.free(a[:1])  # one cached free id on page 0
    needs = {0: 1, 1: 1}
    assert tl.can_allocate(needs)
    tl.reserve(needs)
    assert tl.reserved_pages == 1
    got0 = g0.allocate(1)
    got1 = g1.allocate(1)  # the last page
    tl.release()
    assert got0 == a[:1] and evicted == ["x"] and got1[0] // 2 not in (0, b[0] // 2)
    assert tl.free_pages == {}


def test_two_level_evicts_the_least_recent_block_of_any_group():
    """No free page: group 0 needs an id. Group 1's idle page holds a checkpoint freed before
    group 0's cached block, so the checkpoint goes (one LRU across groups)."""
    evicted = []
    tl = TwoLevelPool(3, {0: 2, 1: 1}, 0, "p", lambda key, sid: evicted.append(key))
    g0, g1 = tl.view(0), tl.view(1)
    (s,) = g1.allocate(1)  # page for group 1
    a = g0.allocate(3)  # id 1 on page 0, then both ids of the last page
    g1.cache(s, "old-state")
    g1.free([s])  # idle page, stamped first
    g0.cache(a[0], "newer-kv")
    g0.free(a[:1])
    assert not tl.free_pages and tl.idle
    got = g0.allocate(1)
    assert evicted == ["old-state"] and g0.lookup("newer-kv") == a[0]
    assert got[0] // 2 == s  # group 1's page now serves group 0
    g0.free(got + a[1:])


def test_two_level_reactivated_idle_page_is_used_or_idle_again():
    """Group 1 needs an id and has neither free ids nor cached ones in its lists, only an idle
    page whose two ids both hold checkpoints; group 0's idle page went idle earlier."""
    tl = TwoLevelPool(4, {0: 4, 1: 2}, 0, "p")
    g0, g1 = tl.view(0), tl.view(1)
    a = g0.allocate(7)  # page 0 (3 ids) and page 1 (4 ids)
    for i in range(3, 7):  # every id of page 1 holds a block: no hole to reuse
        g0.cache(a[i], f"kv-{i}")
    g0.free(a[3:])  # page 1 idle, stamped first
    b = g1.allocate(2)  # page 2
    g1.cache(b[0], "state-0")
    g1.cache(b[1], "state-1")
    g1.free(b)  # page 2 idle
    c = g0.allocate(4)  # the last free page
    assert not tl.free_pages and list(tl.idle) == [1, 2]
    (s,) = g1.allocate(1)
    check = [p for p in g1.pages if tl.used[p] == 0 and p not in g1.idle_pages]
    g1.free([s])
    g0.free(a[:3] + c)
    assert check == [], f"pages {check} of group 1 are neither used, idle nor free"


def test_two_level_holes_of_an_idle_page_are_used_before_a_free_page():
    """An idle page whose ids partly hold nothing is owned memory no one else can use: its
    owner fills those holes before it takes another page (which stays free for any group)."""
    tl = TwoLevelPool(4, {0: 4, 1: 2}, 0, "p")
    g0 = tl.view(0)
    a = g0.allocate(7)  # page 0 (3 ids) and page 1 (4 ids)
    g0.cache(a[3], "kv")
    g0.free(a[3:])  # page 1 idle: one cached id, three holes
    assert g0.num_owned_empty() == 3 + 0  # page 0's ids are all in use
    free_before = list(tl.free_pages)
    got = g0.allocate(3)
    assert sorted(x // 4 for x in got) == [1, 1, 1] and list(tl.free_pages) == free_before
    assert g0.lookup("kv") == a[3] and g0.num_owned_empty() == 0
    g0.free(got + a[:3])


def test_two_level_reactivated_cached_ids_keep_their_lru_place():
    """Reactivating an idle page puts its cached ids back where their last use puts them in
    the LRU, not at the front: a page reactivated for its holes must not lose its newest
    blocks first."""
    tl = TwoLevelPool(5, {0: 4, 1: 2}, 0, "p")
    g0 = tl.view(0)
    a = g0.allocate(3)  # page 0
    old = g0.allocate(1)  # page 1
    g0.cache(old[0], "old")
    g0.free(old)  # page 1 idle
    b = g0.allocate(2)  # page 1's holes
    g0.cache(b[0], "mid")
    g0.free(b)  # page 1 idle again, "old" freed before "mid"
    c = g0.allocate(2)  # the holes again: "old" and "mid" rejoin the LRU by their last use
    assert list(g0._lru) == [old[0], b[0]]
    g0.free(a + c)


def test_two_level_pool_evictor_chooses_what_goes():
    """With a pool-wide evictor (Marconi's), a group that has no room asks it to evict until a
    hole or a free page appears, whichever group the victim is in; the page order (another
    group's oldest idle page first) serves only once it has nothing to offer."""
    evicted = []
    tl = TwoLevelPool(4, {0: 2, 1: 1}, 0, "p", lambda key, sid: evicted.append(key))
    g0, g1 = tl.view(0), tl.view(1)
    (old,) = g1.allocate(1)  # page 1
    g1.cache(old, "old-state")
    g1.free([old])  # idle first: the page order's victim
    (new,) = g1.allocate(1)  # a free page is taken before the idle one is touched: page 2
    g1.cache(new, "new-state")
    g1.free([new])
    a = g0.allocate(3)  # id 1 on page 0, then page 3
    g0.cache(a[2], "kv")
    g0.free(a[1:])  # page 3 idle, its other id a hole
    assert not tl.free_pages and new == 2 and a[2] // 2 == 3
    choices = ["new-state", "kv"]  # the evictor's order, by its own value

    def evict() -> bool:
        if not choices:
            return False
        key = choices.pop(0)
        view = g1 if key.endswith("state") else g0
        return view.drop_cached(view.lookup(key))

    tl.segment_evictor = evict
    got = g0.allocate(1)  # the hole on page 3 first: nothing evicted
    assert evicted == [] and got == [a[1]]
    got += g0.allocate(1)  # no room: the evictor drops the newer state, freeing page 2
    assert evicted == ["new-state"] and got[1] // 2 == new and g1.lookup("old-state") == old
    got += g0.allocate(2)  # one id left on page 2, then the cached "kv" (the evictor's pick)
    assert evicted == ["new-state", "kv"] and got[3] == a[2]
    assert tl.can_allocate({0: 2}) and not tl.can_allocate({0: 3})  # page 1, idle, is left
    got += g0.allocate(1)  # the evictor has nothing left: the page order takes page 1
    assert evicted == ["new-state", "kv", "old-state"] and got[4] // 2 == old
    g0.free(got + a[:1])


def test_two_level_view_evictor_may_choose_an_id_on_an_idle_page():
    """Cached ids on a group's idle pages are evictable (a Marconi segment may lie there): the
    page is reactivated and the chosen id taken, its other cached ids kept in the LRU."""
    tl = TwoLevelPool(3, {0: 4, 1: 1}, 0, "p")
    g0, g1 = tl.view(0), tl.view(1)
    a = g0.allocate(7)  # ids 1..3 on page 0, then page 1 (ids 4..7)
    for i, sid in enumerate(a):
        g0.cache(sid, f"kv-{i}")
    g0.free(a)  # page 0 stays active (it is pinned): ids 1..3 in the LRU; page 1 idle
    (s,) = g1.allocate(1)  # the last free page
    assert list(g0._lru) == a[:3] and 1 in g0.idle_pages
    assert g0.evictable(a[0]) and g0.evictable(a[5])
    g0.evictor = lambda candidates: a[5]  # Marconi's pick: outside the LRU's window
    g0.evictor_window = 2
    got = g0.allocate(1)
    assert got == [a[5]] and g0.lookup("kv-5") is None and 1 not in g0.idle_pages
    # page 1's other cached ids are kept, in the LRU after page 0's (freed later)
    assert list(g0._lru) == a[:5] + a[6:] and g0.lookup("kv-6") == a[6]
    g0.free(got)
    g1.free([s])


def test_pools_answer_the_allocator_through_one_interface():
    """Both pool kinds: feasibility counting ids to be freed and hits' cached ids, reservation
    (only several groups of a two-level pool hold pages back), ids held per group."""
    bp = BlockPool(5, "b", groups=(0, 1))
    assert bp.view(1) is bp and bp.group_views() == [(bp, [0, 1])]
    a = bp.allocate(3)
    bp.cache(a[0], (0, "x"))
    bp.free(a[:1])  # one cached free id, one plain
    assert bp.can_allocate({0: 1, 1: 1}) and not bp.can_allocate({0: 2, 1: 1})
    assert bp.can_allocate({0: 2, 1: 1}, freed={1: 1})  # any group takes a freed id
    assert not bp.can_allocate({0: 2}, touch={0: [a[0]]})  # the hit keeps its cached id
    assert not bp.reserve({0: 1, 1: 1})
    assert bp.ids_in_use(lambda g: a[1:2] if g == 1 else [], {1}) == {1: 1, 0: 2}

    tl = TwoLevelPool(4, {0: 4, 1: 1}, 0, "p")
    assert tl.groups == (0, 1) and [g for _, g in tl.group_views()] == [[0], [1]]
    s = tl.view(1).allocate(2)  # two pages: one page left
    assert tl.can_allocate({1: 1}) and not tl.can_allocate({1: 2})
    assert tl.can_allocate({1: 2}, freed={1: 1})  # an id of a one-id page frees the page
    assert tl.can_allocate({0: 7}) and not tl.can_allocate({0: 8})  # 3 on page 0, a page of 4
    assert not tl.reserve({0: 4}) and tl.reserved_pages == 0
    assert tl.reserve({0: 4, 1: 1}) and tl.reserved_pages == 2
    tl.release()
    assert tl.ids_in_use(lambda g: s if g == 1 else [0], set()) == {0: 0, 1: 2}


# ---- hashes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("algo", ["sha256", "blake2b", "builtin"])
def test_hash_chain(algo):
    fn = get_hash_fn(algo)
    toks = token_array(range(40))
    hs = extend_unit_hashes([], toks, len(toks), 16, b"", fn)
    assert len(hs) == 2  # the 8-token tail is not a full unit
    assert hs[1] == hash_tokens(hs[0], range(16, 32), b"", fn)
    # incremental extension gives the same chain
    assert extend_unit_hashes(hs[:1], toks, 40, 16, b"", fn) == hs
    lora = encode_extra_keys(("lora", 1))
    assert extend_unit_hashes([], toks, 40, 16, lora, fn)[0] != hs[0]
    with pytest.raises(ValueError, match="sha256"):
        get_hash_fn("md5")


def test_extra_keys_and_lora_separate_caches():
    a = HybridAllocator(plan("qwen3.5-0.8b", "per_group"), checkpoint_policy="last")
    prompt = list(range(64))
    _prefill_to(a, "a", prompt, [64])
    a.free("a")
    assert a.find_longest_cache_hit([*prompt, 1]) == 64
    assert a.find_longest_cache_hit([*prompt, 1], lora_id=3) == 0
    assert a.find_longest_cache_hit([*prompt, 1], extra_keys="salt") == 0


# ---- hit rules and checkpoint policies -------------------------------------------------------
def test_state_hit_needs_checkpoint_at_hit_length():
    p = plan("qwen3.5-0.8b", "inflate")
    B = p.groups[1].block_size  # the state checkpoint granularity in align mode
    a = HybridAllocator(p, checkpoint_policy="align", max_model_len=8192)
    base = list(range(1000, 1000 + 2 * B))
    # Only 300 shared tokens: the state group has no checkpoint there.
    _prefill_to(a, "a", base[:300] + [1] * 400, [700])
    a.free("a")
    assert a.add_request("b", base[:300] + [2] * 400).num_cached_tokens == 0
    a.free("b")
    # Chunked at the block boundary (its last cacheable one), align keeps the state at B.
    assert a.add_request("c", base[: B + 100]).num_cached_tokens == 0
    assert a.next_checkpoint("c") == B
    copies: list = []
    assert a.allocate_slots("c", B)
    _step(a, copies)
    assert {g for g, _, _ in copies} == {1, 2, 3}
    assert a.allocate_slots("c", 100)
    _step(a)
    a.free("c")
    hit = a.add_request("d", base[: B + 200])
    assert hit.num_cached_tokens == B
    assert sorted(g for g, _, _ in hit.state_copies) == [1, 2, 3]
    ckpts = {g: c for g, _, c in copies}  # (group, running, checkpoint)
    assert all(ckpts[g] == src for g, src, _ in hit.state_copies)
    assert all(dst == a.state_slot("d", g) for g, _, dst in hit.state_copies)
    a.free("d")
    check_consistency(a)


def test_state_unchunked_prefill_cannot_hit_in_align_mode():
    p = plan("qwen3.5-0.8b", "inflate")
    B = p.groups[1].block_size
    a = HybridAllocator(p, max_model_len=8192)
    prompt = list(range(B + 300))
    _prefill_to(a, "a", prompt, [len(prompt)])  # state only at B + 300, not at B
    a.free("a")
    assert a.add_request("b", [*prompt, 9]).num_cached_tokens == 0


def test_checkpoint_is_visible_only_after_the_commit():
    """A hit may not read a checkpoint (or KV) the running forward pass has not written."""
    p = plan("qwen3.5-0.8b", "per_group", ckpt_slots=4)
    # a prefill that cannot export checkpoints (vLLM 0.32's GDN): the scheduler splits it
    a = HybridAllocator(p, checkpoint_policy="align", prefill_checkpoint_alignment=None)
    prompt = list(range(65))  # align keeps the state at 64, its last cacheable block boundary
    a.add_request("a", prompt)
    assert a.split_prefill("a", 65) == 64
    assert a.allocate_slots("a", 64)
    assert a.find_longest_cache_hit([*prompt[:64], 1]) == 0  # forward not done yet
    copies = _step(a)
    assert copies and all(src == a.state_slot("a", g) for g, src, _ in copies)
    assert a.find_longest_cache_hit([*prompt[:64], 1]) == 64


def test_hit_sources_are_held_until_the_commit_only():
    p = plan("qwen3.5-0.8b", "per_group", ckpt_slots=4)
    a = HybridAllocator(p, checkpoint_policy="align")
    prompt = list(range(64))
    _prefill_to(a, "a", [*prompt, 0], [64, 65])
    a.free("a")
    hit = a.add_request("b", [*prompt, 1, 2])
    ((g, src, _dst),) = hit.state_copies
    pool = a.pool[g]
    assert pool.refcount(src) == 1  # held: the copy has not run yet
    assert a.allocate_slots("b", 2)
    _step(a)
    assert pool.refcount(src) == 0 and pool.lookup(pool.key_of(src)) == src  # cached, free
    a.free("b")


def test_last_policy_keeps_a_rolling_end_state():
    p = plan("qwen3.5-0.8b", "per_group", ckpt_slots=4)
    a = HybridAllocator(p, checkpoint_policy="last", max_model_len=4096)
    prompt = list(range(37))  # not on a hash unit: no checkpoint at the end of prefill
    copies: list = []
    _prefill_to(a, "a", prompt, [37], copies)
    assert copies == []
    _decode(a, "a", range(11), copies)  # token 48 ends a hash unit: the rolling state moves
    assert len(copies) == 1
    g, src, dst = copies[0]
    assert src == a.state_slot("a", g)
    assert a.find_longest_cache_hit([*prompt, *range(11), 5]) == 0  # private while running
    a.free("a")
    turn2 = [*prompt, *range(11), 5, 6]
    hit = a.add_request("b", turn2)
    assert hit.num_cached_tokens == 48 and hit.state_copies == [(g, dst, a.state_slot("b", g))]
    a.free("b")


def test_private_end_checkpoints_give_way_to_new_requests():
    """``last`` keeps a running request's end state in a spare slot; when a new request needs
    that slot, the private checkpoint is dropped instead of refusing the request."""
    p = plan("qwen3.5-0.8b", "per_group", seqs=2)  # 2 state slots
    a = HybridAllocator(p, checkpoint_policy="last")
    copies: list = []
    _prefill_to(a, "a", list(range(32)), [32], copies)
    assert copies and a.reqs["a"].end_ckpt  # the rolling end state took the spare slot
    assert a.pool[0].num_free == 0
    a.add_request("b", [9, 9])  # needs that slot
    assert not a.reqs["a"].end_ckpt
    check_consistency(a)
    with pytest.raises(PoolExhausted):  # nothing private is left to give way
        a.add_request("c", [9, 8])
    _decode(a, "a", range(16))  # the next unit boundary finds no spare slot: no checkpoint
    assert not a.reqs["a"].end_ckpt
    a.free("b")
    _decode(a, "a", range(16))  # a slot is spare again
    assert a.reqs["a"].end_ckpt
    a.free("a")


def test_partial_block_hit_copies_the_reused_tokens():
    """With large blocks (inflate: hundreds of tokens) and an end-of-request state, the next turn
    resumes inside the last attention block: the reused tokens are copied into a new block."""
    p = plan("qwen3.5-0.8b", "inflate")
    B = p.groups[0].block_size
    turn1 = list(range(300))
    for partial in (True, False):
        a = HybridAllocator(p, checkpoint_policy="last", partial_block_hits=partial)
        _prefill_to(a, "a", turn1, [300])
        _decode(a, "a", [7, 7, 7, 7])  # 304 = 19 hash units
        tail = a.block_ids("a")[0][0]
        a.free("a")
        hit = a.add_request("b", [*turn1, 7, 7, 7, 7, 8, 9])
        if not partial:
            assert hit.num_cached_tokens == 0  # the state hit is inside block 0
            continue
        assert hit.num_cached_tokens == 304 < B
        ((g, src, dst, n),) = hit.kv_copies
        assert (g, src, n) == (0, tail, 304) and dst == a.block_ids("b")[0][0] != src
        assert len(hit.state_copies) == 3
        assert a.allocate_slots("b", 2)
        _step(a)
        a.free("b")
        check_consistency(a)


def test_marconi_checkpoints_the_branch_point():
    """Two requests share 200 tokens: the second is a branch. Marconi checkpoints the state at
    the branch point so the third request sharing them hits; ``last`` does not."""
    p = plan("qwen3.5-0.8b", "per_group", ckpt_slots=8)
    X = list(range(200))
    results = {}
    for policy in ("last", "marconi"):
        a = HybridAllocator(p, checkpoint_policy=policy)
        _prefill_to(a, "a", X + [1] * 100, [300])
        _decode(a, "a", [1] * 4)
        a.free("a")
        b = X + [2] * 50
        assert a.add_request("b", b).num_cached_tokens == 0  # no state at 192 yet
        nxt = a.next_checkpoint("b")
        copies: list = []
        if policy == "marconi":
            assert nxt == 192  # the last full hash unit inside the shared prefix
            assert a.allocate_slots("b", nxt)
            _step(a, copies)
            assert copies  # the branch-point checkpoint
        else:  # the prompt's last hash boundary, where its end state is kept
            assert nxt == len(b) // 16 * 16
        assert a.allocate_slots("b", len(b) - a.num_tokens("b"))
        _step(a)
        a.free("b")
        results[policy] = a.add_request("c", X + [3] * 30).num_cached_tokens
        a.free("c")
        check_consistency(a)
    assert results == {"last": 0, "marconi": 192}


def test_marconi_eviction_weighs_recency_against_value():
    """Marconi's utility, recency + alpha x efficiency (each min-max normalised): with alpha 0
    the oldest state goes; with a large alpha the state whose own segment saves the fewest
    FLOPs per byte kept, however recent; a segment reaches up to the previous state or branch
    point of its chain."""
    from hybridkv.alloc.prefix_cache import Entry, PrefixIndex

    p = plan("qwen3.5-0.8b", "per_group")
    chain = next(g.group_id for g in p.attention_groups)
    index = PrefixIndex(16)
    # a chain of 8 units u0..u7 with a branch at u1 (u1 -> u2 and u1 -> v2)
    units = [bytes([i]) for i in range(8)]
    for par, u in zip([None, *units], units):
        index.parent[(chain, u)] = par
        if par is not None:
            index.children.setdefault((chain, par), {})[u] = None
    index.parent[(chain, b"v2")] = units[1]
    index.children[(chain, units[1])][b"v2"] = None

    class Pool:  # every state is cached and free
        def lookup(self, key):
            return 1

        def refcount(self, bid):
            return 0

    s = MarconiScorer(index, p, {g.group_id: Pool() for g in p.groups}, alpha=0.0)
    assert s.segment_start(units[7], 128) == 32  # up to the branch point u1 (32 tokens)
    # states at u4 (80 tokens, cached first) and u7 (128 tokens, a step later)
    state = s.state_groups[0]
    for u in (units[4], units[7]):
        index.entries[(state, u)] = Entry(1, units.index(u), [u], True)
        s.accessed(u)
        s.tick()
    assert s.segment_start(units[7], 128) == 80  # the state at u4 ends u7's segment
    util = s.utilities()
    assert set(util) == {units[4], units[7]}
    assert util[units[4]][0] < util[units[7]][0]  # alpha 0: the older goes first
    s.alpha = 5.0
    assert s.efficiency(80, 128) < s.efficiency(0, 80)
    util = s.utilities()
    # 48 tokens on top of 80 save less per byte kept than 80 from scratch: u7 goes first
    assert util[units[7]][0] < util[units[4]][0]
    # a branch point is never a candidate: a second child under u4
    index.children[(chain, units[4])][b"w5"] = None
    assert set(s.utilities()) == {units[7]}
    with pytest.raises(ValueError, match="marconi_alpha"):
        MarconiScorer(index, p, {}, alpha=-1.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, 2.0]), max_size=40))
def test_ranking_order_is_a_heap_of_utility_then_candidate_order(values):
    """The evictors take candidates in ``Ranking.order``: least utility first, ties in the
    scorer's candidate order, exactly as the heap of ``(utility, index)`` they used to pop
    (values drawn from a few, so ties are common)."""
    n = len(values)
    ranking = Ranking(
        [bytes([i]) for i in range(n)],
        list(range(n)),
        [True] * n,
        np.array(values, dtype=np.float64),
    )
    heap = [(x, i) for i, x in enumerate(values)]
    heapq.heapify(heap)
    assert list(ranking.order()) == [heapq.heappop(heap)[1] for _ in range(n)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=50), st.integers(1, 10**6))
def test_normalised_recency_is_the_float_arithmetic_of_python(stamps, ahead):
    """The ranking's numpy arithmetic gives, bit for bit, what the scorer computed on Python
    floats (one IEEE rounding per operation either way): evictions do not move."""
    now = max(stamps) + ahead
    values = [1.0 / (now - t) for t in stamps]
    lo, hi = min(values), max(values)
    expected = [1.0] * len(values) if hi == lo else [(v - lo) / (hi - lo) for v in values]
    got = _normalise(1.0 / (now - np.array(stamps, dtype=np.int64))).tolist()
    assert got == expected
    mixed = [r + 0.7 * e for r, e in zip(expected, expected[::-1])]
    arr = np.array(expected)
    assert (arr + 0.7 * arr[::-1]).tolist() == mixed


def test_policy_errors():
    p = plan("qwen3.5-0.8b", "per_group")
    with pytest.raises(ValueError, match="checkpoint_policy"):
        HybridAllocator(p, checkpoint_policy="first")
    with pytest.raises(ConfigError, match="hash_block_size"):
        HybridAllocator(p, hash_block_size=5)


def test_full_attention_hit_and_block_tables():
    p = plan("qwen3.5-0.8b", "two_level")
    # align_every_block checkpoints a decode step that ends on a block boundary (align does not)
    a = HybridAllocator(p, max_model_len=4096, checkpoint_policy="align_every_block")
    prompt = list(range(100))
    _prefill_to(a, "a", prompt, [100])
    ids_a = a.block_ids("a")
    attn = next(g.group_id for g in p.groups if not g.is_state)
    hit = a.add_request("b", prompt[:80] + [7] * 10)
    # attention would hit 80, but the state group has no checkpoint there: fixed point is 0
    assert hit.num_cached_tokens == 0
    a.free("b")
    _decode(a, "a", range(12))  # decode to a block boundary (112): a checkpoint
    a.append_tokens("a", [99])
    hit = a.add_request("c", prompt + list(range(12)) + [3] * 5)
    assert hit.num_cached_tokens == 112
    assert a.block_ids("c")[attn][:7] == ids_a[attn][:7]
    tables = a.block_tables(["a", "c"])
    assert len(tables) == len(p.groups) and all(t.dtype == torch.int32 for t in tables)
    assert tables[attn].shape[0] == 2 and tables[attn][1, 7:].eq(0).all()
    assert tables[attn][0, :7].tolist() == ids_a[attn][:7]
    with pytest.raises(UnknownRequest):
        a.block_tables(["a", "nope"])


# ---- sliding window ---------------------------------------------------------------------------
def test_sliding_window_frees_out_of_window_blocks():
    p = plan("recurrentgemma-2b", "per_group")
    g = next(g for g in p.groups if g.kind == "sliding_window")
    W, B = g.sliding_window, g.block_size
    a = HybridAllocator(p, max_model_len=8192)
    n = W + 5 * B
    a.add_request("a", list(range(n)))
    assert a.allocate_slots("a", n)
    pool = a.pool[g.group_id]
    used_before = pool.num_used
    a.append_tokens("a", [1])
    assert a.allocate_slots("a", 1)
    blocks = a.block_ids("a")[g.group_id]
    nulls = (n - W + 1) // B
    assert blocks[:nulls] == [0] * nulls and all(blocks[nulls:])
    assert pool.num_used == used_before - nulls + (len(blocks) > -(-n // B))
    assert a.block_tables(["a"])[g.group_id][0, :nulls].eq(0).all()
    a.free("a")
    assert pool.num_used == 0


def test_sliding_window_hit_past_the_window_needs_only_the_window():
    """A prompt longer than the window hits without the blocks that left the window: the new
    request's table starts with null blocks and those blocks are never referenced."""
    p = plan("recurrentgemma-2b", "per_group", ckpt_slots=4)
    g = next(g for g in p.groups if g.kind == "sliding_window")
    W, B = g.sliding_window, g.block_size
    a = HybridAllocator(p, max_model_len=8192)
    n = W + 5 * B
    prompt = list(range(n))
    # align keeps the state at n, the last cacheable block boundary of n + 1 tokens
    _prefill_to(a, "a", [*prompt, 0], [n // 2, n, n + 1])
    a.free("a")
    pool = a.pool[g.group_id]
    hit = a.add_request("b", [*prompt, 1, 2, 3])
    assert hit.num_cached_tokens == n
    blocks = a.block_ids("b")[g.group_id]
    lead = (n - W + 1) // B
    assert lead > 0 and blocks[:lead] == [0] * lead and all(blocks[lead:])
    # the early blocks are still cached but nobody holds them
    early = [pool.lookup(k) for k in pool.cached_items() if k[0] == g.group_id]
    assert sum(1 for b in early if pool.refcount(b) == 0) >= lead
    check_consistency(a)
    a.free("b")


# ---- accounting ------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["inflate", "pack", "per_group", "two_level"])
def test_ids_in_use_counts_every_id_that_holds_data(layout):
    p = plan("qwen3.5-0.8b", layout, ckpt_slots=4)
    a = HybridAllocator(p, checkpoint_policy="last")
    base = list(range(200))
    _prefill_to(a, "a", base, [200])
    _decode(a, "a", [1] * 8)  # a private end-of-request checkpoint
    _prefill_to(a, "b", [*base[:100], 5, 6, 7], [103])
    a.free("b")
    got = a.ids_in_use()
    assert set(got) == {g.group_id for g in p.groups}
    pools = {id(v): v for v in a.pool.values()}
    for pid, pool in pools.items():
        gids = [g for g, v in a.pool.items() if id(v) == pid]
        brute = sum(1 for b in range(1, pool.num_ids) if pool.ref[b] or pool.key_of(b) is not None)
        assert sum(got[g] for g in gids) == brute, (layout, gids)
    assert a.fast_path_tokens("a") >= 0
    a.free("a")


# ---- errors -----------------------------------------------------------------------------------
def test_errors():
    p = plan("qwen3.5-0.8b", "per_group")
    a = HybridAllocator(p, max_model_len=64)
    with pytest.raises(UnknownRequest, match="add_request"):
        a.allocate_slots("nope", 1)
    a.add_request("a", [1, 2, 3])
    with pytest.raises(DuplicateRequest):
        a.add_request("a", [1])
    with pytest.raises(MaxLengthExceeded, match="max_model_len"):
        a.allocate_slots("a", 65)
    with pytest.raises(ValueError, match=">= 0"):
        a.allocate_slots("a", -1)
    with pytest.raises(MaxLengthExceeded):
        a.add_request("long", list(range(65)))
    with pytest.raises(ValueError, match="attention group"):
        a.state_slot("a", 1)
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
    check_consistency(a)


# ---- events -----------------------------------------------------------------------------------
def test_events_replay_matches_cache():
    p = plan("qwen3.5-0.8b", "inflate")
    a = HybridAllocator(p, max_model_len=8192)
    idx = CacheIndex()
    B = p.groups[0].block_size
    _prefill_to(a, "a", list(range(2 * B + 10)), [B, 2 * B + 10])
    batch = a.take_events()
    stored = [(e.group_idx, h) for e in batch.events for h in e.block_hashes]
    assert len(stored) == len(set(stored))  # no duplicate hash-unit events
    attn = [e for e in batch.events if e.group_idx == 0]
    assert len(attn) == 2  # one event per attention block, hash_block_size units each
    for e in attn:
        assert e.block_size == 16 and len(e.block_hashes) == B // 16
        assert len(e.token_ids) == B
    assert attn[1].parent_block_hash == attn[0].block_hashes[-1]
    idx.apply(batch)
    assert idx.parent == a.cached_units() and idx.errors == 0
    a.free("a")


def test_blocks_sharing_leading_units_emit_each_unit_once():
    """Two partly filled inflate blocks agree on their first 288 tokens: the second request's
    entry stores only its new units, chained to the shared ones, and evicting one entry removes
    only the units nothing else covers. (Unit accounting alone: with ``evict_unreachable``
    b's allocations would evict a's end state and, with it, a's now useless KV.)"""
    p = plan("qwen3.5-0.8b", "inflate", memory=64 << 20, seqs=2)
    a = HybridAllocator(p, checkpoint_policy="last", evict_unreachable=False)
    idx = CacheIndex()
    base = list(range(300))
    _prefill_to(a, "a", base, [300])
    _decode(a, "a", [1] * 4)  # end state at 304: 19 units
    a.free("a")
    events_a = a.take_events().events
    idx.apply(events_a)
    ev_a = [e for e in events_a if isinstance(e, BlockStored) and e.group_idx == 0]
    b = base[:290] + [5] * 30  # diverges inside unit 18
    _prefill_to(a, "b", b, [320])
    a.free("b")
    ev = a.take_events().events
    idx.apply(ev)
    ev_b = [e for e in ev if isinstance(e, BlockStored) and e.group_idx == 0]
    ((e,),) = (ev_b,)
    assert len(e.block_hashes) == 2  # units 18 and 19 of b; 0..17 were stored by a
    assert e.parent_block_hash == ev_a[0].block_hashes[17]
    assert idx.errors == 0 and idx.parent == a.cached_units()
    # New requests evict a's entry (freed first, so oldest): only its unit 18 goes, units 0..17
    # are still covered by b's entry.
    i = 0
    while a.pool[0].lookup((0, ev_a[0].block_hashes[-1])) is not None:
        a.add_request(i, list(range(10_000 * (i + 1), 10_000 * (i + 1) + 600)))
        assert a.allocate_slots(i, 600)
        a.free(i)
        i += 1
    events = a.take_events().events
    idx.apply(events)
    removed = [
        (e.group_idx, h) for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes
    ]
    assert len(removed) == len(set(removed))
    assert (0, ev_a[0].block_hashes[18]) in removed
    assert (0, ev_a[0].block_hashes[0]) not in removed and (0, e.block_hashes[-1]) not in removed
    assert idx.errors == 0 and idx.parent == a.cached_units()


def test_reset_prefix_cache_emits_all_blocks_cleared():
    a = HybridAllocator(plan("qwen3.5-0.8b", "per_group", ckpt_slots=2))
    idx = CacheIndex()
    # align keeps the state where a chunk ends on the replay boundary (48): vLLM's split
    _prefill_to(a, "a", list(range(64)), [48, 64])
    assert not a.reset_prefix_cache()  # a request still runs
    a.free("a")
    idx.apply(a.take_events())
    assert idx.parent
    assert a.reset_prefix_cache()
    events = a.take_events().events
    assert events == [AllBlocksCleared()]  # no BlockRemoved storm before it
    idx.apply(events)
    assert not idx.parent and not a.cached_hashes()
    assert a.find_longest_cache_hit([*range(64), 1]) == 0
    check_consistency(a)


SMALL = 230 << 20  # 230 MiB: the states and a few hundred 16-token KV blocks: the test evicts


def test_kv_events_off_builds_none_and_changes_nothing_else():
    """``kv_events=False`` (the simulator's default) builds no event, not even the reset's
    ``AllBlocksCleared``, and allocates, caches, hits and evicts exactly as with events on."""
    from hybridkv.sim import SimConfig

    assert SimConfig().allocator.kv_events is False
    runs = []
    for events in (True, False):
        p = plan("qwen3.5-0.8b", "per_group", memory=SMALL, ckpt_slots=2)
        a = HybridAllocator(p, kv_events=events)
        trace = []
        for i in range(12):  # shared prefixes of varying length, in a pool that must evict
            prompt = list(range(16 * (i % 5))) + [1000 + i] * 64
            _prefill_to(a, i, prompt, [len(prompt)])
            trace.append((a.block_ids(i), a.find_longest_cache_hit([*prompt, 7])))
            a.free(i)
        trace.append(sorted(a.cached_units().items()))
        check_consistency(a)
        trace.append(a.reset_prefix_cache())
        runs.append((trace, a.take_events().events))
    (with_events, emitted), (without, none) = runs
    assert with_events == without
    assert none == []
    assert any(isinstance(e, BlockRemoved) for e in emitted)  # the pool did evict
    assert emitted[-1] == AllBlocksCleared()


def _random_forest(parents: list[int], states: set[int]):
    """A prefix index of one group (0) holding a random forest: unit ``i``'s parent is unit
    ``parents[i - 1] % i`` (unit 0 a root), a state at each unit of ``states``, with the chain
    every state lies in (its units from the root). Returns the index, the units and each
    unit's chain."""
    from hybridkv.alloc.prefix_cache import PrefixIndex

    index = PrefixIndex(16)
    units = [bytes([i]) for i in range(len(parents) + 1)]
    chains = [[units[0]]]  # each unit's chain: the units from its root to it
    index.parent[(0, units[0])] = None
    for i, p in enumerate(parents, start=1):
        par = p % i
        index.parent[(0, units[i])] = units[par]
        index.children.setdefault((0, units[par]), {})[units[i]] = None
        chains.append([*chains[par], units[i]])
    for i in states:
        if i < len(units):
            index.state_units[units[i]] = 1
            index.state_chains[units[i]] = (chains[i], len(chains[i]) - 1)
    return index, units, chains


@settings(max_examples=60, deadline=None)
@given(
    parents=st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=40),
    states=st.sets(st.integers(min_value=0, max_value=40)),
    start=st.integers(min_value=0, max_value=40),
)
def test_state_below_agrees_with_the_newest_first_walk(parents, states, start):
    """``Reach.state_below`` walks a subtree oldest child first (the eviction cascade's fast
    question); on random prefix forests with states at random units it answers what the
    newest-first ``subtree(stop=state)`` walk answers, and ``dead_segment`` is what that walk
    and ``segment_above`` give."""
    from hybridkv.alloc.reach import Reach

    index, units, _ = _random_forest(parents, states)
    gid = 0
    reach = Reach(index)
    has_state = index.state_units.__contains__
    unit = units[start % len(units)]
    newest_first = reach.subtree(gid, [unit], stop=has_state)
    assert reach.state_below(gid, unit) == (newest_first is None)
    # with a walk limit: what one stack step per unit, oldest child first, answers (the limit
    # counts units visited; a chain's single children are followed without the stack)
    for limit in range(1, 6):
        stack, seen, found = [unit], 0, False
        while stack and seen < limit and not found:
            x = stack.pop()
            found = has_state(x)
            seen += 1
            stack.extend(reversed(index.children.get((gid, x), {})))
        assert reach.state_below(gid, unit, limit) == found, limit
        stack, walked = [unit], []
        while stack and len(walked) < limit:
            x = stack.pop()
            walked.append(x)
            stack.extend(index.children.get((gid, x), {}))
        assert reach.subtree(gid, [unit], limit=limit) == walked, limit
    if newest_first is None:
        assert reach.dead_segment(gid, unit) == []
    else:
        above, _ = reach.segment_above(gid, unit, has_state)
        assert reach.dead_segment(gid, unit) == newest_first + above


@settings(max_examples=80, deadline=None)
@given(
    parents=st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=40),
    states=st.sets(st.integers(min_value=0, max_value=40)),
    gaps=st.sets(st.integers(min_value=1, max_value=40)),
)
def test_state_reachable_answers_what_the_walk_answers(parents, states, gaps):
    """``Reach.state_reachable`` (a state's chain asked at the unit's position) answers what
    the ``state_below`` walk answers, from every unit of random prefix forests whose units
    before each state form its chain, with random units uncached (their links gone, as
    ``PrefixIndex.remove`` leaves them: a walk from above stops there, one from the unit itself
    still goes down), whether it walks a few units first or none; and ``dead_segment`` is the
    same with or without the unit's depth."""
    from hybridkv.alloc.reach import WALK_FIRST, Reach

    index, units, chains = _random_forest(parents, states)
    gid = 0
    for i in sorted(gaps):
        if i < len(units):
            par = index.parent.pop((gid, units[i]))
            del index.children[(gid, par)][units[i]]
    reach = Reach(index)
    for i, unit in enumerate(units):
        depth = len(chains[i]) - 1
        expected = reach.state_below(gid, unit)
        for walk in (0, 1, 3, WALK_FIRST):  # chains asked at once, after a few units, rarely
            assert reach.state_reachable(gid, unit, depth, walk) == expected, (i, walk)
        assert reach.dead_segment(gid, unit, depth) == reach.dead_segment(gid, unit), i
