"""Chained prefix-cache hashes at a fixed token granularity (``hash_block_size``).

``hash_i = sha256(msgpack([hash_{i-1}, tokens of unit i, extra_keys]))``: equal hashes mean equal
whole prefixes, so a group whose block is ``B = m * hash_block_size`` tokens caches a block under
the hash of its last unit, independent of the physical block size (vLLM PR #43258).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

NONE_HASH = hashlib.sha256(b"hybridkv-none-hash").digest()
_encode = msgspec.msgpack.Encoder().encode


def hash_unit(parent: bytes, tokens: Sequence[int], extra_keys: tuple = ()) -> bytes:
    return hashlib.sha256(_encode((parent, list(tokens), list(extra_keys)))).digest()


def chain_hashes(
    tokens: Sequence[int],
    hash_block_size: int,
    extra_keys: tuple = (),
    *,
    start: int = 0,
    parent: bytes = NONE_HASH,
) -> list[bytes]:
    """Hashes of the full units of ``tokens[start:]``, chained from ``parent``."""
    out = []
    n_full = len(tokens) // hash_block_size
    for i in range(start // hash_block_size, n_full):
        parent = hash_unit(
            parent, tokens[i * hash_block_size : (i + 1) * hash_block_size], extra_keys
        )
        out.append(parent)
    return out
