"""The ``periodic``, ``hash_boundary`` and ``hash_ladder`` checkpoint policies: states kept
inside prompts so that a later prompt sharing only part of an earlier one (a whole number of a
trace's hash blocks) still finds a state. Checked on the allocator directly (where the states are
and what a hit gets), in both modes (exported from inside the prefill, or prefill chunks cut at
them), and in the simulator (the same hits either way, the memory they take)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest

from hybridkv import models
from hybridkv.alloc import (
    ALL_POLICIES,
    RECOVERY_POLICIES,
    AllocatorOptions,
    ConfigError,
    HybridAllocator,
)
from hybridkv.alloc.check import check_consistency
from hybridkv.alloc.policies import CheckpointPolicy
from hybridkv.layouts import make_plan
from hybridkv.sim import SimConfig, simulate
from hybridkv.traces import Request, Trace

H = 16


@functools.cache
def _plan(layout: str = "per_group", memory: str = "2GiB"):
    return make_plan(
        models.load("qwen3.5-0.8b"),
        layout,
        memory=memory,
        max_num_seqs=8,
        block_size=16,
        cache_state_slots=64,
    )


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, n).tolist()


def _run_prompt(a: HybridAllocator, rid: str, prompt: list[int], chunk: int = 10_000) -> int:
    """Admit ``prompt`` and prefill it in steps of at most ``chunk`` tokens, ending steps where
    the allocator asks (``next_checkpoint``); returns the hit."""
    hit = a.add_request(rid, prompt)
    done = hit.num_cached_tokens
    while done < len(prompt):
        n = min(chunk, len(prompt) - done)
        stop = a.next_checkpoint(rid)
        if stop is not None and done < stop < done + n:
            n = stop - done
        assert a.allocate_slots(rid, n)
        a.take_state_copies()
        check_consistency(a)
        done += n
    return hit.num_cached_tokens


def _alloc(
    policy: str, interval: int | None, exports: bool, layout: str = "per_group"
) -> HybridAllocator:
    return HybridAllocator(
        _plan(layout),
        hash_block_size=H,
        checkpoint_policy=policy,
        checkpoint_interval=interval,
        prefill_checkpoint_alignment=1 if exports else None,
        max_model_len=1 << 16,
    )


def test_policy_names():
    assert set(RECOVERY_POLICIES) == {"periodic", "hash_boundary", "hash_ladder"}
    assert set(RECOVERY_POLICIES) <= set(ALL_POLICIES)


@pytest.mark.parametrize(
    ("policy", "start", "end", "prompt", "expected"),
    [
        ("periodic", 0, 1199, 1200, [512, 1024]),
        ("periodic", 512, 1199, 1200, [1024]),
        ("periodic", 0, 5000, 1024, [512]),  # not the prompt's end (that is `last`'s state)
        ("periodic", 0, 5000, 1025, [512, 1024]),
        ("hash_boundary", 0, 1199, 1200, [1024]),
        ("hash_boundary", 0, 1000, 1200, []),
        ("hash_boundary", 0, 1199, 1024, [512]),
        ("hash_boundary", 0, 500, 400, []),  # a prompt shorter than one unit has none
        # the last multiple of 512, 1024, 2048, ... of the prompt's last token, each once
        ("hash_ladder", 0, 1199, 1200, [1024]),
        ("hash_ladder", 0, 2999, 3000, [2048, 2560]),
        ("hash_ladder", 0, 40159, 40160, [32768, 36864, 38912, 39936]),
        ("hash_ladder", 36864, 40159, 40160, [38912, 39936]),
        ("hash_ladder", 0, 2400, 3000, [2048]),
        ("hash_ladder", 0, 5000, 1024, [512]),
        ("hash_ladder", 0, 500, 512, []),
    ],
    ids=lambda v: str(v),
)
def test_marks(policy, start, end, prompt, expected):
    pol = CheckpointPolicy(policy, _plan(), H, checkpoint_interval=512)
    assert pol.marks(start, end, prompt) == expected
    first = pol.next_mark(start, prompt)
    assert first == (pol.marks(start, prompt - 1, prompt) or [None])[0]


@pytest.mark.parametrize(
    ("policy", "interval", "match"),
    [
        ("periodic", 100, "multiple of the hash unit"),
        ("periodic", 0, "positive multiple"),
        ("hash_boundary", -512, "positive multiple"),
        ("last", 512, "applies to the periodic, hash_boundary and hash_ladder"),
        ("align", 512, "applies to the periodic, hash_boundary and hash_ladder"),
    ],
    ids=["not-a-hash-multiple", "zero", "negative", "last", "align"],
)
def test_bad_interval(policy, interval, match):
    with pytest.raises(ConfigError, match=match):
        HybridAllocator(_plan(), checkpoint_policy=policy, checkpoint_interval=interval)


@pytest.mark.parametrize("exports", [True, False], ids=["exported", "split"])
@pytest.mark.parametrize(
    ("policy", "interval", "shared", "want"),
    [
        ("periodic", 512, 1060, 1024),  # the last multiple of 512 inside the shared part
        ("periodic", 512, 700, 512),
        ("periodic", 256, 700, 512),
        ("hash_boundary", 512, 1060, 1024),  # the first prompt's last 512 boundary
        ("hash_boundary", 512, 700, 0),  # shares less than that boundary: nothing
        ("hash_ladder", 512, 1060, 1024),  # its first rung is hash_boundary's state
        ("hash_ladder", 512, 700, 0),  # 1,100 tokens: one rung (1024)
        ("last", None, 1060, 0),  # the end state (at 1100) is no prefix of the second prompt
    ],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("layout", ["per_group", "inflate"])
def test_second_prompt_hits_inside_the_first(policy, interval, shared, want, exports, layout):
    """With inflate's 576-token blocks the state at 1024 lies in the first prompt's last, partly
    filled block [576, 1152): attention caches that block up to it when the request ends."""
    a = _alloc(policy, interval, exports, layout)
    first = _tokens(1100, seed=1)
    _run_prompt(a, "a", first)
    a.free("a")
    second = first[:shared] + _tokens(300, seed=2)
    assert _run_prompt(a, "b", second) == want
    check_consistency(a)


@pytest.mark.parametrize("exports", [True, False], ids=["exported", "split"])
@pytest.mark.parametrize(
    ("policy", "want"),
    [("hash_boundary", 0), ("hash_ladder", 2048), ("periodic", 2048)],
)
@pytest.mark.parametrize("layout", ["per_group", "inflate"])
def test_a_ladder_reaches_back_where_one_boundary_does_not(policy, want, exports, layout):
    """A 3,000-token prompt (a document, then a 700-token question) and another question on the
    document: hash_boundary's one state (2560) is past the shared 2,200 tokens; the ladder's
    rung at the last multiple of 1024 (2048) serves them, as periodic's every-512 states do."""
    a = _alloc(policy, 512, exports, layout)
    first = _tokens(3000, seed=7)
    _run_prompt(a, "a", first)
    a.free("a")
    assert _run_prompt(a, "b", first[:2200] + _tokens(500, seed=8)) == want
    check_consistency(a)


