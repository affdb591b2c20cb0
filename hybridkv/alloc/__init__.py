"""Block allocator for hybrid (attention + state) KV caches over a ``MemoryPlan``."""

from .block_pool import BlockPool, TwoLevelPool
from .errors import AllocatorError, DoubleFree, MaxLengthExceeded, PoolExhausted, UnknownRequest
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from .manager import HitInfo, HybridAllocator

__all__ = [
    "AllBlocksCleared",
    "AllocatorError",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "DoubleFree",
    "HitInfo",
    "HybridAllocator",
    "KVEventBatch",
    "MaxLengthExceeded",
    "PoolExhausted",
    "TwoLevelPool",
    "UnknownRequest",
]
