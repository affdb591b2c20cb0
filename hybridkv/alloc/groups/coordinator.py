"""The coordinator (:class:`Coordinator`): one manager per group, the longest prefix every
group serves, and what admitting or growing a request needs across them (vLLM's
``HybridKVCacheCoordinator``).

**The hit** (vLLM's ``find_longest_cache_hit`` fixed point, at hash-unit granularity): each
group in turn shrinks the candidate to the longest it serves (full attention first: its hits
bound everything and are downward closed; then sliding window; then states) until none does.
It is at most ``len(prompt) - 1``: the last prompt token is always computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .base import INF, Admission, GroupManager
from .full_attention import FullAttentionManager
from .ring import RingManager
from .sliding_window import SlidingWindowManager
from .state import StateManager

if TYPE_CHECKING:  # pragma: no cover
    from ...plan import KVCacheGroup, MemoryPlan
    from ..block_pool import IdCache
    from ..prefix_cache import PrefixIndex
    from ..request import Request
    from ..tables import BlockTables

__all__ = ["MANAGER_CLASSES", "Coordinator", "GroupRoles", "group_roles", "manager_class"]

#: a manager class per group kind: a new kind adds its class here
MANAGER_CLASSES: tuple[type[GroupManager], ...] = (
    FullAttentionManager,
    SlidingWindowManager,
    StateManager,
    RingManager,
)


def manager_class(group: KVCacheGroup) -> type[GroupManager]:
    """The manager class of ``group``'s kind (a sliding-window group without a window is full
    attention); a clear error for a kind no manager handles."""
    if group.kind == "sliding_window" and not group.sliding_window:
        return FullAttentionManager
    for cls in MANAGER_CLASSES:
        if group.kind in cls.kinds:
            return cls
    kinds = sorted({k for cls in MANAGER_CLASSES for k in cls.kinds})
    raise ConfigError(
        f"group {group.group_id} has kind {group.kind!r}, which no group manager handles "
        f"(known: {', '.join(kinds)})"
    )


@dataclass(frozen=True)
class GroupRoles:
    """What each group of a plan is to a prefix hit, as its manager class says: the one answer
    the eviction cascade, the byte breakdown and the eviction scores read (:func:`group_roles`).
    Group ids in group order."""

    #: a hit needs every token before it cached here (full attention, MLA, indexer keys),
    #: with each group's block size
    full: tuple[tuple[int, int], ...]
    #: ``(group, window tokens)``: a hit needs the window before it cached here
    window: tuple[tuple[int, int], ...]
    #: recurrent states: a hit needs a checkpoint exactly at it
    state: tuple[int, ...]
    #: per-request blocks no hit reads or caches (a sparse-attention indexer's ring)
    scratch: tuple[int, ...]

    @property
    def full_ids(self) -> list[int]:
        return [g for g, _ in self.full]

    @property
    def chain_ids(self) -> list[int]:
        """The groups whose cached units form chains a hit reads: full, then windowed."""
        return [g for g, _ in self.full] + [g for g, _ in self.window]


def group_roles(groups: Sequence[KVCacheGroup]) -> GroupRoles:
    """:class:`GroupRoles` of ``groups`` (a plan's), from their manager classes."""
    full: list[tuple[int, int]] = []
    window: list[tuple[int, int]] = []
    state: list[int] = []
    scratch: list[int] = []
    for g in groups:
        cls = manager_class(g)
        if cls.is_state:
            state.append(g.group_id)
        elif cls.needs_whole_prefix:
            full.append((g.group_id, g.block_size))
        elif not cls.caches_blocks:
            scratch.append(g.group_id)
        else:
            window.append((g.group_id, g.sliding_window))
    return GroupRoles(tuple(full), tuple(window), tuple(state), tuple(scratch))


class Coordinator:
    """The group managers of one allocator, in group order, and the hits across them.

    ``ids``: group -> where its ids come from; ``partial_hits``: attention may hit inside a
    block (at hash-unit granularity), ``keyed_partial_hits`` only where an entry is keyed
    (vLLM's, ``AllocatorOptions.partial_hit_points``); ``state_hit_step``: the checkpoint
    policy's spacing of state hit points; ``slots_per_seq``: state slots each request
    reserves; ``eagle_block_drop``: vLLM's EAGLE block drop (:meth:`eagle_groups` give a
    drop unit back from every hit)."""

    def __init__(
        self,
        plan: MemoryPlan,
        ids: dict[int, IdCache],
        tables: BlockTables,
        index: PrefixIndex,
        *,
        hash_block_size: int,
        partial_hits: bool,
        state_hit_step: int,
        keyed_partial_hits: bool = False,
        slots_per_seq: int,
        eagle_block_drop: bool = False,
    ) -> None:
        h = self.h = hash_block_size
        self.managers: list[GroupManager] = []
        for g in plan.groups:
            cls = manager_class(g)
            if cls.is_state:
                m: GroupManager = StateManager(
                    g, ids[g.group_id], tables, index, h, state_hit_step, slots_per_seq
                )
            else:
                step = h if partial_hits else g.block_size
                m = cls(g, ids[g.group_id], tables, index, h, step)
                m.keyed_partial_hits = keyed_partial_hits
            self.managers.append(m)
        self.attention = [m for m in self.managers if not m.is_state]
        self.states = [m for m in self.managers if m.is_state]
        #: attention groups whose computed blocks the commit caches (not a scratch ring)
        self.caching = [m for m in self.attention if m.caches_blocks]
        #: groups whose hits need every token before them (the eviction cascade follows them)
        self.whole_prefix = [m for m in self.attention if m.needs_whole_prefix]
        windowed = [m for m in self.attention if m.window]
        # vLLM's order: full attention bounds everything and is downward closed
        self.attention_rules = self.whole_prefix + windowed
        self.hit_rules = self.attention_rules + self.states
        self.windowed = windowed
        if eagle_block_drop:
            for m in self.eagle_groups(plan):
                # eagle_proof_margin: a hash unit where hits land inside a block, else a block
                # (the drop vLLM gives back is the same unit)
                m.eagle_drop = m.hit_step

    def eagle_groups(self, plan: MemoryPlan) -> list[GroupManager]:
        """The managers vLLM's EAGLE block drop applies to: the groups holding the drafter's
        layers (``is_eagle_group``) and every attention group of their spec (vLLM looks groups
        of one spec up together, and drops for all of them if one is the drafter's); every
        attention group when none holds a drafter (vLLM's fallback). Only full-attention
        groups drop here; a sliding window's drop is refused."""
        drafter = {g.group_id for g in plan.groups if g.holds_drafter}
        cached = [m for m in self.attention if m.caches_blocks]
        flagged = [m for m in cached if m.group_id in drafter] if drafter else cached

        def spec(m: GroupManager) -> tuple[object, ...]:
            g = plan.groups[m.group_id]
            return (g.kind, g.block_size, g.page_bytes, g.sliding_window, g.dcp_size)

        specs = {spec(m) for m in flagged}
        out = [m for m in cached if spec(m) in specs]
        windowed = [m.group_id for m in out if not m.needs_whole_prefix]
        if windowed:
            raise ConfigError(
                f"EAGLE's block drop on sliding-window groups {windowed} (one more contiguous "
                "block per hit, then a pop) is not modelled; leave eagle_block_drop off"
            )
        return out

    def longest_hit(
        self, hashes: list[bytes], max_len: int, rules: list[GroupManager] | None = None
    ) -> int:
        """The longest prefix ``<= max_len`` every group of ``rules`` (default: all) serves."""
        rules = self.hit_rules if rules is None else rules
        curr = min(max_len, len(hashes) * self.h)
        memo: dict[int, int] = {}
        while True:
            prev = curr
            for m in rules:
                if curr == 0:
                    return 0
                curr = m.shrink_hit(hashes, curr, memo)
            if curr == prev:
                return curr

    def probe_rules(self, probe: str | None) -> list[GroupManager]:
        """The groups of a checkpoint policy's admission probe: ``"attention"`` (the hit
        attention alone serves: ``marconi``'s branch points) or ``"junction"`` (vLLM's: the
        first group of its hit search and the groups of the same spec); none without state
        groups or a probe."""
        if not self.states or not self.attention_rules or probe is None:
            return []
        if probe == "attention":
            return self.attention_rules
        first = self.attention_rules[0]
        key = (type(first), first.block_size, first.window)
        return [m for m in self.attention_rules if (type(m), m.block_size, m.window) == key]

    def admit(self, r: Request, hit: int) -> Admission:
        """Every group's blocks of ``r`` from a hit of ``hit`` tokens, and what it needs."""
        adm = Admission()
        for m in self.attention:
            m.admit(r, hit, adm)
        for m in self.states:
            m.admit(r, hit, adm)
        return adm

    def blocks_needed(self, r: Request, total: int) -> dict[int, int]:
        """New ids per group for ``r`` to hold ``total`` tokens (groups needing none left out),
        after freeing what fell out of sliding windows."""
        for m in self.windowed:
            m.skip_blocks(r)
        needs: dict[int, int] = {}
        for m in self.attention:
            k = m.blocks_needed(r, total)
            if k > 0:
                needs[m.group_id] = k
        return needs

    def fast_path_limit(self, r: Request, caching: bool) -> tuple[int, int]:
        """``(limit, work)`` over the groups (:meth:`GroupManager.fast_path_limit`)."""
        limit = work = INF
        for m in self.attention:  # comparisons, not min(): this runs at every block boundary
            lim, w = m.fast_path_limit(r, caching)
            if lim < limit:
                limit = lim
            if w < work:
                work = w
        return limit, work
