"""The ``marconi`` policy on a small sequence worked out by hand, on every layout, and the byte
breakdown that explains a run (:mod:`hybridkv.alloc.breakdown`).

The model is Marconi's 7B hybrid byte for byte (``paper.marconi_gap.marconi_model``: 4
attention layers of 16,384 B of KV per token, 24 Mamba-2 layers of 1,116,160 B of state); the
hash unit is 16 tokens. The sequence (token ids from disjoint ranges):

- ``R0``: system prompt ``S`` (64 tokens) + ``A`` (32), 17 answer tokens. Nothing is cached:
  hit 0. Its state is kept where its last step ends on a hash boundary: prompt 96 + 16 computed
  answer tokens (the 17th is sampled, never computed) = **112**.
- ``R1``: ``S + B``. No state lies at or below 64 on ``S`` (``R0``'s is at 112): hit 0. But
  attention has ``S`` cached, so ``R1`` diverges from a cached prefix at 64: Marconi checkpoints
  the *branch point*, **64**, during ``R1``'s prefill. ``R1``'s own end state: 112.
- ``R2``: ``S + C``: hits the branch state: **64**.
- ``R3``: ``R0``'s next turn (``S + A + R0's answer + 15 tokens``, 128): hits ``R0``'s end
  state: **112**. Its end state: 128 + 16 = 144. ``R0``'s state is now *superseded*: the KV
  before it stays reachable through ``R3``'s, and it serves only a prompt diverging exactly at
  112, so it is the first state to evict.

Eviction (recency first, ``alpha`` 0; nothing another entry depends on, while something else
can go): an unrelated prompt of growing length then needs memory, and the continuations of
each request show what was evicted in which order. In the shared-pool layouts one LRU orders
everything: ``R0``'s superseded state, then ``R1``'s segment (its state and the KV of ``B``
that only it reached), then ``R2``'s, while ``S``, the branch state and ``R3`` stay. With
separate pools (``per_group``) the filler presses only the KV pool: the oldest leaf segments go
(``R1``, ``R2``), then ``R3``'s KV tail, and ``R3``'s continuation falls back to ``R0``'s
superseded state, which the state pool, not under pressure, still holds. ``two_level`` keeps
KV and states in separate groups of one pool of large pages, and the pool's evictor
(:class:`~hybridkv.alloc.marconi.MarconiPoolEvictor`) chooses across them, so it follows the
shared-pool order.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.alloc import CATEGORIES, HybridAllocator
from hybridkv.layouts import make_plan
from hybridkv.replay import replay, serve
from hybridkv.sim import SimConfig, simulate
from hybridkv.traces import Request, Trace
from paper.marconi_gap import marconi_model

LAYOUTS = ("inflate", "pack", "aggregate", "per_group", "two_level")
MEMORY = 400_000_000
KV_PER_TOKEN = 4 * 32 * 128 * 2 * 2  # 4 attention layers, K and V, fp16
STATE_PER_LAYER = 4096 * 128 * 2 + (2 * 4096 + 2 * 128) * 4 * 2  # Marconi's formula
STATE = 24 * STATE_PER_LAYER


def _seg(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


S, A, B, C = _seg(1, 64), _seg(1000, 32), _seg(2000, 32), _seg(3000, 32)
OUT = {0: _seg(4000, 17), 1: _seg(7000, 17), 2: _seg(8000, 17), 3: _seg(6000, 17)}
PROMPTS = {0: S + A, 1: S + B, 2: S + C, 3: S + A + OUT[0] + _seg(5000, 15)}
#: each request's continuation (its prompt, its answer's computed part, then new tokens)
PROBES = {
    "R0": S + A + OUT[0][:16] + _seg(9000, 40),
    "R1": S + B + OUT[1][:16] + _seg(9100, 40),
    "R2": S + C + OUT[2][:16] + _seg(9200, 40),
    "R3": PROMPTS[3] + OUT[3][:16] + _seg(9300, 40),
    "S": S + _seg(9400, 40),
}
INTACT = {"R0": 112, "R1": 112, "R2": 112, "R3": 144, "S": 64}


def _req(i: int, prompt: list[int], out: list[int]) -> Request:
    return Request(
        request_id=i,
        arrival_s=float(i),
        prompt=np.asarray(prompt, dtype=np.int32),
        output_length=len(out),
        output_ids=np.asarray(out, dtype=np.int32),
    )


SEQUENCE = [_req(i, PROMPTS[i], OUT[i]) for i in range(4)]


def _plan(layout: str, memory: int = MEMORY):
    # per_group's state pool holds only running states unless given cache slots
    slots = 8 if layout == "per_group" else 0
    return make_plan(
        marconi_model(), layout, memory=memory, max_num_seqs=1, cache_state_slots=slots
    )


def _alloc(layout: str, **kw) -> HybridAllocator:
    return HybridAllocator(
        _plan(layout),
        checkpoint_policy="marconi",
        hash_block_size=16,
        max_model_len=1 << 16,
        marconi_alpha=0.0,
        **kw,
    )


def _probe(alloc: HybridAllocator) -> dict[str, int]:
    return {k: alloc.find_longest_cache_hit(v) for k, v in PROBES.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hand_worked_hits(layout):
    alloc = _alloc(layout)
    hits = [serve(alloc, r) for r in SEQUENCE]
    assert hits == [0, 0, 64, 112]
    assert _probe(alloc) == INTACT
    # states kept: R0 112, the branch point 64, R1 112, R2 112, R3 144; nothing evicted
    bd = alloc.memory_breakdown()
    assert bd.cached_states == 5 and bd.unreachable == 0 and bd.live == 0
    assert all(p.get("evictions", 0) == 0 for p in alloc.stats()["pools"].values())


#: per layout: the probes that fall, in order, as the filler grows (to where they fall)
EXPECTED_ORDER = {
    "inflate": [{"R0": 64}, {"R1": 64}, {"R2": 64}],
    "pack": [{"R0": 64}, {"R1": 64}, {"R2": 64}],
    "aggregate": [{"R0": 64}, {"R1": 64}, {"R2": 64}],
    "per_group": [{"R1": 64}, {"R2": 64}, {"R3": 112}],
    "two_level": [{"R0": 64}, {"R1": 64}, {"R2": 64}],
}


def _after_filler(layout: str, length: int, alpha: float = 0.0, **kw) -> dict[str, int]:
    alloc = _alloc(layout, **kw)
    alloc.marconi_alpha = alpha
    for r in SEQUENCE:
        serve(alloc, r)
    serve(alloc, _req(10, _seg(100_000, length), [5]))
    return _probe(alloc)


def _fall_order(
    layout: str, steps: int, alpha: float = 0.0, **kw
) -> tuple[list[dict[str, int]], dict[str, int]]:
    """The probes that fall, in order, as the filler grows (the first ``steps`` changes), and
    the probes' hits after the last of them."""
    seen: list[dict[str, int]] = []
    state = dict(INTACT)
    for length in range(16, 8000, 16):
        now = _after_filler(layout, length, alpha, **kw)
        changed = {k: v for k, v in now.items() if v != state[k]}
        if changed:
            seen.append(changed)
            state = now
        if len(seen) == steps:
            break
    return seen, state


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hand_worked_eviction_order(layout):
    expected = EXPECTED_ORDER[layout]
    seen, state = _fall_order(layout, len(expected))
    assert seen == expected
    # what the hand-worked order keeps: the shared prefix and its branch state, and R3
    if layout != "per_group":
        assert state["S"] == 64 and state["R3"] == 144


