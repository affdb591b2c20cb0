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
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

from .groups import group_roles
from .reach import Reach

if TYPE_CHECKING:  # pragma: no cover
    from ..plan import MemoryPlan
    from .block_pool import IdCache, Pool
    from .prefix_cache import PrefixIndex

__all__ = ["CATEGORIES", "BreakdownSource", "MemoryBreakdown", "memory_breakdown"]

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


class BreakdownSource(Protocol):
    """What :func:`memory_breakdown` reads of an allocator (``HybridAllocator`` is one)."""

    @property
    def plan(self) -> MemoryPlan: ...

    @property
    def index(self) -> PrefixIndex: ...

    @property
    def pool(self) -> Mapping[int, IdCache]:
        """Group id -> the ids it takes (a pool, or a two-level pool's group view)."""
        ...

    @property
    def pools(self) -> tuple[Pool, ...]: ...

    def held_ids(self) -> list[tuple[int, list[int]]]:
        """Every id running requests hold, as ``(group, ids)``; an id once per holder."""
        ...

    @property
    def hit_peek_units(self) -> Mapping[int, int]:
        """Group -> hash units a hit needs cached past it (EAGLE's block drop; empty
        without)."""
        ...


def memory_breakdown(alloc: BreakdownSource) -> MemoryBreakdown:
    """Classify every byte of ``alloc``'s plan; see the module docstring."""
    plan = alloc.plan
    groups = plan.groups
    id_bytes = {g.group_id: plan.id_bytes(g.group_id) for g in groups}
    data_bytes = {g.group_id: plan.id_data_bytes(g.group_id) for g in groups}
    out: dict[str, int] = defaultdict(int)
    _live(alloc, id_bytes, data_bytes, out)
    _cached(alloc, id_bytes, data_bytes, out)

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


def _live(
    alloc: BreakdownSource,
    id_bytes: dict[int, int],
    data_bytes: dict[int, int],
    out: dict[str, int],
) -> None:
    """Every id a running request holds, once per pool (a block shared by requests counts
    once), into ``live`` and ``padding``."""
    # a group's ids -> id -> group
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


def _cached(
    alloc: BreakdownSource,
    id_bytes: dict[int, int],
    data_bytes: dict[int, int],
    out: dict[str, int],
) -> None:
    """The cached entries no request holds, reachable or not, into their categories and
    ``padding``, and ``cached_states``. States are counted per group and priced at the end
    (a pack layout's 36 state groups make them most of the index): the sums are the same."""
    index, groups = alloc.index, alloc.plan.groups
    useful = _useful_units(alloc)
    no_units: set[bytes] = set()
    useful_of = [useful.get(g.group_id, no_units) for g in groups]
    refs = [alloc.pool[g.group_id].ref for g in groups]  # refcounts: held entries are live
    # a KV entry of n units holds kv_bytes[gid] * n // block[gid] bytes of data
    kv_bytes = [data_bytes[g.group_id] * index.h for g in groups]
    block = [g.block_size for g in groups]
    kv_ok = kv_bad = kv_padding = 0
    # free state entries per group: all, and those a hit could use
    states, states_ok = [0] * len(groups), [0] * len(groups)
    state_positions: set[bytes] = set()
    # the pass over every entry: keys and entries unpacked in the loop header (it runs once
    # per cached block, tens of thousands of times per breakdown)
    for (gid, _), (block_id, _, units, is_state) in index.entries.items():
        if refs[gid][block_id]:
            continue  # held: counted as live
        if is_state:
            u = units[0]
            state_positions.add(u)
            states[gid] += 1
            if u in useful_of[gid]:
                states_ok[gid] += 1
            continue
        data = kv_bytes[gid] * len(units) // block[gid]
        # the first unit nearly always answers (useful prefixes are closed upwards)
        ok = useful_of[gid]
        if units[0] in ok or not ok.isdisjoint(units):
            kv_ok += data
        else:
            kv_bad += data
        kv_padding += id_bytes[gid] - data
    out["reachable"] += kv_ok
    out["reachable_kv"] += kv_ok
    out["unreachable"] += kv_bad
    out["unreachable_kv"] += kv_bad
    out["padding"] += kv_padding
    for gid, n in enumerate(states):
        if not n:
            continue
        ok, data = states_ok[gid], data_bytes[gid]
        out["reachable"] += ok * data
        out["reachable_state"] += ok * data
        out["unreachable"] += (n - ok) * data
        out["unreachable_state"] += (n - ok) * data
        out["padding"] += n * (id_bytes[gid] - data)
    out["cached_states"] = len(state_positions)


def _useful_units(alloc: BreakdownSource) -> dict[int, set[bytes]]:
    """Group -> the units of it a hit could use (:meth:`.reach.Reach.useful_units`)."""
    roles = group_roles(alloc.plan.groups)
    return Reach(alloc.index).useful_units(
        roles.full_ids, list(roles.window), list(roles.state), alloc.hit_peek_units
    )


def breakdown_table(samples: list[MemoryBreakdown]) -> dict[str, Any]:
    """Mean bytes per category over ``samples`` (empty: zeros)."""
    n = max(1, len(samples))
    return {c: sum(getattr(s, c) for s in samples) / n for c in MemoryBreakdown.field_names()}
