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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..plan import MemoryPlan
from .block_pool import IdCache, Pool
from .breakdown import MemoryBreakdown, memory_breakdown
from .capacity import Capacity
from .cascade import Cascade
from .commit import Committer
from .errors import (
    DoubleFree,
    DuplicateRequest,
    MaxLengthExceeded,
    PoolExhausted,
    UnknownRequest,
)
from .events import AllBlocksCleared, KVEventBatch
from .groups import Coordinator
from .hashing import encode_extra_keys, extend_unit_hashes, get_hash_fn, token_array
from .options import AllocatorOptions
from .policies import make_policy
from .policies.base import EvictionHooks
from .pools import build_pools
from .prefix_cache import PrefixIndex
from .request import INF as _INF
from .request import Request
from .tables import BlockTables

if TYPE_CHECKING:  # torch is imported where tensors are built, not by the CLI
    import torch

    from .groups.base import GroupManager

__all__ = ["HitInfo", "HybridAllocator"]

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
    #: the prefix the attention groups alone held (the hit the same cached KV would give a
    #: model without state layers); ``num_cached_tokens`` is at most this, the difference is
    #: what missing state checkpoints cost this request
    num_kv_cached_tokens: int = 0


class HybridAllocator:
    """See the module docstring. ``options`` (:class:`~.options.AllocatorOptions`, which
    documents each one) say how it caches and checkpoints; keyword ``overrides`` replace some
    of them (``HybridAllocator(plan, checkpoint_policy="last")``)."""

    def __init__(
        self, plan: MemoryPlan, options: AllocatorOptions | None = None, **overrides: Any
    ) -> None:
        options = (options or AllocatorOptions()).replace(**overrides) if overrides else options
        self.options = o = (options or AllocatorOptions()).for_plan(plan)
        self.plan = plan
        self.groups = plan.groups
        self.caching = o.enable_prefix_caching
        self.h = o.hash_block_size
        self.max_model_len = o.max_model_len
        self.slots_per_seq = plan.config.state_slots_per_seq
        self.policy = make_policy(plan, o)
        has_state = bool(plan.state_groups)
        # exports need the start of each step: multi-token allocations take the slow path
        self._exports = has_state and self.policy.exports
        self.hash_fn = get_hash_fn(o.hash_algo)
        self.lookahead: int = o.hash_lookahead_tokens  # type: ignore[assignment]  # MTP's hashes
        self.index = PrefixIndex(self.h, emit=o.kv_events)
        self.evict_unreachable = o.evict_unreachable
        self._build_pools()
        # a state group's row is its running slot and spares: a fixed width
        slots = max(1, self.slots_per_seq)
        fixed = {g.group_id: slots for g in plan.state_groups}
        self.tables = BlockTables(len(self.groups), fixed=fixed)
        #: the group managers and the hits across them
        self.coordinator = self._build_coordinator()
        self._state = [m.group_id for m in self.coordinator.states]
        self._probe_rules = self.coordinator.probe_rules(self.policy.admission_probe)
        self._kv_rules = self._attention_only_rules()
        #: the policy's eviction bookkeeping (``marconi``'s scorer), None: the pools' LRU
        self._eviction = self.policy.install_eviction(self.index, plan, self._pools, self.pool, o)
        self.reqs: dict[Any, Request] = {}
        self._freed: OrderedDict[Any, None] = OrderedDict()
        self._dirty: dict[Any, Request] = {}  # allocated this step: commit has work
        self._sourced: dict[Any, Request] = {}  # hold hit sources until the commit
        self.num_queries = self.num_query_tokens = self.num_hit_tokens = 0
        self._commit = Committer(
            index=self.index,
            pools=self.pool,
            tables=self.tables,
            policy=self.policy,
            hash_block_size=self.h,
            hash_fn=self.hash_fn,
            hash_lookahead=self.lookahead,
            attention=self.coordinator.caching,  # type: ignore[arg-type]
            state=self._state,
            full=[m.group_id for m in self.coordinator.whole_prefix],
            caching=self.caching,
            partial=o.partial_block_hits,
            # hits inside a block (vLLM's partial hash hits): attention caches prompts' tails
            promote=has_state and self.policy.promotes_tail,
            scorer=self._eviction,
        )

    @property
    def pools(self) -> tuple[Pool, ...]:
        """The pools, in plan order (a ``per_group`` plan pool: one per group)."""
        return tuple(self._pools)

    @property
    def hit_peek_units(self) -> dict[int, int]:
        """Group -> hash units a hit needs cached past it there, beyond the ones it reuses
        (vLLM's EAGLE block drop, ``AllocatorOptions.eagle_block_drop``: the drafter's groups
        look a unit past every hit and give it back); empty without the drop."""
        return dict(self._cascade.peek)

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
    def _build_coordinator(self) -> Coordinator:
        o = self.options
        coordinator = Coordinator(
            self.plan,
            self.pool,
            self.tables,
            self.index,
            hash_block_size=self.h,
            partial_hits=o.partial_block_hits,
            keyed_partial_hits=o.resolved_partial_hit_points() == "keys",
            state_hit_step=self.policy.step,
            slots_per_seq=self.slots_per_seq,
            eagle_block_drop=o.eagle_block_drop,  # type: ignore[arg-type]
        )
        # the cascade keeps what EAGLE's block drop looks up past each state
        self._cascade.keep_past_states(
            {m.group_id: m.eagle_drop // self.h for m in coordinator.managers if m.eagle_drop}
        )
        return coordinator

    def _build_pools(self) -> None:
        self.pool: dict[int, IdCache] = {}  # group -> where its ids come from
        # evicts what evictions leave unreachable; reads self.pool, filled in below
        self._cascade = Cascade(self.index, self.groups, self.pool)
        on_evict = self._cascade.evicted if self.evict_unreachable else self.index.remove
        #: the pools, in plan order (:func:`.pools.build_pools`)
        self._pools: list[Pool] = build_pools(self.plan, on_evict)
        pool_of: dict[int, Pool] = {}  # group -> the capacity it shares
        for pool in self._pools:
            for gid in pool.groups:
                self.pool[gid] = pool.view(gid)
                pool_of[gid] = pool
        self._capacity = Capacity(pool_of, self.pool)

    # ---- lookups ----------------------------------------------------------------------------
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
        hashes = extend_unit_hashes(
            [], tokens, len(tokens), self.h, extra, self.hash_fn, self.lookahead
        )
        return self.coordinator.longest_hit(hashes, len(tokens) - 1)

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
        r = Request(req_id, tokens, extra, lora_id, [], len(self.groups))
        hit, probe_hit, kv_hit = self._look_up(r)
        self.policy.admitted(r, hit, probe_hit)  # marconi's branch point, align's junction
        info = self._take_hit(r, hit)
        info.num_kv_cached_tokens = kv_hit
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
        if self._cascade.pending:
            self._cascade.settle()
        return info

    def _attention_only_rules(self) -> list[GroupManager]:
        """The groups of the attention-only hit every admission reports; none when the policy's
        probe searches the same groups (``marconi``: its probe's hit is reused) or when there
        is no state group (the hit itself is attention's)."""
        attention = self.coordinator.attention_rules if self._state else []
        return [] if attention == self._probe_rules else attention

    def _look_up(self, r: Request) -> tuple[int, int, int]:
        """Hash ``r``'s prompt and find its hit, the hit of the policy's admission probe, and
        the hit of the attention groups alone (``HitInfo.num_kv_cached_tokens``)."""
        if not self.caching:
            return 0, 0, 0
        n, h = len(r.tokens), self.h
        hashes = r.hashes
        extend_unit_hashes(hashes, r.tokens, n, h, r.extra, self.hash_fn, self.lookahead)
        hit = probe_hit = kv_hit = 0
        if n > 1 and self.index.entries:
            longest = self.coordinator.longest_hit
            hit = longest(hashes, n - 1)
            if self._probe_rules:
                probe_hit = longest(hashes, n - 1, self._probe_rules)
            if self._kv_rules:
                kv_hit = longest(hashes, n - 1, self._kv_rules)
            else:
                kv_hit = probe_hit if self._probe_rules else hit
        self.num_queries += 1
        self.num_query_tokens += n
        self.num_hit_tokens += hit
        if self._eviction is not None:
            self._eviction.tick()
            if hit:
                self._eviction.accessed(hashes[hit // h - 1])
        return hit, probe_hit, kv_hit

    def _take_hit(self, r: Request, hit: int) -> HitInfo:
        """Give ``r`` the cached blocks of its hit and the new ids every group needs (all or
        nothing: raises :class:`PoolExhausted`, changing nothing)."""
        adm = self.coordinator.admit(r, hit)
        needs, touch = adm.needs, adm.touch
        capacity = self._capacity
        if not capacity.fits(needs, touch) and not capacity.reclaim_private(
            needs, self.reqs.values(), touch
        ):
            short = sorted({capacity.pool_of[g].name for g in needs})
            raise PoolExhausted(",".join(short), sum(needs.values()), 0)
        for gid, ids in touch.items():
            self.pool[gid].touch(ids)
        info = HitInfo(hit)
        reserved = capacity.reserve(needs)
        for gid, k in needs.items():
            new = self.pool[gid].allocate(k)
            if gid in adm.state_sources:
                src = adm.state_sources[gid]
                info.state_copies.append((gid, src, new[0]))
                r.sources.append((gid, src))
            if gid in adm.kv_sources:
                src, ntok = adm.kv_sources[gid]
                info.kv_copies.append((gid, src, new[0], ntok))
                r.sources.append((gid, src))
            r.blocks[gid].extend(new)
        for cap in reserved:
            cap.release()
        r.num_alloc = hit
        if adm.state_sources:
            r.hit_unit = r.hashes[hit // self.h - 1]
        return info

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
        needs = self.coordinator.blocks_needed(r, total)
        if needs:
            new = self._capacity.allocate(needs, self.reqs.values())
            if not new:
                return False
            for gid, ids in new.items():
                blocks = r.blocks[gid]
                self.tables.write(gid, r.row, len(blocks), ids)
                blocks.extend(ids)
        if self._exports and self.caching and num_new > 0:
            if r.step_start < 0:
                r.step_start = r.num_alloc
            self._dirty[r.req_id] = r  # the commit looks for an export inside the step
        r.num_alloc = total
        if self.caching and total >= r.work_at:
            self._dirty[r.req_id] = r
        self._set_limit(r)
        if self._cascade.pending:
            self._cascade.settle()
        return True

    def _set_limit(self, r: Request) -> None:
        """Recompute how far allocate_slots may go on the fast path."""
        limit, work = self.coordinator.fast_path_limit(r, self.caching)
        if limit > self.max_model_len:
            limit = self.max_model_len + 1
        if self.caching and self._state:
            # a state waiting for its key: the next commit may know it
            nxt = r.num_alloc + 1 if r.unkeyed else self.policy.next_work(r)
            if nxt < work:
                work = nxt
        r.work_at = work
        r.limit = limit if limit < work else work

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
        if self._cascade.pending:
            self._cascade.settle()
        return copies

    # ---- free -------------------------------------------------------------------------------
    def free(self, req_id: Any) -> None:
        """Release a finished or preempted request. Its computed full blocks stay cached (they
        were cached at the commits); with ``last``/``marconi`` its end state becomes a cache
        entry. Raises :class:`DoubleFree` or :class:`UnknownRequest` for ids not running."""
        r = self._get(req_id)
        self._dirty.pop(req_id, None)  # allocated but never committed: not computed
        if r.unkeyed:
            self._commit.release_deferred(r)
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
        self._cascade.drop_past_last_state(r.hashes, r.blocks)

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
        return self.policy.chunk_stop(r)

    def prefill_chunk(
        self, req_id: Any, num_new_tokens: int, max_prefill_tokens: int | None = None
    ) -> int:
        """The one question a scheduler asks: how many of the ``num_new_tokens`` prompt tokens
        the token budget allows ``req_id`` may run this step (``max_prefill_tokens``: the
        scheduler's per-step limit, default none). The checkpoint policy answers
        (:meth:`~.policies.CheckpointPolicy.chunk_tokens`): a chunk the budget cuts ends on the
        plan's checkpoint granularity, and a chunk ends where the policy wants a state
        (``align``: where vLLM's scheduler would end it). Without prefix caching or state
        groups no state is kept, so the budget's tokens run uncut, as vLLM 0.33 aligns chunks
        only in ``align`` mode (``need_mamba_block_aligned_split``)."""
        r = self._get(req_id)
        if not self.caching or not self._state:
            return num_new_tokens
        limit = _INF if max_prefill_tokens is None else max_prefill_tokens
        return self.policy.chunk_tokens(r, num_new_tokens, limit)

    def split_prefill(
        self, req_id: Any, num_new_tokens: int, max_prefill_tokens: int | None = None
    ) -> int:
        """How many of ``num_new_tokens`` (what the token budget allows) the request may run this
        step. ``align``: vLLM's ``Scheduler._mamba_block_aligned_split``
        (:class:`~.policies.VllmAlign`, rule 1), with ``max_prefill_tokens`` the scheduler's
        per-step token limit (default: no limit). Other policies (and ``align`` without prefix
        caching or state groups) cut nothing."""
        r = self._get(req_id)
        if not self.caching or not self._state:
            return num_new_tokens
        limit = _INF if max_prefill_tokens is None else max_prefill_tokens
        return self.policy.split_prefill(r, num_new_tokens, limit)

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
        spares, private end-of-request checkpoints) and its cached checkpoints, a scratch group
        (a ring) its requests' blocks, and the first caching attention group every other id
        that is not free (shared prefix blocks once, however many requests use them). A
        two-level pool's groups count their own small ids.
        Cost: O(requests x state groups) plus, for two-level pools, the held and cached ids.
        """
        reqs = self.reqs.values()

        def held(g: int) -> list[int]:
            out: list[int] = []
            for r in reqs:
                out += r.blocks[g]
                sid = r.end_ckpt.get(g)
                if sid is not None:
                    out.append(sid)
            return out

        # the groups whose ids are counted per request: states and scratch rings (a ring's
        # ids are no cached KV, and counting them in the first attention group's total would
        # give them the KV's bytes)
        scratch = [m.group_id for m in self.coordinator.attention if not m.caches_blocks]
        per_request = {*self._state, *scratch}
        count: dict[int, int] = {}
        for pool in self._pools:
            count.update(pool.ids_in_use(held, per_request))
        return count

    def held_ids(self) -> list[tuple[int, list[int]]]:
        """Every id running requests hold, as ``(group, ids)``: each request's block list per
        group, its private end checkpoints, the states waiting for their key (lookahead
        hashes), and the cached entries its hit copies from until the commit (an id appears
        once per holder)."""
        out: list[tuple[int, list[int]]] = []
        for r in self.reqs.values():
            for gid, blocks in enumerate(r.blocks):
                if blocks:
                    out.append((gid, blocks))
            for gid, sid in r.end_ckpt.items():
                out.append((gid, [sid]))
            for _, taken in r.unkeyed:
                out.extend((gid, [sid]) for gid, sid in taken)
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
        emit, self.index.emit = self.index.emit, False  # one event for all, below
        try:
            for p in self._pools:
                p.evict_all_free()
        finally:
            self.index.emit = emit
        self.index.clear()
        if emit:
            self.index.events.append(AllBlocksCleared())
        return True

    def usage(self) -> dict[str, float]:
        """Per pool: fraction in use by running requests (cached free memory counts free)."""
        return {p.name: p.usage() for p in self._pools}

    @property
    def marconi_alpha(self) -> float | None:
        """Marconi's eviction's weight of FLOPs saved per byte against recency (None under
        LRU eviction). Settable: Marconi tunes it once it has seen the workload."""
        return None if self._eviction is None else self._eviction.alpha

    @marconi_alpha.setter
    def marconi_alpha(self, alpha: float) -> None:
        if self._eviction is None:
            raise ValueError(
                f"marconi_alpha weighs Marconi's eviction, which checkpoint_policy "
                f"{self.policy.name!r} runs without (eviction='marconi' turns it on)"
            )
        self._eviction.alpha = alpha  # the scorer checks it

    @property
    def eviction_hooks(self) -> EvictionHooks | None:
        """The policy's eviction bookkeeping (Marconi's scorer), None under LRU eviction:
        what ``check_consistency`` asks to check itself."""
        return self._eviction

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
