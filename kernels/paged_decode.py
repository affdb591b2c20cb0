"""Paged decode attention over caches of any layout (one query token per request).

The caches are typed strided views ``[num_blocks, block_size, num_kv_heads, head_dim]`` made by a
memory plan: K of token ``p`` of a request lives at
``k_cache + table[p // block_size] * stride_block + (p % block_size) * stride_token + head *
stride_head``. Nothing else is assumed, so the same kernel reads K-then-V pages, vLLM 0.33's
``[tokens, heads, K | V]`` pages, pages packing N layers, head-major pages and layer-outer
tensors.

Plan once per step, run once per layer (FlashInfer's split): :func:`plan_decode` takes the
step's block tables, lengths and shapes and makes every host decision (config, split count,
grid, partial buffers, the fp8 path); :meth:`DecodePlan.run` then launches with one layer's
``q`` and cache views and does no allocation (given ``out``), no environment read and no device
sync, so it can be captured in a CUDA graph; after a specialisation's first launch it calls
Triton's compiled launcher directly instead of re-binding ~30 arguments (``_Launcher``).
:func:`paged_decode_attention` is plan + run in one call.

- GQA: one program serves all query heads of a KV head, so each K/V byte is read once per KV
  head, not once per query head.
- Page walk: a tile of ``BLOCK_N`` tokens is ``BLOCK_N // SEG`` segments of ``SEG`` tokens, where
  ``SEG`` is a power of two dividing ``block_size`` (so a segment never straddles a page). A tile
  that is one segment (``BLOCK_N <= SEG``) is a 2-D box at one page address whose block id is
  loaded one iteration ahead (a loop-carried scalar), so its K/V loads depend on no load of the
  same iteration: the fast case, which the default configs choose wherever the page allows it.
  A tile of several pages loads one block id per row in its own iteration; Triton's software
  pipeliner schedules that table load stages ahead of the K/V loads it feeds (Triton 3.6, what
  the GPU machines run, leaves ids spread from a per-page vector unpipelined: checked with
  ``python -m paper.compile_kernels``). The head's int64 base is hoisted out of the loop.
- Load/compute overlap: K/V tiles are multi-buffered in shared memory by the pipeliner
  (``num_stages - 1`` tiles in flight, cp.async).
- Split-K (flash-decoding): the context is cut into ``num_splits`` chunks processed in parallel,
  each writing a partial (max, sum, acc); a second kernel merges them. One split writes the
  output directly (no second launch).
- Sliding window: the query at position ``p`` attends to keys in ``(p - window, p]``; keys below
  the window are never loaded (an allocator frees those blocks to a null block whose bytes may
  be anything, NaN included).
- fp8 caches: the tile is converted as stored and the per-tensor float32 scales are folded into
  the scores (``k_scale``) and into the output once (``v_scale``), so a cached element costs one
  conversion, no float32 multiply. With a bf16 query the dots run in fp16 (fp8 to fp16 is one
  instruction a pair, to bf16 four): the query is scaled by a power of two into fp16's range.
  GPUs without hardware e4m3 (sm_80, A100) get the cache's bytes and decode them in the kernel
  (exactly).
- Relative-position bias (``plan_decode(rel_dim=...)``, Inkling): a key ``d`` tokens behind
  the query gets ``rel_states[b, h] @ rel_proj[:, d]`` added to its scaled logit (float32) for
  ``d < rel_extent``. The one query's distances to a tile's keys are its columns of
  ``rel_proj``, so the bias is one small dot per tile, ``[GROUP, rel_dim] x [rel_dim,
  BLOCK_N]``, with those columns loaded by distance (zero past ``rel_extent``); nothing of size
  ``[tokens, heads, rel_extent]`` is built. A scalar bound splits the tile loop in two: tiles
  wholly ``rel_extent`` or more behind the query run the plain loop, so a long context pays
  for the bias over its last ``rel_extent`` keys only. Attention sinks combine with it.
- Sparse (token-list) decode (``plan_decode(token_indices=...)``, Qwen4-Exp's QSA: each query
  attends to the tokens of its indexer's top groups plus the open group's tail): the program
  walks the request's ``[K]`` index list instead of the positions ``0 .. seq_len - 1``
  (``SPARSE``, a constexpr: the dense walk compiles as before). Per tile of ``BLOCK_N``
  entries it loads the entries, maps each to its block id (the request's table row) and slot
  (int64 row offsets), gathers K and V rows, masks padding (-1) and runs the same online
  softmax, whose running max is guarded so that a tile or a split of padding alone weighs
  nothing. Splits cover the K entries; the reduce is the dense one. Every gathered row has
  its own address, so a sparse launch's shape class has ``page_align`` 1 (no ``_TABLE`` row:
  the first config of ``CONFIGS`` that fits, unmeasured). A prefill's query tokens run as
  decode rows over the same block table (the engine's QSA layers: :mod:`hybridkv.e2e.attn`),
  each row its own list, as sparse-attention prefill is commonly served; the paged prefill
  kernel's tiles share their keys across query rows, which per-row lists do not.

Configs come from a table of measurements (``_TABLE``: the H200 sweep of 2026-11-26, each row
with its source), keyed by the launch's shape class (:class:`DecodeShape`: page segment, head
dims, GQA group, cache dtype, batch x KV-head and context buckets), so a first call compiles one
config and never stalls on tuning. ``plan_decode(autotune=True)`` tunes over ``CONFIGS`` instead,
keyed by the same buckets (a GPU only).

Contract (checked only with ``validate=True`` or ``HYBRIDKV_VALIDATE=1``, because checking device
data costs a host sync): ``1 <= seq_lens[b] <= max_seq_len`` (when given), every block id a
request uses (columns ``< cdiv(seq_lens[b], block_size)``) is in ``[0, num_blocks)``; columns past
that are never read and may hold anything. Shapes, dtypes, strides and ``num_splits >= 1`` are
always checked on the host. Outside the contract the kernel reads other memory (the next
layer's page for a block id equal to ``num_blocks``) or drops tokens (``max_seq_len`` too small).

Sparse contract (the same switch checks it, on the plan's list and on every run's): each entry
of ``token_indices[b]`` is ``-1`` (padding, anywhere in the row) or a position in ``[0,
seq_lens[b])``; a row's positions are distinct and every row lists at least one (with no sinks,
a row of padding alone gives NaN). Outside it, entries below 0 are skipped and duplicates are
weighed twice (the reference counts them as listed, too).

Hopper: wgmma needs 64 rows per warpgroup while a decode tile has only the GQA group (<= 16)
rows, so ``mma.sync`` is the right instruction here; decode is bound by HBM bandwidth, which
cp.async reaches with enough tiles in flight.

Standalone: imports only torch and triton, so the file can be copied into another project.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

# ---- configs and the measured default table ---------------------------------------------------


@dataclass(frozen=True)
class DecodeConfig:
    """One compile-time choice of the partial kernel."""

    block_n: int  # keys per tile, a power of two >= 16
    num_warps: int
    num_stages: int  # software-pipelining depth: num_stages - 1 tiles in flight

    def __str__(self) -> str:
        return f"BLOCK_N={self.block_n},num_warps={self.num_warps},num_stages={self.num_stages}"


#: what autotuning tries (``plan_decode(autotune=True)``) and the compile check compiles; every
#: config of ``_TABLE`` is one of them
CONFIGS: tuple[DecodeConfig, ...] = (
    DecodeConfig(16, 2, 4),
    DecodeConfig(16, 4, 4),
    DecodeConfig(16, 2, 3),
    DecodeConfig(32, 2, 4),
    DecodeConfig(32, 4, 3),
    DecodeConfig(64, 4, 3),
    DecodeConfig(64, 8, 4),
    DecodeConfig(128, 4, 2),
    DecodeConfig(128, 8, 3),
)
#: split lengths are multiples of this, so the tiles of every config fit whole in a split
_MAX_BLOCK_N = max(c.block_n for c in CONFIGS)


@dataclass(frozen=True)
class DecodeShape:
    """The shape class a launch's config is chosen by (and autotuning is keyed by)."""

    arch: int  # compute capability as 80, 90, ...; the interpreter counts as 80
    page_align: int  # largest power of two dividing block_size, capped at 128: the segment
    group: int  # query heads per KV head
    head_dim: int  # max(head_dim_k, head_dim_v) padded to a power of two (>= 16)
    cache: str  # "16bit" | "fp32" | "fp8" (converted in hardware) | "fp8-bytes" (in software)
    work: int  # batch * KV heads, rounded up to a power of two
    context: int  # max_seq_len (sparse: the list's K), rounded up to a power of two
    sparse: bool = False  # a token-index list: every row its own address (page_align 1)

    @property
    def fp8(self) -> bool:
        return self.cache.startswith("fp8")


@dataclass(frozen=True)
class DecodeRule:
    """One row of the default table: the first row whose ranges (inclusive) all hold for a
    launch's :class:`DecodeShape` gives its config; ``source`` says where the row comes from."""

    config: DecodeConfig
    source: str
    page_align: tuple[int, int] = (1, 128)
    head_dim: tuple[int, int] = (16, 1024)
    work: tuple[int, int] = (1, 1 << 40)
    fp8: bool | None = None

    def matches(self, shape: DecodeShape) -> bool:
        return (
            self.page_align[0] <= shape.page_align <= self.page_align[1]
            and self.head_dim[0] <= shape.head_dim <= self.head_dim[1]
            and self.work[0] <= shape.work <= self.work[1]
            and (self.fp8 is None or self.fp8 == shape.fp8)
        )


