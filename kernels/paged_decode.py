"""Paged decode attention over caches of any layout (one query token per request).

The caches are typed strided views ``[num_blocks, block_size, num_kv_heads, head_dim]`` made by a
memory plan: K of token ``p`` of a request lives at
``k_cache + table[p // block_size] * stride_block + (p % block_size) * stride_token + head *
stride_head``. Nothing else is assumed, so the same kernel reads vLLM's K-then-V pages, pages
packing N layers, head-major pages and layer-outer tensors.

- GQA: one program serves all query heads of a KV head, so each K/V byte is read once per KV
  head, not once per query head.
- Page walk: a tile of ``BLOCK_N`` tokens is ``BLOCK_N // SEG`` segments of ``SEG`` tokens, where
  ``SEG`` is a power of two dividing ``block_size`` (so a segment never straddles a page). The
  block table is read once per segment as one small vector, not once per token, and there is no
  runtime division by ``block_size`` per token: only one per segment. The head's int64 base is
  hoisted out of the loop.
- Load/compute overlap: the block ids of the next tile are loaded one iteration ahead (a
  loop-carried value), so the K/V loads of a tile depend on no load of the same iteration and
  Triton's software pipeliner multi-buffers them in shared memory (``num_stages - 1`` tiles in
  flight, cp.async on sm_80, cp.async/TMA-free async copies on sm_90).
- Split-K (flash-decoding): the context is cut into ``num_splits`` chunks processed in parallel,
  each writing a partial (max, sum, acc); a second kernel merges them.
- Sliding window: the query at position ``p`` attends to keys in ``(p - window, p]``; keys below
  the window are never loaded (an allocator frees those blocks to a null block whose bytes may
  be anything, NaN included).
- fp8 caches are dequantised with per-tensor float32 scales. GPUs without hardware e4m3
  (sm_80, A100) get the cache's bytes and convert them in the kernel.

Contract (checked only with ``validate=True`` or ``HYBRIDKV_VALIDATE=1``, because checking device
data costs a host sync): ``1 <= seq_lens[b] <= max_seq_len`` (when given), every block id a
request uses (columns ``< cdiv(seq_lens[b], block_size)``) is in ``[0, num_blocks)``; columns past
that are never read and may hold anything. Shapes, dtypes, strides and ``num_splits >= 1`` are
always checked on the host. Outside the contract the kernel reads other memory (the next
layer's page for a block id equal to ``num_blocks``) or drops tokens (``max_seq_len`` too small).

Hopper: K/V segments are 2-D boxes ``[SEG, head_dim]`` at a page-computed address, so TMA (one
descriptor over the cache view, boxes at (page, offset, head)) would take the address math and
the per-thread async copies off the SMs; not done because Triton's device-side descriptors need
a global scratch allocator and decode is bound by HBM bandwidth, which cp.async already reaches
with enough tiles in flight. wgmma needs 64 rows per warpgroup while a decode tile has only the
GQA group (<= 16) rows, so ``mma.sync`` is the right instruction here.

Standalone: imports only torch and triton, so the file can be copied into another project.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _autotune(
    configs: list[triton.Config],
    key: list[str],
    prune_configs_by: dict | None = None,
    **kwargs,
):
    """``triton.autotune`` on a GPU; under the interpreter, pin one config (the first, or the
    one ``HYBRIDKV_INTERPRET_CONFIG`` numbers, so tests can check each), because the autotuner
    needs a GPU driver to benchmark. The pin goes through the same ``early_config_prune`` as on
    a GPU: when it drops the pinned config for a launch, a kept one runs instead, so the CPU
    tests never exercise a config a GPU would not run."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        index = int(os.environ.get("HYBRIDKV_INTERPRET_CONFIG", "0")) % len(configs)
        prune = (prune_configs_by or {}).get("early_config_prune")

        def pick(args: dict | None) -> triton.Config:
            # ``args`` is None when a test reads the pinned values without launching
            if args is None or prune is None:
                return configs[index]
            kept = prune(configs, args)
            return configs[index] if configs[index] in kept else kept[index % len(kept)]

        names = configs[index].kwargs
        return triton.heuristics({k: (lambda args, k=k: pick(args).kwargs[k]) for k in names})
    return triton.autotune(configs, key=key, prune_configs_by=prune_configs_by, **kwargs)