#: with a large alpha (FLOPs saved per byte first): R3's end state saves only the 32 tokens
#: after R0's state for a 144-token prefix's bytes, the least per byte, so it goes first although
#: it is the newest; then R0 (now a leaf, superseded, the oldest of three equally valuable
#: segments above the branch point), R1, R2.
EXPECTED_ORDER_VALUE = [{"R3": 112}, {"R0": 64, "R3": 64}, {"R1": 64}, {"R2": 64}]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hand_worked_eviction_order_by_value(layout):
    seen, _ = _fall_order(layout, len(EXPECTED_ORDER_VALUE), alpha=10.0)
    assert seen == EXPECTED_ORDER_VALUE


def test_two_level_without_the_pool_evictor_evicts_by_group():
    """``marconi_across_groups=False`` (the ablation of section 4.10): each group's evictor
    chooses among its own ids and idle pages go to the group that needs one by their age. The
    KV group gives up R1 first, then the page holding R0's superseded state goes, then the
    branch state at the end of ``S``, which every other prompt's hit needs, while R2's segment
    stays; and value plays no part in which group gives way (R1 first with alpha 10 as well,
    where Marconi evicts R3's end state)."""
    seen, _ = _fall_order("two_level", 3, marconi_across_groups=False)
    assert seen == [{"R1": 64}, {"R0": 64}, {"R0": 0, "R1": 0, "S": 0}]
    seen, _ = _fall_order("two_level", 1, alpha=10.0, marconi_across_groups=False)
    assert seen == [{"R1": 64}]


