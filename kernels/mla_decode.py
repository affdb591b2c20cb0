"""Paged decode attention over an MLA latent cache (DeepSeek-V2/V3, Kimi-Linear), any layout.

Each token keeps one latent row shared by every head: ``c_kv`` (``kv_lora_rank`` values) followed
by the rotary key ``k_pe`` (``qk_rope_head_dim`` values). With the up-projections absorbed into the
query (``q_nope @ W_UK``) and the output (``... @ W_UV``), decode is multi-query attention in the
latent space:

    score[h, n] = (q_nope[h] . c_kv[n] + q_pe[h] . k_pe[n]) * scale
    out[h]      = softmax(score[h]) @ c_kv           # [kv_lora_rank], W_UV applied by the caller

The cache is a typed strided view ``[num_blocks, block_size, latent_dim]`` or
``[num_blocks, block_size, 1, latent_dim]`` (what a memory plan's ``kv_views`` returns for an MLA
layer); the latent of token ``p`` is at ``cache + table[p // block_size] * stride_block +
(p % block_size) * stride_token``. The ``c_kv`` and ``k_pe`` parts are loaded separately, so the
576-wide latent of DeepSeek costs no padding to 1024, and ``c_kv`` is read once for the scores and
the output. All heads of a request share each loaded tile (``BLOCK_H`` heads per program).

Split-K (flash-decoding) as in ``paged_decode.py``: partial (max, sum, acc) per split, merged by a
second kernel. fp8 caches are dequantised with a per-tensor float32 scale.

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


# Reads only the cache and writes fresh partial buffers, so tuning in place is safe. The
# accumulator is BLOCK_H x kv_lora_rank float32 (32 KiB at 16 x 512), so tiles stay small.
_CONFIGS = [
    triton.Config({"BLOCK_N": 16}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_N": 32}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=2),
]

#: heads sharing one program's K tiles (tl.dot needs at least 16 rows)
BLOCK_H = 16
#: programs a GPU needs to be busy (a few waves over ~132 SMs); decides split-K
_TARGET_PROGRAMS = 256
#: fewest tokens a split is worth
_MIN_SPLIT_TOKENS = 256


@_autotune(_CONFIGS, key=["DIM_C", "DIM_R", "block_size"])
@triton.jit
def _mla_partial_kernel(
    q_nope_ptr,  # [B, H, Dc]
    q_pe_ptr,  # [B, H, Dr]
    cache_ptr,  # [num_blocks, block_size, Dc + Dr], strided
    table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    scale_ptr,  # [1] float32 (read only when QUANT)
    part_m_ptr,  # [B, H, S] float32
    part_l_ptr,  # [B, H, S] float32
    part_acc_ptr,  # [B, H, S, Dc] float32
    sm_scale,
    block_size,
    split_len,  # tokens per split, a multiple of every BLOCK_N
    num_heads,
    num_splits,
    stride_qn_b,
    stride_qn_h,
    stride_qp_b,
    stride_qp_h,
    stride_table_b,
    stride_c_block,
    stride_c_token,
    DIM_C: tl.constexpr,
    DIM_R: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_hb = tl.program_id(1)
    i_s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + i_b)
    start = i_s * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = offs_h < num_heads
    offs_dc = tl.arange(0, BLOCK_DC)
    offs_dr = tl.arange(0, BLOCK_DR)
    m_dc = offs_dc < DIM_C
    m_dr = offs_dr < DIM_R
    i_b64 = i_b.to(tl.int64)
    q_nope = tl.load(
        q_nope_ptr + i_b64 * stride_qn_b + offs_h[:, None] * stride_qn_h + offs_dc[None, :],
        mask=m_h[:, None] & m_dc[None, :],
        other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + i_b64 * stride_qp_b + offs_h[:, None] * stride_qp_h + offs_dr[None, :],
        mask=m_h[:, None] & m_dr[None, :],
        other=0.0,
    )

    b_m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_H], tl.float32)
    b_acc = tl.zeros([BLOCK_H, BLOCK_DC], tl.float32)
    if QUANT:
        c_scale = tl.load(scale_ptr)
    p_table = table_ptr + i_b64 * stride_table_b
    for tile in range(start, end, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        m_n = offs_n < end
        blocks = tl.load(p_table + offs_n // block_size, mask=m_n, other=0).to(tl.int64)
        in_block = (offs_n % block_size).to(tl.int64)
        p_row = cache_ptr + blocks * stride_c_block + in_block * stride_c_token  # [BLOCK_N]
        c = tl.load(
            p_row[:, None] + offs_dc[None, :], mask=m_n[:, None] & m_dc[None, :], other=0.0
        )
        k_pe = tl.load(
            p_row[:, None] + DIM_C + offs_dr[None, :], mask=m_n[:, None] & m_dr[None, :], other=0.0
        )
        if QUANT:
            c = (c.to(tl.float32) * c_scale).to(q_nope.dtype)
            k_pe = (k_pe.to(tl.float32) * c_scale).to(q_nope.dtype)
        else:
            c = c.to(q_nope.dtype)
            k_pe = k_pe.to(q_nope.dtype)
        s = tl.dot(q_nope, tl.trans(c)) + tl.dot(q_pe, tl.trans(k_pe))  # [BLOCK_H, BLOCK_N]
        s = tl.where(m_n[None, :], s * sm_scale, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(s, axis=1))
        alpha = tl.exp(b_m - m_new)
        p = tl.exp(s - m_new[:, None])
        b_l = b_l * alpha + tl.sum(p, axis=1)
        b_acc = b_acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        b_m = m_new

    base = (i_b64 * num_heads + offs_h) * num_splits + i_s
    tl.store(part_m_ptr + base, b_m, mask=m_h)
    tl.store(part_l_ptr + base, b_l, mask=m_h)
    tl.store(
        part_acc_ptr + base[:, None] * DIM_C + offs_dc[None, :],
        b_acc,
        mask=m_h[:, None] & m_dc[None, :],
    )


@triton.jit
def _mla_reduce_kernel(
    part_m_ptr,  # [B, H, S] float32
    part_l_ptr,  # [B, H, S] float32
    part_acc_ptr,  # [B, H, S, Dc] float32
    out_ptr,  # [B, H, Dc]
    stride_out_b,
    stride_out_h,
    num_heads,
    num_splits,
    DIM_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DC: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dc = tl.arange(0, BLOCK_DC)
    m_s = offs_s < num_splits
    m_dc = offs_dc < DIM_C
    row = (i_b.to(tl.int64) * num_heads + i_h) * num_splits
    m = tl.load(part_m_ptr + row + offs_s, mask=m_s, other=float("-inf"))
    l = tl.load(part_l_ptr + row + offs_s, mask=m_s, other=0.0)
    acc = tl.load(
        part_acc_ptr + (row + offs_s)[:, None] * DIM_C + offs_dc[None, :],
        mask=m_s[:, None] & m_dc[None, :],
        other=0.0,
    )
    m_max = tl.max(m, axis=0)
    # empty splits (m = -inf, l = 0) get weight 0; at least one split is non-empty
    w = tl.where(l > 0, tl.exp(m - m_max), 0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(
        out_ptr + i_b.to(tl.int64) * stride_out_b + i_h * stride_out_h + offs_dc,
        out.to(out_ptr.dtype.element_ty),
        mask=m_dc,
    )


_FP8 = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)


def _latent_3d(cache: torch.Tensor) -> torch.Tensor:
    """Accept ``[nb, bs, D]`` or a plan's ``[nb, bs, 1, D]`` view."""
    if cache.dim() == 4:
        if cache.shape[2] != 1:
            raise ValueError(
                f"an MLA latent cache has one head, got {cache.shape[2]} (shape "
                f"{tuple(cache.shape)}); pass the [num_blocks, block_size, 1, latent] view"
            )
        cache = cache[:, :, 0]
    if cache.dim() != 3:
        raise ValueError(
            f"latent_cache must be [num_blocks, block_size, latent_dim] (or with a head dim of "
            f"1), got shape {tuple(cache.shape)}"
        )
    if cache.stride(2) != 1:
        raise ValueError("the latent dim of the cache must be contiguous")
    return cache


