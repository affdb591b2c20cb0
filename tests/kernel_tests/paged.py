"""Paged-cache layouts for kernel tests: the same K/V caches laid out the ways plans lay them."""

from __future__ import annotations

import torch

from hybridkv import models
from hybridkv.layouts import make_plan
from hybridkv.target import VllmTarget

SYNTHETIC = ("classic", "packed3-layer1", "head-major", "layer-outer")


def synthetic_caches(
    layout: str, num_blocks: int, block_size: int, heads: int, dk: int, dv: int, dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(backing, k_cache, v_cache) views ``[num_blocks, block_size, heads, d]``, backing
    NaN-poisoned so bytes the kernel should not touch stay NaN. ``layout``: one of
    :data:`SYNTHETIC`, or ``kv-interleaved`` (vLLM 0.33's page, ``[block_size, heads, K | V]``,
    which the tests run on fewer configurations: the suite's time)."""
    tok_k, tok_v = heads * dk, heads * dv
    sub_k, sub_v = block_size * tok_k, block_size * tok_v
    if layout == "classic":  # page = K then V
        page, k_off, v_off, st_k, sh_k, st_v, sh_v = sub_k + sub_v, 0, sub_k, tok_k, dk, tok_v, dv
    elif layout == "packed3-layer1":  # 3 layers per page, this is layer 1
        layer = sub_k + sub_v
        page, k_off, v_off = 3 * layer, layer, layer + sub_k
        st_k, sh_k, st_v, sh_v = tok_k, dk, tok_v, dv
    elif layout == "head-major":  # [H, block_size, D] inside the page
        page, k_off, v_off = sub_k + sub_v, 0, sub_k
        st_k, sh_k, st_v, sh_v = dk, block_size * dk, dv, block_size * dv
    elif layout == "kv-interleaved":  # vLLM 0.33's page: [block_size, H, K | V]
        pair = dk + dv
        page, k_off, v_off = block_size * heads * pair, 0, dk
        st_k, sh_k, st_v, sh_v = heads * pair, pair, heads * pair, pair
    elif layout == "layer-outer":  # per-layer tensor [L, blocks, page], this is layer 2 of 4
        page = sub_k + sub_v
        k_off = 2 * num_blocks * page
        v_off = k_off + sub_k
        st_k, sh_k, st_v, sh_v = tok_k, dk, tok_v, dv
        backing = torch.full((4 * num_blocks * page,), float("nan"), dtype=torch.float32)
        backing = backing.to(dtype) if dtype.is_floating_point and dtype.itemsize > 1 else backing
    else:
        raise ValueError(layout)
    if layout != "layer-outer":
        backing = torch.full((num_blocks * page + 5,), float("nan"), dtype=torch.float32)
    backing = backing.to(dtype)
    k = torch.as_strided(
        backing, (num_blocks, block_size, heads, dk), (page, st_k, sh_k, 1), k_off
    )
    v = torch.as_strided(
        backing, (num_blocks, block_size, heads, dv), (page, st_v, sh_v, 1), v_off
    )
    return backing, k, v


def plan_caches(
    layout: str, dtype_name: str, tp_size: int = 2, cache_formats: str = "transformers"
):
    """(buffers, k_cache, v_cache) of the last attention layer of the smallest real plan that
    holds 640 tokens (40 blocks of 16 where the layout keeps 16); ``cache_formats="vllm"``:
    K and V side by side per token and head, as vLLM keeps a page."""
    model = models.load("qwen3.5-0.8b", tp_size=tp_size, kv_dtype=dtype_name)
    plan = make_plan(
        model, layout, fit_tokens=40 * 16, max_num_seqs=2, block_size=16,
        target=VllmTarget(cache_formats=cache_formats),
    )  # fmt: skip
    buffers = plan.allocate("cpu")
    for b in buffers.values():
        b.view(torch.uint8).fill_(0xFF)  # NaN in every float dtype
    layer = model.attention_layers[-1].name
    k, v = plan.kv_views(buffers, layer)
    return buffers, k, v