def test_replay_tunes_alpha_as_marconi_does():
    """``marconi_alpha="auto"``: alpha starts at 0 and is tuned once, after five times as many
    requests as were served before the first eviction, to the grid value that saved the most
    FLOPs when those requests are replayed from an empty cache; a fixed alpha stays."""
    from hybridkv.replay import tune_marconi_alpha

    trace = _chat(120)
    p = _plan("inflate", 700_000_000)
    auto = replay(p, trace, alpha_grid=(0.0, 0.5, 5.0), bootstrap_multiplier=2)
    assert auto.alpha_tuned_at is not None and auto.marconi_alpha in (0.0, 0.5, 5.0)
    # the first eviction came during request k: tuned after 2 (k + 1) requests
    assert auto.alpha_tuned_at == 2 * (_first_eviction(p, trace) + 1) - 1

    def make():
        return HybridAllocator(
            p, checkpoint_policy="marconi", hash_block_size=16, max_model_len=1 << 16
        )

    window = trace.requests[: auto.alpha_tuned_at + 1]
    assert tune_marconi_alpha(make, window, (0.0, 0.5, 5.0)) == auto.marconi_alpha
    fixed = replay(p, trace, marconi_alpha=0.5)
    assert fixed.marconi_alpha == 0.5 and fixed.alpha_tuned_at is None
    with pytest.raises(ValueError, match="'auto'"):
        replay(p, trace, marconi_alpha="tuned")
    with pytest.raises(ValueError, match="alpha_grid"):
        tune_marconi_alpha(make, window, ())


def _chat(n: int) -> Trace:
    from hybridkv import traces

    return traces.multi_turn_chat(n, seed=2, system_prompt=128)


def _first_eviction(p, trace: Trace) -> int:
    """The request during which a replay with alpha 0 first evicts."""
    alloc = HybridAllocator(
        p, checkpoint_policy="marconi", hash_block_size=16, max_model_len=1 << 16
    )
    alloc.marconi_alpha = 0.0
    for i, r in enumerate(trace.requests):
        serve(alloc, r, index=i)
        if any(x.get("evictions", 0) for x in alloc.stats()["pools"].values()):
            return i
    raise AssertionError("the trace never fills the plan")


