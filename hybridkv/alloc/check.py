"""A full consistency check of a :class:`HybridAllocator` (slow: for tests and debugging).

``check_consistency(alloc)`` raises ``AssertionError`` naming the first broken invariant:

- reference counts equal what running requests hold (block lists, private end checkpoints,
  hit sources awaiting the commit); the null id is never held or cached;
- an id held by two holders, or twice, is a cache entry (sharing only happens through the cache);
- every allocation unit in use or cached belongs to one group at a time;
- free lists hold exactly the free ids, cached ones in the LRU and the rest in the plain list;
- cache maps are mutual inverses, every entry is in the prefix index with the id the pool has,
  and every cached hash unit is covered by exactly the entries the index lists;
- two-level pools: the page table's invariants (every large page exactly one of free, active
  (an id in use) or idle (no id in use, some cached); owners consistent; reserved pages the sum
  of the reservations, none left after an allocation), each view's LRU ordered by stamp and its
  cached ids per page as the table counts; ids in use or cached lie in pages their group owns;
- block tables equal the block lists;
- Marconi's eviction: every kept candidate row is what a full pass would compute.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

from .block_pool import BlockPool
from .groups import group_roles
from .two_level import TwoLevelPool

if TYPE_CHECKING:  # pragma: no cover
    from .manager import HybridAllocator

__all__ = ["check_consistency", "holdings"]


def holdings(a: HybridAllocator) -> Counter:
    """(id of the pool object, block id) -> references running requests hold."""
    held: Counter = Counter()
    for gid, ids in a.held_ids():
        pool = id(a.pool[gid])
        for b in ids:
            if b:
                held[(pool, b)] += 1
    return held


def _refs(p: Any) -> dict[int, int]:
    return {i: n for i, n in enumerate(p.ref) if n}


def check_consistency(a: HybridAllocator) -> None:
    views = {}
    for gid in range(len(a.groups)):
        views.setdefault(id(a.pool[gid]), a.pool[gid])
    held = holdings(a)
    actual = Counter()
    for pid, p in views.items():
        assert p.ref[0] == 0 and p.key_of(0) is None, f"{p.name}: the null id is in use"
        for b, n in _refs(p).items():
            actual[(pid, b)] = n
    assert actual == held, f"reference counts differ from holdings: {actual ^ held}"
    for (pid, b), n in held.items():
        if n > 1:
            assert views[pid].key_of(b) is not None, f"{views[pid].name}: id {b} shared, uncached"

    if a.eviction_hooks is not None:  # Marconi's kept ranking equals a full pass's
        a.eviction_hooks.check()

    # one group per allocation unit
    owner: dict[tuple[str, int], int] = {}
    for r in a.reqs.values():
        for gid, blocks in enumerate(r.blocks):
            for b in blocks:
                if b:
                    _own(a, owner, gid, b)
        for gid, sid in r.end_ckpt.items():
            _own(a, owner, gid, sid)
        if r.end_copies is not None:  # the roll's copy list is the end checkpoint's
            want = sorted((g, r.blocks[g][0], s) for g, s in r.end_ckpt.items())
            assert sorted(r.end_copies) == want, f"request {r.req_id!r}: stale end copies"
            assert len(r.end_ckpt) == len(a.plan.state_groups), "end copies of a partial set"

    for p in views.values():
        for key, bid in p.cached_items().items():
            _own(a, owner, key[0], bid)

    # a scratch ring: one block per running request, never cached
    for gid in group_roles(a.groups).scratch:
        for r in a.reqs.values():
            assert len(r.blocks[gid]) == 1 and r.blocks[gid][0], (
                f"request {r.req_id!r} holds {r.blocks[gid]} in ring group {gid}, not one block"
            )
        assert not any(key[0] == gid for key in a.index.entries), f"ring group {gid} cached"

    # free lists and cache maps
    entries = a.index.entries
    keys_in_pools = {}
    for p in views.values():
        cached = p.cached_items()
        for key, bid in cached.items():
            assert p.key_of(bid) == key, f"{p.name}: maps are not inverse at {bid}"
            assert a.pool[key[0]] is p, f"{p.name}: key of group {key[0]} in the wrong pool"
            keys_in_pools[key] = (p, bid)
        plain, lru = p.free_lists()
        assert len(set(plain) & set(lru)) == 0, f"{p.name}: id in both free lists"
        for b in plain:
            assert p.ref[b] == 0 and p.key_of(b) is None, f"{p.name}: plain id {b} held/cached"
        for b in lru:
            assert p.ref[b] == 0 and p.key_of(b) is not None, f"{p.name}: lru id {b} bad"
        if isinstance(p, BlockPool):
            free = {b for b in range(1, p.num_ids) if p.ref[b] == 0}
            assert free == set(plain) | set(lru), f"{p.name}: free lists lost ids"
    assert set(keys_in_pools) == set(entries), "prefix index and pools disagree on entries"
    cover: dict[tuple[int, bytes], list[int]] = defaultdict(list)
    for key, entry in entries.items():
        bid = entry.block_id
        assert keys_in_pools[key][1] == bid, f"entry {key!r} points to {bid}, pool disagrees"
        assert key[1] == entry.last_unit, "an entry is keyed by its last unit"
        for u in entry.units:
            cover[(key[0], u)].append(bid)
    assert set(cover) == set(a.index.holders) == set(a.index.parent), "unit index is stale"
    for k, bids in cover.items():
        assert sorted(bids) == sorted(a.index.holders[k]), f"unit {k!r} holders are wrong"
    states = Counter(e.units[0] for e in entries.values() if e.is_state)
    assert states == Counter(a.index.state_units), "the index's states per unit are stale"
    assert all(a.index.state_units.values()), "a unit is counted with no state"
    # each state's chain: the unit at its own position, the unit's parent one before it
    assert a.index.state_chains.keys() == a.index.state_units.keys(), "state chains are stale"
    for key, e in entries.items():
        if e.is_state:
            chain, at = a.index.state_chains[e.units[0]]
            assert at == e.first_unit and chain[at] == e.units[0], f"{key!r}: wrong chain"
            parent = a.index.parent[key]
            assert parent == (chain[at - 1] if at else None), f"{key!r}: chain disagrees"
    # children links: exactly the parent links of KV groups' units (a state group has none)
    state_groups = {key[0] for key, e in entries.items() if e.is_state}
    links = {
        (g, par, u)
        for (g, u), par in a.index.parent.items()
        if par is not None and g not in state_groups
    }
    kids = {(g, par, u) for (g, par), us in a.index.children.items() for u in us}
    assert kids == links, "the index's children links are stale"

    for pool in a.pools:
        if isinstance(pool, TwoLevelPool):
            _check_two_level(pool)

    # block tables
    for r in a.reqs.values():
        tables = a.tables.gather([r.row])
        for gid, blocks in enumerate(r.blocks):
            row = tables[gid][0].tolist()
            assert row[: len(blocks)] == blocks and not any(row[len(blocks) :]), (
                f"block table row of {r.req_id!r} group {gid} is stale"
            )


def _own(a: HybridAllocator, owner: dict, gid: int, bid: int) -> None:
    unit = a.plan.allocation_unit(gid, bid)
    prev = owner.setdefault(unit, gid)
    # Groups with the same kind of page may not share a unit either: each id is one group's.
    assert prev == gid, f"allocation unit {unit} used by groups {prev} and {gid}"


def _check_two_level(pool: TwoLevelPool) -> None:
    """The page table's invariants and each view's (:meth:`TwoLevelPool.check`), then the ids
    against their pages."""
    table = pool.table
    assert table.reserved_pages == 0 and not table.reservations(), "page reservations left"
    pool.check()
    for g, v in pool.views.items():
        k = v.k
        for sid in range(v.num_ids):
            if v.ref[sid] or v.key_of(sid) is not None:
                assert table.owner_of(sid // k) == g, f"id {sid} of g{g} outside its pages"
        plain, lru = map(set, v.free_lists())
        for page in table.pages_of(g):
            ids = range(page * k, page * k + k)
            in_use = sum(1 for s in ids if v.ref[s])
            expect = in_use + (1 if page == 0 else 0)
            assert table.in_use(page) == expect, f"page {page}: used count {table.in_use(page)}"
            if table.is_idle(page, g):
                assert not any(s in plain or s in lru for s in ids), "idle ids listed"
            else:
                free_ids = {s for s in ids if not v.ref[s] and s != 0}
                assert free_ids == {s for s in ids if s in plain or s in lru}
