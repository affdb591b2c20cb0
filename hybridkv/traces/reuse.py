"""How much of a trace's prompts a prefix cache could serve, before any simulator.

Two bounds for a cache with ``block_size``-token blocks and unlimited memory:

- ``mode="full"``: a block hits when every token up to its end matches an earlier request (the
  chained block hash of vLLM and SGLang's paged radix tree), so a request whose prompt shares
  ``P`` tokens with an earlier one hits ``floor(P / B) * B`` tokens: the fraction
  ``floor(P / B) * B / P`` of the shared prefix.
- ``mode="align"``: vLLM's ``mamba_cache_mode="align"`` keeps a hybrid model's recurrent state only
  at block boundaries and never caches the last, still-changing block; issue reports observe
  ``max(0, floor(P / B) - 1) * B`` cached tokens (reference facts, section 6).

These ignore eviction, memory and scheduling: they are what block granularity alone costs. A
cache simulator gives the numbers under a memory budget; :func:`lru_cache_hits` is the
attention-only reference for one: the same blocks in an LRU cache of a given size, and
:func:`reference_gap` splits what a hybrid cache misses of it into tokens lost to missing states
and to missing KV.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .request import Trace

__all__ = [
    "ReferenceGap",
    "block_chain",
    "block_hit_tokens",
    "hashed_shared_prefix",
    "hit_fraction",
    "infinite_cache_hits",
    "lru_cache_hits",
    "reference_gap",
]

Mode = Literal["full", "align"]


def block_hit_tokens(
    shared: int | np.ndarray, block_size: int, mode: Mode = "full"
) -> int | np.ndarray:
    """Tokens of a shared prefix of ``shared`` tokens that blocks of ``block_size`` can serve."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    blocks = np.asarray(shared) // block_size
    if mode == "align":
        blocks = np.maximum(0, blocks - 1)
    elif mode != "full":
        raise ValueError(f"mode must be 'full' or 'align', got {mode!r}")
    out = blocks * block_size
    return int(out) if np.ndim(out) == 0 else out


