"""A flat pool of block ids with reference counts, free lists and a prefix-cache map.

Id 0 is the null block: never handed out, never ref-counted; block tables use it for padding and
for sliding-window blocks that fell out of the window. Free ids sit in one of two O(1) lists
(``OrderedDict``s, whose moves and pops are C code):

- ``plain``: free ids holding nothing worth keeping; reused first, last-freed first (the memory
  most recently touched is the most likely to still be in cache lines/TLB; vLLM v0.33 prepends
  them to its free queue for the same reason).
- ``lru``: free ids that still hold a cached block, oldest first. Allocation evicts from the
  front. Callers free a request's blocks tail first, so among one request's blocks the tail
  (least shared, least likely to be hit) is evicted before its prefix, as in vLLM.

An optional *evictor* replaces plain LRU: it sees the ``window`` oldest cached ids and returns
the victim, which may be any id of the LRU (Marconi's eviction, :mod:`.marconi`, picks the
cached segment of least utility wherever its ids are in the LRU).

Two interfaces, so that the allocator never asks which kind of pool it holds:

- :class:`IdCache`, a group's ids (:class:`BlockPool`, or a two-level pool's group view):
  allocate, free, touch, cache, look up, evict one entry;
- :class:`Pool`, a capacity the plan's groups share (:class:`BlockPool`, or
  :class:`~.two_level.TwoLevelPool`): whether an allocation over several groups fits, the
  reservation that keeps it all-or-nothing, the ids each group holds, eviction of every free
  entry, usage and stats.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from itertools import islice
from typing import Protocol

from .errors import DoubleFree, PoolExhausted

CacheKey = Hashable  # (group_id, hash of the last hash unit the entry covers)
OnEvict = Callable[[CacheKey, int], None]
Evictor = Callable[[list[int]], int]
#: the ids running requests hold in a group (block lists, private checkpoints), by group id
HeldIds = Callable[[int], list[int]]

__all__ = ["BlockPool", "CacheKey", "Evictor", "HeldIds", "IdCache", "OnEvict", "Pool"]


class IdCache(ABC):
    """What :class:`BlockPool` and a two-level pool's group view share: reference counts, the
    LRU of cached free ids with its optional evictor, and the key <-> id cache map. Subclasses
    set ``name``, ``ref``, ``_plain``, ``_lru``, ``_key_to_id``, ``_id_to_key``, ``on_evict``,
    ``evictor``, ``evictor_window`` and ``num_evictions``."""

    name: str
    ref: list[int]
    _plain: OrderedDict[int, None]
    _lru: OrderedDict[int, None]
    _key_to_id: dict[CacheKey, int]
    _id_to_key: dict[int, CacheKey]
    on_evict: OnEvict | None
    evictor: Evictor | None
    evictor_window: int
    num_evictions: int

    def _pop_evict(self) -> int:
        lru = self._lru
        if not lru:
            raise PoolExhausted(self.name, 1, 0)
        if self.evictor is None or len(lru) == 1:
            bid = lru.popitem(last=False)[0]
        else:
            bid = self.evictor(list(islice(lru, self.evictor_window)))
            self._list(bid)
            del lru[bid]
        self._drop_key(bid)
        return bid

    def _list(self, bid: int) -> None:
        """The evictor chose ``bid``, free and cached (:meth:`evictable`): make sure it is in the
        LRU (a two-level view's id may be on an idle page, which is reactivated)."""
        return None  # a pool's cached free ids are always listed

    def _drop_key(self, bid: int) -> None:
        key = self._id_to_key.pop(bid)
        del self._key_to_id[key]
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(key, bid)

    def drop_cached(self, bid: int) -> bool:
        """Evict the cached entry of a free id now (it can no longer serve a hit) and make the
        id plain free. False, changing nothing, if the id is held or holds no entry."""
        if self.ref[bid] or bid not in self._id_to_key:
            return False
        self._forget(bid)
        return True

    def demote(self, bid: int) -> None:
        """Make a free cached id the next to be evicted (its entry is unlikely to be hit)."""
        if self.ref[bid] == 0 and bid in self._lru:
            self._lru.move_to_end(bid, last=False)

    def _forget(self, bid: int) -> None:
        del self._lru[bid]
        self._drop_key(bid)
        self._plain[bid] = None

    def refcount(self, bid: int) -> int:
        return self.ref[bid]

    def evictable(self, bid: int) -> bool:
        """Whether ``bid`` is free and cached in this pool's LRU (an eviction could take it)."""
        return bid in self._lru

    # ---- prefix cache -----------------------------------------------------------------------
    def lookup(self, key: CacheKey) -> int | None:
        return self._key_to_id.get(key)

    def key_of(self, bid: int) -> CacheKey | None:
        return self._id_to_key.get(bid)

    def cache(self, bid: int, key: CacheKey) -> bool:
        """Record that ``bid`` (held by a request) holds ``key``. False, changing nothing, when
        the key is cached already (another block computed the same tokens: vLLM keeps such
        duplicates uncached so block tables stay append-only) or the id holds another key."""
        if bid == 0 or key in self._key_to_id or bid in self._id_to_key:
            return False
        if self.ref[bid] <= 0:
            raise ValueError(f"block {bid} of {self.name!r} is free; cache blocks while held")
        self._key_to_id[key] = bid
        self._id_to_key[bid] = key
        return True

    def uncache(self, bid: int) -> None:
        """Forget a held id's cache entry (its content is about to be overwritten)."""
        if self.ref[bid] <= 0:
            raise ValueError(f"block {bid} of {self.name!r} is free; only held ids are uncached")
        if bid in self._id_to_key:
            self._drop_key(bid)
            self.num_evictions -= 1  # an overwrite, not a capacity eviction

    def cached_items(self) -> dict[CacheKey, int]:
        return dict(self._key_to_id)

    def free_ids(self) -> set[int]:
        """Every free id an allocation could take without new pages (for checks)."""
        return set(self._plain) | set(self._lru)

    def free_lists(self) -> tuple[list[int], list[int]]:
        """The free ids listed as plain and as cached (LRU order), copied (for checks)."""
        return list(self._plain), list(self._lru)

    @abstractmethod
    def allocate_one(self) -> int:
        """One id, free or evicted; raises :class:`PoolExhausted` when there is none."""

    @abstractmethod
    def allocate_some(self, n: int) -> list[int]:
        """Up to ``n`` ids, as many as are free or evictable (best effort: a checkpoint)."""


class Pool(Protocol):
    """A capacity that some of the plan's groups share: :class:`BlockPool` or
    :class:`~.two_level.TwoLevelPool`. ``needs``, ``touch`` and ``freed`` map group ids of the
    pool to id counts or lists."""

    name: str
    groups: Sequence[int]
    #: pool-wide eviction for a pool whose groups have ids of their own (several
    #: :meth:`group_views`): called while the group that needs an id has none free, it evicts
    #: the least valuable cached entry of any group (False: nothing to evict); None: each
    #: view's own evictor and the pool's page reclaim decide (:mod:`.marconi`)
    segment_evictor: Callable[[], bool] | None

    def view(self, gid: int) -> IdCache:
        """Where ``gid``'s ids come from."""

    def group_views(self) -> list[tuple[IdCache, list[int]]]:
        """Each distinct :meth:`view`, with the groups it serves."""

    def can_allocate(
        self,
        needs: dict[int, int],
        touch: dict[int, list[int]] | None = None,
        freed: dict[int, int] | None = None,
    ) -> bool:
        """Whether every group ``g`` can get ``needs[g]`` new ids once the cached ids
        ``touch[g]`` (a hit's) left the free lists and ``freed[g]`` ids were freed."""

    def reserve(self, needs: dict[int, int]) -> bool:
        """Before allocating ``needs`` (after :meth:`can_allocate`): hold back what each group
        relies on so that the allocation cannot fail half way. True if :meth:`release` must
        follow the allocation."""

    def release(self) -> None:
        """Drop what :meth:`reserve` held back."""

    def ids_in_use(self, held: HeldIds, per_request: Collection[int]) -> dict[int, int]:
        """Per group: ids that hold data (held by running requests, ``held(g)``, or cached);
        ``per_request``: the groups whose ids are counted from their requests' (states,
        rings)."""

    def evict_all_free(self) -> int:
        """Drop every cached entry no request holds; returns how many."""

    def byte_usage(self, id_bytes: Mapping[int, int], large_page_bytes: int) -> dict[str, int]:
        """Bytes ``free`` (ids or large pages holding nothing), ``owned_empty`` (ids a group
        owns that hold nothing) and ``usable`` (every id but the null ones), given each group's
        bytes per id (:mod:`.breakdown`)."""

    def usage(self) -> float: ...

    def stats(self) -> dict[str, int]: ...


class BlockPool(IdCache):
    """Ids ``1..num_ids-1`` of one id space. A shared pool serves several groups at once
    (``groups``): cache keys carry the group id, and an id serves one group at a time. Both a
    :class:`Pool` and every group's :class:`IdCache`."""

    def __init__(
        self,
        num_ids: int,
        name: str = "pool",
        on_evict: OnEvict | None = None,
        groups: Sequence[int] = (),
    ) -> None:
        if num_ids < 2:
            raise ValueError(f"pool {name!r} needs at least 2 ids (null + one), got {num_ids}")
        self.name = name
        self.groups = tuple(groups)
        self.num_ids = num_ids
        self.on_evict = on_evict
        self.ref = [0] * num_ids
        # popitem(last=True) pops the smallest id first, so a fresh pool hands out 1, 2, 3...
        self._plain: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_ids - 1, 0, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._key_to_id: dict[CacheKey, int] = {}
        self._id_to_key: dict[int, CacheKey] = {}
        self.evictor: Evictor | None = None
        self.evictor_window = 1
        self.num_evictions = 0
        #: cached entries per group (kept as they come and go: counting them at every memory
        #: sample walked every key)
        self.cached_per_group: Counter[int] = Counter()
        # one id space for every group: its own evictor already chooses across them
        self.segment_evictor: Callable[[], bool] | None = None

    def cache(self, bid: int, key: CacheKey) -> bool:
        if not super().cache(bid, key):
            return False
        self.cached_per_group[key[0]] += 1  # type: ignore[index]
        return True

    def _drop_key(self, bid: int) -> None:
        """:class:`IdCache`'s, counting the group's entry out first (``on_evict`` may look)."""
        self.cached_per_group[self._id_to_key[bid][0]] -= 1  # type: ignore[index]
        super()._drop_key(bid)

    # ---- capacity ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Ids that an allocation can take now (free, or cached and evictable)."""
        return len(self._plain) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_ids - 1 - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._key_to_id)

    @property
    def num_plain_free(self) -> int:
        """Free ids that hold nothing."""
        return len(self._plain)

    @property
    def num_cached_free(self) -> int:
        return len(self._lru)

    def available_after_touch(self, touch: Iterable[int]) -> int:
        """Free ids left once ``touch`` (cached ids a hit will reference) leave the free lists."""
        ref = self.ref
        return self.num_free - sum(1 for b in touch if b and ref[b] == 0)

    # ---- the Pool interface -----------------------------------------------------------------
    def view(self, gid: int) -> BlockPool:
        return self

    def group_views(self) -> list[tuple[IdCache, list[int]]]:
        return [(self, list(self.groups))]

    def can_allocate(
        self,
        needs: dict[int, int],
        touch: dict[int, list[int]] | None = None,
        freed: dict[int, int] | None = None,
    ) -> bool:
        """See :class:`Pool`. Any group can use the ids another frees or is still to take."""
        n = sum(needs.values())
        if freed:
            n -= sum(freed.values())
        if not touch:
            return n <= len(self._plain) + len(self._lru)
        return n <= self.available_after_touch([b for ids in touch.values() for b in ids])

    def reserve(self, needs: dict[int, int]) -> bool:
        """Nothing to hold back: an id is an id to every group."""
        return False

    def release(self) -> None:
        pass

    def ids_in_use(self, held: HeldIds, per_request: Collection[int]) -> dict[int, int]:
        """Ids held or cached. Serving several groups, a ``per_request`` group (a state, a
        ring) counts its requests' ids and its cached entries, and the first other group every
        other id that is not free (shared prefix blocks once, however many requests use them).
        Cost: O(1) for one group, else O(the per-request groups' held ids)."""
        total = self.num_ids - 1 - len(self._plain)
        if len(self.groups) == 1:
            return {self.groups[0]: total}
        count: dict[int, int] = {}
        cached = self.cached_per_group
        for g in self.groups:
            if g in per_request:
                count[g] = n = cached[g] + len(held(g))
                total -= n
        attn = [g for g in self.groups if g not in per_request]
        for g in attn:
            count[g] = 0
        if attn:
            count[attn[0]] = total
        return count

    def byte_usage(self, id_bytes: Mapping[int, int], large_page_bytes: int) -> dict[str, int]:
        """See :class:`Pool`: an id is worth its lowest group's bytes (one size in a pool)."""
        size = id_bytes[min(self.groups)]
        return {
            "free": len(self._plain) * size,
            "owned_empty": 0,
            "usable": (self.num_ids - 1) * size,
        }

    def usage(self) -> float:
        """Fraction of ids in use by requests (cached free ids count as free, like vLLM)."""
        return 1.0 - self.num_free / (self.num_ids - 1)

    def stats(self) -> dict[str, int]:
        return {
            "ids": self.num_ids - 1,
            "used": self.num_used,
            "free": len(self._plain),
            "cached_free": len(self._lru),
            "cached": len(self._key_to_id),
            "evictions": self.num_evictions,
        }

    # ---- allocation -------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` ids with reference count 1; raises :class:`PoolExhausted` (changing nothing)
        when fewer are available."""
        if n > len(self._plain) + len(self._lru):
            raise PoolExhausted(self.name, n, self.num_free)
        out = []
        ref = self.ref
        plain = self._plain
        for _ in range(n):
            bid = plain.popitem()[0] if plain else self._pop_evict()
            ref[bid] = 1
            out.append(bid)
        return out

    def allocate_one(self) -> int:
        bid = self._plain.popitem()[0] if self._plain else self._pop_evict()
        self.ref[bid] = 1
        return bid

    def allocate_some(self, n: int) -> list[int]:
        return self.allocate(min(n, len(self._plain) + len(self._lru)))

    def free(self, ids: Iterable[int]) -> None:
        """Drop one reference from each id (0 is skipped). Pass a request's blocks tail first."""
        ref = self.ref
        for bid in ids:
            if bid == 0:
                continue
            r = ref[bid]
            if r <= 0:
                raise DoubleFree(f"block {bid} of pool {self.name!r}")
            ref[bid] = r - 1
            if r == 1:
                if bid in self._id_to_key:
                    self._lru[bid] = None
                else:
                    self._plain[bid] = None

    def touch(self, ids: Iterable[int]) -> None:
        """Take a reference on cached ids (a prefix hit); free ones leave the LRU."""
        ref = self.ref
        for bid in ids:
            if bid == 0:
                continue
            if ref[bid] == 0:
                del self._lru[bid]
            ref[bid] += 1

    def evict_all_free(self) -> int:
        """Drop every cached entry that no request holds; returns how many."""
        n = 0
        while self._lru:
            bid = self._lru.popitem(last=False)[0]
            self._drop_key(bid)
            self._plain[bid] = None
            n += 1
        return n
