"""Block id pools: one flat id space (``BlockPool``) and large pages split per group
(``TwoLevelPool``). Both expose the same per-group interface to the manager."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

from .errors import DoubleFree, PoolExhausted

CacheKey = Hashable  # (group_id, block_hash)
OnEvict = Callable[[CacheKey], None]


class _FreeLists:
    """Free ids in two O(1) lists: uncached ids are reused first (nothing is lost), cached ids
    form an LRU whose front is evicted first. Freed ids are appended, so a request freed
    tail-first puts its tail blocks nearest the front. Holds the cache maps as well."""

    def __init__(self, on_evict: OnEvict | None) -> None:
        self.on_evict = on_evict
        self._plain: OrderedDict[int, None] = OrderedDict()
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._key_to_id: dict[CacheKey, int] = {}
        self._id_to_key: dict[int, CacheKey] = {}

    def _push_free(self, bid: int) -> None:
        if bid in self._id_to_key:
            self._lru[bid] = None
        else:
            self._plain[bid] = None

    def _pop_free(self) -> int:
        if self._plain:
            bid, _ = self._plain.popitem(last=True)  # LIFO: recently used memory first
        else:
            bid, _ = self._lru.popitem(last=False)
            self._evict(bid)
        return bid

    def _drop_free(self, bid: int) -> None:
        """Remove a free id from whichever list holds it."""
        if bid in self._plain:
            del self._plain[bid]
        else:
            self._lru.pop(bid, None)

    def lookup(self, key: CacheKey) -> int | None:
        return self._key_to_id.get(key)

    def cache(self, bid: int, key: CacheKey) -> bool:
        """Record that ``bid`` holds ``key``; False when the key or the id is already cached."""
        if bid == 0 or key in self._key_to_id or bid in self._id_to_key:
            return False
        self._key_to_id[key] = bid
        self._id_to_key[bid] = key
        if bid in self._plain:  # caching a free id (e.g. a state kept at free time)
            del self._plain[bid]
            self._lru[bid] = None
        return True

    def cached_items(self) -> dict[CacheKey, int]:
        return dict(self._key_to_id)

    def key_of(self, bid: int) -> CacheKey | None:
        return self._id_to_key.get(bid)

    def _evict(self, bid: int) -> None:
        key = self._id_to_key.pop(bid, None)
        if key is not None:
            del self._key_to_id[key]
            if self.on_evict is not None:
                self.on_evict(key)


class BlockPool(_FreeLists):
    """Ids ``1..num_ids-1`` of one id space; 0 is the null block (never handed out, never
    ref-counted). A shared pool serves several groups; cache keys carry the group id."""

    def __init__(self, num_ids: int, name: str = "pool", on_evict: OnEvict | None = None) -> None:
        if num_ids < 2:
            raise ValueError(f"pool {name!r} needs at least 2 ids (null + one), got {num_ids}")
        super().__init__(on_evict)
        self.name = name
        self.num_ids = num_ids
        self.ref = [0] * num_ids
        self._plain = OrderedDict.fromkeys(range(num_ids - 1, 0, -1))  # id 1 pops first

    @property
    def num_free(self) -> int:
        return len(self._plain) + len(self._lru)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise PoolExhausted(self.name, n, self.num_free)
        out = []
        for _ in range(n):
            bid = self._pop_free()
            self.ref[bid] = 1
            out.append(bid)
        return out

    def free(self, ids: Iterable[int]) -> None:
        """Drop one reference from each id; pass them tail-first so tails are evicted first."""
        for bid in ids:
            if bid == 0:
                continue
            if self.ref[bid] <= 0:
                raise DoubleFree(f"block {bid} of pool {self.name!r}")
            self.ref[bid] -= 1
            if self.ref[bid] == 0:
                self._push_free(bid)

    def touch(self, ids: Iterable[int]) -> None:
        """Take a reference on cached ids (a prefix hit); free ones leave the LRU."""
        for bid in ids:
            if bid == 0:
                continue
            if self.ref[bid] == 0:
                self._drop_free(bid)
            self.ref[bid] += 1

    def refcount(self, bid: int) -> int:
        return self.ref[bid]

    def usage(self) -> float:
        return 1.0 - self.num_free / (self.num_ids - 1)


class _GroupView(_FreeLists):
    """One group's ids inside a ``TwoLevelPool``; same interface as ``BlockPool``."""

    def __init__(self, owner: TwoLevelPool, gid: int, k: int) -> None:
        super().__init__(owner.on_evict)
        self.owner = owner
        self.gid = gid
        self.k = k
        self.name = f"{owner.name}[g{gid}]"
        self.num_ids = owner.num_pages * k
        self.ref: dict[int, int] = {}
        self.pages: set[int] = set()
        self.used: dict[int, int] = {}  # page -> ids with ref > 0
        self.fully_free: set[int] = set()  # owned pages with no id in use (reclaimable)

    @property
    def num_free(self) -> int:
        return (
            len(self._plain)
            + len(self._lru)
            + self.k * self.owner.reclaimable_pages(excluding=self.gid)
        )

    def partial_free(self) -> int:
        """Free ids in owned pages that are not wholly free."""
        return len(self._plain) + len(self._lru) - self.k * len(self.fully_free)

    def can_allocate(self, n: int) -> bool:
        return self.owner.can_allocate({self.gid: n})

    def _take_page(self, page: int) -> None:
        self.pages.add(page)
        self.used[page] = 0
        self.fully_free.add(page)
        lo = page * self.k
        for sid in range(lo + self.k - 1, lo - 1, -1):
            if sid != 0:  # the group's null id is never handed out
                self._plain[sid] = None

    def _release_page(self, page: int) -> None:
        """Give a fully free page back, evicting its cached ids."""
        lo = page * self.k
        for sid in range(lo, lo + self.k):
            self._drop_free(sid)
            self._evict(sid)
        self.pages.discard(page)
        self.fully_free.discard(page)
        del self.used[page]

    def allocate(self, n: int) -> list[int]:
        out: list[int] = []
        try:
            for _ in range(n):
                # Prefer uncached ids, then a fresh page, then evicting our own cached ids,
                # and only then a reclaimed page of another group.
                if not self._plain and (self.owner.has_free_page() or not self._lru):
                    self.owner.grant_page(self.gid)
                sid = self._pop_free()
                self.ref[sid] = 1
                page = sid // self.k
                self.used[page] += 1
                self.fully_free.discard(page)
                out.append(sid)
        except PoolExhausted:
            self.free(reversed(out))
            raise
        return out

    def free(self, ids: Iterable[int]) -> None:
        for sid in ids:
            if sid == 0:
                continue
            r = self.ref.get(sid, 0)
            if r <= 0:
                raise DoubleFree(f"block {sid} of {self.name!r}")
            if r == 1:
                del self.ref[sid]
                self._push_free(sid)
                page = sid // self.k
                self.used[page] -= 1
                if self.used[page] == 0 and page != 0:  # page 0 is pinned
                    self.fully_free.add(page)
            else:
                self.ref[sid] = r - 1

    def touch(self, ids: Iterable[int]) -> None:
        for sid in ids:
            if sid == 0:
                continue
            r = self.ref.get(sid, 0)
            if r == 0:
                self._drop_free(sid)
                page = sid // self.k
                self.used[page] += 1
                self.fully_free.discard(page)
            self.ref[sid] = r + 1

    def refcount(self, sid: int) -> int:
        return self.ref.get(sid, 0)


