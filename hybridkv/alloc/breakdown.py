"""Where a pool's bytes are: live, cached and reachable, cached but unreachable, owned but
empty, padding, free, unusable (:func:`memory_breakdown`).

A cache that holds less reusable data than another of the same size loses it somewhere, and the
place decides the fix. The categories split the plan's whole budget, so they add up to it:

- ``live``: ids running requests hold (their blocks, running and spare state slots, private
  end checkpoints, cached entries a hit is using), whole: the unwritten tokens of a running
  request's last block are reserved for it;
- ``reachable``: data in cached entries no request holds that a hit could still use. A state
  checkpoint at ``P`` is reachable when every state group has one at ``P`` and every full
  attention group has the KV of every token before ``P`` cached (a sliding-window group: the
  window before ``P``); a KV entry is reachable when it lies on the prefix of a reachable
  state (in a model without state layers: when its whole prefix is cached);
- ``unreachable``: cached data no hit can use as the cache stands: KV past the last state kept
  on its path, KV whose earlier blocks were evicted, a state whose prefix KV is gone. It costs
  memory and can only be evicted (it may become reachable again only if a request recomputes
  the missing part and caches it);
- ``owned_empty``: ids a two-level pool's group owns (on its large pages) that hold nothing:
  memory no other group can take until the page's other ids are freed and evicted;
- ``padding``: bytes of ids in use or cached that hold no data: a state padded to the
  attention page (``inflate``, ``pack``), unused layer slots, the tokens past the end of a
  cached partial KV block;
- ``free``: ids (or two-level large pages) holding nothing, ready for anyone;
- ``unusable``: the budget no id covers (null blocks, the budget's tail, leftovers).

Cost: one pass over the cache index (entries and their hash-unit parents) and the running
requests, O(cached units + running blocks): meant for sampling, not for every step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .manager import HybridAllocator

__all__ = ["CATEGORIES", "MemoryBreakdown", "memory_breakdown"]

#: the categories, in the order tables and plots show them
CATEGORIES = (
    "live",
    "reachable",
    "unreachable",
    "owned_empty",
    "padding",
    "free",
    "unusable",
)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per category (see the module docstring); they add up to :attr:`total`, the
    plan's budget. ``reachable_kv`` / ``reachable_state`` and ``unreachable_kv`` /
    ``unreachable_state`` split the cached data by kind; ``cached_states`` counts the state
    checkpoints (positions) cached and not held."""

    live: int
    reachable: int
    unreachable: int
    owned_empty: int
    padding: int
    free: int
    unusable: int
    reachable_kv: int
    reachable_state: int
    unreachable_kv: int
    unreachable_state: int
    cached_states: int

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in CATEGORIES)

    @property
    def cached(self) -> int:
        """Cached data no request holds (reachable or not)."""
        return self.reachable + self.unreachable

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def memory_breakdown(alloc: HybridAllocator) -> MemoryBreakdown:
    """Classify every byte of ``alloc``'s plan; see the module docstring."""
    plan = alloc.plan
    groups = plan.groups
    h = alloc.h
    id_bytes = {g.group_id: plan.id_bytes(g.group_id) for g in groups}
    data_bytes = {g.group_id: plan.id_data_bytes(g.group_id) for g in groups}
    block = {g.group_id: g.block_size for g in groups}
    out: dict[str, int] = defaultdict(int)

    # ---- live: every id a running request holds, once per pool -----------------------------
    # a group's ids -> id -> group: a block shared by requests counts once
    live_ids: dict[Any, dict[int, int]] = defaultdict(dict)
    for gid, ids in alloc.held_ids():
        seen = live_ids[alloc.pool[gid]]
        for bid in ids:
            if bid:
                seen[bid] = gid
    for seen in live_ids.values():
        for gid in seen.values():
            out["live"] += data_bytes[gid]
            out["padding"] += id_bytes[gid] - data_bytes[gid]

    # ---- cached entries no request holds: reachable or not ---------------------------------
    index = alloc.index
    useful = _useful_units(alloc)
    state_positions: set[bytes] = set()
    for key, (bid, _, units, entry_is_state) in index.entries.items():
        gid = key[0]  # type: ignore[index]
        pool = alloc.pool[gid]
        if pool.refcount(bid):
            continue  # held: counted as live
        if entry_is_state:
            data = data_bytes[gid]
            ok = (gid, units[0]) in useful
            if ok:
                state_positions.add(units[0])
            kind = "state"
        else:
            data = data_bytes[gid] * len(units) * h // block[gid]
            ok = any((gid, u) in useful for u in units)
            kind = "kv"
        name = "reachable" if ok else "unreachable"
        out[name] += data
        out[f"{name}_{kind}"] += data
        out["padding"] += id_bytes[gid] - data
        if entry_is_state and not ok:
            state_positions.add(units[0])
    out["cached_states"] = len(state_positions)

    # ---- free, owned but empty, unusable ----------------------------------------------------
    usable = 0
    for pool in alloc.pools:
        large = plan.pool(groups[pool.groups[0]].pool).large_page_bytes or 0
        got = pool.byte_usage(id_bytes, large)
        out["free"] += got["free"]
        out["owned_empty"] += got["owned_empty"]
        usable += got["usable"]
    out["unusable"] = plan.config.memory_bytes - usable
    return MemoryBreakdown(**{f: int(out.get(f, 0)) for f in MemoryBreakdown.field_names()})


