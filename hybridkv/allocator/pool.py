"""Block pools: hand out block ids of a memory plan, count references, cache freed blocks.

A :class:`BlockPool` serves one id space (``1 .. num_ids - 1``; id 0 is the null block, never
handed out). Freed blocks that carry a prefix-cache hash stay cached until they are evicted, least
recently freed first; blocks without a hash are reused first. Allocation, free and touch are O(1)
per block: the free queue is an insertion-ordered dict used as an LRU.

A :class:`TwoLevelPool` serves a ``two_level`` plan: large pages are handed to one group at a time
and split into that group's small ids; a large page goes back to the shared free list once none of
its ids is in use or cached.
"""

from __future__ import annotations

from collections.abc import Callable

from .errors import PoolExhausted

#: callback ``(group_id, block_id, block_hash)`` run when a cached block is evicted
EvictHook = Callable[[int, int, bytes], None]


class BlockPool:
    """One id space with reference counts and an LRU of cached free blocks."""

    def __init__(self, name: str, ids: range, on_evict: EvictHook | None = None):
        self.name = name
        self.ref = {}  # block -> reference count (live blocks only)
        self.hash_of: dict[int, tuple[int, bytes]] = {}  # block -> (group, hash) while cached
        self.cached: dict[tuple[int, bytes], int] = {}  # (group, hash) -> block
        self._free_plain: list[int] = list(reversed(ids))  # stack: uncached free blocks
        self._free_cached: dict[int, None] = {}  # insertion order = eviction order (LRU first)
        self._on_evict = on_evict
        self.capacity = len(ids)

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (uncached free blocks + evictable cached ones)."""
        return len(self._free_plain) + len(self._free_cached)

    def lookup(self, group: int, block_hash: bytes) -> int | None:
        return self.cached.get((group, block_hash))

    # ---- allocation ------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise PoolExhausted(self.name, n, self.num_free)
        out = []
        for _ in range(n):
            if self._free_plain:
                block = self._free_plain.pop()
            else:
                block = next(iter(self._free_cached))
                del self._free_cached[block]
                self._evict(block)
            self.ref[block] = 1
            out.append(block)
        return out

    def touch(self, block: int) -> None:
        """Take a reference to a cached block (a prefix hit), reviving it if it was free."""
        if block in self.ref:
            self.ref[block] += 1
        else:
            del self._free_cached[block]
            self.ref[block] = 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Pass a request's blocks tail first: among cached
        blocks freed together, the tail is evicted first (its prefix is less likely reused)."""
        for block in blocks:
            count = self.ref[block] - 1
            if count:
                self.ref[block] = count
                continue
            del self.ref[block]
            if block in self.hash_of:
                self._free_cached[block] = None
            else:
                self._free_plain.append(block)

    # ---- prefix cache ----------------------------------------------------------------------
    def cache(self, group: int, block: int, block_hash: bytes) -> bool:
        """Record that ``block`` (held by a request) holds ``block_hash``; False if the hash is
        already cached in another block (the first copy stays the cached one)."""
        key = (group, block_hash)
        if key in self.cached or block in self.hash_of:
            return False
        self.cached[key] = block
        self.hash_of[block] = key
        return True

    def _evict(self, block: int) -> None:
        key = self.hash_of.pop(block, None)
        if key is not None:
            del self.cached[key]
            if self._on_evict is not None:
                self._on_evict(key[0], block, key[1])

    def evict_all_free(self) -> int:
        """Drop every cached free block (``reset_prefix_cache``); returns how many."""
        blocks = list(self._free_cached)
        for block in blocks:
            del self._free_cached[block]
            self._evict(block)
            self._free_plain.append(block)
        return len(blocks)

    def free_cached_blocks(self) -> list[int]:
        return list(self._free_cached)


class TwoLevelPool:
    """Large pages owned by one group at a time, each split into that group's small ids.

    ``ids_per_page[group]`` small ids of a group live in one large page: page ``g`` holds ids
    ``g*k .. g*k+k-1``. Page 0 starts with ``first_group`` (its id 0 is that group's null id).
    """

    def __init__(
        self,
        name: str,
        num_pages: int,
        ids_per_page: dict[int, int],
        first_group: int,
        on_evict: EvictHook | None = None,
    ):
        self.name = name
        self.num_pages = num_pages
        self.ids_per_page = ids_per_page
        self.owner: dict[int, int] = {0: first_group}
        self.free_pages: list[int] = list(range(num_pages - 1, 0, -1))
        self.pools: dict[int, BlockPool] = {}
        self._pages: dict[int, list[int]] = {g: [] for g in ids_per_page}
        self._on_evict = on_evict
        for g in ids_per_page:
            self.pools[g] = BlockPool(f"{name}[{g}]", range(0), on_evict)
            self.pools[g].capacity = 0
        self._grant(0, first_group, skip_null=True)

    def _grant(self, page: int, group: int, skip_null: bool = False) -> None:
        self.owner[page] = group
        k = self.ids_per_page[group]
        ids = range(page * k + (1 if skip_null else 0), (page + 1) * k)
        pool = self.pools[group]
        pool._free_plain.extend(reversed(ids))
        pool.capacity += len(ids)
        self._pages[group].append(page)

    def _reclaim(self, group: int) -> bool:
        """Give back one large page of ``group`` whose ids are all free (evicting cached ones)."""
        pool = self.pools[group]
        k = self.ids_per_page[group]
        for page in self._pages[group]:
            if page == 0:
                continue
            ids = range(page * k, (page + 1) * k)
            if any(i in pool.ref for i in ids):
                continue
            plain = set(pool._free_plain)
            for i in ids:
                if i in pool._free_cached:
                    del pool._free_cached[i]
                    pool._evict(i)
                else:
                    plain.discard(i)
            pool._free_plain = [i for i in pool._free_plain if not page * k <= i < (page + 1) * k]
            pool.capacity -= k
            self._pages[group].remove(page)
            del self.owner[page]
            self.free_pages.append(page)
            return True
        return False

    def num_free(self, group: int) -> int:
        """Ids ``group`` could get now: its own free ids plus whole free large pages."""
        return self.pools[group].num_free + len(self.free_pages) * self.ids_per_page[group]

    def allocate(self, group: int, n: int) -> list[int]:
        pool = self.pools[group]
        while pool.num_free < n:
            if not self.free_pages:
                others = [g for g in self.pools if g != group]
                if not any(self._reclaim(g) for g in others):
                    raise PoolExhausted(self.name, n, pool.num_free)
                continue
            self._grant(self.free_pages.pop(), group)
        return pool.allocate(n)
