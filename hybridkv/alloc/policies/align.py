"""``align``: vLLM 0.33's ``mamba_cache_mode="align"`` (:class:`AlignPolicy`, rules in
:class:`VllmAlign`, each with the vLLM function it follows).

A prompt runs in one chunk up to its last cacheable block boundary (or, with a backend that
exports the checkpoint from inside the prefill, in one chunk to its end); the states kept are
that boundary's (the *replay boundary*), the prompt's last hash-unit boundary when hits inside
a block are on, and the block boundary of a *junction*: a prefix that attention had cached but
the states had not, found when a request was admitted. ``prefix_cache_retention_interval``
(vLLM's option, default 0) adds states at every multiple of it that a step ends on (``None``:
at every block boundary a step ends on, the dense caching of a vLLM run with that setting).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..groups import group_roles
from .base import INF, CheckpointPolicy, StateActions

if TYPE_CHECKING:  # pragma: no cover
    from ...plan import MemoryPlan
    from ..request import Request

__all__ = ["AlignPolicy", "VllmAlign"]

_INF = INF


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class VllmAlign:
    """vLLM 0.33's ``align`` rules, for one allocator (no KV connector, no prefill context
    parallelism: what the simulator models; under MTP, vLLM 0.33's lookahead hashes or vLLM
    0.32's EAGLE block drop, rule 6; under decode context parallelism the attention groups'
    blocks span ``dcp`` times ``B``, so ``S = dcp * B``, and partial hits also take ``h ==
    B``).

    Sizes: ``B`` = the state groups' block size (vLLM: ``cache_config.block_size``, which is the
    Mamba block size in align mode), ``S`` = the scheduler block size (the lcm of every group's
    block size, ``resolve_kv_cache_block_sizes`` in ``vllm/v1/core/kv_cache_utils.py``; ``S ==
    B`` unless ``--kv-cache-dtype-skip-layers`` gave the quantized layers larger blocks or DCP
    sharded them), ``h`` =
    the hash unit (vLLM's ``prefix_match_unit``, by default the gcd of the groups' block sizes,
    i.e. ``B``). *Partial hits* are on when ``h <
    B`` and every attention group can look hashes up inside a block (full attention / MLA, or a
    block of ``h``): ``partial_hash_hits_enabled`` in ``kv_cache_utils.py``. Hits then land on
    ``A = h``, else on ``A = S`` (``HybridKVCacheCoordinator._cache_hit_alignment_tokens`` in
    ``vllm/v1/core/kv_cache_coordinator.py``). ``pos(n, u) = max(0, (n - max(1, L)) // u * u)``
    is ``get_mamba_prefill_checkpoint_position`` (``vllm/v1/kv_cache_interface.py``), the last
    boundary of ``u`` a resend of ``n`` tokens can hit (one token is always recomputed; under
    MTP a unit's hash needs the ``L`` tokens after it, ``hash_lookahead_tokens``).

    1. **Chunk ends** (:meth:`split`, ``Scheduler._mamba_block_aligned_split`` in
       ``vllm/v1/core/sched/scheduler.py``). For a prefill step from ``start`` with ``num_new``
       tokens offered (``prefill_end = max(prompt, num_tokens - 1)``; nothing is cut once
       ``start >= prefill_end``): a chunk that does not reach ``prefill_end`` ends on a multiple
       of ``B`` (unless that leaves nothing and ``B`` exceeds the step's token limit: a block
       wider than a chunk advances by sub-block chunks); then it stops at the first of these
       strictly inside it: the next multiple of ``B`` when ``start`` is inside a block; the last
       cacheable block boundary ``pos(num_tokens, B)``; with partial hits the prompt's last hash
       boundary ``pos(prompt, h)`` when it lies past that block boundary; the block-floored
       junction ``start + (J - start) // B * B`` when ``start < J < end``. So a prompt that fits
       the token budget runs in one chunk to its last cacheable block boundary and the rest in
       the next step; it is not cut at earlier block boundaries.
    2. **Exports from inside the prefill** (``prefill_checkpoint_alignment`` ``a``: vLLM's
       ``MambaSpec.prefill_checkpoint_alignment`` with ``num_prefill_checkpoint_blocks > 0``; 1
       for Mamba-2, ``MambaMixer2.get_kv_cache_spec``; for Gated DeltaNet under FlashInfer's
       prefill in vLLM 0.33, ``get_mamba_prefill_checkpoint_grid``: ``B``, or ``lcm(h, 64)``
       with a ``prefix_match_unit``; ``None`` for layers that cannot, and then the chunk is
       split as in 1). The final chunk ``[start, end)`` exports the state at ``cp = pos(end,
       A)`` if ``is_mamba_prefill_checkpoint_valid`` (``kv_cache_interface.py``) holds:
       ``start % h == 0``, ``cdiv(end, B) - 2 > (start - 1) // B``, ``start + h <= cp``,
       ``start < cp < end`` and ``(cp - start) % a == 0``; the scheduler then drops the
       block-boundary, tail and next-block stops of rule 1 (only a junction still cuts) and runs
       the prompt in one chunk. With a retention interval other than 0 every valid prefill
       chunk exports, not only the final one (``KVCacheCoordinator.get_num_blocks_to_allocate``
       passes ``prefill_end=0``; ``MambaManager._needs_internal_checkpoint``).
    3. **States kept** (``SingleTypeKVCacheManager.cache_blocks``,
       ``MambaManager.reachable_block_mask`` and ``MambaManager._cache_partial_tail_block`` in
       ``vllm/v1/core/single_type_kv_cache_manager.py``). A state exists only where a step ends
       (or is exported); earlier ones are dropped (``MambaManager.remove_skipped_blocks``).
       The state at the end ``P`` of a step (prefill chunk or decode token) is cached when

       - ``P`` is a multiple of ``B`` and the block mask keeps it: with
         ``prefix_cache_retention_interval`` ``None`` always; with ``R > 0`` when ``P % R ==
         0`` (or always if ``R <= B``); and in every case when ``P`` is a *reachable
         boundary*: the replay boundary ``pos(prompt, A) // B * B``
         (``replay_boundaries`` in ``kv_cache_coordinator.py``: a resend hits at most ``prompt
         - 1`` tokens) or the junction's ``J // A * A // B * B``. With the default ``R = 0``
         nothing else: states at other chunk ends and every decode block boundary are dropped;
       - or, with partial hits and no export in that step, ``P == pos(prompt, h)``: the
         prompt's last hash boundary, cached as a partial block (on a block boundary too,
         where under rule 6 it need not be a replay boundary).

       An exported state at ``cp`` is cached when ``cp == pos(prompt, A)`` (the prompt's
       checkpoint), or ``cp`` is a multiple of ``B`` that the retention interval keeps (``None``
       or ``R > 0`` as above, without the reachable boundaries), or ``cp == J``.
    4. **Junctions** (``KVCacheManager.get_computed_blocks`` with
       ``HybridKVCacheCoordinator.find_longest_cache_hit``): when a request is admitted with
       attention (the first group of the hit search, full attention) hitting past the hit every
       group agrees on, ``J`` = that attention hit (``request.shared_prefix_boundary``), else 0.
       Rules 1 and 3 then cut a chunk at, and keep, its block boundary, so that the *next*
       request sharing the prefix hits there. (vLLM's exact, unfloored junction checkpoint,
       ``enable_mamba_shared_prefix_checkpoint``, needs EAGLE and is not modelled.)
    5. **Hits** (``MambaManager.find_longest_cache_hit``): a state hit needs a cached state
       exactly at the hit length, searched on multiples of ``A`` (``h`` with partial hits).
       States cached in a step serve hits from the next step on (``cached_blocks_this_step``).
    6. **EAGLE's block drop** (``eagle_block_drop``: MTP under vLLM 0.32, or 0.33 with
       ``disable_lookahead_block_hashes``). The drafter's attention group looks a hit up one
       unit ``d`` further (``h`` with partial hits, else its block) and gives ``d`` back
       (``HybridKVCacheCoordinator.find_longest_cache_hit``, ``eagle_proof_margin``: the
       group managers do it), so the states move a unit earlier to meet it:
       ``pos(n, u) = max(0, n // u * u - u)`` (``get_mamba_prefill_checkpoint_position`` with
       ``drop_eagle_block``: no token is held back, a unit is), in every rule above; the
       reachable boundaries of rule 3 become ``(p - 1) // S * S - S`` and ``p // S * S - S``
       for a prompt of ``p`` (``replay_boundaries`` with ``use_eagle``: a resend and a longer
       sibling reach different blocks); and attention caches the prompt's tail up to
       ``p // h * h``, the whole prompt an EAGLE lookup reads before its drop
       (``FullAttentionManager._cache_partial_tail_block``), a unit past the tail state, so
       the commit of the step that computes it has work of its own (:meth:`next_position`).
       ``python -m paper.peers.vllm_align_hits`` holds these rules to vLLM 0.32's own
       ``KVCacheManager`` and scheduler split, request by request.

    vLLM 0.32 has the same rules; what differs is which layers export (rule 2): 0.32's Gated
    DeltaNet layers never do (``prefill_checkpoint_alignment=None``), Mamba-2 layers do in
    both (alignment 1). Pass the alignment accordingly.
    """

    def __init__(
        self,
        *,
        block_size: int,
        scheduler_block_size: int,
        hash_block_size: int,
        partial: bool,
        retention_interval: int | None = 0,
        prefill_checkpoint_alignment: int | None = None,
        hash_lookahead_tokens: int = 0,
        eagle_block_drop: bool = False,
    ) -> None:
        if eagle_block_drop and hash_lookahead_tokens:
            raise ValueError("EAGLE's block drop and lookahead hashes exclude each other")
        self.block = block_size
        #: rule 6: hits give a unit back, so states sit a unit earlier
        self.eagle = eagle_block_drop
        #: tokens a position's hash needs after it (``num_hash_lookahead_tokens``), at least the
        #: one token a resend always recomputes
        self.proof = max(1, hash_lookahead_tokens)
        self.scheduler_block = scheduler_block_size
        self.unit = hash_block_size
        self.partial = partial
        #: where hits land (vLLM's ``_cache_hit_alignment_tokens``): ``A`` above
        self.hit_unit = hash_block_size if partial else scheduler_block_size
        # Scheduler._mamba_block_aligned_split's ckpt_block_size (Scheduler.block_size is the
        # scheduler block size)
        self.ckpt_unit = hash_block_size if partial else scheduler_block_size
        self.retention = retention_interval
        self.export = prefill_checkpoint_alignment
        # retention intervals at or below one block keep every block (reachable_block_mask)
        self.dense = retention_interval is None or (
            retention_interval > 0 and retention_interval // block_size <= 1
        )
        self.period = (
            retention_interval // block_size * block_size
            if retention_interval and not self.dense
            else 0
        )

    def pos(self, num_tokens: int, unit: int) -> int:
        """``get_mamba_prefill_checkpoint_position``: the last boundary of ``unit`` a resend
        of ``num_tokens`` can hit (rule 6 under EAGLE's block drop)."""
        if self.eagle:
            return max(0, num_tokens // unit * unit - unit)
        return max(0, (num_tokens - self.proof) // unit * unit)

    def replay_boundaries(self, num_prompt: int) -> tuple[int, ...]:
        """``replay_boundaries``: where a later request replaying the prompt resumes, before
        rule 3 floors them to a state block (a resend hits at most ``num_prompt - 1`` tokens;
        under EAGLE's block drop a resend and a longer sibling land a block apart)."""
        if not self.eagle:
            return (num_prompt - 1,)
        S = self.scheduler_block
        resend = (num_prompt - 1) // S * S
        extension = num_prompt // S * S
        return (max(resend - S, 0), max(extension - S, 0))

    def attention_tail(self, num_prompt: int) -> int:
        """Where attention caches the prompt's tail as a partial entry with hits inside a
        block (``FullAttentionManager._cache_partial_tail_block``): the last hash boundary a
        resend hits, or under EAGLE's block drop the prompt's last, which its lookup reads
        before giving a unit back."""
        if self.eagle:
            return num_prompt // self.unit * self.unit
        return self.pos(num_prompt, self.unit)

    def export_valid(self, start: int, end: int, cp: int) -> bool:
        """``is_mamba_prefill_checkpoint_valid``: can the backend export ``cp`` in this query."""
        a = self.export
        if a is None:
            return False
        B, h = self.block, self.unit
        return (
            start % h == 0
            and _cdiv(end, B) - 2 > (start - 1) // B
            and start + h <= cp
            and start < cp < end
            and (cp - start) % a == 0
        )

    def boundary(self, tokens: int) -> int:
        """The state block a reachable boundary at ``tokens`` keeps (``reachable_block_mask``)."""
        A, B = self.hit_unit, self.block
        return tokens // A * A // B * B

    def split(
        self,
        start: int,
        num_new: int,
        num_tokens: int,
        num_prompt: int,
        junction: int,
        max_prefill_tokens: int,
    ) -> int:
        """Rule 1: the tokens of a prefill step of ``num_new`` offered from ``start``."""
        prefill_end = max(num_prompt, num_tokens - 1)
        if start >= prefill_end:
            return num_new
        B = self.block
        last = self.pos(num_tokens, B)
        end = start + num_new
        cp = self.pos(prefill_end, self.ckpt_unit)
        internal = end >= prefill_end and self.export_valid(start, end, cp)
        if internal:
            last = 0
        if end < prefill_end:
            aligned = end // B * B
            if aligned > start or max_prefill_tokens >= B:
                end = aligned
        tail = self.pos(num_prompt, self.unit) if self.partial and not internal else 0
        stops = (
            (start // B + 1) * B if start % B and not internal else 0,
            last,
            tail if last < tail < num_prompt else 0,
            start + (junction - start) // B * B if start < junction < end else 0,
        )
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)

    def _retained(self, P: int) -> bool:
        """The retention interval alone keeps the block ending at ``P`` (a multiple of B)."""
        return self.dense or (self.period > 0 and P % self.period == 0)

    def keeps_block(self, P: int, num_prompt: int, junction: int) -> bool:
        """Rule 3: the block mask keeps the state at ``P`` (a multiple of ``B``)."""
        if self._retained(P) or any(
            self.boundary(b) == P for b in self.replay_boundaries(num_prompt)
        ):
            return True
        return junction > 0 and self.boundary(junction) == P

    def export_at(self, start: int, end: int, num_prompt: int, num_tokens: int) -> int:
        """Rule 2: where the step ``[start, end)`` exports a state from inside (0: nowhere)."""
        if self.export is None or end - start < 2:
            return 0
        if end < max(num_prompt, num_tokens - 1) and self.retention == 0:
            return 0
        cp = self.pos(end, self.hit_unit)
        return cp if self.export_valid(start, end, cp) else 0

    def step_end(
        self, start: int, P: int, num_prompt: int, num_tokens: int, junction: int
    ) -> tuple[bool, int]:
        """Rule 3 at the end ``P`` of a step begun at ``start`` (``start < 0``: unknown, a
        one-token step): (cache the state at ``P``, position of an exported state to cache or
        0)."""
        cp = self.export_at(start, P, num_prompt, num_tokens) if start >= 0 else 0
        exported = cp > 0
        if exported and not (
            cp == self.pos(num_prompt, self.hit_unit)
            or (cp % self.block == 0 and self._retained(cp))
            or cp == junction
        ):
            cp = 0  # a transient state: vLLM evicts its block at once
        # the prompt's last hash boundary (MambaManager._cache_partial_tail_block, on a block
        # boundary too: under EAGLE's drop it need not be a replay boundary, which the
        # scheduler block floors)
        tail = self.partial and not exported and self.pos(num_prompt, self.unit) == P
        keep = tail or (P % self.block == 0 and self.keeps_block(P, num_prompt, junction))
        return keep, cp

    def next_position(self, after: int, num_prompt: int, junction: int) -> int:
        """The smallest step end ``P > after`` whose commit has work: rule 3 may keep a state
        there, or (with partial hits) the prompt's attention tail becomes computed, which under
        EAGLE's block drop lies a unit past the tail state (exports are found at the commit of
        the step that makes them)."""
        B = self.block
        best = _INF
        if self.dense:
            best = (after // B + 1) * B
        elif self.period:
            best = (after // self.period + 1) * self.period
        for p in (
            *(self.boundary(b) for b in self.replay_boundaries(num_prompt)),
            self.boundary(junction) if junction > 0 else 0,
            self.pos(num_prompt, self.unit) if self.partial else 0,
            self.attention_tail(num_prompt) if self.partial else 0,
        ):
            if after < p < best:
                best = p
        return best


class AlignPolicy(CheckpointPolicy):
    """vLLM 0.33's ``align`` (:class:`VllmAlign` has the rules): chunks split where vLLM's
    scheduler splits them, states kept at the replay boundary, the prompt's tail and junctions
    (plus the retention interval's), exported from inside a prefill where the backend can."""

    name = "align"
    admission_probe = "junction"
    state_slots_per_request = 2
    partial_hit_points = "keys"  # vLLM's BlockPool: hits inside a block land on its keys
    follows_eagle_block_drop = True

    def configure(self, plan: MemoryPlan) -> None:
        retention_interval = self.retention_interval
        prefill_checkpoint_alignment = self.export_alignment
        hash_block_size = self.h
        scheduler = plan.scheduler_block_size if plan.groups else self.block
        if retention_interval is not None and (
            retention_interval < 0 or retention_interval % scheduler
        ):
            raise ValueError(
                f"prefix_cache_retention_interval ({retention_interval}) must be None or a "
                f"non-negative multiple of the scheduler block size ({scheduler}), as vLLM "
                "requires"
            )
        if prefill_checkpoint_alignment is not None and prefill_checkpoint_alignment < 1:
            raise ValueError(
                "prefill_checkpoint_alignment must be None or >= 1, got "
                f"{prefill_checkpoint_alignment}"
            )
        # partial_hash_hits_enabled: a hash unit finer than the state block, and every
        # prefix-cacheable attention group can look hashes up inside a block (full attention,
        # MLA, and a sparse-attention indexer's keys: vLLM 0.33 keeps those as an
        # MLAAttentionSpec) or has blocks of one unit; a ring (CircularBufferSpec) is not
        # prefix-cacheable, so vLLM leaves it out of the question
        # (under DCP a hash unit equal to the state block is enough: the attention blocks it
        # shards span dcp of them, vLLM 0.33's `dcp_world_size > 1 and block_size >= hash`)
        scratch = group_roles(plan.groups).scratch
        sharded = any(g.dcp_size > 1 for g in plan.groups)
        partial = (
            bool(plan.state_groups)
            and (hash_block_size < self.block or (sharded and hash_block_size == self.block))
            and all(
                g.kind in ("full_attention", "mla", "indexer") or g.block_size == hash_block_size
                for g in plan.groups
                if not g.is_state and g.group_id not in scratch
            )
        )
        self.vllm: VllmAlign = VllmAlign(
            block_size=self.block,
            scheduler_block_size=scheduler,
            hash_block_size=hash_block_size,
            partial=partial,
            retention_interval=retention_interval,
            prefill_checkpoint_alignment=prefill_checkpoint_alignment,
            hash_lookahead_tokens=self.lookahead,
            eagle_block_drop=self.eagle_block_drop,
        )
        self.step = self.vllm.hit_unit

    @property
    def exports(self) -> bool:
        return self.vllm.export is not None

    @property
    def promotes_tail(self) -> bool:
        # hits inside a block (vLLM's partial hash hits): attention caches the prompt's tail
        return self.vllm.partial and self.partial_block_hits

    def admitted(self, r: Request, hit: int, probe_hit: int) -> None:
        if probe_hit > hit:
            r.junction = probe_hit

    def chunk_tokens(self, r: Request, offered: int, max_prefill_tokens: int) -> int:
        return self.split_prefill(r, offered, max_prefill_tokens)

    def split_prefill(self, r: Request, offered: int, max_prefill_tokens: int) -> int:
        if offered <= 0:
            return offered
        return self.vllm.split(
            r.num_alloc, offered, len(r.tokens), r.nprompt, r.junction, max_prefill_tokens
        )

    def chunk_stop(self, r: Request) -> int | None:
        rest = len(r.tokens) - r.num_alloc
        end = r.num_alloc + self.split_prefill(r, rest, _INF)
        return end if end < len(r.tokens) else None

    def next_work(self, r: Request) -> int:
        return self.vllm.next_position(r.num_alloc, r.nprompt, r.junction)

    def step_end(self, r: Request, P: int, known: int, act: StateActions) -> None:
        vllm = self.vllm
        start, r.step_start = r.step_start, -1
        if self.promotes_tail:
            # FullAttentionManager._cache_partial_tail_block: the block holding the
            # prompt's last hash boundary is cached up to it once computed
            t = vllm.attention_tail(r.nprompt)
            if 0 < t <= known:
                act.cache_tail_blocks(r, t)
        if known == P and P > 0:
            keep, cp = vllm.step_end(start, P, r.nprompt, len(r.tokens), r.junction)
            if cp:
                act.export(r, cp)
            if keep:
                act.keep(r, P)
