"""Paged decode attention over caches of any layout (one query token per request).

The caches are typed strided views ``[num_blocks, block_size, num_kv_heads, head_dim]`` made by a
memory plan: K of token ``p`` of a request lives at
``k_cache + table[p // block_size] * stride_block + (p % block_size) * stride_token + head *
stride_head``. Nothing else is assumed, so the same kernel reads vLLM's K-then-V pages, pages
packing N layers, head-major pages and layer-outer tensors.

- GQA: one program serves all query heads of a KV head, so K and V are read once.
- Split-K (flash-decoding): the context is cut into ``num_splits`` chunks processed in parallel,
  each writing a partial (max, sum, acc); a second kernel merges them.
- Sliding window: the query at position ``p`` attends to keys in ``(p - window, p]``.
- fp8 caches are dequantised with per-tensor float32 scales.

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


# Reads only the caches and writes fresh partial buffers, so tuning in place is safe.
_CONFIGS = [
    triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=2),
]


@_autotune(_CONFIGS, key=["HEAD_DIM_K", "HEAD_DIM_V", "GROUP", "block_size"])
@triton.jit
def _decode_partial_kernel(
    q_ptr,  # [B, Hq, Dk]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, Dk], strided
    v_cache_ptr,  # [num_blocks, block_size, Hkv, Dv], strided
    table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    k_scale_ptr,  # [1] float32 (read only when QUANT)
    v_scale_ptr,  # [1] float32
    part_m_ptr,  # [B, Hq, S] float32
    part_l_ptr,  # [B, Hq, S] float32
    part_acc_ptr,  # [B, Hq, S, Dv] float32
    sm_scale,
    block_size,
    split_len,  # tokens per split, a multiple of BLOCK_N
    window,  # sliding window in tokens; <= 0 means full attention
    stride_q_b,
    stride_q_h,
    stride_table_b,
    stride_kc_block,
    stride_kc_token,
    stride_kc_head,
    stride_vc_block,
    stride_vc_token,
    stride_vc_head,
    num_splits,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded for tl.dot
    HEAD_DIM_K: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_kvh = tl.program_id(1)
    i_s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + i_b)
    start = i_s * split_len
    end = tl.minimum(start + split_len, seq_len)
    if window > 0:
        start = tl.maximum(start, seq_len - window)

    offs_g = tl.arange(0, BLOCK_G)
    m_g = offs_g < GROUP
    offs_h = i_kvh * GROUP + offs_g
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_dk = offs_dk < HEAD_DIM_K
    m_dv = offs_dv < HEAD_DIM_V
    q = tl.load(
        q_ptr + i_b.to(tl.int64) * stride_q_b + offs_h[:, None] * stride_q_h + offs_dk[None, :],
        mask=m_g[:, None] & m_dk[None, :],
        other=0.0,
    )

    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    if QUANT:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    p_table = table_ptr + i_b.to(tl.int64) * stride_table_b
    for tile in range(start, end, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        m_n = offs_n < end
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
        s = tl.dot(q, tl.trans(k)) * sm_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(m_n[None, :], s, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(s, axis=1))
        alpha = tl.exp(b_m - m_new)
        p = tl.exp(s - m_new[:, None])
        b_l = b_l * alpha + tl.sum(p, axis=1)
        b_acc = b_acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        b_m = m_new

    base = (i_b.to(tl.int64) * (GROUP * tl.num_programs(1)) + offs_h) * num_splits + i_s
    tl.store(part_m_ptr + base, b_m, mask=m_g)
    tl.store(part_l_ptr + base, b_l, mask=m_g)
    tl.store(
        part_acc_ptr + base[:, None] * HEAD_DIM_V + offs_dv[None, :],
        b_acc,
        mask=m_g[:, None] & m_dv[None, :],
    )


@triton.jit
def _decode_reduce_kernel(
    part_m_ptr,  # [B, Hq, S] float32
    part_l_ptr,  # [B, Hq, S] float32
    part_acc_ptr,  # [B, Hq, S, Dv] float32
    out_ptr,  # [B, Hq, Dv]
    stride_out_b,
    stride_out_h,
    num_heads,
    num_splits,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_s = offs_s < num_splits
    m_dv = offs_dv < HEAD_DIM_V
    row = (i_b.to(tl.int64) * num_heads + i_h) * num_splits
    m = tl.load(part_m_ptr + row + offs_s, mask=m_s, other=float("-inf"))
    l = tl.load(part_l_ptr + row + offs_s, mask=m_s, other=0.0)
    acc = tl.load(
        part_acc_ptr + (row + offs_s)[:, None] * HEAD_DIM_V + offs_dv[None, :],
        mask=m_s[:, None] & m_dv[None, :],
        other=0.0,
    )
    m_max = tl.max(m, axis=0)
    # empty splits (m = -inf, l = 0) get weight 0; at least one split is non-empty
    w = tl.where(l > 0, tl.exp(m - m_max), 0.0)
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(l * w, axis=0)
    out = num / den
    tl.store(
        out_ptr + i_b.to(tl.int64) * stride_out_b + i_h * stride_out_h + offs_dv,
        out.to(out_ptr.dtype.element_ty),
        mask=m_dv,
    )


_FP8 = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)

#: programs a GPU needs to be busy (a few waves over ~132 SMs); decides split-K
_TARGET_PROGRAMS = 256
#: fewest tokens a split is worth
_MIN_SPLIT_TOKENS = 256


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Split the context when batch * KV heads alone cannot fill the GPU."""
    by_parallelism = triton.cdiv(_TARGET_PROGRAMS, max(1, batch * num_kv_heads))
    by_length = max(1, max_seq_len // _MIN_SPLIT_TOKENS)
    return max(1, min(by_parallelism, by_length, 64))


def _validate(q, k_cache, v_cache, block_tables, seq_lens) -> tuple[int, int, int, int, int]:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    batch, num_heads, dk = q.shape
    if k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError("k_cache and v_cache must be [num_blocks, block_size, Hkv, D] views")
    _, _block_size, num_kv_heads, dk_cache = k_cache.shape
    if dk_cache != dk:
        raise ValueError(f"q head_dim {dk} != k_cache head_dim {dk_cache}")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError("k_cache and v_cache disagree on blocks, block size or heads")
    if num_heads % num_kv_heads:
        raise ValueError(f"Hq={num_heads} is not a multiple of Hkv={num_kv_heads}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("the head_dim of q and of the caches must be contiguous")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError("block_tables must be an int32 [B, max_blocks] tensor")
    if block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError("block_tables and seq_lens must have one row per request")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    return batch, num_heads, num_kv_heads, dk, v_cache.shape[3]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per request over its paged K/V.

    Shapes: ``q [B, Hq, Dk]``, caches ``[num_blocks, block_size, Hkv, D]`` (any strides but the
    last), ``block_tables [B, max_blocks] int32``, ``seq_lens [B] int32`` (>= 1; the query is the
    last token). Returns ``[B, Hq, Dv]`` in ``q``'s dtype. ``max_seq_len`` avoids a device sync
    when ``num_splits`` is chosen automatically.
    """
    batch, num_heads, num_kv_heads, dk, dv = _validate(q, k_cache, v_cache, block_tables, seq_lens)
    out = torch.empty((batch, num_heads, dv), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if max_seq_len is None:
        lens = seq_lens.cpu()
        if int(lens.min()) < 1:
            raise ValueError("every request needs seq_len >= 1 (the query token itself)")
        max_seq_len = int(lens.max())
    needed = triton.cdiv(max_seq_len, k_cache.shape[1])
    if needed > block_tables.shape[1]:
        raise ValueError(
            f"block_tables has {block_tables.shape[1]} columns but seq_len {max_seq_len} needs "
            f"{needed} blocks"
        )
    quant = k_cache.dtype in _FP8
    if quant and (k_scale is None or v_scale is None):
        raise ValueError("fp8 caches need k_scale and v_scale (float32 scalars)")
    if quant and q.dtype in _FP8:
        raise ValueError("q must be fp16/bf16/fp32")
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_seq_len)
    group = num_heads // num_kv_heads
    # each split covers a whole number of tiles of any config (128 tokens)
    split_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), 128) * 128
    num_splits = triton.cdiv(max_seq_len, split_len)
    part_m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(
        (batch, num_heads, num_splits, dv), dtype=torch.float32, device=q.device
    )
    scales = (
        (k_scale.reshape(1).float(), v_scale.reshape(1).float()) if quant else (seq_lens, seq_lens)
    )
    _decode_partial_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scales[0],
        scales[1],
        part_m,
        part_l,
        part_acc,
        scale,
        k_cache.shape[1],
        split_len,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_splits,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM_K=dk,
        HEAD_DIM_V=dv,
        BLOCK_DK=max(16, triton.next_power_of_2(dk)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        QUANT=quant,
    )
    _decode_reduce_kernel[(batch, num_heads)](
        part_m,
        part_l,
        part_acc,
        out,
        out.stride(0),
        out.stride(1),
        num_heads,
        num_splits,
        HEAD_DIM_V=dv,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
    )
    return out


def gather_kv_ref(
    cache: torch.Tensor, table_row: torch.Tensor, seq_len: int, scale: torch.Tensor | None
) -> torch.Tensor:
    """The first ``seq_len`` tokens of one request as ``[seq_len, H, D]`` float32."""
    block_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blocks = table_row.long()[pos // block_size]
    x = cache[blocks, pos % block_size].float()
    return x * scale.float() if scale is not None and cache.dtype in _FP8 else x


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    **_: object,
) -> torch.Tensor:
    """Plain torch: gather each request's K/V through its block table, softmax in float32."""
    from einops import repeat

    out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[3], dtype=q.dtype, device=q.device)
    group = q.shape[1] // k_cache.shape[2]
    for b, n in enumerate(seq_lens.tolist()):
        k = gather_kv_ref(k_cache, block_tables[b], n, k_scale)
        v = gather_kv_ref(v_cache, block_tables[b], n, v_scale)
        k = repeat(k, "n h d -> n (h g) d", g=group)
        v = repeat(v, "n h d -> n (h g) d", g=group)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        if sliding_window:
            scores[:, : max(0, n - sliding_window)] = float("-inf")
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