class TwoLevelPool:
    """``num_pages`` large pages; a page is owned by one group at a time and split into that
    group's ``k`` small ids. Page 0 holds every group's null id and stays with ``first_gid``."""

    def __init__(
        self,
        num_pages: int,
        ids_per_page: dict[int, int],
        first_gid: int,
        name: str = "pages",
        on_evict: OnEvict | None = None,
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"two-level pool {name!r} needs at least 2 large pages")
        self.name = name
        self.num_pages = num_pages
        self.on_evict = on_evict
        self.views = {g: _GroupView(self, g, k) for g, k in ids_per_page.items()}
        self.page_owner: list[int | None] = [None] * num_pages
        self._free_pages: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_pages))
        self.page_owner[0] = first_gid
        v = self.views[first_gid]
        v._take_page(0)
        # Page 0 is pinned: other groups' null ids live in it, so it is never reclaimed.
        v.fully_free.discard(0)

    def view(self, gid: int) -> _GroupView:
        return self.views[gid]

    def has_free_page(self) -> bool:
        return bool(self._free_pages)

    def reclaimable_pages(self, excluding: int | None = None) -> int:
        n = len(self._free_pages)
        for g, v in self.views.items():
            if g != excluding:
                n += len(v.fully_free)
        return n

    def can_allocate(self, needs: dict[int, int]) -> bool:
        """Exact check: ids in partly used own pages first, then whole pages from the pool."""
        pages_needed = 0
        for g, n in needs.items():
            v = self.views[g]
            rest = n - v.partial_free()
            if rest > 0:
                pages_needed += -(-rest // v.k)
        return pages_needed <= self.reclaimable_pages()

    def grant_page(self, gid: int) -> None:
        if self._free_pages:
            page, _ = self._free_pages.popitem(last=False)
        else:
            page = None
            for g, v in self.views.items():
                if g != gid and v.fully_free:
                    page = next(iter(v.fully_free))
                    v._release_page(page)
                    break
            if page is None:
                raise PoolExhausted(self.name, 1, 0)
        self.page_owner[page] = gid
        self.views[gid]._take_page(page)

    def usage(self) -> float:
        return 1.0 - self.reclaimable_pages() / (self.num_pages - 1)