_H200 = (
    "H200 sweep 2026-11-26 (paper/results/kernels-before-h200-2026-11-26.md), % of copy bandwidth"
)
_H200_SUITE = "H200 GPU suite run 1, 2026-11-26 (paper/results/h200-suite-1/), % of copy bandwidth"
#: the default configs, first match wins. Measured rows name the shape they were measured on;
#: the others are marked unmeasured and say what they are inferred from (the GPU suite sweeps
#: them: ``python -m paper.gpu_suite``).
_TABLE: tuple[DecodeRule, ...] = (
    DecodeRule(
        DecodeConfig(16, 2, 3),
        f"{_H200_SUITE}: 16-token segments (16-token pages, Nemotron-H's 272-, 528-, 1040-token "
        "pages), bf16 at B >= 8 with choose_num_splits' counts: Nemotron-H (d 128, GQA 4) "
        "96-102%, Qwen3-Next (d 256, GQA 8) 88.7% at B=8 ctx 32k and 100.4% at B=256 ctx 4k; "
        "16/2/4 (the earlier sweep's pick) 71-95% on the same cases; the best config at B=1 "
        "(48-63%) and for e4m3 caches (62-64%) too",
        page_align=(16, 16),
    ),
    DecodeRule(
        DecodeConfig(32, 4, 3),
        "unmeasured: no plan of the zoo makes 32-token segments; a one-segment tile like the "
        "measured rows",
        page_align=(32, 32),
    ),
    DecodeRule(
        DecodeConfig(32, 4, 3),
        f"{_H200}: Qwen3-Next (d 256) on 64-, 192- and 576-token pages, 85-106% at B >= 8 (the "
        "autotuner's only candidate there)",
        page_align=(64, 128),
        head_dim=(256, 1024),
    ),
    DecodeRule(
        DecodeConfig(128, 4, 2),
        f"{_H200}: Nemotron-H (d 128) on 256-token pages at B=64 ctx 8k, 100.8%",
        page_align=(128, 128),
        head_dim=(16, 128),
    ),
    DecodeRule(
        DecodeConfig(64, 4, 3),
        "unmeasured: 64-token segments at head dim <= 128; a one-segment tile between the "
        "measured 16- and 128-token rows",
        page_align=(64, 64),
        head_dim=(16, 128),
    ),
)

#: shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin): sm_80 163 KiB, sm_90 227 KiB
_SHARED_BYTES = {8: 166912, 9: 232448}


