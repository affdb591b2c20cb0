"""Stateful property tests: random add / prefill / decode / commit / free / prefix reuse /
cache reset on small plans of every layout, checking the allocator's invariants after every step.

The plans are the smallest that fit three requests, grown by half, so pools run out (allocations
fail and must change nothing) and cached blocks get evicted all the time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv import models
from hybridkv.alloc import RECOVERY_POLICIES, CacheIndex, HybridAllocator, PoolExhausted
from hybridkv.alloc.check import check_consistency
from hybridkv.layouts import LAYOUTS, make_plan
from hybridkv.target import VllmTarget

MAX_SEQS = 3
MODELS = ("qwen3.5-0.8b", "nemotron-h-8b", "recurrentgemma-2b")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
#: configs planned in vLLM 0.33's cache formats (``inflate`` only), whose sparse-attention
#: indexers keep a per-request ring group beside the latents or K/V
VLLM_FORMAT_MODELS = ("qwen4_exp-qsa.json", "glm5_next-defaults.json")


@functools.cache
def small_plan(model: str, layout: str, slots: int):
    """The smallest plan for MAX_SEQS requests (their states and one token of KV), its budget
    grown by half. Sliding windows shrink to three blocks so that sequences of a few blocks
    leave the window. A config of :data:`VLLM_FORMAT_MODELS` is planned as vLLM 0.33 packs it,
    at vLLM's block size."""
    kw = dict(max_num_seqs=MAX_SEQS, state_slots_per_seq=slots, cache_state_slots=2)
    if model in VLLM_FORMAT_MODELS:
        m = models.from_hf_config(EXAMPLES / model)
        kw["target"] = VllmTarget(cache_formats="vllm")
    else:
        m = models.load(model)
        kw["block_size"] = 16
    smallest = make_plan(m, layout, fit_tokens=1, **kw)
    plan = make_plan(m, layout, memory=smallest.config.memory_bytes * 3 // 2, **kw)
    groups = tuple(
        dataclasses.replace(g, sliding_window=3 * g.block_size) if g.sliding_window else g
        for g in plan.groups
    )
    return dataclasses.replace(plan, groups=groups)


def snapshot(a: HybridAllocator) -> tuple:
    """Everything a failed allocation must leave as it was."""
    pools = []
    for p in {id(v): v for v in a.pool.values()}.values():
        pools.append((p.name, tuple(p.ref), tuple(sorted(p.cached_items().items()))))
    reqs = {rid: ([list(b) for b in r.blocks], r.num_alloc) for rid, r in a.reqs.items()}
    return tuple(pools), reqs


class AllocMachine(RuleBasedStateMachine):
    model = "qwen3.5-0.8b"
    layout = "inflate"
    policy = "align"
    slots = 2
    retention: int | None = 0  # align: in scheduler blocks (None: dense)
    export: int | None = None  # align: prefill_checkpoint_alignment (0: the block size)
    interval: int | None = None  # periodic / hash_boundary: checkpoint_interval

    def __init__(self) -> None:
        super().__init__()
        self.plan = small_plan(self.model, self.layout, self.slots)
        self.B = max(g.block_size for g in self.plan.groups)
        self.max_len = 5 * self.B
        S = math.lcm(*(g.block_size for g in self.plan.groups))
        self.a = HybridAllocator(
            self.plan,
            checkpoint_policy=self.policy,
            max_model_len=self.max_len,
            prefix_cache_retention_interval=None if self.retention is None else self.retention * S,
            prefill_checkpoint_alignment=(self.export or self.B)
            if self.export is not None
            else None,
            checkpoint_interval=self.interval,
        )
        self.index = CacheIndex()
        self.prompts: list[list[int]] = []
        self.live: dict[int, list[int]] = {}  # request -> all its tokens (prompt + generated)
        self.next_id = 0

    # ---- rules ------------------------------------------------------------------------------
    @rule(
        data=st.data(),
        reuse=st.booleans(),
        size=st.integers(1, 48),  # in 48ths of three blocks
        tail=st.integers(1, 40),
        # cut a reused prompt anywhere, at a unit, at a block, or extend all of it (a next turn)
        align=st.sampled_from([1, 16, 0, -1]),
    )
    def add(self, data, reuse, size, tail, align):
        self._admit(data, reuse, size, tail, align)

    def _admit(self, data, reuse: bool, size: int, tail: int, align: int) -> int | None:
        if reuse and self.prompts:
            base = data.draw(st.sampled_from(self.prompts))
            cut = len(base)
            if align >= 0:
                cut = data.draw(st.integers(0, len(base)))
                cut = cut // (align or self.B) * (align or self.B)
            prompt = base[:cut] + [7_000_000 + self.next_id * 1000 + i for i in range(tail)]
        else:
            prompt = [self.next_id * 100_000 + i for i in range(max(1, size * self.B // 16))]
        prompt = prompt[: 3 * self.B]
        rid = self.next_id
        self.next_id += 1
        before = snapshot(self.a)
        try:
            hit = self.a.add_request(rid, prompt)
        except PoolExhausted:
            assert snapshot(self.a) == before, "a failed add_request changed the allocator"
            return None
        L = hit.num_cached_tokens
        assert 0 <= L < len(prompt) and L % self.a.h == 0
        assert self.a.num_tokens(rid) == L
        # hit copies name our own fresh slots/blocks as destinations
        blocks = self.a.block_ids(rid)
        for gid, _, dst in hit.state_copies:
            assert blocks[gid][0] == dst
        for gid, _, dst, ntok in hit.kv_copies:
            assert dst in blocks[gid] and 0 < ntok < self.plan.groups[gid].block_size
        self.prompts.append(prompt)
        self.live[rid] = list(prompt)
        return rid

    @precondition(lambda self: self.live)
    @rule(
        data=st.data(),
        how=st.sampled_from(["all", "checkpoint", "random", "split"]),
        commit=st.booleans(),
    )
    def prefill(self, data, how, commit):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self._prefill(data, rid, how)
        if commit:
            self.commit()

    def _prefill(self, data, rid: int, how: str) -> None:
        done, n = self.a.num_tokens(rid), len(self.live[rid])
        if done >= n:
            return
        target = n
        if how == "checkpoint":
            nxt = self.a.next_checkpoint(rid)
            if nxt is not None:
                target = min(n, nxt)
        elif how == "random":
            target = data.draw(st.integers(done + 1, n))
        elif how == "split":  # what the scheduler may run of a random budget
            target = done + self.a.split_prefill(rid, data.draw(st.integers(1, n - done)), self.B)
            if target == done:
                return
        before = snapshot(self.a)
        if self.a.allocate_slots(rid, target - done):
            assert self.a.num_tokens(rid) == target
        else:
            # sliding-window releases may survive a failure; nothing else may
            if not any(g.sliding_window for g in self.plan.groups):
                assert snapshot(self.a) == before, "a failed allocate_slots changed something"
            assert self.a.num_tokens(rid) == done

    @precondition(lambda self: self.live)
    @rule(data=st.data(), steps=st.integers(1, 20), tok=st.integers(0, 3))
    def decode(self, data, steps, tok):
        """Decode steps of every running request whose prompt is done, one commit per step."""
        for _ in range(steps):
            for rid, toks in self.live.items():
                if self.a.num_tokens(rid) < len(toks) or len(toks) >= self.max_len:
                    continue
                toks.append(tok)
                self.a.append_tokens(rid, [tok])
                self.a.allocate_slots(rid, 1)
            self.commit()

    @rule(data=st.data(), reuse=st.booleans(), decode=st.integers(0, 40))
    def lifecycle(self, data, reuse, decode):
        """One whole request: admit, prefill in chunks (committing each), decode, free."""
        rid = self._admit(data, reuse, 1 + decode % 48, 1 + decode, (1, 16, 0, -1)[decode % 4])
        if rid is None:
            return
        for _ in range(4):
            self._prefill(data, rid, "checkpoint" if decode % 3 else "split")
            self.commit()
        toks = self.live[rid]
        for t in range(decode):
            if self.a.num_tokens(rid) < len(toks) or len(toks) >= self.max_len:
                break
            toks.append(t % 3)
            self.a.append_tokens(rid, [t % 3])
            if not self.a.allocate_slots(rid, 1):
                break
            self.commit()
        self.a.free(rid)
        self.prompts.append(self.live.pop(rid))  # a later turn may extend the conversation

    @rule()
    def commit(self):
        copies = self.a.take_state_copies()
        for gid, src, dst in copies:
            assert self.plan.groups[gid].is_state and src != dst and src and dst
        self.index.apply(self.a.take_events())

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.a.free(rid)
        self.prompts.append(self.live.pop(rid))  # a later turn may extend the conversation

    @precondition(lambda self: not self.live)
    @rule()
    def reset(self):
        assert self.a.reset_prefix_cache()
        assert not self.a.cached_hashes()

    # ---- invariants -------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        check_consistency(self.a)
        self.index.apply(self.a.take_events())
        assert self.index.errors == 0, "events stored a held unit or removed a missing one"
        assert self.index.parent == self.a.cached_units(), "replayed events differ from cache"

    def teardown(self):
        self.a.take_state_copies()
        for rid in list(self.live):
            self.a.free(rid)
        check_consistency(self.a)
        for p in {id(v): v for v in self.a.pool.values()}.values():
            assert not any(p.ref), f"{p.name} leaked ids after every request was freed"
        assert all(u == 0.0 for u in self.a.usage().values()), self.a.usage()


CASES = [
    (model, layout, policy, 0, None)
    for model in MODELS
    for layout in LAYOUTS
    for policy in ("align", "align_every_block", "last", "marconi")
]
# vLLM's align with dense or periodic retention and with exports from inside the prefill
# (alignment 1 as Mamba-2, or the block size as Gated DeltaNet under FlashInfer)
CASES += [
    (model, layout, "align", retention, export)
    for model, retention, export in (
        ("qwen3.5-0.8b", None, None),
        ("nemotron-h-8b", 2, 1),
        ("qwen3.5-0.8b", 0, 0),
    )
    for layout in LAYOUTS
]
# states inside prompts, exported (alignment 1) or with the prefill cut at them
CASES += [
    ("qwen3.5-0.8b", layout, policy, 0, export)
    for policy in RECOVERY_POLICIES
    for export in (None, 1)
    for layout in LAYOUTS
]


# vLLM-format plans: a ring group (one block per request, never cached) beside the rest
CASES += [
    (model, "inflate", policy, 0, None)
    for model in VLLM_FORMAT_MODELS
    for policy in ("align", "last", "marconi")
]


@pytest.mark.parametrize("model,layout,policy,retention,export", CASES)
def test_state_machine(model, layout, policy, retention, export):
    slots = 1 if (model, policy) == ("nemotron-h-8b", "align") else 2
    machine = type(
        f"M_{layout}_{policy}",
        (AllocMachine,),
        {
            "model": model,
            "layout": layout,
            "policy": policy,
            "slots": slots,
            "retention": retention,
            "export": export,
            "interval": 32 if policy in RECOVERY_POLICIES else None,
        },
    )
    machine.TestCase.settings = settings(
        max_examples=8,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    machine.TestCase().runTest()
