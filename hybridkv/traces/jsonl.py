"""Real traces as JSON lines: one request per line.

Fields (unknown fields are ignored, so richer traces load as they are):

- ``timestamp`` (required): arrival time, in seconds times ``time_scale``; non-decreasing down
  the file. ``time_scale=None`` (default) reads Mooncake's format (lines with ``hash_ids``) in
  milliseconds and anything else in seconds, and records which in ``Trace.params``. With
  ``rebase`` (default) the first request arrives at 0. ``rate_scale`` is a load factor: arrival
  times are divided by it (0.05 replays one GPU's share of a 20-GPU cluster's trace).
- ``output_length`` (required): tokens generated, ``>= 1``.
- the prompt, one of:

  - ``token_ids``: the prompt's token ids;
  - ``input_length`` with ``prefix_group`` (an int or a string) and ``prefix_length``: the first
    ``prefix_length`` tokens are the group's shared tokens (the same ids in every request of the
    group, prefixes of one another), the rest are unique to the request;
  - ``input_length`` with ``hash_ids`` (Mooncake's format): block ``k`` of ``hash_block_size``
    tokens holds tokens that depend only on ``hash_ids[k]``, so requests that share a leading
    run of ids share those tokens; tokens past the last id are unique;
  - ``input_length`` alone: unique tokens.

- optional: ``output_token_ids`` (its length must equal ``output_length``), ``session_id``,
  ``turn``, ``branch_id``, ``parent_id`` (0-based line index, among requests, of an earlier
  request), ``think_time_s``, ``shared_prefix_length``.

Synthesised tokens are a deterministic function of ``seed`` and the group key, hash id or line
(a splitmix64 hash), so loading a file twice gives identical token ids, and a group's tokens do
not depend on which other lines the file holds. A malformed line raises :class:`ValueError`
naming the file, the line number and the problem. ``limit`` reads only the first requests.

**How long is a shared prefix?** Block hashes say only that two prompts share whole blocks, not
where the sharing really ends, and a recurrent state can be reused only at the exact position it
was saved at, so the answer decides what a hybrid model's cache can serve. ``shared_length``
picks a reading; it is recorded in ``Trace.params``:

- ``"blocks"`` (default): two prompts share exactly the whole hash blocks their ids agree on; a
  block's tokens depend only on its chain of ids (a prompt's partial last block is a prefix of
  any longer block with the same chain).
- ``"continuation"``: a prompt whose ids begin with every whole block of an earlier prompt, and
  which is at least as long, *continues* it, as a chat's next turn does: it starts with that
  earlier prompt exactly, then (if it has room) that request's answer, then its own tokens. The
  parent is the earlier request with the longest such chain (the latest among equals); its
  answer gets synthesised ``output_ids`` so a simulator decodes the very tokens the next turn
  resends. Tokens are still recorded per chain of ids, so prompts that share ids share tokens.

The truth lies between: in a multi-turn chat the next turn resends the previous one exactly
(``continuation``); several questions on one long document share the document, which ends
somewhere inside the block where the questions differ (neither reading is exact there).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np

from .request import Request, Trace
from .synthetic import VOCAB_SIZE

__all__ = [
    "MOONCAKE_SYNTHETIC",
    "SHARED_LENGTHS",
    "load_jsonl",
    "load_mooncake",
    "save_jsonl",
    "synthetic_tokens",
]

#: Mooncake traces hash prompts in blocks of 512 tokens
MOONCAKE_BLOCK = 512
#: Mooncake's synthetic workload (FAST'25 release, Apache-2.0), shipped with the package
MOONCAKE_SYNTHETIC = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl"
#: readings of a continuation's shared length (module docstring)
SHARED_LENGTHS = ("blocks", "continuation")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    x = x.copy()
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _key(kind: str, value: Any, seed: int) -> np.uint64:
    digest = hashlib.blake2b(f"{seed}:{kind}:{value!r}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def synthetic_tokens(key: np.uint64, length: int, vocab_size: int = VOCAB_SIZE) -> np.ndarray:
    """``length`` token ids that depend only on ``key`` and position: the tokens for the same
    key are prefixes of one another whatever the length."""
    pos = np.arange(length, dtype=np.uint64)
    with np.errstate(over="ignore"):
        mixed = _splitmix(_splitmix(np.full(length, key, np.uint64)) + pos * _GOLDEN)
    return (mixed % np.uint64(vocab_size)).astype(np.int32)


def _int(line: dict, name: str, where: str, *, minimum: int | None = None) -> int:
    value = line[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {name!r} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}: {name!r} must be >= {minimum}, got {value}")
    return value


def _id_list(value: Any, name: str, where: str) -> list[int]:
    if not isinstance(value, list) or any(
        isinstance(v, bool) or not isinstance(v, int) for v in value
    ):
        raise ValueError(f"{where}: {name!r} must be a list of integers")
    return value


def load_jsonl(
    path: str | PathLike[str],
    *,
    seed: int = 0,
    time_scale: float | None = None,
    rebase: bool = True,
    hash_block_size: int = MOONCAKE_BLOCK,
    vocab_size: int = VOCAB_SIZE,
    name: str | None = None,
    limit: int | None = None,
    rate_scale: float = 1.0,
    shared_length: str = "blocks",
) -> Trace:
    """Read a trace; see the module docstring for the format and the options."""
    path = Path(path)
    if shared_length not in SHARED_LENGTHS:
        raise ValueError(
            f"shared_length must be one of {', '.join(SHARED_LENGTHS)}, got {shared_length!r}"
        )
    if isinstance(rate_scale, bool) or not (
        isinstance(rate_scale, (int, float)) and math.isfinite(rate_scale) and rate_scale > 0
    ):
        raise ValueError(
            f"rate_scale must be a finite number > 0 (0.05: arrivals 20x further apart), "
            f"got {rate_scale!r}"
        )
    if time_scale is not None and not (
        isinstance(time_scale, (int, float)) and math.isfinite(time_scale) and time_scale > 0
    ):
        raise ValueError(
            f"time_scale must be a number > 0 (seconds per timestamp unit: 1e-3 for ms), "
            f"got {time_scale!r}"
        )
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive number of requests, got {limit!r}")
    unit_note = "" if time_scale is None else "as given"
    rows: list[dict[str, Any]] = []
    group_max: dict[int, int] = {}  # longest prefix of each group seen so far
    state = _HashState(continuation=shared_length == "continuation")
    first_t: float | None = None
    last_t = -math.inf
    with path.open() as fh:
        for lineno, text in enumerate(fh, 1):
            if limit is not None and len(rows) >= limit:
                break
            if not text.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                line = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(line, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(line).__name__}")
            for req in ("timestamp", "output_length"):
                if req not in line:
                    raise ValueError(f"{where}: missing {req!r}")
            ts = line["timestamp"]
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
                raise ValueError(f"{where}: 'timestamp' must be a finite number, got {ts!r}")
            if time_scale is None:
                mooncake = "hash_ids" in line
                time_scale = 1e-3 if mooncake else 1.0
                unit_note = (
                    "milliseconds (Mooncake's format: lines with hash_ids)"
                    if mooncake
                    else "seconds (no hash_ids: not Mooncake's format)"
                )
            t = float(ts) * time_scale / rate_scale
            if t < last_t:
                raise ValueError(
                    f"{where}: timestamp {ts} is earlier than the previous line's; sort the "
                    "trace by timestamp"
                )
            last_t = t
            first_t = t if first_t is None else first_t
            out_len = _int(line, "output_length", where, minimum=1)
            row: dict[str, Any] = {"arrival_s": t, "output_length": out_len, "lineno": lineno}

            has_ids, has_len = "token_ids" in line, "input_length" in line
            if not has_ids and not has_len:
                raise ValueError(f"{where}: give 'token_ids' or 'input_length'")
            if has_ids:
                ids = _id_list(line["token_ids"], "token_ids", where)
                if not ids:
                    raise ValueError(f"{where}: 'token_ids' is empty")
                if has_len and _int(line, "input_length", where) != len(ids):
                    raise ValueError(
                        f"{where}: input_length {line['input_length']} disagrees with "
                        f"{len(ids)} token_ids"
                    )
                if "prefix_length" in line or "hash_ids" in line:
                    raise ValueError(
                        f"{where}: 'prefix_length'/'hash_ids' describe synthesised tokens and "
                        "cannot be combined with 'token_ids'"
                    )
                if any(v < 0 or v >= vocab_size for v in ids):
                    raise ValueError(f"{where}: token ids must lie in [0, {vocab_size})")
                row["prompt"] = np.asarray(ids, np.int32)
                row["shared"] = None
            else:
                n = _int(line, "input_length", where, minimum=1)
                row["length"] = n
                if "hash_ids" in line and "prefix_length" in line:
                    raise ValueError(f"{where}: give 'prefix_length' or 'hash_ids', not both")
                if "prefix_length" in line:
                    if "prefix_group" not in line:
                        raise ValueError(f"{where}: 'prefix_length' needs a 'prefix_group'")
                    p = _int(line, "prefix_length", where, minimum=0)
                    if p > n:
                        raise ValueError(f"{where}: prefix_length {p} exceeds input_length {n}")
                    row["prefix"] = p
                elif "prefix_group" in line:
                    raise ValueError(f"{where}: 'prefix_group' needs a 'prefix_length'")
                if "hash_ids" in line:
                    hids = _id_list(line["hash_ids"], "hash_ids", where)
                    if (len(hids) - 1) * hash_block_size >= n and hids:
                        raise ValueError(
                            f"{where}: {len(hids)} hash_ids of {hash_block_size} tokens are "
                            f"more than input_length {n} needs"
                        )
                    row["hash_ids"] = hids
            if "prefix_group" in line:
                g = line["prefix_group"]
                if isinstance(g, bool) or not isinstance(g, (int, str)):
                    raise ValueError(f"{where}: 'prefix_group' must be an integer or a string")
                row["group_key"] = g
            if "output_token_ids" in line:
                oids = _id_list(line["output_token_ids"], "output_token_ids", where)
                if len(oids) != out_len:
                    raise ValueError(
                        f"{where}: {len(oids)} output_token_ids for output_length {out_len}"
                    )
                row["output_ids"] = np.asarray(oids, np.int32)
            for opt in ("session_id", "turn", "branch_id", "parent_id"):
                if opt in line:
                    row[opt] = _int(line, opt, where, minimum=-1)
            if row.get("parent_id", -1) >= len(rows):
                raise ValueError(
                    f"{where}: parent_id {row['parent_id']} is not an earlier request"
                )
            if "think_time_s" in line:
                tt = line["think_time_s"]
                if isinstance(tt, bool) or not isinstance(tt, (int, float)) or tt < 0:
                    raise ValueError(f"{where}: 'think_time_s' must be a number >= 0")
                row["think_time_s"] = float(tt)
            if "shared_prefix_length" in line:
                row["shared_given"] = _int(line, "shared_prefix_length", where, minimum=0)
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no requests")

    # integer groups keep their number; string groups are numbered after the largest integer
    ints = [r["group_key"] for r in rows if isinstance(r.get("group_key"), int)]
    names: dict[str, int] = {}
    for row in rows:
        g = row.get("group_key")
        if isinstance(g, str):
            g = names.setdefault(g, max(ints, default=-1) + 1 + len(names))
        if g is not None:
            row["prefix_group"] = g

    # synthesise prompts in file order; unique tokens come from one generator
    rng = np.random.default_rng(seed)
    group_tokens: dict[int, np.ndarray] = {}
    for i, row in enumerate(rows):
        if "prompt" in row:
            pass
        elif "prefix" in row:
            g, p, n = row["prefix_group"], row["prefix"], row["length"]
            if g not in group_tokens or group_tokens[g].size < p:
                group_tokens[g] = synthetic_tokens(
                    _key("group", row["group_key"], seed), p, vocab_size
                )
            unique = rng.integers(0, vocab_size, n - p, dtype=np.int32)
            row["prompt"] = np.concatenate([group_tokens[g][:p], unique])
            row["shared"] = min(p, group_max.get(g, 0))
            group_max[g] = max(p, group_max.get(g, 0))
        elif "hash_ids" in row:
            _hashed_prompt(row, i, rows, seed, hash_block_size, vocab_size, rng, state)
        else:
            row["prompt"] = rng.integers(0, vocab_size, row["length"], dtype=np.int32)
            row["shared"] = 0
    offset = first_t if rebase and first_t is not None else 0.0
    requests = []
    for i, row in enumerate(rows):
        shared = row.get("shared_given", row["shared"])
        if shared is not None and shared > row["prompt"].size:
            raise ValueError(
                f"{path}:{row['lineno']}: shared_prefix_length {shared} exceeds the prompt"
            )
        try:
            requests.append(
                Request(
                    request_id=i,
                    arrival_s=row["arrival_s"] - offset,
                    prompt=row["prompt"],
                    output_length=row["output_length"],
                    output_ids=row.get("output_ids"),
                    session_id=row.get("session_id", -1),
                    turn=row.get("turn", 0),
                    branch_id=row.get("branch_id", 0),
                    prefix_group=row.get("prefix_group", -1),
                    parent_id=row.get("parent_id", -1),
                    think_time_s=row.get("think_time_s", 0.0),
                    shared_prefix_length=shared,
                )
            )
        except ValueError as exc:
            raise ValueError(f"{path}:{row['lineno']}: {exc}") from None
    params = {
        "path": str(path),
        "seed": seed,
        "time_scale": time_scale,
        "time_unit": unit_note,
        "rate_scale": rate_scale,
        "rebase": rebase,
        "limit": limit,
        "shared_length": shared_length,
        "hash_block_size": hash_block_size,
    }
    return Trace(name or path.stem, tuple(requests), params)


_EMPTY = np.zeros(0, np.int32)


class _HashState:
    """What synthesising hash-id prompts remembers across lines."""

    def __init__(self, continuation: bool) -> None:
        self.continuation = continuation
        self.chain_len: dict[int, int] = {}  # chain key -> longest block seen with it
        self.blocks: dict[int, np.ndarray] = {}  # chain key -> that block's tokens
        self.parents: dict[int, int] = {}  # chain key of a prompt's whole blocks -> its row


def _hashed_prompt(
    row: dict[str, Any],
    index: int,
    rows: list[dict[str, Any]],
    seed: int,
    unit: int,
    vocab_size: int,
    rng: np.random.Generator,
    st: _HashState,
) -> None:
    """Synthesise a ``hash_ids`` prompt (module docstring) and its shared length."""
    n, hids = row["length"], row["hash_ids"]
    keys, chain = [], 0
    for h in hids:
        chain = hash((chain, h))
        keys.append(chain)
    base = np.zeros(0, np.int32)
    parent = None
    if st.continuation:
        # the longest chain of this prompt's ids that is an earlier prompt's whole blocks
        for k in range(len(keys), 0, -1):
            i = st.parents.get(keys[k - 1])
            if i is not None and rows[i]["length"] <= n:
                parent = rows[i]
                break
    if parent is not None:
        if "output_ids" not in parent:
            parent["output_ids"] = synthetic_tokens(
                _key("output", parent["lineno"], seed), parent["output_length"], vocab_size
            )
        base = parent["prompt"]
        if n >= base.size + parent["output_ids"].size:
            base = np.concatenate([base, parent["output_ids"]])
    parts, shared, matching = [], 0, True
    for k, (h, key) in enumerate(zip(hids, keys)):
        lo = k * unit
        size = min(unit, n - lo)
        known = st.blocks.get(key, _EMPTY)
        if known.size >= size:
            block = known[:size]
        elif not known.size and base.size <= lo:  # the common case: plain tokens
            block = synthetic_tokens(_key("hash", h, seed), size, vocab_size)
        else:
            # extend what is known of this chain's block: the parent's tokens, then tokens that
            # depend only on the hash id and position (so blocks of one chain stay prefixes of
            # one another); only blocks that are not those plain tokens are remembered
            fill = base[lo + known.size : lo + size]
            synth = synthetic_tokens(_key("hash", h, seed), size, vocab_size)
            block = np.concatenate([known, fill, synth[known.size + fill.size :]])
            if known.size or not np.array_equal(fill, synth[: fill.size]):
                st.blocks[key] = block
        parts.append(block)
        seen = st.chain_len.get(key, 0)
        if matching:
            shared += min(size, seen)
            matching = seen >= size
        st.chain_len[key] = max(seen, size)
    covered = sum(p.size for p in parts)
    rest = base[covered:n]
    parts.append(rest)
    parts.append(rng.integers(0, vocab_size, n - covered - rest.size, dtype=np.int32))
    row["prompt"] = np.concatenate(parts)
    if parent is not None:
        # the parent's prompt (and answer) as resent: compared, since a block another request
        # recorded first wins over the parent's tokens
        m = min(base.size, n)
        differ = np.flatnonzero(row["prompt"][:m] != base[:m])
        shared = max(shared, int(differ[0]) if differ.size else m)
    row["shared"] = shared
    whole = n // unit
    if st.continuation and whole:
        st.parents[keys[whole - 1]] = index


def load_mooncake(**options: Any) -> Trace:
    """Mooncake's synthetic workload (:data:`MOONCAKE_SYNTHETIC`: 3,993 requests, timestamps in
    ms, 512-token hash blocks; provenance in ``data/README.md`` beside it), read by
    :func:`load_jsonl` with ``options`` (``limit``, ``rate_scale``, ``shared_length``, ...)."""
    if not MOONCAKE_SYNTHETIC.exists():
        raise FileNotFoundError(
            2, "the Mooncake trace is missing from this installation", str(MOONCAKE_SYNTHETIC)
        )
    options.setdefault("name", "mooncake_synthetic")
    return load_jsonl(MOONCAKE_SYNTHETIC, **options)


def _line(r: Request) -> dict[str, Any]:
    out: dict[str, Any] = {
        "timestamp": r.arrival_s,
        "token_ids": r.prompt.tolist(),
        "output_length": int(r.output_length),
    }
    if r.output_ids is not None:
        out["output_token_ids"] = r.output_ids.tolist()
    defaults = {"session_id": -1, "turn": 0, "branch_id": 0, "prefix_group": -1, "parent_id": -1}
    for name, default in defaults.items():
        value = getattr(r, name)
        if value != default:
            out[name] = int(value)
    if r.think_time_s:
        out["think_time_s"] = r.think_time_s
    if r.shared_prefix_length is not None:
        out["shared_prefix_length"] = int(r.shared_prefix_length)
    return out


def save_jsonl(trace: Trace | Iterable[Request], path: str | PathLike[str]) -> None:
    """Write requests with their token ids (lossless: :func:`load_jsonl` with ``rebase=False``
    reads back equal requests)."""
    with Path(path).open("w") as fh:
        for r in trace:
            fh.write(json.dumps(_line(r), separators=(",", ":")))
            fh.write("\n")