def mla_decode_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode, one query token per request.

    Shapes: ``q_nope [B, H, Dc]`` (already multiplied by ``W_UK``), ``q_pe [B, H, Dr]``,
    ``latent_cache [num_blocks, block_size, (1,) Dc + Dr]`` (any block and token strides),
    ``block_tables [B, max_blocks] int32``, ``seq_lens [B] int32`` (>= 1). Returns
    ``[B, H, Dc]`` (in ``out`` if given) in ``q_nope``'s dtype: the attention-weighted latent,
    before ``W_UV``.
    """
    cache = _latent_3d(latent_cache)
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_nope.shape[:2] != q_pe.shape[:2]:
        raise ValueError(
            f"q_nope [B, H, Dc] and q_pe [B, H, Dr] must agree on B and H, got "
            f"{tuple(q_nope.shape)} and {tuple(q_pe.shape)}"
        )
    batch, num_heads, dc = q_nope.shape
    dr = q_pe.shape[2]
    if dc + dr != cache.shape[2]:
        raise ValueError(
            f"Dc + Dr = {dc} + {dr} does not match the cache's latent dim {cache.shape[2]}"
        )
    if q_nope.stride(2) != 1 or q_pe.stride(2) != 1:
        raise ValueError("the last dim of q_nope and q_pe must be contiguous")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError("block_tables must be an int32 [B, max_blocks] tensor")
    if block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError("block_tables and seq_lens must have one row per request")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    quant = cache.dtype in _FP8
    if quant and k_scale is None:
        raise ValueError("an fp8 latent cache needs k_scale (a float32 scalar)")
    if out is None:
        out = torch.empty((batch, num_heads, dc), dtype=q_nope.dtype, device=q_nope.device)
    elif out.shape != (batch, num_heads, dc) or out.stride(2) != 1:
        raise ValueError(f"out must be [B, H, Dc] = {(batch, num_heads, dc)}, contiguous in Dc")
    if batch == 0:
        return out
    if max_seq_len is None:
        lens = seq_lens.cpu()
        if int(lens.min()) < 1:
            raise ValueError("every request needs seq_len >= 1 (the query token itself)")
        max_seq_len = int(lens.max())
    block_size = cache.shape[1]
    needed = triton.cdiv(max_seq_len, block_size)
    if needed > block_tables.shape[1]:
        raise ValueError(
            f"block_tables has {block_tables.shape[1]} columns but seq_len {max_seq_len} needs "
            f"{needed} blocks"
        )
    head_blocks = triton.cdiv(num_heads, BLOCK_H)
    if num_splits is None:
        by_parallelism = triton.cdiv(_TARGET_PROGRAMS, batch * head_blocks)
        num_splits = max(1, min(by_parallelism, max_seq_len // _MIN_SPLIT_TOKENS, 64))
    # each split covers whole tiles of any config (64 tokens)
    split_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), 64) * 64
    num_splits = triton.cdiv(max_seq_len, split_len)
    dev = q_nope.device
    part_m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((batch, num_heads, num_splits, dc), dtype=torch.float32, device=dev)
    scale_t = k_scale.reshape(1).float() if quant else seq_lens
    _mla_partial_kernel[(batch, head_blocks, num_splits)](
        q_nope,
        q_pe,
        cache,
        block_tables,
        seq_lens,
        scale_t,
        part_m,
        part_l,
        part_acc,
        scale,
        block_size,
        split_len,
        num_heads,
        num_splits,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        block_tables.stride(0),
        cache.stride(0),
        cache.stride(1),
        DIM_C=dc,
        DIM_R=dr,
        BLOCK_DC=max(16, triton.next_power_of_2(dc)),
        BLOCK_DR=max(16, triton.next_power_of_2(dr)),
        BLOCK_H=BLOCK_H,
        QUANT=quant,
    )
    _mla_reduce_kernel[(batch, num_heads)](
        part_m,
        part_l,
        part_acc,
        out,
        out.stride(0),
        out.stride(1),
        num_heads,
        num_splits,
        DIM_C=dc,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        BLOCK_DC=max(16, triton.next_power_of_2(dc)),
    )
    return out


def mla_decode_attention_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    **_: object,
) -> torch.Tensor:
    """Plain torch: gather each request's latents through its block table, float32 softmax."""
    cache = _latent_3d(latent_cache)
    dc = q_nope.shape[2]
    block_size = cache.shape[1]
    out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n, device=cache.device)
        lat = cache[block_tables[b].long()[pos // block_size], pos % block_size].float()
        if cache.dtype in _FP8:
            lat = lat * k_scale.float()
        c, k_pe = lat[:, :dc], lat[:, dc:]
        scores = (q_nope[b].float() @ c.T + q_pe[b].float() @ k_pe.T) * scale
        out[b] = (scores.softmax(-1) @ c).to(q_nope.dtype)
    return out
