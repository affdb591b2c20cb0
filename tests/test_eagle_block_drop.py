"""vLLM's EAGLE block drop under MTP (vLLM 0.32, or 0.33 with ``disable_lookahead_block_hashes``).

The drafter's KV at a cached block's last position was built from the writer's next token, so
vLLM looks every hit up one drop unit further in the drafter's group and gives the unit back
(``HybridKVCacheCoordinator.find_longest_cache_hit``, ``eagle_proof_margin``), and align keeps
its states a unit earlier to meet it (``get_mamba_prefill_checkpoint_position`` with
``drop_eagle_block``, ``replay_boundaries`` with ``use_eagle``). These tests check the rules
against vLLM's formulas, the hits on Qwen3.5-4B's plan against numbers worked out by hand, the
options' resolution and refusals, and the allocator's consistency (with the eviction cascade,
which must keep the unit a hit looks up past each state)."""

from __future__ import annotations

import random

import pytest
from alloc_serving import serve_prefill

from hybridkv import models
from hybridkv.alloc import AllocatorOptions, ConfigError, HybridAllocator
from hybridkv.alloc.check import check_consistency
from hybridkv.alloc.policies.align import VllmAlign
from hybridkv.alloc.prefix_cache import PrefixIndex
from hybridkv.alloc.reach import Reach
from hybridkv.layouts import VllmTarget, make_plan

MTP = dict(speculative_method="mtp", num_spec_tokens=1)


def _plan(layout: str = "inflate", memory: str = "8GiB", **target):
    model = models.load("qwen3.5-4b", **MTP)
    return make_plan(model, layout, memory=memory, max_num_seqs=16, target=VllmTarget(**target))


# ---- the rules, against vLLM's formulas ------------------------------------------------------


def _vllm_checkpoint_position(num_tokens: int, unit: int, drop: bool, lookahead: int = 0) -> int:
    """vllm/v1/kv_cache_interface.py get_mamba_prefill_checkpoint_position, restated."""
    limit = num_tokens if drop else num_tokens - max(1, lookahead)
    position = limit // unit * unit
    if drop:
        position -= unit
    return max(position, 0)


def _vllm_replay_boundaries(num_prompt: int, block: int, drop: bool) -> tuple[int, ...]:
    """vllm/v1/core/kv_cache_coordinator.py replay_boundaries, restated."""
    if not drop:
        return (num_prompt - 1,)
    resend = (num_prompt - 1) // block * block
    extension = num_prompt // block * block
    return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))


@pytest.mark.parametrize("drop", [False, True])
def test_align_rules_follow_vllms_formulas(drop):
    rng = random.Random(drop)
    for _ in range(300):
        B = rng.choice([16, 64, 528, 576])
        h = rng.choice([u for u in (16, 32, B) if B % u == 0])
        rules = VllmAlign(
            block_size=B,
            scheduler_block_size=B,
            hash_block_size=h,
            partial=h < B,
            eagle_block_drop=drop,
        )
        n = rng.randrange(1, 5 * B)
        for unit in (h, B):
            assert rules.pos(n, unit) == _vllm_checkpoint_position(n, unit, drop)
        assert sorted(set(rules.replay_boundaries(n))) == list(_vllm_replay_boundaries(n, B, drop))
        # FullAttentionManager._cache_partial_tail_block: the whole prompt under the drop
        want_tail = (n if drop else n - 1) // h * h
        assert rules.attention_tail(n) == want_tail


def test_the_rules_refuse_the_drop_with_lookahead_hashes():
    with pytest.raises(ValueError, match="exclude each other"):
        VllmAlign(
            block_size=64,
            scheduler_block_size=64,
            hash_block_size=16,
            partial=True,
            hash_lookahead_tokens=1,
            eagle_block_drop=True,
        )


# ---- hits on Qwen3.5-4B ------------------------------------------------------------------------


