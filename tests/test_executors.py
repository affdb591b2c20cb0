"""Executors (``hybridkv.executors``): a sweep's results are byte-identical whether its runs go
to this process, a local process pool or Ray (a local Ray of 2 CPUs, started once for the
module, and the same Ray joined at ``RAY_ADDRESS`` by another process); a missing Ray is a
clear error; the CLI imports Ray only when asked.

The Ray tests skip only where Ray is not importable; ``pip install -e ".[dev]"`` installs it."""

from __future__ import annotations

import hashlib
import operator
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridkv.cli import main
from hybridkv.executors import (
    ExecutorOptions,
    ExecutorUnavailable,
    LocalExecutor,
    RayExecutor,
    open_executor,
)

ROOT = Path(__file__).resolve().parents[1]
ADVISE = ["advise", "--model", "qwen3.5-0.8b", "--gpu-memory", "4GiB", "--requests", "12"]
ADVISE += ["--json", "--no-progress"]


# ---- the runs the figures map, small ------------------------------------------------------------
def _figure_runs() -> list[tuple]:
    """``(function, tasks)`` for each module whose figure maps runs: the simulator figures,
    the real-trace figure and the Marconi comparison, a few short runs each."""
    sys.path.insert(0, str(ROOT))
    try:
        from paper import figures, marconi_gap, real_trace
    finally:
        sys.path.remove(str(ROOT))
    return [
        (
            figures._sim_run,
            [
                (30, "chat", "inflate", "align"),
                (30, "chat", "two_level", "last"),
                (30, "agentic sessions", "per_group+cache", "align"),
                (30, "shared system prompt", "pack", "last"),
            ],
        ),
        (real_trace._run, [(20, "blocks", "inflate", "periodic 512", "periodic", 512)]),
        (marconi_gap._gap_run, [("two_level", marconi_gap.CAPACITIES[0], "marconi", "", 20)]),
    ]


def _pickles(executor) -> list[bytes]:
    """Every run's result, pickled: equal bytes mean equal results down to every float."""
    return [
        pickle.dumps(result) for fn, tasks in _figure_runs() for result in executor.map(fn, tasks)
    ]


@pytest.fixture(scope="module")
def serial() -> list[bytes]:
    return _pickles(LocalExecutor(1))


@pytest.fixture(scope="module")
def advice_local() -> str:
    """``hybridkv advise --json`` with the default executor (one process)."""
    return _advise_json([])


def _advise_json(extra: list[str]) -> str:
    from contextlib import redirect_stdout
    from io import StringIO

    out = StringIO()
    with redirect_stdout(out):
        assert main([*ADVISE, *extra]) == 0
    return out.getvalue()


# ---- local ----------------------------------------------------------------------------------
def test_a_local_pool_gives_the_serial_results_byte_for_byte(serial):
    assert _pickles(LocalExecutor(2)) == serial


def test_shared_is_the_first_argument_and_order_is_kept():
    for executor in (LocalExecutor(1), LocalExecutor(2)):
        assert executor.map(operator.sub, [1, 2, 3], shared=10) == [9, 8, 7]
        assert executor.map(abs, []) == []


def test_a_failing_run_raises_its_error():
    for executor in (LocalExecutor(1), LocalExecutor(2)):
        with pytest.raises(ValueError, match="invalid literal"):
            executor.map(int, ["1", "x"])


def test_options_are_checked(capsys):
    with pytest.raises(ValueError, match="unknown executor 'dask'"):
        ExecutorOptions("dask")
    with pytest.raises(ValueError, match="jobs must be at least 1"):
        ExecutorOptions("local", jobs=0)
    assert main([*ADVISE, "--jobs", "0"]) == 2
    assert "--jobs must be at least 1, got 0" in capsys.readouterr().err


def test_advise_on_a_local_pool_gives_the_same_json(advice_local):
    assert _advise_json(["--jobs", "2"]) == advice_local


# ---- Ray missing --------------------------------------------------------------------------------
def test_a_missing_ray_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as where it is missing
    with pytest.raises(ExecutorUnavailable, match=r'pip install "ray\[client\]>=2.9"'):
        open_executor(ExecutorOptions("ray"))
    assert main([*ADVISE, "--executor", "ray"]) == 2
    err = capsys.readouterr().err
    assert "--executor ray needs Ray, which is not installed" in err
    assert 'pip install -e ".[ray]"' in err

    sys.path.insert(0, str(ROOT))
    try:
        from paper import figures
    finally:
        sys.path.remove(str(ROOT))
    assert figures.main(["--executor", "ray", "--only", "block_sizes", "--no-progress"]) == 2
    assert "needs Ray" in capsys.readouterr().err


