"""The hybrid allocator: one block list per KV cache group, prefix caching across all groups.

- Attention groups grow with the tokens computed (``cdiv(tokens, block_size)`` blocks);
  sliding-window groups release blocks that fell wholly out of the window (replaced by the null
  block 0); state groups hold ``state_slots_per_seq`` blocks for the whole request.
- Prefix caching hashes tokens at ``hash_block_size`` granularity; a block is cached under the
  hash of its last unit once all its tokens are computed. A state group can resume only from a
  cached **checkpoint** exactly at the hit length: policy ``align`` takes one at every block
  boundary a request lands on (vLLM's align mode), ``last`` only at the last block boundary of the
  prompt (what the next turn of a chat can reuse).
- On a hit the cached attention blocks are shared (reference counted) and each state group gets
  a fresh running block plus a copy ``(checkpoint -> running)`` for the engine to run with the
  state-copy kernel; taking a checkpoint likewise yields ``(running -> checkpoint)``.
- Allocation is all-or-nothing across groups: ``allocate_slots`` returns False and changes
  nothing when a pool runs out, so the scheduler can preempt.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..plan import MemoryPlan
from .errors import (
    DoubleFree,
    DuplicateRequest,
    MaxLengthExceeded,
    PoolExhausted,
    UnknownRequest,
)
from .events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    make_batch,
)
from .hashing import NONE_HASH, chain_hashes, hash_unit
from .pool import BlockPool, TwoLevelPool

POLICIES = ("align", "last")


class _GroupPool:
    """The operations a group needs, whatever the plan's pool kind."""

    def __init__(self, pool: BlockPool | TwoLevelPool, group: int):
        self.two_level = pool if isinstance(pool, TwoLevelPool) else None
        self.pool = pool.pools[group] if isinstance(pool, TwoLevelPool) else pool
        self.group = group

    def allocate(self, n: int) -> list[int]:
        if self.two_level is not None:
            return self.two_level.allocate(self.group, n)
        return self.pool.allocate(n)


@dataclass
class HitInfo:
    """What ``add_request`` found: tokens whose KV and state are reused, and the state copies
    ``(group_id, src_block, dst_block)`` the engine must run before computing the request."""

    num_cached_tokens: int
    state_copies: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class _Request:
    tokens: list[int]
    prompt_len: int
    extra_keys: tuple
    blocks: list[list[int]]
    num_computed: int = 0
    hashes: list[bytes] = field(default_factory=list)
    cached_upto: list[int] = field(default_factory=list)  # per group: blocks already cached
    room: int = 0  # tokens the request's attention blocks hold


