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
the output.

- Heads: the heads of a request share a program (``BLOCK_H`` = their count rounded up to a
  power of two, at least 16 for ``tl.dot``), so each latent byte is read once per request, up
  to a limit set by registers: the float32 accumulator ``[BLOCK_H, 512]`` is 128 registers a
  thread at 64 heads and 8 warps (16 warps cap a thread at 128 registers and spill; 128 heads
  would need the whole register file). Measured with ptxas (``heads_per_program``,
  ``_config_fits``): 64 heads fit only on sm_90 with 16-bit caches, where wgmma reads q and the
  latent tile from shared memory; mma.sync (sm_80, and sm_90 below 64 rows) needs each warp to
  hold its rows of q as a 512-deep operand and spills at 64 heads; fp8 tiles are converted in
  registers and spill at 64 heads on sm_90 too. So 32 heads a program on sm_80 and for fp8, 64
  on sm_90: Kimi-Linear (32 heads at TP1) reads its cache once per request everywhere;
  DeepSeek's 128 heads take 2 (H100) or 4 programs per tile, adjacent in the launch order (the
  head group varies fastest), so they run together and all but the first read the tile from L2,
  not HBM (FlashMLA splits the same way: 64 heads per CTA).
- Page walk: a tile of ``BLOCK_N`` tokens is ``BLOCK_N // SEG`` segments of ``SEG`` tokens, where
  ``SEG`` is a power of two dividing ``block_size`` (so a segment never straddles a page). The
  block table is read once per segment as one small vector, not once per token, and there is no
  runtime division by ``block_size`` per token: only one per segment. Row offsets inside a
  segment are loop invariants; the int64 page base is added once per segment.
- Load/compute overlap: the block ids of the next tile are loaded one iteration ahead (a
  loop-carried value), so the latent loads of a tile depend on no load of the same iteration and
  Triton's software pipeliner multi-buffers 16-bit tiles in shared memory (cp.async into
  ``num_stages - 1`` buffers with mma.sync, ``num_stages`` with wgmma). fp8 tiles feed the two
  dots in different layouts (one transposed; ldmatrix cannot transpose 8-bit data), which the
  pipeliner does not stage through shared memory, so they are prefetched by hand in registers,
  one tile ahead (a few registers a thread at 1 byte per value).
- Split-K (flash-decoding): partial (max, sum, acc) per split, merged by a second kernel; one
  split writes the output directly.
- fp8 caches: the latent is multiplied in fp16/bf16 as stored (the per-tensor scale is folded
  into the scores and applied to the accumulator once at the end). GPUs without hardware e4m3
  (sm_80, A100) get the cache's bytes and decode them in the kernel.

Contract (checked only with ``validate=True`` or ``HYBRIDKV_VALIDATE=1``, because checking device
data costs a host sync): ``1 <= seq_lens[b] <= max_seq_len`` (when given); every block id a
request uses (columns ``< cdiv(seq_lens[b], block_size)``) is in ``[0, num_blocks)``; columns
past that are never read and may hold anything (-1 included). Shapes, dtypes, strides and
``num_splits >= 1`` are always checked on the host. Outside the contract the kernel reads other
memory (the next layer's page for a block id equal to ``num_blocks``, bytes before the cache for
-1) or drops tokens (``max_seq_len`` too small).

Hopper: at 64 heads the scores ``[64, BLOCK_N]`` and the output update ``[64, 512]`` are what
wgmma takes (64 rows a warpgroup), and Triton emits wgmma on sm_90 with q and the latent tile
read from shared memory; the 8 warps split the 512-wide accumulator over two warpgroups that
share the tile, as FlashMLA does. Not done: TMA for the latent tiles (each segment is a 2-D box
``[SEG, latent]`` at a page-computed address: one descriptor over the cache view would take the
address math and the per-thread copies off the SMs, but device-side descriptors need a global
scratch allocator, and cp.async already keeps tiles in flight for a bandwidth-bound decode);
fp8 wgmma on the stored bytes (would let fp8 caches keep 64 heads a program and skip the
conversion, but needs q in fp8 too, which costs accuracy); a warp-specialised producer (TMA)
and consumers (wgmma) with 64-token tiles, which Triton's ``warp_specialize`` may reach.

