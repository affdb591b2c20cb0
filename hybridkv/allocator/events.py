"""KV cache events in the layout of vLLM's KV event batches (msgspec, tagged, array-like).

One ``BlockStored`` per newly cached hash unit (hash granularity, not physical blocks), carrying
its parent hash, so a subscriber can rebuild the cache index; ``BlockRemoved`` on eviction;
``AllBlocksCleared`` on a reset.
"""

from __future__ import annotations

import time

import msgspec


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    group_idx: int = 0


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None = "GPU"
    group_idx: int = 0


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def make_batch(events: list[KVCacheEvent]) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=list(events))


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode(data: bytes) -> KVEventBatch:
    return _DECODER.decode(data)


class CacheIndex:
    """What a subscriber knows: the cached (group, hash) units and each one's parent."""

    def __init__(self) -> None:
        self.parent: dict[tuple[int, bytes], bytes | None] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                for h in event.block_hashes:
                    self.parent[(event.group_idx, h)] = parent
                    parent = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self.parent.pop((event.group_idx, h), None)
            else:
                self.parent.clear()

    @property
    def keys(self) -> set[tuple[int, bytes]]:
        return set(self.parent)
