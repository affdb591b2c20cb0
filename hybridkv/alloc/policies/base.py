"""The checkpoint-policy protocol (:class:`CheckpointPolicy`) and what every policy shares.

A policy answers four questions for the allocator, and nobody else asks them:

1. **Where a prefill chunk ends** (:meth:`CheckpointPolicy.chunk_tokens`): a state can only be
   kept where a step ends (or where the backend exports it from inside a prefill), so a policy
   that wants a state inside a prompt ends a chunk there. The scheduler and replay ask this
   through :meth:`HybridAllocator.prefill_chunk <hybridkv.alloc.HybridAllocator.prefill_chunk>`.
2. **Which states it keeps when a step ends** (:meth:`CheckpointPolicy.step_end`): cache a
   checkpoint at the step's end, refresh the request's private end state (cached when it is
   freed), or nothing; and
3. **what it exports from inside a prefill step** (also :meth:`step_end`, through
   :meth:`StateActions.export`), for backends that emit states mid-prefill;
4. **its eviction preferences** (:attr:`CheckpointPolicy.eviction`, installed by
   :meth:`CheckpointPolicy.install_eviction`): ``marconi`` and ``hash_ladder`` replace LRU
   with Marconi's value-weighted victim choice; the others keep the pools' LRU.
   ``AllocatorOptions.eviction`` overrides it.

Besides: what it learns when a request is admitted (:attr:`CheckpointPolicy.admission_probe`,
:meth:`CheckpointPolicy.admitted`), where the commit next has work for a request
(:meth:`CheckpointPolicy.next_work`: the allocator's fast path runs up to it), and the spacing
of the positions a state hit is searched at (:attr:`CheckpointPolicy.step`).

A new policy is one module defining a subclass, plus its line in
:data:`.registry.POLICY_CLASSES`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from ...plan import MemoryPlan
    from ..request import Request

__all__ = [
    "DEFAULT_CHECKPOINT_INTERVAL",
    "INF",
    "POLICIES",
    "RECOVERY_POLICIES",
    "CheckpointPolicy",
    "EvictionHooks",
    "StateActions",
    "budget_cut",
]

#: the policies a deployment can choose between (``align`` is vLLM's)
POLICIES = ("align", "last", "marconi")
#: policies that keep extra states inside prompts, to recover reuse the others miss
RECOVERY_POLICIES = ("periodic", "hash_boundary", "hash_ladder")
#: ``checkpoint_interval`` when none is given: Mooncake's hash unit
DEFAULT_CHECKPOINT_INTERVAL = 512

INF = 1 << 62


class StateActions(Protocol):
    """What a policy can do at a step's end (the allocator's commit implements it)."""

    def keep(self, r: Request, position: int) -> None:
        """Copy the running state into a checkpoint cached at ``position`` (the step's end)."""

    def export(self, r: Request, position: int) -> None:
        """Cache the state the forward exported from inside the step after ``position``."""

    def roll(self, r: Request, position: int) -> None:
        """Refresh the request's private end-of-request checkpoint to ``position``."""

    def cache_tail_blocks(self, r: Request, position: int) -> None:
        """Cache the partly filled attention block holding token ``position - 1``."""


class EvictionHooks(Protocol):
    """A policy's eviction bookkeeping, told what the allocator does (``marconi``'s scorer)."""

    alpha: float

    def tick(self) -> None:
        """A request looked its prefix up."""

    def accessed(self, unit: bytes) -> None:
        """A state at ``unit`` was cached or served a hit."""

    def demote(self, unit: bytes) -> None:
        """The state at ``unit`` was superseded further down its chain."""

    def check(self) -> None:
        """Assert the bookkeeping agrees with the cache (for ``check_consistency``)."""


def budget_cut(
    start: int, offered: int, total: int, granularity: int, max_prefill_tokens: int
) -> int:
    """Tokens of a chunk of ``offered`` from ``start`` of ``total``: all of them if they reach
    the end, else up to the last multiple of ``granularity`` (a chunk the token budget cuts
    ends where a state could be kept). Where ``granularity`` is wider than the scheduler's
    per-step limit ``max_prefill_tokens`` and no multiple is in reach, the chunk runs what was
    offered and the state stays the request's own until a later chunk reaches a multiple, as
    vLLM 0.33's ``_mamba_block_aligned_split`` advances a block too wide for one chunk."""
    end = start + offered
    if end >= total:
        return offered
    aligned = end // granularity * granularity
    if aligned > start or granularity <= max_prefill_tokens:
        return max(0, aligned - start)
    return offered


class CheckpointPolicy:
    """Where a request's recurrent state is kept for later prefix hits (see the module
    docstring). Calling the base class with a policy name builds that policy::

        CheckpointPolicy("last", plan, hash_block_size=16)

    Subclasses set :attr:`name` and override what they decide; the defaults keep nothing."""

    #: the name users choose it by (``AllocatorOptions.checkpoint_policy``)
    name: ClassVar[str] = ""
    #: what :meth:`admitted` needs at admission: ``"attention"`` (the hit attention alone
    #: serves), ``"junction"`` (the hit of the first attention groups of vLLM's search), None
    admission_probe: ClassVar[str | None] = None
    #: state slots a deployment reserves per request under this policy (vLLM's ``align``
    #: reserves two, so that a checkpoint can always be taken)
    state_slots_per_request: ClassVar[int] = 1
    #: the eviction it runs with unless ``AllocatorOptions.eviction`` says otherwise:
    #: ``"lru"`` (the pools') or ``"marconi"`` (recency against FLOPs saved per byte,
    #: ``marconi_alpha``)
    eviction: ClassVar[str] = "lru"
    #: where a hit inside an attention block lands unless ``AllocatorOptions.
    #: partial_hit_points`` says otherwise: ``"units"`` (any unit a cached block holds:
    #: hybridkv's cache) or ``"keys"`` (vLLM's keys: a block's end, a prompt's tail)
    partial_hit_points: ClassVar[str] = "units"
    #: runs vLLM's EAGLE block drop where the plan's vLLM target applies it
    #: (``AllocatorOptions.eagle_block_drop="auto"``): vLLM's ``align``, whose states move a
    #: unit earlier for it; hybridkv's policies place theirs for hits without a drop
    follows_eagle_block_drop: ClassVar[bool] = False

    def __new__(cls, name: str, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if cls is CheckpointPolicy:
            from .registry import policy_class

            cls = policy_class(name)
        return super().__new__(cls)

    def __init__(
        self,
        name: str,
        plan: MemoryPlan,
        hash_block_size: int,
        *,
        retention_interval: int | None = 0,
        prefill_checkpoint_alignment: int | None = None,
        checkpoint_interval: int | None = None,
        partial_block_hits: bool = True,
        hash_lookahead_tokens: int = 0,
        eagle_block_drop: bool = False,
    ) -> None:
        if name != self.name:
            raise ValueError(f"{type(self).__name__} is the {self.name!r} policy, not {name!r}")
        #: the interval of the states kept inside prompts (0: the policy keeps none there)
        self.interval = self.check_interval(checkpoint_interval, hash_block_size)
        #: vLLM's ``prefix_cache_retention_interval`` and the backend's prefill checkpoint
        #: alignment (None: it exports no states from inside a prefill), for the policies
        #: that use them (:meth:`configure`)
        self.retention_interval = retention_interval
        self.export_alignment = prefill_checkpoint_alignment
        self.h = hash_block_size
        #: tokens after each hash unit its hash covers (MTP's lookahead hashes, :mod:`..hashing`)
        self.lookahead = hash_lookahead_tokens
        #: vLLM's EAGLE block drop (``AllocatorOptions.eagle_block_drop``): a hit gives back
        #: the drafter group's last unit, so the states a hit can use lie a unit earlier
        self.eagle_block_drop = eagle_block_drop
        # every state group checkpoints at its block multiples; they share one size in every
        # layout, and the plan's granularity (their lcm) keeps them in step if they did not
        self.block = plan.checkpoint_granularity if plan.state_groups else hash_block_size
        #: where a chunk the token budget cuts ends (the scheduler's checkpoint granularity)
        self.granularity = plan.checkpoint_granularity
        #: spacing of the positions a state hit is searched at
        self.step = hash_block_size
        #: a private end-of-request checkpoint rolls along and is cached at free
        self.keeps_end_state = False
        #: vLLM's align rules, for the policy that follows them (None for the others)
        self.vllm: Any = None
        #: attention may hit inside a block (``AllocatorOptions.partial_block_hits``)
        self.partial_block_hits = partial_block_hits
        self.configure(plan)

    def configure(self, plan: MemoryPlan) -> None:
        """What a policy sets up beyond the common state (the options are attributes by
        then); raises ``ValueError`` for settings the plan rules out."""

    @property
    def promotes_tail(self) -> bool:
        """The prompt's partly filled last block is cached as a partial entry at each commit,
        and grows into a full entry once its block fills (vLLM's partial hash hits)."""
        return False

    @classmethod
    def check_interval(cls, interval: int | None, hash_block_size: int) -> int:
        """The ``checkpoint_interval`` this policy runs with (0: it takes none); raises
        ``ValueError`` saying why ``interval`` does not fit it."""
        if interval is not None:
            raise ValueError(
                f"checkpoint_interval applies to the {', '.join(RECOVERY_POLICIES[:-1])} and "
                f"{RECOVERY_POLICIES[-1]} policies, "
                f"not {cls.name!r}; leave it unset"
            )
        return 0

    # ---- the protocol ---------------------------------------------------------------------
    @property
    def exports(self) -> bool:
        """States come from inside prefill steps: the commit needs each step's start."""
        return False

    def admitted(self, r: Request, hit: int, probe_hit: int) -> None:
        """``r`` was admitted with ``hit`` cached tokens; ``probe_hit``: the hit of
        :attr:`admission_probe`'s groups (0 without a probe)."""

    def chunk_stop(self, r: Request) -> int | None:
        """The position the policy wants ``r``'s next prefill chunk to end at, or None."""
        return None

    def chunk_tokens(self, r: Request, offered: int, max_prefill_tokens: int) -> int:
        """How many of ``offered`` prompt tokens ``r`` runs this step (``max_prefill_tokens``:
        the scheduler's per-step limit): a budget cut ends on the granularity, and the chunk
        stops at :meth:`chunk_stop`."""
        start = r.num_alloc
        n = budget_cut(start, offered, len(r.tokens), self.granularity, max_prefill_tokens)
        stop = self.chunk_stop(r) or 0
        if start < stop < start + n:
            n = stop - start
        return n

    def split_prefill(self, r: Request, offered: int, max_prefill_tokens: int) -> int:
        """vLLM's chunk split (``align``); the other policies cut nothing."""
        return offered

    def next_work(self, r: Request) -> int:
        """The smallest ``num_alloc`` past ``r``'s at which :meth:`step_end` may act."""
        return INF

    def step_end(self, r: Request, P: int, known: int, act: StateActions) -> None:
        """A step of ``r`` ended at ``P`` tokens with slots, ``known`` of them with known ids
        (they differ while a sampled token is not appended yet): keep, export or roll states
        through ``act``."""

    def install_eviction(
        self, index: Any, plan: MemoryPlan, pools: list[Any], pool_of: dict[int, Any], options: Any
    ) -> EvictionHooks | None:
        """Replace the pools' LRU victim choice with Marconi's where ``options`` (resolved:
        :meth:`AllocatorOptions.resolved_eviction`) ask for it; returns the hooks the allocator
        tells about accesses, or None (LRU)."""
        if options.resolved_eviction() != "marconi":
            return None
        from ..marconi import install_marconi_eviction

        return install_marconi_eviction(index, plan, pools, pool_of, options)
