"""Where recurrent states would have to be for a hybrid cache to serve a reference's hits.

A hybrid model's prefix hit needs the attention KV of the prefix *and* a recurrent state saved at
exactly its last token. Given an attention-only reference (per request, the prompt tokens it
serves, e.g. :func:`~hybridkv.traces.lru_cache_hits` of the same memory),
:func:`placement_bounds` asks, for each rule that places states, how much of that reference a
hybrid cache could serve if it kept its states only where the rule puts them, the states costing
no memory and never evicted: an upper bound per rule, before any simulator.

The rules are what the checkpoint policies can know when they keep a state, each from earlier
requests only:

- ``end``: where each earlier request ended (``last``; only reachable when the trace knows the
  output, so that a later prompt can resend it);
- ``prompt_boundary``: each earlier prompt's last multiple of ``interval`` (``hash_boundary``);
- ``ladder``: each earlier prompt's last multiple of ``interval``, ``2 * interval``, ``4 *
  interval``, ... (``hash_ladder``);
- ``seen_branch``: where an earlier request's own reference hit stopped inside its prompt (it
  computed on from there, so the position is a branch point of the cached prefix tree: Marconi's
  admission, measured against the reference's cache);
- ``every_interval``: every multiple of ``interval`` inside each earlier prompt (``periodic``);
- ``oracle``: wherever a later request's hit ends (the reference itself; needs foresight).

A request's bound under several rules together is the elementwise maximum of theirs (the best
state at or below its hit under either rule). What no rule but the oracle serves is reuse at a
position that no earlier request gave a reason to keep a state at.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..alloc.policies.hash_ladder import ladder_rungs
from .request import Trace
from .reuse import block_chain

__all__ = ["PLACEMENT_RULES", "PlacementBounds", "placement_bounds"]

#: the rules :func:`placement_bounds` bounds, in the order of the module docstring
PLACEMENT_RULES = (
    "end",
    "prompt_boundary",
    "ladder",
    "seen_branch",
    "every_interval",
    "oracle",
)


@dataclass(frozen=True, eq=False)
class PlacementBounds:
    """Per request (trace order), prompt tokens of ``reference`` a hybrid cache could serve with
    states kept only at each rule's positions (:data:`PLACEMENT_RULES`): ``served[rule]``.

    ``unit``: the hash unit positions are multiples of; ``interval``: the spacing of the
    ``prompt_boundary`` and ``every_interval`` rules."""

    reference: np.ndarray
    served: dict[str, np.ndarray]
    unit: int
    interval: int

    def total(self, *rules: str) -> int:
        """Tokens served with states at the union of ``rules`` (all of them: none given)."""
        return int(self.per_request(*rules).sum())

    def per_request(self, *rules: str) -> np.ndarray:
        """Per request, tokens served with states at the union of ``rules``."""
        unknown = [r for r in rules if r not in self.served]
        if unknown:
            raise ValueError(f"unknown placement rule(s) {unknown}; choose from {PLACEMENT_RULES}")
        chosen = rules or PLACEMENT_RULES
        return np.maximum.reduce([self.served[r] for r in chosen])

    def to_dict(self) -> dict[str, int]:
        """Totals: the reference's tokens and each rule's."""
        return {"reference": int(self.reference.sum()), **{r: self.total(r) for r in self.served}}


def placement_bounds(
    trace: Trace, reference: np.ndarray, unit: int, interval: int
) -> PlacementBounds:
    """:class:`PlacementBounds` of ``reference`` (per request, prompt tokens an attention-only
    cache served: whole ``unit``-token blocks from the prompt's start, as
    :func:`~hybridkv.traces.lru_cache_hits` with ``block_size=unit`` gives) on ``trace``;
    ``interval`` (a positive multiple of ``unit``) spaces the interval rules."""
    reference = np.asarray(reference, dtype=np.int64)
    if unit < 1:
        raise ValueError(f"unit must be >= 1, got {unit}")
    if interval < 1 or interval % unit:
        raise ValueError(
            f"interval must be a positive multiple of unit ({unit}): states are only looked "
            f"up at whole units; got {interval}"
        )
    if reference.shape != (len(trace),):
        raise ValueError(
            f"reference must hold one hit per request ({len(trace)}), got shape {reference.shape}"
        )
    lengths = trace.prompt_lengths()
    bad = np.flatnonzero((reference < 0) | (reference % unit != 0) | (reference > lengths))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"request {i}: reference hit {reference[i]} is not a whole number of {unit}-token "
            f"units within its {lengths[i]}-token prompt (compute it with block_size={unit})"
        )
    kept: dict[str, set[int]] = {r: set() for r in PLACEMENT_RULES if r != "oracle"}
    served = {r: np.zeros(len(trace), np.int64) for r in PLACEMENT_RULES}
    served["oracle"] = reference.copy()
    for i, r in enumerate(trace):
        stream = r.prompt if r.output_ids is None else np.concatenate([r.prompt, r.output_ids])
        chain = block_chain(stream, unit)  # chain[k - 1]: the prefix of k units
        hit_units = int(reference[i]) // unit
        for rule, states in kept.items():
            for k in range(hit_units, 0, -1):
                if chain[k - 1] in states:
                    served[rule][i] = k * unit
                    break
        n = r.prompt_length
        _keep(kept["every_interval"], chain, range(interval, n, interval), unit)
        _keep(kept["prompt_boundary"], chain, [(n - 1) // interval * interval], unit)
        _keep(kept["ladder"], chain, ladder_rungs(n - 1, interval), unit)
        if 0 < reference[i] < n:
            _keep(kept["seen_branch"], chain, [int(reference[i])], unit)
        if r.output_ids is not None:
            # the last output token is sampled, never fed back: the state covers the rest
            _keep(kept["end"], chain, [(stream.size - 1) // unit * unit], unit)
    return PlacementBounds(reference=reference, served=served, unit=unit, interval=interval)


def _keep(states: set[int], chain: list[int], positions, unit: int) -> None:
    for p in positions:
        if p > 0:
            states.add(chain[p // unit - 1])
