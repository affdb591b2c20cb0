"""A registry of figure functions and the plumbing that makes their output reproducible.

One figure is one function that makes one point (its ``message``); it writes its files through
:class:`Context` and returns their paths, or raises :class:`Skip` with the reason it cannot run
(e.g. the GPU results it draws are not committed). :func:`run` calls them in order and writes
``MANIFEST.md``: every figure, its message, its files or why it was skipped.

Reproducibility: matplotlib runs on the Agg backend with fixed rcParams; PNGs are written
without the ``Software`` text chunk, SVGs with a fixed ``svg.hashsalt`` and no date, so two runs
on the same software give byte-identical files. Nothing random is drawn without a fixed seed.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from tqdm import tqdm

from hybridkv.executors import Executor, LocalExecutor

__all__ = [
    "FIGURES",
    "PACKAGES",
    "CachedRun",
    "Context",
    "Figure",
    "Outcome",
    "Skip",
    "code_fingerprint",
    "register",
    "run",
]

#: the packages the figures' runs execute: what a Ray cluster's nodes are sent
#: (:class:`hybridkv.executors.ExecutorOptions`), since ``paper`` is not installed with hybridkv
PACKAGES = ("hybridkv", "paper")

_RC = {
    "figure.dpi": 100,
    "savefig.dpi": 130,
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "svg.hashsalt": "hybridkv",
    "path.simplify": True,
}


class Skip(Exception):
    """Raised by a figure function that cannot run here; the message says why."""


@dataclass(frozen=True)
class Context:
    """Where figures go and how big the runs are (``small``: a fast subset for tests), and where
    a figure's independent runs execute (:meth:`map`): ``executor`` (a
    :class:`hybridkv.executors.Executor`: a process pool, Ray), else ``jobs`` local worker
    processes.

    A figure whose point depends on its numbers states it with :meth:`summary`, computed from
    the data it drew; the manifest then shows that instead of the registered message, so no
    summary can claim what its own table contradicts."""

    out: Path
    small: bool = False
    jobs: int = 1
    summaries: dict[str, str] = field(default_factory=dict, compare=False)
    executor: Executor | None = field(default=None, compare=False)
    #: keep each run of :meth:`map` here (:class:`CachedRun`), so that a regeneration stopped
    #: half way resumes from the runs it finished (None: keep nothing)
    run_cache: Path | None = None

    def summary(self, name: str, text: str) -> str:
        """Record the summary of figure ``name``, computed from its data; returns it."""
        self.summaries[name] = text
        return text

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        """``[fn(x) for x in items]``, on :attr:`executor`, or over up to ``jobs`` spawned
        worker processes when ``jobs > 1`` (``fn`` must be a module-level function and
        ``items`` picklable). The runs are deterministic, so the results depend on neither.
        With :attr:`run_cache`, each run's result is kept there and found again by later calls
        while the code and data are the same (:class:`CachedRun`)."""
        if self.run_cache is not None:
            fn = CachedRun(fn, self.run_cache, code_fingerprint())
        return (self.executor or LocalExecutor(self.jobs)).map(fn, items)

    def save(self, fig: Any, name: str) -> Path:
        """Save a matplotlib figure as ``name.png`` deterministically and close it."""
        path = self.out / f"{name}.png"
        fig.savefig(path, metadata={"Software": None}, bbox_inches="tight")
        plt.close(fig)
        return path

    def table(self, name: str, text: str) -> Path:
        """Write a Markdown table (or note) ``name.md``."""
        path = self.out / f"{name}.md"
        path.write_text(text.rstrip() + "\n")
        return path


_ROOT = Path(__file__).resolve().parents[1]


def code_fingerprint() -> str:
    """SHA-256 of every file a figure's run reads from this checkout: the packages' Python
    (``hybridkv``, ``kernels``, ``paper``) and ``hybridkv``'s data (the zoo, the traces), by
    path and contents. Any change to them makes every cached run stale."""
    h = hashlib.sha256()
    files = [
        *(_ROOT / "hybridkv").rglob("*"),
        *(_ROOT / "kernels").rglob("*.py"),
        *(_ROOT / "paper").glob("*.py"),
    ]
    for path in sorted(p for p in files if p.is_file() and "__pycache__" not in p.parts):
        h.update(str(path.relative_to(_ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@dataclass(frozen=True)
class CachedRun:
    """``fn`` with its result for each item kept in ``directory`` (one pickle a run, written by
    the worker that made it, so a stopped map keeps what finished), keyed by ``fn``'s name,
    the item's ``repr`` and ``code`` (:func:`code_fingerprint`). Picklable, so that it runs in
    worker processes as ``fn`` would."""

    fn: Callable[[Any], Any]
    directory: Path
    code: str

    def path(self, item: Any) -> Path:
        key = f"{self.fn.__module__}.{self.fn.__qualname__}|{self.code}|{item!r}"
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()}.pkl"

    def __call__(self, item: Any) -> Any:
        path = self.path(item)
        if path.exists():
            return pickle.loads(path.read_bytes())
        result = self.fn(item)
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".part")
        partial.write_bytes(pickle.dumps(result))
        partial.replace(path)  # whole or absent: a run stopped while writing leaves no entry
        return result


@dataclass(frozen=True)
class Figure:
    """A registered figure: ``fn(ctx) -> paths``."""

    name: str
    fn: Callable[[Context], Sequence[Path]]
    message: str


@dataclass(frozen=True)
class Outcome:
    name: str
    message: str
    files: tuple[Path, ...] = ()
    skipped: str | None = None
    seconds: float = field(default=0.0, compare=False)


FIGURES: dict[str, Figure] = {}


def _origin(fn: Callable) -> tuple[str, str]:
    """Where ``fn`` is defined: its module's import name (also for a module run as
    ``python -m``, which is ``__main__``, or ``__mp_main__`` in a spawned worker) and its name."""
    module = sys.modules.get(fn.__module__)
    spec = getattr(module, "__spec__", None)
    return (spec.name if spec is not None else fn.__module__), fn.__qualname__


def register(name: str, message: str) -> Callable:
    """Decorator: add a figure function to :data:`FIGURES` under ``name``. A module run as
    ``python -m paper.figures`` and then imported by name registers its figures twice; the
    second, importable one replaces the first (in place, so the order stays)."""

    def wrap(fn: Callable[[Context], Sequence[Path]]) -> Callable[[Context], Sequence[Path]]:
        if name in FIGURES and _origin(FIGURES[name].fn) != _origin(fn):
            raise ValueError(f"figure {name!r} registered twice")
        FIGURES[name] = Figure(name, fn, message)
        return fn

    return wrap


def run(
    ctx: Context,
    names: Sequence[str] | None = None,
    *,
    echo: bool = True,
    progress: bool = False,
) -> list[Outcome]:
    """Make the figures ``names`` (all by default) in registry order; write ``MANIFEST.md``.
    ``progress``: one bar over the figures, naming the one being made."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    unknown = sorted(set(names or ()) - set(FIGURES))
    if unknown:
        raise ValueError(f"unknown figure(s) {unknown}; known: {', '.join(FIGURES)}")
    outcomes = []
    todo = [f for f in FIGURES.values() if not names or f.name in names]
    bar = tqdm(todo, desc="figures", unit="figure", disable=not progress, leave=False)
    for fig in bar:
        bar.set_postfix_str(fig.name, refresh=True)
        start = time.perf_counter()
        try:
            with plt.rc_context(_RC):
                files = tuple(Path(p) for p in fig.fn(ctx))
            message = ctx.summaries.get(fig.name, fig.message)
            outcome = Outcome(fig.name, message, files, None, time.perf_counter() - start)
        except Skip as why:
            outcome = Outcome(fig.name, fig.message, (), str(why), time.perf_counter() - start)
        outcomes.append(outcome)
        if echo:
            what = (
                f"skipped: {outcome.skipped}"
                if outcome.skipped
                else ", ".join(p.name for p in outcome.files)
            )
            tqdm.write(f"{fig.name:<28} {outcome.seconds:6.2f}s  {what}")
    if names is None:
        _manifest(ctx, outcomes)
    elif (ctx.out / "MANIFEST.md").exists():
        _update_manifest(ctx, outcomes)
    return outcomes


