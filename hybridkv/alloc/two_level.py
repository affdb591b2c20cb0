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

Page state (owners, ids in use and cached per page, free and idle pages, the clock, the
reservations) is the pool's :class:`~.page_table.PageTable`'s alone; a group's
:class:`GroupView` holds its ids' state and changes pages only through the table's methods.

Free ids of active pages sit in the owner's ``plain`` (uncached, reused first) and ``lru``
(cached, evicted oldest first: a :class:`StampLru`, ordered by the clock tick when each was
freed) lists; ids of idle pages sit in no list. An allocation takes
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

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, KeysView, Mapping, Sequence

from .block_pool import CacheKey, Evictor, HeldIds, IdCache, OnEvict
from .errors import DoubleFree, PoolExhausted
from .page_table import PageTable

__all__ = ["GroupView", "StampLru", "TwoLevelPool"]


class StampLru:
    """A group's free cached ids, oldest first: ordered by ``stamp`` (the clock when each was
    last freed; 0 once demoted), with the interface of the ``OrderedDict`` that
    :class:`~.block_pool.IdCache` uses for its LRU.

    An ``OrderedDict`` only appends: putting a reactivated page's cached ids back where their
    stamps put them meant merging, walking up to the whole LRU per page (the two-level
    simulator runs spent most of their time there). Here every operation on one id is O(1):
    a stamp > 0 belongs to one id (one clock tick stamps one id), so the ids with one are kept
    by stamp, as a byte per clock value set where an id is here; order is the order of the
    stamps, and the next id is found with ``bytearray.find`` (memchr) from a cursor below
    which nothing is set. Ids with stamp 0 come first and keep the order the ``OrderedDict``
    gave them: a demoted id goes before every other, an id rejoining from an idle page after
    the stamp-0 ids already here. Memory: one byte per clock tick, per group.
    """

    def __init__(self) -> None:
        self._zero: OrderedDict[int, None] = OrderedDict()  # stamp-0 ids, in order
        self._stamp: dict[int, int] = {}  # id (stamp > 0) -> its stamp
        self._at: dict[int, int] = {}  # stamp -> its id
        self._bits = bytearray(4096)  # 1 at each stamp of an id here
        self._lo = 0  # no stamp below this one is here

    def __len__(self) -> int:
        return len(self._stamp) + len(self._zero)

    def __contains__(self, sid: object) -> bool:
        return sid in self._stamp or sid in self._zero

    def __iter__(self) -> Iterator[int]:
        yield from self._zero
        bits, at = self._bits, self._at
        i = bits.find(1, self._lo)
        while i >= 0:
            yield at[i]
            i = bits.find(1, i + 1)

    def __delitem__(self, sid: int) -> None:
        self.remove(sid)

    def popitem(self, last: bool = True) -> tuple[int, None]:
        """As ``OrderedDict.popitem``: the newest id (``last``) or the oldest."""
        if not len(self):
            raise KeyError("popitem(): LRU is empty")
        if not last:
            return self.pop_oldest(), None
        if not self._stamp:
            return self._zero.popitem()[0], None
        sid = self._at[self._bits.rfind(1)]
        self.remove(sid)
        return sid, None

    def first(self) -> int:
        """The oldest id (the LRU must not be empty)."""
        if self._zero:
            return next(iter(self._zero))
        self._lo = i = self._bits.find(1, self._lo)
        return self._at[i]

    def pop_oldest(self) -> int:
        """Take out the oldest id (the LRU must not be empty)."""
        if self._zero:
            return self._zero.popitem(last=False)[0]
        i = self._bits.find(1, self._lo)
        sid = self._at.pop(i)
        self._bits[i] = 0
        del self._stamp[sid]
        self._lo = i + 1
        return sid

    def append(self, sid: int, stamp: int) -> None:
        """``sid`` was freed now: ``stamp`` (> 0) is newer than every stamp here."""
        self._put(sid, stamp)

    def rejoin(self, sid: int, stamp: int) -> None:
        """``sid``'s idle page was reactivated: where its stamp puts it (stamp 0: after the
        stamp-0 ids already here)."""
        if stamp:
            self._put(sid, stamp)
        else:
            self._zero[sid] = None

    def rejoin_all(self, ids: Iterable[int], stamp: Sequence[int]) -> None:
        """:meth:`rejoin` each of ``ids`` in turn, ``stamp[sid]`` its stamp (one call per
        reactivated page: a page's ids cost no method call each)."""
        bits, at, of, zero = self._bits, self._at, self._stamp, self._zero
        lo = self._lo
        for sid in ids:
            s = stamp[sid]
            if not s:
                zero[sid] = None
                continue
            if s >= len(bits):
                self._grow(s)
            bits[s] = 1
            at[s] = sid
            of[sid] = s
            if s < lo:
                lo = s
        self._lo = lo

    def remove_all(self, ids: Iterable[int]) -> None:
        """:meth:`remove` each of ``ids`` (a page going idle)."""
        bits, at, of, zero = self._bits, self._at, self._stamp, self._zero
        for sid in ids:
            s = of.pop(sid, 0)
            if s:
                bits[s] = 0
                del at[s]
            else:
                del zero[sid]

    def to_front(self, sid: int) -> None:
        """``sid`` was demoted (its stamp is now 0): it goes before every other id."""
        self.remove(sid)
        self._zero[sid] = None
        self._zero.move_to_end(sid, last=False)

    def _put(self, sid: int, stamp: int) -> None:
        bits = self._bits
        if stamp >= len(bits):
            self._grow(stamp)
        bits[stamp] = 1
        self._at[stamp] = sid
        self._stamp[sid] = stamp
        if stamp < self._lo:
            self._lo = stamp

    def _grow(self, stamp: int) -> None:
        """Room for ``stamp`` (doubling: the clock only grows)."""
        bits = self._bits
        bits.extend(bytes(max(stamp + 1, 2 * len(bits)) - len(bits)))

    def remove(self, sid: int) -> None:
        """Take ``sid`` out (KeyError if it is not here)."""
        stamp = self._stamp.pop(sid, 0)
        if stamp:
            self._bits[stamp] = 0
            del self._at[stamp]
        else:
            del self._zero[sid]

    def check(self, stamp: Sequence[int]) -> None:
        """Assert the maps agree with each other and with ``stamp`` (each id's)."""
        assert all(stamp[sid] == 0 for sid in self._zero), "a stamp-0 id has a stamp"
        assert not set(self._zero) & set(self._stamp), "an id listed twice"
        assert self._at == {s: sid for sid, s in self._stamp.items()}, "stamp maps disagree"
        assert all(stamp[sid] == s > 0 for sid, s in self._stamp.items()), "stamps are stale"
        marked = {i for i, b in enumerate(self._bits) if b}
        assert marked == set(self._at), "stamp bits are stale"
        assert all(i >= self._lo for i in marked), "an id below the cursor"


