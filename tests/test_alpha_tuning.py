"""Marconi's alpha tuned online (:class:`hybridkv.replay.AlphaTuner`): when it tunes (after the
bootstrap window, again after every window with ``retune``), that :func:`~hybridkv.replay.replay`
keeps tuning once, the simulator's (``marconi_alpha="auto"``, the default) and the
coarse-to-fine search that picks which alphas it replays."""

from __future__ import annotations

import dataclasses
import time

import pytest

from hybridkv import models, traces
from hybridkv.alloc import HybridAllocator
from hybridkv.layouts import make_plan
from hybridkv.replay import AlphaTuner, replay
from hybridkv.sim import SimConfig, simulate

MODEL = "qwen3.5-4b"


@pytest.fixture(scope="module")
def small():
    model = models.load(MODEL)
    # small enough to evict early: the simulator tunes once, after 85 finished requests
    plan = make_plan(model, "two_level", memory="1.5GiB", max_num_seqs=16)
    return model, plan, traces.multi_turn_chat(150, seed=0)


class _Evictions:
    """An allocator stand-in whose pool reports evictions from the ``n``-th observed request on,
    and records the alphas set on it."""

    def __init__(self, first_eviction: int) -> None:
        self.first, self.seen, self.alphas = first_eviction, 0, []

    def stats(self):
        self.seen += 1
        return {"pools": {"p": {"evictions": int(self.seen >= self.first)}}}

    @property
    def marconi_alpha(self):
        return self.alphas[-1] if self.alphas else 0.0

    @marconi_alpha.setter
    def marconi_alpha(self, alpha):
        self.alphas.append(alpha)


@pytest.mark.parametrize("retune, expected", [(False, [15]), (True, [15, 30, 45])])
def test_tunes_after_the_bootstrap_window_and_then_every_window(monkeypatch, retune, expected):
    # first eviction seen at the 3rd request, multiplier 5: a window of 15 requests
    replayed: list[list[int]] = []

    def fake_scores(make, requests, grid, last, *, stride, flops):
        replayed.append([r.request_id for r in requests])
        return {0.0: 1.0, 0.3: 2.0}

    monkeypatch.setattr("hybridkv.replay.alpha_scores", fake_scores)
    alloc = _Evictions(first_eviction=3)
    tuner = AlphaTuner(lambda: None, retune=retune)
    for r in traces.multi_turn_chat(50, seed=1).requests:
        tuner.observe(alloc, r)
    assert tuner.window == 15 and tuner.tuned_at == expected
    assert alloc.alphas == [0.3] * len(expected)
    assert tuner.scores == [{0.0: 1.0, 0.3: 2.0}] * len(expected)
    # each tuning replays the last window of finished requests, in the order they finished
    assert replayed == [list(range(n - 15, n)) for n in expected]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bootstrap_multiplier": 0}, "bootstrap_multiplier must be >= 1"),
        ({"grid": ()}, "empty"),
        ({"stride": 0}, "stride must be an integer >= 1, got 0"),
    ],
)
def test_bad_tuner_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AlphaTuner(lambda: None, **kwargs)


def test_replay_tunes_once(small):
    _, plan, trace = small
    # a grid of two (Marconi's has 21: the same rule, a tenth of the replays)
    r = replay(plan, trace, alpha_grid=(0.0, 1.5))
    assert r.alpha_tuned_at is not None and r.marconi_alpha in (0.0, 1.5)


def test_the_simulator_tunes_online(small):
    model, plan, trace = small
    fixed = simulate(plan, model, trace, SimConfig(checkpoint_policy="marconi", marconi_alpha=1.0))
    assert fixed.marconi_alpha == 1.0 and fixed.alpha_tuned_at == ()
    assert fixed.alpha_tuning_s == 0.0  # nothing tuned, no replay timed
    config = SimConfig(checkpoint_policy="marconi", retune_marconi_alpha=True)
    t0 = time.perf_counter()
    tuned = simulate(plan, model, trace, config)
    wall = time.perf_counter() - t0
    assert len(tuned.alpha_tuned_at) >= 1
    window = tuned.alpha_tuned_at[0]
    assert all(b - a >= window for a, b in zip(tuned.alpha_tuned_at, tuned.alpha_tuned_at[1:]))
    assert 0.0 <= tuned.marconi_alpha <= 2.0
    # the replays are timed apart: some of the run's wall time, not all of it
    assert 0.0 < tuned.alpha_tuning_s < wall


