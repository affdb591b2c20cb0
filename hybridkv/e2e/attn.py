"""Paged attention for transformers' attention registry (``ATTN_NAME``).

Each attention layer writes its new K/V into the plan's pages with ``write_kv_cache`` and reads
the whole context back from the pages: ``paged_decode_attention`` when every request of the
batch brings one token, ``paged_prefill_attention`` (causal over cached prefix + new tokens)
otherwise. The K/V transformers hands over are only the new tokens; whatever HF cache object
the model was given keeps nothing that this function reads.

Per-forward inputs come from a :class:`PagedContext` set with :func:`set_context`: the block
table of every KV cache group (one row per request) and each request's number of tokens already
in the cache, so that request ``b``'s token ``t`` sits at position ``start[b] + t``.

A layer's pages are found by the module's ``layer_idx``. A module shared by several decoder
layers (Zamba2's shared attention blocks carry ``layer_idx = -1`` and are called with the
decoder layer's index as a ``layer_idx`` argument) is resolved by :func:`track_layer_index`,
which records that argument at each call. A sliding-window group's layers pass the group's
window to the kernels (the allocator frees the blocks that fall out of it, so reading them
would read the null block).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ..plan import MemoryPlan

ATTN_NAME = "hybridkv_paged"


@dataclass
class PagedContext:
    """``block_tables``: one int32 ``[B, max_blocks]`` table per KV cache group (a single
    tensor serves every group); ``start``: ``[B]`` tokens already cached per request (None: 0).
    ``views``: ``layer index -> (k_cache, v_cache, group id)`` of every attention layer of
    ``plan`` over ``buffers`` (the layer index is transformers' ``layer_idx``); ``windows``:
    layer index -> its group's sliding window (None: full attention); ``called``: ``id(module)
    -> layer index`` of the shared modules being run (:func:`track_layer_index`)."""

    plan: MemoryPlan
    buffers: dict[str, torch.Tensor]
    block_tables: list[torch.Tensor] | torch.Tensor
    start: torch.Tensor | None = None
    views: dict[int, tuple[torch.Tensor, torch.Tensor | None, int]] = field(init=False)
    windows: dict[int, int | None] = field(init=False)
    called: dict[int, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.views = {
            p.layer_index: (*self.plan.kv_views(self.buffers, p.layer), p.group_id)
            for p in self.plan.kv_placements
        }
        window = {g.group_id: g.sliding_window for g in self.plan.groups}
        self.windows = {p.layer_index: window[p.group_id] for p in self.plan.kv_placements}

    def layer_of(self, module: torch.nn.Module) -> int:
        return self.called.get(id(module), module.layer_idx)

    def table(self, group_id: int) -> torch.Tensor:
        t = self.block_tables
        return t if isinstance(t, torch.Tensor) else t[group_id]


_CTX: PagedContext | None = None


def set_context(ctx: PagedContext | None) -> None:
    global _CTX
    _CTX = ctx


def current_context() -> PagedContext | None:
    return _CTX


def _record_layer(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    if _CTX is not None:
        _CTX.called[id(module)] = kwargs["layer_idx"] if "layer_idx" in kwargs else args[1]


def track_layer_index(model: torch.nn.Module) -> None:
    """Have every module of ``model`` that is called with a ``layer_idx`` argument (a module
    shared between decoder layers) record it for :meth:`PagedContext.layer_of`; harmless
    outside a context, and done once per module."""
    for m in model.modules():
        if not hasattr(m, "layer_idx") or getattr(m, "hybridkv_tracked", False):
            continue
        params = list(inspect.signature(m.forward).parameters)
        if "layer_idx" in params and params.index("layer_idx") == 1:
            m.register_forward_pre_hook(_record_layer, with_kwargs=True)
            m.hybridkv_tracked = True


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention signature: ``query [B, Hq, T, D]``, ``key``/``value
    [B, Hkv, T, D]`` (new tokens only); returns ``[B, T, Hq, D]``. The mask is ignored: the
    kernels are causal by position and bounded by each request's length."""
    from ..kernels import paged_decode_attention, paged_prefill_attention, write_kv_cache

    ctx = _CTX
    if ctx is None:
        raise RuntimeError(f"{ATTN_NAME} attention called outside hybridkv.e2e.attn.set_context")
    layer = ctx.layer_of(module)
    k_cache, v_cache, gid = ctx.views[layer]
    window = ctx.windows[layer]
    table = ctx.table(gid).to(torch.int32).contiguous()
    b, hq, t, d = query.shape
    bs = k_cache.shape[1]
    start = ctx.start if ctx.start is not None else torch.zeros(b, dtype=torch.int64)
    pos = start.to(torch.int64)[:, None] + torch.arange(t)  # [B, T]
    slots = table.to(torch.int64).gather(1, pos // bs) * bs + pos % bs
    k = key.transpose(1, 2).reshape(b * t, key.shape[1], d).contiguous()
    v = value.transpose(1, 2).reshape(b * t, value.shape[1], value.shape[3]).contiguous()
    write_kv_cache(k, v, k_cache, v_cache, slots.reshape(-1))
    seq_lens = (start + t).to(torch.int32)
    scale = scaling if scaling is not None else d**-0.5
    q = query.transpose(1, 2).reshape(b * t, hq, d).contiguous()
    if t == 1:
        out = paged_decode_attention(
            q,
            k_cache,
            v_cache,
            table,
            seq_lens,
            scale,
            sliding_window=window,
            max_seq_len=int(seq_lens.max()),
        )
    else:
        cu = torch.arange(b + 1, dtype=torch.int32) * t
        out = paged_prefill_attention(
            q, k_cache, v_cache, table, cu, seq_lens, scale, sliding_window=window
        )
    return out.reshape(b, t, hq, out.shape[-1]), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
