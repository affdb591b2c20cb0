"""The large-page state of a two-level pool (:class:`~.two_level.TwoLevelPool`), in one place.

A :class:`PageTable` owns everything about large pages: which group owns each one, how many of
its ids are in use and how many hold cached blocks, the free pages, the idle pages, the clock
that orders cached blocks and idle pages across groups, and the pages reserved for a
multi-group allocation. The group views (:class:`~.two_level.GroupView`) own their ids (free
lists, cache maps) and change page state only through the methods below, whose names are the
transitions. Every page but page 0 is in exactly one state:

- **free**: no owner, in the free queue (taken oldest first, given back to its end);
- **active**: owned, at least one id in use (page 0 is active for good: it holds every group's
  null id and is pinned to the first group), or granted a moment ago, its first id about to be
  taken;
- **idle**: owned, no id in use, some ids cached.

Transitions: free -> active (:meth:`~PageTable.take_free_page`); active -> idle
(:meth:`~PageTable.mark_idle`); idle -> active (:meth:`~PageTable.reactivate`); idle -> another
group's active (:meth:`~PageTable.surrender` then :meth:`~PageTable.claim`); active with no id
in use, or idle -> free (:meth:`~PageTable.give_back`, or :meth:`~PageTable.surrender` then
:meth:`~PageTable.give_back`).

Idle pages are kept in two orders, both changed only here: every group's together, by the
clock when they went idle (a demoted page goes first: reclaimed before any other), and each
group's own, in the order they went idle. A heap per group finds the idle page with the most
ids holding nothing without a scan.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import KeysView, Mapping
from types import MappingProxyType

__all__ = ["PageTable"]


class PageTable:
    """Large pages ``0 .. num_pages-1`` shared by the groups of ``ids_per_page`` (group id ->
    its ids per page); page 0 is pinned to ``first_gid``. See the module docstring."""

    def __init__(self, num_pages: int, ids_per_page: Mapping[int, int], first_gid: int) -> None:
        self.num_pages = num_pages
        self._k = dict(ids_per_page)
        self._owner: list[int | None] = [None] * num_pages
        self._used = [0] * num_pages  # ids in use per page (page 0: one more, the pin)
        self._cached = [0] * num_pages  # ids holding a cached block per page
        self._owned: dict[int, set[int]] = {g: set() for g in self._k}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_pages))
        # every group's idle pages -> the clock when each went idle (0 once demoted), in the
        # order pages are reclaimed: by that stamp, a demoted page first
        self._idle: OrderedDict[int, int] = OrderedDict()
        # each group's idle pages in the order they went idle (a demotion does not move them):
        # the order a group reactivates its own pages in
        self._idle_of: dict[int, OrderedDict[int, None]] = {g: OrderedDict() for g in self._k}
        # when each idle page went idle (a counter): tells a heap entry of its current idle
        # spell from one of an earlier spell, and orders pages that have as many holes
        self._idle_seq = [0] * num_pages
        self._seq = 0
        # per group, (-holes, idle seq, page) of its idle pages with a hole, lazily deleted:
        # entries whose page left idle or gained holes since are skipped when they surface
        self._holey: dict[int, list[tuple[int, int, int]]] = {g: [] for g in self._k}
        self._clock = 0
        self._reservations: dict[int, int] = {}
        self._reserved = 0
        self._owner[0] = first_gid
        self._owned[first_gid].add(0)
        self._used[0] = 1  # pinned: other groups' null ids live in page 0

    # ---- reading ----------------------------------------------------------------------------
    def owner_of(self, page: int) -> int | None:
        return self._owner[page]

    def in_use(self, page: int) -> int:
        """Ids in use on ``page`` (page 0 counts one more: its pin)."""
        return self._used[page]

    def cached_on(self, page: int) -> int:
        return self._cached[page]

    def is_idle(self, page: int, gid: int) -> bool:
        """Whether ``page`` is an idle page of group ``gid``."""
        return page in self._idle_of[gid]

    def idle_pages(self, gid: int) -> KeysView[int]:
        """``gid``'s idle pages in the order they went idle (a live, read-only view)."""
        return self._idle_of[gid].keys()

    def pages_of(self, gid: int) -> frozenset[int]:
        """The pages ``gid`` owns, active or idle (a copy)."""
        return frozenset(self._owned[gid])

    def num_owned(self, gid: int) -> int:
        return len(self._owned[gid])

    def free_pages(self) -> Mapping[int, None]:
        """The free pages, next taken first (a live, read-only view)."""
        return MappingProxyType(self._free)

    def idle_by_age(self) -> Mapping[int, int]:
        """Every idle page -> its idle stamp, next reclaimed first (a live, read-only view)."""
        return MappingProxyType(self._idle)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def pages_available(self) -> int:
        """Pages a group could take: free ones and every group's idle ones."""
        return len(self._free) + len(self._idle)

    @property
    def clock(self) -> int:
        return self._clock

    def oldest_idle(self) -> tuple[int, int]:
        """(page, idle stamp) of the idle page reclaimed next; there must be one."""
        page = next(iter(self._idle))
        return page, self._idle[page]

    def first_idle_of(self, gid: int) -> int:
        """``gid``'s idle page that went idle first; there must be one."""
        return next(iter(self._idle_of[gid]))

    def holey_idle_page(self, gid: int) -> int | None:
        """``gid``'s idle page with the most ids holding nothing, the first to go idle of
        those with as many; None when no idle page of ``gid`` has such an id."""
        heap = self._holey[gid]
        k, cached, seq, idle = self._k[gid], self._cached, self._idle_seq, self._idle_of[gid]
        while heap:
            neg, s, page = heap[0]
            if page in idle and seq[page] == s and k - cached[page] == -neg:
                return page
            heapq.heappop(heap)  # stale: the page left idle or has more holes now
        return None

    # ---- the clock and cached blocks --------------------------------------------------------
    def tick(self) -> int:
        """A cached id was freed: the clock's next value, its stamp (one order for all
        groups' cached ids and idle pages)."""
        self._clock += 1
        return self._clock

    def note_cached(self, page: int) -> None:
        """An id of ``page`` now holds a cached block (only held ids are cached: the page is
        active, but an idle page's holes would shrink, and its heap entry with them)."""
        self._cached[page] += 1
        gid = self._owner[page]
        if gid is not None and page in self._idle_of[gid]:
            self._push_holey(gid, page)

    def note_uncached(self, page: int) -> int:
        """An id of ``page`` lost its cached block; returns how many the page still holds."""
        n = self._cached[page] - 1
        self._cached[page] = n
        gid = self._owner[page]
        if gid is not None and page in self._idle_of[gid]:
            self._push_holey(gid, page)  # one more hole on an idle page
        return n

    def _push_holey(self, gid: int, page: int) -> None:
        holes = self._k[gid] - self._cached[page]
        if holes <= 0:
            return
        heap = self._holey[gid]
        heapq.heappush(heap, (-holes, self._idle_seq[page], page))
        if len(heap) > 4 * self.num_pages:  # many stale entries: keep only the live ones
            heap[:] = [e for e in heap if self._holey_entry_live(gid, e)]
            heapq.heapify(heap)

    def _holey_entry_live(self, gid: int, entry: tuple[int, int, int]) -> bool:
        neg, s, page = entry
        return (
            page in self._idle_of[gid]
            and self._idle_seq[page] == s
            and self._k[gid] - self._cached[page] == -neg
        )

    # ---- ids in use -------------------------------------------------------------------------
    def use(self, page: int) -> None:
        """An id of ``page`` (active) was taken."""
        self._used[page] += 1

    def unuse(self, page: int) -> int:
        """An id of ``page`` was freed; returns how many are still in use (0: the owner must
        :meth:`mark_idle` the page or :meth:`give_back` it)."""
        n = self._used[page] - 1
        self._used[page] = n
        return n

    # ---- page transitions -------------------------------------------------------------------
    def take_free_page(self, gid: int) -> int:
        """free -> active: the free page given back longest ago, now ``gid``'s."""
        page = self._free.popitem(last=False)[0]
        self._own(page, gid)
        return page

    def claim(self, page: int, gid: int) -> None:
        """A page just surrendered (owned by nobody, not free) -> active, ``gid``'s."""
        assert self._owner[page] is None and page not in self._free, f"page {page} not in hand"
        self._own(page, gid)

    def _own(self, page: int, gid: int) -> None:
        self._owner[page] = gid
        self._owned[gid].add(page)
        self._used[page] = 0

    def mark_idle(self, page: int) -> None:
        """active -> idle: no id of ``page`` is in use and some hold cached blocks."""
        gid = self._owner[page]
        assert gid is not None and not self._used[page] and self._cached[page], page
        self._idle[page] = self._clock
        self._idle_of[gid][page] = None
        self._seq += 1
        self._idle_seq[page] = self._seq
        self._push_holey(gid, page)

    def reactivate(self, page: int) -> None:
        """idle -> active, same owner (its cached blocks stay)."""
        gid = self._owner[page]
        assert gid is not None
        del self._idle_of[gid][page]
        del self._idle[page]

    def demote_idle(self, page: int) -> None:
        """A cached block of idle ``page`` is unlikely to be hit: the page is reclaimed first."""
        self._idle.move_to_end(page, last=False)
        self._idle[page] = 0

    def surrender(self, page: int) -> int:
        """idle -> owned by nobody (its owner drops its cached blocks next; then :meth:`claim`
        or :meth:`give_back` it). Returns the group that owned it."""
        gid = self._owner[page]
        assert gid is not None
        del self._idle_of[gid][page]
        del self._idle[page]
        self._owner[page] = None
        self._owned[gid].discard(page)
        return gid

    def give_back(self, page: int) -> None:
        """active with no id in use, idle with no cached block left, or surrendered -> free
        (to the end of the free queue)."""
        gid = self._owner[page]
        if gid is not None:
            if page in self._idle_of[gid]:
                del self._idle_of[gid][page]
                del self._idle[page]
            self._owner[page] = None
            self._owned[gid].discard(page)
        self._free[page] = None

    # ---- reservations -----------------------------------------------------------------------
    @property
    def reserved_pages(self) -> int:
        return self._reserved

    def reservations(self) -> dict[int, int]:
        """Group -> pages reserved for it (a copy)."""
        return dict(self._reservations)

    def reserved_for(self, gid: int) -> int:
        return self._reservations.get(gid, 0)

    def reserve(self, pages: Mapping[int, int]) -> None:
        """Hold back ``pages[g]`` pages for each group ``g`` of a multi-group allocation, in
        place of any reservation left."""
        self._reservations = {g: n for g, n in pages.items() if n > 0}
        self._reserved = sum(self._reservations.values())

    def use_reservation(self, gid: int) -> None:
        """``gid`` takes a page it reserved, if it has one left."""
        r = self._reservations.get(gid, 0)
        if r:
            self._reservations[gid] = r - 1
            self._reserved -= 1

    def release(self) -> None:
        self._reservations.clear()
        self._reserved = 0

    # ---- invariants -------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the page table's invariants (raises ``AssertionError`` naming the first
        broken one)."""
        self._check_pages()
        self._check_idle_orders()
        assert self._reserved == sum(self._reservations.values()), "reserved pages != sum"
        assert all(n >= 0 for n in self._reservations.values()), "a negative reservation"
        for g, heap in self._holey.items():
            live = {e[2] for e in heap if self._holey_entry_live(g, e)}
            want = {p for p in self._idle_of[g] if self._k[g] - self._cached[p] > 0}
            assert live == want, f"g{g}: holey idle pages {sorted(live)} != {sorted(want)}"

    def _check_pages(self) -> None:
        """Each page is exactly one of free / active / idle, with consistent owners."""
        idle_owner = {p: g for g, pages in self._idle_of.items() for p in pages}
        assert set(idle_owner) == set(self._idle), "idle pages: the two orders disagree"
        assert sum(len(p) for p in self._owned.values()) == len(
            {p for pages in self._owned.values() for p in pages}
        ), "a page owned by two groups"
        for page in range(self.num_pages):
            gid = self._owner[page]
            free, idle = page in self._free, page in idle_owner
            assert free == (gid is None), f"page {page}: free {free} but owner {gid}"
            assert not (free and idle), f"page {page} both free and idle"
            if free:
                assert not self._used[page] and not self._cached[page], f"free page {page} used"
                continue
            assert gid is not None and page in self._owned[gid], f"page {page}: owner sets"
            if idle:
                assert idle_owner[page] == gid, f"idle page {page} listed for another group"
                assert self._used[page] == 0, f"idle page {page} has ids in use"
                assert self._cached[page] > 0, f"idle page {page} holds no cached block"
            else:
                assert self._used[page] > 0, f"page {page} of g{gid} neither used, idle nor free"
        assert self._used[0] >= 1, "page 0 lost its pin"

    def _check_idle_orders(self) -> None:
        stamps = list(self._idle.values())
        assert all(0 <= s <= self._clock for s in stamps), "idle stamp out of range"
        assert stamps == sorted(stamps), "idle pages out of the order of their stamps"
        for pages in self._idle_of.values():
            seqs = [self._idle_seq[p] for p in pages]
            assert seqs == sorted(seqs), "a group's idle pages out of the order they went idle"
