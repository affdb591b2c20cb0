"""Sliding-window attention groups (:class:`SlidingWindowManager`): a token reads the
``window - 1`` tokens before it, so a hit needs those cached (earlier blocks are the null
block), blocks that fall out of the window are freed as a request grows, and hits are not
downward closed (candidates are scanned from the longest)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .full_attention import FullAttentionManager

if TYPE_CHECKING:  # pragma: no cover
    from ..request import Request

__all__ = ["SlidingWindowManager"]


class SlidingWindowManager(FullAttentionManager):
    """See the module docstring."""

    kinds = ("sliding_window",)
    needs_whole_prefix = False

    @property
    def window(self) -> int:
        return self.sliding_window

    def shrink_hit(self, hashes: list[bytes], limit: int, memo: dict[int, int]) -> int:
        """Longest L <= ``limit`` (a multiple of the hit step) with the ``window - 1`` tokens
        before L cached. One lookup per block, then a scan over runs of cached blocks."""
        B, s, W, step = self.block_size, self.units_per_block, self.sliding_window, self.hit_step
        nb = limit // B
        run = [0] * (nb + 1)  # run[j]: cached full blocks ending just before block j
        for j in range(nb):
            run[j + 1] = run[j] + 1 if self.lookup(hashes[(j + 1) * s - 1]) is not None else 0
        holder = self.index.holder
        L = limit // step * step
        while L > 0:
            first_block = max(0, L - W + 1) // B
            last = L // B  # blocks [first_block, last) must be full and cached
            # a hit inside a block needs a cached block agreeing with us up to L
            ok = not L % B or holder(self.group_id, hashes[L // self.h - 1]) is not None
            if ok and (last <= first_block or run[last] >= last - first_block):
                return L
            L -= step
        return 0

    def leading_null_blocks(self, hit: int, full: int) -> int:
        return min(full, max(0, hit - self.sliding_window + 1) // self.block_size)

    def skip_blocks(self, r: Request) -> None:
        """Blocks ending at or before the first token the next one attends to become null;
        oldest first, as vLLM: the oldest of them is the nearest to eviction."""
        gid, B = self.group_id, self.block_size
        blocks = r.blocks[gid]
        lead = r.lead[gid]
        end = min(max(0, r.num_alloc - self.sliding_window + 1) // B, len(blocks))
        if end <= lead:
            return
        self.ids.free(blocks[lead:end])
        blocks[lead:end] = [0] * (end - lead)
        self.tables.write(gid, r.row, lead, blocks[lead:end])
        r.lead[gid] = end

    def fast_path_limit(self, r: Request, caching: bool) -> tuple[int, int]:
        limit, work = super().fast_path_limit(r, caching)
        window_limit = (r.lead[self.group_id] + 1) * self.block_size + self.sliding_window - 1
        return min(limit, window_limit), work