class HybridAllocator:
    """Block bookkeeping for one memory plan (see the module docstring)."""

    def __init__(
        self,
        plan: MemoryPlan,
        *,
        enable_prefix_caching: bool = True,
        hash_block_size: int = 16,
        checkpoint_policy: str = "align",
        max_model_len: int = 1 << 20,
    ):
        if checkpoint_policy not in POLICIES:
            raise ValueError(
                f"checkpoint_policy must be one of {POLICIES}, got {checkpoint_policy!r}"
            )
        for g in plan.groups:
            if g.block_size % hash_block_size:
                raise ValueError(
                    f"group {g.group_id} has block size {g.block_size}, not a multiple of "
                    f"hash_block_size={hash_block_size}; use a divisor such as 16"
                )
        self.plan = plan
        self.caching = enable_prefix_caching
        self.hbs = hash_block_size
        self.policy = checkpoint_policy
        self.max_model_len = max_model_len
        self.slots_per_seq = plan.config.state_slots_per_seq
        self._events: list[KVCacheEvent] = []
        self._pending_copies: list[tuple[int, int, int]] = []
        self._units: dict[tuple[int, int], tuple[list[bytes], bytes | None, list[int]]] = {}
        pools: dict[str, BlockPool | TwoLevelPool] = {}
        for p in plan.pools:
            if p.kind == "two_level":
                first = next(g.group_id for g in plan.groups if not g.is_state)
                pools[p.name] = TwoLevelPool(
                    p.name, p.num_blocks, dict(p.ids_per_large_page), first, self._on_evict
                )
            else:
                pools[p.name] = BlockPool(p.name, range(1, p.num_blocks), self._on_evict)
        self.pools = pools
        self.group_pools = [_GroupPool(pools[g.pool], g.group_id) for g in plan.groups]
        self._attn = [(g, gp) for g, gp in zip(plan.groups, self.group_pools) if not g.is_state]
        self.requests: dict[Hashable, _Request] = {}
        self._freed: set[Hashable] = set()

    # ---- events --------------------------------------------------------------------------
    def _on_evict(self, group: int, block: int, block_hash: bytes) -> None:
        units, _, _ = self._units.pop((group, block))
        self._events.append(BlockRemoved(block_hashes=units, group_idx=group))

    def take_events(self) -> KVEventBatch:
        """The events since the last call, as one batch."""
        batch, self._events = make_batch(self._events), []
        return batch

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self, req_id: Hashable, prompt_token_ids: Sequence[int], extra_keys: tuple = ()
    ) -> HitInfo:
        """Register a request, reuse its longest cached prefix, and give it its state blocks.

        Raises :class:`PoolExhausted` (nothing changed) when the state blocks do not fit.
        """
        if req_id in self.requests:
            raise DuplicateRequest(req_id)
        if len(prompt_token_ids) > self.max_model_len:
            raise MaxLengthExceeded(req_id, len(prompt_token_ids), self.max_model_len)
        if not len(prompt_token_ids):
            raise ValueError(f"request {req_id!r} has an empty prompt")
        tokens = list(prompt_token_ids)
        req = _Request(
            tokens,
            len(tokens),
            tuple(extra_keys),
            [[] for _ in self.plan.groups],
            cached_upto=[0] * len(self.plan.groups),
        )
        req.hashes = chain_hashes(tokens, self.hbs, req.extra_keys) if self.caching else []
        hit, hit_blocks = self._longest_hit(req)
        copies: list[tuple[int, int, int]] = []
        taken: list[tuple[_GroupPool, list[int]]] = []
        try:
            for g, gp in zip(self.plan.groups, self.group_pools):
                if g.is_state:
                    blocks = gp.allocate(self.slots_per_seq)
                    taken.append((gp, blocks))
                    req.blocks[g.group_id] = blocks
                    if hit:
                        copies.append((g.group_id, hit_blocks[g.group_id][0], blocks[0]))
        except PoolExhausted:
            for gp, blocks in taken:
                gp.pool.free(blocks)
            raise
        for g, gp in zip(self.plan.groups, self.group_pools):
            if not g.is_state and hit:
                for b in hit_blocks[g.group_id]:
                    gp.pool.touch(b)
                req.blocks[g.group_id] = list(hit_blocks[g.group_id])
                req.cached_upto[g.group_id] = len(hit_blocks[g.group_id])
        req.num_computed = hit
        req.room = min(
            (len(req.blocks[g.group_id]) * g.block_size for g, _ in self._attn), default=1 << 62
        )
        self.requests[req_id] = req
        self._freed.discard(req_id)
        return HitInfo(hit, copies)

    def _longest_hit(self, req: _Request) -> tuple[int, dict[int, list[int]]]:
        if not self.caching:
            return 0, {}
        limit = len(req.tokens) - 1  # the last prompt token is always computed
        hit = limit
        found: dict[int, list[int]] = {}
        for g, gp in zip(self.plan.groups, self.group_pools):
            if g.is_state:
                continue
            scale = g.block_size // self.hbs
            blocks = []
            for j in range(hit // g.block_size):
                b = gp.pool.lookup(g.group_id, req.hashes[(j + 1) * scale - 1])
                if b is None:
                    break
                blocks.append(b)
            found[g.group_id] = blocks
            hit = min(hit, len(blocks) * g.block_size)
        # state groups need a checkpoint exactly at the hit; attention hits are downward closed
        state_groups = [g for g in self.plan.groups if g.is_state]
        step = math.lcm(*(g.block_size for g in self.plan.groups))
        hit = hit // step * step
        while hit > 0 and state_groups:
            unit = hit // self.hbs - 1
            ckpts = [
                self.group_pools[g.group_id].pool.lookup(g.group_id, req.hashes[unit])
                for g in state_groups
            ]
            if all(c is not None for c in ckpts):
                for g, c in zip(state_groups, ckpts):
                    found[g.group_id] = [c]
                break
            hit -= step
        for g in self.plan.groups:
            if not g.is_state:
                found[g.group_id] = found.get(g.group_id, [])[: hit // g.block_size]
        return hit, found

    def append_tokens(self, req_id: Hashable, token_ids: Sequence[int]) -> None:
        """Record generated tokens (their KV is allocated by the next ``allocate_slots``)."""
        req = self._get(req_id)
        if len(req.tokens) + len(token_ids) > self.max_model_len:
            raise MaxLengthExceeded(req_id, len(req.tokens) + len(token_ids), self.max_model_len)
        req.tokens.extend(token_ids)
        if self.caching:
            parent = req.hashes[-1] if req.hashes else NONE_HASH
            for i in range(len(req.hashes), len(req.tokens) // self.hbs):
                parent = hash_unit(
                    parent, req.tokens[i * self.hbs : (i + 1) * self.hbs], req.extra_keys
                )
                req.hashes.append(parent)

    def allocate_slots(self, req_id: Hashable, num_new_tokens: int) -> bool:
        """Blocks for the next ``num_new_tokens`` known tokens of the request, in every group.

        Returns False, changing nothing, when a pool is exhausted (preempt and retry). After
        True the tokens count as computed: full blocks are cached and checkpoints taken; the
        state copies to run are returned by :meth:`take_state_copies`.
        """
        req = self._get(req_id)
        target = req.num_computed + num_new_tokens
        if target > len(req.tokens):
            raise ValueError(
                f"request {req_id!r} knows {len(req.tokens)} tokens, cannot compute up to "
                f"{target}; append_tokens first"
            )
        if target <= req.room and target // self.hbs == req.num_computed // self.hbs:
            # decode fast path: no new block, no newly full hash unit, so nothing to cache,
            # checkpoint or release
            req.num_computed = target
            return True
        taken: list[tuple[_GroupPool, list[int]]] = []
        try:
            for g, gp in self._attn:
                need = -(-target // g.block_size) - len(req.blocks[g.group_id])
                if need > 0:
                    taken.append((gp, gp.allocate(need)))
        except PoolExhausted:
            for gp, blocks in reversed(taken):
                gp.pool.free(blocks)
            return False
        for gp, blocks in taken:
            req.blocks[gp.group].extend(blocks)
        req.num_computed = target
        req.room = min(
            (len(req.blocks[g.group_id]) * g.block_size for g, _ in self._attn), default=1 << 62
        )
        self._release_out_of_window(req)
        if self.caching:
            self._cache_full_blocks(req)
            self._checkpoint(req)
        return True

    def _release_out_of_window(self, req: _Request) -> None:
        for g, gp in zip(self.plan.groups, self.group_pools):
            if g.sliding_window is None:
                continue
            # keep the blocks holding the last `window - 1` computed tokens
            first_needed = max(0, req.num_computed - g.sliding_window + 1) // g.block_size
            blocks = req.blocks[g.group_id]
            for j in range(min(first_needed, len(blocks))):
                if blocks[j] != 0:
                    gp.pool.free([blocks[j]])
                    blocks[j] = 0

    def _cache_full_blocks(self, req: _Request) -> None:
        for g, gp in zip(self.plan.groups, self.group_pools):
            if g.is_state:
                continue
            scale = g.block_size // self.hbs
            blocks = req.blocks[g.group_id]
            full = min(req.num_computed, len(req.hashes) * self.hbs) // g.block_size
            for j in range(req.cached_upto[g.group_id], full):
                if blocks[j] != 0:
                    self._store(g.group_id, gp, blocks[j], req, j * scale, (j + 1) * scale)
            req.cached_upto[g.group_id] = max(req.cached_upto[g.group_id], full)

    def _store(self, group: int, gp: _GroupPool, block: int, req: _Request, u0: int, u1: int):
        if gp.pool.cache(group, block, req.hashes[u1 - 1]):
            units = req.hashes[u0:u1]
            parent = req.hashes[u0 - 1] if u0 else None
            tokens = req.tokens[u0 * self.hbs : u1 * self.hbs]
            self._units[(group, block)] = (units, parent, tokens)
            self._events.append(
                BlockStored(
                    block_hashes=units,
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=self.hbs,
                    group_idx=group,
                )
            )

    def _checkpoint(self, req: _Request) -> None:
        n = req.num_computed
        for g, gp in zip(self.plan.groups, self.group_pools):
            if not g.is_state or n % g.block_size or n // self.hbs > len(req.hashes):
                continue
            if self.policy == "last" and n != req.prompt_len // g.block_size * g.block_size:
                continue
            if gp.pool.lookup(g.group_id, req.hashes[n // self.hbs - 1]) is not None:
                continue
            try:
                (ckpt,) = gp.allocate(1)
            except PoolExhausted:
                continue  # a checkpoint is an optimisation: skip it when memory is short
            self._pending_copies.append((g.group_id, req.blocks[g.group_id][0], ckpt))
            scale = g.block_size // self.hbs
            self._store(g.group_id, gp, ckpt, req, n // self.hbs - scale, n // self.hbs)
            gp.pool.free([ckpt])  # cached and free: reusable until evicted

    def take_state_copies(self) -> list[tuple[int, int, int]]:
        """Checkpoint copies ``(group, running_block, checkpoint_block)`` taken since the last
        call; run them before the next allocation can evict the checkpoints."""
        out, self._pending_copies = self._pending_copies, []
        return out

    def free(self, req_id: Hashable) -> None:
        """Release a finished or preempted request; its cached blocks stay reusable."""
        if req_id not in self.requests:
            if req_id in self._freed:
                raise DoubleFree(req_id)
            raise UnknownRequest(req_id)
        req = self.requests.pop(req_id)
        self._freed.add(req_id)
        for gp, blocks in zip(self.group_pools, req.blocks):
            gp.pool.free([b for b in reversed(blocks) if b != 0])

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; only allowed with no running request."""
        if self.requests:
            return False
        for pool in self.pools.values():
            subpools = pool.pools.values() if isinstance(pool, TwoLevelPool) else [pool]
            for p in subpools:
                for block in p.free_cached_blocks():
                    del p._free_cached[block]
                    key = p.hash_of.pop(block)
                    del p.cached[key]
                    self._units.pop((key[0], block), None)
                    p._free_plain.append(block)
        self._events.append(AllBlocksCleared())
        return True

    # ---- views -----------------------------------------------------------------------------
    def _get(self, req_id: Hashable) -> _Request:
        try:
            return self.requests[req_id]
        except KeyError:
            if req_id in self._freed:
                raise DoubleFree(req_id) from None
            raise UnknownRequest(req_id) from None

    def block_ids(self, req_id: Hashable) -> list[list[int]]:
        return [list(b) for b in self._get(req_id).blocks]

    def num_computed(self, req_id: Hashable) -> int:
        return self._get(req_id).num_computed

    def block_tables(self, req_ids: Sequence[Hashable]) -> list[torch.Tensor]:
        """Per group, an int32 ``[len(req_ids), max_blocks]`` table padded with the null block."""
        reqs = [self._get(r) for r in req_ids]
        tables = []
        for g in self.plan.groups:
            rows = [r.blocks[g.group_id] for r in reqs]
            width = max(1, max(map(len, rows), default=0))
            t = np.zeros((len(rows), width), dtype=np.int32)
            for i, row in enumerate(rows):
                t[i, : len(row)] = row
            tables.append(torch.from_numpy(t))
        return tables

    def cached_keys(self) -> set[tuple[int, bytes]]:
        """Every cached (group, hash unit): what an event subscriber should have rebuilt."""
        return {(g, u) for (g, _), (units, _, _) in self._units.items() for u in units}

    def check(self) -> None:
        """Assert the pools' invariants (used by the tests)."""
        expected: dict[tuple[str, int], int] = {}
        for req in self.requests.values():
            for g, blocks in zip(self.plan.groups, req.blocks):
                for b in blocks:
                    if b:
                        key = (self.group_pools[g.group_id].pool.name, b)
                        expected[key] = expected.get(key, 0) + 1
        seen_pools = {id(gp.pool): gp.pool for gp in self.group_pools}
        actual = {(p.name, b): c for p in seen_pools.values() for b, c in p.ref.items()}
        assert actual == expected, "reference counts disagree with the requests' block lists"
        for p in seen_pools.values():
            free = set(p._free_plain) | set(p._free_cached)
            assert len(free) == len(p._free_plain) + len(p._free_cached), "block free twice"
            assert not free & set(p.ref), "a block is both free and in use"
            assert len(free) + len(p.ref) == p.capacity, "blocks leaked"
            for key, b in p.cached.items():
                assert p.hash_of[b] == key, "cached hash does not resolve to its block"
            assert set(p._free_cached) <= set(p.hash_of), "uncached block in the cached queue"
        for pool in self.pools.values():
            if isinstance(pool, TwoLevelPool):
                owned = [pg for g in pool._pages.values() for pg in g]
                assert len(owned) == len(set(owned)), "a large page has two owners"
                assert not set(owned) & set(pool.free_pages), "a large page owned and free"
                assert len(owned) + len(pool.free_pages) == pool.num_pages
