"""The step's commit and the state checkpoints (:class:`Committer`).

A commit (:meth:`HybridAllocator.take_state_copies <.manager.HybridAllocator.take_state_copies>`)
makes what a step computed visible to prefix hits: the request's full attention blocks become
cache entries, and where the checkpoint policy (:mod:`.policies`) says so, the running state
is copied into a spare or new slot cached at the step's end (or, exported from inside the
step, at a position in it). ``last`` and its kin instead refresh a private end-of-request
checkpoint, cached when the request is freed (:meth:`Committer.cache_end_state`).

The allocator decides *when* (which requests, the fast path around them, the cascade after
evictions); this module decides *what* is cached and which ids the checkpoints take.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .block_pool import IdCache
from .hashing import HashFn, extend_unit_hashes
from .policies import CheckpointPolicy
from .prefix_cache import PrefixIndex
from .request import Request
from .tables import BlockTables

if TYPE_CHECKING:  # pragma: no cover
    from .groups import FullAttentionManager
    from .policies import EvictionHooks

__all__ = ["Committer"]

#: (group, id) pairs a commit holds until it ends (a checkpoint's new slot)
Held = list[tuple[IdCache, int]]


class Committer:
    """Caches what a step computed and takes the state checkpoints, for one allocator.

    ``pools``: group -> where its ids come from; ``attention``: the attention groups'
    managers (they cache their computed blocks); ``state``: the state groups; ``full``: the
    full-attention groups.
    ``policy`` decides which states are kept (:meth:`~.policies.CheckpointPolicy.step_end`),
    through this object's :class:`~.policies.StateActions` (:meth:`keep`, :meth:`export`,
    :meth:`roll`, :meth:`cache_tail_blocks`); ``promote``: a partial tail entry grows into a
    full one once its block fills (vLLM's partial hash hits)."""

    def __init__(
        self,
        *,
        index: PrefixIndex,
        pools: dict[int, IdCache],
        tables: BlockTables,
        policy: CheckpointPolicy,
        hash_block_size: int,
        hash_fn: HashFn,
        hash_lookahead: int,
        attention: list[FullAttentionManager],
        state: list[int],
        full: list[int],
        caching: bool,
        partial: bool,
        promote: bool,
        scorer: EvictionHooks | None,
    ) -> None:
        self.index = index
        self.pool = pools
        self.tables = tables
        self.policy = policy
        self.h = hash_block_size
        self.hash_fn = hash_fn
        self.lookahead = hash_lookahead
        self.attention = attention
        self.state = state
        self.full = full
        self.caching = caching
        self.partial = partial
        self.promote = promote
        self.scorer = scorer
        # state groups by the ids they take (one for all of them in the shared layouts, so
        # that a checkpoint takes its ids in one call), in group order
        by_pool: dict[IdCache, list[int]] = {}
        for gid in state:
            by_pool.setdefault(pools[gid], []).append(gid)
        self.state_pools = list(by_pool.items())
        #: states exported from inside the last committed step, ``(group, slot, position)``
        self.last_exports: list[tuple[int, int, int]] = []
        #: state checkpoints cached (one per position, all state groups together), and the
        #: state ids they took
        self.num_checkpoints = 0
        self.num_checkpoint_ids = 0
        # where the commit in progress puts state copies and the slots it holds
        self._copies: list = []
        self._held: Held = []

    # ---- the step's commit ------------------------------------------------------------------
    def commit(self, r: Request, copies: list, held: Held) -> None:
        """Cache the full blocks ``r`` computed and take the checkpoints the policy wants at the
        step's end; state copies to run go to ``copies``, slots to free after the commit to
        ``held``."""
        h = self.h
        known = min(r.num_alloc, len(r.tokens))
        hashes = r.hashes
        if len(hashes) < known // h:
            extend_unit_hashes(hashes, r.tokens, known, h, r.extra, self.hash_fn, self.lookahead)
        # with lookahead hashes a computed unit whose next tokens are not known yet has no
        # hash: it is cached at a later commit, once they are
        cacheable = min(known, len(hashes) * h)
        ncached = r.ncached
        for m in self.attention:
            if cacheable // m.block_size > ncached[m.group_id]:  # a block filled since the last
                m.cache_computed(r, cacheable, self.promote)
        if self.state:
            if r.unkeyed:
                self.key_deferred(r, held)
            # the policy keeps, exports or rolls states through keep / export / roll
            self._copies, self._held = copies, held
            self.policy.step_end(r, r.num_alloc, known, self)

    def free_held(self, held: Held) -> None:
        """Free the commit's held slots, one call per pool."""
        by_pool: dict[IdCache, list[int]] = {}
        for pool, sid in held:
            by_pool.setdefault(pool, []).append(sid)
        for pool, sids in by_pool.items():
            pool.free(sids)

    def release_sources(self, r: Request) -> None:
        """Drop the cached entries ``r``'s hit copied from (held until the commit)."""
        for gid, sid in r.sources:
            self.pool[gid].free((sid,))
        r.sources = []

    # ---- the policy's actions (StateActions) -------------------------------------------------
    def keep(self, r: Request, position: int) -> None:
        self.checkpoint(r, position, self._copies, self._held)

    def export(self, r: Request, position: int) -> None:
        self.checkpoint(r, position, self.last_exports, self._held, export=True)

    def roll(self, r: Request, position: int) -> None:
        """Refresh the request's private end-of-request checkpoint to ``position``: one copy
        per state group, running slot -> end slot, in group order."""
        r.end_position = position
        if r.end_copies is not None:
            # every group has its slot (all but a request's first roll): the hot path of
            # ``last`` and ``marconi``, once per hash unit a request runs, over 36 state
            # groups in an aggregate layout
            self._copies.extend(r.end_copies)
            return
        ends, blocks = r.end_ckpt, r.blocks
        for gid in self.state:
            if gid not in ends:
                dst = self.spare_or_new(r, gid)
                if dst is not None:
                    ends[gid] = dst
        # taking a spare pops a group's last slot, never its running one: the copies can be
        # made after every group had its try
        made = [(gid, blocks[gid][0], ends[gid]) for gid in self.state if gid in ends]
        self._copies.extend(made)
        if len(ends) == len(self.state):
            r.end_copies = made

    # ---- checkpoints ------------------------------------------------------------------------
    def take_spare(self, r: Request, gid: int) -> int | None:
        """One of the request's reserved spare state slots (after its running slot), if any."""
        blocks = r.blocks[gid]
        if len(blocks) < 2:
            return None
        sid = blocks.pop()
        self.tables.set_row(gid, r.row, blocks)
        return sid

    def spare_or_new(self, r: Request, gid: int) -> int | None:
        """A spare slot, else a free or evictable id (best effort), else None."""
        sid = self.take_spare(r, gid)
        if sid is not None:
            return sid
        ids = self.pool[gid].allocate_some(1)
        return ids[0] if ids else None

    def checkpoint(
        self, r: Request, P: int, copies: list, held: Held, *, export: bool = False
    ) -> None:
        """Copy the running state into a new slot cached at ``P`` (released after the commit,
        so that no other checkpoint of this commit evicts it). Best effort per group: a group
        whose pool has no free or evictable id skips this checkpoint. ``export``: the state
        was exported from inside the step; ``copies`` gets ``(group, slot, P)`` instead.

        With lookahead hashes a decode step ending at ``P`` does not know the token after
        ``P`` yet, so ``P`` has no key: the state is copied now and keyed by the first commit
        that knows it (vLLM's state block stays in the request's table and is cached once its
        hash exists), or released when the request leaves first (:meth:`key_deferred`)."""
        unit = P // self.h - 1
        if unit >= len(r.hashes) and not self._hash_up_to(r, P):
            if not export:  # an export lies inside a prefill: the tokens after it are known
                taken = self._take_slots(r, None)
                if taken:
                    copies.extend((gid, r.blocks[gid][0], dst) for gid, dst in taken)
                    r.unkeyed.append((P, taken))
            return
        u = r.hashes[unit]
        taken = self._take_slots(r, u)
        if not taken:
            return
        if export:
            copies.extend((gid, dst, P) for gid, dst in taken)
        else:
            copies.extend((gid, r.blocks[gid][0], dst) for gid, dst in taken)
        self._key(r, unit, taken, held)

    def _take_slots(self, r: Request, u: bytes | None) -> list[tuple[int, int]]:
        """A slot per state group without a cached state at unit ``u`` (every group when
        ``u`` is None): the request's spares first, then free or evictable ids."""
        taken: list[tuple[int, int]] = []
        for pool, gids in self.state_pools:
            need = []
            for gid in gids:
                if u is not None and pool.lookup((gid, u)) is not None:
                    continue
                sid = self.take_spare(r, gid)
                if sid is not None:
                    taken.append((gid, sid))
                else:
                    need.append(gid)
            if need:
                taken.extend(zip(need, pool.allocate_some(len(need))))
        return taken

    def _key(self, r: Request, unit: int, taken: list[tuple[int, int]], held: Held) -> None:
        """Cache the slots ``taken`` (holding the state after ``unit``) under its key; they
        are released after the commit (``held``)."""
        u = r.hashes[unit]
        pool_of = self.pool
        cached = []
        for gid, dst in taken:
            pool = pool_of[gid]
            if pool.cache(dst, (gid, u)):
                cached.append((gid, dst))
            held.append((pool, dst))
        if not cached:
            return
        self.num_checkpoints += 1
        self.num_checkpoint_ids += len(cached)
        self.index.add_checkpoints(cached, unit, r.hashes, r.tokens, r.lora_id)
        if self.scorer is not None:
            self.scorer.accessed(u)

    def key_deferred(self, r: Request, held: Held) -> None:
        """Key the states :meth:`checkpoint` copied before their position had a key, where
        the tokens known now give it one."""
        h, waiting = self.h, []
        for P, taken in r.unkeyed:
            if P // h > len(r.hashes) and not self._hash_up_to(r, P):
                waiting.append((P, taken))
                continue
            # a state cached at P meanwhile (another request's) leaves this copy unneeded
            u = r.hashes[P // h - 1]
            fresh = [(g, s) for g, s in taken if self.pool[g].lookup((g, u)) is None]
            held.extend((self.pool[g], s) for g, s in taken if (g, s) not in fresh)
            self._key(r, P // h - 1, fresh, held)
        r.unkeyed = waiting

    def release_deferred(self, r: Request) -> None:
        """The request leaves: free the states still waiting for a key (vLLM frees a state
        block it never hashed)."""
        for _, taken in r.unkeyed:
            for gid, sid in taken:
                self.pool[gid].free((sid,))
        r.unkeyed = []

    # ---- at free ----------------------------------------------------------------------------
    def cache_end_state(self, r: Request) -> None:
        """``r`` is freed: cache its private end checkpoints (and the partly filled attention
        block up to them), then free their slots; the state its hit copied from, superseded,
        becomes the next to evict."""
        if self.caching and self.partial and (r.end_ckpt or r.last_mark):
            # the partly filled last block, up to the newest state kept in it: the end state,
            # or a state periodic / hash_boundary kept inside the prompt
            end = r.end_position if r.end_ckpt else 0
            self.cache_tail_blocks(r, max(end, r.last_mark))
        kept = False
        h = self.h
        P = r.end_position
        keyed = self.caching and (len(r.hashes) >= P // h or self._hash_up_to(r, P))
        for gid, sid in r.end_ckpt.items():
            pool = self.pool[gid]
            if keyed:
                key = (gid, r.hashes[P // h - 1])
                if pool.cache(sid, key):
                    self.index.add(key, sid, P // h - 1, r.hashes, 1, r.tokens, r.lora_id, True)
                    self.num_checkpoint_ids += 1
                    kept = True
                    if self.scorer is not None:
                        self.scorer.accessed(key[1])
            pool.free((sid,))
        self.num_checkpoints += kept
        if kept and r.hit_unit is not None:
            self.demote_superseded(r.hit_unit)
        r.end_ckpt = {}
        r.end_copies = None

    def _hash_up_to(self, r: Request, P: int) -> bool:
        """Hash ``r``'s units up to ``P`` with the tokens known now (a sampled token appended
        since the commit gives the unit before it its lookahead); whether ``P`` has a key."""
        extend_unit_hashes(r.hashes, r.tokens, P, self.h, r.extra, self.hash_fn, self.lookahead)
        return len(r.hashes) >= P // self.h

    def demote_superseded(self, unit: bytes) -> None:
        """A request hit the state at ``unit`` and cached its own end state further down the
        same chain: the KV up to ``unit`` stays reachable through the new state, so the old one
        only serves a prompt that ends or diverges exactly there. Unless the chain branches at
        ``unit`` (a shared prefix's branch point), it becomes the next state to evict (Marconi
        evicts such single-child nodes' states first for the same reason)."""
        full = self.full
        if not full or len(self.index.children.get((full[0], unit), ())) > 1:
            return
        for gid in self.state:
            pool = self.pool[gid]
            sid = pool.lookup((gid, unit))
            if sid is not None:
                pool.demote(sid)
        if self.scorer is not None:
            self.scorer.demote(unit)

    def cache_tail_blocks(self, r: Request, P: int) -> None:
        """Cache the partly filled attention block holding token ``P - 1`` (``P``: where a
        state was kept) as a *partial* entry covering its units up to ``P``.

        A full block is cached at commit, but the last block of a request is never full, and
        with large blocks it holds most of what a follow-up turn could reuse. Its first tokens
        are final, so a later hit at ``P`` copies them into a new block (``kv_copies``)."""
        for m in self.attention:
            m.cache_tail(r, P)
