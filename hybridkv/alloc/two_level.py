"""Two-level pool: large pages handed to one group at a time, split into that group's small ids.

Large page ``p`` holds ids ``p*k .. p*k+k-1`` of a group with ``k`` ids per page. Each page is in
exactly one of these states:

- **free**: owned by nobody;
- **active**: owned by a group, at least one id in use (page 0 is always active: it holds every
  group's null id, stays with the first attention group and is never given back);
- **idle**: owned, no id in use, some ids still hold cached blocks. Any group may reclaim it (its
  cached entries are evicted); its owner may reactivate it and keep the cached entries it does
  not need to overwrite.

A page whose ids are all free and uncached goes straight back to the free pages, so memory moves
between attention KV and recurrent states as the mix of requests changes.

Free ids of active pages sit in the owner's ``plain`` (uncached, reused first) and ``lru``
(cached, evicted oldest first) lists; ids of idle pages sit in no list. An allocation takes
plain ids, then a free page if one is spare, then cached ids of active pages (evicting them), then
whole pages (free, then the owner's idle pages, then other groups' idle pages, oldest first).
Cached blocks are thus evicted only when no page is free.

With a pool-wide evictor (:attr:`TwoLevelPool.segment_evictor`: Marconi's, which scores cached
segments across groups), a group that has no plain id, no hole on its idle pages and no free
page first asks it to evict until one of those appears; what goes is then chosen by value
across every group, and the page order above serves only when it has nothing left to offer.
A group's cached ids on its idle pages are evictable too: the hole left is filled first.

:meth:`TwoLevelPool.can_allocate` counts ids without the spare-page preference; for an
allocation over several groups, :meth:`TwoLevelPool.reserve` holds back the pages that count
relies on, which is what keeps multi-group allocations all-or-nothing.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping

from .block_pool import CacheKey, Evictor, HeldIds, IdCache, OnEvict
from .errors import DoubleFree, PoolExhausted

__all__ = ["GroupView", "TwoLevelPool"]


class GroupView(IdCache):
    """One group's ids inside a :class:`TwoLevelPool`, with :class:`BlockPool`'s interface."""

    def __init__(self, owner: TwoLevelPool, gid: int, k: int) -> None:
        self.owner = owner
        self.gid = gid
        self.k = k
        self.name = f"{owner.name}[g{gid}]"
        self.num_ids = owner.num_pages * k
        self.ref = [0] * self.num_ids
        self._plain: OrderedDict[int, None] = OrderedDict()
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._key_to_id: dict[CacheKey, int] = {}
        self._id_to_key: dict[int, CacheKey] = {}
        self.pages: set[int] = set()
        self.idle_pages: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.evictor: Evictor | None = None
        self.evictor_window = 1
        self.num_evictions = 0
        self.on_evict = owner.on_evict
        self.stamp = [0] * self.num_ids  # owner.clock when a cached id was last freed
        self.ncached = [0] * owner.num_pages  # cached ids per page

    # ---- capacity ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Ids this group could take now, evicting cached blocks and reclaiming pages."""
        return len(self._plain) + len(self._lru) + self.k * self.owner.pages_available

    @property
    def num_cached(self) -> int:
        return len(self._key_to_id)

    @property
    def num_listed_free(self) -> int:
        """Free ids of the group's active pages (plain or cached): what it can take without
        another page."""
        return len(self._plain) + len(self._lru)

    def cache(self, bid: int, key: CacheKey) -> bool:
        if not super().cache(bid, key):
            return False
        self.ncached[bid // self.k] += 1
        return True

    def _drop_key(self, bid: int) -> None:
        super()._drop_key(bid)
        self.ncached[bid // self.k] -= 1

    def evictable(self, bid: int) -> bool:
        """Free and cached, in the LRU of an active page or on an idle page (evicting it there
        leaves a hole, which this group fills before it takes another page)."""
        return bid in self._lru or (bid // self.k in self.idle_pages and bid in self._id_to_key)

    def _list(self, bid: int) -> None:
        page = bid // self.k
        if page in self.idle_pages:
            self.reactivate(page)

    def demote(self, bid: int) -> None:
        if self.ref[bid] or bid not in self._id_to_key:
            return
        self.stamp[bid] = 0  # as if last used before anything else
        page = bid // self.k
        if page in self.idle_pages:
            self.owner.idle.move_to_end(page, last=False)
            self.owner.idle_stamp[page] = 0
        else:
            self._lru.move_to_end(bid, last=False)

    def _forget(self, bid: int) -> None:
        page = bid // self.k
        if page not in self.idle_pages:
            super()._forget(bid)
            return
        self._drop_key(bid)
        if not self.ncached[page]:
            # nothing left worth keeping on the idle page: it goes back to every group
            del self.idle_pages[page]
            del self.owner.idle[page]
            del self.owner.idle_stamp[page]
            self._give_back(page)

    def num_owned_empty(self) -> int:
        """Ids on this group's pages (active or idle) that hold nothing: neither in use nor
        cached. The null ids of page 0 are not counted."""
        n = len(self._plain)
        cached = self._id_to_key
        for page in self.idle_pages:
            lo = page * self.k
            n += sum(1 for sid in range(lo, lo + self.k) if sid not in cached)
        return n

    def ids_in_use(self, held: Iterable[int]) -> int:
        """Distinct ids ``held`` by requests or cached (the null id not counted)."""
        ids = set(held)
        ids.update(self._key_to_id.values())
        ids.discard(0)
        return len(ids)

    def usage(self) -> float:
        return self.owner.usage()

    def stats(self) -> dict[str, int]:
        return {
            "pages": len(self.pages),
            "idle_pages": len(self.idle_pages),
            "used": sum(1 for r in self.ref if r),
            "free_in_active_pages": len(self._plain),
            "cached_free_in_active_pages": len(self._lru),
            "cached": len(self._key_to_id),
            "evictions": self.num_evictions,
        }

    # ---- pages ------------------------------------------------------------------------------
    def take_fresh_page(self, page: int) -> None:
        self.pages.add(page)
        self.owner.page_owner[page] = self.gid
        self.owner.used[page] = 0
        lo = page * self.k
        plain = self._plain
        for sid in range(lo + self.k - 1, lo - 1, -1):  # lowest id popped first
            if sid:  # id 0 is the null id
                plain[sid] = None

    def reactivate(self, *pages: int) -> None:
        """Idle pages of ours are needed again: their free ids rejoin the lists (the cached
        ones in one merge into the LRU, however many pages: a long hit reactivates many)."""
        cached, owner = self._id_to_key, self.owner
        back = []
        for page in pages:
            del self.idle_pages[page]
            del owner.idle[page]
            del owner.idle_stamp[page]
            lo = page * self.k
            for sid in range(lo + self.k - 1, lo - 1, -1):
                if sid in cached:
                    back.append(sid)
                else:
                    self._plain[sid] = None
        self._rejoin_lru(back)

    def _rejoin_lru(self, ids: list[int]) -> None:
        """Put cached free ids back into the LRU where their last use puts them (the LRU is
        ordered by ``stamp``), so that reactivating a page does not make its blocks the next
        victims, however recently they were used."""
        if not ids:
            return
        stamp, lru = self.stamp, self._lru
        ids.sort(key=stamp.__getitem__)
        if not lru or stamp[ids[0]] >= stamp[next(reversed(lru))]:
            for sid in ids:
                lru[sid] = None
            return
        # Merge them with the shorter of two runs, walked in lockstep: the LRU's ids not newer
        # than the newest of them (then the merged run goes back to the front) or its ids newer
        # than the oldest of them (then to the back). O(shorter run), where rebuilding the whole
        # LRU made each reactivation O(cached ids); ties keep the LRU's ids first either way.
        oldest, newest = stamp[ids[0]], stamp[ids[-1]]
        fwd, bwd = iter(lru), reversed(lru)
        front: list[int] = []
        back: list[int] = []
        while True:
            sid = next(fwd, None)
            if sid is None or stamp[sid] > newest:
                merged = list(heapq.merge(front, ids, key=stamp.__getitem__))
                for sid in ids:
                    lru[sid] = None
                for sid in reversed(merged):
                    lru.move_to_end(sid, last=False)
                return
            front.append(sid)
            sid = next(bwd, None)
            if sid is None or stamp[sid] <= oldest:
                back.reverse()
                for sid in heapq.merge(back, ids, key=stamp.__getitem__):
                    if sid in lru:
                        lru.move_to_end(sid)
                    else:
                        lru[sid] = None
                return
            back.append(sid)

    def _went_unused(self, page: int) -> None:
        """The last id in use on ``page`` was freed: idle it or give it back."""
        lo = page * self.k
        cached = self._id_to_key
        any_cached = False
        for sid in range(lo, lo + self.k):
            if sid in cached:
                any_cached = True
                del self._lru[sid]
            else:
                del self._plain[sid]
        if any_cached:
            self.idle_pages[page] = None
            self.owner.idle[page] = None
            self.owner.idle_stamp[page] = self.owner.clock
        else:
            self._give_back(page)

    def _give_back(self, page: int) -> None:
        self.pages.discard(page)
        self.owner.page_owner[page] = None
        self.owner.free_pages[page] = None

    def surrender(self, page: int) -> None:
        """Another group reclaims our idle ``page``: evict its cached entries."""
        del self.idle_pages[page]
        del self.owner.idle[page]
        del self.owner.idle_stamp[page]
        lo = page * self.k
        for sid in range(lo, lo + self.k):
            if sid in self._id_to_key:
                self._drop_key(sid)
        self.pages.discard(page)
        self.owner.page_owner[page] = None

    def evict_all_free(self) -> int:
        """Drop every cached entry no request holds: idle pages go back to the free pages."""
        n = 0
        for page in list(self.idle_pages):
            n += self.ncached[page]
            self.surrender(page)
            self.owner.free_pages[page] = None
        lru = self._lru
        while lru:
            sid = lru.popitem(last=False)[0]
            self._drop_key(sid)
            self._plain[sid] = None
            n += 1
        return n

    # ---- allocation -------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if not self.owner.can_allocate({self.gid: n}):
            raise PoolExhausted(self.name, n, self.num_free)
        return [self.allocate_one() for _ in range(n)]

    def allocate_some(self, n: int) -> list[int]:
        out = []
        while len(out) < n and self.owner.can_allocate({self.gid: 1}):
            out.append(self.allocate_one())
        return out

    def allocate_one(self) -> int:
        owner = self.owner
        if owner.segment_evictor is not None:
            # the pool's evictor chooses what goes, in any group, until we have room
            while not self._has_room() and owner.segment_evictor():
                pass
        spare = owner.pages_available > owner.reserved_pages  # a page nobody has reserved
        if self._plain:
            sid = self._plain.popitem()[0]
        elif (holey := self._holey_idle_page()) is not None:
            # an idle page of ours has ids holding nothing: use them before taking another
            # page, or they stay owned and empty while the cache shrinks elsewhere
            self.reactivate(holey)
            return self.allocate_one()
        elif owner.free_pages and spare:
            # take a free page rather than evict a cached block: the cache gives way only when
            # nothing is free, as in vLLM
            owner.grant_page(self.gid)
            return self.allocate_one()
        elif self._lru and spare and owner.idle and self._idle_page_is_older():
            # One LRU across groups (as Jenga): an idle page, whoever owns it, whose blocks
            # were used less recently than our oldest cached id goes first.
            owner.take_oldest_idle(self.gid)
            return self.allocate_one()
        elif self._lru:
            sid = self._pop_evict()
        else:
            r = owner.reservations.get(self.gid, 0)
            if r:
                owner.reservations[self.gid] = r - 1
                owner.reserved_pages -= 1
            owner.grant_page(self.gid)
            # take the id from the page just granted: it may be our own idle page, reactivated
            # with its cached ids at the front of the LRU, and recursing would then prefer
            # another group's older idle page and leave this one owned but neither used nor idle
            sid = self._plain.popitem()[0] if self._plain else self._pop_evict()
        self.ref[sid] = 1
        owner.used[sid // self.k] += 1
        return sid

    def _has_room(self) -> bool:
        """An id we can take without evicting: a plain id, a hole on an idle page of ours, or a
        free page nobody else has reserved."""
        owner = self.owner
        return bool(
            self._plain
            or self._holey_idle_page() is not None
            or (
                owner.free_pages
                and (
                    owner.pages_available > owner.reserved_pages
                    or owner.reservations.get(self.gid, 0)
                )
            )
        )

    def _holey_idle_page(self) -> int | None:
        """Our idle page with the most ids holding nothing (None: no idle page has any)."""
        best, most = None, 0
        k, ncached = self.k, self.ncached
        for page in self.idle_pages:
            holes = k - ncached[page]
            if holes > most:
                best, most = page, holes
        return best

    def _idle_page_is_older(self) -> bool:
        owner = self.owner
        page = next(iter(owner.idle))
        return owner.idle_stamp[page] < self.stamp[next(iter(self._lru))]

    def free(self, ids: Iterable[int]) -> None:
        owner = self.owner
        ref, used, k = self.ref, owner.used, self.k
        for sid in ids:
            if sid == 0:
                continue
            r = ref[sid]
            if r <= 0:
                raise DoubleFree(f"block {sid} of {self.name!r}")
            ref[sid] = r - 1
            if r == 1:
                if sid in self._id_to_key:
                    self._lru[sid] = None
                    owner.clock += 1
                    self.stamp[sid] = owner.clock
                else:
                    self._plain[sid] = None
                page = sid // k
                used[page] -= 1
                if used[page] == 0:
                    self._went_unused(page)

    def touch(self, ids: Iterable[int]) -> None:
        ref, used, k = self.ref, self.owner.used, self.k
        ids = list(ids)
        if self.idle_pages:
            # the idle pages the hit reaches, reactivated together: one page at a time, each
            # merge walked the LRU, and the agentic simulator runs spent 94% of their time there
            idle = self.idle_pages
            pages = dict.fromkeys(x // k for x in ids if x and not ref[x] and x // k in idle)
            if pages:
                self.reactivate(*pages)
        for sid in ids:
            if sid == 0:
                continue
            if ref[sid] == 0:  # its page, if it was idle, was reactivated above
                page = sid // k
                del self._lru[sid]
                used[page] += 1
            ref[sid] += 1


class TwoLevelPool:
    """``num_pages`` large pages shared by ``ids_per_page`` groups; see the module docstring.
    A :class:`~.block_pool.Pool`; each group's ids are its :class:`GroupView`."""

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
        self.page_owner: list[int | None] = [None] * num_pages
        self.used = [0] * num_pages  # ids in use per page
        self.free_pages: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_pages))
        self.idle: OrderedDict[int, None] = OrderedDict()  # every group's idle pages, oldest first
        # pages that groups of a multi-group allocation will need once their own free and
        # cached ids run out (see reserve); other groups may not take them to spare the cache
        self.clock = 0  # ticks when a cached id is freed: one LRU order for every group
        self.idle_stamp: dict[int, int] = {}  # idle page -> clock when it went idle
        self.reservations: dict[int, int] = {}
        self.reserved_pages = 0
        #: pool-wide eviction (Marconi's, :class:`~.marconi.MarconiPoolEvictor`), or None: the
        #: page reclaim below and each view's own evictor decide
        self.segment_evictor: Callable[[], bool] | None = None
        self.views = {g: GroupView(self, g, k) for g, k in ids_per_page.items()}
        self.groups = tuple(self.views)
        self.first_gid = first_gid
        self.views[first_gid].take_fresh_page(0)
        self.used[0] = 1  # pinned: other groups' null ids live in page 0

    def view(self, gid: int) -> GroupView:
        return self.views[gid]

    def group_views(self) -> list[tuple[IdCache, list[int]]]:
        return [(v, [g]) for g, v in self.views.items()]

    @property
    def pages_available(self) -> int:
        return len(self.free_pages) + len(self.idle)

    def can_allocate(
        self,
        needs: dict[int, int],
        touch: dict[int, list[int]] | None = None,
        freed: dict[int, int] | None = None,
    ) -> bool:
        """Whether every group ``g`` can get ``needs[g]`` new ids after ``touch[g]`` (cached ids a
        hit will reference) left the free lists and ``freed[g]`` ids were freed (a group with
        one id per page gives the pages back; another keeps the ids for itself); counts pages
        in allocation order."""
        pages = self.pages_available
        if freed:
            needs = dict(needs)
            for gid, n in freed.items():
                if self.views[gid].k == 1:  # an id is a whole page: back to the free pages
                    pages += n
                elif gid in needs:  # the freed ids are the group's own
                    needs[gid] = max(0, needs[gid] - n)
        demand = 0
        for gid in set(needs) | set(touch or ()):
            v = self.views[gid]
            avail = v.num_listed_free
            revived: set[int] = set()
            for sid in (touch or {}).get(gid, ()):
                if sid == 0 or v.ref[sid]:
                    continue
                page = sid // v.k
                if page in v.idle_pages and page not in revived:
                    revived.add(page)
                    pages -= 1
                    avail += v.k
                avail -= 1
            rest = needs.get(gid, 0) - avail
            if rest > 0:
                demand += -(-rest // v.k)
        return demand <= pages

    def reserve(self, needs: dict[int, int]) -> bool:
        """Before allocating ``needs`` ids for several groups at once (after ``can_allocate``):
        reserve the pages each group needs beyond its free and cached ids, so that no group
        takes a free page in place of evicting its cached blocks while another group still
        needs that page. :meth:`release` drops what is left afterwards. One group alone
        reserves nothing (False)."""
        if len(needs) < 2:
            return False
        total = 0
        for gid, n in needs.items():
            v = self.views[gid]
            short = n - v.num_listed_free
            if short > 0:
                p = -(-short // v.k)
                self.reservations[gid] = p
                total += p
        self.reserved_pages = total
        return True

    def release(self) -> None:
        self.reservations.clear()
        self.reserved_pages = 0

    def grant_page(self, gid: int) -> None:
        """Give ``gid`` one more page: a free one, else its own idle page, else the oldest idle
        page of another group (evicting the cached blocks on it)."""
        v = self.views[gid]
        if self.free_pages:
            page = self.free_pages.popitem(last=False)[0]
            v.take_fresh_page(page)
        elif v.idle_pages:
            v.reactivate(next(iter(v.idle_pages)))
        elif self.idle:
            page = next(iter(self.idle))
            owner = self.page_owner[page]
            assert owner is not None and owner != gid
            self.views[owner].surrender(page)
            v.take_fresh_page(page)
        else:
            raise PoolExhausted(self.name, v.k, 0)

    def take_oldest_idle(self, gid: int) -> None:
        """Give ``gid`` the idle page that went idle first (its own: reactivated, keeping its
        cached blocks at the front of the LRU; another group's: its blocks are evicted)."""
        page = next(iter(self.idle))
        owner = self.page_owner[page]
        assert owner is not None
        if owner == gid:
            self.views[gid].reactivate(page)
        else:
            self.views[owner].surrender(page)
            self.views[gid].take_fresh_page(page)

    def evict_all_free(self) -> int:
        """Drop every cached entry no request holds; idle pages go back to the free pages."""
        return sum(v.evict_all_free() for v in self.views.values())

    def ids_in_use(self, held: HeldIds, state_groups: Collection[int]) -> dict[int, int]:
        """Per group: its own small ids held by requests or cached. Cost: O(held and cached
        ids)."""
        return {g: v.ids_in_use(held(g)) for g, v in self.views.items()}

    def byte_usage(self, id_bytes: Mapping[int, int], large_page_bytes: int) -> dict[str, int]:
        """See :class:`~.block_pool.Pool`: free large pages; each group's ids on its pages that
        hold nothing; every large page but page 0, whose first group's other ids are usable."""
        first = self.views[self.first_gid]
        return {
            "free": len(self.free_pages) * large_page_bytes,
            "owned_empty": sum(v.num_owned_empty() * id_bytes[g] for g, v in self.views.items()),
            "usable": (self.num_pages - 1) * large_page_bytes
            + (first.k - 1) * id_bytes[self.first_gid],
        }

    def usage(self) -> float:
        """Fraction of large pages (page 0 excluded) with an id in use."""
        return 1.0 - self.pages_available / (self.num_pages - 1)

    def stats(self) -> dict[str, int]:
        out = {
            "pages": self.num_pages - 1,
            "free_pages": len(self.free_pages),
            "idle_pages": len(self.idle),
            "evictions": sum(v.num_evictions for v in self.views.values()),
        }
        for g, v in self.views.items():
            out[f"g{g}_pages"] = len(v.pages)
            out[f"g{g}_cached"] = v.num_cached
        return out
