"""All-or-nothing allocation across groups (:class:`Capacity`): whether what a request needs in
every group fits the pools those groups share, what must be held back so that it cannot fail
half way, and the running requests' private checkpoints that give way when it does not fit."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .block_pool import IdCache, Pool
    from .request import Request

__all__ = ["Capacity"]

#: per pool: (needs, touch, freed) of its groups
_Asks = dict["Pool", tuple[dict[int, int], dict[int, list[int]], dict[int, int]]]


class Capacity:
    """The pools of one allocator as one capacity. ``pool_of``: group -> the pool (a
    :class:`~.block_pool.Pool`) whose capacity it shares; ``ids``: group -> where its ids come
    from."""

    def __init__(self, pool_of: dict[int, Pool], ids: dict[int, IdCache]) -> None:
        self.pool_of = pool_of
        self.ids = ids

    def fits(
        self,
        needs: dict[int, int],
        touch: dict[int, list[int]] | None = None,
        freed: dict[int, int] | None = None,
    ) -> bool:
        """Whether ``needs`` (new ids per group) fits once the cached ids ``touch`` (a hit's)
        left the free lists; ``freed`` counts ids per group freed first (private checkpoints,
        see :meth:`reclaim_private`)."""
        if len(needs) == 1 and not touch and not freed:
            return self.pool_of[next(iter(needs))].can_allocate(needs)
        pool_of = self.pool_of
        asks: _Asks = {}
        for gid, n in needs.items():
            asks.setdefault(pool_of[gid], ({}, {}, {}))[0][gid] = n
        if touch:
            for gid, ids in touch.items():
                if ids:
                    asks.setdefault(pool_of[gid], ({}, {}, {}))[1][gid] = ids
        if freed:
            for gid, n in freed.items():
                ask = asks.get(pool_of[gid])
                if ask is not None:
                    ask[2][gid] = n
        return all(pool.can_allocate(n, t, f) for pool, (n, t, f) in asks.items())

    def reclaim_private(
        self,
        needs: dict[int, int],
        running: Iterable[Request],
        touch: dict[int, list[int]] | None = None,
    ) -> bool:
        """Make room for ``needs`` by dropping running requests' private end-of-request
        checkpoints (``last``/``marconi`` take them only where a slot is spare), oldest requests
        first, but only if that makes ``needs`` fit: otherwise nothing changes. A dropped
        checkpoint is taken again at the request's next hash-unit boundary if a slot is free."""
        pool_of = self.pool_of
        pools = {pool_of[g] for g in needs}
        holders = [r for r in running if any(pool_of[g] in pools for g in r.end_ckpt)]
        if not holders:
            return False
        freed: dict[int, int] = {}
        for r in holders:
            for g in r.end_ckpt:
                if pool_of[g] in pools:
                    freed[g] = freed.get(g, 0) + 1
        if not self.fits(needs, touch, freed):
            return False
        for r in holders:
            for gid in [g for g in r.end_ckpt if pool_of[g] in pools]:
                self.ids[gid].free((r.end_ckpt.pop(gid),))
            r.end_copies = None
            if self.fits(needs, touch):
                return True
        return self.fits(needs, touch)

    def reserve(self, needs: dict[int, int]) -> list[Pool]:
        """Reserve what an allocation over several groups of a pool relies on; returns the
        pools to release afterwards."""
        if len(needs) < 2:
            return []
        by_pool: dict[Pool, dict[int, int]] = {}
        for gid, k in needs.items():
            by_pool.setdefault(self.pool_of[gid], {})[gid] = k
        return [pool for pool, n in by_pool.items() if pool.reserve(n)]

    def allocate(self, needs: dict[int, int], running: Iterable[Request]) -> dict[int, list[int]]:
        """``needs`` new ids per group, all or none (an empty dict: they do not fit, even after
        dropping private checkpoints; nothing changed)."""
        if not self.fits(needs) and not self.reclaim_private(needs, running):
            return {}
        reserved = self.reserve(needs)
        out = {gid: self.ids[gid].allocate(k) for gid, k in needs.items()}
        for pool in reserved:
            pool.release()
        return out
