"""Cache write: scatter the new K and V of a batch of tokens into paged caches of any layout.

The caches are typed strided views ``[num_blocks, block_size, num_kv_heads, head_dim]`` over a
memory plan's raw buffers: the block, token and head strides are arbitrary (vLLM's K-then-V page,
N layers packed per page, head-major pages, layer-outer tensors), only the last dim is
contiguous. Token ``t`` goes to ``slot_mapping[t] = block_id * block_size + offset``; ``-1``
marks a padding token. fp8 caches store ``x / scale`` (one float32 scale per cache).

Standalone: imports only torch and triton, so the file can be copied into another project.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _autotune(configs: list[triton.Config], key: list[str], **kwargs):
    """``triton.autotune`` on a GPU; under the interpreter, pin one config (the first, or the
    one ``HYBRIDKV_INTERPRET_CONFIG`` numbers, so tests can check each), because the autotuner
    needs a GPU driver to benchmark."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        index = int(os.environ.get("HYBRIDKV_INTERPRET_CONFIG", "0")) % len(configs)
        pinned = configs[index].kwargs
        return triton.heuristics({k: (lambda _, v=v: v) for k, v in pinned.items()})
    return triton.autotune(configs, key=key, **kwargs)


# One program per token writes all its heads; the tile covers every head at once for the usual
# sizes. Tuning writes the cache, so the cache views are restored between trials.
_CONFIGS = [
    triton.Config({"BLOCK_H": 1}, num_warps=1),
    triton.Config({"BLOCK_H": 2}, num_warps=2),
    triton.Config({"BLOCK_H": 4}, num_warps=4),
    triton.Config({"BLOCK_H": 8}, num_warps=4),
]


@_autotune(
    _CONFIGS,
    key=["num_heads", "HEAD_DIM_K", "HEAD_DIM_V"],
    restore_value=["k_cache_ptr", "v_cache_ptr"],
)
@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, H, Dk]
    value_ptr,  # [T, H, Dv]
    k_cache_ptr,  # [num_blocks, block_size, H, Dk], strided
    v_cache_ptr,  # [num_blocks, block_size, H, Dv], strided
    slot_ptr,  # [T] int64, -1 = padding token
    k_scale_ptr,  # [1] float32 (read only when QUANT)
    v_scale_ptr,  # [1] float32
    num_heads,
    block_size,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kc_block,
    stride_kc_token,
    stride_kc_head,
    stride_vc_block,
    stride_vc_token,
    stride_vc_head,
    HEAD_DIM_K: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_hb = tl.program_id(1)
    slot = tl.load(slot_ptr + i_t).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    offs_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = offs_h < num_heads
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_k = m_h[:, None] & (offs_dk[None, :] < HEAD_DIM_K)
    m_v = m_h[:, None] & (offs_dv[None, :] < HEAD_DIM_V)

    k = tl.load(
        key_ptr + i_t * stride_key_t + offs_h[:, None] * stride_key_h + offs_dk[None, :], mask=m_k
    )
    v = tl.load(
        value_ptr + i_t * stride_value_t + offs_h[:, None] * stride_value_h + offs_dv[None, :],
        mask=m_v,
    )
    if QUANT:
        k = k.to(tl.float32) / tl.load(k_scale_ptr)
        v = v.to(tl.float32) / tl.load(v_scale_ptr)
    p_k = (
        k_cache_ptr
        + block * stride_kc_block
        + offset * stride_kc_token
        + offs_h[:, None].to(tl.int64) * stride_kc_head
        + offs_dk[None, :]
    )
    p_v = (
        v_cache_ptr
        + block * stride_vc_block
        + offset * stride_vc_token
        + offs_h[:, None].to(tl.int64) * stride_vc_head
        + offs_dv[None, :]
    )
    tl.store(p_k, k.to(k_cache_ptr.dtype.element_ty), mask=m_k)
    tl.store(p_v, v.to(v_cache_ptr.dtype.element_ty), mask=m_v)


_FP8 = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key[t]`` / ``value[t]`` (``[T, H, D]``) into the caches at ``slot_mapping[t]``.

    ``k_scale`` / ``v_scale`` (float32 scalars) are required for fp8 caches and ignored
    otherwise. Slots must be distinct apart from ``-1``.
    """
    if key.dim() != 3 or value.dim() != 3 or key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"key/value must be [T, H, D], got {tuple(key.shape)}, {tuple(value.shape)}"
        )
    num_tokens, num_heads, dk = key.shape
    dv = value.shape[2]
    for name, cache, d in (("k_cache", k_cache, dk), ("v_cache", v_cache, dv)):
        if cache.dim() != 4 or cache.shape[2] != num_heads or cache.shape[3] != d:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, {num_heads}, {d}], got "
                f"{tuple(cache.shape)}"
            )
        if cache.stride(3) != 1:
            raise ValueError(f"{name}'s head_dim must be contiguous (stride 1)")
    if k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError("k_cache and v_cache must have the same number of blocks and block size")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be [{num_tokens}] int32/int64")
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key/value head_dim must be contiguous")
    quant = k_cache.dtype in _FP8
    if quant:
        if k_scale is None or v_scale is None:
            raise ValueError("fp8 caches need k_scale and v_scale (float32 scalars)")
        k_scale = k_scale.reshape(1).to(torch.float32)
        v_scale = v_scale.reshape(1).to(torch.float32)
    else:
        k_scale = v_scale = slot_mapping  # never read
    if num_tokens == 0:
        return
    grid = lambda meta: (num_tokens, triton.cdiv(num_heads, meta["BLOCK_H"]))
    _write_kv_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        num_heads,
        k_cache.shape[1],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        HEAD_DIM_K=dk,
        HEAD_DIM_V=dv,
        BLOCK_DK=triton.next_power_of_2(dk),
        BLOCK_DV=triton.next_power_of_2(dv),
        QUANT=quant,
    )


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    block_size = k_cache.shape[1]
    live = slot_mapping >= 0
    slots = slot_mapping[live].long()
    blocks, offsets = slots // block_size, slots % block_size
    k, v = key[live], value[live]
    if k_cache.dtype in _FP8:
        k = k.float() / k_scale.float()
        v = v.float() / v_scale.float()
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)