class GroupView(IdCache):
    """One group's ids inside a :class:`TwoLevelPool`, with :class:`BlockPool`'s interface.
    Its ids' state (reference counts, free lists, cache maps, stamps) is its own; page state
    is the pool's :class:`~.page_table.PageTable`'s, changed only through its methods."""

    _lru: StampLru  # type: ignore[assignment]  # IdCache's LRU interface, ordered by stamp

    def __init__(self, owner: TwoLevelPool, gid: int, k: int) -> None:
        self.owner = owner
        self.table = owner.table
        self.gid = gid
        self.k = k
        self.name = f"{owner.name}[g{gid}]"
        self.num_ids = owner.num_pages * k
        self.ref = [0] * self.num_ids
        self._plain: OrderedDict[int, None] = OrderedDict()
        self._lru = StampLru()
        self._key_to_id: dict[CacheKey, int] = {}
        self._id_to_key: dict[int, CacheKey] = {}
        self.evictor: Evictor | None = None
        self.evictor_window = 1
        self.num_evictions = 0
        self.on_evict = owner.on_evict
        self.stamp = [0] * self.num_ids  # table.clock when a cached id was last freed

    # ---- capacity ---------------------------------------------------------------------------
    @property
    def pages(self) -> frozenset[int]:
        """The pages this group owns, active or idle (a copy)."""
        return self.table.pages_of(self.gid)

    @property
    def idle_pages(self) -> KeysView[int]:
        """This group's idle pages in the order they went idle (a live view)."""
        return self.table.idle_pages(self.gid)

    @property
    def num_free(self) -> int:
        """Ids this group could take now, evicting cached blocks and reclaiming pages."""
        return len(self._plain) + len(self._lru) + self.k * self.table.pages_available

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
        self.table.note_cached(bid // self.k)
        return True

    def _drop_key(self, bid: int) -> None:
        """:class:`IdCache`'s, then the page table counts one cached id less on the page."""
        key = self._id_to_key.pop(bid)
        del self._key_to_id[key]
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(key, bid)
        self.table.note_uncached(bid // self.k)

    def evictable(self, bid: int) -> bool:
        """Free and cached, in the LRU of an active page or on an idle page (evicting it there
        leaves a hole, which this group fills before it takes another page)."""
        return bid in self._lru or (
            self.table.is_idle(bid // self.k, self.gid) and bid in self._id_to_key
        )

    def _list(self, bid: int) -> None:
        page = bid // self.k
        if self.table.is_idle(page, self.gid):
            self.reactivate(page)

    def demote(self, bid: int) -> None:
        if self.ref[bid] or bid not in self._id_to_key:
            return
        self.stamp[bid] = 0  # as if last used before anything else
        page = bid // self.k
        if self.table.is_idle(page, self.gid):
            self.table.demote_idle(page)
        else:
            self._lru.to_front(bid)

    def _forget(self, bid: int) -> None:
        page = bid // self.k
        if not self.table.is_idle(page, self.gid):
            self._lru.remove(bid)
            self._drop_key(bid)
            self._plain[bid] = None
            return
        self._drop_key(bid)
        if not self.table.cached_on(page):
            # nothing left worth keeping on the idle page: it goes back to every group
            self.table.give_back(page)

    def num_owned_empty(self) -> int:
        """Ids on this group's pages (active or idle) that hold nothing: neither in use nor
        cached. The null ids of page 0 are not counted."""
        table, k = self.table, self.k
        return len(self._plain) + sum(k - table.cached_on(p) for p in table.idle_pages(self.gid))

    def ids_in_use(self, held: Iterable[int]) -> int:
        """Distinct ids ``held`` by requests or cached (the null id, never cached, not
        counted). O(held ids): the cached ones are counted by the cache map's size."""
        cached = self._id_to_key
        extra = set(held).difference(cached)  # C's loop over the held ids, not the cached
        extra.discard(0)
        return len(cached) + len(extra)

    def usage(self) -> float:
        return self.owner.usage()

    def stats(self) -> dict[str, int]:
        return {
            "pages": self.table.num_owned(self.gid),
            "idle_pages": len(self.idle_pages),
            "used": sum(1 for r in self.ref if r),
            "free_in_active_pages": len(self._plain),
            "cached_free_in_active_pages": len(self._lru),
            "cached": len(self._key_to_id),
            "evictions": self.num_evictions,
        }

    def check(self) -> None:
        """Assert this view's LRU is ordered by stamp and its cached ids per page are what
        the page table counts."""
        self._lru.check(self.stamp)
        per_page = [0] * self.owner.num_pages
        for sid in self._id_to_key:
            per_page[sid // self.k] += 1
        for page in self.table.pages_of(self.gid):
            n = self.table.cached_on(page)
            assert per_page[page] == n, f"page {page}: {per_page[page]} cached ids, table {n}"

    # ---- pages ------------------------------------------------------------------------------
    def list_fresh_page(self, page: int) -> None:
        """``page`` was just granted to this group (empty): its ids become plain free ids."""
        lo = page * self.k
        plain = self._plain
        for sid in range(lo + self.k - 1, lo - 1, -1):  # lowest id popped first
            if sid:  # id 0 is the null id
                plain[sid] = None

    def reactivate(self, *pages: int) -> None:
        """Idle pages of ours are needed again: their free ids rejoin the lists, the cached
        ones where their last use puts them in the LRU, so that reactivating a page does not
        make its blocks the next victims, however recently they were used."""
        cached, plain, k = self._id_to_key, self._plain, self.k
        for page in pages:
            self.table.reactivate(page)
            lo = page * k
            back = []
            for sid in range(lo + k - 1, lo - 1, -1):
                if sid in cached:
                    back.append(sid)
                else:
                    plain[sid] = None
            self._lru.rejoin_all(back, self.stamp)

    def _went_unused(self, page: int) -> None:
        """The last id in use on ``page`` was freed: idle it or give it back."""
        lo = page * self.k
        cached, plain = self._id_to_key, self._plain
        back = []
        for sid in range(lo, lo + self.k):
            if sid in cached:
                back.append(sid)
            else:
                del plain[sid]
        if back:
            self._lru.remove_all(back)
            self.table.mark_idle(page)
        else:
            self.table.give_back(page)

    def surrender(self, page: int) -> None:
        """Another group reclaims our idle ``page`` (or it goes back to the free pages): evict
        its cached entries. The page is then owned by nobody until claimed or given back."""
        self.table.surrender(page)
        lo = page * self.k
        for sid in range(lo, lo + self.k):
            if sid in self._id_to_key:
                self._drop_key(sid)

    def evict_all_free(self) -> int:
        """Drop every cached entry no request holds: idle pages go back to the free pages."""
        n = 0
        table = self.table
        for page in list(table.idle_pages(self.gid)):
            n += table.cached_on(page)
            self.surrender(page)
            table.give_back(page)
        lru = self._lru
        while lru:
            sid = lru.pop_oldest()
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
        owner, table, gid = self.owner, self.table, self.gid
        while True:  # each pass either takes an id or makes one listed, then looks again
            if owner.segment_evictor is not None:
                # the pool's evictor chooses what goes, in any group, until we have room
                while not self._has_room() and owner.segment_evictor():
                    pass
            spare = table.pages_available > table.reserved_pages  # a page nobody reserved
            if self._plain:
                sid = self._plain.popitem()[0]
                break
            if (holey := table.holey_idle_page(gid)) is not None:
                # an idle page of ours has ids holding nothing: use them before taking another
                # page, or they stay owned and empty while the cache shrinks elsewhere
                self.reactivate(holey)
            elif table.num_free and spare:
                # take a free page rather than evict a cached block: the cache gives way only
                # when nothing is free, as in vLLM
                owner.grant_page(gid)
            elif self._lru and spare and table.num_idle and self._idle_page_is_older():
                # One LRU across groups (as Jenga): an idle page, whoever owns it, whose blocks
                # were used less recently than our oldest cached id goes first.
                owner.take_oldest_idle(gid)
            elif self._lru:
                sid = self._pop_evict()
                break
            else:
                table.use_reservation(gid)
                owner.grant_page(gid)
                # take the id from the page just granted: it may be our own idle page,
                # reactivated with its cached ids at the front of the LRU, and looking again
                # would then prefer another group's older idle page and leave this one owned
                # but neither used nor idle
                sid = self._plain.popitem()[0] if self._plain else self._pop_evict()
                break
        self.ref[sid] = 1
        table.use(sid // self.k)
        return sid

    def _has_room(self) -> bool:
        """An id we can take without evicting: a plain id, a hole on an idle page of ours, or a
        free page nobody else has reserved."""
        table = self.table
        return bool(
            self._plain
            or table.holey_idle_page(self.gid) is not None
            or (
                table.num_free
                and (table.pages_available > table.reserved_pages or table.reserved_for(self.gid))
            )
        )

    def _idle_page_is_older(self) -> bool:
        _, idle_stamp = self.table.oldest_idle()
        return idle_stamp < self.stamp[self._lru.first()]

    def free(self, ids: Iterable[int]) -> None:
        ref, k, stamp = self.ref, self.k, self.stamp
        cached, plain = self._id_to_key, self._plain
        tick, unuse, append = self.table.tick, self.table.unuse, self._lru.append
        for sid in ids:
            if sid == 0:
                continue
            r = ref[sid]
            if r <= 0:
                raise DoubleFree(f"block {sid} of {self.name!r}")
            ref[sid] = r - 1
            if r == 1:
                if sid in cached:
                    stamp[sid] = now = tick()
                    append(sid, now)
                else:
                    plain[sid] = None
                page = sid // k
                if not unuse(page):
                    self._went_unused(page)

    def touch_cost(self, ids: Iterable[int]) -> tuple[int, int]:
        """What :meth:`touch` of ``ids`` would take: (free ids taken, idle pages of ours it
        would reactivate, whose other ids would join the lists)."""
        ref, k, idle = self.ref, self.k, self.table.idle_pages(self.gid)
        taken = 0
        revived: set[int] = set()
        for sid in ids:
            if sid == 0 or ref[sid]:
                continue
            taken += 1
            if idle and sid // k in idle:
                revived.add(sid // k)
        return taken, len(revived)

    def touch(self, ids: Iterable[int]) -> None:
        ref, k, table = self.ref, self.k, self.table
        ids = list(ids)
        idle = table.idle_pages(self.gid)
        if idle:
            # the idle pages the hit reaches, reactivated together before any id is taken
            pages = dict.fromkeys(x // k for x in ids if x and not ref[x] and x // k in idle)
            if pages:
                self.reactivate(*pages)
        lru = self._lru
        for sid in ids:
            if sid == 0:
                continue
            if ref[sid] == 0:  # its page, if it was idle, was reactivated above
                lru.remove(sid)
                table.use(sid // k)
            ref[sid] += 1


class TwoLevelPool:
    """``num_pages`` large pages shared by ``ids_per_page`` groups; see the module docstring.
    A :class:`~.block_pool.Pool`; each group's ids are its :class:`GroupView`, the pages'
    state is :attr:`table` (a :class:`~.page_table.PageTable`)."""

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
        self.table = PageTable(num_pages, ids_per_page, first_gid)
        #: pool-wide eviction (Marconi's, :class:`~.marconi.MarconiPoolEvictor`), or None: the
        #: page reclaim below and each view's own evictor decide
        self.segment_evictor: Callable[[], bool] | None = None
        self.views = {g: GroupView(self, g, k) for g, k in ids_per_page.items()}
        self.groups = tuple(self.views)
        self.first_gid = first_gid
        self.views[first_gid].list_fresh_page(0)  # the table pinned page 0 to this group

    def view(self, gid: int) -> GroupView:
        return self.views[gid]

    def group_views(self) -> list[tuple[IdCache, list[int]]]:
        return [(v, [g]) for g, v in self.views.items()]

    # ---- read-only page state (the table's) -------------------------------------------------
    @property
    def pages_available(self) -> int:
        return self.table.pages_available

    @property
    def page_owner(self) -> tuple[int | None, ...]:
        """Each page's group (None: free), a copy."""
        return tuple(self.table.owner_of(p) for p in range(self.num_pages))

    @property
    def used(self) -> tuple[int, ...]:
        """Ids in use per page (page 0 counts one more: its pin), a copy."""
        return tuple(self.table.in_use(p) for p in range(self.num_pages))

    @property
    def free_pages(self) -> Mapping[int, None]:
        return self.table.free_pages()

    @property
    def idle(self) -> Mapping[int, int]:
        """Every group's idle pages -> idle stamp, reclaimed first first."""
        return self.table.idle_by_age()

    @property
    def reserved_pages(self) -> int:
        return self.table.reserved_pages

    # ---- capacity ---------------------------------------------------------------------------
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
        pages = self.table.pages_available
        if freed:
            needs = dict(needs)
            for gid, n in freed.items():
                if self.views[gid].k == 1:  # an id is a whole page: back to the free pages
                    pages += n
                elif gid in needs:  # the freed ids are the group's own
                    needs[gid] = max(0, needs[gid] - n)
        demand = 0
        for gid in needs.keys() | touch.keys() if touch else needs:
            v = self.views[gid]
            avail = v.num_listed_free
            if touch and gid in touch:
                taken, revived = v.touch_cost(touch[gid])
                pages -= revived
                avail += revived * v.k - taken
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
        pages = {}
        for gid, n in needs.items():
            v = self.views[gid]
            short = n - v.num_listed_free
            if short > 0:
                pages[gid] = -(-short // v.k)
        self.table.reserve(pages)
        return True

    def release(self) -> None:
        self.table.release()

    # ---- pages between groups ---------------------------------------------------------------
    def grant_page(self, gid: int) -> None:
        """Give ``gid`` one more page: a free one, else its own idle page, else the oldest idle
        page of another group (evicting the cached blocks on it)."""
        v, table = self.views[gid], self.table
        if table.num_free:
            v.list_fresh_page(table.take_free_page(gid))
        elif v.idle_pages:
            v.reactivate(table.first_idle_of(gid))
        elif table.num_idle:
            page, _ = table.oldest_idle()
            assert table.owner_of(page) != gid
            self._hand_over(page, gid)
        else:
            raise PoolExhausted(self.name, v.k, 0)

    def take_oldest_idle(self, gid: int) -> None:
        """Give ``gid`` the idle page that went idle first (its own: reactivated, keeping its
        cached blocks at the front of the LRU; another group's: its blocks are evicted)."""
        page, _ = self.table.oldest_idle()
        if self.table.owner_of(page) == gid:
            self.views[gid].reactivate(page)
        else:
            self._hand_over(page, gid)

    def _hand_over(self, page: int, gid: int) -> None:
        """Another group's idle ``page`` becomes ``gid``'s, its cached blocks evicted."""
        owner = self.table.owner_of(page)
        assert owner is not None
        self.views[owner].surrender(page)
        self.table.claim(page, gid)
        self.views[gid].list_fresh_page(page)

    # ---- the Pool interface -----------------------------------------------------------------
    def evict_all_free(self) -> int:
        """Drop every cached entry no request holds; idle pages go back to the free pages."""
        return sum(v.evict_all_free() for v in self.views.values())

    def ids_in_use(self, held: HeldIds, per_request: Collection[int]) -> dict[int, int]:
        """Per group: its own small ids held by requests or cached. Cost: O(held ids)."""
        return {g: v.ids_in_use(held(g)) for g, v in self.views.items()}

    def byte_usage(self, id_bytes: Mapping[int, int], large_page_bytes: int) -> dict[str, int]:
        """See :class:`~.block_pool.Pool`: free large pages; each group's ids on its pages that
        hold nothing; every large page but page 0, whose first group's other ids are usable."""
        first = self.views[self.first_gid]
        return {
            "free": self.table.num_free * large_page_bytes,
            "owned_empty": sum(v.num_owned_empty() * id_bytes[g] for g, v in self.views.items()),
            "usable": (self.num_pages - 1) * large_page_bytes
            + (first.k - 1) * id_bytes[self.first_gid],
        }

    def usage(self) -> float:
        """Fraction of large pages (page 0 excluded) with an id in use."""
        return 1.0 - self.table.pages_available / (self.num_pages - 1)

    def stats(self) -> dict[str, int]:
        out = {
            "pages": self.num_pages - 1,
            "free_pages": self.table.num_free,
            "idle_pages": self.table.num_idle,
            "evictions": sum(v.num_evictions for v in self.views.values()),
        }
        for g, v in self.views.items():
            out[f"g{g}_pages"] = self.table.num_owned(g)
            out[f"g{g}_cached"] = v.num_cached
        return out

    def check(self) -> None:
        """Assert the page table's invariants and each view's (see :mod:`.check`)."""
        self.table.check()
        for v in self.views.values():
            v.check()
