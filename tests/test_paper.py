"""``python -m paper.figures`` makes every registered figure, and makes it the same way twice."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def make(*outs: Path) -> None:
    """``--small`` into each of ``outs``, the runs side by side (each is one process: on two
    cores the pair takes about as long as one, where one after the other took twice as long,
    the longest test of the suite)."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "paper.figures", "--small", "--out", str(out)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for out in outs
    ]
    for proc in procs:
        # a guard against a hang only: --small takes minutes on 2 cores, more on a busy machine
        _, err = proc.communicate(timeout=3600)
        assert proc.returncode == 0, err


@pytest.fixture(scope="module")
def registry():
    sys.path.insert(0, str(ROOT))
    try:
        from paper import registry
        from paper.figures import FIGURES  # registers every figure

        yield registry, FIGURES
    finally:
        sys.path.remove(str(ROOT))


def test_figures_command(tmp_path, registry):
    # one test, so that parallel workers do not each run the command twice
    a, b = tmp_path / "a", tmp_path / "b"
    make(a, b)
    check_every_figure_is_made(a, registry)
    check_two_runs_are_identical(a, b)
    results = ROOT / "paper" / "results"
    if not [*results.glob("kernels-*.json"), *results.glob("*/kernels-*.json")]:
        assert "No GPU results" in (a / "kernels.md").read_text()


def check_every_figure_is_made(out, registry):
    _, figures = registry
    manifest = (out / "MANIFEST.md").read_text()
    for name in figures:
        assert f"`{name}`" in manifest
        line = next(x for x in manifest.splitlines() if x.startswith(f"| `{name}` |"))
        assert "skipped" not in line, line
        files = re.findall(r"\]\(([^)]+)\)", line)
        assert files, name
        for f in files:
            assert (out / f).is_file() and (out / f).stat().st_size > 0, f


def check_two_runs_are_identical(a, b):
    files_a = sorted(p.name for p in a.iterdir())
    assert files_a == sorted(p.name for p in b.iterdir())
    assert len([n for n in files_a if n.endswith(".md")]) >= 5
    for name in files_a:
        assert (a / name).read_bytes() == (b / name).read_bytes(), f"{name} differs between runs"


def test_small_runs_write_elsewhere(tmp_path, registry, monkeypatch, capsys):
    """``--small`` without ``--out`` must not overwrite the committed figures."""
    from paper import figures

    committed = ROOT / "paper" / "figures" / "block_sizes.md"
    before = committed.read_bytes()
    monkeypatch.setattr(figures, "SMALL_OUT", tmp_path / "small")
    assert figures.main(["--small", "--only", "block_sizes", "--no-progress"]) == 0
    assert (tmp_path / "small" / "block_sizes.md").exists()
    assert committed.read_bytes() == before
    assert f"written to {tmp_path / 'small'}" in capsys.readouterr().out
    assert (
        figures.SMALL_OUT != figures.OUT and "figures-small" in (ROOT / ".gitignore").read_text()
    )


def test_real_trace_uses_the_simulator_figures_deployment(registry):
    from paper import figures, real_trace

    assert real_trace.DEPLOYMENT == figures.SIM_DEPLOYMENT
    assert real_trace.PER_GROUP_CACHED == figures.PER_GROUP_CACHED


def test_context_map_gives_the_same_results_in_worker_processes(tmp_path, registry):
    from paper.registry import Context

    items = [(3, 4), (10, -2), (7, 7, 1)]
    one = Context(tmp_path).map(sum, items)
    assert one == [7, 8, 15]
    # spawned workers, results back in the items' order
    assert Context(tmp_path, jobs=2).map(sum, items) == one


def test_jobs_below_one_is_an_error(registry, capsys):
    from paper import figures

    with pytest.raises(SystemExit):
        figures.main(["--jobs", "0", "--only", "block_sizes"])
    assert "--jobs must be at least 1, got 0" in capsys.readouterr().err


def test_run_cache_keeps_each_run_and_finds_it_again(tmp_path, registry):
    """``--run-cache``: each run of ``Context.map`` is kept, read back instead of recomputed
    while the code is the same, and keyed by the code's fingerprint."""
    import pickle

    module, _ = registry
    cache = tmp_path / "cache"
    ctx = module.Context(tmp_path / "out", run_cache=cache)
    assert ctx.map(abs, [-3, 4]) == [3, 4]
    assert len(list(cache.glob("*.pkl"))) == 2 and not list(cache.glob("*.part"))
    run = module.CachedRun(abs, cache, module.code_fingerprint())
    run.path(-3).write_bytes(pickle.dumps("kept"))  # read back, not recomputed
    assert ctx.map(abs, [-3, 4]) == ["kept", 4]
    assert module.CachedRun(abs, cache, "other code").path(-3) != run.path(-3)
    assert module.Context(tmp_path / "out").map(abs, [-3]) == [3]  # no cache: computed