def _useful_units(alloc: HybridAllocator) -> set[tuple[int, bytes]]:
    """``(group, unit)`` pairs a hit could use: for state groups, units where every state group
    has a checkpoint and the attention groups have the prefix; for attention groups, the units
    on the prefix of such a checkpoint (of any cached unit when the model has no state)."""
    index = alloc.index
    parent = index.parent
    groups = alloc.plan.groups
    h = alloc.h
    full = [g.group_id for g in groups if not g.is_state and not g.sliding_window]
    window = [
        (g.group_id, g.sliding_window) for g in groups if not g.is_state and g.sliding_window
    ]
    states = [g.group_id for g in groups if g.is_state]

    rooted: dict[tuple[int, bytes], bool] = {}

    def is_rooted(gid: int, unit: bytes) -> bool:
        """The unit and every unit before it are cached in ``gid`` (iterative: chains are
        thousands of units long)."""
        path = []
        k: tuple[int, bytes] | None = (gid, unit)
        result = True
        while k is not None:
            known = rooted.get(k)
            if known is not None:
                result = known
                break
            if k not in parent:
                result = False
                break
            path.append(k)
            p = parent[k]
            k = None if p is None else (gid, p)
        for x in path:
            rooted[x] = result
        return result

    def window_cached(gid: int, unit: bytes, W: int) -> bool:
        k: tuple[int, bytes] | None = (gid, unit)
        for _ in range(max(1, -(-(W - 1) // h))):
            if k is None:
                return True
            if k not in parent:
                return False
            p = parent[k]
            k = None if p is None else (gid, p)
        return True

    useful: set[tuple[int, bytes]] = set()
    if not states:
        for gid, unit in list(parent):
            if gid in full and is_rooted(gid, unit):
                useful.add((gid, unit))
        for gid, W in window:
            for g, unit in list(parent):
                if g == gid and window_cached(gid, unit, W):
                    useful.add((gid, unit))
        return useful
    first = states[0]
    for key, (_, _, units, entry_is_state) in index.entries.items():
        if not entry_is_state or key[0] != first:  # type: ignore[index]
            continue
        u = units[0]
        if not all((g, u) in parent for g in states[1:]):
            continue
        if not all(is_rooted(g, u) for g in full):
            continue
        if not all(window_cached(g, u, W) for g, W in window):
            continue
        for g in states:
            useful.add((g, u))
        for g in full:  # mark the prefix, stopping where another state's walk got to
            k: tuple[int, bytes] | None = (g, u)
            while k is not None and k not in useful:
                useful.add(k)
                p = parent[k]
                k = None if p is None else (g, p)
        for g, W in window:
            k = (g, u)
            for _ in range(max(1, -(-(W - 1) // h))):
                if k is None or k not in parent:
                    break
                useful.add(k)
                p = parent[k]
                k = None if p is None else (g, p)
    return useful


def breakdown_table(samples: list[MemoryBreakdown]) -> dict[str, Any]:
    """Mean bytes per category over ``samples`` (empty: zeros)."""
    n = max(1, len(samples))
    return {c: sum(getattr(s, c) for s in samples) / n for c in MemoryBreakdown.field_names()}
