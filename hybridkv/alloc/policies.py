"""State checkpoint policies: where a request's recurrent state is kept for later prefix hits.

A state can only be reused at exactly the token it was taken at, and each one costs a whole
state page, so the policy decides which positions are worth a page. A checkpoint is taken when a
scheduler step *ends* at a chosen position (the state exists nowhere else), by copying the
running state into another slot after the forward pass.

- ``align`` (vLLM's ``mamba_cache_mode="align"``): at every multiple of the state group's block
  size a step ends on; each is cached at once. Hits land on block multiples only, so a prompt
  shorter than one block never hits, and prefill must be chunked at block multiples.
- ``last``: only the state at the end of each request. While it runs, the request keeps a private
  rolling checkpoint at the last hash-unit boundary a step ended on (decode ends a step on every
  token, so it is at most ``hash_block_size - 1`` tokens old); at ``free()`` it is cached. This
  serves multi-turn reuse (the next turn extends the whole previous conversation) at one page per
  conversation.
- ``marconi`` (Marconi, MLSys'25): ``last`` plus a checkpoint at the *branch point* of a request
  whose prompt diverges from a cached prefix (attention KV is cached past the point where the
  state hit stops, so another request shared these tokens: the next one will too). Eviction
  weighs recency against compute saved per byte (:class:`MarconiEvictor`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ..plan import MemoryPlan
    from .prefix_cache import PrefixIndex

__all__ = ["CACHE", "NONE", "POLICIES", "ROLLING", "CheckpointPolicy", "MarconiEvictor"]

NONE, CACHE, ROLLING = 0, 1, 2
POLICIES = ("align", "last", "marconi")


class CheckpointPolicy:
    """What to do with the state when a step ends at token ``P``: nothing, ``CACHE`` (take a
    checkpoint and cache it) or ``ROLLING`` (refresh the request's private end checkpoint)."""

    def __init__(self, name: str, plan: MemoryPlan, hash_block_size: int) -> None:
        if name not in POLICIES:
            raise ValueError(
                f"checkpoint_policy must be one of {', '.join(POLICIES)}, got {name!r}"
            )
        self.name = name
        sizes = [g.block_size for g in plan.state_groups]
        # align: every state group checkpoints at its block multiples; they share one size in
        # every layout, and the lcm keeps all groups in step if they did not.
        self.step = math.lcm(*sizes) if name == "align" and sizes else hash_block_size
        self.keeps_end_state = name != "align"
        self.branches = name == "marconi"

    def at_step_end(self, P: int, branch_at: int) -> int:
        if P <= 0:
            return NONE
        if self.branches and branch_at == P:
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


class MarconiEvictor:
    """Victim choice among the ``window`` oldest cached free ids of one pool.

    utility = recency + alpha * efficiency, the smallest is evicted:

    - recency: rank among the candidates, 0 for the oldest, 1 for the newest;
    - efficiency: tokens of prefix a hit on the entry saves per byte kept, relative to attention
      KV (whose efficiency is 1: a block saves B tokens for B tokens of KV). A state checkpoint at
      ``P`` tokens saves ``P`` tokens of compute and keeps a state page plus the prefix's KV:
      ``P * kv / (state + P * kv)``, with ``kv`` the KV bytes per token and ``state`` the bytes
      of one sequence's recurrent state. Short-prefix states are poor value; long ones approach 1.

    ``alpha = 0`` is plain LRU.
    """

    def __init__(self, pool: object, index: PrefixIndex, plan: MemoryPlan, alpha: float) -> None:
        self.pool = pool
        self.index = index
        self.alpha = alpha
        self.kv_per_token = sum(
            (p.k_bytes_per_block + p.v_bytes_per_block) / p.block_size for p in plan.kv_placements
        )
        self.state_bytes = sum(c.nbytes for s in plan.state_placements for c in s.components)

    def efficiency(self, prefix_tokens: int, is_state: bool) -> float:
        if not is_state:
            return 1.0
        kv = prefix_tokens * self.kv_per_token
        return kv / (self.state_bytes + kv) if kv or self.state_bytes else 1.0

    def __call__(self, candidates: list[int]) -> int:
        n = len(candidates)
        key_of = self.pool.key_of  # type: ignore[attr-defined]
        info = self.index.entry_info
        best, best_u = candidates[0], math.inf
        for i, bid in enumerate(candidates):
            P, is_state = info(key_of(bid))
            u = i / (n - 1) + self.alpha * self.efficiency(P, is_state)
            if u < best_u:
                best, best_u = bid, u
        return best