def test_tuning_needs_marconi(small):
    model, plan, trace = small
    with pytest.raises(ValueError, match="'last' runs without \\(eviction='marconi' turns"):
        config = SimConfig(checkpoint_policy="last", retune_marconi_alpha=True)
        simulate(plan, model, trace, config)
    with pytest.raises(ValueError, match="'marconi' runs without"):
        config = SimConfig(checkpoint_policy="marconi", eviction="lru", retune_marconi_alpha=True)
        simulate(plan, model, trace, config)
    with pytest.raises(ValueError, match=r"which marconi_alpha=0\.5 fixes; leave marconi_alpha"):
        config = SimConfig(checkpoint_policy="marconi", marconi_alpha=0.5)
        simulate(plan, model, trace, dataclasses.replace(config, retune_marconi_alpha=True))
    # a fixed alpha where nothing evicts by Marconi's utility would be ignored: refused
    with pytest.raises(ValueError, match=r"marconi_alpha=0\.5 weighs Marconi's eviction, which "
                       "checkpoint_policy 'last' with eviction='auto' runs without"):  # fmt: skip
        SimConfig(checkpoint_policy="last", marconi_alpha=0.5)
    # the default under LRU eviction: nothing to tune, nothing refused
    plain = simulate(plan, model, trace, SimConfig(checkpoint_policy="last"))
    assert plain.marconi_alpha is None and plain.alpha_tuned_at == ()


def test_the_shadow_allocator_is_fresh(small):
    # the tuner replays on new allocators: the served one's cache is not touched by a tuning
    _, plan, _ = small
    made: list[HybridAllocator] = []

    def make():
        made.append(HybridAllocator(plan, checkpoint_policy="marconi"))
        return made[-1]

    a, b = make(), make()
    assert a is not b and len(a.index) == len(b.index) == 0


def test_paper_alpha_online_writes_its_table(tmp_path):
    import json

    from paper import alpha_online

    assert alpha_online.main(["--requests", "40", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "alpha-online.json").read_text())["rows"]
    assert [(r["seed"], r["layout"], r["setting"]) for r in rows] == [
        (seed, layout, label)
        for seed in alpha_online.SEEDS
        for layout in alpha_online.LAYOUTS
        for label in alpha_online.SETTINGS
    ]
    assert [r["alpha_end"] for r in rows[:2]] == [1.0, 0.0]
    assert all(len(r["choices"]) == len(r["tuned_at"]) for r in rows)
    assert "| 0 | two_level | tuned online |" in (tmp_path / "alpha-online.md").read_text()
    assert all(r["alpha_tuning_s"] == 0.0 for r in rows if not r["tuned_at"])


def test_paper_alpha_online_tables_the_first_tunings_scores():
    from paper import alpha_online

    base = {"seed": 0, "layout": "two_level", "token_hit_rate": 0.5, "compute_saved_pflop": 1.0,
            "ttft_p50_ms": 10.0, "ttft_p90_ms": 20.0, "wall_s": 2.0}  # fmt: skip
    rows = [
        dict(base, setting="alpha 1.0", tuned_at=[], choices=[], alpha_tuning_s=0.0, scores=[]),
        dict(base, setting="whole", tuned_at=[9], choices=[0.1], alpha_tuning_s=1.5,
             scores=[{"0": 1.5, "0.1": 1.66, "2": 1.6}]),
        dict(base, setting="coarse", tuned_at=[9], choices=[2.0], alpha_tuning_s=0.5,
             scores=[{"0": 1.5, "2": 1.6}, {"0": 1.0}]),
    ]  # fmt: skip
    meta = {"what": "w", "date": "d", "machine": "m", "cpus": 2, "commit": "c" * 12, "argv": []}
    text = alpha_online.table(rows, meta)
    assert "| 0 | two_level | whole | 50.0% | 1.00 | 10 / 20 | 9: 0.1 | 2.0 | 1.5 |" in text
    # the first tuning's scores only, one column per alpha any search tried, blank where not
    assert "| seed | layout | alpha | 0 | 0.1 | 2 |" in text
    assert "| 0 | two_level | whole | 1.500 | 1.660 | 1.600 |" in text
    assert "| 0 | two_level | coarse | 1.500 |  | 1.600 |" in text
    assert "| 0 | two_level | alpha 1.0 | 1.500" not in text


