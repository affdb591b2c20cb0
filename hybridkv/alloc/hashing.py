"""Chained prefix hashes at ``hash_block_size`` granularity (vLLM's request block hasher).

Hash unit ``i`` covers tokens ``[i*h, (i+1)*h)`` and is ``H(parent || extra || tokens)`` where
``parent`` is unit ``i-1``'s hash (a fixed seed for unit 0), so one hash names a whole prefix.
Groups with a larger block size ``B`` (a multiple of ``h``) name a block by the hash of its last
unit, which is why one hash list serves every group.

With a *lookahead* of ``L`` tokens (vLLM 0.33's lookahead block hashes, under MTP), unit ``i``
also covers the ``L`` tokens after it, ``[(i+1)*h, (i+1)*h + L)``, and exists only once they
are known: an MTP drafter's KV at a unit's last position is built from the next token, so
the unit serves a later prompt only if that prompt goes on the same way.

The byte encoding is canonical, so hashes agree across processes and machines: tokens are
little-endian int32, extra keys (e.g. a LoRA id) are msgpack-encoded once per request and
length-prefixed. Algorithms:

- ``sha256`` (default): collision resistant, stable everywhere; 32-byte hashes.
- ``blake2b``: 16-byte digests, a little faster; stable everywhere.
- ``builtin``: Python's ``hash()`` of the bytes, 8-byte hashes, the fastest; stable only within
  one process (or with a fixed ``PYTHONHASHSEED``), so never publish these to other machines.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

__all__ = [
    "HASH_ALGOS",
    "NONE_HASH",
    "HashFn",
    "encode_extra_keys",
    "extend_unit_hashes",
    "get_hash_fn",
    "hash_tokens",
    "token_array",
]

# A fixed seed (like vLLM's "vllm-none-hash") keeps hashes stable across processes.
NONE_HASH: bytes = hashlib.sha256(b"hybridkv-none-hash").digest()

HashFn = Callable[[bytes], bytes]

_sha256 = hashlib.sha256
_blake2b = hashlib.blake2b


def _h_sha256(payload: bytes) -> bytes:
    return _sha256(payload).digest()


def _h_blake2b(payload: bytes) -> bytes:
    return _blake2b(payload, digest_size=16).digest()


def _h_builtin(payload: bytes) -> bytes:
    return hash(payload).to_bytes(8, "little", signed=True)


HASH_ALGOS: dict[str, HashFn] = {
    "sha256": _h_sha256,
    "blake2b": _h_blake2b,
    "builtin": _h_builtin,
}

_BIG_ENDIAN = sys.byteorder == "big"
_enc = msgspec.msgpack.Encoder()


def get_hash_fn(name: str) -> HashFn:
    try:
        return HASH_ALGOS[name]
    except KeyError:
        raise ValueError(
            f"unknown hash algorithm {name!r}; choose one of: {', '.join(HASH_ALGOS)}"
        ) from None


def token_array(tokens: Iterable[int]) -> array:
    """Token ids as a C int32 array: 4 bytes a token and no Python object per token."""
    a = array("i", tokens)
    if a.itemsize != 4:  # pragma: no cover - every platform we run on has 32-bit C int
        a = array("l", tokens)
    return a


def encode_extra_keys(extra_keys: Any) -> bytes:
    """Canonical, length-prefixed bytes of a request's extra keys (b"" for None)."""
    if extra_keys is None:
        return b""
    body = _enc.encode(extra_keys)
    return len(body).to_bytes(4, "little") + body


def _token_bytes(tokens: array, start: int, end: int) -> bytes:
    chunk = tokens[start:end]
    if _BIG_ENDIAN:  # pragma: no cover - canonical order is little-endian
        chunk.byteswap()
    return chunk.tobytes()


def hash_tokens(
    parent: bytes | None, tokens: Iterable[int], extra: bytes = b"", fn: HashFn = _h_sha256
) -> bytes:
    """The hash of one unit: ``fn(parent || extra || int32-LE tokens)``."""
    t = token_array(tokens)
    return fn((parent or NONE_HASH) + extra + _token_bytes(t, 0, len(t)))


def extend_unit_hashes(
    hashes: list[bytes],
    tokens: array,
    upto: int,
    h: int,
    extra: bytes,
    fn: HashFn,
    lookahead: int = 0,
) -> list[bytes]:
    """Append the hashes of every full unit of ``tokens[:upto]`` not hashed yet; with a
    ``lookahead`` of ``L``, of those whose ``L`` following tokens ``tokens`` holds, each
    covering them too (``fn(parent || extra || unit || next L tokens)``)."""
    n = min(upto, len(tokens) - lookahead) // h
    i = len(hashes)
    if i >= n:
        return hashes
    parent = hashes[-1] if i else NONE_HASH
    # unit k's bytes start at k * step and run on for its lookahead tokens
    step = 4 * h
    width = step + 4 * lookahead
    raw = _token_bytes(tokens, i * h, n * h + lookahead)
    append = hashes.append
    for off in range(0, (n - i) * step, step):
        parent = fn(parent + extra + raw[off : off + width])
        append(parent)
    return hashes