# Reads only the caches and writes fresh partial buffers, so tuning in place is safe. Each
# config keeps num_stages - 1 K and V tiles in flight.
_CONFIGS = [
    triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=3),
]
#: the split length is a multiple of this, so every config's tiles fit whole in a split
_MAX_BLOCK_N = 128


def _prune(configs: list[triton.Config], nargs: dict, **kwargs) -> list[triton.Config]:
    """Drop configs whose K/V tiles in flight would not fit in shared memory (or would spill)
    at wide heads: 128-token tiles at head dim 256 hold 2 x 3 x 64 KiB."""
    args = {**nargs, **kwargs}
    width = args["BLOCK_DK"] + args["BLOCK_DV"]
    kept = [c for c in configs if c.kwargs["BLOCK_N"] * width <= 64 * 256]
    if args["FP8"] == 2:  # the byte decode's temporaries spill 64-token tiles at 4 warps (sm_80)
        kept = [c for c in kept if c.kwargs["BLOCK_N"] < 64 or c.num_warps >= 8]
    if args["FP8"] == 1 and _capability(args["q_ptr"].device) >= (9, 0):
        # measured (paper/compile_kernels.py): 32-token fp8 tiles at 4 warps spill 16 B on sm_90
        kept = [c for c in kept if (c.kwargs["BLOCK_N"], c.num_warps) != (32, 4)]
    return kept or configs[:1]


