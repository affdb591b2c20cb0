"""Paged prefill / extend attention over caches of any layout.

Many query tokens per request attend, causally, to the request's cached prefix plus the new
tokens, all read from the paged caches (the new K/V are written first by the cache-write kernel,
as vLLM's unified Triton attention does). Batches are varlen: request ``r`` has
``q_len = cu_seqlens_q[r+1] - cu_seqlens_q[r]`` query tokens at absolute positions
``seq_lens[r] - q_len .. seq_lens[r] - 1``.

The caches are typed strided views ``[num_blocks, block_size, num_kv_heads, head_dim]``: any
block, token and head strides (K-then-V pages, packed pages, head-major pages, layer-outer
tensors); only the last dim is contiguous. Addressing is int64.

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


# BLOCK_M is fixed by the launcher (it decides the tile list), so only BLOCK_N and warps are
# tuned; the kernel writes a fresh output, so tuning in place is safe.
_CONFIGS = [
    triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=3),
]

#: query tokens per program
BLOCK_M = 32


@_autotune(_CONFIGS, key=["HEAD_DIM_K", "HEAD_DIM_V", "GROUP", "block_size"])
@triton.jit
def _prefill_kernel(
    q_ptr,  # [total_q, Hq, Dk]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, Dk], strided
    v_cache_ptr,  # [num_blocks, block_size, Hkv, Dv], strided
    table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32, total KV length incl. the new tokens
    cu_q_ptr,  # [B + 1] int32
    tile_req_ptr,  # [num_tiles] int32: the request of each query tile
    tile_start_ptr,  # [num_tiles] int32: first query index (within the request) of the tile
    k_scale_ptr,  # [1] float32 (read only when QUANT)
    v_scale_ptr,  # [1] float32
    out_ptr,  # [total_q, Hq, Dv]
    sm_scale,
    block_size,
    window,  # <= 0: full causal attention
    stride_q_t,
    stride_q_h,
    stride_out_t,
    stride_out_h,
    stride_table_b,
    stride_kc_block,
    stride_kc_token,
    stride_kc_head,
    stride_vc_block,
    stride_vc_token,
    stride_vc_head,
    GROUP: tl.constexpr,
    HEAD_DIM_K: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i_tile = tl.program_id(0)
    i_h = tl.program_id(1)
    i_kvh = i_h // GROUP
    req = tl.load(tile_req_ptr + i_tile)
    q_first = tl.load(tile_start_ptr + i_tile)
    q_begin = tl.load(cu_q_ptr + req)
    q_len = tl.load(cu_q_ptr + req + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len  # tokens cached before the first query token

    offs_m = q_first + tl.arange(0, BLOCK_M)
    m_m = offs_m < q_len
    pos_m = ctx + offs_m  # absolute positions of the query rows
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_dk = offs_dk < HEAD_DIM_K
    m_dv = offs_dv < HEAD_DIM_V
    rows = (q_begin + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_q_t + i_h * stride_q_h + offs_dk[None, :],
        mask=m_m[:, None] & m_dk[None, :],
        other=0.0,
    )

    # finite initial max: fully masked padding rows stay finite (they are not stored)
    b_m = tl.full([BLOCK_M], -1e30, tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if QUANT:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    hi = tl.minimum(seq_len, ctx + q_first + BLOCK_M)
    lo = 0
    if window > 0:
        lo = tl.maximum(0, ctx + q_first - window + 1) // BLOCK_N * BLOCK_N
    p_table = table_ptr + req.to(tl.int64) * stride_table_b
    for tile in range(lo, hi, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        m_n = offs_n < hi
        blocks = tl.load(p_table + offs_n // block_size, mask=m_n, other=0).to(tl.int64)
        in_block = (offs_n % block_size).to(tl.int64)
        p_k = (
            k_cache_ptr
            + blocks[:, None] * stride_kc_block
            + in_block[:, None] * stride_kc_token
            + i_kvh.to(tl.int64) * stride_kc_head
            + offs_dk[None, :]
        )
        p_v = (
            v_cache_ptr
            + blocks[:, None] * stride_vc_block
            + in_block[:, None] * stride_vc_token
            + i_kvh.to(tl.int64) * stride_vc_head
            + offs_dv[None, :]
        )
        k = tl.load(p_k, mask=m_n[:, None] & m_dk[None, :], other=0.0)
        v = tl.load(p_v, mask=m_n[:, None] & m_dv[None, :], other=0.0)
        if QUANT:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * sm_scale  # [BLOCK_M, BLOCK_N]
        visible = m_n[None, :] & (offs_n[None, :] <= pos_m[:, None])
        if window > 0:
            visible = visible & (offs_n[None, :] > pos_m[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(s, axis=1))
        alpha = tl.exp(b_m - m_new)
        p = tl.exp(s - m_new[:, None])
        b_l = b_l * alpha + tl.sum(p, axis=1)
        b_acc = b_acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        b_m = m_new

    out = b_acc / b_l[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_out_t + i_h * stride_out_h + offs_dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_m[:, None] & m_dv[None, :],
    )


_FP8 = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [total_q, Hq, Dk]`` over each request's paged K/V.

    ``cu_seqlens_q [B+1] int32`` splits ``q`` into requests; ``seq_lens [B] int32`` is each
    request's KV length including its new tokens (already in the cache). Returns
    ``[total_q, Hq, Dv]`` in ``q``'s dtype.
    """
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"q must be [total_q, Hq, D] with a contiguous last dim, got {q.shape}")
    total_q, num_heads, dk = q.shape
    if k_cache.dim() != 4 or v_cache.shape[:3] != k_cache.shape[:3] or k_cache.shape[3] != dk:
        raise ValueError("caches must be [num_blocks, block_size, Hkv, D] views matching q")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the caches' head_dim must be contiguous")
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"Hq={num_heads} is not a multiple of Hkv={num_kv_heads}")
    batch = seq_lens.shape[0]
    if cu_seqlens_q.shape != (batch + 1,) or block_tables.shape[0] != batch:
        raise ValueError("cu_seqlens_q must be [B+1] and block_tables [B, max_blocks]")
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be a row-contiguous int32 tensor")
    quant = k_cache.dtype in _FP8
    if quant and (k_scale is None or v_scale is None):
        raise ValueError("fp8 caches need k_scale and v_scale (float32 scalars)")
    cu = cu_seqlens_q.cpu().long()
    lens = seq_lens.cpu().long()
    q_lens = cu[1:] - cu[:-1]
    if int(cu[-1]) != total_q or (q_lens < 0).any():
        raise ValueError(f"cu_seqlens_q must rise from 0 to total_q={total_q}")
    if (q_lens > lens).any():
        raise ValueError("a request has more query tokens than seq_lens (its KV length)")
    needed = (lens + k_cache.shape[1] - 1) // k_cache.shape[1]
    if len(needed) and int(needed.max()) > block_tables.shape[1]:
        raise ValueError(f"block_tables has {block_tables.shape[1]} columns, needs {needed.max()}")
    dv = v_cache.shape[3]
    out = torch.empty((total_q, num_heads, dv), dtype=q.dtype, device=q.device)
    # one tile per BLOCK_M query tokens of a request
    tiles_per_req = (q_lens + BLOCK_M - 1) // BLOCK_M
    tile_req = torch.repeat_interleave(torch.arange(batch), tiles_per_req)
    first = torch.cumsum(tiles_per_req, 0) - tiles_per_req
    tile_start = (torch.arange(len(tile_req)) - first[tile_req]) * BLOCK_M
    if len(tile_req) == 0:
        return out
    tile_req = tile_req.to(torch.int32).to(q.device)
    tile_start = tile_start.to(torch.int32).to(q.device)
    scales = (
        (k_scale.reshape(1).float(), v_scale.reshape(1).float()) if quant else (seq_lens, seq_lens)
    )
    _prefill_kernel[(len(tile_req), num_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        tile_req,
        tile_start,
        scales[0],
        scales[1],
        out,
        scale,
        k_cache.shape[1],
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM_K=dk,
        HEAD_DIM_V=dv,
        BLOCK_DK=max(16, triton.next_power_of_2(dk)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        QUANT=quant,
        BLOCK_M=BLOCK_M,
    )
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch: gather each request's K/V through its block table, causal softmax in fp32."""
    from einops import repeat

    out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[3], dtype=q.dtype, device=q.device)
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    for r, n in enumerate(seq_lens.tolist()):
        a, b = int(cu_seqlens_q[r]), int(cu_seqlens_q[r + 1])
        pos = torch.arange(n)
        blocks = block_tables[r].long()[pos // block_size]
        k = k_cache[blocks, pos % block_size].float()
        v = v_cache[blocks, pos % block_size].float()
        if k_cache.dtype in _FP8:
            k, v = k * k_scale.float(), v * v_scale.float()
        k = repeat(k, "n h d -> n (h g) d", g=group)
        v = repeat(v, "n h d -> n (h g) d", g=group)
        qpos = torch.arange(n - (b - a), n)
        visible = pos[None, :] <= qpos[:, None]
        if sliding_window:
            visible &= pos[None, :] > qpos[:, None] - sliding_window
        scores = torch.einsum("mhd,nhd->hmn", q[a:b].float(), k) * scale
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[a:b] = torch.einsum("hmn,nhd->mhd", scores.softmax(-1), v).to(q.dtype)
    return out