def test_the_cli_imports_no_ray_unless_asked():
    argv = [*ADVISE, "--requests", "3"]  # the last --requests counts
    code = (
        "import sys; from hybridkv.cli import main; "
        f"assert main({argv!r}) == 0; "
        "assert 'ray' not in sys.modules, 'ray was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ---- Ray ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_address():
    """A local Ray of 2 CPUs for the module (its address, for another process to join); the
    executors find it initialised, use it and leave it running."""
    ray = pytest.importorskip("ray")
    saved = os.environ.pop("RAY_ADDRESS", None)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved


def test_ray_gives_the_serial_results_byte_for_byte(ray_address, serial):
    import ray

    with open_executor(ExecutorOptions("ray")) as executor:
        assert isinstance(executor, RayExecutor)
        assert _pickles(executor) == serial
        assert executor.map(operator.sub, [1, 2, 3], shared=10) == [9, 8, 7]
        with pytest.raises(ValueError, match="invalid literal"):
            executor.map(int, ["1", "x"])
        # arrays come back writable, as from the local executors (not Ray's read-only views)
        assert executor.map(np.arange, [100_000])[0].flags.writeable
    assert ray.is_initialized()  # a Ray it did not start is left as it was


def test_advise_on_ray_gives_the_same_json(ray_address, advice_local):
    assert _advise_json(["--executor", "ray"]) == advice_local


def test_a_cluster_at_ray_address_is_joined_and_left_running(ray_address, advice_local):
    """Another process joins the Ray at ``RAY_ADDRESS`` (as a driver joins a cluster: the
    package is uploaded), gives the same advice, and disconnects without stopping it."""
    import ray

    env = {**os.environ, "RAY_ADDRESS": ray_address}
    argv = [sys.executable, "-m", "hybridkv.cli", *ADVISE, "--executor", "ray"]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == advice_local
    assert ray.get(ray.put("still up")) == "still up"


def test_a_local_ray_is_started_with_jobs_cpus_and_stopped():
    """Without ``RAY_ADDRESS`` (and no Ray initialised) the executor starts a local Ray of
    ``jobs`` CPUs for its maps and stops it on leaving (another process: this one may hold
    the module's Ray)."""
    pytest.importorskip("ray")
    code = """
import operator, ray
from hybridkv.executors import ExecutorOptions, open_executor
with open_executor(ExecutorOptions("ray", jobs=2)) as executor:
    assert not ray.is_initialized()  # started at the first map, not before
    assert executor.map(operator.sub, [1, 2, 3], shared=10) == [9, 8, 7]
    assert ray.cluster_resources()["CPU"] == 2
assert not ray.is_initialized(), "the local Ray was left running"
"""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_cluster_of_two_nodes_spreads_the_runs_and_gives_the_serial_results(serial):
    """A Ray cluster of two nodes (two raylets on this machine, one CPU each:
    ``ray.cluster_utils.Cluster``, as a head and a worker joined with ``ray start``): the
    executor joins it, its runs land on both nodes, and the results are the serial ones byte
    for byte (another process: this one may hold the module's Ray)."""
    pytest.importorskip("ray")
    code = f"""
import hashlib, pickle, sys, time
sys.path.insert(0, {str(ROOT / "tests")!r})
import ray
from ray.cluster_utils import Cluster
from hybridkv.executors import ExecutorOptions, RayExecutor, open_executor
import test_executors

# small object stores: two nodes share this machine's memory (the results are a few MB)
store = 200 * 2**20
head = {{"num_cpus": 1, "include_dashboard": False, "object_store_memory": store}}
cluster = Cluster(initialize_head=True, head_node_args=head)
cluster.add_node(num_cpus=1, object_store_memory=store)
cluster.wait_for_nodes()
ray.init(address=cluster.address, log_to_driver=False)

def node_of(i):
    time.sleep(0.5)  # long enough that both nodes take some of the eight
    return ray.get_runtime_context().get_node_id()

try:
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    with open_executor(ExecutorOptions("ray")) as executor:
        assert isinstance(executor, RayExecutor)
        print("nodes", len(set(executor.map(node_of, range(8)))))
        for result in test_executors._pickles(executor):
            print("run", hashlib.sha256(result).hexdigest())
finally:
    ray.shutdown()
    cluster.shutdown()
"""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split()
    assert lines[:2] == ["nodes", "2"], proc.stdout
    runs = [lines[i + 1] for i, word in enumerate(lines) if word == "run"]
    assert runs == [hashlib.sha256(result).hexdigest() for result in serial]
