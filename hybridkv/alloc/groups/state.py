"""Recurrent-state groups (:class:`StateManager`): a request holds a fixed number of state slots
(the running state, then spares that become checkpoints), and a hit needs a checkpoint exactly
at the hit point, because a recurrent state cannot be rolled back."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Admission, GroupManager

if TYPE_CHECKING:  # pragma: no cover
    from ...plan import KVCacheGroup
    from ..block_pool import IdCache
    from ..prefix_cache import PrefixIndex
    from ..request import Request
    from ..tables import BlockTables

__all__ = ["StateManager"]


class StateManager(GroupManager):
    """See the module docstring. ``slots_per_seq``: slots each request reserves (vLLM's
    ``align`` mode reserves 2, so that a checkpoint can be taken even when the pool is
    full); ``hit_step``: the checkpoint policy's spacing of state hit points."""

    kinds = ("state",)
    is_state = True

    def __init__(
        self,
        group: KVCacheGroup,
        ids: IdCache,
        tables: BlockTables,
        index: PrefixIndex,
        hash_block_size: int,
        hit_step: int,
        slots_per_seq: int = 1,
    ) -> None:
        super().__init__(group, ids, tables, index, hash_block_size, hit_step)
        self.slots_per_seq = slots_per_seq

    def shrink_hit(self, hashes: list[bytes], limit: int, memo: dict[int, int]) -> int:
        """Longest L <= ``limit`` with a checkpoint of this group exactly at L."""
        step, h = self.hit_step, self.h
        L = limit // step * step
        while L > 0:
            if self.lookup(hashes[L // h - 1]) is not None:
                return L
            L -= step
        return 0

    def admit(self, r: Request, hit: int, adm: Admission) -> None:
        gid = self.group_id
        adm.needs[gid] = self.slots_per_seq
        if hit:
            src = self.lookup(r.hashes[hit // self.h - 1])
            assert src is not None
            adm.state_sources[gid] = src
            adm.touch[gid] = [src]
