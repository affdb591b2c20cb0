"""``hash_ladder`` (``checkpoint_interval`` ``N``): ``last`` plus a state at the prompt's last
multiple of ``N``, of ``2N``, of ``4N``, ... (each distinct position once).

A later prompt shares an earlier one up to some point ``d`` tokens before its end: the next
turn of a conversation as a block-hashed trace records it (``d`` under one unit), another
question on the same document (``d`` the old question's length), the same system prompt and
tools with another history (``d`` most of the prompt). ``hash_boundary`` keeps only the last
multiple of ``N`` and serves the first kind alone. A ladder keeps one state per doubling of the
distance from the end, so whatever ``d`` is, some rung sits at most about ``d`` tokens further
back (the last multiple of the first scale ``M >= d`` with ``n mod M >= d``): a prefix shared up to
``d`` tokens before the end is served to within about ``2d`` of where it stops, for
``log2(n / N) + 1`` states per ``n``-token prompt instead of ``periodic``'s ``n / N``. The rungs
are multiples of their scale, so prompts that share a prefix put theirs at the same positions and
find them cached.

The first scale defaults to the state's own size in KV tokens, rounded up to a power-of-two
multiple of the hash unit (2,048 tokens for Qwen3-Next-80B-A3B, whose 37.7 MiB state weighs as
much as 1,608 tokens of KV): a rung closer to the next one up saves fewer tokens of prefill per
reuse than the KV its page could have held instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..groups import group_roles
from .periodic import PeriodicPolicy

if TYPE_CHECKING:  # pragma: no cover
    from ...plan import MemoryPlan

__all__ = ["HashLadderPolicy", "ladder_rungs", "state_sized_scale"]


class HashLadderPolicy(PeriodicPolicy):
    """See the module docstring."""

    name = "hash_ladder"
    #: which rungs (and which KV) stay when memory runs out is Marconi's value per byte
    #: against recency: a long document's rungs save the most prefill per byte kept
    eviction = "marconi"

    @classmethod
    def check_interval(cls, interval: int | None, hash_block_size: int) -> int:
        if interval is None:
            return 0  # the plan decides (configure)
        return super().check_interval(interval, hash_block_size)

    def configure(self, plan: MemoryPlan) -> None:
        if not self.interval:
            self.interval = state_sized_scale(plan, self.h)
        super().configure(plan)

    def marks(self, start: int, end: int, num_prompt: int) -> list[int]:
        last = num_prompt - 1  # states strictly inside the prompt (the end state is last's)
        top = min(end, last)
        return [m for m in ladder_rungs(last, self.interval) if start < m <= top]

    def next_mark(self, after: int, num_prompt: int) -> int | None:
        found = self.marks(after, num_prompt - 1, num_prompt)
        return found[0] if found else None


def state_sized_scale(plan: MemoryPlan, hash_block_size: int) -> int:
    """The smallest power-of-two multiple of ``hash_block_size`` whose KV takes at least the
    bytes one kept state takes in ``plan``'s pages (``hash_block_size`` for a plan with no
    states)."""
    if not plan.state_groups:
        return hash_block_size
    state = sum(plan.id_bytes(g.group_id) for g in plan.state_groups)
    # the groups a cached token keeps bytes in (a scratch ring is per request), in group
    # order as before
    kv = set(group_roles(plan.groups).chain_ids)
    kv_per_token = sum(
        plan.id_bytes(g.group_id) / g.block_size for g in plan.groups if g.group_id in kv
    )
    scale = hash_block_size
    while kv_per_token and scale * kv_per_token < state:
        scale *= 2
    return scale


def ladder_rungs(last: int, interval: int) -> list[int]:
    """The ladder's positions for a prompt whose last token is at ``last``: the last multiple of
    ``interval``, ``2 * interval``, ``4 * interval``, ... at or below it, each once, ascending."""
    rungs, scale = set(), interval
    while scale <= last:
        rungs.add(last // scale * scale)
        scale *= 2
    return sorted(rungs)
