"""The prefix cache's index (:class:`PrefixIndex`): which hash units are cached, in which
entries (:class:`Entry`), with their parent links and the KV events of every change.

**Entries and units.** A cached attention block of ``B`` tokens is keyed by its last hash unit
and covers ``B / h`` units; a cached state checkpoint at token ``P`` is keyed by (and covers) the
single unit ending at ``P``. :class:`PrefixIndex` counts, per ``(group, unit)``, the cached
entries covering it, and emits KV events when a unit gains its first holder or loses its last
one. Two blocks may share leading units (two prompts agreeing on 300 tokens of a 544-token
block), so counting per unit is what keeps the event stream free of duplicates and of removals
of units that are still cached.

How long a prefix every group serves is the group managers' (:mod:`.groups`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .block_pool import CacheKey
from .events import MEDIUM_GPU, BlockRemoved, BlockStored

__all__ = ["Entry", "PrefixIndex"]

UnitKey = tuple[int, bytes]


class Entry(NamedTuple):
    """One cached entry of :class:`PrefixIndex` (a tuple: the index makes one per cached block
    or checkpoint, on the commit's hot path). It covers ``units``, the hash units
    ``first_unit .. first_unit + len(units) - 1`` of the prompts that computed it, and is held in
    id ``block_id`` of its group's pool; ``is_state``: a state checkpoint (one unit) rather than
    a block of KV."""

    block_id: int
    first_unit: int
    units: list[bytes]
    is_state: bool

    @property
    def last_unit(self) -> bytes:
        """The unit the entry is keyed by (its key is ``(group, last_unit)``)."""
        return self.units[-1]

    @property
    def end_unit(self) -> int:
        """Index of the first unit after the entry: its end, in hash units."""
        return self.first_unit + len(self.units)


class PrefixIndex:
    """Cached hash units per group, their parent links, the entries covering them, and the KV
    events describing every change."""

    def __init__(
        self, hash_block_size: int, *, medium: str | None = MEDIUM_GPU, emit: bool = True
    ) -> None:
        self.h = hash_block_size
        self.medium = medium
        self.holders: dict[UnitKey, list[int]] = {}  # unit -> ids of the entries covering it
        self.parent: dict[UnitKey, bytes | None] = {}
        # (group, unit) -> units cached right after it, in the order they came (a dict, not a
        # set: walks down a chain must not depend on the hash seed). KV groups only: every walk
        # goes down a full-attention or window chain, and a state group's units (one per
        # checkpoint, up to 36 groups at once in a pack layout) would only add upkeep
        self.children: dict[UnitKey, dict[bytes, None]] = {}
        self.entries: dict[CacheKey, Entry] = {}  # entry key -> what it covers, where
        # unit -> how many groups hold a state checkpoint at it (is there a state at this
        # position: asked for every unit of a chain when a state is evicted)
        self.state_units: dict[bytes, int] = {}
        # state unit -> (a hash list holding its chain, its index there): the chain of every
        # unit before it (hashes are chained, so one list names them all; request hash lists
        # only grow). Lets :meth:`.reach.Reach.state_reachable` ask "is this state below that
        # unit" by position instead of walking the subtree between them
        self.state_chains: dict[bytes, tuple[list[bytes], int]] = {}
        self.events: list[Any] = []
        #: whether changes become KV events (``AllocatorOptions.kv_events``; off, the simulator
        #: builds none: it would drop them every step)
        self.emit = emit
        #: units that gained or lost a state entry, or whose children (in a KV group) went
        #: from none to one, one to two or back, since a watcher last took them (:meth:`watch`;
        #: None: nobody watches). Marconi's scorer, rescoring only what changed instead of
        #: every cached state at every eviction, reads it: whether a unit is a leaf or a branch
        #: point is all it asks of the children, and a branch point's further children (a
        #: shared system prompt's, one per conversation) would mark every segment below it
        self.changed: set[bytes] | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def watch(self) -> set[bytes]:
        """Start recording :attr:`changed` (a unit gaining or losing a state entry, in any
        state group, or its first, second, or only children, in any KV group); returns the
        set, which the watcher empties as it reads it."""
        if self.changed is None:
            self.changed = set()
        return self.changed

    def add(
        self,
        key: CacheKey,
        bid: int,
        first_unit: int,
        hashes: list[bytes],
        num_units: int,
        tokens: Any,
        lora_id: int | None,
        is_state: bool,
    ) -> None:
        """Record entry ``key`` (held in ``bid``) covering units ``first_unit ..
        first_unit+num_units-1`` of a request's ``hashes``; emit BlockStored for new units."""
        gid = key[0]  # type: ignore[index]
        units = hashes[first_unit : first_unit + num_units]
        changed = self.changed
        if is_state:
            if key not in self.entries:
                n = self.state_units.get(units[0], 0)
                self.state_units[units[0]] = n + 1
                if not n:
                    self.state_chains[units[0]] = (hashes, first_unit)
            if changed is not None:
                changed.add(units[0])
        self.entries[key] = Entry(bid, first_unit, units, is_state)
        holders, parent = self.holders, self.parent
        if num_units == 1:  # every state checkpoint and 16-token block: the hot path
            k = (gid, units[0])
            lst = holders.get(k)
            if lst is None:
                holders[k] = [bid]
                par = parent[k] = hashes[first_unit - 1] if first_unit else None
                if not is_state:
                    self._link(gid, par, units[0])
                if self.emit:
                    self._stored(gid, hashes, first_unit, 1, tokens, lora_id)
            else:
                lst.append(bid)
            return
        run_start = -1
        children = self.children
        for i, u in enumerate(units):
            k = (gid, u)
            lst = holders.get(k)
            if lst is None:
                holders[k] = [bid]
                idx = first_unit + i
                par = parent[k] = hashes[idx - 1] if idx else None
                if par is not None:  # _link, inline: once per unit of every block cached
                    kids = children.get((gid, par))
                    if kids is None:
                        children[(gid, par)] = {u: None}
                        if changed is not None:
                            changed.add(par)
                    else:
                        kids[u] = None
                        if changed is not None and len(kids) == 2:
                            changed.add(par)
                if run_start < 0:
                    run_start = i
            else:
                lst.append(bid)
                if run_start >= 0:  # a held unit after new ones: close the run
                    start = first_unit + run_start
                    self._stored(gid, hashes, start, i - run_start, tokens, lora_id)
                    run_start = -1
        if run_start >= 0:
            self._stored(
                gid, hashes, first_unit + run_start, num_units - run_start, tokens, lora_id
            )

    def add_checkpoints(
        self,
        gids_ids: list[tuple[int, int]],
        unit: int,
        hashes: list[bytes],
        tokens: Any,
        lora_id: int | None,
    ) -> None:
        """:meth:`add` for state checkpoints of several groups at one unit (one entry each).
        A pack layout has one state group per layer (36 for Qwen3-Next), all checkpointing at
        once, so this path shares the work the groups have in common."""
        u = hashes[unit]
        par = hashes[unit - 1] if unit else None
        holders, parent, entries = self.holders, self.parent, self.entries
        units = [u]
        token_ids = None
        state_units = self.state_units
        if u not in state_units:
            self.state_chains[u] = (hashes, unit)
        if self.changed is not None:
            self.changed.add(u)
        for gid, bid in gids_ids:
            k = (gid, u)
            if k not in entries:
                state_units[u] = state_units.get(u, 0) + 1
            entries[k] = Entry(bid, unit, units, True)
            lst = holders.get(k)
            if lst is not None:
                lst.append(bid)
                continue
            holders[k] = [bid]
            parent[k] = par  # no children link: see ``children``
            if self.emit:
                if token_ids is None:
                    token_ids = tokens[unit * self.h : (unit + 1) * self.h].tolist()
                self._stored(gid, hashes, unit, 1, tokens, lora_id, token_ids)

    def _stored(
        self,
        gid: int,
        hashes: list[bytes],
        start: int,
        n: int,
        tokens: Any,
        lora_id: int | None,
        token_ids: list[int] | None = None,
    ) -> None:
        if not self.emit:
            return
        h = self.h
        if token_ids is None:
            token_ids = tokens[start * h : (start + n) * h].tolist()
        self.events.append(
            BlockStored(
                block_hashes=hashes[start : start + n],
                parent_block_hash=hashes[start - 1] if start else None,
                token_ids=token_ids,
                block_size=h,
                lora_id=lora_id,
                medium=self.medium,
                group_idx=gid,
            )
        )

    def remove(self, key: CacheKey, bid: int) -> None:
        """Entry ``key`` was evicted; emit BlockRemoved for units nothing covers any more."""
        entry = self.entries.pop(key)
        units = entry.units
        changed = self.changed
        if entry.is_state:
            if changed is not None:
                changed.add(units[0])
            left = self.state_units[units[0]] - 1
            if left:
                self.state_units[units[0]] = left
            else:
                del self.state_units[units[0]]
                del self.state_chains[units[0]]
        gid = key[0]  # type: ignore[index]
        holders, parent, children = self.holders, self.parent, self.children
        linked = not entry.is_state  # a state group's units have no children links
        gone = []
        for u in units:
            k = (gid, u)
            lst = holders[k]
            if len(lst) == 1:
                del holders[k]
                par = parent.pop(k)
                if par is not None and linked:
                    kids = children[(gid, par)]
                    kids.pop(u, None)
                    if not kids:
                        del children[(gid, par)]
                    if changed is not None and len(kids) < 2:
                        changed.add(par)
                gone.append(u)
            else:
                lst.remove(bid)
        if gone and self.emit:
            self.events.append(BlockRemoved(block_hashes=gone, medium=self.medium, group_idx=gid))

    def _link(self, gid: int, par: bytes | None, unit: bytes) -> None:
        if par is not None:
            kids = self.children.get((gid, par))
            if kids is None:
                self.children[(gid, par)] = {unit: None}
                if self.changed is not None:
                    self.changed.add(par)  # a leaf no more
            else:
                kids[unit] = None
                if self.changed is not None and len(kids) == 2:
                    self.changed.add(par)  # a branch point now

    def holder(self, gid: int, unit: bytes) -> int | None:
        """An entry id covering ``unit`` of ``gid`` (for partial-block hits)."""
        lst = self.holders.get((gid, unit))
        return lst[0] if lst else None

    def entry_info(self, key: CacheKey) -> tuple[int, bool]:
        """(tokens of prefix the entry ends at, whether it is a state checkpoint)."""
        entry = self.entries[key]
        return entry.end_unit * self.h, entry.is_state

    def continuations(self, key: CacheKey, chain_group: int) -> int:
        """How many units are cached right after entry ``key`` on its chain: in its own group
        for a KV entry, in ``chain_group`` (a full-attention group) for a state checkpoint."""
        entry = self.entries[key]
        gid = chain_group if entry.is_state else key[0]  # type: ignore[index]
        return len(self.children.get((gid, entry.last_unit), ()))

    def take_events(self) -> list[Any]:
        out, self.events = self.events, []
        return out

    def clear(self) -> None:
        if self.changed is not None:  # every state entry and every branch goes
            self.changed.update(u for _, u in self.entries)
            self.changed.update(u for _, u in self.children)
        self.holders.clear()
        self.parent.clear()
        self.children.clear()
        self.entries.clear()
        self.state_units.clear()
        self.state_chains.clear()

    def units(self) -> dict[UnitKey, bytes | None]:
        """Cached (group, unit) -> parent unit: what a subscriber's index must equal."""
        return dict(self.parent)
