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
attention-only reference for one: the same blocks in an LRU cache of a given size.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

import numpy as np

from .request import Trace

__all__ = [
    "block_hit_tokens",
    "hashed_shared_prefix",
    "hit_fraction",
    "infinite_cache_hits",
    "lru_cache_hits",
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


def hashed_shared_prefix(trace: Trace, block_size: int) -> np.ndarray:
    """Per request, the longest prefix made of whole ``block_size`` blocks that matches an earlier
    request's prompt followed by its known output ids, found by chained block hashes the way a
    prefix cache does (independent of ``Request.shared_prefix_length``)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seen: set[int] = set()
    out = np.zeros(len(trace), np.int64)
    for i, r in enumerate(trace):
        h = 0
        n_prompt = r.prompt_length // block_size
        matched, broken = 0, False
        stream = r.prompt if r.output_ids is None else np.concatenate([r.prompt, r.output_ids])
        chain = []
        for k in range(stream.size // block_size):
            h = hash((h, stream[k * block_size : (k + 1) * block_size].tobytes()))
            chain.append(h)
            if k < n_prompt and not broken:
                if h in seen:
                    matched = k + 1
                else:
                    broken = True
        out[i] = matched * block_size
        seen.update(chain)
    return out


def infinite_cache_hits(trace: Trace, block_size: int, mode: Mode = "full") -> np.ndarray:
    """Per request, prompt tokens an unlimited cache with ``block_size`` blocks serves.

    Uses ``shared_prefix_length`` when the trace knows it for every request, else hashes blocks
    (:func:`hashed_shared_prefix`, one pass; the same answer, slower).
    """
    shared = trace.shared_prefix_lengths()
    if shared is None:
        shared = hashed_shared_prefix(trace, block_size)
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
        h, matched, broken = 0, 0, False
        for k in range(stream.size // block_size):
            h = hash((h, stream[k * block_size : (k + 1) * block_size].tobytes()))
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
