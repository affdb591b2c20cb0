"""Marconi's eviction (MLSys'25, its ``evict_v2``): which cached *segment* gives way.

Marconi's radix tree holds, per node, the KV of the node's tokens and the recurrent state at
its end. It evicts only nodes with at most one child: a leaf goes with its KV, a single-child
node loses its state (its KV still serves the child). Among those it evicts the smallest

    utility = recency + alpha * efficiency        (each min-max normalised over the candidates)

- recency: ``1 / (now - last access)``, with a logical clock; an access is the node's creation
  or a prefix match that ends on it (only the last node of a match is refreshed);
- efficiency: FLOPs the node saves relative to its parent (prefilling its ``c`` tokens after the
  parent's ``p``) per byte it keeps (a state plus the KV of all ``p + c`` tokens).

In hybridkv the nodes are the cached state checkpoints: the KV between a state and the previous
state or branch point of its chain is its segment. A leaf state's segment goes with it (the
allocator's ``evict_unreachable`` cascade evicts KV that no state can reach any more); a state
whose chain continues (superseded by a later turn) loses only itself; a branch-point state is
never a candidate. A pool that holds state ids evicts the chosen state; a pool of attention
ids only (``per_group``'s KV pool) evicts the chosen leaf's last KV block, and the cascade takes
the rest of the segment. A pool with no such candidate falls back to its LRU (first an entry
nothing depends on). A pool whose groups have ids of their own in shared memory (``two_level``)
chooses across its groups with :class:`MarconiPoolEvictor`: the segment of least utility goes
from every group at once, whichever group needed the memory.

``alpha = 0`` is recency alone. Marconi tunes ``alpha`` online; so do the simulator and
:func:`hybridkv.replay.replay` under ``marconi_alpha="auto"`` (the options' default; an allocator
run without them keeps Marconi's starting 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .groups import group_roles
from .reach import Reach

if TYPE_CHECKING:  # pragma: no cover
    from ..plan import MemoryPlan
    from .prefix_cache import PrefixIndex

__all__ = [
    "MarconiEvictor",
    "MarconiPoolEvictor",
    "MarconiScorer",
    "PrefillFlops",
    "Ranking",
    "install_marconi_eviction",
    "tokens_as_flops",
]

#: FLOPs of prefilling ``new`` tokens after ``cached`` ones (``StepCoster.prefill_flops``)
PrefillFlops = Callable[[int, int], float]


def tokens_as_flops(new: int, cached: int) -> float:
    """The FLOP model when none is given: every token costs the same (the weights' work, which
    dominates prefill FLOPs below tens of thousands of tokens of context)."""
    return float(new)


def _normalise(values: np.ndarray) -> np.ndarray:
    """Min-max normalised ``values`` (all 1.0 when they are equal). Element by element the
    same IEEE operations as on Python floats, so a ranking does not depend on which is used."""
    lo, hi = values.min(), values.max()
    if hi == lo:
        return np.ones(len(values))
    return (values - lo) / (hi - lo)


class MarconiScorer:
    """The shared part of every pool's :class:`MarconiEvictor`: the logical clock, each cached
    state's last access, and the utility of evicting it.

    ``pool_of`` maps a group id to the pool its ids come from (the allocator's). ``flops``:
    :data:`PrefillFlops`, default :func:`tokens_as_flops`.

    Every eviction ranks every candidate, but between two evictions few of them change. With
    ``incremental`` (the allocator's scorer), the index reports the units whose state entries
    or children changed (:meth:`PrefixIndex.watch`) and the scorer keeps each tracked state's
    row (a candidate's tokens, last access, leaf flag and efficiency, or not a candidate),
    recomputing only the rows those changes, its own accesses, and memos read from the
    changed units can move; the rows are what a full pass would compute, in the same order
    (:meth:`check` asserts it). Without it, every ranking recomputes every row (a scorer over
    an index changed by hand, as in tests)."""

    def __init__(
        self,
        index: PrefixIndex,
        plan: MemoryPlan,
        pool_of: dict[int, Any],
        alpha: float,
        flops: PrefillFlops | None = None,
        *,
        incremental: bool = False,
    ) -> None:
        self.index = index
        self.reach = Reach(index)  # the chain walks segments are read with
        self.pool_of = pool_of
        self.alpha = alpha
        self.flops = flops or tokens_as_flops
        self.h = index.h
        roles = group_roles(plan.groups)
        full = roles.full_ids
        self.chain_group = full[0] if full else None  # whose units tell a chain's shape
        self.state_groups = [g.group_id for g in plan.state_groups]
        # what a cached token keeps (a scratch ring is per request, never cached)
        self.kv_per_token = sum(
            (p.k_bytes_per_block + p.v_bytes_per_block) / p.block_size
            for p in plan.kv_placements
            if p.group_id not in roles.scratch
        )
        self.state_bytes = sum(c.nbytes for s in plan.state_placements for c in s.components)
        self.clock = 0
        #: cached state unit -> logical time of its last access (a demoted state: -1)
        self.last_access: dict[bytes, int] = {}
        # segment starts, remembered: state unit -> (tokens, the unit the walk stopped at: a
        # state or branch point, None at the root); and walked unit -> the state whose segment
        # holds it (segments are disjoint: each ends at the next state or branch point)
        self._start: dict[bytes, tuple[int, bytes | None]] = {}
        self._owner: dict[bytes, bytes] = {}
        # state unit -> (segment start, end, efficiency): a FLOP model is costly and every
        # eviction rescores every candidate, whose segments seldom change
        self._eff: dict[bytes, tuple[int, int, float]] = {}
        # the rows, in last_access's order: tracked unit -> (unit, tokens, last access, is a
        # leaf, efficiency), or None when it is no candidate (held by a request, or a branch
        # point); the rows to recompute; those held (a release changes nothing in the index,
        # so they are looked at again every time); each row's insertion number (its order)
        self._rows: dict[bytes, tuple[bytes, int, int, bool, float] | None] = {}
        self._dirty: set[bytes] = set()
        self._held: set[bytes] = set()
        self._seq: dict[bytes, int] = {}
        self._next_seq = 0
        # memos that read another unit's state (the unit their segment's walk stopped at):
        # that unit -> the rows whose memo it is, and row -> its unit
        self._deps: dict[bytes, set[bytes]] = {}
        self._dep_of: dict[bytes, bytes] = {}
        self._rows_with_eff: bool | None = None  # whether the rows carry efficiencies
        #: the index's changes (None: every ranking recomputes every row)
        self._changed: set[bytes] | None = index.watch() if incremental else None

    @property
    def alpha(self) -> float:
        """The weight of efficiency against recency (>= 0; 0 is recency alone)."""
        return self._alpha

    @alpha.setter
    def alpha(self, alpha: float) -> None:
        if not alpha >= 0:
            raise ValueError(f"marconi_alpha must be >= 0, got {alpha}")
        self._alpha = float(alpha)

    # ---- what the allocator tells it ----------------------------------------------------------
    def tick(self) -> None:
        """One step of the logical clock (a request looked up, as Marconi's ``match_prefix``)."""
        self.clock += 1

    def accessed(self, unit: bytes) -> None:
        """A state at ``unit`` was cached or served a hit: it is the newest access."""
        if unit not in self.last_access:
            # a new state inside another state's segment now starts that segment
            owner = self._owner.pop(unit, None)
            if owner is not None:
                self._start.pop(owner, None)
                self._dirty.add(owner)
            self._start.pop(unit, None)
            self._rows[unit] = None
            self._seq[unit] = self._next_seq
            self._next_seq += 1
        self.last_access[unit] = self.clock
        self._dirty.add(unit)  # (a hit's source is held from now on: this is how it leaves)

    def demote(self, unit: bytes) -> None:
        """The state at ``unit`` was superseded further down its chain: oldest of all."""
        if unit in self.last_access:
            self.last_access[unit] = -1
            self._dirty.add(unit)

    # ---- scoring ----------------------------------------------------------------------------
    def segment_start(self, unit: bytes, end: int) -> int:
        """Tokens before the segment of the state at ``unit`` (``end`` tokens): the previous
        state or branch point up its chain, else 0. Remembered: a state added inside the
        segment, or the state or branch point it starts at going, makes it walk again (a
        branch point formed inside it without a state is seen at the next of those)."""
        g = self.chain_group
        memo = self._start.get(unit)
        if memo is not None and self._start_holds(memo[1]):
            return memo[0]
        walked: list[bytes] = []
        at = None
        if g is not None:
            # the walk may not reach past the chain's first token
            limit = max(0, -(-end // self.h) - 1)
            walked, at = self.reach.segment_above(g, unit, self._kept, limit)
        owner = self._owner
        for x in walked:
            owner[x] = unit
        pos = end - (len(walked) + 1) * self.h
        if at is None:
            pos = max(pos, 0)
        self._start[unit] = (pos, at)
        self._dirty.add(unit)  # its row's memo moved (a no-op inside a ranking's refresh)
        return pos

    def _start_holds(self, at: bytes | None) -> bool:
        """A remembered segment start at ``at`` (None: the chain's root) still holds: ``at``
        is a branch point or holds a state. (The one rule the memo and :meth:`check` follow;
        the units whose answer can change are the ones :meth:`PrefixIndex.watch` reports.)"""
        return (
            at is None
            or len(self.index.children.get((self.chain_group, at), ())) > 1
            or self.has_state(at)
        )

    def _kept(self, unit: bytes) -> bool:
        """A state Marconi tracks is cached at ``unit``: a segment ends there."""
        return unit in self.last_access and self.has_state(unit)

    def has_state(self, unit: bytes) -> bool:
        g = self.state_groups[0]
        return self.pool_of[g].lookup((g, unit)) is not None

    def efficiency(self, start: int, end: int) -> float:
        """FLOPs a hit at ``end`` saves over one at ``start``, per byte the state keeps."""
        return self.flops(end - start, start) / (self.state_bytes + self.kv_per_token * end)

    def _efficiency_of(self, unit: bytes, end: int) -> float:
        """:meth:`efficiency` of the segment of the state at ``unit`` (``end`` tokens), kept
        until its start or end moves (the FLOP model is a pure function of them)."""
        start = self.segment_start(unit, end)
        kept = self._eff.get(unit)
        if kept is not None and kept[0] == start and kept[1] == end:
            return kept[2]
        eff = self.efficiency(start, end)
        self._eff[unit] = (start, end, eff)
        return eff

    def candidates(self) -> list[tuple[bytes, int, int, bool]]:
        """(unit, tokens, last access, is a leaf) of every free cached state that is not a
        branch point; forgets states no longer cached."""
        # in the rows' mode: asking without efficiencies would make the next ranking
        # recompute every row
        return [row[:4] for row in self._candidate_rows(bool(self._rows_with_eff))]

    def _candidate_rows(self, with_efficiency: bool) -> list[tuple[bytes, int, int, bool, float]]:
        """The candidates' rows in order, each with its segment's :meth:`efficiency` (0.0
        unless ``with_efficiency``), after recomputing the rows that may have changed."""
        rows = self._rows
        if self._changed is None or self._rows_with_eff is not with_efficiency:
            self._dirty.update(rows)
            self._rows_with_eff = with_efficiency
            if self._changed is not None:
                self._changed.clear()  # every row is recomputed
        else:
            changed, dirty, deps = self._changed, self._dirty, self._deps
            for x in changed:
                if x in rows:
                    dirty.add(x)
                d = deps.get(x)
                if d:
                    dirty.update(d)
            changed.clear()
            dirty.update(self._held)
        if self._dirty:
            self._refresh(with_efficiency)
        return [row for row in rows.values() if row is not None]

    def _refresh(self, with_efficiency: bool) -> None:
        """Recompute the dirty rows, in the rows' order (a segment walk records which state
        owns the units it walked, so the order is the one a full pass walks in): the checks of
        a full pass, one row each; efficiencies through :meth:`_efficiency_of`, which uses its
        memo while :meth:`segment_start`'s start holds and the end is the same."""
        rows, seq = self._rows, self._seq
        todo = sorted((u for u in self._dirty if u in rows), key=seq.__getitem__)
        self._dirty.clear()
        if not self.state_groups:
            rows.update(dict.fromkeys(todo))
            return
        g0 = self.state_groups[0]
        pool = self.pool_of[g0]
        chain, h = self.chain_group, self.h
        refcount, entry_of = pool.refcount, self.index.entries.get
        children_of, last_access, held = self.index.children.get, self.last_access, self._held
        gone = []
        for u in todo:
            e = entry_of((g0, u))
            if e is None:
                gone.append(u)
                continue
            if refcount(e.block_id):
                rows[u] = None  # a running request holds it (a hit source)
                held.add(u)
                continue
            held.discard(u)
            if chain is not None:
                kids = children_of((chain, u))
                if kids and len(kids) > 1:
                    rows[u] = None  # a branch point: every branch hits there
                    continue
                leaf = not kids
            else:
                leaf = True
            P = (e.first_unit + 1) * h  # a state: one unit
            eff = self._efficiency_of(u, P) if with_efficiency else 0.0
            rows[u] = (u, P, last_access[u], leaf, eff)
            self._depend(u)
        self._dirty.clear()  # the walks above marked their own rows, recomputed already
        # (scoring a state never reads a gone unit's memo: its segment's walk stops only at
        # a state still cached, and its own memo is its own)
        for u in gone:  # segments that started at u walk again when next scored
            self._forget(u)

    def check(self) -> None:
        """Assert that every row not waiting to be recomputed is what a full pass would make
        of it now (``check_consistency`` calls this: a change the rows missed shows here)."""
        rows = self._rows
        assert list(rows) == list(self.last_access), "rows and tracked states disagree"
        assert list(rows) == sorted(rows, key=self._seq.__getitem__), "rows out of order"
        if self._changed is None or self._rows_with_eff is None or not self.state_groups:
            return  # every ranking recomputes every row
        pending = self._dirty | self._held
        for x in self._changed:
            pending.add(x)
            pending.update(self._deps.get(x, ()))
        g0, chain, h = self.state_groups[0], self.chain_group, self.h
        pool, children = self.pool_of[g0], self.index.children
        for u, row in rows.items():
            if u in pending:
                continue
            e = self.index.entries.get((g0, u))
            assert e is not None, "a row's state is gone, and nothing marked it"
            kids = len(children.get((chain, u), ())) if chain is not None else 0
            if pool.refcount(e.block_id) or kids > 1:
                assert row is None, "a held state or a branch point is ranked"
                continue
            eff = 0.0
            if self._rows_with_eff:
                memo, kept = self._start.get(u), self._eff.get(u)
                P = (e.first_unit + 1) * h
                assert memo is not None and kept is not None, "a ranked state has no memo"
                at = memo[1]
                assert kept[:2] == (memo[0], P), "a ranked state's efficiency is stale"
                assert self._start_holds(at), "a ranked state's segment memo no longer holds"
                assert self._dep_of.get(u) == at, "a memo's unit is not watched"
                eff = kept[2]
            expected = (u, (e.first_unit + 1) * h, self.last_access[u], kids == 0, eff)
            assert row == expected, f"a ranked row is stale: {row} != {expected}"

    def _depend(self, unit: bytes) -> None:
        """Record which unit ``unit``'s segment memo reads (its row moves when that does)."""
        memo = self._start.get(unit)
        at = memo[1] if memo is not None else None
        old = self._dep_of.get(unit)
        if old == at:
            return
        if old is not None:
            self._deps[old].discard(unit)
            del self._dep_of[unit]
        if at is not None:
            self._deps.setdefault(at, set()).add(unit)
            self._dep_of[unit] = at

    def _forget(self, unit: bytes) -> None:
        """A tracked state is no longer cached: its row and memos go."""
        del self.last_access[unit]
        del self._rows[unit]
        del self._seq[unit]
        self._start.pop(unit, None)
        self._eff.pop(unit, None)
        self._held.discard(unit)
        old = self._dep_of.pop(unit, None)
        if old is not None:
            self._deps[old].discard(unit)

    def ranking(self) -> Ranking:
        """Every :meth:`candidates` state with its utility, recency and efficiency normalised
        over all of them (Marconi scores every evictable node at once)."""
        alpha = self.alpha
        cands = self._candidate_rows(with_efficiency=bool(alpha))
        if not cands:
            return Ranking([], [], [], np.empty(0))
        units, ends, stamps, leaves, effs = zip(*cands)  # columns
        # numpy over the few hundred candidates: the same values as Python's floats (one
        # rounding per operation), a tenth of the interpreter's work per eviction
        now = self.clock + 1
        recency = _normalise(1.0 / (now - np.array(stamps, dtype=np.int64)))
        utility = recency
        if alpha:
            utility = recency + alpha * _normalise(np.array(effs, dtype=np.float64))
        return Ranking(units, ends, leaves, utility)

    def utilities(self) -> dict[bytes, tuple[float, int, bool]]:
        """unit -> (utility, tokens, is a leaf) of every :meth:`candidates` state
        (:meth:`ranking` as a mapping)."""
        r = self.ranking()
        xs = r.utility.tolist()
        return {u: (x, P, leaf) for u, x, P, leaf in zip(r.units, xs, r.ends, r.leaves)}


class Ranking(NamedTuple):
    """The candidates of one scoring in the order Marconi's scorer tracks them (the order ties
    are broken in): unit, tokens, whether a leaf, and utility (an array of the same length)."""

    units: Sequence[bytes]
    ends: Sequence[int]
    leaves: Sequence[bool]
    utility: np.ndarray

    def order(self) -> Iterator[int]:
        """Indices from the least utility up, ties in candidate order (what a heap of
        ``(utility, index)`` pops). The least comes from one ``argmin``; the rest are sorted
        only when a caller goes past it, which an eviction seldom does."""
        xs = self.utility
        if not len(xs):
            return
        first = int(np.argmin(xs))  # the first of equal minima
        yield first
        for i in np.argsort(xs, kind="stable").tolist():  # stable: ties in candidate order
            if i != first:
                yield i


class MarconiEvictor:
    """The victim choice of one pool (``BlockPool`` or a two-level group view): the ids whose
    eviction removes the cached segment of least utility (:class:`MarconiScorer`), else the LRU
    window's first entry nothing depends on.

    A pool hands out one id per call, and the allocator's cascade runs only after the whole
    allocation; so once a segment is chosen, its other ids in this pool are queued and taken
    first, as Marconi frees a node's bytes together, rather than one state of another segment
    per id needed."""

    def __init__(self, scorer: MarconiScorer, pool: Any, groups: list[int]) -> None:
        self.scorer = scorer
        self.pool = pool
        state = set(scorer.state_groups)
        self.state_groups = [g for g in groups if g in state]
        self.kv_groups = [g for g in groups if g not in state]
        self._queue: list[tuple[int, Any]] = []  # (id, its key) of the segment being evicted

    def __call__(self, candidates: list[int]) -> int:
        pool = self.pool
        while self._queue:
            bid, key = self._queue.pop()
            if pool.evictable(bid) and pool.key_of(bid) == key:
                return bid
        best = self._best_own(self.scorer.ranking())
        if best is not None:
            bid, u, P = best
            self._queue_segment(bid, u, P)
            return bid
        for bid in candidates:
            if not self._depended_on(bid):
                return bid
        return candidates[0]

    def _best_own(self, ranking: Ranking) -> tuple[int, bytes, int] | None:
        """(id, unit, tokens) of this pool's least valuable segment (ties: the first cached),
        or None."""
        units, ends, leaves = ranking.units, ranking.ends, ranking.leaves
        for i in ranking.order():
            bid = self._victim(units[i], leaves[i])
            if bid is not None:
                return bid, units[i], ends[i]
        return None

    def _victim(self, unit: bytes, leaf: bool) -> int | None:
        """This pool's free cached id whose eviction removes the state at ``unit`` (and, for a
        leaf, its segment), or None."""
        pool = self.pool
        for g in self.state_groups:
            bid = pool.lookup((g, unit))
            if bid is not None and pool.evictable(bid):
                return bid
        if not leaf or self.state_groups:
            return None
        holders = self.scorer.index.holders
        for g in self.kv_groups:
            for bid in holders.get((g, unit), ()):
                if pool.evictable(bid):
                    return bid
        return None

    def _queue_segment(self, first: int, unit: bytes, end: int) -> None:
        """Queue this pool's other evictable ids of the segment ending at ``unit`` (the tail of
        the chain is popped first)."""
        self._queue = [(bid, key) for bid, key in self.segment_ids(unit, end) if bid != first]

    def segment_ids(self, unit: bytes, end: int) -> list[tuple[int, Any]]:
        """This pool's evictable ids of the segment ending at ``unit`` (``end`` tokens), with
        their keys: the states of its groups there and, for a leaf, the KV blocks lying wholly
        inside the segment (states first, then the KV from the segment's start to its tail)."""
        s, pool = self.scorer, self.pool
        index = s.index
        out: list[tuple[int, Any]] = []
        for g in self.state_groups:
            bid = pool.lookup((g, unit))
            if bid is not None and pool.evictable(bid):
                out.append((bid, (g, unit)))
        chain = s.chain_group
        leaf = chain is not None and not index.children.get((chain, unit))
        if leaf and chain is not None and self.kv_groups:
            n = (end - s.segment_start(unit, end)) // s.h
            units = s.reach.path_up(chain, unit, n)
            inside = set(units)
            seen = {bid for bid, _ in out}
            for x in reversed(units):
                for g in self.kv_groups:
                    for bid in index.holders.get((g, x), ()):
                        if bid in seen or not pool.evictable(bid):
                            continue
                        seen.add(bid)
                        key = pool.key_of(bid)
                        if all(y in inside for y in index.entries[key].units):
                            out.append((bid, key))
        return out

    def _depended_on(self, bid: int) -> bool:
        """A branch-point state, or a KV block with cached units after it."""
        s = self.scorer
        if s.chain_group is None:
            return False
        key = self.pool.key_of(bid)
        if key is None:
            return False
        return s.index.continuations(key, s.chain_group) > int(s.index.entry_info(key)[1])


class MarconiPoolEvictor:
    """Marconi's victim choice across the groups of one pool whose groups have ids of their own
    (a two-level pool's views, one :class:`MarconiEvictor` each): evicts, in every group, the
    ids of the cached segment of least utility that keeps a state in the pool.

    Each view's own evictor chooses only among its group's ids, so which *group* gives memory
    up was left to the pool: two-level pages went to the group that needed them by the age of
    an idle page, and Marconi's utility decided only inside a group. The pool calls this
    instead, until the group that needs an id has one (a hole on its pages, or a free page):
    memory then moves between KV and states in Marconi's order, as in its radix tree, where a
    node's KV and state are freed together."""

    def __init__(self, scorer: MarconiScorer, evictors: list[MarconiEvictor]) -> None:
        self.scorer = scorer
        self.evictors = evictors
        self.states = {g for ev in evictors for g in ev.state_groups}

    def __call__(self) -> bool:
        """Evict the least valuable segment (ties: the first cached); False, evicting nothing,
        when no free cached state of this pool is a candidate."""
        ranking = self.scorer.ranking()
        units, ends = ranking.units, ranking.ends
        # the least valuable candidate nearly always has its state here: the rest of the
        # order is sorted only if not (Ranking.order)
        for i in ranking.order():
            u, P = units[i], ends[i]
            victims = [(ev.pool, ids) for ev in self.evictors if (ids := ev.segment_ids(u, P))]
            if not any(key[0] in self.states for _, ids in victims for _, key in ids):
                continue  # its state is not here (or not free): evicting its KV frees nothing
            # every id is listed before any goes: an eviction updates the index the lists
            # are read from
            for pool, ids in victims:
                for bid, _ in ids:
                    pool.drop_cached(bid)
            return True
        return False


def install_marconi_eviction(
    index: PrefixIndex,
    plan: MemoryPlan,
    pools: list[Any],
    pool_of: dict[int, Any],
    options: Any,
) -> MarconiScorer:
    """Marconi's victim choice in every pool (one clock and score for all of them), and
    across a pool's groups when they have ids of their own (``marconi_across_groups``);
    returns the scorer the allocator tells about accesses."""
    scorer = MarconiScorer(
        index,
        plan,
        pool_of,
        options.starting_marconi_alpha(),
        options.marconi_flops,
        incremental=True,
    )
    for pool in pools:
        evictors = []
        for ids, gids in pool.group_views():
            ids.evictor = MarconiEvictor(scorer, ids, gids)
            ids.evictor_window = max(1, options.eviction_window)
            evictors.append(ids.evictor)
        if options.marconi_across_groups and len(evictors) > 1:
            pool.segment_evictor = MarconiPoolEvictor(scorer, evictors)
    return scorer
