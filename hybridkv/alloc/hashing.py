"""Chained prefix hashes at ``hash_block_size`` granularity (vLLM's request block hasher)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

# A fixed seed (like vLLM's "vllm-none-hash") keeps hashes stable across processes.
NONE_HASH: bytes = hashlib.sha256(b"hybridkv-none-hash").digest()
_enc = msgspec.msgpack.Encoder()


def hash_unit(parent: bytes | None, tokens: Sequence[int], extra_keys: object = None) -> bytes:
    """sha256 over a canonical msgpack encoding of (parent, tokens, extra_keys)."""
    payload = _enc.encode((parent or NONE_HASH, tuple(tokens), extra_keys))
    return hashlib.sha256(payload).digest()


def extend_hashes(
    hashes: list[bytes], tokens: Sequence[int], hash_block_size: int, extra_keys: object = None
) -> list[bytes]:
    """Append hashes for every newly full hash unit of ``tokens``; returns ``hashes``."""
    h = hash_block_size
    for i in range(len(hashes), len(tokens) // h):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_unit(parent, tokens[i * h : (i + 1) * h], extra_keys))
    return hashes


def block_hash(unit_hashes: Sequence[bytes], block_index: int, scale: int) -> bytes:
    """A block of ``scale`` hash units is cached under the hash of its last unit."""
    return unit_hashes[(block_index + 1) * scale - 1]