def test_the_ladder_starts_at_the_state_size_in_kv_tokens():
    """Without an interval, hash_ladder's first rung is the smallest power-of-two multiple of
    the hash unit whose KV weighs at least a state: Qwen3-Next-80B-A3B's state (37.7 MiB) weighs
    1,608 tokens of its KV (24 KiB a token), so 2,048; a model with a smaller state relative to
    its KV starts lower; an attention-only plan at the hash unit."""
    from hybridkv.alloc.policies.hash_ladder import state_sized_scale

    for name, layout in [("qwen3-next-80b-a3b", "inflate"), ("qwen3-next-80b-a3b", "two_level"),
                         ("qwen3.5-0.8b", "per_group"), ("qwen3.5-0.8b", "inflate")]:  # fmt: skip
        plan = make_plan(models.load(name), layout, memory="40GiB", max_num_seqs=8)
        scale = state_sized_scale(plan, H)
        policy = CheckpointPolicy("hash_ladder", plan, H)
        assert policy.interval == scale
        state = sum(plan.id_bytes(g.group_id) for g in plan.state_groups)
        kv = sum(plan.id_bytes(g.group_id) / g.block_size for g in plan.attention_groups)
        assert scale % H == 0 and (scale // H) & (scale // H - 1) == 0  # a power-of-two multiple
        assert scale * kv >= state and (scale == H or scale // 2 * kv < state)
        if name == "qwen3-next-80b-a3b":
            assert scale == 2048
    assert CheckpointPolicy("hash_ladder", plan, H, checkpoint_interval=512).interval == 512
    no_states = SimpleNamespace(state_groups=(), attention_groups=plan.attention_groups)
    assert state_sized_scale(no_states, H) == H


def test_exports_report_slots_and_positions():
    """Exported states come back from the step's commit as ``(group, slot, position)``, one per
    state group and position, into slots cached at those positions."""
    a = _alloc("periodic", 512, exports=True)
    a.add_request("a", _tokens(1600, seed=3))
    assert a.allocate_slots("a", 1600)
    copies = a.take_state_copies()
    positions = sorted({p for _, _, p in a.last_exports})
    assert positions == [512, 1024, 1536]
    assert len(a.last_exports) == 3 * len(_plan().state_groups)
    assert a.num_checkpoints == 3
    assert not any(dst == a.state_slot("a", g) for g, _, dst in copies)
    check_consistency(a)


def test_split_mode_cuts_the_prefill():
    a = _alloc("periodic", 512, exports=False)
    a.add_request("a", _tokens(1200, seed=4))
    assert a.next_checkpoint("a") == 512
    assert a.allocate_slots("a", 512)
    a.take_state_copies()
    assert a.next_checkpoint("a") == 1024
    assert a.num_checkpoints == 1


def _doc_trace(n_docs: int = 3, per_doc: int = 4) -> Trace:
    """Documents asked several questions: each prompt is a document then its own question, so
    prompts share the document's length exactly (not a block multiple)."""
    reqs, t = [], 0.0
    rng = np.random.default_rng(5)
    docs = [_tokens(int(rng.integers(1500, 2600)), seed=10 + d) for d in range(n_docs)]
    for q in range(per_doc):
        for d, doc in enumerate(docs):
            prompt = doc + _tokens(int(rng.integers(20, 200)), seed=100 + 10 * q + d)
            reqs.append(Request(len(reqs), t, np.asarray(prompt), 8, shared_prefix_length=None))
            t += 2.0
    return Trace("docs", tuple(reqs))


@pytest.mark.parametrize("policy", ["periodic", "hash_boundary", "hash_ladder"])
def test_simulator_same_hits_exported_or_split(policy):
    """Exporting the states or ending chunks at them keeps the same states: the same hits."""
    plan, model = _plan("inflate", "4GiB"), models.load("qwen3.5-0.8b")
    trace = _doc_trace()
    got = {}
    for exports in (1, None):
        cfg = SimConfig(
            checkpoint_policy=policy,
            checkpoint_interval=256,
            hash_block_size=H,
            prefill_checkpoint_alignment=exports,
        )
        got[exports] = simulate(plan, model, trace, cfg)
    a, b = got[1], got[None]
    assert a.hit_tokens == b.hit_tokens > 0
    assert a.checkpoints == b.checkpoints > 0
    assert b.steps > a.steps  # split mode runs more, smaller steps


def test_simulator_recovers_what_last_misses_and_reports_its_memory():
    plan, model = _plan("inflate", "4GiB"), models.load("qwen3.5-0.8b")
    trace = _doc_trace()
    res = {
        p: simulate(
            plan,
            model,
            trace,
            SimConfig(
                checkpoint_policy=p,
                hash_block_size=H,
                checkpoint_interval=256 if p in RECOVERY_POLICIES else None,
            ),
        )
        for p in ("last", "periodic", "hash_boundary", "hash_ladder")
    }
    assert res["last"].hit_tokens == 0  # no document ends where a question starts
    assert res["periodic"].hit_tokens > res["hash_boundary"].hit_tokens > 0
    # the ladder keeps hash_boundary's state and more rungs below it
    assert res["periodic"].hit_tokens >= res["hash_ladder"].hit_tokens
    assert res["hash_ladder"].hit_tokens > res["hash_boundary"].hit_tokens
    # periodic keeps a state every 256 tokens of every prompt, hash_boundary one per prompt
    # (where no hit already holds one), last only end states
    c = {p: r.checkpoints for p, r in res.items()}
    assert c["periodic"] > c["hash_ladder"] > c["hash_boundary"] > c["last"]
    for r in res.values():
        s = r.summary()
        per = r.checkpoint_bytes / max(1, r.checkpoints)
        state_page = plan.pool_of(plan.state_groups[0].group_id).block_bytes
        assert per == pytest.approx(len(plan.state_groups) * state_page, rel=0.01)
        assert s["checkpoints"] == r.checkpoints
        assert s["state_gib_mean"] > 0


@pytest.mark.parametrize(
    ("policy", "eviction", "value"),
    [
        ("hash_ladder", "auto", True),  # the ladder's own: Marconi's
        ("hash_ladder", "lru", False),
        ("marconi", "auto", True),
        ("marconi", "lru", False),
        ("hash_boundary", "auto", False),
        ("hash_boundary", "marconi", True),
        ("last", "marconi", True),
    ],
)
def test_eviction_is_the_policys_unless_asked(policy, eviction, value):
    """``AllocatorOptions.eviction``: ``auto`` runs the policy's own (Marconi's for marconi and
    hash_ladder, LRU for the others); ``lru`` / ``marconi`` choose for any policy. Marconi's
    eviction has an alpha (settable), LRU none."""
    options = AllocatorOptions(
        hash_block_size=H,
        checkpoint_policy=policy,
        checkpoint_interval=512 if policy in RECOVERY_POLICIES else None,
        eviction=eviction,
        max_model_len=1 << 16,
    )
    assert options.resolved_eviction() == ("marconi" if value else "lru")
    a = HybridAllocator(_plan(), options)
    assert (a.marconi_alpha is not None) == value
    if value:
        a.marconi_alpha = 0.5
        assert a.marconi_alpha == 0.5
    else:
        with pytest.raises(ValueError, match="eviction='marconi' turns it on"):
            a.marconi_alpha = 0.5


def test_unknown_eviction_is_refused():
    with pytest.raises(ConfigError, match="eviction must be one of auto, lru, marconi"):
        AllocatorOptions(eviction="fifo")


def test_marconi_eviction_keeps_what_is_worth_more_than_lru_does():
    """Documents asked again after other documents filled the cache: LRU loses the first
    document's ladder to the newer ones; Marconi's value per byte keeps the state with the most
    prefill behind it (the longest document) longer. The same ladder serves more with it."""
    plan, model = _plan("inflate", "1GiB"), models.load("qwen3.5-0.8b")
    rng = np.random.default_rng(9)
    docs = [_tokens(int(n), seed=40 + d) for d, n in enumerate(rng.integers(800, 4000, 10))]
    reqs, t = [], 0.0
    for rnd in range(3):
        for d, doc in enumerate(docs):
            prompt = doc + _tokens(30, seed=500 + 10 * rnd + d)
            reqs.append(Request(len(reqs), t, np.asarray(prompt), 4, shared_prefix_length=None))
            t += 1.0
    trace = Trace("docs-again", tuple(reqs))
    hits = {}
    # alpha fixed at 1: the weight of prefill saved is what this is about (30 requests are too
    # few for the default's tuning, which would leave Marconi's starting 0, recency alone)
    for eviction, alpha in (("lru", "auto"), ("marconi", 1.0)):
        cfg = SimConfig(checkpoint_policy="hash_ladder", hash_block_size=H, eviction=eviction,
                        checkpoint_interval=256, marconi_alpha=alpha)  # fmt: skip
        hits[eviction] = simulate(plan, model, trace, cfg).hit_tokens
    assert hits["marconi"] > hits["lru"] > 0
