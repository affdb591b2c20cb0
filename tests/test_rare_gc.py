"""The simulators run Python's cyclic collector rarely and give the caller's thresholds back."""

from __future__ import annotations

import gc

import pytest

import hybridkv.replay as replay_module
from hybridkv import models, traces
from hybridkv.layouts import make_plan
from hybridkv.rare_gc import SIMULATION_THRESHOLDS, rare_cyclic_gc
from hybridkv.sim import simulate

CALLER = (1234, 7, 9)  # thresholds no default or simulation uses


@pytest.fixture
def caller_thresholds():
    before = gc.get_threshold()
    gc.set_threshold(*CALLER)
    yield
    gc.set_threshold(*before)


def test_thresholds_inside_and_restored(caller_thresholds):
    with rare_cyclic_gc():
        assert gc.get_threshold() == SIMULATION_THRESHOLDS
        with rare_cyclic_gc((5000, 20, 30)):  # nested: the inner ones, then the outer again
            assert gc.get_threshold() == (5000, 20, 30)
        assert gc.get_threshold() == SIMULATION_THRESHOLDS
    assert gc.get_threshold() == CALLER


def test_restored_after_an_error(caller_thresholds):
    with pytest.raises(RuntimeError, match="inside"), rare_cyclic_gc():
        raise RuntimeError("inside")
    assert gc.get_threshold() == CALLER


def test_simulate_and_replay_run_with_them(caller_thresholds, monkeypatch):
    model = models.load("qwen3.5-0.8b")
    plan = make_plan(model, "per_group", memory="1GiB", max_num_seqs=8, block_size=16)
    seen: set[tuple[int, int, int]] = set()
    result = simulate(
        plan,
        model,
        traces.multi_turn_chat(12, seed=3),
        on_step=lambda _: seen.add(gc.get_threshold()),
    )
    assert result.finished == 12 and seen == {SIMULATION_THRESHOLDS}
    assert gc.get_threshold() == CALLER
    # replay has no per-step hook: record the thresholds each request is served under
    serve = replay_module._serve
    served: set[tuple[int, int, int]] = set()

    def recording_serve(*args):
        served.add(gc.get_threshold())
        return serve(*args)

    monkeypatch.setattr(replay_module, "_serve", recording_serve)
    replayed = replay_module.replay(
        plan, traces.multi_turn_chat(12, seed=3), checkpoint_policy="last"
    )
    assert len(replayed.hits) == 12 and served == {SIMULATION_THRESHOLDS}
    assert gc.get_threshold() == CALLER
