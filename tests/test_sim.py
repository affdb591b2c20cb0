"""Simulator invariants on small traces."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hybridkv import models, traces
from hybridkv.layouts import LAYOUTS, make_plan
from hybridkv.sim import SimConfig, simulate


@pytest.fixture(scope="module")
def chat():
    return traces.multi_turn_chat(40, seed=1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_invariants(layout, chat):
    model = models.load("qwen3.5-0.8b")
    plan = make_plan(model, layout, memory="1GiB", max_num_seqs=8, block_size=16)
    result = simulate(plan, model, chat)
    assert result.finished == len(chat)  # no request lost
    assert result.hit_tokens <= result.shared_tokens  # hits only on really shared tokens
    assert result.output_tokens == sum(r.output_length for r in chat)
    held = result.kv_bytes + result.state_bytes
    assert held.size and (held <= plan.config.memory_bytes).all()  # never over budget
    assert result.ttft_s.size == len(chat) and (result.ttft_s > 0).all()


def test_deterministic(chat):
    model = models.load("qwen3.5-0.8b")
    plan = make_plan(model, "pack", memory="1GiB", max_num_seqs=8, block_size=16)
    a, b = simulate(plan, model, chat), simulate(plan, model, chat)
    assert a.summary() == b.summary()
    assert np.array_equal(a.kv_bytes, b.kv_bytes)


def test_preemption_under_memory_pressure():
    model = models.load("qwen3.5-0.8b")
    trace = traces.no_sharing(30, seed=2, rate=1000.0)  # all arrive at once
    plan = make_plan(model, "per_group", memory="600MiB", max_num_seqs=16, block_size=16)
    result = simulate(plan, model, trace)
    assert result.finished == len(trace)
    assert result.preemptions > 0


def test_a_request_larger_than_memory_is_an_error():
    model = models.load("qwen3.5-0.8b")
    trace = traces.no_sharing(30, seed=2, rate=1000.0)
    plan = make_plan(model, "per_group", memory="400MiB", max_num_seqs=16, block_size=16)
    with pytest.raises(RuntimeError, match="cannot fit in the plan's memory"):
        simulate(plan, model, trace)


def test_advise_ranks_and_reports_what_does_not_fit(capsys):
    from hybridkv.cli import main

    argv = ["advise", "--model", "qwen3.5-0.8b", "--gpu-memory", "2GiB", "--requests", "20"]
    assert main([*argv, "--json"]) == 0
    got = __import__("json").loads(capsys.readouterr().out)
    ok, errors = got["results"], got["errors"]
    assert ok and errors and all("too small" in r["error"] for r in errors)
    assert all("error" not in r for r in ok)
    assert got["recommended"] == ok[0]["config"]
    from hybridkv.advise import ADVISED_POLICIES

    assert {r["config"].rsplit(" ", 1)[1] for r in ok + errors} == set(ADVISED_POLICIES)
    keys = [(r["ttft_p50_ms"], -r["throughput_tok_s"], -r["token_hit_rate"]) for r in ok]
    assert keys == sorted(keys)
    assert main(argv) == 0
    assert "recommended:" in capsys.readouterr().out


def _same(a, b):
    assert a.summary() == b.summary()
    assert a.steps == b.steps and a.sim_time_s == b.sim_time_s
    assert a.saved_flops == b.saved_flops
    assert np.array_equal(a.ttft_s, b.ttft_s)
    assert np.array_equal(a.kv_bytes, b.kv_bytes)
    assert np.array_equal(a.state_bytes, b.state_bytes)
    assert np.array_equal(a.sample_t_s, b.sample_t_s)


@pytest.mark.parametrize(
    "layout,policy,kw",
    [
        ("inflate", "align", {}),
        ("per_group", "last", {}),
        ("two_level", "marconi", {}),
        ("pack", "align", {}),
        ("per_group", "align_every_block", {}),
        ("inflate", "align", {"prefix_cache_retention_interval": None}),
        ("pack", "align", {"prefill_checkpoint_alignment": 1, "hash_block_size": 64}),
    ],
)
def test_parked_decoders_give_the_step_by_step_results(layout, policy, kw, chat):
    # fast_decode parks decoding requests between allocator events and counts idle steps in a
    # tight loop; fast_decode=False touches every request every step, as the allocator's
    # protocol describes. The allocator sees the same state-changing calls in the same order.
    from hybridkv.sim import SimConfig

    model = models.load("qwen3.5-0.8b")
    plan = make_plan(model, layout, memory="1GiB", max_num_seqs=8, block_size=16)
    config = SimConfig(checkpoint_policy=policy, **kw)
    fast = simulate(plan, model, chat, config)
    slow = simulate(plan, model, chat, replace(config, fast_decode=False))
    _same(fast, slow)


def test_parked_decoders_under_preemption():
    from hybridkv.sim import SimConfig

    model = models.load("qwen3.5-0.8b")
    trace = traces.no_sharing(30, seed=2, rate=1000.0)
    plan = make_plan(model, "per_group", memory="600MiB", max_num_seqs=16, block_size=16)
    fast = simulate(plan, model, trace)
    assert fast.preemptions > 0
    _same(fast, simulate(plan, model, trace, SimConfig(fast_decode=False)))


def _repeat_trace(prompt_len: int):
    from hybridkv.traces import Request, Trace

    prompt = np.arange(1, prompt_len + 1)
    # the second request arrives long after the first finished
    reqs = (Request(0, 0.0, prompt, 4), Request(1, 100.0, prompt, 4))
    return Trace("repeat", reqs)


def test_saved_flops_by_hand():
    # Qwen3.5-0.8B: 6 full-attention layers (8 query heads, head_dim 256 for K and V), 18 Gated
    # DeltaNet layers (conv state 3 x 6144, recurrent state 16 x 128 x 128), 0.8e9 parameters.
    # A 600-token prompt sent twice: align with 16-token blocks stops the first prefill at its
    # last cacheable block boundary, 592 = (600 - 1) // 16 * 16, and keeps the state there, so
    # the second request hits 592 tokens.
    model = models.load("qwen3.5-0.8b")
    plan = make_plan(model, "per_group", memory="1GiB", max_num_seqs=4, block_size=16)
    result = simulate(plan, model, _repeat_trace(600))
    n = 592
    assert result.hit_tokens == n
    weights = 2 * 0.8e9 * n
    attention = 6 * (2 * 8 * (256 + 256)) * (n * (n + 1) // 2)  # token j attends to j tokens
    recurrent = 6 * 18 * (3 * 6144 + 16 * 128 * 128) * n  # 6 FLOPs per state element per token
    assert result.saved_flops == pytest.approx(weights + attention + recurrent, rel=1e-12)
    assert result.summary()["compute_saved_pflop"] == round(result.saved_flops / 1e15, 3)


def test_align_stops_the_prefill_at_the_last_block_boundary():
    model = models.load("qwen3.5-0.8b")
    plan = make_plan(model, "per_group", memory="1GiB", max_num_seqs=4, block_size=16)
    from hybridkv.sim import SimConfig

    align = simulate(plan, model, _repeat_trace(600), SimConfig(checkpoint_policy="align"))
    assert align.hit_tokens == 592  # (600 - 1) // 16 * 16, kept before the last 8 tokens
    last = simulate(plan, model, _repeat_trace(600), SimConfig(checkpoint_policy="last"))
    # last keeps the end state: its prefill ends at the prompt's last hash boundary (592) and
    # the 3-token answer never reaches the next one (608), so the resend hits there too
    assert last.hit_tokens == 592
    align_every = simulate(
        plan, model, _repeat_trace(600), SimConfig(checkpoint_policy="align_every_block")
    )
    assert align_every.hit_tokens == 592


def test_memory_samples_are_bounded_and_timed(chat):
    from hybridkv.sim import SimConfig

    model = models.load("qwen3.5-0.8b")
    plan = make_plan(model, "two_level", memory="1GiB", max_num_seqs=8, block_size=16)
    full = simulate(plan, model, chat, SimConfig(sample_every=1, max_samples=10**9))
    few = simulate(plan, model, chat, SimConfig(sample_every=1, max_samples=64))
    assert full.kv_bytes.size == full.steps and few.kv_bytes.size < 64
    assert np.all(np.diff(few.sample_t_s) > 0) and few.sample_t_s[-1] <= few.sim_time_s
    # a thinned run keeps a subset of the full run's samples
    idx = np.searchsorted(full.sample_t_s, few.sample_t_s)
    assert np.array_equal(full.kv_bytes[idx], few.kv_bytes)


def test_breakdowns_are_spread_over_the_requests_and_change_nothing_else(chat):
    """``breakdowns=n`` takes at most n byte breakdowns, one per n-th of the requests finished
    (not thinned from the step samples), in time order, each of the whole pool; how many are
    taken changes no hit, step or TTFT."""
    from hybridkv.sim import SimConfig

    model = models.load("qwen3.5-0.8b")
    plan = make_plan(model, "two_level", memory="1GiB", max_num_seqs=8, block_size=16)
    runs = {n: simulate(plan, model, chat, SimConfig(breakdowns=n)) for n in (0, 5, 1000)}
    assert runs[0].breakdown == () and runs[0].breakdown_t_s.size == 0
    assert len(runs[5].breakdown) == 5 == runs[5].breakdown_t_s.size
    # more breakdowns than requests: at most one per step that finishes a request
    assert 5 < len(runs[1000].breakdown) <= len(chat.requests)
    for r in runs.values():
        assert np.all(np.diff(r.breakdown_t_s) >= 0) and np.all(r.breakdown_t_s <= r.sim_time_s)
        assert all(b.total == plan.config.memory_bytes for b in r.breakdown)
        assert r.steps == runs[0].steps and r.hit_tokens == runs[0].hit_tokens
        assert np.array_equal(r.ttft_s, runs[0].ttft_s)
    with pytest.raises(ValueError, match="breakdowns"):
        SimConfig(breakdowns=-1)


def test_ttft_counts_from_when_a_turn_is_sent():
    # a chat turn is sent think_time_s after its parent finished, not at its open-loop arrival
    model = models.load("qwen3.5-0.8b")
    trace = traces.multi_turn_chat(20, seed=1, session_rate=0.5)
    plan = make_plan(model, "inflate", memory="1GiB", max_num_seqs=8, block_size=16)
    result = simulate(plan, model, trace)
    assert result.ttft_s.max() < 5.0  # seconds: prefill of one short prompt plus queueing


@pytest.mark.parametrize("layout", ["inflate", "per_group"])
def test_a_thousand_chat_requests_run_to_the_end(layout):
    # the speed target (10,000 requests in under a minute on 2 cores) is recorded by
    # paper/bench_sim.py, not asserted here: the suite must pass on a busy machine
    model = models.load("qwen3-next-80b-a3b")
    plan = make_plan(model, layout, memory="40GiB")
    trace = traces.multi_turn_chat(1000, seed=0)
    result = simulate(plan, model, trace)
    assert result.finished == 1000
    assert result.output_tokens == sum(r.output_length for r in trace.requests)


def test_a_top_k_sparse_model_is_simulated_with_its_contexts():
    """GLM-5-Next's indexed MLA reads at most its top-k tokens a query: the cost model counts it
    as a window, so the scheduler hands each decode step its contexts (as for sliding windows)
    and the simulation runs to the end."""
    pytest.importorskip("transformers")
    from hybridkv import costmodel as cm
    from hybridkv.e2e import hybrid_model_for, make_tiny_plan
    from hybridkv.e2e.families import TINY_CONFIGS

    config = TINY_CONFIGS["glm5_next"]()
    model = hybrid_model_for(config)
    assert {layer.spec.sparse_topk for layer in model.layers if layer.spec.kind == "mla"} == {19}
    params = cm.ParamCount(1e6, 1e6, "tiny")
    assert cm.StepCoster(model, cm.H100_SXM, params=params).windows, "no contexts asked for"
    plan = make_tiny_plan(config, "two_level", state_slots_per_seq=1)
    steps = []
    r = simulate(
        plan,
        model,
        traces.shared_prefix(12, seed=0),
        SimConfig(checkpoint_policy="last", params=params),
        on_step=steps.append,
    )
    assert r.finished == 12
    decoding = [out for out in steps if out.decode or out.num_parked]
    assert decoding and all(out.decode_contexts for out in decoding)
