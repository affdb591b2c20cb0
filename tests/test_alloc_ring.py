"""The ring group kind (``hybridkv.alloc.groups.ring``): a sparse-attention indexer's ring of raw
keys in a vLLM-format plan (GLM-5-Next's tail ring, Qwen4-Exp's QSA ring) is one block per
request for its whole life, never hashed or cached, and takes no part in prefix hits, as vLLM
0.33's ``CircularBufferManager``. The allocator state machine runs these plans too
(``tests/test_alloc_state_machine.py``, whose consistency check asserts one ring block per
running request and no ring entry)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hybridkv import models, traces
from hybridkv.alloc import HybridAllocator
from hybridkv.alloc.check import check_consistency
from hybridkv.alloc.groups import RingManager, group_roles, manager_class
from hybridkv.layouts import make_plan
from hybridkv.sim import SimConfig, simulate
from hybridkv.target import VllmTarget

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CONFIGS = ("qwen4_exp-qsa.json", "glm5_next-defaults.json")


def _plan(name: str, memory: str = "24GiB", max_num_seqs: int = 8):
    model = models.from_hf_config(EXAMPLES / name)
    target = VllmTarget(cache_formats="vllm")
    return model, make_plan(
        model, "inflate", memory=memory, max_num_seqs=max_num_seqs, target=target
    )


@pytest.fixture(scope="module", params=CONFIGS)
def vllm_plan(request):
    return _plan(request.param)[1]


def _ring(plan) -> int:
    (ring,) = (g.group_id for g in plan.groups if g.kind == "indexer_ring")
    return ring


def test_roles_of_a_vllm_format_plan(vllm_plan):
    """The ring is scratch: no chain, no hit rule, no state; the latents or K/V are the group a
    hit needs whole, as in vLLM's hit search (which leaves out groups that are not
    prefix-cacheable)."""
    ring = _ring(vllm_plan)
    assert manager_class(vllm_plan.groups[ring]) is RingManager
    roles = group_roles(vllm_plan.groups)
    assert roles.scratch == (ring,)
    assert ring not in roles.chain_ids and ring not in roles.state
    kv = [g.group_id for g in vllm_plan.groups if g.kind in ("mla", "full_attention")]
    assert roles.full_ids == kv
    assert sorted(roles.state) == [g.group_id for g in vllm_plan.state_groups]


def _prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 50_000, size=n).tolist()


@pytest.mark.parametrize("policy", ["align", "last", "marconi"])
def test_a_ring_is_one_block_per_request_never_cached(vllm_plan, policy):
    """Admission gives every request one ring block (a prefix hit too: its ring is fresh), the
    block stays one however long the request grows, commits cache none of it, the second
    request's hit is served by the other groups, and every id comes back at free."""
    ring, B = _ring(vllm_plan), vllm_plan.block_size
    a = HybridAllocator(vllm_plan, checkpoint_policy=policy)
    rng = np.random.default_rng(0)
    prompt = _prompt(rng, 3 * B + 7)
    a.add_request("a", prompt)
    assert a.allocate_slots("a", len(prompt))
    a.take_state_copies()
    tokens = list(prompt)
    for _ in range(B + 3):  # a block's worth of decode
        assert a.allocate_slots("a", 1)
        tokens.append(int(rng.integers(0, 50_000)))
        a.append_tokens("a", tokens[-1:])
        a.take_state_copies()
    (first,) = a.block_ids("a")[ring]
    assert first != 0
    assert not any(key[0] == ring for key in a.index.entries)
    check_consistency(a)
    a.free("a")
    # the conversation's next turns: the hit comes from the other groups, at their blocks
    hit = a.add_request("b", tokens + _prompt(rng, B))
    assert hit.num_cached_tokens > 0 and hit.num_cached_tokens % B == 0
    assert len(a.block_ids("b")[ring]) == 1
    hit_c = a.add_request("c", tokens + _prompt(rng, 2 * B))
    assert hit_c.num_cached_tokens == hit.num_cached_tokens
    assert a.block_ids("c")[ring] != a.block_ids("b")[ring]  # each request its own ring
    check_consistency(a)
    a.free("b")
    a.free("c")
    check_consistency(a)
    assert not any(any(ids.ref) for ids in a.pool.values()), "an id is still held"