def _row(o: Outcome) -> str:
    files = (
        f"skipped: {o.skipped}"
        if o.skipped
        else ", ".join(f"[{p.name}]({p.name})" for p in o.files)
    )
    return f"| `{o.name}` | {o.message} | {files} |"


def _update_manifest(ctx: Context, outcomes: Sequence[Outcome]) -> None:
    """``--only``: replace the rows of the figures just made in an existing manifest."""
    path = ctx.out / "MANIFEST.md"
    made = {o.name: o for o in outcomes}
    lines = path.read_text().splitlines()
    seen = set()
    for i, line in enumerate(lines):
        for name, o in made.items():
            if line.startswith(f"| `{name}` |"):
                lines[i] = _row(o)
                seen.add(name)
    lines += [_row(o) for name, o in made.items() if name not in seen]
    path.write_text("\n".join(lines) + "\n")


def _manifest(ctx: Context, outcomes: Sequence[Outcome]) -> None:
    lines = [
        "# Figures and tables",
        "",
        f"Generated by `python -m paper.figures{' --small' if ctx.small else ''}`. "
        "Do not edit by hand.",
        "",
        "| figure | message | files |",
        "| --- | --- | --- |",
    ]
    lines += [_row(o) for o in outcomes]
    ctx.table("MANIFEST", "\n".join(lines))