@pytest.mark.parametrize("evict_unreachable", [True, False])
@pytest.mark.parametrize("fine", [False, True])
def test_hits_give_a_unit_back(fine, evict_unreachable):
    """Qwen3.5-4B under vLLM 0.32 (528-token blocks), one prompt of 2B + 10 tokens served.

    Whole blocks (hash unit = block): align keeps the state at ``pos = 2B - B = B``; a resend
    looks attention up to 2B and gives B back: it hits B (2B with the drop off). A prompt
    sharing only B + 5 tokens finds one block, gives it back: nothing. With 16-token units the
    state is the prompt's tail ``(2B + 10) // 16 * 16 - 16 = 1040`` and the drop one unit:
    1056 - 16 = 1040. The cascade (``evict_unreachable``) keeps the block past the last state,
    which the lookup needs."""
    plan = _plan(version="0.32")
    B = plan.block_size
    assert B == 528 and plan.vllm.eagle_block_drop
    h = 16 if fine else B
    rng = random.Random(0)
    tokens = [rng.randrange(1, 50_000) for _ in range(2 * B + 10)]
    other = [50_001 + i for i in range(40)]
    hits = {}
    for drop in (True, False):
        options = AllocatorOptions(
            hash_block_size=h,
            max_model_len=1 << 16,
            prefill_checkpoint_alignment=None,
            evict_unreachable=evict_unreachable,
            eagle_block_drop="auto" if drop else False,
        )
        a = HybridAllocator(plan, options)
        assert a.options.eagle_block_drop is drop
        assert a.hit_peek_units == ({0: 1} if drop else {})
        serve_prefill(a, "first", tokens)
        hits[drop] = (
            a.find_longest_cache_hit([*tokens, 7]),
            a.find_longest_cache_hit(tokens[: 2 * B] + other),
            a.find_longest_cache_hit(tokens[: B + 5] + other),
            a.find_longest_cache_hit(tokens),
        )
    want = 1040 if fine else B
    assert hits[True] == (want, want, 0, want)
    assert hits[False] == (2 * B, 2 * B, 0, 2 * B)


def test_a_shared_prefix_hits_a_block_less_under_the_drop():
    """Three prompts of 3B + 150 tokens sharing their first 3B + 100 (whole blocks). Without
    the drop the first keeps its state at its replay boundary 3B and the others hit 3B. Under
    it the replay boundaries are ``(n - 1) // B * B - B = n // B * B - B = 2B``: the state sits
    at 2B, the lookup finds attention to 3B and gives a block back, so they hit 2B."""
    rng = random.Random(3)
    base = [rng.randrange(1, 50_000) for _ in range(4 * 528)]
    out = {}
    for drop in (True, False):
        plan = _plan(version="0.32")
        B = plan.block_size
        a = HybridAllocator(
            plan,
            AllocatorOptions(
                hash_block_size=B,
                max_model_len=1 << 16,
                prefill_checkpoint_alignment=None,
                eagle_block_drop=drop,
            ),
        )
        shared = base[: 3 * B + 100]
        got = []
        for i in range(3):
            prompt = shared + [60_000 + 100 * i + j for j in range(50)]
            got.append(a.find_longest_cache_hit(prompt))
            serve_prefill(a, f"r{i}", prompt)
        out[drop] = got
    B = 528
    assert out[False] == [0, 3 * B, 3 * B]
    assert out[True] == [0, 2 * B, 2 * B]


def _fine(drop: bool, evict_unreachable: bool = True) -> HybridAllocator:
    """Qwen3.5-4B under vLLM 0.32 with 16-token hash units (partial hits)."""
    options = AllocatorOptions(
        hash_block_size=16,
        max_model_len=1 << 16,
        prefill_checkpoint_alignment=None,
        evict_unreachable=evict_unreachable,
        eagle_block_drop="auto" if drop else False,
    )
    a = HybridAllocator(_plan(version="0.32"), options)
    assert a.options.eagle_block_drop is drop
    return a