Standalone: imports only torch and triton, so the file can be copied into another project.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _autotune(configs: list[triton.Config], key: list[str], prune=None, **kwargs):
    """``triton.autotune`` on a GPU; under the interpreter, pin one config (the first kept by
    ``prune``, or the one ``HYBRIDKV_INTERPRET_CONFIG`` numbers, so tests can check each),
    because the autotuner needs a GPU driver to benchmark."""
    if os.environ.get("TRITON_INTERPRET") == "1":

        def pick(args: dict | None) -> triton.Config:
            # read per launch, so a test can switch configs without reloading the module
            index = int(os.environ.get("HYBRIDKV_INTERPRET_CONFIG", "0"))
            kept = prune(configs, args) if prune and args is not None else configs
            return kept[index % len(kept)]

        names = configs[0].kwargs
        return triton.heuristics({k: (lambda args, k=k: pick(args).kwargs[k]) for k in names})
    if prune is not None:
        kwargs["prune_configs_by"] = {"early_config_prune": prune}
    return triton.autotune(configs, key=key, **kwargs)


# Reads only the cache and writes fresh partial buffers (or the output), so tuning in place is
# safe. 16-bit tiles: num_stages - 1 in flight (num_stages with wgmma); fp8 tiles: one, by hand.
# _config_fits drops what does not fit a launch; the first config fits every launch.
_CONFIGS = [
    triton.Config({"BLOCK_N": 16}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_N": 16}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_N": 32}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=3),
]
#: the split length is a multiple of this, so every config's tiles fit whole in a split
_MAX_BLOCK_N = 64
#: programs a GPU needs to be busy (a few waves over ~132 SMs); decides split-K
_TARGET_PROGRAMS = 256
#: fewest tokens a split is worth
_MIN_SPLIT_TOKENS = 256
#: shared memory per block: sm_80 (A100) 163 KiB, sm_90 (H100) 227 KiB
_SHARED_BYTES = {8: 166912, 9: 232448}


def _capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability; the interpreter counts as the smallest supported one
    (sm_80), so the CPU tests run the configs an A100 would. The compile check monkeypatches
    this."""
    if device.type != "cuda":
        return (8, 0)
    return torch.cuda.get_device_capability(device)


def _fp8e4_in_hardware(device: torch.device) -> bool:
    """sm_89+ (Ada, Hopper) convert e4m3 in hardware; older GPUs get the raw bytes and a
    software conversion in the kernel. Tests and the compile check monkeypatch this."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def heads_per_program(
    num_heads: int, capability: tuple[int, int], fp8: bool = False, page_align: int = 64
) -> int:
    """``BLOCK_H``: the heads of a request rounded up to a power of two (at least 16, the
    smallest ``tl.dot``), capped at what compiles without spills (see ``_config_fits``): 64
    on sm_90 for 16-bit caches whose block size is a multiple of 16, else 32 (blocks of other
    sizes walk segments shorter than a tile, whose addresses spill next to 64 heads)."""
    limit = 64 if capability >= (9, 0) and not fp8 and page_align >= 16 else 32
    return min(max(16, triton.next_power_of_2(num_heads)), limit)


