"""Simulator invariants on small traces."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv import models, traces
from hybridkv.layouts import LAYOUTS, make_plan
from hybridkv.sim import simulate


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
    rows = __import__("json").loads(capsys.readouterr().out)
    ok = [r for r in rows if "error" not in r]
    assert ok and any("too small" in r["error"] for r in rows if "error" in r)
    keys = [(r["ttft_p50_ms"], -r["throughput_tok_s"], -r["hit_rate"]) for r in ok]
    assert keys == sorted(keys)
    assert main(argv) == 0
    assert "recommended:" in capsys.readouterr().out