def _chunks(a: HybridAllocator, rid: str, tokens: list[int]) -> list[tuple[int, int]]:
    """Prefill ``tokens`` as the scheduler asks (``prefill_chunk``) and free: the chunks."""
    a.add_request(rid, tokens)
    chunks = []
    while (start := a.num_tokens(rid)) < len(tokens):
        n = a.prefill_chunk(rid, len(tokens) - start)
        assert n > 0 and a.allocate_slots(rid, n)
        a.take_state_copies()
        check_consistency(a)
        chunks.append((start, start + n))
    a.free(rid)
    check_consistency(a)
    return chunks


@pytest.mark.parametrize("evict_unreachable", [True, False])
@pytest.mark.parametrize("fresh", [0, 1])
def test_a_prompt_inside_one_block_keeps_its_attention_tail_past_the_state(
    fresh, evict_unreachable
):
    """A prompt of 108 shared tokens (+ ``fresh``) under 16-token units. With the drop its
    state is ``pos = 108 // 16 * 16 - 16 = 80`` (the first chunk ends there), and attention
    caches its tail to ``108 // 16 * 16 = 96``, which the lookup reads before giving a unit
    back: a prompt sharing 173 tokens hits 80 (vLLM 0.32's own KVCacheManager: 80). The tail
    is computed by the last chunk, whose commit must run though no state is kept at its end
    (it was skipped, and the hit was 0). Without the drop the state and the tail are both at
    96."""
    rng = random.Random(fresh)
    base = [rng.randrange(1, 50_000) for _ in range(200)]
    prompt = base[:108] + [60_000 + i for i in range(fresh)]
    probe = base[:173] + [70_000 + i for i in range(20)]
    a = _fine(drop=True, evict_unreachable=evict_unreachable)
    assert _chunks(a, "r", prompt) == [(0, 80), (80, len(prompt))]
    assert a.find_longest_cache_hit(probe) == 80
    b = _fine(drop=False, evict_unreachable=evict_unreachable)
    _chunks(b, "r", prompt)
    assert b.find_longest_cache_hit(probe) == 96


@pytest.mark.parametrize("length", [2660, 2668])
def test_a_prompt_tail_on_a_block_boundary_is_kept_under_the_drop(length):
    """Prompts of 2,660 and 2,668 tokens (B = 528): under the drop with 16-token units the
    prompt's tail state is ``length // 16 * 16 - 16 = 2640 = 5B``, a block boundary but not a
    replay boundary (``length // B * B - B = 2112``). vLLM keeps it as the prompt's tail
    (``MambaManager._cache_partial_tail_block`` runs on block boundaries too), so a longer
    prompt sharing the whole prompt hits 2640 (vLLM 0.32's KVCacheManager: 2640); kept only by
    the block mask it was dropped and the hit fell to 2112."""
    rng = random.Random(length)
    base = [rng.randrange(1, 50_000) for _ in range(3000)]
    a = _fine(drop=True)
    assert _chunks(a, "r", base[:length]) == [(0, 2112), (2112, 2640), (2640, length)]
    assert a.find_longest_cache_hit(base[: length + 40]) == 2640
    b = _fine(drop=False)
    _chunks(b, "r", base[:length])
    assert b.find_longest_cache_hit(base[: length + 40]) == 2656


# ---- options -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target, policy, want",
    [
        (dict(version="0.32"), "align", True),
        (dict(version="0.32"), "last", False),  # hybridkv's policies place states for no drop
        (dict(version="0.32", disable_eagle_block_drop=True), "align", False),
        (dict(version="0.33"), "align", False),  # lookahead hashes instead
        (dict(version="0.33", disable_lookahead_block_hashes=True), "align", True),
    ],
)
def test_auto_follows_the_vllm_target(target, policy, want):
    plan = _plan(**target)
    resolved = AllocatorOptions(checkpoint_policy=policy).for_plan(plan)
    assert resolved.eagle_block_drop is want
    if want:
        assert resolved.hash_lookahead_tokens == 0