@_autotune(
    _CONFIGS,
    key=["HEAD_DIM_K", "HEAD_DIM_V", "GROUP", "PAGE_ALIGN", "FP8"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _decode_partial_kernel(
    q_ptr,  # [B, Hq, Dk]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, Dk], strided (uint8 bytes when FP8 == 2)
    v_cache_ptr,  # [num_blocks, block_size, Hkv, Dv], strided
    table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    k_scale_ptr,  # [1] float32 (read only when FP8)
    v_scale_ptr,  # [1] float32
    part_m_ptr,  # [B, Hq, S] float32
    part_l_ptr,  # [B, Hq, S] float32
    part_acc_ptr,  # [B, Hq, S, Dv] float32
    sm_scale,
    block_size,
    split_len,  # tokens per split, a multiple of every BLOCK_N
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
    PAGE_ALIGN: tl.constexpr,  # largest power of two dividing block_size (capped)
    FP8: tl.constexpr,  # 0: no fp8; 1: fp8 cache converted in hardware; 2: e4m3 bytes
    BLOCK_N: tl.constexpr,
):
    # a tile = PAGES segments of SEG tokens; a segment lies inside one page
    SEG: tl.constexpr = min(BLOCK_N, PAGE_ALIGN)
    PAGES: tl.constexpr = BLOCK_N // SEG
    i_b = tl.program_id(0)
    i_kvh = tl.program_id(1)
    i_s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + i_b)
    start = i_s * split_len
    end = tl.minimum(start + split_len, seq_len)
    lo = start
    if window > 0:
        lo = tl.maximum(start, seq_len - window)
    tile_lo = lo // BLOCK_N * BLOCK_N  # tiles stay BLOCK_N-aligned, so segments stay in pages

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
    if FP8 > 0:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    # loop invariants: the head's base and each row's offset inside its segment
    p_k_head = k_cache_ptr + i_kvh.to(tl.int64) * stride_kc_head
    p_v_head = v_cache_ptr + i_kvh.to(tl.int64) * stride_vc_head
    offs_seg = tl.arange(0, BLOCK_N) % SEG
    offs_k_row = offs_seg[:, None] * stride_kc_token + offs_dk[None, :]
    offs_v_row = offs_seg[:, None] * stride_vc_token + offs_dv[None, :]
    p_table = table_ptr + i_b.to(tl.int64) * stride_table_b
    offs_pages = tl.arange(0, PAGES) * SEG

    # block ids of the first tile; each iteration loads the next tile's ids ahead, so the K/V
    # loads of a tile depend on no load of the same iteration and can be multi-buffered
    if PAGES == 1:  # the tile lies in one page: a scalar id
        seg_block = tl.load(p_table + tile_lo // block_size, mask=tile_lo < end, other=0)
    else:
        seg_pos = tile_lo + offs_pages
        seg_block = tl.load(p_table + seg_pos // block_size, mask=seg_pos < end, other=0)
    for tile in range(tile_lo, end, BLOCK_N):
        if PAGES == 1:
            in_page = tile % block_size
            p_k = p_k_head + (seg_block.to(tl.int64) * stride_kc_block + in_page * stride_kc_token)
            p_v = p_v_head + (seg_block.to(tl.int64) * stride_vc_block + in_page * stride_vc_token)
            p_k = p_k + offs_k_row
            p_v = p_v + offs_v_row
            next_tile = tile + BLOCK_N
            seg_block = tl.load(p_table + next_tile // block_size, mask=next_tile < end, other=0)
        else:
            seg_pos = tile + offs_pages
            in_page = seg_pos % block_size
            k_base = seg_block.to(tl.int64) * stride_kc_block + in_page * stride_kc_token
            v_base = seg_block.to(tl.int64) * stride_vc_block + in_page * stride_vc_token
            k_rows = tl.reshape(tl.broadcast_to(k_base[:, None], (PAGES, SEG)), (BLOCK_N,))
            v_rows = tl.reshape(tl.broadcast_to(v_base[:, None], (PAGES, SEG)), (BLOCK_N,))
            p_k = p_k_head + k_rows[:, None] + offs_k_row
            p_v = p_v_head + v_rows[:, None] + offs_v_row
            next_pos = seg_pos + BLOCK_N
            seg_block = tl.load(p_table + next_pos // block_size, mask=next_pos < end, other=0)
        offs_n = tile + tl.arange(0, BLOCK_N)
        m_n = (offs_n >= lo) & (offs_n < end)
        k = tl.load(p_k, mask=m_n[:, None] & m_dk[None, :], other=0.0)
        v = tl.load(p_v, mask=m_n[:, None] & m_dv[None, :], other=0.0)
        if FP8 == 2:
            k = (_e4m3_to_f32(k) * k_scale).to(q.dtype)
            v = (_e4m3_to_f32(v) * v_scale).to(q.dtype)
        elif FP8 == 1:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * sm_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(m_n[None, :], s, float("-inf"))
        # every tile holds a key in [lo, end), so m_new is finite from the first tile on
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
def _e4m3_to_f32(x):
    """e4m3fn bytes (uint8) to float32, exactly: the fields are placed in an fp16 (same
    mantissa, exponent field widened) and rebiased by 2**(15 - 7); subnormals map to fp16
    subnormals, so they are exact too. 0x7F / 0xFF are NaN."""
    x16 = x.to(tl.uint16)
    bits = ((x16 & 0x7F) << 7) | ((x16 & 0x80) << 8)
    y = bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((x16 & 0x7F) == 0x7F, float("nan"), y)


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


def _capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability; the CPU (the interpreter) counts as sm_80, the oldest GPU
    the configs are pruned for. The compile check monkeypatches this per target."""
    if device.type != "cuda":
        return (8, 0)
    return torch.cuda.get_device_capability(device)


def _fp8e4_in_hardware(device: torch.device) -> bool:
    """sm_89+ (Ada, Hopper) convert e4m3 in hardware; older GPUs get the raw bytes and a
    software conversion in the kernel. Tests and the compile check monkeypatch this."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _validate_enabled(validate: bool | None) -> bool:
    if validate is None:
        return os.environ.get("HYBRIDKV_VALIDATE", "") not in ("", "0")
    return validate


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Split the context when batch * KV heads alone cannot fill the GPU."""
    by_parallelism = triton.cdiv(_TARGET_PROGRAMS, max(1, batch * num_kv_heads))
    by_length = max(1, max_seq_len // _MIN_SPLIT_TOKENS)
    return max(1, min(by_parallelism, by_length, 64))


def _check_shapes(q, k_cache, v_cache, block_tables, seq_lens) -> tuple[int, int, int, int, int]:
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
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be int32/int64, got {seq_lens.dtype}")
    return batch, num_heads, num_kv_heads, dk, v_cache.shape[3]


def check_block_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """Every block id a request reads (columns below ``cdiv(seq_len, block_size)``) lies in
    ``[0, num_blocks)``. Syncs with the device."""
    lens = seq_lens.detach().cpu().long()
    tables = block_tables.detach().cpu().long()
    used = (lens + block_size - 1) // block_size
    cols = torch.arange(tables.shape[1])
    live = cols[None, :] < used[:, None]
    bad = live & ((tables < 0) | (tables >= num_blocks))
    if bad.any():
        b, c = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"block_tables[{b}, {c}] = {int(tables[b, c])} is outside [0, {num_blocks}): request "
            f"{b} reads that column for its seq_len {int(lens[b])} (block_size {block_size}); "
            f"an id of num_blocks or more reads another layer's memory, -1 reads before the "
            f"cache. Give every used column a block id of this cache (0 is the null block)"
        )


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
    validate: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per request over its paged K/V.

    Shapes: ``q [B, Hq, Dk]``, caches ``[num_blocks, block_size, Hkv, D]`` (any strides but the
    last), ``block_tables [B, max_blocks] int32``, ``seq_lens [B] int32`` (>= 1; the query is the
    last token). Returns ``[B, Hq, Dv]`` in ``q``'s dtype. With ``max_seq_len`` (>= every
    seq_len) the call never syncs with the device; without it, it reads ``seq_lens`` back once.
    ``validate`` (default: the ``HYBRIDKV_VALIDATE`` environment switch) checks every block id
    and length the kernel will use (see the module's contract). ``out [B, Hq, Dv]`` (contiguous
    in Dv), if given, receives the result.
    """
    batch, num_heads, num_kv_heads, dk, dv = _check_shapes(
        q, k_cache, v_cache, block_tables, seq_lens
    )
    num_blocks, block_size = k_cache.shape[:2]
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 (or None to choose), got {num_splits}")
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(f"sliding_window must be None, 0 (off) or positive: {sliding_window}")
    if out is None:
        out = torch.empty((batch, num_heads, dv), dtype=q.dtype, device=q.device)
    elif out.shape != (batch, num_heads, dv) or out.stride(2) != 1:
        raise ValueError(f"out must be [B, Hq, Dv] = {(batch, num_heads, dv)}, contiguous in Dv")
    if batch == 0:
        return out
    check = _validate_enabled(validate)
    if max_seq_len is None or check:
        lens = seq_lens.detach().cpu()
        if int(lens.min()) < 1:
            b = int(lens.argmin())
            raise ValueError(
                f"seq_lens[{b}] = {int(lens[b])}: every request needs seq_len >= 1 (the query "
                f"token itself)"
            )
        if max_seq_len is not None and int(lens.max()) > max_seq_len:
            b = int(lens.argmax())
            raise ValueError(
                f"seq_lens[{b}] = {int(lens[b])} exceeds max_seq_len = {max_seq_len}: the "
                f"tokens past it would be dropped; pass max_seq_len >= max(seq_lens)"
            )
        if max_seq_len is None:
            max_seq_len = int(lens.max())
        if check:  # the host copy of seq_lens, not a second sync
            check_block_tables(block_tables, lens, num_blocks, block_size)
    needed = triton.cdiv(max_seq_len, block_size)
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
    if quant != (v_cache.dtype in _FP8):
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    fp8 = 0
    if quant:
        fp8 = 1
        if k_cache.dtype == torch.float8_e4m3fn and not _fp8e4_in_hardware(q.device):
            fp8 = 2  # the kernel decodes the bytes itself
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_seq_len)
    group = num_heads // num_kv_heads
    # each split covers a whole number of tiles of any config
    split_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), _MAX_BLOCK_N) * _MAX_BLOCK_N
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
        block_size,
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
        PAGE_ALIGN=min(block_size & -block_size, _MAX_BLOCK_N),
        FP8=fp8,
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
    cache: torch.Tensor,
    table_row: torch.Tensor,
    seq_len: int,
    scale: torch.Tensor | None,
    first: int = 0,
) -> torch.Tensor:
    """Tokens ``first .. seq_len - 1`` of one request as ``[seq_len - first, H, D]`` float32."""
    block_size = cache.shape[1]
    pos = torch.arange(first, seq_len, device=cache.device)
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
    """Plain torch: gather each request's visible K/V through its block table (keys below a
    sliding window are not read: their blocks may be freed), softmax in float32."""
    from einops import repeat

    out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[3], dtype=q.dtype, device=q.device)
    group = q.shape[1] // k_cache.shape[2]
    for b, n in enumerate(seq_lens.tolist()):
        first = max(0, n - sliding_window) if sliding_window else 0
        k = gather_kv_ref(k_cache, block_tables[b], n, k_scale, first)
        v = gather_kv_ref(v_cache, block_tables[b], n, v_scale, first)
        k = repeat(k, "n h d -> n (h g) d", g=group)
        v = repeat(v, "n h d -> n (h g) d", g=group)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
