"""``periodic`` (``checkpoint_interval`` ``N``): ``last`` plus a state at every multiple of ``N``
inside each prompt.

The states are exported from inside the prefill where the backend can (SGLang keeps extra state
buffers at a fixed interval; Mamba-2's chunked scan and the chunked Gated-DeltaNet kernels
compute the state at every chunk boundary anyway); where it cannot
(``prefill_checkpoint_alignment`` ``None``, or an interval that is not a multiple of it),
prefill chunks end at those positions instead: the same states, more, smaller steps. A later
prompt sharing ``P`` tokens hits at the last multiple of ``N`` below ``P``, whatever ``P`` is;
each kept state costs a whole state page, about ``state / N`` bytes per prompt token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import DEFAULT_CHECKPOINT_INTERVAL, StateActions
from .last import LastPolicy

if TYPE_CHECKING:  # pragma: no cover
    from ...plan import MemoryPlan
    from ..request import Request

__all__ = ["PeriodicPolicy"]


class PeriodicPolicy(LastPolicy):
    """See the module docstring; :meth:`marks` says where the states inside a prompt are."""

    name = "periodic"

    def configure(self, plan: MemoryPlan) -> None:
        super().configure(plan)
        a = self.export_alignment
        #: the states inside prompts are exported from inside a prefill step (else chunks
        #: end at them)
        self.exports_marks = a is not None and a >= 1 and self.interval % a == 0

    @classmethod
    def check_interval(cls, interval: int | None, hash_block_size: int) -> int:
        n = DEFAULT_CHECKPOINT_INTERVAL if interval is None else interval
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n % hash_block_size:
            raise ValueError(
                f"checkpoint_interval must be a positive multiple of the hash unit "
                f"({hash_block_size} tokens): a state is only found at a hash boundary; "
                f"got {n!r}"
            )
        return n

    @property
    def exports(self) -> bool:
        return self.exports_marks

    def marks(self, start: int, end: int, num_prompt: int) -> list[int]:
        """The positions in ``(start, end]`` at which a state is kept inside the prompt (states
        strictly inside a prompt: the end state is ``last``'s)."""
        N = self.interval
        top = min(end, num_prompt - 1)
        return list(range((start // N + 1) * N, top + 1, N))

    def next_mark(self, after: int, num_prompt: int) -> int | None:
        """The first position of :meth:`marks` past ``after``, or None."""
        m = (after // self.interval + 1) * self.interval
        return m if m < num_prompt else None

    def chunk_stops(self, r: Request) -> list[int]:
        stops = super().chunk_stops(r)
        if not self.exports_marks:
            stops.append(self.next_mark(r.num_alloc, r.nprompt) or 0)
        return stops

    def step_end(self, r: Request, P: int, known: int, act: StateActions) -> None:
        if known != P:
            return
        if self.exports_marks:
            start, r.step_start = r.step_start, -1
            if start >= 0:
                for m in self.marks(start, P - 1, r.nprompt):
                    act.export(r, m)
                    r.last_mark = m
                if self.marks(P - 1, P, r.nprompt):
                    act.keep(r, P)  # the step ends on one
                    r.last_mark = P
        elif P > 0 and self.marks(P - 1, P, r.nprompt):
            act.keep(r, P)
            # a kept state inside the prompt is also the newest end state (as when it is
            # exported from a step that ends on it)
            r.last_mark = P
            act.roll(r, P)
            return
        if P > 0 and P % self.h == 0:
            act.roll(r, P)
