"""Block allocation for memory plans: pools, KV cache groups, hybrid prefix caching, KV events."""

from .errors import (
    AllocatorError,
    DoubleFree,
    DuplicateRequest,
    MaxLengthExceeded,
    PoolExhausted,
    UnknownRequest,
)
from .events import AllBlocksCleared, BlockRemoved, BlockStored, CacheIndex, KVEventBatch
from .manager import POLICIES, HitInfo, HybridAllocator

__all__ = [
    "POLICIES",
    "AllBlocksCleared",
    "AllocatorError",
    "BlockRemoved",
    "BlockStored",
    "CacheIndex",
    "DoubleFree",
    "DuplicateRequest",
    "HitInfo",
    "HybridAllocator",
    "KVEventBatch",
    "MaxLengthExceeded",
    "PoolExhausted",
    "UnknownRequest",
]
