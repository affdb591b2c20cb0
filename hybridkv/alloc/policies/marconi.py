"""``marconi`` (Marconi, MLSys'25): ``last`` plus a checkpoint at each branch point.

A request whose prompt diverges from a cached prefix (attention KV is cached past the point
where the state hit stops, so another request shared these tokens: the next one will too) keeps
a state at that *branch point*. Eviction weighs recency against compute saved per byte
(:mod:`hybridkv.alloc.marconi`). Its admission is what the name means when comparing policies: a
state is admitted at a prefix only once a second request has shown that prefix to be shared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import StateActions
from .last import LastPolicy

if TYPE_CHECKING:  # pragma: no cover
    from ..request import Request

__all__ = ["MarconiPolicy"]


class MarconiPolicy(LastPolicy):
    """See the module docstring."""

    name = "marconi"
    admission_probe = "attention"
    eviction = "marconi"

    def admitted(self, r: Request, hit: int, probe_hit: int) -> None:
        if probe_hit > hit:
            r.branch_at = probe_hit // self.h * self.h

    def chunk_stops(self, r: Request) -> list[int]:
        return [*super().chunk_stops(r), r.branch_at]

    def next_work(self, r: Request) -> int:
        nxt = super().next_work(r)
        return r.branch_at if r.num_alloc < r.branch_at < nxt else nxt

    def step_end(self, r: Request, P: int, known: int, act: StateActions) -> None:
        if known == P and P > 0 and r.branch_at == P:
            act.keep(r, P)
            r.branch_at = -1
            return
        super().step_end(r, P, known, act)
