"""The allocator's options, in one frozen dataclass (:class:`AllocatorOptions`).

Everything that builds an allocator (the simulator's ``SimConfig``, the engine, replay, the
advisor, the CLI) takes one of these, so each option is named, defaulted, documented and
validated here only. :meth:`AllocatorOptions.for_plan` checks what depends on a plan (the hash
unit divides every block) and resolves ``"auto"`` (the prefill checkpoint alignment of the
plan's vLLM target).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .groups import group_roles
from .hashing import HASH_ALGOS
from .marconi import PrefillFlops
from .policies import POLICY_CLASSES

if TYPE_CHECKING:  # pragma: no cover
    from ..plan import MemoryPlan

__all__ = ["AUTO", "EVICTIONS", "PARTIAL_HIT_POINTS", "AllocatorOptions"]

#: ``prefill_checkpoint_alignment`` taken from the plan's vLLM target; ``eviction``: the
#: policy's own
AUTO = "auto"
#: the evictions ``AllocatorOptions.eviction`` names
EVICTIONS = (AUTO, "lru", "marconi")
#: where ``AllocatorOptions.partial_hit_points`` lets a hit inside a block land
PARTIAL_HIT_POINTS = (AUTO, "units", "keys")


@dataclass(frozen=True)
class AllocatorOptions:
    """How a :class:`~.manager.HybridAllocator` caches and checkpoints.

    - ``enable_prefix_caching``: off, nothing is cached and no state checkpoint is taken.
    - ``hash_block_size``: tokens per prefix-cache hash unit; divides every group's block size
      (vLLM's ``prefix_match_unit``; vLLM's default is the block size).
    - ``checkpoint_policy``: ``align`` (vLLM 0.33's), ``align_every_block``, ``last``,
      ``marconi``, ``periodic`` or ``hash_boundary`` (:mod:`.checkpoint`).
    - ``max_model_len``: tokens a request may reach.
    - ``partial_block_hits``: let attention hit inside a block (at hash-unit granularity) by
      copying the reused tokens into a new block; pays off where state checkpoints are finer
      than the attention block (``last``/``marconi`` with large blocks).
    - ``partial_hit_points``: where such a hit may land. ``"units"``: at any hash unit a cached
      block holds that agrees with the prompt (hybridkv's cache). ``"keys"``: only where vLLM
      0.33 keys an entry (``BlockPool``): a full block's last unit, or a prompt's tail cached as
      a partial entry, which a block's promotion to a full entry removes; what vLLM serves,
      fewer hits where states are kept finer than the attention blocks' keys (``--prefix-match-
      unit`` below the block, decode context parallelism). ``"auto"`` (default): the policy's
      own (``keys`` for vLLM's ``align``, ``units`` for hybridkv's policies).
    - ``hash_algo``: ``sha256``, ``blake2b`` or ``builtin`` (:mod:`.hashing`).
    - ``marconi_alpha``, ``marconi_flops`` (Marconi's eviction only): its weight of FLOPs saved
      per byte against recency (a number >= 0; 0 is recency alone), or ``"auto"`` (default):
      tuned online as Marconi tunes it wherever a run can replay what it served (the
      simulator, :func:`hybridkv.replay.replay`, ``advise``), from Marconi's starting 0, which
      an allocator run without a tuner keeps. No constant suits every workload: multi-turn
      chat wants recency (0), Mooncake's long shared documents the FLOPs' weight (paper
      section 4.8); a number where the eviction is LRU is refused. Then the FLOP model
      (``costmodel.StepCoster(model, gpu).prefill_flops``; default: every token costs the
      same). ``eviction_window``: how many of the oldest cached ids a pool's fallback (no
      cached state is a candidate) looks at.
    - ``prefix_cache_retention_interval`` (``align`` only): vLLM's option: 0 keeps only the
      replay boundary and junction states, ``R > 0`` also every multiple of ``R`` a step ends
      on, ``None`` every block boundary a step ends on.
    - ``prefill_checkpoint_alignment``: the token alignment at which the state layers' prefill
      kernels export a checkpoint from inside a prefill (vLLM's
      ``MambaSpec.prefill_checkpoint_alignment``), ``None`` when they cannot (the prefill is
      split instead: vLLM 0.32's Gated DeltaNet, or any GPU without FlashInfer's GDN prefill),
      1 for Mamba-2, the block size for vLLM 0.33's Gated DeltaNet under FlashInfer
      (``lcm(hash_block_size, 64)`` with hits inside a block); ``"auto"``: the plan's vLLM
      target's (:meth:`hybridkv.target.VllmRules.prefill_checkpoint_grid`).
    - ``checkpoint_interval`` (``periodic`` / ``hash_boundary`` only, default 512): where those
      keep states inside a prompt; a multiple of ``hash_block_size``.
    - ``evict_unreachable``: when an eviction leaves cached entries no hit can use, evict them
      too (:mod:`.reach`); ``False`` keeps them until they age out (vLLM's behaviour).
    - ``eviction``: ``"lru"`` (every pool's least recently used cached entry goes first),
      ``"marconi"`` (Marconi's utility: recency against FLOPs saved per byte kept, weighed by
      ``marconi_alpha``, across KV and states: :mod:`.marconi`) or ``"auto"``: the checkpoint
      policy's own (``marconi`` and ``hash_ladder``: ``"marconi"``; the others ``"lru"``).
    - ``marconi_across_groups`` (Marconi's eviction only): in a pool whose groups have ids of
      their own (``two_level``), one evictor chooses the cached segment of least utility across
      groups;
      ``False`` (an ablation) leaves it to each group's evictor.
    - ``hash_lookahead_tokens``: tokens after each hash unit that its hash also covers, so a
      unit is hashed (cached, hit) only once they are known and a hit ending on it needs them
      equal: vLLM 0.33's lookahead block hashes under MTP, whose drafter KV at a unit's last
      position depends on the next token (:mod:`.hashing`); 0 for plain hashes; ``"auto"``:
      the plan's vLLM target's (:attr:`hybridkv.target.VllmRules.hash_lookahead_tokens`).
    - ``eagle_block_drop``: vLLM's EAGLE block drop (``SpeculativeConfig.use_eagle_block_drop``:
      vLLM 0.32 under MTP, 0.33 with ``disable_lookahead_block_hashes``): the drafter's group
      (:attr:`hybridkv.plan.KVCacheGroup.holds_drafter`, every attention group of its spec;
      all full-attention groups where no group holds a drafter, as vLLM falls back to) looks
      a hit up one drop unit further (a hash unit where hits land inside a block, else a
      block) and gives that unit back, so a hit at ``P`` needs that group's KV cached to
      ``P`` plus the unit: the drafter's KV at ``P - 1`` is recomputed from the prompt's own
      next token. ``align`` then keeps its states a unit earlier, as vLLM does
      (:class:`.policies.align.VllmAlign`); the eviction cascade keeps the unit past each
      state. ``"auto"`` (default): the plan's vLLM target's
      (:attr:`hybridkv.target.VllmRules.eagle_block_drop`) for ``align``; off for hybridkv's
      own policies (:attr:`.policies.CheckpointPolicy.follows_eagle_block_drop`), which place
      their states for hits without a drop. Not together with ``hash_lookahead_tokens``:
      vLLM proves the next token with one or the other.
    - ``kv_events``: build vLLM's KV events (``BlockStored`` with the block's tokens,
      ``BlockRemoved``, ``AllBlocksCleared``: :meth:`~.manager.HybridAllocator.take_events`)
      for a subscriber; ``False`` builds none (the simulator, where nobody subscribes: building
      and dropping them cost a tenth of its time). Nothing else depends on it.
    """

    enable_prefix_caching: bool = True
    hash_block_size: int = 16
    checkpoint_policy: str = "align"
    max_model_len: int = 32768
    partial_block_hits: bool = True
    partial_hit_points: str = AUTO
    hash_algo: str = "sha256"
    marconi_alpha: float | str = AUTO
    marconi_flops: PrefillFlops | None = field(default=None, compare=False)
    eviction_window: int = 32
    prefix_cache_retention_interval: int | None = 0
    prefill_checkpoint_alignment: int | str | None = AUTO
    checkpoint_interval: int | None = None
    evict_unreachable: bool = True
    marconi_across_groups: bool = True
    eviction: str = AUTO
    hash_lookahead_tokens: int | str = AUTO
    eagle_block_drop: bool | str = AUTO
    kv_events: bool = True

    def __post_init__(self) -> None:
        for name in ("hash_block_size", "max_model_len", "eviction_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.checkpoint_policy not in POLICY_CLASSES:
            raise ConfigError(
                f"checkpoint_policy must be one of {', '.join(POLICY_CLASSES)}, "
                f"got {self.checkpoint_policy!r}"
            )
        if self.hash_algo not in HASH_ALGOS:
            raise ConfigError(
                f"hash_algo must be one of {', '.join(HASH_ALGOS)}, got {self.hash_algo!r}"
            )
        if self.partial_hit_points not in PARTIAL_HIT_POINTS:
            raise ConfigError(
                f"partial_hit_points must be one of {', '.join(PARTIAL_HIT_POINTS)}, got "
                f"{self.partial_hit_points!r}"
            )
        if self.eviction not in EVICTIONS:
            raise ConfigError(
                f"eviction must be one of {', '.join(EVICTIONS)}, got {self.eviction!r}"
            )
        self._check_marconi_alpha()
        a = self.prefill_checkpoint_alignment
        bad_int = isinstance(a, bool) or not isinstance(a, int) or a < 1
        if a != AUTO and a is not None and bad_int:
            raise ConfigError(
                f"prefill_checkpoint_alignment must be 'auto', None or an integer >= 1, got {a!r}"
            )
        n = self.hash_lookahead_tokens
        if n != AUTO and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ConfigError(
                f"hash_lookahead_tokens must be 'auto' or an integer >= 0, got {n!r}"
            )
        drop = self.eagle_block_drop
        if drop != AUTO and not isinstance(drop, bool):
            raise ConfigError(f"eagle_block_drop must be 'auto', True or False, got {drop!r}")
        if drop is True and n != AUTO and n:
            raise ConfigError(
                f"eagle_block_drop=True with hash_lookahead_tokens={n} (given, or under 'auto' "
                "the plan's vLLM target's): vLLM proves the token after a hit for an MTP "
                "drafter with one or the other (0.33's lookahead hashes clear the drop); set "
                "hash_lookahead_tokens=0 or eagle_block_drop=False"
            )
        r = self.prefix_cache_retention_interval
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
            raise ConfigError(
                f"prefix_cache_retention_interval must be None or an integer >= 0, got {r!r}"
            )
        try:
            POLICY_CLASSES[self.checkpoint_policy].check_interval(
                self.checkpoint_interval, self.hash_block_size
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def resolved_eviction(self) -> str:
        """``"lru"`` or ``"marconi"``: :attr:`eviction`, or the policy's own for ``"auto"``."""
        if self.eviction != AUTO:
            return self.eviction
        return POLICY_CLASSES[self.checkpoint_policy].eviction

    def _check_marconi_alpha(self) -> None:
        alpha = self.marconi_alpha
        if alpha == AUTO:
            return
        if isinstance(alpha, (bool, str)) or not isinstance(alpha, (int, float)) or not alpha >= 0:
            raise ConfigError(f"marconi_alpha must be 'auto' or a number >= 0, got {alpha!r}")
        if self.resolved_eviction() != "marconi":  # a fixed alpha nothing would read
            raise ConfigError(
                f"marconi_alpha={alpha!r} weighs Marconi's eviction, which checkpoint_policy "
                f"{self.checkpoint_policy!r} with eviction={self.eviction!r} runs without; "
                "leave marconi_alpha 'auto' or set eviction='marconi'"
            )

    @property
    def tunes_marconi_alpha(self) -> bool:
        """Whether a run that can replay what it served tunes Marconi's alpha online: the
        eviction is Marconi's and ``marconi_alpha`` is ``"auto"``."""
        return self.marconi_alpha == AUTO and self.resolved_eviction() == "marconi"

    def starting_marconi_alpha(self) -> float | None:
        """The alpha Marconi's eviction starts at: the fixed one, or under ``"auto"`` Marconi's
        0 (a tuner may change it); None under LRU eviction."""
        if self.resolved_eviction() != "marconi":
            return None
        return 0.0 if self.marconi_alpha == AUTO else float(self.marconi_alpha)

    def resolved_partial_hit_points(self) -> str:
        """``"units"`` or ``"keys"``: :attr:`partial_hit_points`, or the policy's own for
        ``"auto"``."""
        if self.partial_hit_points != AUTO:
            return self.partial_hit_points
        return POLICY_CLASSES[self.checkpoint_policy].partial_hit_points

    def replace(self, **changes: Any) -> AllocatorOptions:
        """A copy with ``changes`` (validated again); unknown names raise :class:`ConfigError`."""
        unknown = sorted(set(changes) - set(self.names()))
        if unknown:
            raise ConfigError(
                f"unknown allocator option(s) {', '.join(unknown)}; the options are "
                f"{', '.join(self.names())}"
            )
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def as_dict(self) -> dict[str, Any]:
        """The options as plain values (``marconi_flops`` by its repr), for result files."""
        out = {f: getattr(self, f) for f in self.names()}
        if out["marconi_flops"] is not None:
            out["marconi_flops"] = repr(out["marconi_flops"])
        return out

    def for_plan(self, plan: MemoryPlan) -> AllocatorOptions:
        """These options checked against ``plan``, with ``"auto"`` resolved: the prefill
        checkpoint alignment the plan's vLLM target exports at (Mamba-2 anywhere, Qwen's GDN
        under FlashInfer on its grid, otherwise none: the prefill is split), its hash
        lookahead (MTP under vLLM 0.33, otherwise 0) and its EAGLE block drop (MTP under vLLM
        0.32, for ``align``)."""
        h = self.hash_block_size
        # a ring (vLLM's CircularBufferSpec) is one block per request, never hashed
        # (hybridkv.alloc.groups.ring): its block size need not divide into hash units
        scratch = group_roles(plan.groups).scratch
        for g in plan.groups:
            if g.group_id not in scratch and g.block_size % h:
                raise ConfigError(
                    f"group {g.group_id} block_size {g.block_size} is not a multiple of "
                    f"hash_block_size {h}; pick a divisor of every block size"
                )
        resolved = self
        if self.hash_lookahead_tokens == AUTO:
            lookahead = plan.vllm.hash_lookahead_tokens if plan.vllm is not None else 0
            resolved = dataclasses.replace(resolved, hash_lookahead_tokens=lookahead)
        if self.eagle_block_drop == AUTO:
            drop = (
                plan.vllm is not None
                and plan.vllm.eagle_block_drop
                and POLICY_CLASSES[self.checkpoint_policy].follows_eagle_block_drop
            )
            resolved = dataclasses.replace(resolved, eagle_block_drop=bool(drop))
        if resolved.eagle_block_drop and resolved.resolved_eviction() == "marconi":
            raise ConfigError(
                "eagle_block_drop with Marconi's eviction: its segments do not keep the unit "
                "a hit looks up past each state, so its victims are not modelled under the "
                "drop; use eviction='lru'"
            )
        if resolved.eagle_block_drop:
            windowed = [
                g.group_id for g in plan.groups if g.kind == "sliding_window" and g.sliding_window
            ]
            if windowed and not any(g.holds_drafter for g in plan.groups):
                raise ConfigError(
                    f"eagle_block_drop on a plan with no drafter's group: vLLM then drops a "
                    f"block in every group, sliding-window groups {windowed} included, whose "
                    "drop (one more contiguous block per hit) hybridkv does not model"
                )
        if self.prefill_checkpoint_alignment != AUTO:
            return resolved
        grid = (
            plan.vllm.prefill_checkpoint_grid(plan.state_groups[0].block_size, h)
            if plan.vllm is not None and plan.state_groups
            else None
        )
        return dataclasses.replace(resolved, prefill_checkpoint_alignment=grid)
