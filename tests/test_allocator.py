"""The allocator: hit rules, errors, events, and invariants under random workloads."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv import models
from hybridkv.allocator import (
    CacheIndex,
    DoubleFree,
    HybridAllocator,
    MaxLengthExceeded,
    PoolExhausted,
    UnknownRequest,
)
from hybridkv.allocator.events import decode, encode
from hybridkv.layouts import LAYOUTS, make_plan


def _plan(layout: str, name: str = "qwen3.5-0.8b", blocks: int = 40, seqs: int = 4, **kw):
    model = models.load(name, kv_dtype="fp8")
    probe = make_plan(model, layout, memory=1 << 50, max_num_seqs=seqs, block_size=16, **kw)
    unit = max(p.block_bytes for p in probe.pools)
    memory = probe.capacity.state_reserved_bytes + 2 * unit
    memory += blocks * probe.block_size * model.kv_bytes_per_token
    return make_plan(model, layout, memory=memory, max_num_seqs=seqs, block_size=16, **kw)


def test_shared_prefix_hits_whole_blocks_and_copies_the_checkpoint():
    plan = _plan("per_group")
    alloc = HybridAllocator(plan, hash_block_size=16)
    prompt = list(range(100))
    assert alloc.add_request("a", prompt).num_cached_tokens == 0
    assert alloc.allocate_slots("a", 96)  # prefill up to a block boundary: checkpoint at 96
    copies = alloc.take_state_copies()
    assert [c[0] for c in copies] == [g.group_id for g in plan.state_groups]
    assert alloc.allocate_slots("a", 4)
    hit = alloc.add_request("b", [*prompt[:96], 7, 7, 7])
    assert hit.num_cached_tokens == 96
    # the state resumes from a copy of the checkpoint into b's own running block
    (group, src, dst), *_ = hit.state_copies
    assert src == copies[0][2] and dst == alloc.block_ids("b")[group][0]
    attn = plan.attention_groups[0].group_id
    assert alloc.block_ids("b")[attn] == alloc.block_ids("a")[attn][:6]
    alloc.check()


def test_align_mode_cannot_hit_inside_a_large_block():
    """With vLLM's inflated blocks (Qwen3.5-0.8B fp8: hundreds of tokens) a 300-token shared
    prefix shorter than a block never hits: no checkpoint exists inside a block."""
    plan = _plan("inflate", blocks=8)
    block = plan.block_size
    assert block > 300
    alloc = HybridAllocator(plan, hash_block_size=16)
    prompt = list(range(block + 20))
    alloc.add_request("a", prompt)
    assert alloc.allocate_slots("a", 300) and alloc.allocate_slots("a", block - 300)
    assert alloc.allocate_slots("a", 20)
    assert alloc.add_request("b", prompt[:300] + [1] * 10).num_cached_tokens == 0
    assert alloc.add_request("c", [*prompt[:block], 2]).num_cached_tokens == block


def test_last_policy_only_checkpoints_the_prompt_end():
    plan = _plan("per_group")
    alloc = HybridAllocator(plan, checkpoint_policy="last")
    prompt = list(range(70))
    alloc.add_request("a", prompt)
    assert alloc.allocate_slots("a", 32)
    assert alloc.take_state_copies() == []  # 32 is not the prompt's last boundary (64)
    assert alloc.allocate_slots("a", 32)
    assert len(alloc.take_state_copies()) == len(plan.state_groups)
    assert alloc.add_request("b", [*prompt[:40], 1]).num_cached_tokens == 0
    assert alloc.add_request("c", [*prompt, 1]).num_cached_tokens == 64


def test_sliding_window_releases_blocks():
    plan = _plan("per_group", name="recurrentgemma-2b", blocks=400)
    alloc = HybridAllocator(plan, enable_prefix_caching=False)
    window = plan.attention_groups[0].sliding_window
    alloc.add_request("a", list(range(window + 200)))
    assert alloc.allocate_slots("a", window + 200)
    blocks = alloc.block_ids("a")[plan.attention_groups[0].group_id]
    assert blocks[:10] == [0] * 10 and all(blocks[-5:])
    alloc.free("a")
    alloc.check()


def test_errors_and_exhaustion():
    plan = _plan("inflate", blocks=6)
    too_many = plan.pools[0].num_blocks * plan.block_size  # more than the whole pool holds
    alloc = HybridAllocator(plan, max_model_len=too_many + 100)
    with pytest.raises(UnknownRequest):
        alloc.free("nope")
    alloc.add_request("a", list(range(50)))
    before = alloc.block_ids("a")
    alloc.append_tokens("a", list(range(too_many - 50)))
    assert not alloc.allocate_slots("a", too_many)  # exhausted: nothing changed
    assert alloc.block_ids("a") == before and alloc.num_computed("a") == 0
    with pytest.raises(MaxLengthExceeded, match="max_model_len"):
        alloc.append_tokens("a", [1] * 200)
    alloc.free("a")
    with pytest.raises(DoubleFree):
        alloc.free("a")
    for i in range(4):
        alloc.add_request(i, [1, 2, 3])
    with pytest.raises(PoolExhausted, match="preempt"):
        for i in range(4, 100):
            alloc.add_request(i, [1, 2, 3])
    alloc.check()


def test_events_round_trip_and_rebuild_the_index():
    plan = _plan("two_level")
    alloc = HybridAllocator(plan)
    index = CacheIndex()
    for r in range(6):
        alloc.add_request(r, list(range(r * 7, r * 7 + 90)))
        assert alloc.allocate_slots(r, 90)
        index.apply(decode(encode(alloc.take_events())))
        if r % 2:
            alloc.free(r)
    assert index.keys == alloc.cached_keys() and index.keys


def test_events_at_hash_granularity_for_a_large_block():
    """Seed 003: a physical block of B tokens emits B / 16 chained hashes, once."""
    plan = _plan("inflate", blocks=4)
    alloc = HybridAllocator(plan, hash_block_size=16)
    alloc.add_request("a", list(range(plan.block_size + 5)))
    assert alloc.allocate_slots("a", plan.block_size + 5)
    stored = [e for e in alloc.take_events().events if e.group_idx == 0]
    (event,) = stored
    assert len(event.block_hashes) == plan.block_size // 16
    assert event.parent_block_hash is None and len(event.token_ids) == plan.block_size


class AllocatorMachine(RuleBasedStateMachine):
    layout = "inflate"

    def __init__(self):
        super().__init__()
        self.alloc = HybridAllocator(_plan(self.layout, blocks=24), max_model_len=2000)
        self.index = CacheIndex()
        self.prompts: list[list[int]] = []
        self.next_id = 0

    @rule(length=st.integers(1, 120), reuse=st.booleans(), cut=st.integers(0, 200))
    def add(self, length, reuse, cut):
        prompt = list(range(self.next_id * 1000, self.next_id * 1000 + length))
        if reuse and self.prompts:
            base = self.prompts[cut % len(self.prompts)]
            prompt = base[: cut % (len(base) + 1)] + prompt
        try:
            self.alloc.add_request(self.next_id, prompt)
            self.prompts.append(prompt)
        except PoolExhausted:
            pass
        self.next_id += 1

    @precondition(lambda self: self.alloc.requests)
    @rule(pick=st.integers(0, 10**6), n=st.integers(1, 40))
    def step(self, pick, n):
        rid = sorted(self.alloc.requests)[pick % len(self.alloc.requests)]
        known = len(self.alloc.requests[rid].tokens) - self.alloc.num_computed(rid)
        if known == 0:
            self.alloc.append_tokens(rid, [rid] * 1)
            known = 1
        self.alloc.allocate_slots(rid, min(n, known))
        self.alloc.take_state_copies()

    @precondition(lambda self: self.alloc.requests)
    @rule(pick=st.integers(0, 10**6))
    def free(self, pick):
        rid = sorted(self.alloc.requests)[pick % len(self.alloc.requests)]
        self.alloc.free(rid)

    @invariant()
    def consistent(self):
        self.alloc.check()
        self.index.apply(decode(encode(self.alloc.take_events())))
        assert self.index.keys == self.alloc.cached_keys()

    def teardown(self):
        for rid in list(self.alloc.requests):
            self.alloc.free(rid)
        self.alloc.check()
        for pool in self.alloc.pools.values():  # nothing held after every request freed
            subpools = pool.pools.values() if hasattr(pool, "free_pages") else [pool]
            assert all(not p.ref for p in subpools)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_random_workloads_keep_invariants(layout):
    machine = type(f"Machine_{layout}", (AllocatorMachine,), {"layout": layout})
    machine.TestCase.settings = settings(
        max_examples=15,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    machine.TestCase().runTest()
