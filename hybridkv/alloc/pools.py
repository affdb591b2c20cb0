"""The id pools behind a plan's pools (:func:`build_pools`), each a
:class:`~.block_pool.Pool`: the allocator works through that interface alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .block_pool import BlockPool, OnEvict, Pool
from .errors import ConfigError
from .two_level import TwoLevelPool

if TYPE_CHECKING:  # pragma: no cover
    from ..plan import MemoryPlan

__all__ = ["POOL_KINDS", "build_pools"]

#: the plan's pool kinds these pools implement
POOL_KINDS = ("shared", "per_group", "two_level")


def build_pools(plan: MemoryPlan, on_evict: OnEvict | None = None) -> list[Pool]:
    """One pool per plan pool, in plan order (a plan pool whose groups have ids of their own
    gives one per group): ids in large pages make a :class:`TwoLevelPool`, whose page 0 (every
    group's null id) stays with its first attention group; one id space for all the groups
    (``shared``) one :class:`BlockPool`; else (``per_group``) a :class:`BlockPool` per
    group."""
    groups = plan.groups
    out: list[Pool] = []
    for p in plan.pools:
        if p.kind not in POOL_KINDS:
            raise ConfigError(f"unknown pool kind {p.kind!r}")
        if p.is_two_level:
            attn = [g for g in p.groups if not groups[g].is_state]
            first = attn[0] if attn else p.groups[0]
            ids = {g: p.ids_per_page(g) for g in p.groups}
            out.append(TwoLevelPool(p.num_blocks, ids, first, p.name, on_evict))
        elif p.shares_ids:
            out.append(BlockPool(p.num_blocks, p.name, on_evict, p.groups))
        else:
            for gid in p.groups:
                name = f"{p.name}/g{gid}" if len(p.groups) > 1 else p.name
                out.append(BlockPool(p.num_ids(gid), name, on_evict, (gid,)))
    return out
