"""``HybridAllocator``: per-request block tables over a ``MemoryPlan``'s pools, with prefix
caching across attention and state groups (vLLM's KVCacheManager + HybridKVCacheCoordinator)."""

from __future__ import annotations

import functools
import math
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..plan import MemoryPlan
from .block_pool import BlockPool, TwoLevelPool
from .errors import DoubleFree, MaxLengthExceeded, PoolExhausted, UnknownRequest
from .events import BlockRemoved, BlockStored, KVEventBatch
from .hashing import extend_hashes

ATTENTION_KINDS = ("full_attention", "mla")


@dataclass
class HitInfo:
    """Result of ``add_request``: cached prefix length and state copies (group, src, dst) the
    runner must do before computing the rest (checkpoint -> running slot)."""

    num_cached_tokens: int
    state_copies: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class _Request:
    req_id: Any
    tokens: list[int]
    extra_keys: Any
    unit_hashes: list[bytes]
    blocks: list[list[int]]  # per group; a state group holds its running slots
    num_alloc: int = 0  # tokens that have slots
    num_cached_blocks: list[int] = field(default_factory=list)  # per group, blocks hashed
    held: list[tuple[int, int]] = field(default_factory=list)  # (gid, id) extra refs (hits)
    ckpt: dict[int, tuple[int, int]] = field(default_factory=dict)  # gid -> (L, id) held
    mark: tuple[int, int] = (-1, -1)  # (known, allocated) // grain at the last cache pass


