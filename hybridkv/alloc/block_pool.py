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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from itertools import islice

from .errors import DoubleFree, PoolExhausted

CacheKey = Hashable  # (group_id, hash of the last hash unit the entry covers)
OnEvict = Callable[[CacheKey, int], None]
Evictor = Callable[[list[int]], int]

__all__ = ["BlockPool", "CacheKey", "Evictor", "IdCache", "OnEvict"]


class IdCache:
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
            del lru[bid]
        self._drop_key(bid)
        return bid

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


class BlockPool(IdCache):
    """Ids ``1..num_ids-1`` of one id space. A shared pool serves several groups at once: cache
    keys carry the group id, and an id serves one group at a time."""

    def __init__(self, num_ids: int, name: str = "pool", on_evict: OnEvict | None = None) -> None:
        if num_ids < 2:
            raise ValueError(f"pool {name!r} needs at least 2 ids (null + one), got {num_ids}")
        self.name = name
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

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._plain) + len(self._lru)

    def available_after_touch(self, touch: Iterable[int]) -> int:
        """Free ids left once ``touch`` (cached ids a hit will reference) leave the free lists."""
        ref = self.ref
        return self.num_free - sum(1 for b in touch if b and ref[b] == 0)

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
