"""``last``: only the state at the end of each request.

While it runs, the request keeps a private rolling checkpoint at the last hash-unit boundary a
step ended on (decode ends a step on every token, so it is at most ``hash_block_size - 1``
tokens old); at ``free()`` it is cached. This serves multi-turn reuse (the next turn extends the
whole previous conversation) at one page per conversation. A prefill chunk ends at the prompt's
last hash boundary: a state is only kept where a step ends on one, and an answer too short to
reach the next would leave the request with no end state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import CheckpointPolicy, StateActions

if TYPE_CHECKING:  # pragma: no cover
    from ...plan import MemoryPlan
    from ..request import Request

__all__ = ["LastPolicy"]


class LastPolicy(CheckpointPolicy):
    """See the module docstring; the base of the policies that keep an end state."""

    name = "last"

    def configure(self, plan: MemoryPlan) -> None:
        self.keeps_end_state = True

    def chunk_stops(self, r: Request) -> list[int]:
        """Every position this policy wants a chunk to end at (the first past ``num_alloc``
        is :meth:`chunk_stop`)."""
        return [r.nprompt // self.h * self.h]

    def chunk_stop(self, r: Request) -> int | None:
        after = [p for p in self.chunk_stops(r) if p > r.num_alloc]
        return min(after) if after else None

    def next_work(self, r: Request) -> int:
        return (r.num_alloc // self.h + 1) * self.h

    def step_end(self, r: Request, P: int, known: int, act: StateActions) -> None:
        if known == P and P > 0 and P % self.h == 0:
            act.roll(r, P)