def test_a_model_without_mtp_never_drops():
    model = models.load("qwen3.5-4b")
    plan = make_plan(
        model, "inflate", memory="8GiB", max_num_seqs=16, target=VllmTarget(version="0.32")
    )
    assert AllocatorOptions().for_plan(plan).eagle_block_drop is False


def test_refusals():
    with pytest.raises(ConfigError, match="eagle_block_drop must be"):
        AllocatorOptions(eagle_block_drop="yes")
    with pytest.raises(ConfigError, match="one or the other"):
        AllocatorOptions(eagle_block_drop=True, hash_lookahead_tokens=1)
    with pytest.raises(ConfigError, match="hash_lookahead_tokens=0"):
        AllocatorOptions(eagle_block_drop=True).for_plan(_plan())  # 0.33: lookahead 1
    with pytest.raises(ConfigError, match="Marconi"):
        AllocatorOptions(checkpoint_policy="marconi", eagle_block_drop=True).for_plan(
            _plan(version="0.32")
        )
    # no drafter's group: vLLM drops in every group, a sliding window's drop is not modelled
    gemma = models.load("recurrentgemma-2b")
    plan = make_plan(gemma, "inflate", memory="4GiB", max_num_seqs=4)
    with pytest.raises(ConfigError, match="sliding-window"):
        AllocatorOptions(eagle_block_drop=True, hash_lookahead_tokens=0).for_plan(plan)


def test_the_drafters_group_is_the_one_that_drops():
    """Every layout keeps Qwen3.5-4B's drafter layer in one full-attention group; that group,
    and no other, gives a unit back."""
    for layout in ("inflate", "pack", "aggregate", "per_group", "two_level"):
        plan = _plan(layout, memory="4GiB", version="0.32")
        drafter = [g.group_id for g in plan.groups if g.holds_drafter]
        assert len(drafter) == 1
        a = HybridAllocator(plan, AllocatorOptions(max_model_len=8192))
        assert list(a.hit_peek_units) == drafter, layout


# ---- consistency and the cascade -------------------------------------------------------------


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("layout", ["inflate", "per_group", "two_level"])
@pytest.mark.parametrize("policy", ["align", "last"])
def test_the_drop_keeps_the_allocator_consistent(layout, policy):
    """Random prompts sharing prefixes of random lengths in a cache small enough to evict:
    the consistency checker after every step, and every hit leaves at least the drop unit of
    the longest prefix the prompt shares with an earlier one (the unit looked up and given
    back)."""
    rng = random.Random(hash((layout, policy)) & 0xFFFF)
    plan = _plan(layout, memory="2GiB", version="0.32")
    a = HybridAllocator(
        plan,
        AllocatorOptions(
            checkpoint_policy=policy, max_model_len=8192, hash_block_size=16, eagle_block_drop=True
        ),
    )
    (unit,) = a.hit_peek_units.values()
    drop = unit * 16
    base = [rng.randrange(1, 50_000) for _ in range(2000)]
    seen: list[list[int]] = []
    hits = 0
    for i in range(25):
        shared = rng.choice([0, 16, 300, 528, 1056, 1100, 1600])
        tokens = base[:shared] + [rng.randrange(1, 50_000) for _ in range(rng.randrange(5, 600))]
        longest = max((_common(tokens, s) for s in seen), default=0)
        hit = a.find_longest_cache_hit(tokens)
        assert hit == 0 or hit + drop <= longest, (i, hit, longest)
        hits += hit
        serve_prefill(a, f"r{i}", tokens)
        seen.append(tokens)
    if policy == "align":
        assert hits > 0  # the drop leaves hits where prompts share more than a unit