def _config_fits(
    config: triton.Config,
    *,
    block_h: int,
    block_dc: int,
    block_dr: int,
    q_bytes: int,
    cache_bytes: int,
    fp8: bool,
    capability: tuple[int, int],
) -> bool:
    """Whether ``config`` compiles within the GPU's shared memory and without spills (the
    model below matches ptxas for the latent 512 + 64; the compile check tests it).

    Registers: up to 32 heads, every config fits (mma.sync, <= 255 registers). 64 heads hold a
    [64, 512] float32 accumulator, 128 registers a thread at 8 warps: it fits only with wgmma
    (sm_90, which reads q and the latent tile from shared memory, where mma.sync on sm_80 needs
    every warp to hold all 64 rows of q as an operand) and 16-token tiles; 16 warps cap a thread
    at 128 registers and spill. fp8 tiles are prefetched in registers and converted there:
    64 heads spill on sm_90 too (16-32 bytes). With mma.sync, 64-token tiles at 32 heads spill
    (sm_90: 24 bytes of stack; fp8 on sm_80 too), so heads x tile <= 32 x 32. Shared
    memory: q, the latent tiles in flight (wgmma keeps ``num_stages`` of them, mma.sync
    ``num_stages - 1``) or for fp8 the converted tile, and the probabilities staged for the
    second dot."""
    block_n, stages, warps = config.kwargs["BLOCK_N"], config.num_stages, config.num_warps
    wgmma = capability >= (9, 0) and block_h >= 64
    if block_h > 32 and not (wgmma and not fp8 and warps == 8 and block_n == 16):
        return False
    if not wgmma and block_h * block_n > 32 * 32:  # scores, operands and tile spill
        return False
    width = block_dc + block_dr
    if fp8:  # prefetched in registers, converted, staged once for the dots
        shared = block_h * width * q_bytes + block_n * width * q_bytes
    else:
        buffers = stages if wgmma else stages - 1
        shared = block_h * width * q_bytes + buffers * block_n * width * cache_bytes
        shared += block_h * block_n * q_bytes
    return shared <= _SHARED_BYTES.get(capability[0], _SHARED_BYTES[8])


def _prune(configs: list[triton.Config], nargs: dict, **kwargs) -> list[triton.Config]:
    """Drop configs that do not fit this GPU (shared memory) or would spill."""
    args = {**nargs, **kwargs}
    capability = _capability(args["q_nope_ptr"].device)
    fits = dict(
        block_h=args["BLOCK_H"],
        block_dc=args["BLOCK_DC"],
        block_dr=args["BLOCK_DR"],
        q_bytes=args["q_nope_ptr"].element_size(),
        cache_bytes=args["cache_ptr"].element_size(),
        fp8=args["FP8"] > 0,
        capability=capability,
    )
    kept = [c for c in configs if _config_fits(c, **fits)]
    if not kept:
        raise ValueError(f"no MLA decode config fits sm_{capability[0]}{capability[1]}: {fits}")
    return kept


