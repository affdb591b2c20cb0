"""Stateful property tests: random add/prefill/decode/free/reuse on small plans per layout,
checking allocator invariants after every step."""

from __future__ import annotations

import functools
from collections import Counter, defaultdict

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv import models
from hybridkv.alloc import HybridAllocator, PoolExhausted
from hybridkv.alloc.block_pool import BlockPool, TwoLevelPool
from hybridkv.alloc.zmq_events import CacheIndex
from hybridkv.layouts import LAYOUTS, make_plan

MAX_SEQS = 3


@functools.cache
def small_plan(model: str, layout: str):
    """The smallest plan (8 MiB steps) for MAX_SEQS, grown 30% so a few blocks are spare."""
    m = models.load(model)
    for mb in range(8, 4096, 8):
        try:
            make_plan(m, layout, memory=mb << 20, max_num_seqs=MAX_SEQS, block_size=16)
        except ValueError:
            continue
        return make_plan(
            m, layout, memory=int(mb * 1.3) << 20, max_num_seqs=MAX_SEQS, block_size=16
        )
    raise AssertionError("no plan fits")


def ref_snapshot(a: HybridAllocator) -> dict:
    out = {}
    for name, p in a._pools.items():
        if isinstance(p, TwoLevelPool):
            for g, v in p.views.items():
                out[(name, g)] = dict(v.ref)
        else:
            out[name] = {i: r for i, r in enumerate(p.ref) if r}
    return out


def check_invariants(a: HybridAllocator, index: CacheIndex) -> None:
    expected: Counter = Counter()
    holders: dict = defaultdict(set)
    for rid, r in a.reqs.items():
        for gid, blocks in enumerate(r.blocks):
            for b in blocks:
                if b:
                    expected[(id(a.pool[gid]), b)] += 1
                    holders[(id(a.pool[gid]), b)].add((rid, gid))
        for gid, b in r.held:
            expected[(id(a.pool[gid]), b)] += 1
            holders[(id(a.pool[gid]), b)].add((rid, gid))
        for gid, (_, c) in r.ckpt.items():
            if c > 0:
                expected[(id(a.pool[gid]), c)] += 1
                holders[(id(a.pool[gid]), c)].add((rid, gid))
    actual: Counter = Counter()
    seen = {}
    for gid in range(len(a.groups)):
        p = a.pool[gid]
        seen[id(p)] = p
    for pid, p in seen.items():
        refs = p.ref.items() if isinstance(p.ref, dict) else enumerate(p.ref)
        for b, n in refs:
            if n:
                actual[(pid, b)] = n
        # every id is either in use or in exactly one free list
        if isinstance(p, BlockPool):
            in_use = sum(1 for n in p.ref if n)
            assert in_use + p.num_free == p.num_ids - 1
        for key, bid in p.cached_items().items():
            assert p.key_of(bid) == key and a.pool[key[0]] is p
    assert actual == expected, "ref counts differ from what live requests hold"
    for (pid, b), hs in holders.items():
        assert len({g for _, g in hs}) == 1, f"id {b} held by two groups"
        if len({rid for rid, _ in hs}) > 1 or expected[(pid, b)] > 1:
            assert seen[pid].key_of(b) is not None, f"id {b} shared but not cached"
    for p in a._pools.values():
        if isinstance(p, TwoLevelPool):
            owned = [pg for v in p.views.values() for pg in v.pages]
            assert len(owned) == len(set(owned)), "a large page owned by two groups"
            assert not set(owned) & set(p._free_pages)
            for g, v in p.views.items():
                assert all(p.page_owner[pg] == g for pg in v.pages)
    index.apply(a.take_events())
    assert index.keys == a.cached_hashes()


class AllocMachine(RuleBasedStateMachine):
    model = "lfm2-350m"
    layout = "inflate"
    policy = "align"

    def __init__(self) -> None:
        super().__init__()
        self.plan = small_plan(self.model, self.layout)
        self.B = max(g.block_size for g in self.plan.groups)
        self.a = HybridAllocator(
            self.plan, checkpoint_policy=self.policy, max_model_len=6 * self.B
        )
        self.index = CacheIndex()
        self.prompts: list[list[int]] = []
        self.live: dict[int, int] = {}  # req -> prompt length
        self.next_id = 0

    @rule(
        data=st.data(),
        reuse=st.booleans(),
        blocks=st.integers(0, 3),
        extra=st.integers(1, 40),
    )
    def add(self, data, reuse, blocks, extra):
        if reuse and self.prompts:
            base = data.draw(st.sampled_from(self.prompts))
            cut = data.draw(st.sampled_from([len(base), min(len(base), blocks * self.B)]))
            prompt = base[:cut] + [7 + self.next_id % 5] * extra
        else:
            prompt = [self.next_id * 1000 + i for i in range(blocks * self.B + extra)]
        prompt = prompt[: 3 * self.B]
        before = ref_snapshot(self.a)
        rid = self.next_id
        self.next_id += 1
        try:
            hit = self.a.add_request(rid, prompt)
        except PoolExhausted:
            assert ref_snapshot(self.a) == before
            return
        assert hit.num_cached_tokens < len(prompt)
        for g in self.plan.groups:
            if hit.num_cached_tokens:
                assert hit.num_cached_tokens % g.block_size == 0
        self.prompts.append(prompt)
        self.live[rid] = len(prompt)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), to_boundary=st.booleans())
    def prefill(self, data, to_boundary):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        done, n = self.a.num_tokens(rid), self.live[rid]
        if done >= n:
            return
        target = min(n, (done // self.B + 1) * self.B) if to_boundary else n
        before = (ref_snapshot(self.a), self.a.block_ids(rid))
        if not self.a.allocate_slots(rid, target - done):
            assert (ref_snapshot(self.a), self.a.block_ids(rid)) == before
        else:
            assert self.a.num_tokens(rid) == target

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tok=st.integers(0, 3))
    def decode(self, data, tok):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        done, n = self.a.num_tokens(rid), self.live[rid]
        if done < n or done >= 6 * self.B - 1:
            return
        if self.a.reqs[rid].tokens.__len__() == done:
            self.a.append_tokens(rid, [tok])
        before = ref_snapshot(self.a)
        if not self.a.allocate_slots(rid, 1):
            assert ref_snapshot(self.a) == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.a.free(rid)
        del self.live[rid]
        self.a.take_state_copies()

    @invariant()
    def invariants(self):
        check_invariants(self.a, self.index)

    def teardown(self):
        for rid in list(self.live):
            self.a.free(rid)
        check_invariants(self.a, self.index)
        assert all(u == 0.0 for u in self.a.usage().values()), self.a.usage()


CASES = [(m, lay) for m in ("lfm2-350m", "qwen3.5-0.8b") for lay in LAYOUTS]


@pytest.mark.parametrize("model,layout", CASES)
@pytest.mark.parametrize("policy", ["align", "last"])
def test_state_machine(model, layout, policy):
    machine = type(
        f"M_{layout}_{policy}",
        (AllocMachine,),
        {"model": model, "layout": layout, "policy": policy},
    )
    machine.TestCase.settings = settings(
        max_examples=25,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    machine.TestCase().runTest()