def config_fits(config: DecodeConfig, shape: DecodeShape) -> bool:
    """Whether ``config`` compiles for ``shape`` without spills and within shared memory: a
    rule fitted to ``python -m paper.compile_kernels`` over ``CONFIGS`` (sm_80 and sm_90, head
    dims 64-256, 16-bit and fp8 caches, 1-8 page segments a tile); the test suite checks the
    table against it. Shared memory holds ``num_stages - 1`` K and V tiles in flight plus q and
    the scores (8 KiB of slack). Registers: the tile's values a thread converts, at most 128 at
    2 warps (32/2/4 spills at head dim 256) and 64 there for a tile of several pages (its row
    ids and addresses take registers too: 32/2/4 spills 8 B at head dim 128 with e4m3), 256 at
    4 warps (128/4/2 spills at head dim 256, not at 128), 128 at 8 warps and 64 when the tile
    spans more than two page segments (128/8/3 spills on 16-token pages)."""
    width = 2 * shape.head_dim
    item = 1 if shape.fp8 else (4 if shape.cache == "fp32" else 2)
    shared = (config.num_stages - 1) * config.block_n * width * item + 8192
    if shared > _SHARED_BYTES.get(shape.arch // 10, _SHARED_BYTES[8]):
        return False
    per_thread = config.block_n * width // (32 * config.num_warps)
    segments = config.block_n // min(config.block_n, shape.page_align)
    if config.num_warps == 2:  # a tile of several pages: its row ids and addresses too
        limit = 128 if segments == 1 else 64
    else:
        limit = 256 if config.num_warps == 4 else (128 if segments <= 2 else 64)
    if shape.fp8 and config.num_warps >= 4 and per_thread <= 16:
        # ptxas 13.4 for sm_90 caps such a small fp8 tile (head dim 64) at 64 registers and
        # spills 8 B; Triton 3.6's ptxas does not
        return False
    return per_thread <= limit


def choose_config(shape: DecodeShape) -> tuple[DecodeConfig, str]:
    """The default config of a shape class and where it comes from (a ``_TABLE`` row, or the
    first config of ``CONFIGS`` that fits when a row's config does not fit this shape)."""
    for rule in _TABLE:
        if rule.matches(shape) and config_fits(rule.config, shape):
            return rule.config, rule.source
    for config in CONFIGS:
        if config_fits(config, shape):
            return config, "no table row: the first config that fits"
    raise ValueError(f"no decode config fits {shape}")


#: fewest tokens a split is worth
_MIN_SPLIT_TOKENS = 256
#: most splits (the reduce reads them all, 16 at a time)
_MAX_SPLITS = 128


def programs_per_sm(config: DecodeConfig, shape: DecodeShape) -> int:
    """How many programs of ``config`` ``choose_num_splits`` aims to give each multiprocessor.

    4+ warps: two (8+ warps a multiprocessor). 2 warps: as many as fit at once in shared
    memory (``num_stages`` K and V tiles, as Triton allocates them on Hopper, plus 8 KiB),
    at most 6 (8 for fp8 caches, whose programs also convert): small programs hide their loads
    only in numbers, and a grid that overflows one wave of resident programs leaves a tail.
    Measured (H200 GPU suite, 16/2/3): Qwen3-Next (d 256: 4 resident) B=8 x 2 KV heads at 32k,
    32 splits (512 programs) 88.7%, 37 splits (592: two waves) 66.6%; B=64 x 2 KV heads at 8k,
    3 splits 92.5%, 6 splits 79.9%; Nemotron-H (d 128) B=8 x 8 KV heads, 5 splits 81%, 10-11
    splits 96%; e4m3 Nemotron-H B=64 x 8 KV heads, 1 split 48.7%, 2 splits 60.9%."""
    if config.num_warps > 2:
        return 2
    item = 1 if shape.fp8 else (4 if shape.cache == "fp32" else 2)
    per_program = config.num_stages * config.block_n * 2 * shape.head_dim * item + 8192
    resident = _SHARED_BYTES.get(shape.arch // 10, _SHARED_BYTES[8]) // per_program
    return max(1, min(resident, 8 if shape.fp8 else 6))


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int = 132,
    per_sm: int = 2,
    one_wave: bool = False,
) -> int:
    """Split the context when batch * KV heads alone cannot fill the GPU with ``per_sm``
    programs a multiprocessor (``programs_per_sm``): at least ``_MIN_SPLIT_TOKENS`` tokens a
    split, at most ``_MAX_SPLITS``. ``one_wave`` (2-warp programs, sized by what fits at once):
    round down, so the grid stays one wave; otherwise round up (4-warp programs on large
    pages: 16 splits at B=8 x 2 KV heads, 89%; 8 splits of 64/4/3: 89.7%)."""
    target = per_sm * num_sms
    base = max(1, batch * num_kv_heads)
    by_parallelism = target // base if one_wave else triton.cdiv(target, base)
    by_length = max(1, max_seq_len // _MIN_SPLIT_TOKENS)
    return max(1, min(by_parallelism, by_length, _MAX_SPLITS))


# ---- kernels ----------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["tune_work", "tune_context"])
def _decode_partial_kernel(
    q_ptr,  # [B, Hq, Dk]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, Dk], strided (uint8 bytes when FP8 == 2)
    v_cache_ptr,  # [num_blocks, block_size, Hkv, Dv], strided
    table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    k_scale_ptr,  # [1] float32 (read only when FP8)
    v_scale_ptr,  # [1] float32
    sinks_ptr,  # [Hq] float32 attention-sink logits (read only when HAS_SINKS and ONE_SPLIT)
    rel_states_ptr,  # [B, Hq, D_REL] in q's dtype, last dim contiguous (read only when HAS_REL)
    rel_proj_ptr,  # [D_REL, rel_extent] in q's dtype, last dim contiguous (likewise)
    idx_ptr,  # [B, K] int32 token positions, -1 = padding, rows contiguous (read only when SPARSE)
    part_m_ptr,  # [B, Hq, S] float32, log2 units (unused when ONE_SPLIT)
    part_l_ptr,  # [B, Hq, S] float32 (unused when ONE_SPLIT)
    part_acc_ptr,  # [B, Hq, S, Dv] float32 (unused when ONE_SPLIT)
    out_ptr,  # [B, Hq, Dv] (written only when ONE_SPLIT)
    sm_scale,
    block_size,
    split_len,  # tokens per split, a multiple of every BLOCK_N
    window,  # sliding window in tokens; <= 0 means full attention
    rel_extent,  # HAS_REL: distances 0 .. rel_extent - 1 get a bias, farther keys none
    stride_rs_b,  # rel_states' strides (HAS_REL)
    stride_rs_h,
    stride_rp_r,  # rel_proj's row stride (HAS_REL)
    stride_idx_b,  # token_indices' row stride (SPARSE)
    num_indices,  # K: the index list's length (SPARSE)
    stride_q_b,
    stride_q_h,
    stride_out_b,
    stride_out_h,
    stride_table_b,
    stride_kc_block,
    stride_kc_token,
    stride_kc_head,
    stride_vc_block,
    stride_vc_token,
    stride_vc_head,
    num_splits,
    tune_work,  # batch x KV-head bucket: read only by autotuning's key
    tune_context,  # context bucket: likewise
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded for tl.dot
    HEAD_DIM_K: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGE_ALIGN: tl.constexpr,  # largest power of two dividing block_size (capped)
    FP8: tl.constexpr,  # 0: no fp8; 1: fp8 cache converted in hardware; 2: e4m3 bytes
    ONE_SPLIT: tl.constexpr,  # num_splits == 1: normalise and write out directly
    Q_TO_F16: tl.constexpr,  # fp8 cache, bf16 q: run the dots in fp16 (q rescaled)
    HAS_SINKS: tl.constexpr,  # per-head sink logits join each softmax's denominator
    HAS_REL: tl.constexpr,  # a relative-position bias rel_states @ rel_proj[:, distance]
    D_REL: tl.constexpr,  # relative states per head (HAS_REL)
    BLOCK_R: tl.constexpr,  # D_REL padded for tl.dot (>= 16)
    SPARSE: tl.constexpr,  # walk the index list idx_ptr instead of the positions 0..seq_len-1
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
    if SPARSE:  # splits cover the index list (no window: the plan refuses one)
        end = tl.minimum(start + split_len, num_indices)
    else:
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
    i_b64 = i_b.to(tl.int64)
    q = tl.load(
        q_ptr + i_b64 * stride_q_b + offs_h[:, None] * stride_q_h + offs_dk[None, :],
        mask=m_g[:, None] & m_dk[None, :],
        other=0.0,
    )

    # scores in log2 units (exp2 is one instruction); an fp8 cache's scales multiply the scores
    # and, once at the end, the accumulator, instead of every cached element
    qk_scale = sm_scale * 1.4426950408889634
    out_scale = 1.0
    if FP8 > 0:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        out_scale = tl.load(v_scale_ptr)
        if FP8 == 2:  # _e4m3_to_f16_div256 leaves out 2**(15 - 7)
            qk_scale = qk_scale * 256.0
            out_scale = out_scale * 256.0
        if Q_TO_F16:
            # fp8 converts to fp16 in one instruction a pair, to bf16 in four: a bf16 query is
            # scaled by a power of two into fp16's range (its largest value to [2**13, 2**14))
            # and the dots run in fp16; elements 2**-37 below the largest flush to zero, far
            # below bf16's own rounding
            q32 = q.to(tl.float32)
            q_max = tl.max(tl.max(tl.abs(q32), axis=1), axis=0)
            shift = 13.0 - tl.floor(tl.log2(tl.maximum(q_max, 1e-30)))
            q_mul = tl.exp2(tl.minimum(shift, 100.0))
            q = (q32 * q_mul).to(tl.float16)
            qk_scale = qk_scale / q_mul
    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    # loop invariants: the head's base and each row's offset inside its segment
    p_k_head = k_cache_ptr + i_kvh.to(tl.int64) * stride_kc_head
    p_v_head = v_cache_ptr + i_kvh.to(tl.int64) * stride_vc_head
    offs_seg = tl.arange(0, BLOCK_N) % SEG
    offs_k_row = offs_seg[:, None] * stride_kc_token + offs_dk[None, :]
    offs_v_row = offs_seg[:, None] * stride_vc_token + offs_dv[None, :]
    p_table = table_ptr + i_b64 * stride_table_b

    # a one-page tile: its block id is loaded one iteration ahead (a loop-carried scalar), so
    # the K/V loads of a tile depend on no load of the same iteration and are multi-buffered.
    # A tile of several pages loads one id per row in its own iteration instead: Triton's
    # pipeliner (3.6 as well as 3.9) schedules that table load stages ahead of the K/V loads
    # it feeds, where it leaves ids spread from a per-page vector (reshape) unpipelined in 3.6
    seg_block = 0
    if PAGES == 1 and not SPARSE:
        seg_block = tl.load(p_table + tile_lo // block_size, mask=tile_lo < end, other=0)
    rel_q = q  # HAS_REL: the query's relative states; else unused
    p_rel = q_ptr
    band_lo = end
    if HAS_REL:
        offs_i = tl.arange(0, BLOCK_R)
        m_i = offs_i < D_REL
        p_rs = rel_states_ptr + i_b64 * stride_rs_b + offs_h[:, None] * stride_rs_h
        rel_q = tl.load(p_rs + offs_i[None, :], mask=m_g[:, None] & m_i[None, :], other=0.0)
        # rel_proj's rows as int64 bases: only the distance is added per tile
        p_rel = rel_proj_ptr + offs_i.to(tl.int64)[:, None] * stride_rp_r
        # keys below seq_len - rel_extent are rel_extent or more behind the query: no bias,
        # so the tiles wholly below it run the plain loop (a scalar bound, no per-tile test)
        band_lo = tl.maximum(seq_len - rel_extent, 0) // BLOCK_N * BLOCK_N
        band_lo = tl.minimum(tl.maximum(band_lo, tile_lo), end)
    if SPARSE:
        # the request's list, BLOCK_N entries a tile: each entry's block id through the table
        # row and its slot (int64 rows); padding (-1) and entries past the split read nothing
        p_idx = idx_ptr + i_b64 * stride_idx_b
        b_m, b_l, b_acc = _decode_sparse_tiles(
            q, p_k_head, p_v_head, p_table, p_idx, start, end, qk_scale, b_m, b_l, b_acc,
            block_size, stride_kc_block, stride_kc_token, stride_vc_block, stride_vc_token,
            offs_dk, offs_dv, m_dk, m_dv, FP8, BLOCK_N,
        )  # fmt: skip
    else:
        b_m, b_l, b_acc, seg_block = _decode_tiles(
            q, rel_q, p_rel, p_k_head, p_v_head, p_table, seg_block, tile_lo, band_lo, lo, end,
            seq_len, rel_extent, qk_scale, b_m, b_l, b_acc, block_size, stride_kc_block,
            stride_kc_token, stride_vc_block, stride_vc_token, offs_k_row, offs_v_row, offs_dk,
            offs_dv, m_dk, m_dv, FP8, PAGES, False, D_REL, BLOCK_R, BLOCK_N,
        )  # fmt: skip
        if HAS_REL:  # the tiles holding a key less than rel_extent behind the query
            b_m, b_l, b_acc, seg_block = _decode_tiles(
                q, rel_q, p_rel, p_k_head, p_v_head, p_table, seg_block, band_lo, end, lo, end,
                seq_len, rel_extent, qk_scale, b_m, b_l, b_acc, block_size, stride_kc_block,
                stride_kc_token, stride_vc_block, stride_vc_token, offs_k_row, offs_v_row,
                offs_dk, offs_dv, m_dk, m_dv, FP8, PAGES, True, D_REL, BLOCK_R, BLOCK_N,
            )  # fmt: skip

    if ONE_SPLIT:
        if HAS_SINKS:  # a sink is one more logit with no value: it only adds to the denominator
            sink = tl.load(sinks_ptr + offs_h, mask=m_g, other=0.0) * 1.4426950408889634
            m_fin = tl.maximum(b_m, sink)
            corr = tl.exp2(b_m - m_fin)
            b_l = b_l * corr + tl.exp2(sink - m_fin)
            b_acc = b_acc * corr[:, None]
        out = b_acc * (out_scale / b_l)[:, None]
        tl.store(
            out_ptr + i_b64 * stride_out_b + offs_h[:, None] * stride_out_h + offs_dv[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=m_g[:, None] & m_dv[None, :],
        )
    else:
        base = (i_b64 * (GROUP * tl.num_programs(1)) + offs_h) * num_splits + i_s
        tl.store(part_m_ptr + base, b_m, mask=m_g)
        tl.store(part_l_ptr + base, b_l, mask=m_g)
        tl.store(
            part_acc_ptr + base[:, None] * HEAD_DIM_V + offs_dv[None, :],
            b_acc * out_scale,
            mask=m_g[:, None] & m_dv[None, :],
        )


@triton.jit
def _decode_tiles(
    q,  # [BLOCK_G, BLOCK_DK] in the dots' dtype
    rel_q,  # BIAS: [BLOCK_G, BLOCK_R] the query's relative states
    p_rel,  # BIAS: [BLOCK_R, 1] pointers to rel_proj's rows
    p_k_head,  # the KV head's base in each cache
    p_v_head,
    p_table,  # the request's block-table row
    seg_block,  # one-page tiles: the block id of tile ``first``, loaded ahead
    first,  # first tile, a multiple of BLOCK_N
    last,  # the loop stops before this key
    lo,  # first key of the split (or window) the query sees
    end,  # one past the split's last key
    seq_len,
    rel_extent,
    qk_scale,
    b_m,
    b_l,
    b_acc,
    block_size,
    stride_kc_block,
    stride_kc_token,
    stride_vc_block,
    stride_vc_token,
    offs_k_row,  # [BLOCK_N, BLOCK_DK] offsets inside a page segment
    offs_v_row,  # [BLOCK_N, BLOCK_DV]
    offs_dk,
    offs_dv,
    m_dk,
    m_dv,
    FP8: tl.constexpr,
    PAGES: tl.constexpr,
    BIAS: tl.constexpr,  # add rel_q @ rel_proj[:, distance] to the scores
    D_REL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The online softmax over the tiles ``first, first + BLOCK_N, ...`` below ``last``: the
    running ``(b_m, b_l, b_acc)`` and the next tile's block id."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for tile in range(first, last, BLOCK_N):
        if PAGES == 1:
            in_page = tile % block_size
            p_k = p_k_head + (seg_block.to(tl.int64) * stride_kc_block + in_page * stride_kc_token)
            p_v = p_v_head + (seg_block.to(tl.int64) * stride_vc_block + in_page * stride_vc_token)
            p_k = p_k + offs_k_row
            p_v = p_v + offs_v_row
            next_tile = tile + BLOCK_N
            seg_block = tl.load(p_table + next_tile // block_size, mask=next_tile < end, other=0)
        else:
            pos = tile + offs_n0
            row_block = tl.load(p_table + pos // block_size, mask=pos < end, other=0)
            in_page = pos % block_size
            k_rows = row_block.to(tl.int64) * stride_kc_block + in_page * stride_kc_token
            v_rows = row_block.to(tl.int64) * stride_vc_block + in_page * stride_vc_token
            p_k = p_k_head + k_rows[:, None] + offs_dk[None, :]
            p_v = p_v_head + v_rows[:, None] + offs_dv[None, :]
        offs_n = tile + tl.arange(0, BLOCK_N)
        m_n = (offs_n >= lo) & (offs_n < end)
        k = tl.load(p_k, mask=m_n[:, None] & m_dk[None, :], other=0.0)
        v = tl.load(p_v, mask=m_n[:, None] & m_dv[None, :], other=0.0)
        if FP8 == 2:
            k = _e4m3_to_f16_div256(k).to(q.dtype)
            v = _e4m3_to_f16_div256(v).to(q.dtype)
        else:  # 16-bit caches: a no-op; fp8: one conversion (the scales are folded out)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_G, BLOCK_N]
        if BIAS:
            # the one query sits at seq_len - 1: key n is seq_len - 1 - n behind it, so the
            # bias is one small dot with rel_proj's columns gathered by distance (zero from
            # rel_extent on, and for masked keys past the split)
            dist = seq_len - 1 - offs_n
            m_d = (dist >= 0) & (dist < rel_extent) & m_n
            m_i = tl.arange(0, BLOCK_R) < D_REL
            proj = tl.load(p_rel + dist[None, :], mask=m_i[:, None] & m_d[None, :], other=0.0)
            s += tl.dot(rel_q, proj) * 1.4426950408889634  # log2 units, float32
        s = tl.where(m_n[None, :], s, float("-inf"))
        # every tile holds a key in [lo, end), so m_new is finite from the first tile on
        m_new = tl.maximum(b_m, tl.max(s, axis=1))
        alpha = tl.exp2(b_m - m_new)
        p = tl.exp2(s - m_new[:, None])
        b_l = b_l * alpha + tl.sum(p, axis=1)
        b_acc = b_acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        b_m = m_new
    return b_m, b_l, b_acc, seg_block


@triton.jit
def _decode_sparse_tiles(
    q,  # [BLOCK_G, BLOCK_DK] in the dots' dtype
    p_k_head,  # the KV head's base in each cache
    p_v_head,
    p_table,  # the request's block-table row
    p_idx,  # the request's index-list row
    first,  # first list entry of the split
    end,  # one past the split's last entry
    qk_scale,
    b_m,
    b_l,
    b_acc,
    block_size,
    stride_kc_block,
    stride_kc_token,
    stride_vc_block,
    stride_vc_token,
    offs_dk,
    offs_dv,
    m_dk,
    m_dv,
    FP8: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The online softmax over the list entries ``first .. end - 1``, ``BLOCK_N`` a tile:
    every entry is a row of its own (a position anywhere in the context), so each gets its
    own block id and int64 row offset, as on pages of one token. A tile (or a whole split)
    may be padding alone: its running max stays -inf and it weighs nothing, instead of
    ``exp2(-inf - -inf)`` = NaN."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for tile in range(first, end, BLOCK_N):
        offs_n = tile + offs_n0
        pos = tl.load(p_idx + offs_n, mask=offs_n < end, other=-1)  # [BLOCK_N]
        m_n = pos >= 0
        row_block = tl.load(p_table + pos // block_size, mask=m_n, other=0)
        in_page = (pos % block_size).to(tl.int64)
        k_rows = row_block.to(tl.int64) * stride_kc_block + in_page * stride_kc_token
        v_rows = row_block.to(tl.int64) * stride_vc_block + in_page * stride_vc_token
        k = tl.load(
            p_k_head + k_rows[:, None] + offs_dk[None, :], mask=m_n[:, None] & m_dk[None, :],
            other=0.0,
        )  # fmt: skip
        v = tl.load(
            p_v_head + v_rows[:, None] + offs_dv[None, :], mask=m_n[:, None] & m_dv[None, :],
            other=0.0,
        )  # fmt: skip
        if FP8 == 2:
            k = _e4m3_to_f16_div256(k).to(q.dtype)
            v = _e4m3_to_f16_div256(v).to(q.dtype)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(m_n[None, :], s, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(b_m - m_use)
        p = tl.exp2(s - m_use[:, None])
        b_l = b_l * alpha + tl.sum(p, axis=1)
        b_acc = b_acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        b_m = m_new
    return b_m, b_l, b_acc


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
def _decode_reduce_kernel(
    part_m_ptr,  # [B, Hq, S] float32, log2 units
    part_l_ptr,  # [B, Hq, S] float32
    part_acc_ptr,  # [B, Hq, S, Dv] float32
    sinks_ptr,  # [Hq] float32 attention-sink logits (read only when HAS_SINKS)
    out_ptr,  # [B, Hq, Dv]
    stride_out_b,
    stride_out_h,
    num_heads,
    num_splits,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_S: tl.constexpr,  # num_splits padded to a power of two
    CHUNK_S: tl.constexpr,  # splits merged per step
    BLOCK_DV: tl.constexpr,  # output columns per program
    HAS_SINKS: tl.constexpr,  # per-head sink logits join the softmax's denominator
):
    # one program per (request, head, column block): at batch 1 with many splits the merge
    # still spreads over several programs
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    i_d = tl.program_id(2)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = i_d * BLOCK_DV + tl.arange(0, BLOCK_DV)
    m_dv = offs_dv < HEAD_DIM_V
    row = (i_b.to(tl.int64) * num_heads + i_h) * num_splits
    m = tl.load(part_m_ptr + row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    l = tl.load(part_l_ptr + row + offs_s, mask=offs_s < num_splits, other=0.0)
    m_max = tl.max(m, axis=0)
    if HAS_SINKS:  # added once here, not per split
        sink = tl.load(sinks_ptr + i_h) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    # empty splits (m = -inf, l = 0) get weight 0; at least one split is non-empty
    den = tl.sum(tl.where(l > 0, tl.exp2(m - m_max), 0.0) * l, axis=0)
    if HAS_SINKS:
        den += tl.exp2(sink - m_max)
    num = tl.zeros([BLOCK_DV], tl.float32)
    offs_c = tl.arange(0, CHUNK_S)
    for s0 in range(0, BLOCK_S, CHUNK_S):
        m_c = (s0 + offs_c) < num_splits
        m_s = tl.load(part_m_ptr + row + s0 + offs_c, mask=m_c, other=float("-inf"))
        l_s = tl.load(part_l_ptr + row + s0 + offs_c, mask=m_c, other=0.0)
        w = tl.where(l_s > 0, tl.exp2(m_s - m_max), 0.0)
        acc = tl.load(
            part_acc_ptr + (row + s0 + offs_c)[:, None] * HEAD_DIM_V + offs_dv[None, :],
            mask=m_c[:, None] & m_dv[None, :],
            other=0.0,
        )
        num += tl.sum(acc * w[:, None], axis=0)
    tl.store(
        out_ptr + i_b.to(tl.int64) * stride_out_b + i_h * stride_out_h + offs_dv,
        (num / den).to(out_ptr.dtype.element_ty),
        mask=m_dv,
    )


# ---- host side --------------------------------------------------------------------------------

_FP8 = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability; the CPU (the interpreter) counts as sm_80, the oldest GPU
    the configs are checked for. The compile check monkeypatches this per target."""
    if device.type != "cuda":
        return (8, 0)
    return torch.cuda.get_device_capability(device)


def _fp8e4_in_hardware(device: torch.device) -> bool:
    """sm_89+ (Ada, Hopper) convert e4m3 in hardware; older GPUs get the raw bytes and a
    software conversion in the kernel. The interpreter's widening casts are exact, so it takes
    the hardware path (its narrowing casts are not: see ``cache_write.py``). Tests and the
    compile check monkeypatch this."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Multiprocessors of the GPU; on the CPU an H100's 132, so the CPU tests see the grids an
    H100 would run."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


#: Triton versions whose compiled-kernel launch API ``_Launcher`` calls directly (checked)
_DIRECT_LAUNCH = not _INTERPRETED and (3, 6) <= tuple(
    int(x) for x in triton.__version__.split(".")[:2]
) <= (3, 9)


class _Launcher:
    """Launch a ``@triton.jit`` kernel without Triton's per-call argument binding once its
    specialisation has been compiled. ``JITFunction.run`` binds and specialises every argument
    on every call (tens of microseconds for ~30 arguments), while an engine launches the same
    specialisation for every layer of every step. The caller names the specialisation by a
    ``key`` holding whatever in its arguments may change between calls and matters to Triton
    (pointer alignment, integer values or classes); the first call of a key goes through
    Triton and keeps the compiled kernel, later ones call its launcher directly. Triton's path
    is always taken under the interpreter, while launch hooks are set (profilers), or with a
    Triton whose compiled-kernel API was not checked (``_DIRECT_LAUNCH``)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.compiled: dict[tuple, tuple] = {}

    def __call__(self, grid: tuple[int, int, int], key: tuple, args: tuple, meta: dict) -> None:
        hit = self.compiled.get(key)
        if hit is None or _hooks_set():
            kernel = self.fn[grid](*args, **meta)
            if _DIRECT_LAUNCH and hit is None and hasattr(kernel, "packed_metadata"):
                # the launcher takes every parameter in order, constexprs included
                tail = tuple(meta[name] for name in self.fn.arg_names[len(args) :])
                self.compiled[key] = (kernel, tail)
            return
        kernel, tail = hit
        device = triton.runtime.driver.active.get_current_device()
        stream = triton.runtime.driver.active.get_current_stream(device)
        kernel.run(
            grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata,
            None, None, None, *args, *tail,
        )  # fmt: skip


def _hooks_set() -> bool:
    """Whether a profiler (or anyone) hooks Triton's launches: then every launch takes
    Triton's path, which calls the hooks with the launch's metadata."""
    runtime = triton.knobs.runtime
    hooks = (runtime.launch_enter_hook, runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def _int_class(v: int) -> tuple[bool, bool, bool]:
    """What Triton specialises an integer argument on: equal to 1, divisible by 16, 32-bit."""
    return (v == 1, v % 16 == 0, -(2**31) <= v < 2**31)


_partial_launcher = _Launcher(_decode_partial_kernel)
_reduce_launcher = _Launcher(_decode_reduce_kernel)


def _validate_enabled(validate: bool | None) -> bool:
    if validate is None:
        return os.environ.get("HYBRIDKV_VALIDATE", "") not in ("", "0")
    return validate


def _bucket(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _cache_kind(cache_dtype: torch.dtype, device: torch.device) -> str:
    if cache_dtype in _FP8:
        if cache_dtype == torch.float8_e4m3fn and not _fp8e4_in_hardware(device):
            return "fp8-bytes"
        return "fp8"
    return "fp32" if cache_dtype == torch.float32 else "16bit"


def decode_shape(
    *,
    device: torch.device,
    block_size: int,
    group: int,
    head_dim_k: int,
    head_dim_v: int,
    cache_dtype: torch.dtype,
    batch: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_indices: int | None = None,
) -> DecodeShape:
    """The :class:`DecodeShape` of a launch; ``num_indices`` (K of a token-index list) makes
    it sparse: every gathered row has its own address (``page_align`` 1) and the walk covers K
    entries."""
    major, minor = _capability(device)
    sparse = num_indices is not None
    return DecodeShape(
        arch=10 * major + minor,
        page_align=1 if sparse else min(block_size & -block_size, _MAX_BLOCK_N),
        group=group,
        head_dim=max(16, triton.next_power_of_2(max(head_dim_k, head_dim_v))),
        cache=_cache_kind(cache_dtype, device),
        work=_bucket(batch * num_kv_heads),
        context=_bucket(num_indices if sparse else max_seq_len),
        sparse=sparse,
    )


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


def _check_lengths(seq_lens: torch.Tensor, max_seq_len: int | None) -> torch.Tensor:
    """``seq_lens`` on the host (one sync), checked against the contract."""
    lens = seq_lens.detach().cpu()
    if int(lens.min()) < 1:
        b = int(lens.argmin())
        raise ValueError(
            f"seq_lens[{b}] = {int(lens[b])}: every request needs seq_len >= 1 (the query token "
            f"itself)"
        )
    if max_seq_len is not None and int(lens.max()) > max_seq_len:
        b = int(lens.argmax())
        raise ValueError(
            f"seq_lens[{b}] = {int(lens[b])} exceeds max_seq_len = {max_seq_len}: the tokens "
            f"past it would be dropped; pass max_seq_len >= max(seq_lens)"
        )
    return lens


def _check_indices_tensor(token_indices: torch.Tensor, batch: int, device: torch.device) -> None:
    """The host-side checks of an index list (no sync): shape, dtype, rows, device."""
    if (
        not isinstance(token_indices, torch.Tensor)
        or token_indices.dtype != torch.int32
        or token_indices.dim() != 2
        or token_indices.shape[0] != batch
    ):
        got = (
            f"{tuple(token_indices.shape)} {token_indices.dtype}"
            if isinstance(token_indices, torch.Tensor)
            else type(token_indices).__name__
        )
        raise ValueError(
            f"token_indices must be an int32 [B, K] tensor with one row per request (B = "
            f"{batch}), got {got}"
        )
    if token_indices.shape[1] > 1 and token_indices.stride(1) != 1:
        raise ValueError("token_indices rows must be contiguous (.contiguous())")
    if token_indices.device != device:
        raise ValueError(f"token_indices is on {token_indices.device}, block_tables on {device}")


def check_token_indices(token_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Every entry of row ``b`` is ``-1`` (padding) or a position in ``[0, seq_lens[b])``; the
    positions of a row are distinct; every row lists at least one. Syncs with the device."""
    idx = token_indices.detach().cpu().long()
    lens = seq_lens.detach().cpu().long()
    bad = (idx < -1) | (idx >= lens[:, None])
    if bad.any():
        b, k = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"token_indices[{b}, {k}] = {int(idx[b, k])} is outside [0, {int(lens[b])}) "
            f"(request {b}'s seq_len) and is not -1 (padding): list positions of cached tokens "
            f"only"
        )
    live = idx >= 0
    empty = ~live.any(dim=1)
    if empty.any():
        b = int(empty.nonzero()[0])
        raise ValueError(
            f"token_indices[{b}] lists no token (all -1): every request attends to at least "
            f"one (with no sinks, a row of padding alone has no softmax)"
        )
    ordered = torch.where(live, idx, -1 - torch.arange(idx.shape[1])).sort(dim=1).values
    dup = ordered[:, 1:] == ordered[:, :-1]
    if dup.any():
        b, k = (int(i) for i in dup.nonzero()[0])
        raise ValueError(
            f"token_indices[{b}] lists position {int(ordered[b, k])} more than once: the "
            f"kernel would weigh it twice; list each token once (as a top-k does)"
        )


@functools.cache
def _autotuned_kernel():
    """The partial kernel under ``triton.autotune`` over ``CONFIGS``, keyed by the shape class
    (the constexprs plus the work and context buckets). Built on first use: the interpreter
    cannot autotune."""
    configs = [
        triton.Config({"BLOCK_N": c.block_n}, num_warps=c.num_warps, num_stages=c.num_stages)
        for c in CONFIGS
    ]
    return triton.autotune(
        configs,
        key=[
            "HEAD_DIM_K",
            "HEAD_DIM_V",
            "GROUP",
            "PAGE_ALIGN",
            "FP8",
            "HAS_REL",  # a bias launch tunes apart: its tiles also hold the bias dot
            "SPARSE",  # a gather of listed rows tunes apart from the page walk
            "tune_work",
            "tune_context",
        ],
        prune_configs_by={"early_config_prune": _prune_for_autotune},
    )(_decode_partial_kernel)


def _config_of(c: triton.Config) -> DecodeConfig:
    return DecodeConfig(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)


def _prune_for_autotune(
    configs: list[triton.Config], nargs: dict, **kwargs
) -> list[triton.Config]:
    """Autotuning's candidates: the configs that fit the launch's shape class."""
    args = {**nargs, **kwargs}
    device = args["q_ptr"].device
    major, minor = _capability(device)
    item = args["k_cache_ptr"].element_size()
    cache = {1: "fp8", 4: "fp32"}.get(item, "16bit")
    if args["FP8"] == 2:
        cache = "fp8-bytes"
    shape = DecodeShape(
        arch=10 * major + minor,
        page_align=args["PAGE_ALIGN"],
        group=args["GROUP"],
        head_dim=max(args["BLOCK_DK"], args["BLOCK_DV"]),
        cache=cache,
        work=args["tune_work"],
        context=args["tune_context"],
        sparse=bool(args["SPARSE"]),
    )
    kept = [c for c in configs if config_fits(_config_of(c), shape)]
    return kept or configs[:1]


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """Everything :meth:`run` needs that does not change between the layers of one step.

    Made by :func:`plan_decode`; holds the step's block tables and lengths (by reference: a
    CUDA graph that captured :meth:`run` replays on whatever they hold then), the partial
    buffers, the config and the grid."""

    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    block_size: int
    cache_dtype: torch.dtype
    q_dtype: torch.dtype
    scale: float
    sliding_window: int  # 0: full attention
    max_seq_len: int
    shape: DecodeShape
    config: DecodeConfig
    config_source: str  # the table row, "autotune" or "given"
    num_splits: int
    split_len: int
    autotune: bool
    has_sinks: bool  # run takes each layer's per-head attention-sink logits
    rel_dim: int  # > 0: run takes each layer's relative-position bias (rel_states, rel_proj)
    num_indices: int | None  # K of a sparse plan (splits cover the list), None when dense
    validate: bool  # run checks each layer's index list too (one sync a run)
    block_tables: torch.Tensor = field(repr=False)
    seq_lens: torch.Tensor = field(repr=False)
    token_indices: torch.Tensor | None = field(repr=False)  # the list planned with
    _host_lens: torch.Tensor | None = field(repr=False)  # seq_lens read back (validate)
    part_m: torch.Tensor | None = field(repr=False)
    part_l: torch.Tensor | None = field(repr=False)
    part_acc: torch.Tensor | None = field(repr=False)
    _constexprs: dict = field(repr=False)
    _reduce_grid: tuple[int, int, int] = field(repr=False)
    _reduce_constexprs: dict = field(repr=False)
    # derived once, for run's checks and launches
    _q_shape: tuple[int, int, int] = field(init=False, repr=False)
    _out_shape: tuple[int, int, int] = field(init=False, repr=False)
    _k_tail: tuple[int, int, int] = field(init=False, repr=False)
    _v_tail: tuple[int, int, int] = field(init=False, repr=False)
    _meta: dict = field(init=False, repr=False)
    _launch_key: tuple = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)  # a frozen dataclass's derived fields

        batch, heads, bs, hkv = self.batch, self.num_heads, self.block_size, self.num_kv_heads
        put("_q_shape", (batch, heads, self.head_dim_k))
        put("_out_shape", (batch, heads, self.head_dim_v))
        put("_k_tail", (bs, hkv, self.head_dim_k))
        put("_v_tail", (bs, hkv, self.head_dim_v))
        c = self.config
        meta = dict(self._constexprs, BLOCK_N=c.block_n)
        put("_meta", dict(meta, num_warps=c.num_warps, num_stages=c.num_stages))
        # the plan's part of every launch's specialisation: its tensors' alignment, its
        # integers' classes, the constexprs and options
        tensors = (self.block_tables, self.seq_lens, self.part_m, self.part_l, self.part_acc)
        put(
            "_launch_key",
            (
                self.block_tables.device,
                (self.q_dtype, self.cache_dtype, self.seq_lens.dtype),
                tuple(None if t is None else t.data_ptr() % 16 for t in tensors),
                tuple(
                    _int_class(v)
                    for v in (bs, self.split_len, self.sliding_window, self.num_splits,
                              self.block_tables.stride(0), self.num_indices or 0)
                ),
                tuple(sorted(self._meta.items())),
            ),
        )  # fmt: skip

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        rel_states: torch.Tensor | None = None,
        rel_proj: torch.Tensor | None = None,
        token_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode attention of one layer: ``q [B, Hq, Dk]`` over ``k_cache``/``v_cache``
        ``[num_blocks, block_size, Hkv, D]`` (any strides but the last) of the planned shape
        and dtype; fp8 caches need ``k_scale``/``v_scale`` (float32, one value each). Returns
        ``[B, Hq, Dv]`` in ``q``'s dtype (in ``out`` if given: then nothing is allocated).
        ``sinks [Hq] float32``: the layer's attention-sink logits, required when the plan was
        made with ``sinks=True`` and refused otherwise. ``rel_states [B, Hq, rel_dim]`` and
        ``rel_proj [rel_dim, rel_extent]`` (q's dtype, last dims contiguous): the layer's
        relative-position bias, required when the plan was made with ``rel_dim`` and refused
        otherwise (see :func:`plan_decode`). A sparse plan needs this layer's ``token_indices
        [B, K] int32`` (the planned K, rows contiguous; ``plan.token_indices`` where the layers
        share one list); a dense plan refuses one."""
        batch, heads, dv = self.batch, self.num_heads, self.head_dim_v
        if self.num_indices is None:
            if token_indices is not None:
                raise ValueError(
                    "this plan attends to every cached token: it was made without "
                    "token_indices. Pass the step's [B, K] list to plan_decode(token_indices="
                    "...) for a sparse (token-list) plan"
                )
            idx, stride_idx = self.seq_lens, 0  # never read
        else:
            if token_indices is None:
                raise ValueError(
                    f"this plan is sparse (planned with token_indices, K = {self.num_indices}):"
                    f" pass this layer's token_indices= [B, K] (or plan.token_indices), or plan "
                    f"without token_indices to attend to every cached token"
                )
            _check_indices_tensor(token_indices, batch, self.block_tables.device)
            if token_indices.shape[1] != self.num_indices:
                raise ValueError(
                    f"token_indices has K = {token_indices.shape[1]} entries a request but the "
                    f"plan was made for K = {self.num_indices}: plan with this list"
                )
            if self.validate and batch:
                check_token_indices(token_indices, self._host_lens)
            idx, stride_idx = token_indices, token_indices.stride(0)
        if q.shape != self._q_shape or q.dtype != self.q_dtype or q.stride(2) != 1:
            raise ValueError(
                f"q must be {list(self._q_shape)} {self.q_dtype} with a contiguous last dim "
                f"(the plan's), got {tuple(q.shape)} {q.dtype}"
            )
        ks, vs = k_cache.stride(), v_cache.stride()
        if (
            k_cache.shape[1:] != self._k_tail
            or v_cache.shape[1:] != self._v_tail
            or k_cache.shape[0] != v_cache.shape[0]
            or k_cache.dtype != self.cache_dtype
            or v_cache.dtype != self.cache_dtype
            or ks[3] != 1
            or vs[3] != 1
        ):
            raise ValueError(
                f"k_cache/v_cache must be [num_blocks, {self.block_size}, {self.num_kv_heads}, "
                f"{self.head_dim_k}/{dv}] {self.cache_dtype} views with a contiguous last dim "
                f"(the plan's), got {tuple(k_cache.shape)} {k_cache.dtype} and "
                f"{tuple(v_cache.shape)} {v_cache.dtype}"
            )
        fp8 = self._constexprs["FP8"]
        if fp8:
            _check_scale(k_scale, "k_scale")
            _check_scale(v_scale, "v_scale")
            if fp8 == 2:
                k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        else:
            k_scale = v_scale = self.seq_lens  # never read
        sinks = _check_sinks(sinks, self.has_sinks, heads, q.device)
        if sinks is None:
            sinks = self.seq_lens  # never read
        _check_rel(rel_states, rel_proj, self.rel_dim, batch, heads, q, "B")
        if rel_states is None:
            rel_states = rel_proj = self.seq_lens  # never read
            rel_ints = (0, 0, 0, 0)
        else:
            rs = rel_states.stride()
            rel_ints = (rel_proj.shape[1], rs[0], rs[1], rel_proj.stride(0))
        if out is None:
            out = torch.empty(self._out_shape, dtype=q.dtype, device=q.device)
        elif out.shape != self._out_shape or out.stride(2) != 1 or out.dtype != q.dtype:
            raise ValueError(
                f"out must be {list(self._out_shape)} {q.dtype}, contiguous in Dv, got "
                f"{tuple(out.shape)} {out.dtype}"
            )
        if batch == 0:
            return out
        one_split = self.num_splits == 1
        qs, os_ = q.stride(), out.stride()
        parts = (out, out, out) if one_split else (self.part_m, self.part_l, self.part_acc)
        args = (
            q, k_cache, v_cache, self.block_tables, self.seq_lens, k_scale, v_scale, sinks,
            rel_states, rel_proj, idx, *parts, out, self.scale, self.block_size, self.split_len,
            self.sliding_window, *rel_ints, stride_idx, self.num_indices or 0, qs[0], qs[1],
            os_[0], os_[1],
            self.block_tables.stride(0), ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
            self.num_splits, self.shape.work, self.shape.context,
        )  # fmt: skip
        grid = (batch, self.num_kv_heads, self.num_splits)
        if self.autotune:
            _autotuned_kernel()[grid](*args, **self._constexprs)
        else:
            # what may differ between the layers of a step and matters to Triton's
            # specialisation: the pointers' alignment and the strides
            key = (
                self._launch_key, q.data_ptr() % 16, k_cache.data_ptr() % 16,
                v_cache.data_ptr() % 16, out.data_ptr() % 16, k_scale.data_ptr() % 16,
                v_scale.data_ptr() % 16, sinks.data_ptr() % 16, rel_states.data_ptr() % 16,
                rel_proj.data_ptr() % 16, tuple(_int_class(v) for v in rel_ints), qs, os_, ks,
                vs, idx.data_ptr() % 16, _int_class(stride_idx),
            )  # fmt: skip
            _partial_launcher(grid, key, args, self._meta)
        if not one_split:
            _reduce_launcher(
                self._reduce_grid,
                (self._launch_key, out.data_ptr() % 16, sinks.data_ptr() % 16, os_),
                (self.part_m, self.part_l, self.part_acc, sinks, out, os_[0], os_[1], heads,
                 self.num_splits),
                self._reduce_constexprs,
            )  # fmt: skip
        return out


def _check_sinks(
    sinks: torch.Tensor | None, planned: bool, num_heads: int, device: torch.device
) -> torch.Tensor | None:
    """``sinks`` as a run takes them: ``[Hq]`` float32 on the layer's device, given exactly when
    the plan was made for them."""
    if sinks is None:
        if planned:
            raise ValueError("this plan was made with sinks=True: pass the layer's sinks [Hq]")
        return None
    if not planned:
        raise ValueError("sinks given to a plan made without them: plan with sinks=True")
    if sinks.shape != (num_heads,) or sinks.dtype != torch.float32 or sinks.device != device:
        raise ValueError(
            f"sinks must be [{num_heads}] float32 on {device} (one logit per query head), got "
            f"{tuple(sinks.shape)} {sinks.dtype} on {sinks.device}"
        )
    return sinks.contiguous()


def _check_rel(
    rel_states: torch.Tensor | None,
    rel_proj: torch.Tensor | None,
    rel_dim: int,
    rows: int,
    num_heads: int,
    q: torch.Tensor,
    rows_name: str,
) -> None:
    """A run's relative-position bias: ``rel_states [rows, Hq, rel_dim]`` and ``rel_proj
    [rel_dim, rel_extent]`` in ``q``'s dtype on its device with contiguous last dims, given
    exactly when the plan was made with ``rel_dim`` (> 0)."""
    given = (rel_states is not None, rel_proj is not None)
    if given == (False, False):
        if rel_dim:
            raise ValueError(
                f"this plan was made with rel_dim={rel_dim}: pass the layer's rel_states "
                f"[{rows_name}, Hq, {rel_dim}] and rel_proj [{rel_dim}, rel_extent]"
            )
        return
    if not rel_dim:
        raise ValueError(
            "rel_states/rel_proj given to a plan made without a relative bias: plan with "
            "rel_dim=rel_states.shape[-1]"
        )
    if given != (True, True):
        raise ValueError("pass rel_states and rel_proj together (the bias is their product)")
    want = (rows, num_heads, rel_dim)
    if rel_states.shape != want or rel_states.stride(2) != 1:
        raise ValueError(
            f"rel_states must be [{rows_name}={rows}, Hq={num_heads}, rel_dim={rel_dim}] (one "
            f"row per query token) with a contiguous last dim, got {tuple(rel_states.shape)} "
            f"strides {rel_states.stride()}"
        )
    if rel_proj.dim() != 2 or rel_proj.shape[0] != rel_dim or rel_proj.shape[1] < 1:
        raise ValueError(
            f"rel_proj must be [rel_dim={rel_dim}, rel_extent >= 1] (one column per distance), "
            f"got {tuple(rel_proj.shape)}"
        )
    if rel_proj.stride(1) != 1:
        raise ValueError(
            f"rel_proj's last dim must be contiguous (its distances), got strides "
            f"{rel_proj.stride()}: pass rel_proj.contiguous()"
        )
    for name, t in (("rel_states", rel_states), ("rel_proj", rel_proj)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"{name} must be {q.dtype} on {q.device} (q's: the bias dot runs in q's dtype, "
                f"as the model's relative_states @ proj does), got {t.dtype} on {t.device}"
            )


def _check_scale(scale: torch.Tensor | None, name: str) -> None:
    if scale is None or scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError(
            f"an fp8 cache needs {name}: a float32 tensor holding one value, got "
            f"{None if scale is None else (scale.dtype, tuple(scale.shape))}"
        )


def plan_decode(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    cache_dtype: torch.dtype,
    q_dtype: torch.dtype,
    scale: float,
    head_dim_v: int | None = None,
    sliding_window: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    autotune: bool = False,
    num_blocks: int | None = None,
    validate: bool | None = None,
    sinks: bool = False,
    rel_dim: int | None = None,
    token_indices: torch.Tensor | None = None,
) -> DecodePlan:
    """Plan one step's decode: ``block_tables [B, max_blocks] int32`` (row-contiguous),
    ``seq_lens [B] int32/int64`` (>= 1; the query is the last token) on the device the layers'
    tensors live on, and the shapes every layer of the step shares. Returns a
    :class:`DecodePlan` whose :meth:`~DecodePlan.run` serves every layer.

    ``max_seq_len`` (>= every seq_len) keeps planning free of device syncs; without it
    ``seq_lens`` is read back once. ``num_splits`` overrides :func:`choose_num_splits`;
    ``config`` overrides the table (:func:`choose_config`); ``autotune=True`` tunes over
    ``CONFIGS`` on the GPU instead, keyed by the shape class. ``validate`` (default: the
    ``HYBRIDKV_VALIDATE`` switch) checks the lengths and, given ``num_blocks``, every block id
    the kernel will read (one sync; see the module's contract). ``sinks=True``: the layers
    have learnable per-head attention sinks (GPT-OSS, GraniteSWA: one more logit per head in
    each softmax's denominator, with no value), passed to each :meth:`~DecodePlan.run`.
    ``rel_dim``: the layers add a hidden-state-conditioned relative-position bias (Inkling):
    each :meth:`~DecodePlan.run` takes ``rel_states [B, Hq, rel_dim]`` and ``rel_proj
    [rel_dim, rel_extent]``, and key ``k`` of a query at position ``p`` gets
    ``rel_states[b, h] @ rel_proj[:, p - k]`` added to its scaled logit where
    ``p - k < rel_extent`` (nothing farther back).

    ``token_indices [B, K] int32`` (rows contiguous, on the tables' device) makes a sparse
    plan: request ``b`` attends only to the positions its row lists (-1 = padding, anywhere in
    the row; a top-k indexer's pick: Qwen4-Exp's QSA), gathered through its table row, and
    the splits cover the K entries instead of the context. The plan keeps the list
    (``plan.token_indices``) and every :meth:`~DecodePlan.run` takes one of the same K. A
    sparse plan takes no sliding window and no relative bias (no model combines them; the list
    is the only restriction); sinks combine with it. Contract (checked with ``validate``):
    each entry ``-1`` or in ``[0, seq_lens[b])``, distinct within a row, at least one a row.
    """
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError("block_tables must be an int32 [B, max_blocks] tensor")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    batch = block_tables.shape[0]
    if seq_lens.shape != (batch,):
        raise ValueError("block_tables and seq_lens must have one row per request")
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be int32/int64, got {seq_lens.dtype}")
    if seq_lens.device != block_tables.device:
        raise ValueError(
            f"seq_lens is on {seq_lens.device}, block_tables on {block_tables.device}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"Hq={num_heads} is not a multiple of Hkv={num_kv_heads}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 (or None to choose), got {num_splits}")
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(f"sliding_window must be None, 0 (off) or positive: {sliding_window}")
    if cache_dtype in _FP8 and q_dtype in _FP8:
        raise ValueError("q must be fp16/bf16/fp32")
    if autotune and _INTERPRETED:
        raise ValueError(
            "autotune=True needs a GPU: the Triton interpreter cannot time configs; leave it "
            "off (the table's config) or pass config="
        )
    if autotune and config is not None:
        raise ValueError("pass config= or autotune=True, not both")
    if rel_dim is not None and not 1 <= rel_dim <= 128:
        raise ValueError(
            f"rel_dim must be None (no relative bias) or 1..128 (rel_states' last dim), got "
            f"{rel_dim}"
        )
    device = block_tables.device
    num_indices = None
    if token_indices is not None:
        _check_indices_tensor(token_indices, batch, device)
        num_indices = token_indices.shape[1]
        if num_indices < 1:
            raise ValueError(
                "token_indices has no entries (K = 0): give each request at least one token, "
                "or plan without token_indices to attend to every cached token"
            )
        if sliding_window or rel_dim:
            raise ValueError(
                f"a sparse plan (token_indices) takes no sliding window or relative bias (got "
                f"sliding_window={sliding_window}, rel_dim={rel_dim}): the list alone says "
                f"which keys a query sees; plan them densely, or restrict the list itself"
            )
    check = _validate_enabled(validate)
    lens = None
    if batch and (max_seq_len is None or check):
        lens = _check_lengths(seq_lens, max_seq_len)
        if max_seq_len is None:
            max_seq_len = int(lens.max())
        if check:
            if num_blocks is None:
                raise ValueError("validate=True checks block ids: pass num_blocks (the cache's)")
            check_block_tables(block_tables, lens, num_blocks, block_size)
            if token_indices is not None:
                check_token_indices(token_indices, lens)
    max_seq_len = max_seq_len or 1
    needed = triton.cdiv(max_seq_len, block_size)
    if needed > block_tables.shape[1]:
        raise ValueError(
            f"block_tables has {block_tables.shape[1]} columns but seq_len {max_seq_len} needs "
            f"{needed} blocks"
        )
    group = num_heads // num_kv_heads
    shape = decode_shape(
        device=device,
        block_size=block_size,
        group=group,
        head_dim_k=head_dim,
        head_dim_v=head_dim_v,
        cache_dtype=cache_dtype,
        batch=batch,
        num_kv_heads=num_kv_heads,
        max_seq_len=max_seq_len,
        num_indices=num_indices,
    )
    if autotune:
        source = "autotune"
        config = choose_config(shape)[0]  # recorded only; the autotuner picks per launch
    elif config is None:
        config, source = choose_config(shape)
    else:
        if config not in CONFIGS:
            raise ValueError(f"{config} is not one of CONFIGS: {', '.join(map(str, CONFIGS))}")
        source = "given"
    walked = num_indices or max_seq_len  # sparse: the splits cover the list
    if num_splits is None:
        num_splits = choose_num_splits(
            batch, num_kv_heads, walked, _num_sms(device),
            per_sm=programs_per_sm(config, shape), one_wave=config.num_warps <= 2,
        )  # fmt: skip
    # each split covers a whole number of tiles of any config
    split_len = triton.cdiv(triton.cdiv(walked, num_splits), _MAX_BLOCK_N) * _MAX_BLOCK_N
    num_splits = triton.cdiv(walked, split_len)
    part_m = part_l = part_acc = None
    if num_splits > 1:
        f32 = dict(dtype=torch.float32, device=device)
        part_m = torch.empty((batch, num_heads, num_splits), **f32)
        part_l = torch.empty((batch, num_heads, num_splits), **f32)
        part_acc = torch.empty((batch, num_heads, num_splits, head_dim_v), **f32)
    cache_kind = shape.cache
    block_dv = max(16, triton.next_power_of_2(head_dim_v))
    block_s = max(2, triton.next_power_of_2(num_splits))
    reduce_dv = min(block_dv, 64)
    return DecodePlan(
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim_k=head_dim,
        head_dim_v=head_dim_v,
        block_size=block_size,
        cache_dtype=cache_dtype,
        q_dtype=q_dtype,
        scale=float(scale),
        sliding_window=sliding_window or 0,
        max_seq_len=max_seq_len,
        shape=shape,
        config=config,
        config_source=source,
        num_splits=num_splits,
        split_len=split_len,
        autotune=autotune,
        has_sinks=bool(sinks),
        rel_dim=rel_dim or 0,
        num_indices=num_indices,
        validate=check,
        block_tables=block_tables,
        seq_lens=seq_lens,
        token_indices=token_indices,
        _host_lens=lens if check else None,
        part_m=part_m,
        part_l=part_l,
        part_acc=part_acc,
        _constexprs=dict(
            GROUP=group,
            BLOCK_G=max(16, triton.next_power_of_2(group)),
            HEAD_DIM_K=head_dim,
            HEAD_DIM_V=head_dim_v,
            BLOCK_DK=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_DV=block_dv,
            PAGE_ALIGN=shape.page_align,
            FP8={"fp8": 1, "fp8-bytes": 2}.get(cache_kind, 0),
            ONE_SPLIT=num_splits == 1,
            Q_TO_F16=cache_kind.startswith("fp8") and q_dtype == torch.bfloat16,
            HAS_SINKS=bool(sinks),
            HAS_REL=bool(rel_dim),
            D_REL=rel_dim or 0,
            BLOCK_R=max(16, triton.next_power_of_2(rel_dim or 1)),
            SPARSE=num_indices is not None,
        ),
        _reduce_grid=(batch, num_heads, triton.cdiv(head_dim_v, reduce_dv)),
        _reduce_constexprs=dict(
            HEAD_DIM_V=head_dim_v,
            BLOCK_S=block_s,
            CHUNK_S=min(block_s, 16),
            BLOCK_DV=reduce_dv,
            HAS_SINKS=bool(sinks),
        ),
    )


def _check_shapes(q, k_cache, v_cache, block_tables, seq_lens) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    batch, _, dk = q.shape
    if k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError("k_cache and v_cache must be [num_blocks, block_size, Hkv, D] views")
    if k_cache.shape[3] != dk:
        raise ValueError(f"q head_dim {dk} != k_cache head_dim {k_cache.shape[3]}")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError("k_cache and v_cache disagree on blocks, block size or heads")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("the head_dim of q and of the caches must be contiguous")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError("block_tables must be [B, max_blocks] with one row per request")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")


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
    config: DecodeConfig | None = None,
    autotune: bool = False,
    sinks: torch.Tensor | None = None,
    rel_states: torch.Tensor | None = None,
    rel_proj: torch.Tensor | None = None,
    token_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per request over its paged K/V: :func:`plan_decode` and
    :meth:`DecodePlan.run` in one call (plan once and run per layer to save the host work).

    Shapes: ``q [B, Hq, Dk]``, caches ``[num_blocks, block_size, Hkv, D]`` (any strides but the
    last), ``block_tables [B, max_blocks] int32``, ``seq_lens [B] int32`` (>= 1; the query is the
    last token). Returns ``[B, Hq, Dv]`` in ``q``'s dtype. With ``max_seq_len`` (>= every
    seq_len) the call never syncs with the device; without it, it reads ``seq_lens`` back once.
    ``validate`` (default: the ``HYBRIDKV_VALIDATE`` environment switch) checks every block id
    and length the kernel will use (see the module's contract). ``out [B, Hq, Dv]`` (contiguous
    in Dv), if given, receives the result. fp8 caches need ``k_scale``/``v_scale`` (float32
    scalars). ``sinks [Hq] float32``: per-head attention-sink logits (none by default).
    ``rel_states [B, Hq, rel_dim]`` with ``rel_proj [rel_dim, rel_extent]`` (q's dtype): a
    relative-position bias (see :func:`plan_decode`; none by default). ``token_indices [B, K]
    int32``: each request attends only to the positions its row lists, -1 padded (a sparse
    plan, see :func:`plan_decode`; every cached token by default).
    """
    _check_shapes(q, k_cache, v_cache, block_tables, seq_lens)
    quant = k_cache.dtype in _FP8
    if quant and (k_scale is None or v_scale is None):
        raise ValueError("fp8 caches need k_scale and v_scale (float32 scalars)")
    plan = plan_decode(
        block_tables,
        seq_lens,
        num_heads=q.shape[1],
        num_kv_heads=k_cache.shape[2],
        head_dim=q.shape[2],
        head_dim_v=v_cache.shape[3],
        block_size=k_cache.shape[1],
        cache_dtype=k_cache.dtype,
        q_dtype=q.dtype,
        scale=scale,
        sliding_window=sliding_window,
        max_seq_len=max_seq_len,
        num_splits=num_splits,
        config=config,
        autotune=autotune,
        num_blocks=k_cache.shape[0],
        validate=validate,
        sinks=sinks is not None,
        rel_dim=None if rel_states is None else rel_states.shape[-1],
        token_indices=token_indices,
    )
    if quant:
        k_scale = k_scale.reshape(1).to(torch.float32)
        v_scale = v_scale.reshape(1).to(torch.float32)
    return plan.run(
        q, k_cache, v_cache, k_scale, v_scale, out=out, sinks=sinks, rel_states=rel_states,
        rel_proj=rel_proj, token_indices=token_indices,
    )  # fmt: skip


# ---- reference --------------------------------------------------------------------------------


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
    sinks: torch.Tensor | None = None,
    rel_states: torch.Tensor | None = None,
    rel_proj: torch.Tensor | None = None,
    token_indices: torch.Tensor | None = None,
    **_: object,
) -> torch.Tensor:
    """Plain torch: gather each request's visible K/V through its block table (keys below a
    sliding window are not read: their blocks may be freed), softmax in float32 (over the
    scores and, given ``sinks [Hq]``, one sink logit per head whose weight is dropped). Given
    ``rel_states [B, Hq, rel_dim]`` and ``rel_proj [rel_dim, rel_extent]``, each scaled score
    gets ``rel_states[b, h] @ rel_proj[:, distance]`` added in float32 (none from distance
    ``rel_extent`` on). Given ``token_indices [B, K]``, request ``b`` attends to the listed
    positions only (-1 entries skipped; a position listed twice counts twice)."""
    from einops import repeat

    out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[3], dtype=q.dtype, device=q.device)
    group = q.shape[1] // k_cache.shape[2]
    for b, n in enumerate(seq_lens.tolist()):
        if token_indices is not None:
            listed = token_indices[b].long()
            listed = listed[listed >= 0]
            blocks = block_tables[b].long()[listed // k_cache.shape[1]]
            k = k_cache[blocks, listed % k_cache.shape[1]].float()
            v = v_cache[blocks, listed % v_cache.shape[1]].float()
            if k_cache.dtype in _FP8 and k_scale is not None:
                k, v = k * k_scale.float(), v * v_scale.float()
            k = repeat(k, "n h d -> n (h g) d", g=group)
            v = repeat(v, "n h d -> n (h g) d", g=group)
            scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
            if sinks is not None:
                scores = torch.cat([scores, sinks.float()[:, None]], dim=1)
            weights = scores.softmax(-1)[:, : k.shape[0]]
            out[b] = torch.einsum("hn,nhd->hd", weights, v).to(q.dtype)
            continue
        first = max(0, n - sliding_window) if sliding_window else 0
        k = gather_kv_ref(k_cache, block_tables[b], n, k_scale, first)
        v = gather_kv_ref(v_cache, block_tables[b], n, v_scale, first)
        k = repeat(k, "n h d -> n (h g) d", g=group)
        v = repeat(v, "n h d -> n (h g) d", g=group)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        if rel_states is not None:
            dist = (n - 1) - torch.arange(first, n, device=q.device)
            scores = scores + _rel_bias_ref(rel_states[b, None], rel_proj, dist[None, :])[:, 0]
        if sinks is not None:
            scores = torch.cat([scores, sinks.float()[:, None]], dim=1)
        weights = scores.softmax(-1)[:, : k.shape[0]]
        out[b] = torch.einsum("hn,nhd->hd", weights, v).to(q.dtype)
    return out


def _rel_bias_ref(
    rel_states: torch.Tensor, rel_proj: torch.Tensor, dist: torch.Tensor
) -> torch.Tensor:
    """``[Hq, M, N]`` float32 bias of the query tokens' ``rel_states [M, Hq, rel_dim]`` at
    distances ``dist [M, N]`` (query position minus key position): ``rel_states @
    rel_proj[:, dist]`` where ``0 <= dist < rel_extent``, else zero (transformers'
    ``InklingRelativeLogits``)."""
    extent = rel_proj.shape[1]
    logits = (rel_states.float() @ rel_proj.float()).transpose(0, 1)  # [Hq, M, rel_extent]
    index = dist.clamp(0, extent - 1).expand(logits.shape[0], -1, -1)
    return logits.gather(-1, index).masked_fill((dist < 0) | (dist >= extent), 0.0)
