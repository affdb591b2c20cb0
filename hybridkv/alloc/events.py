"""KV cache events in vLLM's msgpack layout (``vllm/distributed/kv_events.py``).

Events are tagged (``tag=True``: the class name travels with each event) and array-like (fields
by position, as vLLM's original schema): ``BlockStored`` keeps vLLM's field order
``block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium`` and then the later
additions in vLLM's order ``lora_name, extra_keys, group_idx``, all defaulted so that a decoder
of the original six-field schema reads our events (msgspec ignores extra trailing fields).
``lora_id`` and ``medium`` have no default on purpose: vLLM's decoders require them, and
``omit_defaults`` would otherwise drop them.

The allocator emits one ``BlockStored`` per newly cached entry listing the hash units (of
``hash_block_size`` tokens, the event's ``block_size``) that no cached block held before, each
unit's parent being the previous unit; ``BlockRemoved`` lists units no cached block holds any
more. So a subscriber that applies the events in order holds exactly the allocator's set of
cached ``(group, unit hash)`` pairs, with parent links (:class:`~.index.CacheIndex`).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
]

MEDIUM_GPU = "GPU"


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of all events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(data: bytes) -> KVEventBatch:
    return _decoder.decode(data)
