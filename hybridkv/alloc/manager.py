"""``HybridAllocator``: block tables for every KV cache group of every request over a
``MemoryPlan``'s pools, with prefix caching across attention and state groups (vLLM's
``KVCacheManager`` + ``HybridKVCacheCoordinator``).

Engine protocol, once per scheduler step::

    hit = alloc.add_request(rid, prompt)          # new requests; raises PoolExhausted if full
    run(hit.state_copies, hit.kv_copies)          # before the forward pass that uses them
    ok = alloc.allocate_slots(rid, n)             # False: nothing changed, preempt and retry
    tables = alloc.block_tables(batch)            # int32 [batch, blocks] per group
    forward(...)
    run(alloc.take_state_copies())                # after the forward, before the next one
    alloc.append_tokens(rid, [sampled])
    alloc.free(rid)                               # finished or preempted requests

``take_state_copies()`` is the step's commit: the tokens allocated since the last one now hold
computed KV, so their full blocks become cache entries (and KV events), state checkpoints are
taken (the running state only exists after the forward pass, which is why checkpoint copies
come back here), and the cached states that hits copied from are released. Nothing computed in
a step is visible to prefix hits before this call, so a hit never reads memory still being
written. What a commit caches and which ids checkpoints take is :mod:`.commit`'s; the pools
are reached through one interface, :class:`~.block_pool.Pool` (:mod:`.pools` builds them).

A request's block list for a state group is ``[running slot, spare slots...]``: it reserves
``state_slots_per_seq`` slots, the running state in the first; spares become checkpoints, so
with 2 slots a checkpoint can always be taken even when the pool is full (vLLM's ``align`` mode
reserves 2 pages per request for the same reason). Once spent, checkpoints come from free or
evictable ids, best effort: a checkpoint never makes an allocation fail.

With the ``align`` policy, where a prefill chunk ends is part of the policy (vLLM's scheduler
cuts chunks where states are to be kept): a scheduler asks :meth:`HybridAllocator.split_prefill`
how many of the tokens it offers a request may run this step. With
``prefill_checkpoint_alignment`` set (a backend that exports states from inside a prefill), a
commit may also cache a state from inside the step: :attr:`HybridAllocator.last_exports` lists
them as ``(group, slot, position)``; the runner puts the state its forward exported after
``position`` tokens into ``slot``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..plan import MemoryPlan
from .block_pool import IdCache, Pool
from .breakdown import MemoryBreakdown, memory_breakdown
from .commit import Committer
from .errors import (
    ConfigError,
    DoubleFree,
    DuplicateRequest,
    MaxLengthExceeded,
    PoolExhausted,
    UnknownRequest,
)
from .events import AllBlocksCleared, KVEventBatch
from .hashing import encode_extra_keys, extend_unit_hashes, get_hash_fn, token_array
from .marconi import MarconiEvictor, MarconiPoolEvictor, MarconiScorer, PrefillFlops
from .policies import ALL_POLICIES, CheckpointPolicy
from .pools import build_pools
from .prefix_cache import GroupRule, PrefixIndex, longest_hit
from .request import INF as _INF
from .request import Request
from .tables import BlockTables

__all__ = ["HitInfo", "HybridAllocator"]

ATTENTION_KINDS = ("full_attention", "mla", "sliding_window")
_FREED_MEMORY = 65536  # freed request ids remembered to tell a double free from a typo


@dataclass
class HitInfo:
    """What ``add_request`` found: ``num_cached_tokens`` need no compute. Before the forward
    pass that computes the rest, the runner copies each ``state_copies`` entry
    ``(group, src slot, dst slot)`` (cached checkpoint -> the request's running slot) and each
    ``kv_copies`` entry ``(group, src block, dst block, num_tokens)`` (the first tokens of a
    partly reused attention block)."""

    num_cached_tokens: int
    state_copies: list[tuple[int, int, int]] = field(default_factory=list)
    kv_copies: list[tuple[int, int, int, int]] = field(default_factory=list)


class HybridAllocator:
    """See the module docstring. Arguments:

    - ``hash_block_size``: tokens per prefix-cache hash unit; divides every group's block size
      (vLLM's ``prefix_match_unit``; vLLM's default is the block size).
    - ``checkpoint_policy``: ``align`` (vLLM 0.33's), ``align_every_block``, ``last``,
      ``marconi``, ``periodic`` or ``hash_boundary`` (:mod:`.policies`).
    - ``checkpoint_interval`` (``periodic`` / ``hash_boundary`` only, default 512): where those
      keep states inside a prompt; a multiple of ``hash_block_size``. They are exported from
      inside the prefill (:attr:`last_exports`) when ``prefill_checkpoint_alignment`` divides
      the interval, else :meth:`next_checkpoint` asks the scheduler to end chunks there.
    - ``prefix_cache_retention_interval`` (``align`` only): vLLM's option of that name: 0 keeps
      only the replay boundary and junction states, ``R > 0`` also every multiple of ``R`` a
      step ends on, ``None`` every block boundary a step ends on.
    - ``prefill_checkpoint_alignment`` (``align`` only): the token alignment at which the state
      layers' prefill kernels export a checkpoint from inside a prefill (vLLM's
      ``MambaSpec.prefill_checkpoint_alignment``), or ``None`` when they cannot and the prefill
      is split instead (:class:`~.policies.VllmAlign`, rule 2); ``"auto"`` (default) takes it
      from the plan's vLLM target (:meth:`hybridkv.target.VllmRules.prefill_checkpoint_grid`).
    - ``partial_block_hits``: let attention hit inside a block (at hash-unit granularity) by
      copying the reused tokens into a new block; pays off where state checkpoints are finer
      than the attention block (``last``/``marconi`` with large blocks).
    - ``hash_algo``: ``sha256``, ``blake2b`` or ``builtin`` (:mod:`.hashing`).
    - ``marconi_alpha``, ``marconi_flops``: Marconi's eviction (:mod:`.marconi`): the weight of
      FLOPs saved per byte against recency (settable later, :attr:`marconi_alpha`), and the FLOP
      model (``costmodel.StepCoster(model, gpu).prefill_flops``; default: every token costs
      the same). ``eviction_window``: how many of the oldest cached ids a pool's fallback
      (when no cached state is a candidate) looks through.
    - ``evict_unreachable``: when an eviction leaves cached entries no hit can use, evict them
      too (:meth:`_settle`): the KV of a chain whose last state went, or everything after a
      KV block that went. Marconi evicts a radix-tree leaf's KV with its state for the same
      reason. ``False`` keeps them until they age out (vLLM's behaviour).
    - ``marconi_across_groups`` (``marconi`` only): in a pool whose groups have ids of their own
      (``two_level``), one evictor chooses what goes across the groups: the cached segment of
      least utility, its state and KV together (:class:`~.marconi.MarconiPoolEvictor`).
      ``False`` (an ablation) leaves it to each group's evictor, among that group's ids, and to
      the pool's reclaim of idle pages by their age.
    """

    def __init__(
        self,
        plan: MemoryPlan,
        *,
        enable_prefix_caching: bool = True,
        hash_block_size: int = 16,
        checkpoint_policy: str = "align",
        max_model_len: int = 32768,
        partial_block_hits: bool = True,
        hash_algo: str = "sha256",
        marconi_alpha: float = 1.0,
        marconi_flops: PrefillFlops | None = None,
        eviction_window: int = 32,
        prefix_cache_retention_interval: int | None = 0,
        prefill_checkpoint_alignment: int | str | None = "auto",
        checkpoint_interval: int | None = None,
        evict_unreachable: bool = True,
        marconi_across_groups: bool = True,
    ) -> None:
        if hash_block_size < 1:
            raise ConfigError(f"hash_block_size must be >= 1, got {hash_block_size}")
        for g in plan.groups:
            if g.block_size % hash_block_size:
                raise ConfigError(
                    f"group {g.group_id} block_size {g.block_size} is not a multiple of "
                    f"hash_block_size {hash_block_size}; pick a divisor of every block size"
                )
        if max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {max_model_len}")
        self.plan = plan
        self.groups = plan.groups
        self.caching = enable_prefix_caching
        self.h = hash_block_size
        self.max_model_len = max_model_len
        self.slots_per_seq = plan.config.state_slots_per_seq
        if prefill_checkpoint_alignment == "auto":
            # what the plan's vLLM target exports: Mamba-2 anywhere, Qwen's GDN under
            # FlashInfer on its grid, otherwise nothing (the prefill is split)
            prefill_checkpoint_alignment = (
                plan.vllm.prefill_checkpoint_grid(plan.state_groups[0].block_size, hash_block_size)
                if plan.vllm is not None and plan.state_groups
                else None
            )
        try:
            self.policy = CheckpointPolicy(
                checkpoint_policy,
                plan,
                hash_block_size,
                retention_interval=prefix_cache_retention_interval,
                prefill_checkpoint_alignment=prefill_checkpoint_alignment,
                checkpoint_interval=checkpoint_interval,
            )
        except ValueError as e:
            if checkpoint_policy not in ALL_POLICIES:
                raise
            raise ConfigError(str(e)) from None
        self._vllm = self.policy.vllm if plan.state_groups else None
        # exports need the start of each step: multi-token allocations take the slow path
        self._exports = bool(plan.state_groups) and (
            (self._vllm is not None and self._vllm.export is not None) or self.policy.exports_marks
        )
        # hits inside a block (vLLM's partial hash hits): attention caches the prompt's tail
        self._promote = self._vllm is not None and self._vllm.partial and partial_block_hits
        self.hash_fn = get_hash_fn(hash_algo)
        self.partial = partial_block_hits
        self.index = PrefixIndex(hash_block_size)
        self.evict_unreachable = evict_unreachable
        # evicted entries: (group, units, is a state, the unit before them)
        self._dead: list[tuple[int, list[bytes], bool, bytes | None]] = []
        self._build_pools()
        self._attn: list[tuple[int, int]] = []
        self._swa: list[tuple[int, int, int]] = []
        self._state: list[int] = []
        self._window = [0] * len(self.groups)
        for g in self.groups:
            if g.is_state:
                self._state.append(g.group_id)
            elif g.kind in ATTENTION_KINDS:
                self._attn.append((g.group_id, g.block_size))
                if g.kind == "sliding_window" and g.sliding_window:
                    self._swa.append((g.group_id, g.block_size, g.sliding_window))
                    self._window[g.group_id] = g.sliding_window
            else:
                raise ConfigError(f"group {g.group_id} has unknown kind {g.kind!r}")
        # full-attention groups: a hit needs every token before it there (cascades, demotion)
        self._full = [g for g, _ in self._attn if not self._window[g]]
        self._attn_rules, self._rules = self._hit_rules()
        # vLLM's junction is the hit of the first group of its hit search (full attention first,
        # groups of one spec looked up together)
        first = self._attn_rules[0] if self._attn_rules else None
        self._junction_rules = [
            x
            for x in self._attn_rules
            if first
            and (x.kind, x.block_size, x.window) == (first.kind, first.block_size, first.window)
        ]
        #: Marconi's eviction utility (``marconi`` only): one clock and score for every pool
        self._scorer: MarconiScorer | None = None
        if self.policy.name == "marconi":
            self._scorer = MarconiScorer(self.index, plan, self.pool, marconi_alpha, marconi_flops)
            for pool in self._pools:
                evictors = []
                for ids, gids in pool.group_views():
                    ids.evictor = MarconiEvictor(self._scorer, ids, gids)
                    ids.evictor_window = max(1, eviction_window)
                    evictors.append(ids.evictor)
                if marconi_across_groups and len(evictors) > 1:
                    # groups with ids of their own: which group gives way is Marconi's choice too
                    pool.segment_evictor = MarconiPoolEvictor(self._scorer, evictors)
        self.reqs: dict[Any, Request] = {}
        # a state group's row is its running slot and spares: a fixed width
        self.tables = BlockTables(
            len(self.groups), fixed={g: max(1, self.slots_per_seq) for g in self._state}
        )
        self._freed: OrderedDict[Any, None] = OrderedDict()
        self._dirty: dict[Any, Request] = {}  # allocated this step: commit has work
        self._sourced: dict[Any, Request] = {}  # hold hit sources until the commit
        self.num_queries = self.num_query_tokens = self.num_hit_tokens = 0
        self._commit = Committer(
            index=self.index,
            pools=self.pool,
            tables=self.tables,
            policy=self.policy,
            vllm=self._vllm,
            hash_block_size=hash_block_size,
            hash_fn=self.hash_fn,
            attn=self._attn,
            state=self._state,
            full=self._full,
            caching=self.caching,
            partial=self.partial,
            promote=self._promote,
            exports=self._exports,
            scorer=self._scorer,
        )

    @property
    def pools(self) -> tuple[Pool, ...]:
        """The pools, in plan order (a ``per_group`` plan pool: one per group)."""
        return tuple(self._pools)

    @property
    def last_exports(self) -> list[tuple[int, int, int]]:
        """States exported from inside the last committed step, ``(group, slot, position)``."""
        return self._commit.last_exports

    @property
    def num_checkpoints(self) -> int:
        """State checkpoints cached (one per position, all state groups together)."""
        return self._commit.num_checkpoints

    @property
    def num_checkpoint_ids(self) -> int:
        """The state ids those checkpoints took."""
        return self._commit.num_checkpoint_ids

    # ---- construction -----------------------------------------------------------------------
    def _build_pools(self) -> None:
        on_evict = self._evicted if self.evict_unreachable else self.index.remove
        #: the pools, in plan order (:func:`.pools.build_pools`)
        self._pools: list[Pool] = build_pools(self.plan, on_evict)
        self.pool: dict[int, IdCache] = {}  # group -> where its ids come from
        self._cap: dict[int, Pool] = {}  # group -> the capacity it shares
        for pool in self._pools:
            for gid in pool.groups:
                self.pool[gid] = pool.view(gid)
                self._cap[gid] = pool

    def _hit_rules(self) -> tuple[list[GroupRule], list[GroupRule]]:
        """Full attention first (its hits bound everything and are downward closed), then
        sliding window, then states (vLLM's order)."""
        h = self.h
        full, window, state = [], [], []
        for g in self.groups:
            step = h if self.partial else g.block_size
            if g.is_state:
                state.append(GroupRule(g.group_id, "state", g.block_size, self.policy.step))
            elif g.kind == "sliding_window" and g.sliding_window:
                window.append(
                    GroupRule(g.group_id, "window", g.block_size, step, g.sliding_window)
                )
            else:
                full.append(GroupRule(g.group_id, "full", g.block_size, step))
        return full + window, full + window + state

    # ---- unreachable entries ----------------------------------------------------------------
    def _evicted(self, key: Any, bid: int) -> None:
        """A pool evicted ``key``: update the index, and remember it for :meth:`_settle` (pools
        call this in the middle of an allocation, where no other id may change)."""
        _, _, units, is_state = self.index.entries[key]
        above = self.index.parent.get((key[0], units[0]))  # the unit before the entry
        self.index.remove(key, bid)
        self._dead.append((key[0], units, is_state, above))

    def _settle(self) -> None:
        """Evict the free cached entries that the evictions since the last call left useless.

        A hit needs, at its length ``P``, a state in every state group and the KV of every
        token before ``P`` in every full-attention group. So when a state goes, the KV between
        it and the previous state or branch of its chain serves nothing (unless a state lies
        further down the chain); when a KV block goes, nothing after it on its chain can be
        reached. Those entries would otherwise sit in the LRU, cached but useless, until they
        aged out. A request that recomputes the missing part caches it again."""
        index = self.index
        parent, entries = index.parent, index.entries
        full = self._full
        while self._dead:
            dead, self._dead = self._dead, []
            # units whose entries go, in the order found (a dict: runs must not depend on the
            # hash seed)
            doomed: dict[tuple[int, bytes], None] = {}
            for gid, units, is_state, above in dead:
                if is_state:
                    u = units[0]
                    if self._has_state(u):
                        # another state group still holds u: those states are useless alone
                        for g in self._state:
                            doomed[(g, u)] = None
                        continue
                    if not full:
                        continue
                    seg = self._dead_segment(full[0], u)
                    for g in full:
                        doomed.update(dict.fromkeys((g, x) for x in seg))
                    for g, _, _ in self._swa:
                        doomed.update(dict.fromkeys((g, x) for x in seg))
                elif gid in full:
                    gone = [u for u in units if (gid, u) not in parent]
                    if not gone:
                        continue
                    below = self._subtree(gid, gone)
                    for g in range(len(self.groups)):
                        doomed.update(dict.fromkeys((g, x) for x in below))
                    if above is not None and (gid, above) in parent:
                        # the chain above the gap served only what lay below it, perhaps
                        seg = self._dead_segment(gid, above)
                        for g in full:
                            doomed.update(dict.fromkeys((g, x) for x in seg))
                        for g, _, _ in self._swa:
                            doomed.update(dict.fromkeys((g, x) for x in seg))
            for g, x in doomed:
                key = (g, x)
                info = entries.get(key)
                if info is None:
                    continue
                if not info[3] and any(
                    (g, y) not in doomed and len(index.holders[(g, y)]) == 1 for y in info[2]
                ):
                    continue  # the block's first tokens still serve a hit inside it
                self.pool[g].drop_cached(info[0])

    def _has_state(self, unit: bytes) -> bool:
        """Some state group caches a checkpoint at ``unit`` (the index counts them: asking
        each of 36 state groups' pools made evictions under periodic checkpoints crawl)."""
        return unit in self.index.state_units

    def _subtree(
        self,
        gid: int,
        roots: list[bytes],
        limit: int = 1 << 20,
        stop: Callable[[bytes], bool] | None = None,
    ) -> list[bytes] | None:
        """``roots`` and every unit cached after them in ``gid``; None as soon as a unit
        satisfies ``stop`` (the walk gives up there instead of collecting the rest)."""
        out, stack = [], list(roots)
        children = self.index.children
        while stack and len(out) < limit:
            x = stack.pop()
            if stop is not None and stop(x):
                return None
            out.append(x)
            kids = children.get((gid, x))
            if kids:
                stack.extend(kids)
        return out

    def _dead_segment(self, gid: int, u: bytes) -> list[bytes]:
        """The units of ``gid`` that no state serves once the state at ``u`` is gone: nothing
        if a state lies below ``u``; else ``u``'s subtree and the chain above it up to the
        previous state or branch (exclusive)."""
        # given up at the first state: with states every few hundred tokens (periodic),
        # collecting whole subtrees first made this quadratic
        seg = self._subtree(gid, [u], stop=self._has_state)
        if seg is None:
            return []
        parent, children = self.index.parent, self.index.children
        x = parent.get((gid, u))
        while x is not None and (gid, x) in parent:
            if self._has_state(x) or len(children.get((gid, x), ())) > 1:
                break
            seg.append(x)
            x = parent[(gid, x)]
        return seg

    # ---- lookups ----------------------------------------------------------------------------
    def _lookup(self, gid: int, unit: bytes) -> int | None:
        return self.pool[gid].lookup((gid, unit))

    def _get(self, req_id: Any) -> Request:
        r = self.reqs.get(req_id)
        if r is None:
            self._missing(req_id)
        return r  # type: ignore[return-value]

    def _missing(self, req_id: Any) -> None:
        if req_id in self._freed:
            raise DoubleFree(f"request {req_id!r}")
        raise UnknownRequest(req_id)

    def find_longest_cache_hit(
        self, prompt_token_ids: list[int], extra_keys: Any = None, *, lora_id: int | None = None
    ) -> int:
        """Cached prefix length a new request with this prompt would get (changes nothing)."""
        if not self.caching or len(prompt_token_ids) < 2:
            return 0
        tokens = token_array(prompt_token_ids)
        extra = encode_extra_keys(extra_keys if lora_id is None else (extra_keys, lora_id))
        hashes = extend_unit_hashes([], tokens, len(tokens), self.h, extra, self.hash_fn)
        return longest_hit(
            self._rules, hashes, len(tokens) - 1, self.h, self._lookup, self.index.holder
        )

    # ---- capacity ---------------------------------------------------------------------------
    def _can_allocate(
        self,
        needs: dict[int, int],
        touch: dict[int, list[int]] | None = None,
        freed: dict[int, int] | None = None,
    ) -> bool:
        """Whether ``needs`` fits after ``touch``; ``freed`` counts ids per group that would be
        freed first (private checkpoints, see :meth:`_reclaim_private`)."""
        cap = self._cap
        # per pool: (needs, touch, freed) of its groups
        asks: dict[Pool, tuple[dict[int, int], dict[int, list[int]], dict[int, int]]] = {}
        for gid, n in needs.items():
            asks.setdefault(cap[gid], ({}, {}, {}))[0][gid] = n
        if touch:
            for gid, ids in touch.items():
                if ids:
                    asks.setdefault(cap[gid], ({}, {}, {}))[1][gid] = ids
        if freed:
            for gid, n in freed.items():
                ask = asks.get(cap[gid])
                if ask is not None:
                    ask[2][gid] = n
        return all(pool.can_allocate(n, t, f) for pool, (n, t, f) in asks.items())

    def _reclaim_private(
        self, needs: dict[int, int], touch: dict[int, list[int]] | None = None
    ) -> bool:
        """Make room for ``needs`` by dropping running requests' private end-of-request
        checkpoints (``last``/``marconi`` take them only where a slot is spare), oldest requests
        first, but only if that makes ``needs`` fit: otherwise nothing changes. A dropped
        checkpoint is taken again at the request's next hash-unit boundary if a slot is free."""
        cap = self._cap
        pools = {cap[g] for g in needs}
        holders = [r for r in self.reqs.values() if any(cap[g] in pools for g in r.end_ckpt)]
        if not holders:
            return False
        freed: dict[int, int] = {}
        for r in holders:
            for g in r.end_ckpt:
                if cap[g] in pools:
                    freed[g] = freed.get(g, 0) + 1
        if not self._can_allocate(needs, touch, freed):
            return False
        for r in holders:
            for gid in [g for g in r.end_ckpt if cap[g] in pools]:
                _, sid = r.end_ckpt.pop(gid)
                self.pool[gid].free((sid,))
            if self._can_allocate(needs, touch):
                return True
        return self._can_allocate(needs, touch)

    def _reserve(self, needs: dict[int, int]) -> list[Pool]:
        """Reserve what an allocation over several groups of a pool relies on; returns the
        pools to release afterwards."""
        if len(needs) < 2:
            return []
        by_pool: dict[Pool, dict[int, int]] = {}
        for gid, k in needs.items():
            by_pool.setdefault(self._cap[gid], {})[gid] = k
        return [pool for pool, n in by_pool.items() if pool.reserve(n)]

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        req_id: Any,
        prompt_token_ids: Any,
        extra_keys: Any = None,
        *,
        lora_id: int | None = None,
        num_prompt_tokens: int | None = None,
    ) -> HitInfo:
        """Register a request: take its longest prefix hit and its state slots.

        ``extra_keys`` (anything msgpack can encode: a LoRA name, a cache salt, multimodal ids)
        and ``lora_id`` enter every hash, so only requests that agree on them share blocks.
        The request then has ``num_cached_tokens`` tokens with slots; call
        :meth:`allocate_slots` for the rest. Raises :class:`PoolExhausted`, changing nothing,
        when the slots and hit blocks do not fit.

        ``num_prompt_tokens``: how many of the tokens are the prompt, when a preempted request is
        re-added with its outputs (``align`` keeps states by the prompt's length, as vLLM's
        ``num_prompt_tokens``); default all of them."""
        if req_id in self.reqs:
            raise DuplicateRequest(req_id)
        n = len(prompt_token_ids)
        if n > self.max_model_len:
            raise MaxLengthExceeded(req_id, n, self.max_model_len)
        tokens = token_array(prompt_token_ids)
        extra = encode_extra_keys(extra_keys if lora_id is None else (extra_keys, lora_id))
        hashes: list[bytes] = []
        h = self.h
        L, branch_at, junction = 0, -1, 0
        if self.caching:
            extend_unit_hashes(hashes, tokens, n, h, extra, self.hash_fn)
            if n > 1 and self.index.entries:
                L = longest_hit(self._rules, hashes, n - 1, h, self._lookup, self.index.holder)
                if self.policy.branches and self._state:
                    D = longest_hit(
                        self._attn_rules, hashes, n - 1, h, self._lookup, self.index.holder
                    )
                    if D > L:
                        branch_at = D // h * h
                elif self._vllm is not None and self._junction_rules:
                    J = longest_hit(
                        self._junction_rules, hashes, n - 1, h, self._lookup, self.index.holder
                    )
                    if J > L:
                        junction = J
            self.num_queries += 1
            self.num_query_tokens += n
            self.num_hit_tokens += L
            if self._scorer is not None:
                self._scorer.tick()
                if L:
                    self._scorer.accessed(hashes[L // h - 1])
        r = Request(req_id, tokens, extra, lora_id, hashes, len(self.groups))
        touch: dict[int, list[int]] = {}
        needs: dict[int, int] = {}
        partial: dict[int, tuple[int, int]] = {}  # gid -> (src block, tokens to copy)
        state_src: dict[int, int] = {}
        for gid, B in self._attn:
            full = L // B
            W = self._window[gid]
            first = min(full, max(0, L - W + 1) // B) if W else 0
            r.lead[gid] = first
            s = B // h
            ids = [0] * first
            ids += [self._lookup(gid, hashes[(j + 1) * s - 1]) for j in range(first, full)]
            r.blocks[gid] = ids  # type: ignore[assignment]
            r.ncached[gid] = full
            held = [b for b in ids if b]
            if full * B < L:
                src = self.index.holder(gid, hashes[L // h - 1])
                assert src is not None
                partial[gid] = (src, L - full * B)
                held.append(src)
                needs[gid] = 1
            touch[gid] = held
        for gid in self._state:
            needs[gid] = self.slots_per_seq
            if L:
                src = self._lookup(gid, hashes[L // h - 1])
                assert src is not None
                state_src[gid] = src
                touch[gid] = [src]
        if not self._can_allocate(needs, touch) and not self._reclaim_private(needs, touch):
            short = sorted({self._cap[g].name for g in needs})
            raise PoolExhausted(",".join(short), sum(needs.values()), 0)
        for gid, ids in touch.items():
            self.pool[gid].touch(ids)
        hit = HitInfo(L)
        reserved = self._reserve(needs)
        for gid, k in needs.items():
            new = self.pool[gid].allocate(k)
            if gid in state_src:
                hit.state_copies.append((gid, state_src[gid], new[0]))
                r.sources.append((gid, state_src[gid]))
            if gid in partial:
                src, ntok = partial[gid]
                hit.kv_copies.append((gid, src, new[0], ntok))
                r.sources.append((gid, src))
            r.blocks[gid].extend(new)
        for cap in reserved:
            cap.release()
        r.num_alloc = L
        if state_src:
            r.hit_unit = hashes[L // h - 1]
        r.branch_at = branch_at
        r.junction = junction
        if num_prompt_tokens is not None:
            r.nprompt = max(1, min(n, num_prompt_tokens))
        r.row = self.tables.add_row()
        for gid, blocks in enumerate(r.blocks):
            if blocks:
                self.tables.write(gid, r.row, 0, blocks)
        self.reqs[req_id] = r
        self._freed.pop(req_id, None)
        if r.sources:
            self._sourced[req_id] = r
        self._set_limit(r)
        if self._dead:
            self._settle()
        return hit

    def allocate_slots(self, req_id: Any, num_new_tokens: int) -> bool:
        """Give ``num_new_tokens`` more tokens slots in every group, all or nothing.

        False means the pools are exhausted and nothing changed: preempt a request (``free``
        it) and retry. The only change that survives a False is the release of sliding-window
        blocks that no longer hold any token the request can attend to. Raises
        :class:`MaxLengthExceeded` past ``max_model_len``."""
        r = self.reqs.get(req_id)
        if r is None:
            self._missing(req_id)
        total = r.num_alloc + num_new_tokens  # type: ignore[union-attr]
        # Fast path (most decode steps): no new block, no cache or checkpoint work.
        if (
            num_new_tokens >= 0
            and total < r.limit  # type: ignore[union-attr]
            and not (self._exports and num_new_tokens > 1)
        ):
            r.num_alloc = total  # type: ignore[union-attr]
            return True
        return self._allocate_slow(r, num_new_tokens, total)  # type: ignore[arg-type]

    def _allocate_slow(self, r: Request, num_new: int, total: int) -> bool:
        if num_new < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new}")
        if total > self.max_model_len:
            raise MaxLengthExceeded(r.req_id, total, self.max_model_len)
        for gid, B, W in self._swa:
            self._free_outside_window(r, gid, B, r.num_alloc - W + 1)
        needs: dict[int, int] = {}
        for gid, B in self._attn:
            k = -(-total // B) - len(r.blocks[gid])
            if k > 0:
                needs[gid] = k
        if needs:
            if len(needs) == 1:
                fits = self._cap[next(iter(needs))].can_allocate(needs)
            else:
                fits = self._can_allocate(needs)
            if not fits and not self._reclaim_private(needs):
                return False
            reserved = self._reserve(needs)
            for gid, k in needs.items():
                ids = self.pool[gid].allocate(k)
                blocks = r.blocks[gid]
                self.tables.write(gid, r.row, len(blocks), ids)
                blocks.extend(ids)
            for cap in reserved:
                cap.release()
        if self._exports and self.caching and num_new > 0:
            if r.step_start < 0:
                r.step_start = r.num_alloc
            self._dirty[r.req_id] = r  # the commit looks for an export inside the step
        r.num_alloc = total
        if self.caching and total >= r.work_at:
            self._dirty[r.req_id] = r
        self._set_limit(r)
        if self._dead:
            self._settle()
        return True

    def _free_outside_window(self, r: Request, gid: int, B: int, first_needed: int) -> None:
        """Blocks ending at or before the first token the next one attends to become null."""
        blocks = r.blocks[gid]
        lead = r.lead[gid]
        end = min(max(0, first_needed) // B, len(blocks))
        if end <= lead:
            return
        # Oldest first, as vLLM: the oldest of them is the nearest to eviction.
        self.pool[gid].free(blocks[lead:end])
        blocks[lead:end] = [0] * (end - lead)
        self.tables.write(gid, r.row, lead, blocks[lead:end])
        r.lead[gid] = end

    def _set_limit(self, r: Request) -> None:
        """Recompute how far allocate_slots may go on the fast path."""
        limit = self.max_model_len + 1
        work = _INF
        for gid, B in self._attn:
            cap = len(r.blocks[gid]) * B + 1
            if cap < limit:
                limit = cap
            if self.caching:
                nxt = (r.ncached[gid] + 1) * B
                if nxt < work:
                    work = nxt
        for gid, B, W in self._swa:
            thr = (r.lead[gid] + 1) * B + W - 1
            if thr < limit:
                limit = thr
        if self.caching and self._state:
            if self._vllm is not None:
                nxt = self._vllm.next_position(r.num_alloc, r.nprompt, r.junction)
            else:
                nxt = self.policy.next_position(r.num_alloc, r.branch_at)
            if nxt < work:
                work = nxt
        r.work_at = work
        r.limit = min(limit, work)

    def append_tokens(self, req_id: Any, token_ids: Any) -> None:
        """Record tokens the model produced (they enter the hashes of later blocks)."""
        r = self.reqs.get(req_id)
        if r is None:
            self._missing(req_id)
        toks = r.tokens  # type: ignore[union-attr]
        if len(toks) + len(token_ids) > self.max_model_len:
            raise MaxLengthExceeded(req_id, len(toks) + len(token_ids), self.max_model_len)
        toks.extend(token_ids)

    # ---- the step's commit ------------------------------------------------------------------
    def take_state_copies(self) -> list[tuple[int, int, int]]:
        """Commit the step (see the module docstring and :mod:`.commit`) and return the state
        copies ``(group, running slot, checkpoint slot)`` to run after this forward pass."""
        copies: list[tuple[int, int, int]] = []
        held: list[tuple[IdCache, int]] = []
        commit = self._commit
        if commit.last_exports:
            commit.last_exports = []
        if self._dirty:
            for r in self._dirty.values():
                commit.commit(r, copies, held)
                self._set_limit(r)
            self._dirty.clear()
        if self._sourced:
            for r in self._sourced.values():
                commit.release_sources(r)
            self._sourced.clear()
        if held:
            commit.free_held(held)
        if self._dead:
            self._settle()
        return copies

    # ---- free -------------------------------------------------------------------------------
    def free(self, req_id: Any) -> None:
        """Release a finished or preempted request. Its computed full blocks stay cached (they
        were cached at the commits); with ``last``/``marconi`` its end state becomes a cache
        entry. Raises :class:`DoubleFree` or :class:`UnknownRequest` for ids not running."""
        r = self._get(req_id)
        self._dirty.pop(req_id, None)  # allocated but never committed: not computed
        self._commit.cache_end_state(r)
        if r.sources:
            self._commit.release_sources(r)
            self._sourced.pop(req_id, None)
        for gid, blocks in enumerate(r.blocks):
            # Tail first: among this request's blocks the tail is evicted first (vLLM).
            self.pool[gid].free(reversed(blocks))
        if self.evict_unreachable and self.caching and self._state:
            self._drop_past_last_state(r)
        self.tables.release_row(r.row)
        del self.reqs[req_id]
        self._freed[req_id] = None
        if len(self._freed) > _FREED_MEMORY:
            self._freed.popitem(last=False)

    def _drop_past_last_state(self, r: Request) -> None:
        """Evict the finished request's cached KV past the last state kept on its chain (the
        answer's blocks under ``align``, which keeps states only in the prompt): no hit can
        reach it, and a request that computes past that state again computes it anyway."""
        hashes, h = r.hashes, self.h
        last = len(hashes)
        while last > 0 and not self._has_state(hashes[last - 1]):
            last -= 1
        if last == len(hashes):
            return
        for gid, B in self._attn:
            if self._window[gid]:
                continue
            blocks, s = r.blocks[gid], B // h
            for j in range(last // s, len(blocks)):
                bid = blocks[j]
                if not bid:
                    continue
                key = self.pool[gid].key_of(bid)
                info = self.index.entries.get(key) if key is not None else None
                # an entry of this chain whose every unit lies past the last state
                if info is not None and info[1] >= last and info[2][0] == hashes[info[1]]:
                    self.pool[gid].drop_cached(bid)
        if self._dead:
            self._settle()

    # ---- queries ----------------------------------------------------------------------------
    def block_ids(self, req_id: Any) -> list[list[int]]:
        """One list of block ids per group (state groups: running slot, then spares)."""
        return [list(b) for b in self._get(req_id).blocks]

    def num_tokens(self, req_id: Any) -> int:
        """Tokens of the request that have slots (cached hit + allocated)."""
        return self._get(req_id).num_alloc

    def state_slot(self, req_id: Any, group_id: int) -> int:
        """The running state slot of a state group."""
        if not self.groups[group_id].is_state:
            raise ValueError(f"group {group_id} is an attention group; use block_ids()")
        return self._get(req_id).blocks[group_id][0]

    def next_checkpoint(self, req_id: Any) -> int | None:
        """Where the policy wants a prefill chunk to end so that a state checkpoint is taken, or
        None: ``align``, where vLLM would end a chunk offered every remaining token
        (:meth:`split_prefill`); ``align_every_block``: the next block multiple; ``last``,
        ``marconi``, ``periodic`` and ``hash_boundary``: the prompt's last hash boundary (a
        state is only kept where a step ends on one, and an answer too short to reach the next
        would leave the request with no end state; Marconi keeps the last token's), before it
        ``marconi``'s pending branch point and, when they are not exported, the next position
        ``periodic`` / ``hash_boundary`` keep a state at."""
        r = self._get(req_id)
        if not self.caching or not self._state:
            return None
        if self._vllm is not None:
            rest = len(r.tokens) - r.num_alloc
            end = r.num_alloc + self.split_prefill(req_id, rest)
            return end if end < len(r.tokens) else None
        if self.policy.name == "align_every_block":
            return self.policy.next_position(r.num_alloc, -1)
        stops = [r.nprompt // self.h * self.h, r.branch_at]
        if self.policy.interval and not self.policy.exports_marks:
            stops.append(self.policy.next_mark(r.num_alloc, r.nprompt) or 0)
        after = [p for p in stops if p > r.num_alloc]
        return min(after) if after else None

    def split_prefill(
        self, req_id: Any, num_new_tokens: int, max_prefill_tokens: int | None = None
    ) -> int:
        """How many of ``num_new_tokens`` (what the token budget allows) the request may run this
        step. ``align``: vLLM's ``Scheduler._mamba_block_aligned_split``
        (:class:`~.policies.VllmAlign`, rule 1), with ``max_prefill_tokens`` the scheduler's
        per-step token limit (default: no limit). Other policies (and ``align`` without prefix
        caching or state groups) cut nothing."""
        r = self._get(req_id)
        if self._vllm is None or not self.caching or num_new_tokens <= 0:
            return num_new_tokens
        return self._vllm.split(
            r.num_alloc,
            num_new_tokens,
            len(r.tokens),
            r.nprompt,
            r.junction,
            _INF if max_prefill_tokens is None else max_prefill_tokens,
        )

    def junction(self, req_id: Any) -> int:
        """``align``: the junction found when the request was admitted (vLLM's
        ``shared_prefix_boundary``: attention hit past the states), 0 if none."""
        return self._get(req_id).junction

    def fast_path_tokens(self, req_id: Any) -> int:
        """Tokens :meth:`allocate_slots` can add to ``req_id`` with no block, cache or
        checkpoint work: a scheduler may batch that many decode steps without calling the
        allocator for them (then hand them over in one call)."""
        r = self._get(req_id)
        return max(0, r.limit - 1 - r.num_alloc)

    def ids_in_use(self) -> dict[int, int]:
        """Per group: ids that hold data (used by running requests or holding a cached block).

        In a pool serving several groups, a state group counts its requests' slots (running,
        spares, private end-of-request checkpoints) and its cached checkpoints, and the first
        attention group counts every other id that is not free (shared prefix blocks once,
        however many requests use them). A two-level pool's groups count their own small ids.
        Cost: O(requests x state groups) plus, for two-level pools, the held and cached ids.
        """
        reqs = self.reqs.values()

        def held(g: int) -> list[int]:
            out: list[int] = []
            for r in reqs:
                out += r.blocks[g]
                ck = r.end_ckpt.get(g)
                if ck is not None:
                    out.append(ck[1])
            return out

        state = set(self._state)
        count: dict[int, int] = {}
        for pool in self._pools:
            count.update(pool.ids_in_use(held, state))
        return count

    def held_ids(self) -> list[tuple[int, list[int]]]:
        """Every id running requests hold, as ``(group, ids)``: each request's block list per
        group, its private end checkpoints, and the cached entries its hit copies from until
        the commit (an id appears once per holder)."""
        out: list[tuple[int, list[int]]] = []
        for r in self.reqs.values():
            for gid, blocks in enumerate(r.blocks):
                if blocks:
                    out.append((gid, blocks))
            for gid, (_, sid) in r.end_ckpt.items():
                out.append((gid, [sid]))
            for gid, sid in r.sources:
                out.append((gid, [sid]))
        return out

    def memory_breakdown(self) -> MemoryBreakdown:
        """Where the plan's bytes are now: live, cached and reachable, cached but unreachable,
        owned but empty, padding, free, unusable (:mod:`.breakdown`)."""
        return memory_breakdown(self)

    def block_tables(self, req_ids: list[Any]) -> list[torch.Tensor]:
        """One int32 ``[len(req_ids), max blocks]`` table per group, padded with the null id."""
        reqs = self.reqs
        try:
            rows = [reqs[q].row for q in req_ids]
        except KeyError as e:
            self._missing(e.args[0])
            raise  # pragma: no cover
        return self.tables.gather(rows)

    def take_events(self) -> KVEventBatch:
        """KV events since the last call, as one batch."""
        return KVEventBatch(ts=time.time(), events=self.index.take_events())

    def cached_hashes(self) -> set[tuple[int, bytes]]:
        """(group, hash unit) pairs some cache entry covers."""
        return set(self.index.parent)

    def cached_units(self) -> dict[tuple[int, bytes], bytes | None]:
        """(group, hash unit) -> parent unit: what a subscriber's :class:`CacheIndex` holds."""
        return self.index.units()

    def reset_prefix_cache(self) -> bool:
        """Drop every cache entry (one ``AllBlocksCleared`` event). Only when no request runs,
        as in vLLM; returns whether it did."""
        if self.reqs:
            return False
        self.index.emit = False
        try:
            for p in self._pools:
                p.evict_all_free()
        finally:
            self.index.emit = True
        self.index.clear()
        self.index.events.append(AllBlocksCleared())
        return True

    def usage(self) -> dict[str, float]:
        """Per pool: fraction in use by running requests (cached free memory counts free)."""
        return {p.name: p.usage() for p in self._pools}

    @property
    def marconi_alpha(self) -> float | None:
        """``marconi``'s weight of FLOPs saved per byte against recency (None for the other
        policies). Settable: Marconi tunes it once it has seen the workload."""
        return None if self._scorer is None else self._scorer.alpha

    @marconi_alpha.setter
    def marconi_alpha(self, alpha: float) -> None:
        if self._scorer is None:
            raise ValueError(
                f"marconi_alpha is for checkpoint_policy='marconi', not {self.policy.name!r}"
            )
        self._scorer.alpha = alpha  # the scorer checks it

    def stats(self) -> dict[str, Any]:
        q = max(1, self.num_query_tokens)
        return {
            "running": len(self.reqs),
            "pools": {p.name: p.stats() for p in self._pools},
            "cache_entries": len(self.index),
            "cached_units": len(self.index.parent),
            "prefix_queries": self.num_queries,
            "prefix_hit_rate": self.num_hit_tokens / q,
            "checkpoints": self.num_checkpoints,
            "checkpoint_ids": self.num_checkpoint_ids,
        }
