"""What a prefix hit can still reach: the walks over a :class:`~.prefix_cache.PrefixIndex`'s
chains that the eviction cascade (:mod:`.cascade`), the byte breakdown (:mod:`.breakdown`) and
Marconi's segments (:mod:`.marconi`) share.

A group's cached hash units form a forest: each unit links to its parent (the unit before it in
the prompts that cached it) and to its children (the units cached right after it). A hit at
``P`` tokens needs, at ``P``, a state checkpoint in every state group, the KV of every token
before ``P`` in every full-attention group (the unit ending at ``P`` is *rooted*: it and every
unit before it are cached) and, in a sliding-window group, the window before ``P``. So:

- a **segment** is the run of units above a state up to the previous state or branch point of
  its chain: the KV that only this state makes reachable (:meth:`Reach.segment_above`);
- a **subtree** is a unit and everything cached after it: what a gap at that unit cuts off
  (:meth:`Reach.subtree`);
- the **useful units** are those some hit could use as the cache stands
  (:meth:`Reach.useful_units`).

A unit's parent is known only while the unit is cached (:attr:`PrefixIndex.parent`), so a walk
up a chain ends at the root or right after the first unit that is not cached.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from itertools import repeat
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .prefix_cache import PrefixIndex, UnitKey

__all__ = ["SUBTREE_LIMIT", "WALK_FIRST", "Reach"]

#: units a subtree walk collects at most (a guard against a runaway walk; the eviction cascade
#: has always walked with this limit, and its results depend on it only past it)
SUBTREE_LIMIT = 1 << 20

#: units :meth:`Reach.state_reachable` walks before it asks the states' chains instead
WALK_FIRST = 128


class Reach:
    """Chain walks over ``index``, which they read and never change."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    def has_state(self, unit: bytes) -> bool:
        """Some state group caches a checkpoint at ``unit`` (the index counts them: asking each
        of 36 state groups' pools made evictions under periodic checkpoints crawl)."""
        return unit in self.index.state_units

    # ---- up a chain -------------------------------------------------------------------------
    def segment_above(
        self, gid: int, unit: bytes, stop: Callable[[bytes], bool], limit: int = -1
    ) -> tuple[list[bytes], bytes | None]:
        """The units before ``unit`` on its chain in ``gid``, nearest first, up to the previous
        branch point or unit where ``stop`` holds (excluded, and returned second; None when
        the walk ended at the root, after an uncached unit, or after ``limit`` units when
        ``limit >= 0``). The last unit listed may be uncached: callers that want only cached
        ones drop it."""
        parent_of, children_of = self.index.parent.get, self.index.children.get
        out: list[bytes] = []
        x = unit
        while len(out) != limit:
            par = parent_of((gid, x))
            if par is None:
                break
            if len(children_of((gid, par), ())) > 1 or stop(par):
                return out, par
            out.append(par)
            x = par
        return out, None

    def path_up(self, gid: int, unit: bytes, n: int) -> list[bytes]:
        """``unit`` and the units before it on its chain in ``gid``, ``n`` at most (fewer at the
        root or after an uncached unit), nearest first."""
        parent = self.index.parent
        out: list[bytes] = []
        x: bytes | None = unit
        while x is not None and len(out) < n:
            out.append(x)
            x = parent.get((gid, x))
        return out

    def window_cached(self, gid: int, unit: bytes, n: int) -> bool:
        """``unit`` and the ``n - 1`` units before it are cached in ``gid`` (fewer from the
        root): the window a sliding-window group needs before a hit."""
        parent = self.index.parent
        k: UnitKey | None = (gid, unit)
        for _ in range(n):
            if k is None:
                return True
            p = parent.get(k, k)
            if p is k:
                return False
            k = None if p is None else (gid, p)
        return True

    # ---- down a chain -----------------------------------------------------------------------
    def subtree(
        self,
        gid: int,
        roots: Iterable[bytes],
        stop: Callable[[bytes], bool] | None = None,
        limit: int = SUBTREE_LIMIT,
    ) -> list[bytes] | None:
        """``roots`` and every unit cached after them in ``gid`` (depth first, ``limit`` at
        most); None as soon as a unit satisfies ``stop`` (the walk gives up there instead of
        collecting the rest)."""
        out: list[bytes] = []
        stack = list(roots)
        children_of = self.index.children.get
        while stack and len(out) < limit:
            x = stack.pop()
            # a run of single children (most of a chain: a running request's, thousands of
            # units below a lost state) is followed without the stack, as :meth:`_search`
            # does: the same units in the same order as pushing the one child and popping it
            while True:
                if stop is not None and stop(x):
                    return None
                out.append(x)
                kids = children_of((gid, x))
                if not kids:
                    break
                if len(kids) > 1:
                    stack.extend(kids)
                    break
                if len(out) >= limit:
                    return out  # the walk would stop here with the child still to visit
                (x,) = kids
        return out

    def state_below(self, gid: int, unit: bytes, limit: int = SUBTREE_LIMIT) -> bool:
        """A state lies at ``unit`` or in its subtree in ``gid`` (found within ``limit`` units).

        The walk takes a unit's children oldest first, where :meth:`subtree` lists them newest
        first: the newest branches are most often running requests' chains, which hold no
        state until they finish (``last``), so a walk newest first went through thousands of
        their units before reaching an older branch's state (14 of the 17 million units the
        eviction cascade walked in 10,000 chat requests on per_group / ``last``). Whether a
        state is there does not depend on the order."""
        return self._search(gid, unit, limit) is True

    def _search(self, gid: int, unit: bytes, limit: int) -> bool | None:
        """:meth:`state_below`'s walk: True at the first state, False when the subtree holds
        none, None when it gave up after ``limit`` units with more to walk."""
        has_state = self.index.state_units.__contains__
        children_of = self.index.children.get
        stack = [unit]
        seen = 0
        while stack and seen < limit:
            x = stack.pop()
            # a run of single children (most of a chain) is followed without the stack: the
            # same units in the same order as pushing the one child and popping it next
            while True:
                if has_state(x):
                    return True
                seen += 1
                kids = children_of((gid, x))
                if not kids:
                    break
                if len(kids) > 1:
                    stack.extend(reversed(kids))
                    break
                if seen >= limit:
                    return None
                (x,) = kids
        return None if stack else False

    def state_reachable(self, gid: int, unit: bytes, depth: int, walk: int = WALK_FIRST) -> bool:
        """:meth:`state_below`, for ``unit`` at index ``depth`` of its chain, without walking
        a large subtree: a state lies at ``unit`` or at a unit after it whose chain is cached
        in ``gid`` from ``unit`` on (exactly the units the walk can reach: a child is linked
        while cached).

        The walk's first ``walk`` units answer most questions (with a state every
        block, the first unit or two); past them every cached state's chain
        (:attr:`PrefixIndex.state_chains`) is asked at position ``depth``: a chained hash
        there equal to ``unit`` puts the state below it. Walking on went through every unit of
        the subtree, thousands when running requests' chains (no state yet) hang below a
        branch point; a few hundred states are cheaper to ask."""
        index = self.index
        if walk > 0:
            found = self._search(gid, unit, walk)  # its first unit is ``unit`` itself
            if found is not None:
                return found
        elif unit in index.state_units:
            return True
        cached = index.parent.__contains__
        for chain, at in index.state_chains.values():
            if (
                at > depth
                and chain[depth] == unit
                and all(map(cached, zip(repeat(gid), chain[depth + 1 : at + 1])))
            ):
                return True
        return False

    def dead_segment(
        self, gid: int, unit: bytes, depth: int | None = None, peek: int = 0
    ) -> list[bytes]:
        """The units of ``gid`` that no state serves once the state at ``unit`` is gone: none
        if a state lies at or below ``unit``; else ``unit``'s subtree and the cached chain
        above it up to the previous state or branch point (exclusive). ``depth``: ``unit``'s
        index in its chain, when known (:meth:`state_reachable` then answers, walking little).
        ``peek``: units a hit needs cached past its state (EAGLE's block drop): the ``peek``
        units after the previous state or branch point stay, and nothing is dead when they
        reach into ``unit``'s subtree."""
        has_state = self.index.state_units.__contains__
        # given up at the first state: with states every few hundred tokens (periodic),
        # collecting whole subtrees first made this quadratic
        if depth is None:
            if self.state_below(gid, unit):
                return []
        elif self.state_reachable(gid, unit, depth):
            return []
        seg = self.subtree(gid, [unit], stop=has_state)
        if seg is None:  # a state past the first SUBTREE_LIMIT units of the oldest-first walk
            return []
        above, stop = self.segment_above(gid, unit, has_state)
        if peek and stop is not None:
            # the state (or a state past the branch point) above needs these for its hits
            if len(above) < peek:
                return []
            del above[len(above) - peek :]
        if above and (gid, above[-1]) not in self.index.parent:
            above.pop()  # its KV is gone already
        seg += above
        return seg

    # ---- everything ---------------------------------------------------------------------------
    def useful_units(
        self,
        full: list[int],
        window: list[tuple[int, int]],
        states: list[int],
        peek: Mapping[int, int] | None = None,
    ) -> dict[int, set[bytes]]:
        """Group -> the units of it a hit could use: for state groups, units where every state
        group has a checkpoint and the attention groups have the prefix (``window``:
        ``(group, window tokens)``) and, in the groups of ``peek`` (group -> units: EAGLE's
        block drop), that many units cached after it, which count as useful too; for
        attention groups, the units on the prefix of such a checkpoint (of any cached unit
        when the model has no state). Per group, so that the byte breakdown's pass over every
        entry asks a set of hashes, not of fresh tuples."""
        index, h = self.index, self.index.h
        parent = index.parent
        spans = [(g, max(1, -(-(W - 1) // h))) for g, W in window]  # units of each window
        useful: dict[int, set[bytes]] = {g: set() for g in (*full, *(g for g, _ in window))}
        useful.update((g, set()) for g in states)
        # one memo per full group, keyed by unit: the walks below visit every cached unit
        memos: dict[int, dict[bytes, bool]] = {g: {} for g in full}
        if not states:
            for gid, unit in list(parent):
                if gid in memos and self.rooted(gid, unit, memos[gid]) is not None:
                    useful[gid].add(unit)
            for gid, n in spans:
                for g, unit in list(parent):
                    if g == gid and self.window_cached(gid, unit, n):
                        useful[gid].add(unit)
            return useful
        # units with a checkpoint of every state group (the index counts them per unit): the
        # result does not depend on the order they are visited in
        num_states = len(states)
        peeks_wanted = [(g, n) for g, n in (peek or {}).items() if n > 0]
        for u, count in index.state_units.items():
            if count != num_states:
                continue
            if spans and not all(self.window_cached(g, u, n) for g, n in spans):
                continue
            peeks = []
            for g, n in peeks_wanted:
                path = self.path_down(g, u, n)
                if path is None:
                    break
                peeks.append((g, path))
            if len(peeks) < len(peeks_wanted):
                continue
            if len(full) == 1:
                # the last test: every unit a rooted walk meets in the memo is marked already,
                # so the units it walked are the ones to mark (one walk, not two)
                g = full[0]
                walked = self.rooted(g, u, memos[g])
                if walked is None:
                    continue
                useful[g].update(walked)
            elif all(self.rooted(g, u, memos[g]) is not None for g in full):
                for g in full:
                    self._mark_prefix(g, u, useful[g])
            else:
                continue
            for g in states:
                useful[g].add(u)
            for g, path in peeks:
                useful[g].update(path)
            for g, n in spans:
                useful[g].update(x for x in self.path_up(g, u, n) if (g, x) in parent)
        return useful

    def path_down(self, gid: int, unit: bytes, n: int) -> list[bytes] | None:
        """``n`` units cached one after another right after ``unit`` in ``gid`` (the oldest
        branch that has them, depth first), or None: what EAGLE's block drop looks up past a
        hit at ``unit`` before giving it back."""
        children_of = self.index.children.get
        stack: list[tuple[bytes, int]] = [(unit, 0)]
        path: list[bytes] = []
        while stack:
            x, depth = stack.pop()
            if depth:
                del path[depth - 1 :]  # back up to this unit's parent
                path.append(x)
            if depth == n:
                return path
            kids = children_of((gid, x))
            if kids:
                stack.extend((k, depth + 1) for k in reversed(kids))
        return None

    def rooted(self, gid: int, unit: bytes, memo: dict[bytes, bool]) -> list[bytes] | None:
        """Whether ``unit`` and every unit before it are cached in ``gid`` (*rooted*): the units
        this call walked that ``memo`` did not know (nearest first) when it is, else None.
        ``memo`` (one per group, keyed by unit) keeps the answer for every unit walked, so
        walks from many units of one tree each cost what they add (iterative: chains are
        thousands of units long)."""
        parent_of, known_of = self.index.parent.get, memo.get  # bound: the inner loop
        path: list[bytes] = []
        x: bytes | None = unit
        result = True
        while x is not None:
            known = known_of(x)
            if known is not None:
                result = known
                break
            k = (gid, x)
            p = parent_of(k, k)  # k itself: a sentinel for "not cached"
            if p is k:
                result = False
                break
            path.append(x)
            x = p
        memo.update(dict.fromkeys(path, result))
        return path if result else None

    def _mark_prefix(self, gid: int, unit: bytes, useful: set[bytes]) -> None:
        """Add ``unit`` and the units before it (rooted: all cached) to ``useful`` (the
        group's), stopping where another state's walk got to: from there up, it marked them
        all."""
        parent = self.index.parent
        x: bytes | None = unit
        while x is not None and x not in useful:
            useful.add(x)
            x = parent[(gid, x)]
