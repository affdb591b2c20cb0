"""Where a sweep's independent runs execute: this process, a local process pool, or Ray.

A sweep (``hybridkv advise``, ``python -m paper.figures``) is many simulations that share
nothing but their inputs. An :class:`Executor` has one job: apply a module-level function to
picklable items and give the results back in the items' order. Which executor runs them never
changes a result: the runs are deterministic and each one is computed whole, by the same code,
wherever it runs, so a sweep's output is byte-identical across executors (the tests check it).

- ``local`` (the default): ``jobs`` spawned worker processes of this machine, or this process
  itself when ``jobs`` is 1.
- ``ray``: Ray tasks. With ``RAY_ADDRESS`` set (``ray://head:10001``, ``head:6379``, ``auto``)
  it connects to that cluster and uploads the packages the tasks run (runtime-env
  ``py_modules``), so the nodes run this checkout's code and need only its dependencies;
  otherwise it starts a local Ray of ``jobs`` CPUs (all of them when ``jobs`` is not given)
  and stops it when done. Ray is imported only here and only when asked for.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pickle
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

__all__ = [
    "EXECUTORS",
    "Executor",
    "ExecutorOptions",
    "ExecutorUnavailable",
    "LocalExecutor",
    "RayExecutor",
    "add_executor_arguments",
    "executor_options",
    "open_executor",
]

#: the executors a command line offers (``--executor``), the default first
EXECUTORS = ("local", "ray")

#: what to install when ``--executor ray`` is asked for and Ray is missing
RAY_INSTALL = 'pip install "ray[client]>=2.9" (hybridkv\'s "ray" extra: pip install -e ".[ray]")'


class ExecutorUnavailable(ImportError):
    """The executor asked for cannot run here (Ray is not installed); the message says what
    to install. An ImportError, so that code catching a missing optional dependency sees it."""


@dataclass(frozen=True)
class ExecutorOptions:
    """Which executor runs a sweep, and how wide.

    ``jobs``: for ``local``, the worker processes (None or 1: in this process, no pool); for
    ``ray``, the CPUs of a local Ray it starts (None: all of this machine's); a cluster's size
    is the cluster's, so ``jobs`` does not apply to one. ``packages``: the top-level packages
    whose code the tasks run; uploaded to a Ray cluster when connecting to one (a local Ray
    finds them where this process does)."""

    kind: str = "local"
    jobs: int | None = None
    packages: tuple[str, ...] = ("hybridkv",)

    def __post_init__(self) -> None:
        if self.kind not in EXECUTORS:
            raise ValueError(f"unknown executor {self.kind!r}; known: {', '.join(EXECUTORS)}")
        if self.jobs is not None and self.jobs < 1:
            raise ValueError(f"jobs must be at least 1, got {self.jobs}")


class _Unset:
    """The ``shared`` argument left out (None is a value a caller may share)."""

    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()


class Executor(ABC):
    """Maps a module-level function over picklable items; results in the items' order.

    ``shared``: one object every call needs (a model, a trace), passed as the function's first
    argument, ``fn(shared, item)``; it is sent to each worker once instead of with every item.
    An executor is a context manager: leaving it releases what it started."""

    @abstractmethod
    def imap(
        self, fn: Callable[..., Any], items: Iterable[Any], shared: Any = _UNSET
    ) -> Generator[Any, None, None]:
        """The results one at a time, in the items' order, as they become available (a
        progress bar can follow them)."""

    def map(self, fn: Callable[..., Any], items: Iterable[Any], shared: Any = _UNSET) -> list[Any]:
        """``[fn(x) for x in items]`` (``[fn(shared, x) ...]`` with ``shared``)."""
        return list(self.imap(fn, items, shared))

    def close(self) -> None:  # noqa: B027  (a no-op unless an executor starts something)
        """Release what this executor started (nothing for a local one)."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# ---- local ----------------------------------------------------------------------------------
#: a pool worker's copy of the map's ``shared`` object, set once by the pool's initializer
_WORKER_SHARED: Any = _UNSET


def _install_shared(shared: Any) -> None:
    global _WORKER_SHARED
    _WORKER_SHARED = shared


def _call_with_worker_shared(task: tuple[Callable[..., Any], Any]) -> Any:
    fn, item = task
    return fn(_WORKER_SHARED, item)


class LocalExecutor(Executor):
    """``jobs`` spawned worker processes, one pool per map; this process when ``jobs <= 1`` or
    there is one item. Workers are spawned, not forked, so nothing the parent holds (threads,
    open files, a running Ray) leaks into them."""

    def __init__(self, jobs: int | None = None) -> None:
        self.jobs = jobs or 1

    def imap(
        self, fn: Callable[..., Any], items: Iterable[Any], shared: Any = _UNSET
    ) -> Generator[Any, None, None]:
        items = list(items)
        if self.jobs <= 1 or len(items) <= 1:
            for x in items:
                yield fn(x) if shared is _UNSET else fn(shared, x)
            return
        # imported here: a command line that runs nothing in parallel does not pay for them
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        spawn = multiprocessing.get_context("spawn")
        initargs = () if shared is _UNSET else (shared,)
        pool = ProcessPoolExecutor(
            min(self.jobs, len(items)),
            mp_context=spawn,
            initializer=_install_shared if initargs else None,
            initargs=initargs,
        )
        try:
            if shared is _UNSET:
                yield from pool.map(fn, items)
            else:
                yield from pool.map(_call_with_worker_shared, [(fn, x) for x in items])
        finally:  # a consumer that stops early (or an error) cancels what has not started
            pool.shutdown(wait=True, cancel_futures=True)


