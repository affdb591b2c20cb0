"""Where and from what a CPU measurement under ``paper/results`` was made: the ``meta`` block of
its JSON (machine, versions, date, commit, command line), and the JSON + Markdown pair a
measurement script writes. One place, so every result file records the same facts."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["git_commit", "run_meta", "versions", "write_results"]

ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The checkout's HEAD, or ``"unknown"`` outside a git checkout."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def versions() -> dict[str, str]:
    """Python's and the measured stack's versions (``"absent"`` for one not installed)."""
    out = {"python": platform.python_version(), "numpy": np.__version__}
    for mod in ("torch", "tqdm"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:  # pragma: no cover
            out[mod] = "absent"
    return out


def run_meta(what: str, argv: list[str] | None) -> dict[str, Any]:
    """The ``meta`` block of a result: ``what`` was measured, on which machine, with which
    versions, when, at which commit, by which arguments (``argv`` None: this process's)."""
    return {
        "what": what,
        "machine": platform.platform(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "versions": versions(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "argv": sys.argv[1:] if argv is None else argv,
    }


def write_results(
    out: Path, stem: str, meta: dict, rows: list[dict] | dict[str, Any], markdown: str
) -> Path:
    """``out/stem.json`` (meta and rows) and ``out/stem.md`` (``markdown``); returns the
    Markdown file's path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    path = out / f"{stem}.md"
    path.write_text(markdown)
    return path
