"""The records a workload is made of: one :class:`Request` per prompt, a :class:`Trace` of them.

A request carries its prompt as real token ids (a read-only ``int32`` array). Prompts that share
a prefix share the *values* of those tokens (often the same memory: a chat turn's prompt is a view
of its session's transcript), so a prefix cache that hashes blocks of token ids finds them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Request", "Trace", "answer_ids"]


def _frozen_ids(values: Any, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D array of token ids, got shape {arr.shape}")
    if arr.dtype != np.int32:
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{what} must hold integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int32)
    if arr.flags.writeable:
        # a view, so the caller's buffer (e.g. a session transcript) is shared, not copied
        arr = arr.view()
        arr.flags.writeable = False
    return arr


@dataclass(frozen=True, eq=False)
class Request:
    """One prompt sent to the server.

    - ``arrival_s``: open-loop arrival time in seconds from the start of the trace.
    - ``prompt``: the prompt's token ids (``int32``, read-only).
    - ``output_length``: tokens the request generates (``>= 1``).
    - ``output_ids``: those tokens when the workload knows them (a chat turn's answer is resent
      in the next turn's prompt, so a simulator that caches decoded blocks should hash these);
      ``None`` when unknown (most real traces).
    - ``session_id``/``turn``/``branch_id``: the conversation, its turn number and, for agentic
      sessions, the branch (0 is the trunk); ``-1``/``0``/``0`` outside sessions.
    - ``prefix_group``: which shared prefix (system prompt) the request starts with, ``-1`` none.
    - ``parent_id``: the request this one waits for in a closed loop (the previous turn of the
      session), ``-1`` for none; ``think_time_s`` is the delay after the parent *completes*.
      ``arrival_s`` assumes zero service time; a closed-loop simulator should use these instead.
    - ``shared_prefix_length``: tokens at the start of the prompt that, by construction, equal
      the start of an earlier request's prompt followed by its output (what an infinite prefix
      cache with one-token blocks could serve); ``None`` when the trace does not know.
    """

    request_id: int
    arrival_s: float
    prompt: np.ndarray
    output_length: int
    output_ids: np.ndarray | None = None
    session_id: int = -1
    turn: int = 0
    branch_id: int = 0
    prefix_group: int = -1
    parent_id: int = -1
    think_time_s: float = 0.0
    shared_prefix_length: int | None = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", _frozen_ids(self.prompt, "prompt"))
        if self.prompt.size == 0:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        if int(self.output_length) < 1:
            raise ValueError(
                f"request {self.request_id}: output_length must be >= 1, got {self.output_length}"
            )
        if self.output_ids is not None:
            ids = _frozen_ids(self.output_ids, "output_ids")
            if ids.size != self.output_length:
                raise ValueError(
                    f"request {self.request_id}: {ids.size} output ids for output_length "
                    f"{self.output_length}"
                )
            object.__setattr__(self, "output_ids", ids)
        if not np.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(
                f"request {self.request_id}: arrival time must be finite and >= 0, "
                f"got {self.arrival_s}"
            )
        spl = self.shared_prefix_length
        if spl is not None and not 0 <= spl <= self.prompt.size:
            raise ValueError(
                f"request {self.request_id}: shared_prefix_length {spl} is outside "
                f"0..{self.prompt.size}"
            )

    @property
    def prompt_length(self) -> int:
        return int(self.prompt.size)

    @property
    def total_length(self) -> int:
        """Tokens in the cache once the request finishes (prompt + output)."""
        return self.prompt_length + int(self.output_length)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Request):
            return NotImplemented
        scalars = (
            "request_id",
            "arrival_s",
            "output_length",
            "session_id",
            "turn",
            "branch_id",
            "prefix_group",
            "parent_id",
            "think_time_s",
            "shared_prefix_length",
        )
        if any(getattr(self, s) != getattr(other, s) for s in scalars):
            return False
        if (self.output_ids is None) != (other.output_ids is None):
            return False
        if self.output_ids is not None and not np.array_equal(self.output_ids, other.output_ids):
            return False
        return bool(np.array_equal(self.prompt, other.prompt))

    __hash__ = None  # type: ignore[assignment]  # mutable-looking payload; compare, don't hash


#: the answer ids :func:`answer_ids` makes up: above every vocabulary, inside int32 (token ids
#: are hashed as int32, as vLLM's): a request's first answer token is ``_FIRST + request_id``,
#: the rest count up from ``_REST``
_FIRST = 1 << 30
_REST = _FIRST + (1 << 29)


def answer_ids(request: Request) -> list[int]:
    """The tokens ``request`` generates as a simulator or replay feeds them back: the trace's
    ``output_ids`` where known, else ids no prompt contains (``2**30`` and up, int32 as every
    token id the allocator hashes). The first one is the request's own (``2**30 +
    request_id``), so no two requests' answers agree from their first token on: a later prompt
    or answer cannot share an answer the trace does not record (hashes chain, so one differing
    token makes every later hash unit differ); the rest are ``2**30 + 2**29 + k``.

    Request ids from ``2**29`` and answers of ``2**29`` tokens or more are refused (they would
    leave int32)."""
    n = int(request.output_length)
    if request.output_ids is not None:
        return np.asarray(request.output_ids[:n], np.int64).tolist()  # Python ints, at C speed
    rid = request.request_id
    if not 0 <= rid < _REST - _FIRST or n >= _REST - _FIRST:
        raise ValueError(
            f"request {rid}: made-up answer ids cover request ids below {_REST - _FIRST:,} and "
            f"answers shorter than that ({n:,} tokens asked); split the trace or give the "
            "request its output_ids"
        )
    return [_FIRST + rid, *range(_REST + 1, _REST + n)]


@dataclass(frozen=True, eq=False)
class Trace:
    """Requests in arrival order (``request_id`` is the position) plus how they were made.

    ``params`` records the generator and every parameter it used, so a trace can be described
    in a figure caption and regenerated exactly.
    """

    name: str
    requests: tuple[Request, ...]
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, r in enumerate(self.requests):
            if r.request_id != i:
                raise ValueError(f"request at position {i} has request_id {r.request_id}")
            if r.parent_id >= i:
                raise ValueError(f"request {i} waits for a later request {r.parent_id}")
        arrivals = self.arrivals()
        if arrivals.size > 1 and np.any(np.diff(arrivals) < 0):
            raise ValueError("requests must be in non-decreasing arrival order")

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __getitem__(self, i: int) -> Request:
        return self.requests[i]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        return self.name == other.name and self.requests == other.requests

    __hash__ = None  # type: ignore[assignment]

    def arrivals(self) -> np.ndarray:
        return np.fromiter((r.arrival_s for r in self.requests), float, len(self.requests))

    def prompt_lengths(self) -> np.ndarray:
        return np.fromiter((r.prompt_length for r in self.requests), np.int64, len(self.requests))

    def output_lengths(self) -> np.ndarray:
        return np.fromiter((r.output_length for r in self.requests), np.int64, len(self.requests))

    def shared_prefix_lengths(self) -> np.ndarray | None:
        """Per-request ``shared_prefix_length``, or None if any request does not know it."""
        if any(r.shared_prefix_length is None for r in self.requests):
            return None
        return np.fromiter(
            (r.shared_prefix_length for r in self.requests), np.int64, len(self.requests)
        )

    def summary(self) -> dict[str, float]:
        """Size, duration and length statistics (token counts, seconds)."""
        p, o = self.prompt_lengths(), self.output_lengths()
        t = self.arrivals()
        out: dict[str, float] = {
            "requests": float(len(self)),
            "duration_s": float(t[-1] - t[0]) if len(self) else 0.0,
            "prompt_tokens": float(p.sum()),
            "prompt_median": float(np.median(p)) if len(self) else 0.0,
            "prompt_p99": float(np.percentile(p, 99)) if len(self) else 0.0,
            "output_median": float(np.median(o)) if len(self) else 0.0,
            "sessions": float(len({r.session_id for r in self.requests if r.session_id >= 0})),
        }
        shared = self.shared_prefix_lengths()
        if shared is not None and p.sum():
            out["shared_fraction"] = float(shared.sum() / p.sum())
        return out
