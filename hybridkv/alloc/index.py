"""A consumer's view of the cache, rebuilt from KV events alone (what a KV-aware router keeps)."""

from __future__ import annotations

from collections.abc import Iterable

from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVEventBatch

__all__ = ["CacheIndex"]

Key = tuple[int, bytes]


class CacheIndex:
    """Cached ``(group, unit hash)`` pairs with their parent hash, from events in order.

    ``errors`` counts events that contradict the index (a stored hash already present, a removed
    hash absent): a correct, gap-free stream never has any.
    """

    def __init__(self) -> None:
        self.parent: dict[Key, bytes | None] = {}
        self.errors = 0

    def apply(self, batch: KVEventBatch | Iterable[KVCacheEvent]) -> None:
        events = batch.events if isinstance(batch, KVEventBatch) else batch
        for ev in events:
            if isinstance(ev, BlockStored):
                g = ev.group_idx or 0
                parent = ev.parent_block_hash
                for h in ev.block_hashes:
                    if (g, h) in self.parent:
                        self.errors += 1
                    self.parent[(g, h)] = parent
                    parent = h
            elif isinstance(ev, BlockRemoved):
                g = ev.group_idx or 0
                for h in ev.block_hashes:
                    if self.parent.pop((g, h), 0) == 0:
                        self.errors += 1
            elif isinstance(ev, AllBlocksCleared):
                self.parent.clear()

    @property
    def keys(self) -> set[Key]:
        return set(self.parent)

    def longest_prefix(self, group: int, unit_hashes: list[bytes]) -> int:
        """Leading units of a request (its chained hashes) this index holds for ``group``."""
        n = 0
        for h in unit_hashes:
            if (group, h) not in self.parent:
                break
            n += 1
        return n
