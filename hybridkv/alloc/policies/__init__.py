"""State checkpoint policies: where a request's recurrent state is kept for later prefix hits.

A state can only be reused at exactly the token it was taken at, and each one costs a whole
state page, so the policy decides which positions are worth a page. A checkpoint is taken when a
scheduler step *ends* at a chosen position (the state exists nowhere else), by copying the
running state into another slot after the forward pass; a backend that exports states from
inside a prefill (vLLM's prefill checkpoint blocks) also gives positions inside the step.

One module per policy, each a :class:`~.base.CheckpointPolicy` (the protocol, in
:mod:`.base`): ``align`` (:mod:`.align`, vLLM 0.33's), ``align_every_block``
(:mod:`.align_every_block`, a bound), ``last`` (:mod:`.last`), ``marconi`` (:mod:`.marconi`),
``periodic`` (:mod:`.periodic`), ``hash_boundary`` (:mod:`.hash_boundary`) and ``hash_ladder``
(:mod:`.hash_ladder`).
:mod:`.registry` maps names to classes.
"""

from .align import AlignPolicy, VllmAlign
from .align_every_block import AlignEveryBlock
from .base import (
    DEFAULT_CHECKPOINT_INTERVAL,
    POLICIES,
    RECOVERY_POLICIES,
    CheckpointPolicy,
    EvictionHooks,
    StateActions,
)
from .hash_boundary import HashBoundaryPolicy
from .hash_ladder import HashLadderPolicy, state_sized_scale
from .last import LastPolicy
from .marconi import MarconiPolicy
from .periodic import PeriodicPolicy
from .registry import ALL_POLICIES, POLICY_CLASSES, make_policy, policy_class

__all__ = [
    "ALL_POLICIES",
    "DEFAULT_CHECKPOINT_INTERVAL",
    "POLICIES",
    "POLICY_CLASSES",
    "RECOVERY_POLICIES",
    "AlignEveryBlock",
    "AlignPolicy",
    "CheckpointPolicy",
    "EvictionHooks",
    "HashBoundaryPolicy",
    "HashLadderPolicy",
    "LastPolicy",
    "MarconiPolicy",
    "PeriodicPolicy",
    "StateActions",
    "VllmAlign",
    "make_policy",
    "policy_class",
    "state_sized_scale",
]
