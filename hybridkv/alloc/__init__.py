"""Block allocator for hybrid (attention + state) KV caches over a ``MemoryPlan``.

- :class:`HybridAllocator` (:mod:`.manager`): per-request block lists for every KV cache group,
  all-or-nothing allocation, prefix caching with state checkpoints, block tables, KV events.
  How it caches and checkpoints is one :class:`AllocatorOptions` (:mod:`.options`), which
  everything that builds an allocator takes.
- :class:`BlockPool` / :class:`TwoLevelPool`: the id pools behind a plan's pools
  (:func:`~.pools.build_pools`), both a :class:`Pool` (the one interface the allocator uses:
  feasibility, reservation, ids held per group, eviction); a group's ids are an
  :class:`~.block_pool.IdCache`.
- :mod:`.groups`: one manager per KV cache group, a class per kind (full attention and MLA,
  sliding window, recurrent state), each owning its blocks, hit rule and skipped blocks, and
  the :class:`~.groups.Coordinator` that finds the longest prefix they all serve.
- :mod:`.policies`: the checkpoint policies, one module each behind one protocol
  (:class:`~.policies.CheckpointPolicy`: where a prefill chunk ends, which states a step end
  keeps, what a prefill exports, eviction preferences).
- :mod:`.commit`: the step's commit (caching computed blocks) and the state checkpoints;
  :mod:`.capacity`: all-or-nothing allocation across groups; :mod:`.cascade` on
  :mod:`.reach` (the one reachability walk): what an eviction leaves unreachable.
- :mod:`.prefix_cache` (the cache index, typed :class:`~.prefix_cache.Entry`), :mod:`.hashing`:
  chained hashes. :mod:`.breakdown`: where a pool's bytes are (live, cached and reachable or
  not, owned but empty, padding, free, unusable). :mod:`.page_table`: a two-level pool's large
  pages. :mod:`.events`, :mod:`.index`, :mod:`.zmq_events`: KV events, a subscriber's index,
  ZMQ transport.
"""

from .block_pool import BlockPool, Pool
from .breakdown import CATEGORIES, MemoryBreakdown, memory_breakdown
from .errors import (
    AllocatorError,
    ConfigError,
    DoubleFree,
    DuplicateRequest,
    MaxLengthExceeded,
    PoolExhausted,
    UnknownRequest,
)
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from .index import CacheIndex
from .manager import HitInfo, HybridAllocator
from .options import AllocatorOptions
from .policies import ALL_POLICIES, POLICIES, RECOVERY_POLICIES
from .two_level import TwoLevelPool

__all__ = [
    "ALL_POLICIES",
    "CATEGORIES",
    "POLICIES",
    "RECOVERY_POLICIES",
    "AllBlocksCleared",
    "AllocatorError",
    "AllocatorOptions",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheIndex",
    "ConfigError",
    "DoubleFree",
    "DuplicateRequest",
    "HitInfo",
    "HybridAllocator",
    "KVEventBatch",
    "MaxLengthExceeded",
    "MemoryBreakdown",
    "Pool",
    "PoolExhausted",
    "TwoLevelPool",
    "UnknownRequest",
    "memory_breakdown",
]