def test_a_preempted_request_gets_a_fresh_ring(vllm_plan):
    """A request freed mid-prefill (preempted) and admitted again holds one ring block again,
    and the pool lends no more ids than running requests and the cache hold."""
    ring, B = _ring(vllm_plan), vllm_plan.block_size
    a = HybridAllocator(vllm_plan)
    prompt = _prompt(np.random.default_rng(1), 2 * B + 1)
    a.add_request("r", prompt)
    assert a.allocate_slots("r", B)
    a.take_state_copies()
    a.free("r")
    a.add_request("r", prompt)
    assert len(a.block_ids("r")[ring]) == 1
    check_consistency(a)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("policy", ["align", "last", "marconi"])
def test_vllm_format_plans_simulate(name, policy):
    """The simulator runs both families in vLLM 0.33's formats: every request finishes, hits
    are served, and no byte breakdown finds cached data no hit can use."""
    model, plan = _plan(name, memory="40GiB", max_num_seqs=16)
    trace = traces.multi_turn_chat(40, seed=3)
    r = simulate(plan, model, trace, SimConfig(checkpoint_policy=policy))
    assert r.finished == 40
    assert r.hit_tokens > 0
    assert all(b.unreachable == 0 for b in r.breakdown)


def test_a_ring_does_not_turn_off_hits_inside_a_block(vllm_plan):
    """vLLM 0.33 asks only prefix-cacheable groups whether they look hashes up inside a block
    (``partial_hash_hits_enabled``), so a ring, whose 4 or 16-token blocks hold no hashes,
    leaves hits at the hash unit on: a request sharing a prompt up to inside a block hits
    there, not at the block boundary before it."""
    B, h = vllm_plan.block_size, 16
    a = HybridAllocator(vllm_plan, hash_block_size=h)
    assert a.policy.vllm.partial
    rng = np.random.default_rng(2)
    prompt = _prompt(rng, 2 * B + 5 * h + 3)
    a.add_request("a", prompt)
    done = 0
    while done < len(prompt):  # in the chunks the policy cuts (states kept where they end)
        n = a.prefill_chunk("a", len(prompt) - done)
        assert n > 0 and a.allocate_slots("a", n)
        a.take_state_copies()
        done += n
    a.free("a")
    hit = a.add_request("b", prompt[: 2 * B + 5 * h] + _prompt(rng, B))
    assert hit.num_cached_tokens > 2 * B  # inside the third block
    assert hit.num_cached_tokens % h == 0


def test_the_engine_refuses_vllm_format_plans(vllm_plan):
    """The allocator serves these plans now, so the engine says itself that its kernels read
    transformers' formats, not vLLM's packed pages (the allocator's refusal of the rings
    stopped them before)."""
    from hybridkv.e2e.states import Unservable, check_wired

    with pytest.raises(Unservable, match="cache formats packed block-outermost"):
        check_wired(vllm_plan)


def test_memory_samples_count_a_ring_per_request_not_as_kv(vllm_plan):
    """ids_in_use (the simulator's memory samples): a ring group counts its requests' one block
    each, and the latents or K/V group every other non-free id that is not a state's (before,
    the first non-state group, a ring in Qwen4-Exp's plan, got them all, at a ring's bytes)."""
    ring, B = _ring(vllm_plan), vllm_plan.block_size
    a = HybridAllocator(vllm_plan, checkpoint_policy="last")
    rng = np.random.default_rng(1)
    for rid, n in (("a", 3 * B + 5), ("b", 2 * B)):
        prompt = _prompt(rng, n)
        a.add_request(rid, prompt)
        assert a.allocate_slots(rid, len(prompt))
    a.take_state_copies()
    count = a.ids_in_use()
    assert count[ring] == 2
    (kv,) = [g.group_id for g in vllm_plan.groups if g.kind in ("mla", "full_attention")]
    held_kv = {b for rid in ("a", "b") for b in a.block_ids(rid)[kv] if b}
    assert count[kv] == len(held_kv) == 4 + 2
