"""State checkpoint policies: where a request's recurrent state is kept for later prefix hits.

A state can only be reused at exactly the token it was taken at, and each one costs a whole
state page, so the policy decides which positions are worth a page. A checkpoint is taken when a
scheduler step *ends* at a chosen position (the state exists nowhere else), by copying the
running state into another slot after the forward pass; a backend that exports states from
inside a prefill (vLLM's prefill checkpoint blocks) also gives one position inside the step.

- ``align``: vLLM's ``mamba_cache_mode="align"`` as vLLM 0.33 runs it (:class:`VllmAlign` has
  the rules, each with the vLLM function it follows). A prompt runs in one chunk up to its last
  cacheable block boundary (or, with a backend that exports the checkpoint from inside the
  prefill, in one chunk to its end); the states kept are that boundary's (the *replay
  boundary*), the prompt's last hash-unit boundary when hits inside a block are on, and the
  block boundary of a *junction*: a prefix that attention had cached but the states had not,
  found when a request was admitted. ``prefix_cache_retention_interval`` (vLLM's option, default
  0) adds states at every multiple of it that a step ends on (``None``: at every block boundary
  a step ends on, the dense caching of a vLLM run with that setting).
- ``align_every_block`` (not vLLM's): prefill chunks end at every multiple of the state groups'
  block size and every block boundary a step ends on is cached, decode included. Hits land on
  the largest block multiple of a shared prefix: the upper bound of align-style caching while
  memory is ample (each state takes a page, so under pressure they evict one another).
- ``last``: only the state at the end of each request. While it runs, the request keeps a private
  rolling checkpoint at the last hash-unit boundary a step ended on (decode ends a step on every
  token, so it is at most ``hash_block_size - 1`` tokens old); at ``free()`` it is cached. This
  serves multi-turn reuse (the next turn extends the whole previous conversation) at one page per
  conversation.
- ``marconi`` (Marconi, MLSys'25): ``last`` plus a checkpoint at the *branch point* of a request
  whose prompt diverges from a cached prefix (attention KV is cached past the point where the
  state hit stops, so another request shared these tokens: the next one will too). Eviction
  weighs recency against compute saved per byte (:mod:`.marconi`). Its admission is
  what the name means when comparing policies: a state is admitted at a prefix only once a
  second request has shown that prefix to be shared.
- ``periodic`` (``checkpoint_interval`` ``N``): ``last`` plus a state at every multiple of ``N``
  inside each prompt, exported from inside the prefill (SGLang keeps extra state buffers at a
  fixed interval; Mamba-2's chunked scan and the chunked Gated-DeltaNet kernels compute the
  state at every chunk boundary anyway). A later prompt sharing ``P`` tokens hits at the last
  multiple of ``N`` below ``P``, whatever ``P`` is; each kept state costs a whole state page,
  about ``state / N`` bytes per prompt token.
- ``hash_boundary`` (``checkpoint_interval`` ``N``): ``last`` plus one state per prompt, at its
  last multiple of ``N`` (``N`` = a trace's hash unit: Mooncake's 512). A request that shares
  every whole ``N``-token block of an earlier prompt (the next turn of a conversation as a
  block-hashed trace records it, or another question on the same document) hits there.

Where a backend cannot export from inside a prefill (``prefill_checkpoint_alignment`` ``None``,
or an interval that is not a multiple of it), ``periodic`` and ``hash_boundary`` end prefill
chunks at those positions instead (:meth:`CheckpointPolicy.next_mark`, asked through the
allocator's ``next_checkpoint``): the same states, more, smaller steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ..plan import MemoryPlan

__all__ = [
    "ALL_POLICIES",
    "CACHE",
    "DEFAULT_CHECKPOINT_INTERVAL",
    "NONE",
    "POLICIES",
    "RECOVERY_POLICIES",
    "ROLLING",
    "CheckpointPolicy",
    "VllmAlign",
]

NONE, CACHE, ROLLING = 0, 1, 2
#: the policies a deployment can choose between (``align`` is vLLM's)
POLICIES = ("align", "last", "marconi")
#: policies that keep extra states inside prompts, to recover reuse the others miss
RECOVERY_POLICIES = ("periodic", "hash_boundary")
#: every policy name the allocator accepts: ``align_every_block`` is a bound, not a system
ALL_POLICIES = (*POLICIES, *RECOVERY_POLICIES, "align_every_block")
#: ``checkpoint_interval`` when none is given: Mooncake's hash unit
DEFAULT_CHECKPOINT_INTERVAL = 512

_INF = 1 << 62


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class VllmAlign:
    """vLLM 0.33's ``align`` rules, for one allocator (no EAGLE/MTP, no lookahead hashes, no KV
    connector, no context parallelism: what the simulator models).

    Sizes: ``B`` = the state groups' block size (vLLM: ``cache_config.block_size``, which is the
    Mamba block size in align mode), ``S`` = the scheduler block size (the lcm of every group's
    block size, ``resolve_kv_cache_block_sizes`` in ``vllm/v1/core/kv_cache_utils.py``; ``S ==
    B`` in every hybridkv layout), ``h`` = the hash unit (vLLM's ``prefix_match_unit``, by
    default the gcd of the groups' block sizes, i.e. ``B``). *Partial hits* are on when ``h <
    B`` and every attention group can look hashes up inside a block (full attention / MLA, or a
    block of ``h``): ``partial_hash_hits_enabled`` in ``kv_cache_utils.py``. Hits then land on
    ``A = h``, else on ``A = S`` (``HybridKVCacheCoordinator._cache_hit_alignment_tokens`` in
    ``vllm/v1/core/kv_cache_coordinator.py``). ``pos(n, u) = max(0, (n - 1) // u * u)`` is
    ``get_mamba_prefill_checkpoint_position`` (``vllm/v1/kv_cache_interface.py``), the last
    boundary of ``u`` a resend of ``n`` tokens can hit (one token is always recomputed).

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
         prompt's last hash boundary, cached as a partial block.

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
    ) -> None:
        self.B = block_size
        self.S = scheduler_block_size
        self.h = hash_block_size
        self.partial = partial
        self.A = hash_block_size if partial else scheduler_block_size
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

    @staticmethod
    def pos(num_tokens: int, unit: int) -> int:
        """``get_mamba_prefill_checkpoint_position`` without EAGLE or lookahead hashes."""
        return max(0, (num_tokens - 1) // unit * unit)

    def export_valid(self, start: int, end: int, cp: int) -> bool:
        """``is_mamba_prefill_checkpoint_valid``: can the backend export ``cp`` in this query."""
        a = self.export
        if a is None:
            return False
        B, h = self.B, self.h
        return (
            start % h == 0
            and _cdiv(end, B) - 2 > (start - 1) // B
            and start + h <= cp
            and start < cp < end
            and (cp - start) % a == 0
        )

    def boundary(self, tokens: int) -> int:
        """The state block a reachable boundary at ``tokens`` keeps (``reachable_block_mask``)."""
        return tokens // self.A * self.A // self.B * self.B

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
        B = self.B
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
        tail = self.pos(num_prompt, self.h) if self.partial and not internal else 0
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
        if self._retained(P) or self.boundary(num_prompt - 1) == P:
            return True
        return junction > 0 and self.boundary(junction) == P

    def export_at(self, start: int, end: int, num_prompt: int, num_tokens: int) -> int:
        """Rule 2: where the step ``[start, end)`` exports a state from inside (0: nowhere)."""
        if self.export is None or end - start < 2:
            return 0
        if end < max(num_prompt, num_tokens - 1) and self.retention == 0:
            return 0
        cp = self.pos(end, self.A)
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
            cp == self.pos(num_prompt, self.A)
            or (cp % self.B == 0 and self._retained(cp))
            or cp == junction
        ):
            cp = 0  # a transient state: vLLM evicts its block at once
        if P % self.B == 0:
            keep = self.keeps_block(P, num_prompt, junction)
        else:
            keep = self.partial and not exported and self.pos(num_prompt, self.h) == P
        return keep, cp

    def next_position(self, after: int, num_prompt: int, junction: int) -> int:
        """The smallest step end ``P > after`` at which rule 3 may keep a state (exports are
        found at the commit of the step that makes them)."""
        B = self.B
        best = _INF
        if self.dense:
            best = (after // B + 1) * B
        elif self.period:
            best = (after // self.period + 1) * self.period
        for p in (
            self.boundary(num_prompt - 1),
            self.boundary(junction) if junction > 0 else 0,
            self.pos(num_prompt, self.h) if self.partial else 0,
        ):
            if after < p < best:
                best = p
        return best


class CheckpointPolicy:
    """What to do with the state when a step ends at token ``P``: nothing, ``CACHE`` (take a
    checkpoint and cache it) or ``ROLLING`` (refresh the request's private end checkpoint).
    ``align`` delegates to :attr:`vllm` (:class:`VllmAlign`), which needs the request's prompt
    length, junction and step start."""

    def __init__(
        self,
        name: str,
        plan: MemoryPlan,
        hash_block_size: int,
        *,
        retention_interval: int | None = 0,
        prefill_checkpoint_alignment: int | None = None,
        checkpoint_interval: int | None = None,
    ) -> None:
        if name not in ALL_POLICIES:
            raise ValueError(
                f"checkpoint_policy must be one of {', '.join(ALL_POLICIES)}, got {name!r}"
            )
        self.name = name
        # align: every state group checkpoints at its block multiples; they share one size in
        # every layout, and the plan's granularity (their lcm) keeps them in step if they did not.
        block = plan.checkpoint_granularity if plan.state_groups else hash_block_size
        self.block = block
        self.keeps_end_state = name in ("last", "marconi", *RECOVERY_POLICIES)
        self.branches = name == "marconi"
        self.vllm: VllmAlign | None = None
        #: periodic / hash_boundary: the interval of the states kept inside prompts (0: none)
        self.interval = 0
        #: those states are exported from inside a prefill step (else chunks end at them)
        self.exports_marks = False
        if checkpoint_interval is not None and name not in RECOVERY_POLICIES:
            raise ValueError(
                f"checkpoint_interval applies to the {' and '.join(RECOVERY_POLICIES)} policies, "
                f"not {name!r}; leave it unset"
            )
        if name in RECOVERY_POLICIES:
            n = DEFAULT_CHECKPOINT_INTERVAL if checkpoint_interval is None else checkpoint_interval
            if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n % hash_block_size:
                raise ValueError(
                    f"checkpoint_interval must be a positive multiple of the hash unit "
                    f"({hash_block_size} tokens): a state is only found at a hash boundary; "
                    f"got {n!r}"
                )
            self.interval = n
            a = prefill_checkpoint_alignment
            self.exports_marks = a is not None and a >= 1 and n % a == 0
        if name == "align_every_block":
            self.step = block
        elif name == "align":
            scheduler = plan.scheduler_block_size if plan.groups else block
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
            # attention group can look hashes up inside a block (full attention, MLA) or has
            # blocks of one unit
            partial = (
                bool(plan.state_groups)
                and hash_block_size < block
                and all(
                    g.kind in ("full_attention", "mla") or g.block_size == hash_block_size
                    for g in plan.groups
                    if not g.is_state
                )
            )
            self.vllm = VllmAlign(
                block_size=block,
                scheduler_block_size=scheduler,
                hash_block_size=hash_block_size,
                partial=partial,
                retention_interval=retention_interval,
                prefill_checkpoint_alignment=prefill_checkpoint_alignment,
            )
            self.step = self.vllm.A
        else:
            self.step = hash_block_size

    def marks(self, start: int, end: int, num_prompt: int) -> list[int]:
        """``periodic`` / ``hash_boundary``: the positions in ``(start, end]`` at which a state
        is kept inside the prompt (states strictly inside a prompt: the end state is
        ``last``'s)."""
        N = self.interval
        if not N:
            return []
        top = min(end, num_prompt - 1)
        if self.name == "hash_boundary":
            m = (num_prompt - 1) // N * N
            return [m] if start < m <= top and m > 0 else []
        return list(range((start // N + 1) * N, top + 1, N))

    def next_mark(self, after: int, num_prompt: int) -> int | None:
        """The first position of :meth:`marks` past ``after``, or None."""
        if self.name == "periodic":
            m = (after // self.interval + 1) * self.interval
            return m if m < num_prompt else None
        found = self.marks(after, num_prompt - 1, num_prompt)
        return found[0] if found else None

    def at_step_end(self, P: int, branch_at: int, num_prompt: int = 0) -> int:
        """For every policy but ``align`` (:class:`VllmAlign`); ``num_prompt`` locates the
        states ``periodic`` and ``hash_boundary`` keep inside a prompt."""
        if P <= 0:
            return NONE
        if self.branches and branch_at == P:
            return CACHE
        if self.interval and not self.exports_marks and self.marks(P - 1, P, num_prompt):
            return CACHE
        if P % self.step:
            return NONE
        return ROLLING if self.keeps_end_state else CACHE

    def next_position(self, after: int, branch_at: int) -> int:
        """The smallest P > ``after`` where :meth:`at_step_end` may act."""
        nxt = (after // self.step + 1) * self.step
        if self.branches and after < branch_at < nxt:
            return branch_at
        return nxt
