"""Full attention, MLA and sparse-attention indexer groups (:class:`FullAttentionManager`): every
token's KV (or indexer key) is kept, so a hit needs every block before it cached (downward
closed), and with partial hits a prefix of the block holding the hit point (served by copying
those tokens into a new block)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import INF, Admission, GroupManager

if TYPE_CHECKING:  # pragma: no cover
    from ..request import Request

__all__ = ["FullAttentionManager"]


class FullAttentionManager(GroupManager):
    """See the module docstring; MLA is full attention with its own (latent) page, an indexer's
    keys likewise (every token's key is kept and read to pick the top-k)."""

    kinds = ("full_attention", "mla", "indexer")
    needs_whole_prefix = True

    def shrink_hit(self, hashes: list[bytes], limit: int, memo: dict[int, int]) -> int:
        # downward closed: the prefix found at the first visit bounds every later one
        got = memo.get(self.group_id)
        if got is None:
            drop = self.eagle_drop
            if drop:
                # EAGLE's block drop: look one drop unit past the candidate, give it back (once
                # per lookup: vLLM trims, and does not drop again, as the candidate shrinks)
                got = self.cached_prefix(hashes, min(limit + drop, len(hashes) * self.h))
                got = max(0, got - drop)
            else:
                got = self.cached_prefix(hashes, limit)
            memo[self.group_id] = got
        step = self.hit_step
        return min(limit, got) // step * step

    def cached_prefix(self, hashes: list[bytes], limit: int) -> int:
        """Longest prefix ``<= limit`` this group holds: whole cached blocks, then (with hit
        points finer than a block) hash units of a cached block that agrees with us."""
        B, s = self.block_size, self.units_per_block
        nblocks = limit // B
        n = 0
        while n < nblocks and self.lookup(hashes[(n + 1) * s - 1]) is not None:
            n += 1
        hit = n * B
        if self.hit_step < B:  # partial hit inside block n
            per, h = self.hit_step // self.h, self.h
            first = n * s + per - 1
            end = min((n + 1) * s, limit // h)
            if self.keyed_partial_hits:
                # vLLM probes the block's hit points from the top for a key (a prompt tail's
                # partial entry): the units a full block holds are not keys of their own
                i = first + (end - 1 - first) // per * per
                while i >= first:
                    if self.lookup(hashes[i]) is not None:
                        return (i + 1) * h
                    i -= per
                return hit
            holder, i = self.index.holder, first
            while i < end and holder(self.group_id, hashes[i]) is not None:
                hit = (i + 1) * h
                i += per
        return hit

    def leading_null_blocks(self, hit: int, full: int) -> int:
        """Blocks before the first one a request admitted at ``hit`` reads (none here)."""
        return 0

    def admit(self, r: Request, hit: int, adm: Admission) -> None:
        gid, B, s = self.group_id, self.block_size, self.units_per_block
        full = hit // B
        first = self.leading_null_blocks(hit, full)
        r.lead[gid] = first
        hashes = r.hashes
        ids = [0] * first
        ids += [self.lookup(hashes[(j + 1) * s - 1]) for j in range(first, full)]
        r.blocks[gid] = ids  # type: ignore[assignment]
        r.ncached[gid] = full
        held = [b for b in ids if b]
        if full * B < hit:
            # the hit ends inside a block: copy its first tokens into a new block
            src = self.index.holder(gid, hashes[hit // self.h - 1])
            assert src is not None
            adm.kv_sources[gid] = (src, hit - full * B)
            held.append(src)
            adm.needs[gid] = 1
        adm.touch[gid] = held

    def blocks_needed(self, r: Request, total: int) -> int:
        return -(-total // self.block_size) - len(r.blocks[self.group_id])

    def fast_path_limit(self, r: Request, caching: bool) -> tuple[int, int]:
        gid, B = self.group_id, self.block_size
        return len(r.blocks[gid]) * B + 1, (r.ncached[gid] + 1) * B if caching else INF

    # ---- the commit -------------------------------------------------------------------------
    def cache_computed(self, r: Request, known: int, promote: bool) -> None:
        """Cache ``r``'s full blocks among its first ``known`` tokens (their KV is computed).
        ``promote``: a block cached as the prompt's partial tail grows into a full entry once
        it fills (vLLM's partial -> full promotion in ``BlockPool.cache_full_blocks``)."""
        gid, B, s = self.group_id, self.block_size, self.units_per_block
        full = known // B
        i0 = r.ncached[gid]
        if full <= i0:
            return
        blocks, ids, index, hashes = r.blocks[gid], self.ids, self.index, r.hashes
        for i in range(i0, full):
            bid = blocks[i]
            if not bid:
                continue
            key = (gid, hashes[(i + 1) * s - 1])
            if ids.cache(bid, key):
                index.add(key, bid, i * s, hashes, s, r.tokens, r.lora_id, False)
            elif promote and ids.key_of(bid) is not None:
                ids.uncache(bid)
                if ids.cache(bid, key):
                    index.add(key, bid, i * s, hashes, s, r.tokens, r.lora_id, False)
        r.ncached[gid] = full

    def cache_tail(self, r: Request, P: int) -> None:
        """Cache the partly filled block holding token ``P - 1`` (``P``: where a state was
        kept) as a *partial* entry covering its units up to ``P``; a full block was cached at
        its commit. Its first tokens are final, so a later hit at ``P`` copies them into a new
        block (``kv_copies``)."""
        gid, B = self.group_id, self.block_size
        blocks = r.blocks[gid]
        j = (P - 1) // B
        if P % B == 0 or j >= len(blocks) or not blocks[j] or P // self.h > len(r.hashes):
            return  # (no hash at P: its lookahead tokens are not known)
        s, h = self.units_per_block, self.h
        key = (gid, r.hashes[P // h - 1])
        if self.ids.cache(blocks[j], key):
            self.index.add(
                key, blocks[j], j * s, r.hashes, P // h - j * s, r.tokens, r.lora_id, False
            )
