"""Per-group block tables kept up to date incrementally (vLLM's worker-side ``BlockTable``).

Each running request owns one row in a numpy int32 array per group; the allocator writes only
the ids that change (a new block, a sliding-window block turned null, a state slot), so building
the tables for a batch is one gather per group, not a Python loop over every block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["BlockTables"]


class BlockTables:
    def __init__(self, num_groups: int, rows: int = 64, width: int = 8) -> None:
        self.num_groups = num_groups
        self.tables = [np.zeros((rows, width), dtype=np.int32) for _ in range(num_groups)]
        self.lens = np.zeros((num_groups, rows), dtype=np.int32)
        self._free_rows = list(range(rows - 1, -1, -1))

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
        """One int32 tensor ``[len(rows), max blocks among them]`` per group, 0-padded."""
        idx = np.asarray(rows, dtype=np.intp)
        out = []
        for g, t in enumerate(self.tables):
            if idx.size == 0:
                out.append(torch.zeros((0, 0), dtype=torch.int32))
                continue
            w = int(self.lens[g, idx].max())
            out.append(torch.from_numpy(t[idx, :w]))
        return out
