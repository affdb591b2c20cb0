"""Per-group block tables kept up to date incrementally (vLLM's worker-side ``BlockTable``).

Each running request owns one row in a numpy int32 array per group; the allocator writes only
the ids that change (a new block, a sliding-window block turned null, a state slot), so building
the tables for a batch is one gather per group, not a Python loop over every block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where tensors are built, not by the CLI
    import torch

__all__ = ["BlockTables"]


class BlockTables:
    """``fixed`` maps groups whose rows never grow past a width (state groups: their slots) to
    that width. Their tables live in one 3-D array, so a batch's tables for all of them come
    from one gather: the pack layout of Qwen3-Next has 36 state groups."""

    def __init__(
        self, num_groups: int, rows: int = 64, width: int = 8, fixed: dict[int, int] | None = None
    ) -> None:
        self.num_groups = num_groups
        self.fixed = sorted(fixed or {})
        self.fixed_width = max((fixed or {}).values(), default=1)
        self.lens = np.zeros((num_groups, rows), dtype=np.int32)
        self._free_rows = list(range(rows - 1, -1, -1))
        self.tables: list[np.ndarray] = [
            np.zeros((rows, width), dtype=np.int32) for _ in range(num_groups)
        ]
        self._fixed_arr = np.zeros((len(self.fixed), rows, self.fixed_width), dtype=np.int32)
        self._bind_fixed()

    def _bind_fixed(self) -> None:
        for i, g in enumerate(self.fixed):
            self.tables[g] = self._fixed_arr[i]

    @property
    def num_rows(self) -> int:
        return self.lens.shape[1]

    def add_row(self) -> int:
        if not self._free_rows:
            old = self.num_rows
            new = 2 * old
            self.tables = [
                np.concatenate([t, np.zeros((new - old, t.shape[1]), np.int32)])
                for t in self.tables
            ]
            f = self._fixed_arr
            self._fixed_arr = np.concatenate(
                [f, np.zeros((f.shape[0], new - old, f.shape[2]), np.int32)], 1
            )
            self._bind_fixed()
            self.lens = np.concatenate([self.lens, np.zeros((self.num_groups, old), np.int32)], 1)
            self._free_rows = list(range(new - 1, old - 1, -1))
        return self._free_rows.pop()

    def release_row(self, row: int) -> None:
        for g, t in enumerate(self.tables):
            n = self.lens[g, row]
            if n:
                t[row, :n] = 0
                self.lens[g, row] = 0
        self._free_rows.append(row)

    def _fit(self, g: int, width: int) -> np.ndarray:
        t = self.tables[g]
        if width > t.shape[1]:
            if g in self.fixed:
                raise ValueError(f"group {g} holds at most {t.shape[1]} ids a request")
            w = max(width, 2 * t.shape[1])
            grown = np.zeros((t.shape[0], w), np.int32)
            grown[:, : t.shape[1]] = t
            self.tables[g] = t = grown
        return t

    def write(self, g: int, row: int, start: int, ids: Sequence[int]) -> None:
        """Set entries ``start ..`` of a row; the row's length becomes at least their end."""
        end = start + len(ids)
        t = self._fit(g, end)
        t[row, start:end] = ids
        if end > self.lens[g, row]:
            self.lens[g, row] = end

    def set_row(self, g: int, row: int, ids: Sequence[int]) -> None:
        """Replace a whole row (state groups: running slot and spare slots)."""
        n = len(ids)
        t = self._fit(g, n)
        old = self.lens[g, row]
        t[row, :n] = ids
        if old > n:
            t[row, n:old] = 0
        self.lens[g, row] = n

    def gather(self, rows: Sequence[int]) -> list[torch.Tensor]:
        import torch  # here only: the CLI and the simulator never build tensors

        """One int32 tensor per group, 0-padded: ``[len(rows), max blocks among them]``, or
        ``[len(rows), fixed width]`` for the fixed-width groups."""
        idx = np.asarray(rows, dtype=np.intp)
        if idx.size == 0:
            return [torch.zeros((0, 0), dtype=torch.int32) for _ in range(self.num_groups)]
        out: list[torch.Tensor | None] = [None] * self.num_groups
        if self.fixed:
            both = torch.from_numpy(self._fixed_arr[:, idx])
            for i, g in enumerate(self.fixed):
                out[g] = both[i]
        lens = self.lens
        for g, t in enumerate(self.tables):
            if out[g] is None:
                out[g] = torch.from_numpy(t[idx, : int(lens[g, idx].max())])
        return out  # type: ignore[return-value]