@_autotune(_CONFIGS, key=["DIM_C", "DIM_R", "BLOCK_H", "PAGE_ALIGN", "FP8"], prune=_prune)
@triton.jit
def _mla_partial_kernel(
    q_nope_ptr,  # [B, H, Dc]
    q_pe_ptr,  # [B, H, Dr]
    cache_ptr,  # [num_blocks, block_size, Dc + Dr], strided (uint8 bytes when FP8 == 2)
    table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    scale_ptr,  # [1] float32 (read only when FP8)
    part_m_ptr,  # [B, H, S] float32 (unused when ONE_SPLIT)
    part_l_ptr,  # [B, H, S] float32 (unused when ONE_SPLIT)
    part_acc_ptr,  # [B, H, S, Dc] float32 (unused when ONE_SPLIT)
    out_ptr,  # [B, H, Dc] (written only when ONE_SPLIT)
    sm_scale,
    block_size,
    split_len,  # tokens per split, a multiple of every BLOCK_N
    num_heads,
    num_head_blocks,  # cdiv(num_heads, BLOCK_H)
    num_splits,
    stride_qn_b,
    stride_qn_h,
    stride_qp_b,
    stride_qp_h,
    stride_table_b,
    stride_c_block,
    stride_c_token,
    stride_out_b,
    stride_out_h,
    DIM_C: tl.constexpr,
    DIM_R: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program, a power of two >= 16
    PAGE_ALIGN: tl.constexpr,  # largest power of two dividing block_size (capped)
    FP8: tl.constexpr,  # 0: no fp8; 1: fp8 cache converted in hardware; 2: e4m3 bytes
    ONE_SPLIT: tl.constexpr,  # num_splits == 1: normalise and write out directly
    BLOCK_N: tl.constexpr,
):
    # a tile = PAGES segments of SEG tokens; a segment lies inside one page
    SEG: tl.constexpr = min(BLOCK_N, PAGE_ALIGN)
    PAGES: tl.constexpr = BLOCK_N // SEG
    # the head group varies fastest, so the programs reading one request's tiles run together
    pid = tl.program_id(0)
    i_hb = pid % num_head_blocks
    i_s = (pid // num_head_blocks) % num_splits
    i_b = pid // (num_head_blocks * num_splits)
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

    # scores in log2 units (exp2 is one instruction); an fp8 scale multiplies the scores and,
    # once at the end, the accumulator instead of every latent element
    qk_scale = sm_scale * 1.4426950408889634
    c_scale = 1.0
    if FP8 > 0:
        c_scale = tl.load(scale_ptr)
        if FP8 == 2:
            c_scale = c_scale * 256.0  # _e4m3_to_f16_div256 leaves out 2**(15 - 7)
        qk_scale = qk_scale * c_scale
    b_m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_H], tl.float32)
    b_acc = tl.zeros([BLOCK_H, BLOCK_DC], tl.float32)

    # loop invariants: each row's offset inside its segment (int32: < SEG * stride_c_token,
    # checked on the host)
    offs_in_seg = (tl.arange(0, BLOCK_N) % SEG) * stride_c_token
    offs_c_row = offs_in_seg[:, None] + offs_dc[None, :]
    offs_pe_row = offs_in_seg[:, None] + (DIM_C + offs_dr)[None, :]
    p_table = table_ptr + i_b64 * stride_table_b
    offs_pages = tl.arange(0, PAGES) * SEG

    # block ids of the first tile; each iteration loads the next tile's ids ahead, so no
    # latent load waits on a table load of its own iteration
    seg_block = _tile_ids(p_table, start, end, block_size, offs_pages, PAGES)
    if FP8 > 0:
        # fp8 tiles feed the two dots through different register layouts (ldmatrix cannot
        # transpose 8-bit data), so the pipeliner leaves them in registers: prefetch by hand,
        # one tile ahead (BLOCK_N x latent bytes, a few registers a thread)
        c_next, pe_next = _load_tile(
            cache_ptr, seg_block, start, end, block_size, stride_c_block, stride_c_token,
            offs_pages, offs_c_row, offs_pe_row, m_dc, m_dr,
            DIM_C, DIM_R, BLOCK_DC, BLOCK_DR, BLOCK_N, PAGES, SEG,
        )  # fmt: skip
        seg_block = _tile_ids(p_table, start + BLOCK_N, end, block_size, offs_pages, PAGES)
    for tile in range(start, end, BLOCK_N):
        if FP8 > 0:
            c, k_pe = c_next, pe_next
            c_next, pe_next = _load_tile(
                cache_ptr, seg_block, tile + BLOCK_N, end, block_size, stride_c_block,
                stride_c_token, offs_pages, offs_c_row, offs_pe_row, m_dc, m_dr,
                DIM_C, DIM_R, BLOCK_DC, BLOCK_DR, BLOCK_N, PAGES, SEG,
            )  # fmt: skip
            next_ids = tile + 2 * BLOCK_N
        else:
            c, k_pe = _load_tile(
                cache_ptr, seg_block, tile, end, block_size, stride_c_block, stride_c_token,
                offs_pages, offs_c_row, offs_pe_row, m_dc, m_dr,
                DIM_C, DIM_R, BLOCK_DC, BLOCK_DR, BLOCK_N, PAGES, SEG,
            )  # fmt: skip
            next_ids = tile + BLOCK_N
        seg_block = _tile_ids(p_table, next_ids, end, block_size, offs_pages, PAGES)
        m_n = tile + tl.arange(0, BLOCK_N) < end
        # each dot converts its own view of the tile (a 16-bit tile is read from one
        # shared-memory buffer by both)
        c_t = _to_dot_dtype(tl.trans(c), q_nope.dtype, FP8)
        s = tl.dot(q_pe, _to_dot_dtype(tl.trans(k_pe), q_nope.dtype, FP8))
        s = tl.dot(q_nope, c_t, s)  # [BLOCK_H, BLOCK_N]
        s = tl.where(m_n[None, :], s * qk_scale, float("-inf"))
        # every tile holds a token below end, so m_new is finite from the first tile on
        m_new = tl.maximum(b_m, tl.max(s, axis=1))
        alpha = tl.exp2(b_m - m_new)
        p = tl.exp2(s - m_new[:, None])
        b_l = b_l * alpha + tl.sum(p, axis=1)
        c = _to_dot_dtype(c, q_nope.dtype, FP8)
        b_acc = tl.dot(p.to(q_nope.dtype), c, b_acc * alpha[:, None])
        b_m = m_new

    if ONE_SPLIT:
        out = b_acc * (c_scale / b_l)[:, None]
        tl.store(
            out_ptr + i_b64 * stride_out_b + offs_h[:, None] * stride_out_h + offs_dc[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=m_h[:, None] & m_dc[None, :],
        )
    else:
        base = (i_b64 * num_heads + offs_h) * num_splits + i_s
        tl.store(part_m_ptr + base, b_m, mask=m_h)
        tl.store(part_l_ptr + base, b_l, mask=m_h)
        tl.store(
            part_acc_ptr + base[:, None] * DIM_C + offs_dc[None, :],
            b_acc * c_scale,
            mask=m_h[:, None] & m_dc[None, :],
        )


@triton.jit
def _tile_ids(p_table, tile, end, block_size, offs_pages, PAGES: tl.constexpr):
    """Block ids of the tile starting at token ``tile`` (0 past ``end``): a scalar when the
    tile lies in one page (keeps the base's divisibility visible, so the loads vectorise),
    else one per segment."""
    if PAGES == 1:
        return tl.load(p_table + tile // block_size, mask=tile < end, other=0)
    else:
        seg_pos = tile + offs_pages
        return tl.load(p_table + seg_pos // block_size, mask=seg_pos < end, other=0)


@triton.jit
def _load_tile(
    cache_ptr,
    seg_block,  # block ids from _tile_ids
    tile,  # first token of the tile, a multiple of BLOCK_N
    end,
    block_size,
    stride_c_block,
    stride_c_token,
    offs_pages,  # [PAGES] first token of each segment, relative to the tile
    offs_c_row,  # [BLOCK_N, BLOCK_DC] offsets inside a segment
    offs_pe_row,  # [BLOCK_N, BLOCK_DR]
    m_dc,
    m_dr,
    DIM_C: tl.constexpr,
    DIM_R: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGES: tl.constexpr,
    SEG: tl.constexpr,
):
    """The ``c_kv`` and ``k_pe`` rows of tokens ``tile .. tile + BLOCK_N - 1`` as stored; rows
    at or past ``end`` are zero (they may hold NaN, and 0 * NaN would reach the sums)."""
    if PAGES == 1:
        base = (
            seg_block.to(tl.int64) * stride_c_block
            + (tile % block_size).to(tl.int64) * stride_c_token
        )
        p_c = cache_ptr + base + offs_c_row
        p_pe = cache_ptr + base + offs_pe_row
    else:
        seg_base = (
            seg_block.to(tl.int64) * stride_c_block
            + ((tile + offs_pages) % block_size).to(tl.int64) * stride_c_token
        )
        rows = tl.reshape(tl.broadcast_to(seg_base[:, None], (PAGES, SEG)), (BLOCK_N,))
        p_rows = cache_ptr + rows[:, None]
        p_c = p_rows + offs_c_row
        p_pe = p_rows + offs_pe_row
    m_n = tile + tl.arange(0, BLOCK_N) < end
    if BLOCK_DC == DIM_C:
        c = tl.load(p_c, mask=m_n[:, None], other=0.0)
    else:
        c = tl.load(p_c, mask=m_n[:, None] & m_dc[None, :], other=0.0)
    if BLOCK_DR == DIM_R:
        k_pe = tl.load(p_pe, mask=m_n[:, None], other=0.0)
    else:
        k_pe = tl.load(p_pe, mask=m_n[:, None] & m_dr[None, :], other=0.0)
    return c, k_pe


@triton.jit
def _to_dot_dtype(x, dtype: tl.constexpr, FP8: tl.constexpr):
    """A latent tile as stored -> the query's dtype (fp8 values unscaled)."""
    if FP8 == 2:
        return _e4m3_to_f16_div256(x).to(dtype)
    return x.to(dtype)


@triton.jit
def _e4m3_to_f16_div256(x):
    """e4m3fn bytes (uint8) to float16 / 256, exactly: the fields are placed in an fp16 (same
    mantissa, exponent field widened); the rebias 2**(15 - 7) is left to the caller's scale.
    Subnormals map to fp16 subnormals, so they are exact too. 0x7F / 0xFF are NaN."""
    x16 = x.to(tl.uint16)
    bits = ((x16 & 0x7F) << 7) | ((x16 & 0x80) << 8)
    y = bits.to(tl.float16, bitcast=True)
    return tl.where((x16 & 0x7F) == 0x7F, float("nan"), y)


@triton.jit
def _mla_reduce_kernel(
    part_m_ptr,  # [B, H, S] float32, log2 units
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
    w = tl.where(l > 0, tl.exp2(m - m_max), 0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(
        out_ptr + i_b.to(tl.int64) * stride_out_b + i_h * stride_out_h + offs_dc,
        out.to(out_ptr.dtype.element_ty),
        mask=m_dc,
    )


_FP8 = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)


def _validate_enabled(validate: bool | None) -> bool:
    if validate is None:
        return os.environ.get("HYBRIDKV_VALIDATE", "") not in ("", "0")
    return validate


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


def check_block_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """Every block id a request reads (columns below ``cdiv(seq_len, block_size)``) lies in
    ``[0, num_blocks)``. Syncs with the device."""
    lens = seq_lens.detach().cpu().long()
    tables = block_tables.detach().cpu().long()
    used = (lens + block_size - 1) // block_size
    live = torch.arange(tables.shape[1])[None, :] < used[:, None]
    bad = live & ((tables < 0) | (tables >= num_blocks))
    if bad.any():
        b, c = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"block_tables[{b}, {c}] = {int(tables[b, c])} is outside [0, {num_blocks}): request "
            f"{b} reads that column for its seq_len {int(lens[b])} (block_size {block_size}); "
            f"an id of num_blocks or more reads another layer's memory, -1 reads before the "
            f"cache. Give every used column a block id of this cache (0 is the null block)"
        )


def choose_num_splits(batch: int, num_head_blocks: int, max_seq_len: int) -> int:
    """Split the context when batch * head groups alone cannot fill the GPU."""
    by_parallelism = triton.cdiv(_TARGET_PROGRAMS, max(1, batch * num_head_blocks))
    by_length = max(1, max_seq_len // _MIN_SPLIT_TOKENS)
    return max(1, min(by_parallelism, by_length, 64))


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
    validate: bool | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode, one query token per request.

    Shapes: ``q_nope [B, H, Dc]`` (already multiplied by ``W_UK``), ``q_pe [B, H, Dr]``,
    ``latent_cache [num_blocks, block_size, (1,) Dc + Dr]`` (any block and token strides),
    ``block_tables [B, max_blocks] int32``, ``seq_lens [B] int32`` (>= 1). Returns
    ``[B, H, Dc]`` (in ``out`` if given) in ``q_nope``'s dtype: the attention-weighted latent,
    before ``W_UV``. With ``max_seq_len`` (>= every seq_len) the call never syncs with the
    device; without it, it reads ``seq_lens`` back once. ``validate`` (default: the
    ``HYBRIDKV_VALIDATE`` environment switch) checks every block id and length the kernel will
    use (see the module's contract).
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
    if q_nope.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q_nope must be fp16/bf16/fp32, got {q_nope.dtype}")
    if q_pe.dtype != q_nope.dtype:
        raise ValueError(f"q_pe is {q_pe.dtype} but q_nope is {q_nope.dtype}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError("block_tables must be an int32 [B, max_blocks] tensor")
    if block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError("block_tables and seq_lens must have one row per request")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be int32/int64, got {seq_lens.dtype}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 (or None to choose), got {num_splits}")
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    quant = cache.dtype in _FP8
    if quant and k_scale is None:
        raise ValueError("an fp8 latent cache needs k_scale (a float32 scalar)")
    num_blocks, block_size = cache.shape[:2]
    page_align = min(block_size & -block_size, _MAX_BLOCK_N)
    if cache.stride(1) * page_align + dc + dr >= 2**31:
        raise ValueError(f"the cache's token stride {cache.stride(1)} is too large (>= 2**25)")
    if out is None:
        out = torch.empty((batch, num_heads, dc), dtype=q_nope.dtype, device=q_nope.device)
    elif out.shape != (batch, num_heads, dc) or out.stride(2) != 1:
        raise ValueError(f"out must be [B, H, Dc] = {(batch, num_heads, dc)}, contiguous in Dc")
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
    fp8 = 0
    if quant:
        fp8 = 1
        if cache.dtype == torch.float8_e4m3fn and not _fp8e4_in_hardware(q_nope.device):
            fp8 = 2  # the kernel decodes the bytes itself
            cache = cache.view(torch.uint8)
    block_h = heads_per_program(num_heads, _capability(q_nope.device), quant, page_align)
    num_head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_head_blocks, max_seq_len)
    # each split covers whole tiles of any config
    split_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), _MAX_BLOCK_N) * _MAX_BLOCK_N
    num_splits = triton.cdiv(max_seq_len, split_len)
    dev = q_nope.device
    # one split normalises and writes the output itself, saving the partials' round trip, but
    # that epilogue spills next to 64 heads' accumulator (wgmma): those keep the reduce kernel
    one_split = num_splits == 1 and block_h <= 32
    if one_split:
        part_m = part_l = part_acc = out  # not touched
    else:
        part_m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=dev)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((batch, num_heads, num_splits, dc), dtype=torch.float32, device=dev)
    scale_t = k_scale.reshape(1).float() if quant else seq_lens
    block_dc = max(16, triton.next_power_of_2(dc))
    _mla_partial_kernel[(batch * num_splits * num_head_blocks,)](
        q_nope,
        q_pe,
        cache,
        block_tables,
        seq_lens,
        scale_t,
        part_m,
        part_l,
        part_acc,
        out,
        scale,
        block_size,
        split_len,
        num_heads,
        num_head_blocks,
        num_splits,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        block_tables.stride(0),
        cache.stride(0),
        cache.stride(1),
        out.stride(0),
        out.stride(1),
        DIM_C=dc,
        DIM_R=dr,
        BLOCK_DC=block_dc,
        BLOCK_DR=max(16, triton.next_power_of_2(dr)),
        BLOCK_H=block_h,
        PAGE_ALIGN=page_align,
        FP8=fp8,
        ONE_SPLIT=one_split,
    )
    if not one_split:
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
            BLOCK_DC=block_dc,
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