def block_chain(tokens: np.ndarray, block_size: int, lookahead: int = 0) -> list[int]:
    """The chained hashes of ``tokens``' whole ``block_size`` blocks: element ``k`` stands for
    the prefix of ``k + 1`` blocks (equal prefixes, equal hashes; a partial last block has
    none), the way a prefix cache names blocks. ``lookahead``: each hash also covers that many
    tokens after its block and exists only where they do (vLLM 0.33's lookahead hashes under
    MTP, :mod:`hybridkv.alloc.hashing`)."""
    h, out = 0, []
    for k in range((tokens.size - lookahead) // block_size):
        h = hash((h, tokens[k * block_size : (k + 1) * block_size + lookahead].tobytes()))
        out.append(h)
    return out


def hashed_shared_prefix(trace: Trace, block_size: int, lookahead: int = 0) -> np.ndarray:
    """Per request, the longest prefix made of whole ``block_size`` blocks that matches an earlier
    request's prompt followed by its known output ids, found by chained block hashes the way a
    prefix cache does (independent of ``Request.shared_prefix_length``); ``lookahead`` as in
    :func:`block_chain`."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seen: set[int] = set()
    out = np.zeros(len(trace), np.int64)
    for i, r in enumerate(trace):
        stream = r.prompt if r.output_ids is None else np.concatenate([r.prompt, r.output_ids])
        chain = block_chain(stream, block_size, lookahead)
        matched = 0
        for h in chain[: max(0, r.prompt_length - lookahead) // block_size]:
            if h not in seen:
                break
            matched += 1
        out[i] = matched * block_size
        seen.update(chain)
    return out


def infinite_cache_hits(
    trace: Trace, block_size: int, mode: Mode = "full", lookahead: int = 0
) -> np.ndarray:
    """Per request, prompt tokens an unlimited cache with ``block_size`` blocks serves; with a
    hash ``lookahead`` (:func:`block_chain`) a block serves only when the tokens after it are
    shared too.

    Uses ``shared_prefix_length`` when the trace knows it for every request, else hashes blocks
    (:func:`hashed_shared_prefix`, one pass; the same answer, slower).
    """
    shared = trace.shared_prefix_lengths()
    if shared is None:
        shared = hashed_shared_prefix(trace, block_size, lookahead)
    else:
        shared = np.maximum(np.asarray(shared) - lookahead, 0)
    return np.asarray(block_hit_tokens(shared, block_size, mode))


def hit_fraction(trace: Trace, block_size: int, mode: Mode = "full") -> float:
    """Prompt tokens served from the cache over all prompt tokens (token hit rate)."""
    total = int(trace.prompt_lengths().sum())
    return float(infinite_cache_hits(trace, block_size, mode).sum() / total) if total else 0.0


def lru_cache_hits(trace: Trace, block_size: int, capacity_tokens: int) -> np.ndarray:
    """Per request, prompt tokens an attention-only prefix cache of ``capacity_tokens`` tokens
    serves: whole ``block_size`` blocks found by chained hashes (as :func:`hashed_shared_prefix`),
    least recently used blocks evicted first. Requests are replayed in arrival order; each looks
    its prompt up, then its prompt's blocks and its known output's are inserted (hits refreshed).

    A reference, not a simulation: the memory of running requests, preemption and timing are
    ignored (the whole capacity is cache), so a real engine with that much memory serves less."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if capacity_tokens < 0:
        raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
    capacity = capacity_tokens // block_size
    cache: OrderedDict[int, None] = OrderedDict()
    out = np.zeros(len(trace), np.int64)
    for i, r in enumerate(trace):
        stream = r.prompt if r.output_ids is None else np.concatenate([r.prompt, r.output_ids])
        n_prompt = r.prompt_length // block_size
        matched, broken = 0, False
        for k, h in enumerate(block_chain(stream, block_size)):
            if h in cache:
                cache.move_to_end(h)
                if k < n_prompt and not broken:
                    matched = k + 1
            else:
                broken = True
                if capacity:
                    cache[h] = None
                    if len(cache) > capacity:
                        cache.popitem(last=False)
        out[i] = matched * block_size
    return out


@dataclass(frozen=True)
class ReferenceGap:
    """Where a hybrid cache's hits part from an attention-only reference's (e.g.
    :func:`lru_cache_hits` of the same memory), in prompt tokens, from per-request arrays:

    - ``served``: tokens the hybrid cache served;
    - ``lost_to_state``: tokens the reference served and the hybrid cache still held the KV of,
      but no state checkpoint let a hit reach (``min(reference, kv) - hit``);
    - ``lost_to_kv``: tokens the reference served whose KV the hybrid cache no longer held
      (``reference - max(kv, hit)``);
    - ``beyond``: tokens the hybrid cache served past the reference (``hit - reference``).

    Per request ``served + lost_to_state + lost_to_kv - beyond = reference``; the counts are
    of requests that lost anything to each cause."""

    reference: int
    served: int
    lost_to_state: int
    lost_to_kv: int
    beyond: int
    requests_losing_to_state: int
    requests_losing_to_kv: int

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def reference_gap(hits: np.ndarray, kv_hits: np.ndarray, reference: np.ndarray) -> ReferenceGap:
    """:class:`ReferenceGap` of per-request ``hits`` (a run's served prompt tokens),
    ``kv_hits`` (the prefix its attention groups held at the lookup, ``>= hits``) and
    ``reference`` (the attention-only reference's hits), all in trace order."""
    hits, kv_hits, reference = (np.asarray(a, dtype=np.int64) for a in (hits, kv_hits, reference))
    if not hits.shape == kv_hits.shape == reference.shape or hits.ndim != 1:
        raise ValueError(
            "hits, kv_hits and reference must be 1-D arrays of one length (one entry per "
            f"request), got shapes {hits.shape}, {kv_hits.shape}, {reference.shape}"
        )
    if np.any(kv_hits < hits):
        i = int(np.argmax(kv_hits < hits))
        raise ValueError(
            f"request {i}: kv_hits {kv_hits[i]} < hits {hits[i]}; the attention groups' prefix "
            "bounds every hit (pass HitInfo.num_kv_cached_tokens, not another run's)"
        )
    to_state = np.maximum(0, np.minimum(reference, kv_hits) - hits)
    to_kv = np.maximum(0, reference - np.maximum(kv_hits, hits))
    return ReferenceGap(
        reference=int(reference.sum()),
        served=int(hits.sum()),
        lost_to_state=int(to_state.sum()),
        lost_to_kv=int(to_kv.sum()),
        beyond=int(np.maximum(0, hits - reference).sum()),
        requests_losing_to_state=int(np.count_nonzero(to_state)),
        requests_losing_to_kv=int(np.count_nonzero(to_kv)),
    )
