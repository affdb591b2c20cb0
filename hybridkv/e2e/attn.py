"""Prefill-only paged attention for transformers' attention registry (single-step, no decode yet).

K/V of each attention layer are written into the plan's pages with ``write_kv_cache`` and read
back with ``paged_prefill_attention``. Block ids come from ``ctx.block_table`` (one row per
sequence in the batch).
"""

from __future__ import annotations

import torch

ATTN_NAME = "hybridkv_paged"


class PagedContext:
    def __init__(self, plan, buffers, block_tables: torch.Tensor):
        self.plan, self.buffers, self.block_tables = plan, buffers, block_tables


_CTX: PagedContext | None = None


def set_context(ctx: PagedContext | None) -> None:
    global _CTX
    _CTX = ctx


def paged_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    from hybridkv_kernels.cache_write import write_kv_cache
    from hybridkv_kernels.paged_prefill import paged_prefill_attention

    ctx = _CTX
    k_cache, v_cache = ctx.plan.kv_views(ctx.buffers, f"layers.{module.layer_idx}.attn")
    b, hq, t, d = query.shape
    bs = k_cache.shape[1]
    pos = torch.arange(t)
    slots = ctx.block_tables[:, pos // bs] * bs + pos % bs  # [B, T]
    k = key.transpose(1, 2).reshape(b * t, key.shape[1], d).contiguous()
    v = value.transpose(1, 2).reshape(b * t, value.shape[1], d).contiguous()
    write_kv_cache(k, v, k_cache, v_cache, slots.reshape(-1).to(torch.int64))
    q = query.transpose(1, 2).reshape(b * t, hq, d).contiguous()
    cu = torch.arange(b + 1, dtype=torch.int32) * t
    lens = torch.full((b,), t, dtype=torch.int32)
    scale = scaling if scaling is not None else d**-0.5
    out = paged_prefill_attention(
        q, k_cache, v_cache, ctx.block_tables.to(torch.int32), cu, lens, scale
    )
    return out.reshape(b, t, hq, d), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
