"""The interface every group manager implements (:class:`GroupManager`).

One manager per KV cache group (vLLM's ``SingleTypeKVCacheManager``), of a class per kind of
group: it owns the group's blocks in every request (what an admission takes from a prefix hit,
how many a request needs for its tokens, which fall out of a sliding window), the group's hit
rule (how long a prefix the group alone can serve), and its part of the fast path's limit. The
:class:`~.coordinator.Coordinator` combines them: the longest prefix every group serves, and
each request's admission and allocation across the groups.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # pragma: no cover
    from ...plan import KVCacheGroup
    from ..block_pool import IdCache
    from ..prefix_cache import PrefixIndex
    from ..request import Request
    from ..tables import BlockTables

__all__ = ["Admission", "GroupManager"]

INF = 1 << 62


@dataclass(slots=True)
class Admission:
    """What admitting one request needs, group by group (filled by :meth:`GroupManager.admit`):
    new ids per group (``needs``), cached ids the hit references (``touch``), and where the
    request's hit is copied from: ``kv_sources`` (group -> (cached block, tokens to copy): the
    first tokens of a partly reused attention block) and ``state_sources`` (group -> cached
    checkpoint)."""

    needs: dict[int, int] = field(default_factory=dict)
    touch: dict[int, list[int]] = field(default_factory=dict)
    kv_sources: dict[int, tuple[int, int]] = field(default_factory=dict)
    state_sources: dict[int, int] = field(default_factory=dict)


class GroupManager(ABC):
    """One KV cache group's blocks and hit rule (see the module docstring).

    ``ids``: where the group's ids come from; ``tables``: the block tables the kernels read
    (this group's column of each request's row is written here); ``index``: the prefix index
    (for partial-block hits); ``hash_block_size``: tokens per hash unit; ``hit_step``: the
    granularity of the group's hit points (the hash unit with partial hits, the block
    otherwise, the checkpoint spacing for states)."""

    #: the group kinds this class manages (:attr:`hybridkv.plan.KVCacheGroup.kind`)
    kinds: ClassVar[tuple[str, ...]] = ()
    #: holds recurrent states (a fixed number of slots per request), not per-token KV
    is_state: ClassVar[bool] = False
    #: a hit needs every token before it cached here (what the eviction cascade follows)
    needs_whole_prefix: ClassVar[bool] = False
    #: the commit caches the group's computed blocks (false for a per-request scratch ring,
    #: whose block covers no token range; a state group's checkpoints are the policy's)
    caches_blocks: ClassVar[bool] = True

    def __init__(
        self,
        group: KVCacheGroup,
        ids: IdCache,
        tables: BlockTables,
        index: PrefixIndex,
        hash_block_size: int,
        hit_step: int,
    ) -> None:
        self.group_id = group.group_id
        self.tables = tables
        self.block_size = group.block_size
        #: the group's window as the plan gives it (0: none; :attr:`window` is what applies)
        self.sliding_window = group.sliding_window or 0
        self.ids = ids
        self.index = index
        self.h = hash_block_size
        self.hit_step = hit_step
        #: hash units per block
        self.units_per_block = group.block_size // hash_block_size
        #: a hit inside a block lands only where an entry is keyed (vLLM's), not at any unit a
        #: cached block holds (``AllocatorOptions.partial_hit_points``; the coordinator sets it)
        self.keyed_partial_hits = False
        #: tokens a hit gives back under vLLM's EAGLE block drop (0: none): this group's hits
        #: need its KV cached that far past them (``AllocatorOptions.eagle_block_drop``; the
        #: coordinator sets it on the drafter's groups)
        self.eagle_drop = 0

    @property
    def window(self) -> int:
        """Tokens before a position that attention reads (0: all of them)."""
        return 0

    def lookup(self, unit: bytes) -> int | None:
        """The id of this group's entry keyed by ``unit``, or None."""
        return self.ids.lookup((self.group_id, unit))

    # ---- hits -------------------------------------------------------------------------------
    @abstractmethod
    def shrink_hit(self, hashes: list[bytes], limit: int, memo: dict[int, int]) -> int:
        """The longest hit ``<= limit`` this group serves (``memo``: per-lookup scratch space a
        group may keep results in while the coordinator iterates to its fixed point)."""

    # ---- admission and allocation -----------------------------------------------------------
    @abstractmethod
    def admit(self, r: Request, hit: int, adm: Admission) -> None:
        """Fill ``r``'s block list from a prefix hit of ``hit`` tokens; add what it needs."""

    def blocks_needed(self, r: Request, total: int) -> int:
        """New ids ``r`` needs in this group to hold ``total`` tokens."""
        return 0

    def skip_blocks(self, r: Request) -> None:
        """Free ``r``'s blocks that no later token reads (a sliding window's)."""
        return  # every token stays in reach of full attention and of a state

    def fast_path_limit(self, r: Request, caching: bool) -> tuple[int, int]:
        """``(limit, work)``: ``r`` may grow below ``limit`` tokens without new ids here, and the
        commit has caching work here once it reaches ``work``."""
        return INF, INF