# ---- the byte breakdown -------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["inflate", "two_level"])
def test_breakdown_by_hand_after_one_request(layout):
    """After R0 alone: its 112 tokens of KV and its end state are cached and reachable; the
    rest of its ids' bytes are padding; nothing is live; the categories cover the budget."""
    alloc = _alloc(layout)
    serve(alloc, SEQUENCE[0])
    plan = alloc.plan
    bd = alloc.memory_breakdown()
    assert bd.reachable_kv == 112 * KV_PER_TOKEN
    assert bd.reachable_state == STATE
    assert bd.unreachable == bd.live == 0 and bd.cached_states == 1
    assert bd.total == MEMORY
    B = plan.block_size
    kv_ids = -(-112 // B)
    if layout == "inflate":
        # one shared id is a 4-layer page; a state takes 6 of them (24 layers, 4 per group)
        page = plan.pools[0].block_bytes
        assert bd.padding == kv_ids * page - 112 * KV_PER_TOKEN + 6 * page - STATE
        assert bd.owned_empty == 0
    else:
        # R0's blocks fill the first ids of large page 0 (which keeps the null ids and stays
        # with attention): its other ids are owned but empty; so are the other slots of the
        # large page holding R0's end state (R0's running slot, freed)
        attn, state = plan.groups[0], plan.groups[1]
        k = dict(plan.pools[0].ids_per_large_page)
        assert bd.padding == kv_ids * (attn.page_bytes - B * KV_PER_TOKEN) + (
            state.page_bytes - STATE
        )
        assert (
            bd.owned_empty == (k[0] - 1 - kv_ids) * attn.page_bytes + (k[1] - 1) * state.page_bytes
        )


def _first_filler(layout: str, probe: str, to: int) -> int:
    """The shortest filler (16-token steps) after which ``probe`` hits only ``to`` tokens."""
    for length in range(16, 8000, 16):
        if _after_filler(layout, length)[probe] == to:
            return length
    raise AssertionError(f"no filler up to 8000 tokens evicts {probe} on {layout}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unreachable_entries_are_counted_and_evicted(layout):
    """The shortest filler that evicts R1's end state (shared pools) or its KV (the KV pool of
    ``per_group``) leaves the other half of R1's segment useless. Without
    ``evict_unreachable`` the breakdown counts it as cached but unreachable; with it, it goes
    with the half that was evicted. ``two_level``'s pool-wide evictor frees the segment whole
    (its state and its KV, as Marconi frees a node), so nothing is left either way."""
    length = _first_filler(layout, "R1", 64)
    out = {}
    for flag in (False, True):
        alloc = _alloc(layout, evict_unreachable=flag)
        for r in SEQUENCE:
            serve(alloc, r)
        serve(alloc, _req(10, _seg(100_000, length), [5]))
        out[flag] = (alloc.find_longest_cache_hit(PROBES["R1"]), alloc.memory_breakdown())
    (hit_keep, keep), (hit_drop, drop) = out[False], out[True]
    assert hit_drop == 64 and keep.total == drop.total == MEMORY
    assert drop.unreachable == 0
    # the same eviction happens without the cascade: the other half is dead weight
    assert hit_keep == 64
    assert keep.unreachable == 0 if layout == "two_level" else keep.unreachable > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_breakdown_covers_the_budget_while_serving(layout):
    """On a chat replay with evictions, sampled after every request and while requests run
    (the simulator), every byte of the budget is in exactly one category."""
    from hybridkv import traces

    trace = traces.multi_turn_chat(40, seed=3, system_prompt=128)
    mem = 1_200_000_000
    res = replay(_plan(layout, mem), trace, sample_every=1, marconi_alpha=1.0)
    assert len(res.samples) == 40
    for bd in res.samples:
        assert bd.total == mem
        assert min(getattr(bd, c) for c in CATEGORIES) >= 0
        assert bd.reachable == bd.reachable_kv + bd.reachable_state
        assert bd.live == 0  # between requests nothing runs
    assert res.evictions > 0 and 0 < res.token_hit_rate < 1


@pytest.mark.parametrize("layout", ["inflate", "two_level"])
def test_simulator_reports_the_breakdown(layout):
    from hybridkv import traces
    from hybridkv.models import load

    model = load("qwen3.5-0.8b")
    trace = traces.multi_turn_chat(60, seed=1, system_prompt=128)
    plan = make_plan(model, layout, memory="256MiB", max_num_seqs=8)
    r = simulate(plan, model, trace, SimConfig(checkpoint_policy="marconi", sample_every=4))
    assert r.breakdown and len(r.breakdown) == len(r.breakdown_t_s)
    assert all(b.total == plan.config.memory_bytes for b in r.breakdown)
    assert any(b.live > 0 for b in r.breakdown)  # sampled while requests run
    assert any(b.reachable > 0 for b in r.breakdown)
    s = r.summary()
    assert {"reachable_gib_mean", "unreachable_gib_mean", "owned_empty_gib_mean"} <= set(s)
    assert s["reachable_gib_mean"] == round(r.breakdown_mean()["reachable"] / 2**30, 3)


def test_replay_errors():
    plan = _plan("inflate")
    long = _req(0, _seg(1, 12_000), [1])
    with pytest.raises(ValueError, match="does not fit"):
        replay(plan, Trace("one", (long,)))
    # a request with no recorded answer is not an error: replay feeds back ids no prompt holds
    # (tests/test_reference_gap.py), as the simulator does
    no_ids = Request(
        request_id=0, arrival_s=0.0, prompt=np.arange(32, dtype=np.int32), output_length=4
    )
    assert replay(plan, [no_ids]).prompts.tolist() == [32]


@pytest.mark.parametrize("layout", ["per_group", "two_level"])
def test_the_kept_ranking_is_a_full_pass(layout):
    """The allocator's scorer recomputes only the rows the index reports changed; after every
    request of a run that evicts, its ranking equals a full pass's over the same cache (a twin
    scorer that recomputes every row), order and ties included, and ``check`` finds each row
    as a full pass computes it."""
    from hybridkv.alloc.marconi import MarconiScorer

    alloc = _alloc(layout)
    alloc.marconi_alpha = 1.0
    scorer = alloc.eviction_hooks
    requests = [*SEQUENCE, _req(10, _seg(100_000, 2000), [5]), *SEQUENCE[1:]]
    for i, r in enumerate(requests):
        serve(alloc, r)
        twin = MarconiScorer(alloc.index, alloc.plan, scorer.pool_of, alpha=1.0)
        for u, ts in scorer.last_access.items():  # the same states, accessed in the same order
            twin.clock = ts
            twin.accessed(u)
        twin.clock = scorer.clock
        kept, full = scorer.ranking(), twin.ranking()
        assert list(kept.units) == list(full.units), i
        assert kept.utility.tolist() == full.utility.tolist(), i
        assert list(kept.order()) == list(full.order()), i
        scorer.check()
    assert sum(p.get("evictions", 0) for p in alloc.stats()["pools"].values()) > 0


def test_a_change_behind_the_index_is_caught():
    """``check`` can fail: a branch made by hand, not through the index (which would have
    reported it), leaves a ranked row stale, and the check names it."""
    alloc = _alloc("two_level")
    for r in SEQUENCE:
        serve(alloc, r)
    scorer = alloc.eviction_hooks
    scorer.ranking()
    scorer.check()
    chain = scorer.chain_group
    u = scorer.ranking().units[0]
    alloc.index.children.setdefault((chain, u), {})[b"x" * 32] = None
    alloc.index.children[(chain, u)][b"y" * 32] = None
    with pytest.raises(AssertionError, match="branch point is ranked"):
        scorer.check()
