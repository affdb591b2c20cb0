"""``hash_boundary`` (``checkpoint_interval`` ``N``): ``last`` plus one state per prompt, at its
last multiple of ``N``.

``N`` is a trace's hash unit (Mooncake's 512): a request that shares every whole ``N``-token
block of an earlier prompt (the next turn of a conversation as a block-hashed trace records it,
or another question on the same document) hits there. Exported from inside the prefill, or a
chunk ends there, as for ``periodic``.
"""

from __future__ import annotations

from .periodic import PeriodicPolicy

__all__ = ["HashBoundaryPolicy"]


class HashBoundaryPolicy(PeriodicPolicy):
    """See the module docstring."""

    name = "hash_boundary"

    def marks(self, start: int, end: int, num_prompt: int) -> list[int]:
        top = min(end, num_prompt - 1)
        m = (num_prompt - 1) // self.interval * self.interval
        return [m] if start < m <= top and m > 0 else []

    def next_mark(self, after: int, num_prompt: int) -> int | None:
        found = self.marks(after, num_prompt - 1, num_prompt)
        return found[0] if found else None