# ---- ray ------------------------------------------------------------------------------------
def _ray_call(fn: Callable[..., Any], item: Any, *shared: bytes) -> bytes:
    """The Ray task: ``fn(item)``, or ``fn(shared, item)``. The shared object comes pickled and
    the result goes back pickled: Ray would otherwise hand NumPy arrays over zero-copy from its
    object store, read-only, where the local executors give writable ones."""
    args = (*(pickle.loads(blob) for blob in shared), item)
    return pickle.dumps(fn(*args), protocol=pickle.HIGHEST_PROTOCOL)


#: set by ``ray job submit``: the job's runtime environment, which then decides what the nodes
#: run (ray.init refuses a second one with the same fields)
_RAY_JOB_CONFIG = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ExecutorUnavailable(
            f"--executor ray needs Ray, which is not installed here ({exc}); install it with: "
            f"{RAY_INSTALL}"
        ) from exc
    return ray


class RayExecutor(Executor):
    """Ray tasks of one CPU each. Ray is imported when the executor is made (a missing Ray is
    an error before any work) and initialised at the first map (a command that maps nothing
    never starts it).

    Where it runs: a Ray this process already initialised is used as it is and left running;
    otherwise ``RAY_ADDRESS`` names a cluster to connect to (with ``options.packages``
    uploaded, so every node runs this code), and without it a local Ray of ``options.jobs``
    CPUs is started. :meth:`close` disconnects from a cluster (which keeps running) and stops
    a local Ray it started."""

    def __init__(self, options: ExecutorOptions | None = None) -> None:
        self.options = options or ExecutorOptions("ray")
        self._ray = _import_ray()
        self._initialised_here = False
        self._remote: Any = None

    def _connect(self) -> Any:
        ray = self._ray
        if self._remote is not None:
            return self._remote
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS") or None
            if address is None:
                # "local", not None: None would join a cluster `ray start` left on this machine
                ray.init(address="local", num_cpus=self.options.jobs, include_dashboard=False)
            else:
                ray.init(address=address, runtime_env=self._runtime_env())
            self._initialised_here = True
        self._remote = ray.remote(_ray_call)
        return self._remote

    def _runtime_env(self) -> dict[str, Any] | None:
        """What a cluster's workers need to run this code: the packages themselves (their
        dependencies must be installed on the nodes). A ``ray job submit`` job brings its own
        runtime environment, which is left as it is."""
        if _RAY_JOB_CONFIG in os.environ or not self.options.packages:
            return None
        # paths, not module objects: a Ray Client (ray://) connection pickles the runtime env
        folders = [importlib.import_module(p).__path__[0] for p in self.options.packages]
        return {"py_modules": folders}

    def imap(
        self, fn: Callable[..., Any], items: Iterable[Any], shared: Any = _UNSET
    ) -> Generator[Any, None, None]:
        items = list(items)
        if not items:
            return
        remote = self._connect()
        ray = self._ray
        extra: tuple[Any, ...] = ()
        if shared is not _UNSET:  # stored once; each task reads it from Ray's object store
            extra = (ray.put(pickle.dumps(shared, pickle.HIGHEST_PROTOCOL)),)
        # Submitted all at once; Ray queues what its CPUs cannot take yet. Tasks left running by
        # an error or a consumer that stops early are not cancelled (ray.cancel races a task's
        # completion in some Ray releases and aborts the driver): they end with the driver's
        # job, at close() or at exit.
        for ref in [remote.remote(fn, x, *extra) for x in items]:
            yield pickle.loads(ray.get(ref))

    def close(self) -> None:
        if self._initialised_here:
            self._ray.shutdown()
            self._initialised_here = False
        self._remote = None


def open_executor(options: ExecutorOptions | None = None) -> Executor:
    """The executor ``options`` ask for (``local`` by default), to be used as a context
    manager. Raises :class:`ExecutorUnavailable` when it needs what is not installed."""
    options = options or ExecutorOptions()
    if options.kind == "ray":
        return RayExecutor(options)
    return LocalExecutor(options.jobs)


# ---- command lines --------------------------------------------------------------------------
def add_executor_arguments(parser: argparse.ArgumentParser, runs: str) -> None:
    """``--executor`` and ``--jobs``, with the same meaning in every command that sweeps
    (``runs``: what they spread, for the help)."""
    parser.add_argument(
        "--executor",
        choices=EXECUTORS,
        default=EXECUTORS[0],
        help=f"where {runs} execute: local (this machine: --jobs worker processes) or ray (the "
        "Ray cluster at RAY_ADDRESS, else a local Ray of --jobs CPUs; needs hybridkv's "
        '"ray" extra) (default local; the results do not depend on it)',
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="local: worker processes (default 1: all in this process); ray: the CPUs of the "
        "local Ray it starts (default: all of this machine's; a cluster has its own)",
    )


def executor_options(
    args: argparse.Namespace,
    packages: tuple[str, ...] = ("hybridkv",),
    parser: argparse.ArgumentParser | None = None,
) -> ExecutorOptions:
    """The :class:`ExecutorOptions` of parsed ``--executor`` / ``--jobs``. A bad ``--jobs`` is
    a usage error reported by ``parser`` when given, else a ValueError naming the flag."""
    if args.jobs is not None and args.jobs < 1:
        message = f"--jobs must be at least 1, got {args.jobs}"
        if parser is not None:
            parser.error(message)
        raise ValueError(message)
    return ExecutorOptions(args.executor, args.jobs, packages)
