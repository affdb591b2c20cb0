"""Paged prefill / extend attention over caches of any layout.

Many query tokens per request attend, causally, to the request's cached prefix plus the new
tokens, all read from the paged caches (the new K/V are written first by the cache-write kernel,
as vLLM's unified Triton attention does). Batches are varlen: request ``r`` has
``q_len = cu_seqlens_q[r+1] - cu_seqlens_q[r]`` query tokens at absolute positions
``seq_lens[r] - q_len .. seq_lens[r] - 1``.

The caches are typed strided views ``[num_blocks, block_size, num_kv_heads, head_dim]``: any
block, token and head strides (K-then-V pages, packed pages, head-major pages, layer-outer
tensors); only the last dim is contiguous. Addressing is int64.

- GQA packing: one program takes ``BLOCK_Q`` query tokens times all ``GROUP`` query heads of one
  KV head as the ``BLOCK_M`` rows of its tile, so each K/V tile is read once per KV head and
  query tile, not once per query head.
- Page walk and load/compute overlap as in ``paged_decode.py``: tiles of ``BLOCK_N`` keys are
  segments that never straddle a page, one block-table load per segment, the next tile's block
  ids loaded one iteration ahead so the pipeliner multi-buffers K/V.
- Sliding window: keys below the first key visible to a tile are never loaded (their blocks may
  be freed to a null block holding NaN), not just masked after the dot.
- No host sync: programs find their request by a binary search over ``cu_seqlens_q`` (request
  ``r``'s tiles are numbered from ``cu_seqlens_q[r] // BLOCK_Q + r``), so the grid
  ``total_q // BLOCK_Q + B`` needs only host-known sizes; surplus programs exit at once.
- fp8 caches are dequantised with per-tensor float32 scales; GPUs without hardware e4m3 (sm_80)
  get the bytes and convert them in the kernel.

Contract (checked only with ``validate=True`` or ``HYBRIDKV_VALIDATE=1``, which syncs):
``cu_seqlens_q`` rises from 0 to ``total_q``; ``1 <= seq_lens[r]``, ``q_len <= seq_lens[r]``;
every block id in the columns below ``cdiv(seq_lens[r], block_size)`` is in
``[0, num_blocks)``. Shapes, dtypes and strides are always checked on the host.

Hopper: the ``[BLOCK_M, head_dim] x [head_dim, BLOCK_N]`` products have 64-128 rows, which is
what wgmma wants; Triton emits it on sm_90 for these tiles when the operands sit in shared
memory (the K/V tiles do; the packed Q tile is loaded once). TMA would pay off for the K/V
segments (2-D boxes at a page address) by taking the per-thread address math and cp.async
issue out of the loop; it needs device-side tensor descriptors, which are not used here yet.

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


# BLOCK_M rows = BLOCK_Q query tokens x GROUP_PAD query heads. The kernel writes a fresh output,
# so tuning in place is safe.
_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=8, num_stages=3),  # head dim 256
    # fp8 at head dim 256 on GPUs without hardware fp8 (sm_80): with 64 rows ptxas falls back
    # to 32 registers and a 1.9 KB stack once the byte tiles are pipelined; 32 rows do not
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=8, num_stages=3),
]


#: pre-Hopper GPUs (mma.sync, sm_80/86): the (BLOCK_M, BLOCK_N, num_warps) that compile without
#: spills, by (fp8 cache, padded head dim), measured over the full matrix of
#: ``python -m paper.compile_kernels`` (ptxas spills a few of the configs the general rules
#: below admit, e.g. 64 x 32 tiles at 8 warps and head dim 128, and most with fp8 caches, which
#: these GPUs convert in registers).
_PRE_HOPPER = {
    (False, 64): {(64, 32, 4), (128, 32, 8), (128, 64, 8), (64, 32, 8)},
    (False, 128): {(64, 32, 4), (128, 32, 8)},
    (False, 256): {(64, 32, 8)},
    (True, 64): {(64, 32, 4), (64, 64, 4), (128, 32, 8), (128, 64, 8), (64, 32, 8)},
    (True, 128): {(64, 32, 8)},
    (True, 256): {(32, 32, 8)},
}


def _prune(configs: list[triton.Config], nargs: dict, **kwargs) -> list[triton.Config]:
    """Keep what compiles without spills on sm_80 and sm_90 (paper/compile_kernels.py): at most
    64 float32 accumulator values per thread (``BLOCK_M x head_dim`` over the threads; 64 rows x
    256 dims need 8 warps), at most 32 K-tile values per thread, and K/V tiles of at most
    64 x 128 elements so that ``num_stages - 1`` of each fit an A100's shared memory; on
    pre-Hopper GPUs only the measured spill-free configs of ``_PRE_HOPPER``. 32-row tiles (which
    read K/V twice as often) only where no 64-row tile compiles well."""
    args = {**nargs, **kwargs}
    width = max(args["BLOCK_DK"], args["BLOCK_DV"])
    if _capability(args["q_ptr"].device) < (9, 0):
        key = (args["FP8"] > 0, min((w for w in (64, 128, 256) if w >= width), default=256))
        allowed = _PRE_HOPPER[key]
        kept = [
            c
            for c in configs
            if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) in allowed
        ]
    else:
        kept = [
            c
            for c in configs
            if c.kwargs["BLOCK_M"] * width <= 64 * 32 * c.num_warps
            and c.kwargs["BLOCK_N"] * width <= min(64 * 128, 32 * 32 * c.num_warps)
        ]
    wide = [c for c in kept if c.kwargs["BLOCK_M"] > 32]
    return wide or kept or configs[-1:]


def tokens_per_tile(block_m: int, group: int) -> int:
    """Query tokens per program: ``BLOCK_M`` rows over the padded GQA group."""
    return max(1, block_m // triton.next_power_of_2(group))


@_autotune(
    _CONFIGS,
    key=["HEAD_DIM_K", "HEAD_DIM_V", "GROUP", "PAGE_ALIGN", "FP8"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _prefill_kernel(
    q_ptr,  # [total_q, Hq, Dk]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, Dk], strided (uint8 bytes when FP8 == 2)
    v_cache_ptr,  # [num_blocks, block_size, Hkv, Dv], strided
    table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32, total KV length incl. the new tokens
    cu_q_ptr,  # [B + 1] int32
    k_scale_ptr,  # [1] float32 (read only when FP8)
    v_scale_ptr,  # [1] float32
    out_ptr,  # [total_q, Hq, Dv]
    sm_scale,
    batch,
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
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    HEAD_DIM_K: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGE_ALIGN: tl.constexpr,  # largest power of two dividing block_size (capped)
    FP8: tl.constexpr,  # 0: no fp8; 1: fp8 cache converted in hardware; 2: e4m3 bytes
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = max(1, BLOCK_M // GROUP_PAD)
    ROWS: tl.constexpr = BLOCK_Q * GROUP_PAD
    SEG: tl.constexpr = min(BLOCK_N, PAGE_ALIGN)
    PAGES: tl.constexpr = BLOCK_N // SEG
    i_tile = tl.program_id(0)
    i_kvh = tl.program_id(1)
    req = _tile_request(cu_q_ptr, i_tile, batch, BLOCK_Q)
    q_begin = tl.load(cu_q_ptr + req)
    q_len = tl.load(cu_q_ptr + req + 1) - q_begin
    q_first = (i_tile - (q_begin // BLOCK_Q + req)) * BLOCK_Q
    if q_first >= q_len:  # a surplus program of the sync-free grid
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len  # tokens cached before the first query token

    # row r of the tile: query token q_first + r // GROUP_PAD, head i_kvh * GROUP + r % GROUP_PAD
    offs_r = tl.arange(0, ROWS)
    tok = q_first + offs_r // GROUP_PAD
    offs_g = offs_r % GROUP_PAD
    m_r = (tok < q_len) & (offs_g < GROUP)
    pos_r = ctx + tok  # absolute positions of the query rows
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_dk = offs_dk < HEAD_DIM_K
    m_dv = offs_dv < HEAD_DIM_V
    rows_t = (q_begin + tok).to(tl.int64)
    rows_h = i_kvh * GROUP + offs_g
    q = tl.load(
        q_ptr + (rows_t * stride_q_t + rows_h * stride_q_h)[:, None] + offs_dk[None, :],
        mask=m_r[:, None] & m_dk[None, :],
        other=0.0,
    )

    # finite initial max: fully masked rows (padding, or no key yet) stay finite
    b_m = tl.full([ROWS], -1e30, tl.float32)
    b_l = tl.zeros([ROWS], tl.float32)
    b_acc = tl.zeros([ROWS, BLOCK_DV], tl.float32)
    if FP8 > 0:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    hi = tl.minimum(seq_len, ctx + q_first + BLOCK_Q)
    lo = 0
    if window > 0:  # the first key the tile's first query sees
        lo = tl.maximum(0, ctx + q_first - window + 1)
    tile_lo = lo // BLOCK_N * BLOCK_N  # BLOCK_N-aligned, so segments stay inside pages

    p_k_head = k_cache_ptr + i_kvh.to(tl.int64) * stride_kc_head
    p_v_head = v_cache_ptr + i_kvh.to(tl.int64) * stride_vc_head
    offs_seg = tl.arange(0, BLOCK_N) % SEG
    offs_k_row = offs_seg[:, None] * stride_kc_token + offs_dk[None, :]
    offs_v_row = offs_seg[:, None] * stride_vc_token + offs_dv[None, :]
    p_table = table_ptr + req.to(tl.int64) * stride_table_b
    offs_pages = tl.arange(0, PAGES) * SEG
    # block ids of the first tile; each iteration loads the next tile's ids ahead
    if PAGES == 1:
        seg_block = tl.load(p_table + tile_lo // block_size, mask=tile_lo < hi, other=0)
    else:
        seg_pos = tile_lo + offs_pages
        seg_block = tl.load(p_table + seg_pos // block_size, mask=seg_pos < hi, other=0)
    for tile in range(tile_lo, hi, BLOCK_N):
        if PAGES == 1:
            in_page = tile % block_size
            p_k = p_k_head + (seg_block.to(tl.int64) * stride_kc_block + in_page * stride_kc_token)
            p_v = p_v_head + (seg_block.to(tl.int64) * stride_vc_block + in_page * stride_vc_token)
            p_k = p_k + offs_k_row
            p_v = p_v + offs_v_row
            next_tile = tile + BLOCK_N
            seg_block = tl.load(p_table + next_tile // block_size, mask=next_tile < hi, other=0)
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
            seg_block = tl.load(p_table + next_pos // block_size, mask=next_pos < hi, other=0)
        offs_n = tile + tl.arange(0, BLOCK_N)
        m_n = (offs_n >= lo) & (offs_n < hi)
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
        s = tl.dot(q, tl.trans(k)) * sm_scale  # [ROWS, BLOCK_N]
        visible = m_n[None, :] & (offs_n[None, :] <= pos_r[:, None])
        if window > 0:
            visible = visible & (offs_n[None, :] > pos_r[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(s, axis=1))
        alpha = tl.exp(b_m - m_new)
        p = tl.exp(s - m_new[:, None])
        b_l = b_l * alpha + tl.sum(p, axis=1)
        b_acc = b_acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        b_m = m_new

    out = b_acc / b_l[:, None]
    tl.store(
        out_ptr + (rows_t * stride_out_t + rows_h * stride_out_h)[:, None] + offs_dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_r[:, None] & m_dv[None, :],
    )


@triton.jit
def _tile_request(cu_q_ptr, i_tile, batch, BLOCK_Q: tl.constexpr):
    """The request owning query tile ``i_tile``: the last ``r`` whose first tile number
    ``cu_q[r] // BLOCK_Q + r`` is ``<= i_tile`` (a binary search; first tile numbers rise
    strictly with ``r``)."""
    lo = 0
    hi = batch - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_q_ptr + mid) // BLOCK_Q + mid <= i_tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _e4m3_to_f32(x):
    """e4m3fn bytes (uint8) to float32, exactly: the fields are placed in an fp16 (same
    mantissa, exponent field widened) and rebiased by 2**(15 - 7); subnormals map to fp16
    subnormals, so they are exact too. 0x7F / 0xFF are NaN."""
    x16 = x.to(tl.uint16)
    bits = ((x16 & 0x7F) << 7) | ((x16 & 0x80) << 8)
    y = bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((x16 & 0x7F) == 0x7F, float("nan"), y)


_FP8 = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)
#: tiles of every config are at most this many keys; page segments are capped at it
_MAX_BLOCK_N = 64


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


def _check_lengths(
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    total_q: int,
    num_blocks: int,
    block_size: int,
) -> None:
    """The contract's device-data checks (one sync)."""
    cu = cu_seqlens_q.detach().cpu().long()
    lens = seq_lens.detach().cpu().long()
    q_lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != total_q or (q_lens < 0).any():
        raise ValueError(
            f"cu_seqlens_q must rise from 0 to total_q={total_q}, got {cu.tolist()[:8]}"
            f"{' ...' if len(cu) > 8 else ''}"
        )
    if (lens < 1).any():
        r = int((lens < 1).nonzero()[0])
        raise ValueError(f"seq_lens[{r}] = {int(lens[r])}: every request needs seq_len >= 1")
    if (q_lens > lens).any():
        r = int((q_lens > lens).nonzero()[0])
        raise ValueError(
            f"request {r} has more query tokens ({int(q_lens[r])}) than seq_lens "
            f"({int(lens[r])}, its KV length including the new tokens)"
        )
    used = (lens + block_size - 1) // block_size
    if len(used) and int(used.max()) > block_tables.shape[1]:
        raise ValueError(
            f"block_tables has {block_tables.shape[1]} columns, needs {int(used.max())}"
        )
    tables = block_tables.detach().cpu().long()
    live = torch.arange(tables.shape[1])[None, :] < used[:, None]
    bad = live & ((tables < 0) | (tables >= num_blocks))
    if bad.any():
        r, c = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"block_tables[{r}, {c}] = {int(tables[r, c])} is outside [0, {num_blocks}): request "
            f"{r} reads that column for its seq_len {int(lens[r])} (block_size {block_size}); "
            f"an id of num_blocks or more reads another layer's memory, -1 reads before the "
            f"cache. Give every used column a block id of this cache (0 is the null block)"
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
    validate: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [total_q, Hq, Dk]`` over each request's paged K/V.

    ``cu_seqlens_q [B+1] int32`` splits ``q`` into requests; ``seq_lens [B] int32`` is each
    request's KV length including its new tokens (already in the cache). Returns
    ``[total_q, Hq, Dv]`` in ``q``'s dtype. Never syncs with the device unless ``validate``
    (default: the ``HYBRIDKV_VALIDATE`` environment switch) asks for the contract's checks.
    ``out [total_q, Hq, Dv]`` (contiguous in Dv), if given, receives the result.
    """
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"q must be [total_q, Hq, D] with a contiguous last dim, got {q.shape}")
    total_q, num_heads, dk = q.shape
    if k_cache.dim() != 4 or v_cache.shape[:3] != k_cache.shape[:3] or k_cache.shape[3] != dk:
        raise ValueError("caches must be [num_blocks, block_size, Hkv, D] views matching q")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the caches' head_dim must be contiguous")
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    if num_heads % num_kv_heads:
        raise ValueError(f"Hq={num_heads} is not a multiple of Hkv={num_kv_heads}")
    batch = seq_lens.shape[0]
    if cu_seqlens_q.shape != (batch + 1,) or block_tables.shape[0] != batch:
        raise ValueError("cu_seqlens_q must be [B+1] and block_tables [B, max_blocks]")
    if cu_seqlens_q.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("cu_seqlens_q and seq_lens must be int32")
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be a row-contiguous int32 tensor")
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(f"sliding_window must be None, 0 (off) or positive: {sliding_window}")
    quant = k_cache.dtype in _FP8
    if quant and (k_scale is None or v_scale is None):
        raise ValueError("fp8 caches need k_scale and v_scale (float32 scalars)")
    if quant != (v_cache.dtype in _FP8):
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    if _validate_enabled(validate):
        _check_lengths(cu_seqlens_q, seq_lens, block_tables, total_q, num_blocks, block_size)
    dv = v_cache.shape[3]
    if out is None:
        out = torch.empty((total_q, num_heads, dv), dtype=q.dtype, device=q.device)
    elif out.shape != (total_q, num_heads, dv) or out.stride(2) != 1:
        raise ValueError(f"out must be [total_q, Hq, Dv] = {(total_q, num_heads, dv)}")
    if total_q == 0 or batch == 0:
        return out
    fp8 = 0
    if quant:
        fp8 = 1
        if k_cache.dtype == torch.float8_e4m3fn and not _fp8e4_in_hardware(q.device):
            fp8 = 2  # the kernel decodes the bytes itself
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    scales = (
        (k_scale.reshape(1).float(), v_scale.reshape(1).float()) if quant else (seq_lens, seq_lens)
    )
    group = num_heads // num_kv_heads
    # request r owns tiles cu[r] // BLOCK_Q + r ...: at most total_q // BLOCK_Q + B of them
    grid = lambda meta: (total_q // tokens_per_tile(meta["BLOCK_M"], group) + batch, num_kv_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scales[0],
        scales[1],
        out,
        scale,
        batch,
        block_size,
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
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        HEAD_DIM_K=dk,
        HEAD_DIM_V=dv,
        BLOCK_DK=max(16, triton.next_power_of_2(dk)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        PAGE_ALIGN=min(block_size & -block_size, _MAX_BLOCK_N),
        FP8=fp8,
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
    **_: object,
) -> torch.Tensor:
    """Plain torch: gather each request's K/V through its block table, causal softmax in fp32.
    Keys no query of the request can see (below a sliding window) are not read: an allocator
    may have freed their blocks."""
    from einops import repeat

    out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[3], dtype=q.dtype, device=q.device)
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    for r, n in enumerate(seq_lens.tolist()):
        a, b = int(cu_seqlens_q[r]), int(cu_seqlens_q[r + 1])
        first = max(0, n - (b - a) - sliding_window + 1) if sliding_window else 0
        pos = torch.arange(first, n)
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
