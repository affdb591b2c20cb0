"""Test helpers for running vLLM 0.33's own KV-cache planning on an export (where vLLM
imports): the duck-typed ``VllmConfig`` its planner reads, and GLM-5-Next's registration
order of its caches."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def planner_config(layout: Any, **cache: Any) -> SimpleNamespace:
    """What ``get_kv_cache_groups`` and ``get_kv_cache_config_from_groups`` read of a
    ``VllmConfig``, with the resolved ``layout``; ``cache`` adds cache_config fields."""
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            num_gpu_blocks_override=None,
            prefix_cache_retention_interval=0,
            **cache,
        ),
    )


_GLM5_RANK = {"indexer.k_cache": 0, "indexer.tail_cache": 1, "attn": 2}


def glm5_registered(name: str) -> tuple[int, int]:
    """vLLM's registration order of a GLM-5-Next cache: by decoder layer; inside an MLA layer
    the Indexer's k_cache and tail_cache, then the MLAAttention (Glm5NextMLAAttention)."""
    layer, _, rest = name.removeprefix("language_model.model.layers.").partition(".")
    return int(layer), _GLM5_RANK.get(rest.removeprefix("self_attn."), 0)
