"""The ``align`` policy follows vLLM 0.33's ``mamba_cache_mode="align"`` (the rules are listed in
:class:`hybridkv.alloc.policies.VllmAlign`); ``align_every_block`` keeps the every-boundary
caching as a bound.

Every expected number is derived from the plan's block sizes (``plan.block_size`` and the state
groups'), never written down, since the block-size rules change with the vLLM release.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from hybridkv import models, traces
from hybridkv.alloc import ConfigError, HybridAllocator
from hybridkv.alloc.check import check_consistency
from hybridkv.alloc.policies import ALL_POLICIES, POLICIES, CheckpointPolicy
from hybridkv.layouts import VllmTarget, make_plan
from hybridkv.sim import SimConfig, simulate
from hybridkv.traces import Request, Trace

SHARED = 1024  # the shared prefix


def pos(num_tokens: int, unit: int) -> int:
    """vLLM's ``get_mamba_prefill_checkpoint_position`` without MTP: one token recomputed."""
    return max(0, (num_tokens - 1) // unit * unit)


@functools.cache
def gdn():
    """The issue's setting: Qwen3.5-4B (Gated DeltaNet + attention), vLLM's shared-pool layout
    on 8 GiB (16 sequences: 256 do not fit 8 GiB)."""
    model = models.load("qwen3.5-4b")
    return model, make_plan(model, "inflate", memory="8GiB", max_num_seqs=16)


def _block(plan) -> int:
    """The state groups' block size: where align keeps states."""
    return math.lcm(*(g.block_size for g in plan.state_groups))


def _alloc(plan, h=16, **kw) -> HybridAllocator:
    """An allocator whose prefill exports no checkpoints unless a test asks (``auto`` would
    take the plan's vLLM target: FlashInfer's GDN prefill on Hopper exports them)."""
    kw.setdefault("prefill_checkpoint_alignment", None)
    return HybridAllocator(plan, hash_block_size=h, max_model_len=1 << 16, **kw)


def _commit(a: HybridAllocator) -> list:
    copies = a.take_state_copies()
    check_consistency(a)
    return copies


def _prefill(a: HybridAllocator, rid, tokens, budget: int | None = None) -> list[int]:
    """Admit and prefill ``tokens`` as vLLM's scheduler would: each step offers what the budget
    allows and runs what ``split_prefill`` gives; returns the chunk ends."""
    a.add_request(rid, tokens)
    ends = []
    while a.num_tokens(rid) < len(tokens):
        rest = len(tokens) - a.num_tokens(rid)
        n = a.split_prefill(rid, rest if budget is None else min(rest, budget), budget)
        assert n > 0 and a.allocate_slots(rid, n)
        _commit(a)
        ends.append(a.num_tokens(rid))
    return ends


def _sharers(first_len: int, n: int, other_len: int = SHARED + 100) -> Trace:
    """``n`` requests that share the first ``SHARED`` tokens; the first is ``first_len`` long,
    the others ``other_len``. Each arrives long after the previous one finished."""
    shared = np.arange(1, SHARED + 1)
    reqs = []
    for i in range(n):
        extra = (first_len if i == 0 else other_len) - SHARED
        tail = np.arange(100_000 * (i + 1), 100_000 * (i + 1) + extra)
        reqs.append(Request(i, 100.0 * i, np.concatenate([shared, tail]), 4))
    return Trace("sharers", tuple(reqs))


def _hits(policy: str, first_len: int, n: int, h: int | None = None, **kw) -> int:
    """Prompt tokens the ``n`` sharers hit in all; the later ones are as long as the first."""
    model, plan = gdn()
    config = SimConfig(checkpoint_policy=policy, hash_block_size=h or 16, **kw)
    return simulate(plan, model, _sharers(first_len, n, first_len), config).hit_tokens


# ---- the measurement -----------------------------------------------------------------
@pytest.mark.parametrize("unit", ["16", "block"])
def test_second_sharer_of_a_1024_token_prefix(unit):
    """The prompts are long: vLLM runs the first in one chunk to its last cacheable block
    boundary, beyond the shared prefix, and keeps only that state (and, with 16-token hash units,
    the prompt's last hash boundary), so the second sharer hits nothing. ``align_every_block``
    ends a prefill chunk at every block multiple and keeps each of those states, so the second
    sharer hits the last block boundary inside the prefix, whatever the token budget."""
    _, plan = gdn()
    B = _block(plan)
    h = 16 if unit == "16" else B
    first = SHARED + 2 * B
    assert pos(first, B) > SHARED  # the replay boundary is past the shared prefix
    assert _hits("align", first, 2, h) == 0
    assert _hits("align_every_block", first, 2, h) == SHARED // B * B
    one_block = {"max_num_batched_tokens": B}
    assert _hits("align_every_block", first, 2, h, **one_block) == SHARED // B * B
    # the second sharer found the shared prefix cached by attention only (a junction): it cut
    # its prefill at the junction's block boundary and kept that state (its own last cacheable
    # boundary is past the prefix), so the third hits it
    assert _hits("align", first, 3, h) == SHARED // B * B
    # it needs no junction: every sharer hits the prefix's last block boundary
    assert _hits("align_every_block", first, 3, h) == 2 * (SHARED // B * B)


@pytest.mark.parametrize("unit", ["16", "block"])
def test_second_sharer_hits_when_the_first_prompt_ends_just_past_the_prefix(unit):
    """vLLM keeps the state at the first prompt's last cacheable block boundary
    (``pos(len, B)``) and, with 16-token hash units, at its last hash boundary
    (``pos(len, 16)``); when the first prompt ends just past the shared prefix, both lie inside
    it and the second sharer hits the longest of them."""
    model, plan = gdn()
    B = _block(plan)
    h = 16 if unit == "16" else B
    first = SHARED + 1
    assert pos(first, B) == SHARED // B * B and pos(first, 16) == SHARED
    config = SimConfig(hash_block_size=h)
    assert simulate(plan, model, _sharers(first, 2), config).hit_tokens == pos(first, h)


def test_chunks_cut_by_the_budget_keep_no_state_with_retention_0():
    """A budget of one block cuts the first prompt at every block boundary: vLLM keeps none of
    those states but the replay boundary's (retention interval 0, its default); a retention
    interval of ``None`` keeps them all, which is what hybridkv's ``align`` did before."""
    _, plan = gdn()
    B = _block(plan)
    first = SHARED + 2 * B
    kw = {"max_num_batched_tokens": B}
    assert _hits("align", first, 2, **kw) == 0
    assert _hits("align", first, 2, prefix_cache_retention_interval=None, **kw) == SHARED // B * B
    assert _hits("align_every_block", first, 2, **kw) == SHARED // B * B


# ---- chunk ends --------------------------------------------------------------------------------
def test_one_chunk_to_the_last_cacheable_boundary():
    _, plan = gdn()
    B = _block(plan)
    n = SHARED + 2 * B + 37
    # hash unit = block (vLLM's default prefix_match_unit): one chunk to pos(n, B), then the rest
    a = _alloc(plan, h=B)
    assert _prefill(a, "a", list(range(n))) == [pos(n, B), n]
    a.free("a")
    assert a.find_longest_cache_hit([*range(n), 1]) == pos(n, B)
    assert a.find_longest_cache_hit([*range(pos(n, B) - 1), 1, 2]) == 0  # no earlier state
    # 16-token hash units: hits inside a block, so it also stops at the prompt's last hash
    # boundary, whose state (and the attention block up to it) is kept too
    a = _alloc(plan, h=16)
    assert _prefill(a, "a", list(range(n))) == [pos(n, B), pos(n, 16), n]
    a.free("a")
    assert a.find_longest_cache_hit([*range(n), 1]) == pos(n, 16)
    assert a.find_longest_cache_hit([*range(pos(n, 16) - 1), 1, 2]) == pos(n, B)


def test_a_chunk_the_budget_cuts_ends_on_a_block_boundary():
    _, plan = gdn()
    B = _block(plan)
    a = _alloc(plan)
    a.add_request("a", list(range(4 * B)))
    assert a.split_prefill("a", B + 10, 8192) == B
    assert a.split_prefill("a", B - 10, 8192) == 0  # nothing fits: wait for a fuller budget
    # a block wider than the step limit advances by sub-block chunks, re-aligning at the next
    # block boundary
    assert a.split_prefill("a", 100, 100) == 100
    assert a.allocate_slots("a", 100)
    _commit(a)
    assert a.split_prefill("a", 2 * B, 2 * B) == B - 100
    a.free("a")


def test_prefill_exports_replace_the_split():
    """Layers whose prefill exports the checkpoint (Mamba-2; Gated DeltaNet under FlashInfer in
    vLLM 0.33, on the block grid) run the prompt in one chunk; the state is the same."""
    _, plan = gdn()
    B = _block(plan)
    n = SHARED + 2 * B + 37
    a = _alloc(plan, h=B, prefill_checkpoint_alignment=B)
    a.add_request("a", list(range(n)))
    assert a.split_prefill("a", n) == n
    assert a.allocate_slots("a", n)
    copies = _commit(a)
    assert copies == []  # nothing at the chunk's end ...
    exports = a.last_exports  # ... the state at pos(n, B), exported from inside the forward
    assert {g for g, _, _ in exports} == {g.group_id for g in plan.state_groups}
    assert {p for _, _, p in exports} == {pos(n, B)}
    a.free("a")
    hit = a.add_request("b", [*range(n), 1])
    assert hit.num_cached_tokens == pos(n, B)
    assert sorted(src for _, src, _ in hit.state_copies) == sorted(s for _, s, _ in exports)
    a.free("b")
    check_consistency(a)


@pytest.mark.parametrize("tail_on_grid", [True, False])
def test_exports_on_a_finer_grid(tail_on_grid):
    """With 16-token hash units the export grid is lcm(16, 64) = 64 (FlashInfer's GDN): a prompt
    whose last hash boundary is on that grid runs in one chunk and keeps only that state;
    otherwise the prefill is split as without exports."""
    _, plan = gdn()
    B = _block(plan)
    n = SHARED + 2 * B + (1 if tail_on_grid else 17)
    assert (pos(n, 16) % 64 == 0) == tail_on_grid
    a = _alloc(plan, h=16, prefill_checkpoint_alignment=64)
    ends = _prefill(a, "a", list(range(n)))
    a.free("a")
    if tail_on_grid:
        assert ends == [n]
        assert a.find_longest_cache_hit([*range(n), 1]) == pos(n, 16)
        assert a.find_longest_cache_hit([*range(pos(n, B)), 1, 2]) == 0
    else:
        assert ends == [pos(n, B), pos(n, 16), n]
        assert a.find_longest_cache_hit([*range(pos(n, B)), 1, 2]) == pos(n, B)


def test_prefill_exports_save_a_step_in_the_simulator():
    """The prompt runs in one forward instead of two."""
    model, plan = gdn()
    B = _block(plan)
    trace = _sharers(SHARED + 2 * B + 37, 1)
    split = simulate(
        plan, model, trace, SimConfig(hash_block_size=B, prefill_checkpoint_alignment=None)
    )
    export = simulate(
        plan, model, trace, SimConfig(hash_block_size=B, prefill_checkpoint_alignment=B)
    )
    assert export.steps == split.steps - 1
    assert export.hit_tokens == split.hit_tokens == 0


# ---- junctions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("unit", ["16", "block"])
def test_junction_checkpoint(unit):
    _, plan = gdn()
    B = _block(plan)
    h = 16 if unit == "16" else B
    a = _alloc(plan, h=h)
    shared = list(range(SHARED))
    _prefill(a, "a", shared + [7] * (2 * B))
    a.free("a")
    # b shares the prefix; attention hits it, states do not: b's junction. b's own last
    # cacheable block boundary is past the prefix, so only the junction keeps a state in it.
    b = shared + [8] * (2 * B)
    assert pos(len(b), B) > SHARED
    assert a.add_request("b", b).num_cached_tokens == 0
    J = a.junction("b")
    assert J // B * B == SHARED // B * B > 0 and J <= SHARED
    ends = []
    while a.num_tokens("b") < len(b):
        assert a.allocate_slots("b", a.split_prefill("b", len(b) - a.num_tokens("b")))
        copies = _commit(a)
        ends.append((a.num_tokens("b"), bool(copies)))
    assert ends[0] == (SHARED // B * B, True)  # cut and kept at the junction's block boundary
    a.free("b")
    hit = a.add_request("c", shared + [9] * 50)
    assert hit.num_cached_tokens == SHARED // B * B
    a.free("c")


@pytest.mark.parametrize(("points", "junction"), [("units", 1), ("keys", 0)])
def test_a_junction_inside_the_first_block_cuts_nothing(points, junction):
    """A prefix shared inside the first (full) block: on hybridkv's units attention finds it
    and it is the junction; on vLLM's keys the block is keyed at its end only, so attention
    finds nothing there and there is no junction. Either way no block boundary lies below it
    to keep, and the first chunk runs to pos(len, B)."""
    _, plan = gdn()
    B = _block(plan)
    a = _alloc(plan, partial_hit_points=points)
    shared = list(range(B // 2))
    _prefill(a, "a", shared + [7] * (2 * B))
    a.free("a")
    b = shared + [8] * (2 * B)
    assert a.add_request("b", b).num_cached_tokens == 0
    assert a.junction("b") == junction * B // 2
    assert a.split_prefill("b", len(b)) == pos(len(b), B)
    a.free("b")


# ---- retention interval, decode ----------------------------------------------------------------
@pytest.mark.parametrize("retention", [0, 2, None])
def test_retention_interval(retention):
    """Chunks of one block each (a budget of ``B``): which chunk ends keep their state."""
    _, plan = gdn()
    B = _block(plan)
    S = math.lcm(*(g.block_size for g in plan.groups))
    R = None if retention is None else retention * S
    a = _alloc(plan, h=B, prefix_cache_retention_interval=R)
    n = 5 * B + 10
    prompt = list(range(n))
    assert _prefill(a, "a", prompt, budget=B) == [B, 2 * B, 3 * B, 4 * B, 5 * B, n]
    a.free("a")
    got = [a.find_longest_cache_hit([*prompt[: k * B], 1]) for k in range(1, 6)]
    keep = {  # the replay boundary 5B always; R = 2S adds the multiples of 2B; None all
        0: [0, 0, 0, 0, 5 * B],
        2: [0, 2 * B, 2 * B, 4 * B, 5 * B],
        None: [B, 2 * B, 3 * B, 4 * B, 5 * B],
    }[retention]
    assert got == keep


def test_retention_interval_must_be_a_multiple_of_the_scheduler_block():
    _, plan = gdn()
    S = math.lcm(*(g.block_size for g in plan.groups))
    with pytest.raises(ConfigError, match="retention"):
        _alloc(plan, prefix_cache_retention_interval=S + 16)
    with pytest.raises(ConfigError, match="prefill_checkpoint_alignment"):
        _alloc(plan, prefill_checkpoint_alignment=0)


@pytest.mark.parametrize(
    "policy,retention,kept",
    [("align", 0, False), ("align", None, True), ("align_every_block", 0, True)],
)
def test_decode_block_boundaries(policy, retention, kept):
    """vLLM keeps no state of a decode step (retention 0): a next turn hits the prompt's
    boundary, not the one decode crossed."""
    _, plan = gdn()
    B = _block(plan)
    a = _alloc(plan, h=B, checkpoint_policy=policy, prefix_cache_retention_interval=retention)
    prompt = list(range(B + 10))
    _prefill(a, "a", prompt)
    out = []
    while a.num_tokens("a") < 2 * B:
        out.append(len(out) % 7)
        a.append_tokens("a", out[-1:])
        assert a.allocate_slots("a", 1)
        _commit(a)
    a.free("a")
    hit = a.find_longest_cache_hit(prompt + out + [3])
    assert hit == (2 * B if kept else B)


# ---- the other policies -------------------------------------------------------------------------
def test_policy_names():
    assert POLICIES == ("align", "last", "marconi")  # what advise compares
    assert set(ALL_POLICIES) == {
        *POLICIES,
        "periodic",
        "hash_boundary",
        "hash_ladder",
        "align_every_block",
    }
    _, plan = gdn()
    B = _block(plan)
    assert CheckpointPolicy("align", plan, 16).vllm.partial
    assert not CheckpointPolicy("align", plan, B).vllm.partial
    for name in ("align_every_block", "last", "marconi"):
        assert CheckpointPolicy(name, plan, 16).vllm is None


def test_last_and_marconi_ignore_the_align_options():
    """``last`` and ``marconi`` chunk and checkpoint as before: the align options change
    nothing, and ``split_prefill`` cuts nothing for them."""
    model = models.load("qwen3.5-0.8b")
    plan = make_plan(model, "per_group", memory="1GiB", max_num_seqs=8, block_size=16)
    trace = traces.multi_turn_chat(30, seed=3)
    for policy in ("last", "marconi"):
        base = simulate(plan, model, trace, SimConfig(checkpoint_policy=policy))
        other = simulate(
            plan,
            model,
            trace,
            SimConfig(
                checkpoint_policy=policy,
                prefix_cache_retention_interval=None,
                prefill_checkpoint_alignment=1,
            ),
        )
        assert base.summary() == other.summary() and base.steps == other.steps
        a = HybridAllocator(plan, checkpoint_policy=policy)
        a.add_request("a", list(range(100)))
        assert a.split_prefill("a", 100) == 100


def test_the_prompts_partial_attention_tail_grows_into_a_full_block():
    """With 16-token hash units the attention block holding the prompt's last hash boundary is
    cached up to it (a later request hits it and copies those tokens); once decode fills the
    block, the entry becomes the whole block, keyed at its end only, and the events say so."""
    from hybridkv.alloc import CacheIndex

    _, plan = gdn()
    B = _block(plan)
    attn = next(g.group_id for g in plan.groups if not g.is_state)
    a = _alloc(plan)
    index = CacheIndex()
    n = 2 * B + 37
    prompt = list(range(n))
    _prefill(a, "a", prompt)
    index.apply(a.take_events())
    tail = pos(n, 16)
    units = a.reqs["a"].hashes
    block = a.block_ids("a")[attn][2]  # tokens 2B .. 3B, the prompt ends inside it
    assert a.pool[attn].key_of(block) == (attn, units[tail // 16 - 1])
    out = []
    while a.num_tokens("a") < 3 * B:
        out.append(5)
        a.append_tokens("a", [5])
        assert a.allocate_slots("a", 1)
        _commit(a)
        index.apply(a.take_events())
    units = a.reqs["a"].hashes
    assert a.pool[attn].key_of(block) == (attn, units[3 * B // 16 - 1])  # the whole block now
    assert index.errors == 0 and index.parent == a.cached_units()
    a.free("a")
    # the full block is keyed at its end only (vLLM's promotion removes the tail's partial key),
    # so the prompt's tail state is no longer reached: the resend hits the two blocks before
    hit = a.add_request("b", [*prompt, 9])
    assert tail > 2 * B and hit.num_cached_tokens == 2 * B and not hit.kv_copies
    a.free("b")
    check_consistency(a)


@pytest.mark.parametrize(
    "name, target, expected",
    [
        # Qwen's GDN under FlashInfer (vLLM 0.33 on Hopper): the block grid
        pytest.param("qwen3.5-0.8b", VllmTarget(), "block", id="qwen-gdn-hopper-block"),
        # Ampere runs the Triton GDN prefill, vLLM 0.32's GDN exports nothing: split
        pytest.param("qwen3.5-0.8b", VllmTarget(gpu="ampere"), None, id="qwen-gdn-ampere-split"),
        pytest.param("qwen3.5-0.8b", VllmTarget(version="0.32"), None, id="qwen-gdn-0.32-split"),
        # Mamba-2 exports at any token, in both versions
        pytest.param("nemotron-h-8b", VllmTarget(), 1, id="mamba2-any-token"),
        pytest.param("nemotron-h-8b", VllmTarget(version="0.32"), 1, id="mamba2-0.32"),
        # short convolutions export nothing
        pytest.param("lfm2-1.2b", VllmTarget(), None, id="short-conv-split"),
    ],
)
def test_auto_prefill_exports_follow_the_vllm_target(name, target, expected):
    model = models.load(name)
    plan = make_plan(model, "inflate", memory="80GiB", max_num_seqs=8, target=target)
    B = _block(plan)
    a = HybridAllocator(plan, hash_block_size=B, max_model_len=1 << 16)
    want = B if expected == "block" else expected
    assert a.policy.vllm.export == want


def test_align_every_block_prefill_ends_at_every_block():
    """``align_every_block`` ends prefill chunks at every multiple of the state block, as its
    policy defines (the scheduler and replay ask the allocator, :meth:`prefill_chunk`): a
    ``3B + 5``-token prompt that fits the budget takes 4 prefill steps (3 blocks, then the
    rest) where no caching takes one, and on a 16-token per_group plan ``3B/16 + 1``."""
    model, plan = gdn()
    B = _block(plan)
    trace = _sharers(3 * B + 5, 1)
    config = {"hash_block_size": 16, "max_num_batched_tokens": 1 << 14}
    every = simulate(
        plan, model, trace, SimConfig(checkpoint_policy="align_every_block", **config)
    )
    # without prefix caching nothing cuts the prefill: one step fewer
    plain = simulate(plan, model, trace, SimConfig(enable_prefix_caching=False, **config))
    assert every.steps == plain.steps + 3
    # on a 16-token per_group plan the same prompt takes 3B/16 + 1 prefill steps
    small = make_plan(model, "per_group", memory="8GiB", max_num_seqs=16)
    every = simulate(
        small, model, trace, SimConfig(checkpoint_policy="align_every_block", **config)
    )
    plain = simulate(small, model, trace, SimConfig(enable_prefix_caching=False, **config))
    assert every.steps == plain.steps + 3 * B // 16


@pytest.mark.parametrize("layout", ["per_group", "two_level", "inflate"])
def test_an_indexer_group_keeps_partial_hash_hits(layout):
    """GLM-5-Next's sparse-attention indexer keeps per-token keys that vLLM 0.33 holds as an
    MLAAttentionSpec: like the latent, they can be looked up inside a block, so a layout that
    gives them their own group keeps vLLM's partial hash hits (hash unit 16 below a 64-token
    state block) as the shared-page layout does."""
    pytest.importorskip("transformers")
    from hybridkv.e2e import make_tiny_plan
    from hybridkv.e2e.families import TINY_CONFIGS

    plan = make_tiny_plan(TINY_CONFIGS["glm5_next"](), layout)
    kinds = {g.kind for g in plan.groups}
    assert "mla" in kinds and ("indexer" in kinds) == (layout != "inflate")
    assert _block(plan) > 16
    assert CheckpointPolicy("align", plan, 16).vllm.partial


def test_vllm_keys_a_prompts_tail_until_its_block_fills():
    """``partial_hit_points="keys"`` (vLLM's ``BlockPool``): a hit inside an attention block
    lands only on a key, and a prompt's tail is one only until the block fills (its promotion to
    a full entry removes the partial key). Qwen3-Next's 576-token blocks, 16-token units: a
    1,000-token prompt is hit at its tail (992) by a prompt sharing it, until decoding fills the
    block; then at 576 under vLLM's keys, still at 992 under hybridkv's units."""
    import random

    from hybridkv.alloc import AllocatorOptions

    plan = make_plan(models.load("qwen3-next-80b-a3b"), "inflate", memory="8GiB", max_num_seqs=16)
    assert plan.block_size == 576
    rng = random.Random(5)
    prompt = [rng.randrange(1, 50_000) for _ in range(1000)]
    other = [*prompt, *range(60_000, 60_050)]
    for points, after in (("keys", 576), ("units", 992)):
        options = AllocatorOptions(
            hash_block_size=16, max_model_len=1 << 16, prefill_checkpoint_alignment=None,
            partial_hit_points=points,
        )  # fmt: skip
        a = HybridAllocator(plan, options)
        a.add_request("x", prompt)
        while a.num_tokens("x") < len(prompt):
            assert a.allocate_slots("x", a.split_prefill("x", len(prompt) - a.num_tokens("x")))
            a.take_state_copies()
        assert a.find_longest_cache_hit(other) == 992
        while a.num_tokens("x") < 2 * 576 + 8:  # decode past the tail block's end
            a.append_tokens("x", [rng.randrange(1, 50_000)])
            assert a.allocate_slots("x", 1)
            a.take_state_copies()
        check_consistency(a)
        a.free("x")
        assert a.find_longest_cache_hit(other) == after, points


def test_partial_hit_points_is_checked():
    from hybridkv.alloc import AllocatorOptions

    with pytest.raises(ConfigError, match="partial_hit_points must be one of auto, units, keys"):
        AllocatorOptions(partial_hit_points="any")


def test_vllms_align_lands_on_its_keys_by_default():
    """``partial_hit_points="auto"``: the policy's own, vLLM's keys under its ``align``,
    hybridkv's units under its own policies; either can be asked for."""
    from hybridkv.alloc import AllocatorOptions

    assert AllocatorOptions().resolved_partial_hit_points() == "keys"
    for policy in ("last", "marconi", "align_every_block", "periodic", "hash_ladder"):
        assert AllocatorOptions(checkpoint_policy=policy).resolved_partial_hit_points() == "units"
    assert AllocatorOptions(partial_hit_points="units").resolved_partial_hit_points() == "units"
