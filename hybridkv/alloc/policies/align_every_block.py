"""``align_every_block`` (not vLLM's): a state at every block boundary of every request.

Prefill chunks end at every multiple of the state groups' block size, and the state at every
block boundary a step ends on is cached, decode included. Hits land on the largest block
multiple of a shared prefix: the upper bound of align-style caching while memory is ample (each
state takes a page, so under pressure they evict one another), paid for with a prefill step per
block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import CheckpointPolicy, StateActions

if TYPE_CHECKING:  # pragma: no cover
    from ...plan import MemoryPlan
    from ..request import Request

__all__ = ["AlignEveryBlock"]


class AlignEveryBlock(CheckpointPolicy):
    """See the module docstring."""

    name = "align_every_block"

    def configure(self, plan: MemoryPlan) -> None:
        self.step = self.block

    def _next_block(self, after: int) -> int:
        return (after // self.block + 1) * self.block

    def chunk_stop(self, r: Request) -> int | None:
        return self._next_block(r.num_alloc)

    def next_work(self, r: Request) -> int:
        return self._next_block(r.num_alloc)

    def step_end(self, r: Request, P: int, known: int, act: StateActions) -> None:
        if known == P and P > 0 and P % self.block == 0 and P % self.h == 0:
            act.keep(r, P)
