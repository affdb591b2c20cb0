"""Every checkpoint policy by name: a new policy adds its class here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ConfigError
from .align import AlignPolicy
from .align_every_block import AlignEveryBlock
from .base import CheckpointPolicy
from .hash_boundary import HashBoundaryPolicy
from .hash_ladder import HashLadderPolicy
from .last import LastPolicy
from .marconi import MarconiPolicy
from .periodic import PeriodicPolicy

if TYPE_CHECKING:  # pragma: no cover
    from ...plan import MemoryPlan
    from ..options import AllocatorOptions

__all__ = ["ALL_POLICIES", "POLICY_CLASSES", "make_policy", "policy_class"]

#: every policy the allocator accepts, by name (``align_every_block`` is a bound, not a system)
POLICY_CLASSES: dict[str, type[CheckpointPolicy]] = {
    cls.name: cls
    for cls in (
        AlignPolicy,
        LastPolicy,
        MarconiPolicy,
        PeriodicPolicy,
        HashBoundaryPolicy,
        HashLadderPolicy,
        AlignEveryBlock,
    )
}
#: their names
ALL_POLICIES = tuple(POLICY_CLASSES)


def policy_class(name: str) -> type[CheckpointPolicy]:
    """The class of the policy called ``name``; a clear error for an unknown one."""
    try:
        return POLICY_CLASSES[name]
    except KeyError:
        raise ValueError(
            f"checkpoint_policy must be one of {', '.join(POLICY_CLASSES)}, got {name!r}"
        ) from None


def make_policy(plan: MemoryPlan, options: AllocatorOptions) -> CheckpointPolicy:
    """The policy ``options`` name, for ``plan`` (options resolved by
    :meth:`AllocatorOptions.for_plan`); what the plan rules out raises :class:`ConfigError`."""
    name = options.checkpoint_policy
    try:
        return policy_class(name)(
            name,
            plan,
            options.hash_block_size,
            retention_interval=options.prefix_cache_retention_interval,
            prefill_checkpoint_alignment=options.prefill_checkpoint_alignment,  # type: ignore[arg-type]
            checkpoint_interval=options.checkpoint_interval,
            partial_block_hits=options.partial_block_hits,
            hash_lookahead_tokens=options.hash_lookahead_tokens,  # type: ignore[arg-type]
            eagle_block_drop=options.eagle_block_drop,  # type: ignore[arg-type]
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
