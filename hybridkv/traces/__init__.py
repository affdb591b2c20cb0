"""Workload traces: requests with real, shared token ids.

- :mod:`~hybridkv.traces.request`: :class:`Request` and :class:`Trace`.
- :mod:`~hybridkv.traces.dists`: log-normal lengths and Poisson arrivals.
- :mod:`~hybridkv.traces.synthetic`: seeded generators (:data:`WORKLOADS`).
- :mod:`~hybridkv.traces.jsonl`: reading and writing real traces; Mooncake's synthetic workload
  ships with the package (:func:`load_mooncake`).
- :mod:`~hybridkv.traces.reuse`: what block granularity alone costs a prefix cache, and the
  attention-only reference a hybrid cache is measured against.
- :mod:`~hybridkv.traces.placement`: what each rule for placing recurrent states could serve of
  that reference.

>>> from hybridkv import traces
>>> chat = traces.multi_turn_chat(1000, seed=0)
>>> chat[1].prompt[: chat[1].shared_prefix_length].size == chat[1].shared_prefix_length
True
"""

from .dists import LogNormal, poisson_arrivals
from .jsonl import (
    MOONCAKE_SYNTHETIC,
    SHARED_LENGTHS,
    load_jsonl,
    load_mooncake,
    save_jsonl,
    synthetic_tokens,
)
from .placement import PLACEMENT_RULES, PlacementBounds, placement_bounds
from .request import Request, Trace, answer_ids
from .reuse import (
    ReferenceGap,
    block_chain,
    block_hit_tokens,
    hashed_shared_prefix,
    hit_fraction,
    infinite_cache_hits,
    lru_cache_hits,
    reference_gap,
)
from .synthetic import (
    VOCAB_SIZE,
    WORKLOADS,
    agentic,
    generate,
    multi_turn_chat,
    no_sharing,
    shared_prefix,
)

__all__ = [
    "MOONCAKE_SYNTHETIC",
    "PLACEMENT_RULES",
    "SHARED_LENGTHS",
    "VOCAB_SIZE",
    "WORKLOADS",
    "LogNormal",
    "PlacementBounds",
    "ReferenceGap",
    "Request",
    "Trace",
    "agentic",
    "answer_ids",
    "block_chain",
    "block_hit_tokens",
    "generate",
    "hashed_shared_prefix",
    "hit_fraction",
    "infinite_cache_hits",
    "load_jsonl",
    "load_mooncake",
    "lru_cache_hits",
    "multi_turn_chat",
    "no_sharing",
    "placement_bounds",
    "poisson_arrivals",
    "reference_gap",
    "save_jsonl",
    "shared_prefix",
    "synthetic_tokens",
]