class HybridAllocator:
    def __init__(
        self,
        plan: MemoryPlan,
        *,
        enable_prefix_caching: bool = True,
        hash_block_size: int = 16,
        checkpoint_policy: Literal["align", "last"] = "align",
        max_model_len: int = 32768,
    ) -> None:
        if checkpoint_policy not in ("align", "last"):
            raise ValueError(
                f"checkpoint_policy must be 'align' or 'last', got {checkpoint_policy!r}"
            )
        self.plan = plan
        self.groups = plan.groups
        self.caching = enable_prefix_caching
        self.h = hash_block_size
        self.policy = checkpoint_policy
        self.max_model_len = max_model_len
        self.slots_per_seq = plan.config.state_slots_per_seq
        for g in self.groups:
            if g.block_size % hash_block_size:
                raise ValueError(
                    f"group {g.group_id} block_size {g.block_size} is not a multiple of "
                    f"hash_block_size {hash_block_size}; pick a divisor of every block size"
                )
        self._events: list[Any] = []
        self._copies: list[tuple[int, int, int]] = []  # checkpoint copies not yet taken
        self._stored_units: dict[tuple[int, bytes], list[bytes]] = {}
        # Per group: the object to allocate from, and a key naming the capacity it shares.
        self.pool: dict[int, Any] = {}
        self._capacity_key: dict[int, str] = {}
        self._pools: dict[str, Any] = {}
        for p in plan.pools:
            if p.kind == "shared":
                bp = BlockPool(p.num_blocks, p.name, self._on_evict)
                self._pools[p.name] = bp
                for gid in p.groups:
                    self.pool[gid], self._capacity_key[gid] = bp, p.name
            elif p.kind == "per_group":
                for gid in p.groups:
                    name = f"{p.name}/g{gid}" if len(p.groups) > 1 else p.name
                    bp = BlockPool(p.num_ids(gid), name, self._on_evict)
                    self._pools[name] = bp
                    self.pool[gid], self._capacity_key[gid] = bp, name
            elif p.kind == "two_level":
                attn = [g for g in p.groups if not self.groups[g].is_state]
                first = attn[0] if attn else p.groups[0]
                tl = TwoLevelPool(
                    p.num_blocks,
                    {g: p.ids_per_page(g) for g in p.groups},
                    first,
                    p.name,
                    self._on_evict,
                )
                self._pools[p.name] = tl
                for gid in p.groups:
                    self.pool[gid], self._capacity_key[gid] = tl.view(gid), p.name
            else:
                raise ValueError(f"unknown pool kind {p.kind!r}")
        self.reqs: dict[Any, _Request] = {}
        self._freed: set[Any] = set()
        # Decode fast paths: block-table growth only concerns attention groups, and cache work
        # only happens when a token count crosses a multiple of the gcd of all block sizes.
        self._attn = [(g.group_id, g.block_size) for g in self.groups if not g.is_state]
        self._grain = functools.reduce(math.gcd, (g.block_size for g in self.groups))
        self._version = 0  # bumps on add/free; state tables only change then
        self._state_tables: tuple[Any, int, dict[int, torch.Tensor]] | None = None

    # ---- events -----------------------------------------------------------------------------
    def _on_evict(self, key: tuple[int, bytes]) -> None:
        units = self._stored_units.pop(key)
        self._events.append(BlockRemoved(block_hashes=units, group_idx=key[0]))

    def take_events(self) -> KVEventBatch:
        batch = KVEventBatch(ts=time.time(), events=self._events)
        self._events = []
        return batch

    def cached_hashes(self) -> set[tuple[int, bytes]]:
        """(group, hash-unit hash) pairs currently cached, at hash granularity."""
        return {(k[0], u) for k, units in self._stored_units.items() for u in units}

    def _cache_block(self, r: _Request, gid: int, i: int, bid: int) -> None:
        """Cache block ``i`` of ``gid`` (held in ``bid``); emit one BlockStored per new block."""
        B = self.groups[gid].block_size
        s = B // self.h
        key = (gid, r.unit_hashes[(i + 1) * s - 1])
        if not self.pool[gid].cache(bid, key):
            return  # already cached elsewhere: no duplicate entry, no duplicate event
        units = r.unit_hashes[i * s : (i + 1) * s]
        self._stored_units[key] = units
        parent = r.unit_hashes[i * s - 1] if i else None
        self._events.append(
            BlockStored(
                block_hashes=list(units),
                parent_block_hash=parent,
                token_ids=list(r.tokens[i * B : (i + 1) * B]),
                block_size=self.h,
                group_idx=gid,
            )
        )

    # ---- lookup -----------------------------------------------------------------------------
    def _key(self, gid: int, hashes: list[bytes], length: int) -> tuple[int, bytes]:
        return (gid, hashes[length // self.h - 1])

    def _group_hit(self, gid: int, hashes: list[bytes], limit: int) -> int:
        """Longest hit length <= ``limit`` that group ``gid`` alone can serve."""
        g = self.groups[gid]
        B, pool = g.block_size, self.pool[gid]
        if g.is_state:
            # Resume only from a checkpoint exactly at the hit length.
            for L in range(limit // B * B, 0, -B):
                if pool.lookup(self._key(gid, hashes, L)) is not None:
                    return L
            return 0
        if g.kind == "sliding_window" and g.sliding_window:
            W = g.sliding_window
            for L in range(limit // B * B, 0, -B):
                first = max(0, L - W + 1) // B
                if all(
                    pool.lookup(self._key(gid, hashes, (j + 1) * B)) is not None
                    for j in range(first, L // B)
                ):
                    return L
            return 0
        n = 0  # full attention: hits are prefixes of full blocks
        while (n + 1) * B <= limit and pool.lookup(
            self._key(gid, hashes, (n + 1) * B)
        ) is not None:
            n += 1
        return n * B

    def find_longest_cache_hit(self, hashes: list[bytes], max_len: int) -> int:
        """Fixed point over groups: every group shrinks the candidate until none does."""
        curr = max_len
        while True:
            prev = curr
            for g in self.groups:
                curr = self._group_hit(g.group_id, hashes, curr)
            if curr == prev:
                return curr

    # ---- capacity ---------------------------------------------------------------------------
    def _can_allocate(self, needs: dict[int, int]) -> bool:
        by_pool: dict[str, dict[int, int]] = {}
        for gid, n in needs.items():
            if n > 0:
                by_pool.setdefault(self._capacity_key[gid], {})[gid] = n
        for name, gneeds in by_pool.items():
            p = self._pools[name]
            if isinstance(p, TwoLevelPool):
                if not p.can_allocate(gneeds):
                    return False
            elif not p.can_allocate(sum(gneeds.values())):
                return False
        return True

    def _get(self, req_id: Any) -> _Request:
        r = self.reqs.get(req_id)
        if r is None:
            if req_id in self._freed:
                raise DoubleFree(f"request {req_id!r}")
            raise UnknownRequest(req_id)
        return r

    # ---- API --------------------------------------------------------------------------------
    def add_request(
        self, req_id: Any, prompt_token_ids: list[int], extra_keys: Any = None
    ) -> HitInfo:
        """Register a request, take its prefix hit and its running state slots.

        Raises ``PoolExhausted`` (changing nothing) when the state slots do not fit."""
        if req_id in self.reqs:
            raise ValueError(f"request {req_id!r} already added; free it before reusing the id")
        if len(prompt_token_ids) > self.max_model_len:
            raise MaxLengthExceeded(req_id, len(prompt_token_ids), self.max_model_len)
        tokens = list(prompt_token_ids)
        hashes = extend_hashes([], tokens, self.h, extra_keys) if self.caching else []
        G = len(self.groups)
        r = _Request(req_id, tokens, extra_keys, hashes, [[] for _ in range(G)], 0, [0] * G)
        L = self.find_longest_cache_hit(hashes, len(tokens) - 1) if self.caching and tokens else 0
        touched: list[tuple[int, int]] = []
        copies: list[tuple[int, int, int]] = []
        for g in self.groups:
            gid, B, pool = g.group_id, g.block_size, self.pool[g.group_id]
            if g.is_state:
                if L:
                    src = pool.lookup(self._key(gid, hashes, L))
                    pool.touch([src])
                    touched.append((gid, src))
                    r.held.append((gid, src))
                continue
            first = max(0, L - g.sliding_window + 1) // B if g.kind == "sliding_window" else 0
            ids = [0] * first + [
                pool.lookup(self._key(gid, hashes, (j + 1) * B)) for j in range(first, L // B)
            ]
            pool.touch(ids)
            touched.extend((gid, b) for b in ids if b)
            r.blocks[gid] = ids
            r.num_cached_blocks[gid] = L // B
        state = {g.group_id: self.slots_per_seq for g in self.groups if g.is_state}
        if not self._can_allocate(state):
            for gid, b in reversed(touched):
                self.pool[gid].free([b])
            raise PoolExhausted(
                ",".join(sorted({self._capacity_key[g] for g in state})), sum(state.values()), 0
            )
        for gid, n in state.items():
            r.blocks[gid] = self.pool[gid].allocate(n)
            if L:
                copies.append(
                    (gid, r.held[[h[0] for h in r.held].index(gid)][1], r.blocks[gid][0])
                )
                r.ckpt[gid] = (L, -1)
        r.num_alloc = L
        self.reqs[req_id] = r
        self._version += 1
        self._freed.discard(req_id)
        return HitInfo(L, copies)

    def allocate_slots(self, req_id: Any, num_new_tokens: int) -> bool:
        """Give slots for ``num_new_tokens`` more tokens in every group, atomically.

        False means the pools are exhausted and nothing changed: preempt someone and retry."""
        r = self._get(req_id)
        total = r.num_alloc + num_new_tokens
        if total > self.max_model_len:
            raise MaxLengthExceeded(req_id, total, self.max_model_len)
        needs: dict[int, int] = {}
        for gid, B in self._attn:
            n = -(-total // B) - len(r.blocks[gid])
            if n > 0:
                needs[gid] = n
        if needs and not self._can_allocate(needs):
            return False
        for g in self.groups:
            if g.kind == "sliding_window" and g.sliding_window:
                self._free_outside_window(r, g.group_id, r.num_alloc - g.sliding_window + 1)
        done: list[tuple[int, list[int]]] = []
        try:
            for gid, n in needs.items():
                if n > 0:
                    ids = self.pool[gid].allocate(n)
                    done.append((gid, ids))
        except PoolExhausted:  # only possible in a two-level pool with awkward fragmentation
            for gid, ids in reversed(done):
                self.pool[gid].free(reversed(ids))
            return False
        for gid, ids in done:
            r.blocks[gid].extend(ids)
        r.num_alloc = total
        self._cache_new(r)
        return True

    def _free_outside_window(self, r: _Request, gid: int, first_needed: int) -> None:
        """Blocks ending before the window's first token are freed and become null."""
        blocks = r.blocks[gid]
        B = self.groups[gid].block_size
        for i in range(min(max(0, first_needed) // B, len(blocks)) - 1, -1, -1):
            if blocks[i] == 0:
                break  # everything before is already null
            self.pool[gid].free([blocks[i]])
            blocks[i] = 0

    def append_tokens(self, req_id: Any, token_ids: list[int]) -> list[tuple[int, int, int]]:
        """Record generated tokens; cache newly full blocks; return state checkpoint copies."""
        r = self._get(req_id)
        r.tokens.extend(token_ids)
        return self._cache_new(r)

    def _cache_new(self, r: _Request) -> list[tuple[int, int, int]]:
        if not self.caching:
            return []
        known = min(len(r.tokens), r.num_alloc)
        mark = (known // self._grain, r.num_alloc // self._grain)
        if mark == r.mark:
            return []  # no block boundary crossed since the last pass: nothing to cache
        r.mark = mark
        if len(r.unit_hashes) < known // self.h:
            extend_hashes(r.unit_hashes, r.tokens[:known], self.h, r.extra_keys)
        copies: list[tuple[int, int, int]] = []
        for g in self.groups:
            gid, B = g.group_id, g.block_size
            full = known // B
            if g.is_state:
                # align: the running state after this step sits exactly at a block boundary.
                if self.policy == "align" and full and r.num_alloc == full * B:
                    copy = self._checkpoint(r, gid, full * B)
                    if copy:
                        copies.append(copy)
                        self._copies.append(copy)
                continue
            blocks = r.blocks[gid]
            for i in range(r.num_cached_blocks[gid], full):
                if blocks[i]:
                    self._cache_block(r, gid, i, blocks[i])
            r.num_cached_blocks[gid] = max(r.num_cached_blocks[gid], full)
        return copies

    def _checkpoint(self, r: _Request, gid: int, L: int) -> tuple[int, int, int] | None:
        prev = r.ckpt.get(gid)
        if prev is not None and prev[0] >= L:
            return None
        pool = self.pool[gid]
        key = self._key(gid, r.unit_hashes, L)
        if pool.lookup(key) is not None or not self._can_allocate({gid: 1}):
            return None  # already cached, or no room: checkpoints are best effort
        (cid,) = pool.allocate(1)
        self._cache_block(r, gid, L // self.groups[gid].block_size - 1, cid)
        # The checkpoint goes straight to the LRU (cached, ref 0): a state pool may hold only
        # max_num_seqs running slots, so checkpoints must never block a running request.
        # The runner performs the copies from take_state_copies() before the next allocation.
        pool.free([cid])
        r.ckpt[gid] = (L, -1)
        return (gid, r.blocks[gid][0], cid)

    def take_state_copies(self) -> list[tuple[int, int, int]]:
        """(group, running id, checkpoint id) copies to do after this step's forward pass."""
        out, self._copies = self._copies, []
        return out

    def free(self, req_id: Any) -> None:
        r = self._get(req_id)
        if self.caching and self.policy == "last":
            known = min(len(r.tokens), r.num_alloc)
            # The running state is exactly at ``known``: keep it as a checkpoint if that is a
            # block boundary whose hash is known.
            hashed = len(r.unit_hashes) >= known // self.h
            for g in self.groups:
                if g.is_state and known and known % g.block_size == 0 and hashed:
                    self._cache_block(
                        r, g.group_id, known // g.block_size - 1, r.blocks[g.group_id][0]
                    )
        for g in self.groups:
            # Tail first, so the tail of a freed request is evicted before its shared prefix.
            self.pool[g.group_id].free(reversed(r.blocks[g.group_id]))
            c = r.ckpt.get(g.group_id)
            if c is not None and c[1] > 0:
                self.pool[g.group_id].free([c[1]])
        for gid, b in r.held:
            self.pool[gid].free([b])
        del self.reqs[req_id]
        self._freed.add(req_id)
        self._version += 1

    def block_ids(self, req_id: Any) -> list[list[int]]:
        return [list(b) for b in self._get(req_id).blocks]

    def num_tokens(self, req_id: Any) -> int:
        return self._get(req_id).num_alloc

    def block_tables(self, req_ids: list[Any]) -> list[torch.Tensor]:
        """One int32 [len(req_ids), max_blocks] table per group, padded with the null id 0."""
        rs = [self._get(q) for q in req_ids]
        key = tuple(req_ids)
        cached = self._state_tables
        if cached is None or cached[0] != key or cached[1] != self._version:
            cached = self._state_tables = (key, self._version, {})
        out = []
        for gid in range(len(self.groups)):
            if self.groups[gid].is_state and gid in cached[2]:
                out.append(cached[2][gid].clone())  # running slots change only on add/free
                continue
            rows = [r.blocks[gid] for r in rs]
            width = max((len(x) for x in rows), default=0)
            if width and rows:
                # A flat C int array converts ~10x faster than torch.tensor(nested lists).
                buf = array("i")
                pad = [0] * width
                for x in rows:
                    buf.extend(x)
                    buf.extend(pad[: width - len(x)])
                t = torch.frombuffer(buf, dtype=torch.int32).view(len(rows), width)
            else:
                t = torch.zeros((len(rows), width), dtype=torch.int32)
            if self.groups[gid].is_state:
                cached[2][gid] = t.clone()
            out.append(t)
        return out

    def usage(self) -> dict[str, float]:
        return {name: p.usage() for name, p in self._pools.items()}