def test_the_simulator_tunes_once_by_default(small):
    """The default: one tuning, on the first window (Marconi's simulator), coarse to fine (9 of
    Marconi's 21 alphas); each tuning's choice and scores are recorded and the last choice is
    the alpha at the end. Retuning tunes first at the same point, with the same choice."""
    model, plan, trace = small
    once = simulate(plan, model, trace, SimConfig(checkpoint_policy="marconi"))
    again = simulate(
        plan, model, trace, SimConfig(checkpoint_policy="marconi", retune_marconi_alpha=True)
    )
    assert len(once.alpha_tuned_at) == len(once.alpha_choices) == 1
    assert once.alpha_tuned_at[0] == again.alpha_tuned_at[0]
    assert once.alpha_choices[0] == again.alpha_choices[0] == once.marconi_alpha
    assert len(again.alpha_choices) == len(again.alpha_tuned_at)
    assert again.alpha_choices[-1] == again.marconi_alpha
    # the scores: 9 alphas tried, the choice the best of them
    (scores,) = once.alpha_scores
    assert len(scores) == 9 and scores[once.alpha_choices[0]] == max(scores.values())
    assert len(again.alpha_scores) == len(again.alpha_tuned_at)


def test_hash_ladder_tunes_too(small):
    # Marconi's eviction is hash_ladder's own: its alpha is tuned the same way
    model, plan, trace = small
    r = simulate(plan, model, trace, SimConfig(checkpoint_policy="hash_ladder"))
    assert len(r.alpha_tuned_at) == 1 and r.marconi_alpha == r.alpha_choices[0]


@pytest.mark.parametrize(
    ("n", "stride", "tried"),
    [
        (21, 1, list(range(21))),
        # coarse 0, 5, 10, 15, 20; best 10 -> its neighbours 8, 9, 11, 12
        (21, 5, [0, 5, 10, 15, 20, 8, 9, 11, 12]),
        # the last value is always in the coarse pass; neighbours clipped at the ends
        (7, 4, [0, 4, 6, 2, 3, 5]),
    ],
)
def test_coarse_to_fine_tries_each_value_once(n, stride, tried):
    from hybridkv.replay import coarse_to_fine

    peak = {21: 10, 7: 4}[n]
    calls: list[int] = []

    def score(alpha: float) -> float:
        calls.append(round(alpha * 10))
        return -abs(alpha * 10 - peak)

    coarse_to_fine([i / 10 for i in range(n)], stride, score)
    assert calls == tried


def test_coarse_to_fine_finds_the_grid_best_on_a_smooth_score():
    from hybridkv.replay import best_alpha, coarse_to_fine

    grid = [round(0.1 * i, 1) for i in range(21)]
    for peak in grid:
        scores: dict[float, float] = {}

        def score(alpha: float, peak: float = peak, scores: dict = scores) -> float:
            scores[alpha] = -((alpha - peak) ** 2)
            return scores[alpha]

        coarse_to_fine(grid, 5, score)
        assert best_alpha(scores, grid) == peak and len(scores) <= 9


def test_best_alpha_breaks_ties_in_grid_order():
    from hybridkv.replay import best_alpha

    assert best_alpha({0.5: 3.0, 0.0: 3.0, 1.0: 1.0}, (0.0, 0.5, 1.0)) == 0.0
    assert best_alpha({0.5: 3.0, 1.0: 4.0}, (0.0, 0.5, 1.0)) == 1.0
