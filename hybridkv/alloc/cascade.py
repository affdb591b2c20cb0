"""The eviction cascade: when an eviction leaves cached entries no hit can use, evict them too
(the allocator's ``evict_unreachable`` option).

A hit needs, at its length ``P``, a state in every state group and the KV of every token
before ``P`` in every full-attention group (:mod:`.reach`). So when a state goes, the KV between
it and the previous state or branch of its chain serves nothing (unless a state lies further
down the chain); when a KV block goes, nothing after it on its chain can be reached. Those
entries would otherwise sit in the LRU, cached but useless, until they aged out. Marconi evicts
a radix-tree leaf's KV with its state for the same reason. A request that recomputes the
missing part caches it again.

Pools evict in the middle of an allocation, where no other id may change: :meth:`Cascade.evicted`
(their ``on_evict``) only updates the index and remembers the entry; :meth:`Cascade.settle`,
called once the allocation is done, evicts what those evictions left unreachable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, NamedTuple

from .groups import group_roles
from .reach import Reach

if TYPE_CHECKING:  # pragma: no cover
    from ..plan import KVCacheGroup
    from .block_pool import CacheKey, IdCache
    from .prefix_cache import PrefixIndex, UnitKey

__all__ = ["Cascade", "Evicted"]


class Evicted(NamedTuple):
    """An entry a pool evicted, as the cascade needs it once the index has forgotten it."""

    group: int
    units: list[bytes]
    is_state: bool
    above: bytes | None  # the unit before the entry on its chain (None at the root)
    first_unit: int  # the entry's first unit's index in its chain (``above`` is one before)


class Cascade:
    """The eviction cascade over ``index`` and the pools of ``groups`` (``pools``: group id ->
    its :class:`~.block_pool.IdCache`; read when settling, so it may be filled in after the
    pools that call :meth:`evicted` are built). ``peek``: group -> hash units a hit needs
    cached past it there (EAGLE's block drop; empty without): the cascade keeps them past
    every state that stays."""

    def __init__(
        self,
        index: PrefixIndex,
        groups: Sequence[KVCacheGroup],
        pools: Mapping[int, IdCache],
        peek: Mapping[int, int] | None = None,
    ) -> None:
        self.index = index
        self.keep_past_states(peek or {})
        self.reach = Reach(index)
        self.pools = pools
        roles = group_roles(groups)
        self.state = list(roles.state)
        self.state_set = set(self.state)
        # full-attention groups (with their block sizes): a hit needs every token before it
        self.full_blocks = list(roles.full)
        self.full = roles.full_ids
        self.chain_groups = roles.chain_ids  # the groups a dead segment is evicted from
        # every group that caches entries (a scratch ring caches none: nothing to doom there)
        self.cache_groups = [g.group_id for g in groups if g.group_id not in roles.scratch]
        # a unit a KV group evicted may be cached in another KV group still
        self.other_kv_groups = len(self.chain_groups) > 1
        #: entries evicted since the last :meth:`settle`, oldest first
        self.pending: list[Evicted] = []

    def keep_past_states(self, peek: Mapping[int, int]) -> None:
        """Set ``peek`` (see the class docstring): the allocator knows it once its group
        managers are built, after the pools that call :meth:`evicted`."""
        self.peek = dict(peek)
        # units kept after the state or branch point above a dead segment (one figure for
        # every chain group walked: the drafter's group is the only full one in practice)
        self.peek_units = max(self.peek.values(), default=0)

    def evicted(self, key: CacheKey, bid: int) -> None:
        """A pool evicted ``key`` (held in ``bid``): update the index and remember the entry for
        :meth:`settle`."""
        index = self.index
        entry = index.entries[key]
        gid = key[0]  # type: ignore[index]
        above = index.parent.get((gid, entry.units[0]))
        index.remove(key, bid)
        self.pending.append(Evicted(gid, entry.units, entry.is_state, above, entry.first_unit))

    def settle(self) -> None:
        """Evict the free cached entries that the evictions since the last call left useless
        (those evictions may leave more: until none do)."""
        index = self.index
        entries, holders, pools = index.entries, index.holders, self.pools
        while self.pending:
            dead, self.pending = self.pending, []
            doomed = self._doomed(dead)
            for key in doomed:
                entry = entries.get(key)
                if entry is None:
                    continue
                g = key[0]
                pool = pools[g]
                if pool.ref[entry.block_id]:
                    # held: a request uses it, and drop_cached would refuse (most doomed
                    # units lie on running requests' chains below a lost state)
                    continue
                # (a one-unit block is keyed by its only unit, doomed: no first tokens to keep)
                if (
                    not entry.is_state
                    and len(entry.units) > 1
                    and any(
                        (g, y) not in doomed and len(holders[(g, y)]) == 1 for y in entry.units
                    )
                ):
                    continue  # the block's first tokens still serve a hit inside it
                pool.drop_cached(entry.block_id)

    def _doomed(self, dead: list[Evicted]) -> dict[UnitKey, None]:
        """The units whose entries ``dead`` left useless, in the order found (a dict, not a
        set: the evictions must not depend on the hash seed)."""
        parent, reach, full = self.index.parent, self.reach, self.full
        children_of, state_units = self.index.children.get, self.index.state_units
        doomed: dict[UnitKey, None] = {}
        # dead segments doomed already: the states of one position go together (36 of them in
        # a pack layout), and the same segment again would add nothing
        done: set[UnitKey] = set()
        # positions whose states are doomed in every state group already: a layout with many
        # state groups evicts one position's states one group at a time, and dooming all of
        # them again for each (36 x 36 keys in an aggregate layout) adds nothing
        states_doomed: set[bytes] = set()
        for e in dead:
            if e.is_state:
                u = e.units[0]
                if reach.has_state(u):
                    # another state group still holds u: those states are useless alone
                    if u not in states_doomed:
                        states_doomed.add(u)
                        _doom(doomed, self.state, [u])
                elif full and (full[0], u) not in done:
                    done.add((full[0], u))
                    _doom(
                        doomed,
                        self.chain_groups,
                        reach.dead_segment(full[0], u, e.first_unit, self.peek_units),
                    )
            elif e.group in full:
                gone = [u for u in e.units if (e.group, u) not in parent]
                if not gone:
                    continue
                if any(map(children_of, zip(repeat(e.group), gone))):
                    self._doom_everywhere(doomed, reach.subtree(e.group, gone) or [])
                elif self.other_kv_groups or any(map(state_units.__contains__, gone)):
                    # nothing cached below the gap (the cascade's own drops, mostly): the
                    # units themselves, uncached in this group, doom nothing here (a doomed
                    # key matters only while its unit is cached), so only other groups'
                    self._doom_everywhere(doomed, gone[::-1], skip=e.group)
                above = (e.group, e.above)
                if e.above is not None and above in parent and above not in done:
                    # the chain above the gap served only what lay below it, perhaps
                    done.add(above)
                    segment = reach.dead_segment(
                        e.group, e.above, e.first_unit - 1, self.peek_units
                    )
                    _doom(doomed, self.chain_groups, segment)
        return doomed

    def _doom_everywhere(
        self, doomed: dict[UnitKey, None], units: list[bytes], skip: int | None = None
    ) -> None:
        """``units`` in every group but ``skip``, in group order. A state group caches a unit
        only where the index counts a state, and only its entries are looked up: its other
        units are left out (36 state groups made this the cascade's largest cost)."""
        state_units = self.index.state_units
        with_state = [u for u in units if u in state_units]
        for g in self.cache_groups:
            if g == skip:
                continue
            if g not in self.state_set:
                _doom(doomed, [g], units)
            elif with_state:
                _doom(doomed, [g], with_state)

    def drop_past_last_state(self, hashes: list[bytes], blocks: list[list[int]]) -> None:
        """Evict a finished request's cached KV past the last state kept on its chain (the
        answer's blocks under ``align``, which keeps states only in the prompt): no hit can
        reach it, and a request that computes past that state again computes it anyway.
        ``hashes``: the request's hash units; ``blocks``: its block ids per group."""
        has_state = self.reach.has_state
        last = len(hashes)
        while last > 0 and not has_state(hashes[last - 1]):
            last -= 1
        if last == len(hashes):
            return
        entries, h = self.index.entries, self.index.h
        state_end = last
        for gid, B in self.full_blocks:
            # the units a hit at the last state looks up past it stay (EAGLE's block drop)
            last = min(len(hashes), state_end + self.peek.get(gid, 0)) if state_end else 0
            pool, row, s = self.pools[gid], blocks[gid], B // h
            for j in range(last // s, len(row)):
                bid = row[j]
                if not bid:
                    continue
                key = pool.key_of(bid)
                entry = entries.get(key) if key is not None else None
                # an entry of this chain whose every unit lies past the last state
                if (
                    entry is not None
                    and entry.first_unit >= last
                    and entry.units[0] == hashes[entry.first_unit]
                ):
                    pool.drop_cached(bid)
        if self.pending:
            self.settle()


def _doom(doomed: dict[UnitKey, None], groups: list[int], units: list[bytes]) -> None:
    """Add ``units`` of each of ``groups`` (group by group) to ``doomed``."""
    for g in groups:
        doomed.update(zip(zip(repeat(g), units), repeat(None)))