def _chain_index(n: int, states: list[int]) -> tuple[PrefixIndex, list[bytes]]:
    """A prefix index holding one chain of ``n`` one-unit KV blocks in group 0 and state
    checkpoints in group 1 at the given units."""
    index = PrefixIndex(16, emit=False)
    hashes = [bytes([i]) * 4 for i in range(n)]
    for i in range(n):
        index.add((0, hashes[i]), 100 + i, i, hashes, 1, None, None, False)
    for i in states:
        index.add((1, hashes[i]), 200 + i, i, hashes, 1, None, None, True)
    return index, hashes


def test_a_dead_segment_keeps_the_peek_of_the_state_above():
    """States at units 3 and 9 of a 12-unit chain; the one at 9 goes. Without the drop the KV
    from unit 4 on serves nothing; under it the state at 3 still needs unit 4 (its hits look it
    up), and a peek reaching into the evicted state's subtree keeps everything."""
    index, hashes = _chain_index(12, [3, 9])
    index.remove((1, hashes[9]), 209)
    reach = Reach(index)
    plain = reach.dead_segment(0, hashes[9], 9)
    assert sorted(plain) == sorted(hashes[4:12])
    kept = reach.dead_segment(0, hashes[9], 9, peek=2)
    assert sorted(kept) == sorted(hashes[6:12])
    assert reach.dead_segment(0, hashes[9], 9, peek=6) == []


def test_useful_units_need_the_peek():
    """A state at the chain's last unit serves no hit under the drop (nothing to look up past
    it); one with a unit after it does, and that unit counts as useful."""
    index, hashes = _chain_index(6, [2, 5])
    reach = Reach(index)
    plain = reach.useful_units([0], [], [1])
    assert hashes[5] in plain[1] and hashes[2] in plain[1]
    dropped = reach.useful_units([0], [], [1], peek={0: 1})
    assert hashes[5] not in dropped[1] and hashes[2] in dropped[1]
    assert hashes[3] in dropped[0]  # the peek past the state at 2
    assert reach.path_down(0, hashes[2], 3) == hashes[3:6]
    assert reach.path_down(0, hashes[2], 4) is None


# ---- the doctor ------------------------------------------------------------------------------


def test_the_doctor_predicts_the_drop_and_the_switch_that_ends_it(capsys):
    """Qwen3.5-4B under vLLM 0.32 with MTP, prompts of 2,000 tokens sharing 1,100: attention
    finds two 528-token blocks and the drop gives one back, so each later prompt hits 528
    tokens where it hits 1,056 without the drop: exactly half the hit rate. The minimum shared
    prefix is two blocks, and ``disable_eagle_block_drop`` is offered with the plain hits."""
    import json

    from hybridkv.cli import main

    flags = ["doctor", "--model", "qwen3.5-4b", "--vllm-version", "0.32"]
    flags += ["--prompt-len", "2000", "--shared-prefix", "1100", "--json"]
    spec = {"method": "mtp", "num_speculative_tokens": 1}

    def run(**switches):
        assert main([*flags, "--speculative-config", json.dumps({**spec, **switches})]) == 0
        out = json.loads(capsys.readouterr().out)
        return {f["key"]: f for f in out["findings"]}, {r["key"]: r for r in out["remedies"]}

    findings, remedies = run()
    assert findings["min_hit"]["data"]["min_shared_tokens"] == 2 * 528
    assert "EAGLE's block drop" in findings["min_hit"]["text"]
    dropped = remedies["as_given"]["token_hit_rate"]
    fix = remedies["mtp_plain_hashes"]
    assert json.loads(fix["flags"][1])["disable_eagle_block_drop"] is True
    _, plain = run(disable_eagle_block_drop=True)
    assert fix["token_hit_rate"] == plain["as_given"]["token_hit_rate"]
    assert dropped == pytest.approx(plain["as_given"]["token_hit_rate"] / 2)
