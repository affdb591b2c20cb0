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

Plan once per step, run once per layer (FlashInfer's split): :func:`plan_mla_decode` takes the
step's block tables, lengths and shapes and makes every host decision (heads per program,
config, split count, grid, partial buffers, the fp8 path); :meth:`MlaDecodePlan.run` then
launches with one layer's queries and latent cache and does no allocation (given ``out``), no
environment read and no device sync, so it can be captured in a CUDA graph.
:func:`mla_decode_attention` is plan + run in one call.

- Heads: the heads of a request share a program (``BLOCK_H`` = their count rounded up to a
  power of two, at least 16 for ``tl.dot``), so each latent byte is read once per request, up
  to a limit set by registers: the float32 accumulator ``[BLOCK_H, 512]`` is 128 registers a
  thread at 32 heads and 4 warps, or 64 heads and 8 warps (16 warps cap a thread at 128
  registers and spill; 128 heads would need the whole register file). Measured with ptxas
  (``heads_per_program``, :func:`config_fits`): 64 heads fit only on sm_90 with 16-bit caches,
  where wgmma reads q and the latent tile from shared memory; mma.sync (sm_80, and sm_90 below
  64 rows) needs each warp to hold its rows of q as a 512-deep operand and spills at 64 heads;
  fp8 tiles are converted in registers and spill at 64 heads on sm_90 too. So 32 heads a
  program on sm_80 and for fp8, 64 on sm_90: Kimi-Linear (32 heads at TP1) reads its cache once
  per request everywhere; DeepSeek's 128 heads take 2 (H100) or 4 programs per tile, adjacent in
  the launch order (the head group varies fastest), so they run together and all but the first
  read the tile from L2, not HBM (FlashMLA splits the same way: 64 heads per CTA).
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
- Sparse (top-k) decode: with ``token_indices [B, K] int32`` (DeepSeek-V3.2's and GLM-5-Next's
  indexer: each query attends to its top-k cached tokens, k = 2048 of a long context) the
  program walks the request's index list instead of the positions ``0 .. seq_len - 1``
  (``SPARSE``, a constexpr: the dense walk compiles as before). Per tile of ``BLOCK_N``
  entries it loads the entries, maps each to its block id (the request's table row) and slot
  (int64 row offsets), gathers the latent and rope rows, masks padding (-1), and runs the
  same online softmax; the entries and block ids of the next tile are loaded a tile ahead.
  Splits cover the K entries (a split or a tile of padding alone weighs nothing), the reduce
  is the dense one. Every gathered row has its own address, as on pages of one token, so a
  sparse launch's shape class has ``page_align`` 1: at most 32 heads a program (at 64 the
  gather spills even at 16/8/3, 52 B on sm_90; DeepSeek-V3.2's 128 heads take 4 programs a
  request, adjacent, reading the rows from L2 after the first) and its own rows in
  :func:`config_fits` and ``_TABLE`` (the compile check, k = 2048). The read is K rows of
  ``(Dc + Dr)`` elements a request and head group instead of ``seq_len`` rows: DeepSeek-V3.2
  in bf16, k = 2048, reads 2.4 MB a request at any context (a 128k context: 151 MB).
- fp8 caches: the latent is multiplied in fp16/bf16 as stored (the per-tensor scale is folded
  into the scores and applied to the accumulator once at the end). GPUs without hardware e4m3
  (sm_80, A100) get the cache's bytes and decode them in the kernel (exactly).

Configs come from a table (``_TABLE``: the H200 sweep of 2026-11-26 where it measured the
shape, each row with its source), keyed by the launch's shape class (:class:`MlaShape`: arch,
heads per program, latent dims, cache dtype, page segment, batch x head-group and context
buckets), so a first call compiles one config and never stalls on tuning.
``plan_mla_decode(autotune=True)`` tunes over ``CONFIGS`` instead, keyed by the same buckets (a
GPU only).

Why the configs are what they are (H200, Kimi-Linear, 32 heads, bf16, ctx 32k): the old
autotuner's configs (8 warps, 16- and 32-token tiles) ran at 34-39% of copy bandwidth, the best
forced config ``BLOCK_N=64, num_warps=4, num_stages=2`` at 60-75%. The compile check explains
the gap. With 8 warps a 16-token score tile ``[32, 16]`` has four ``m16n8`` MMA tiles for eight
warps, so warps repeat each other's MMAs (44 HMMA a token; 17 at 64-token tiles, the minimum
for 32 x 576 + 32 x 512 multiply-adds a token), and every warp reads all of ``q`` (36 KB) from
shared memory for every tile: for 64 tokens (74 KB of latent) 1.2 MB of ``q`` reads at
16-token tiles and 8 warps, 0.15 MB at 64-token tiles and 4 warps, so the small tiles are
bound by shared memory and the tensor cores, not by HBM. And at 32 heads every config takes
156-255 registers a thread, so 8 warps leave room for one CTA a multiprocessor and 4 warps for
two (115 KB of shared memory each fit twice on sm_90): the second CTA's copies overlap the
first's math.
64/4/2 has both, but it is at the register ceiling: 128 registers hold the accumulator, the
dots' tile operands are read from shared memory as whole tensors (a 64-token tile at 4 warps
reaches 255 registers even beside the 64-register accumulator of 16 heads), and the 36 row
offsets of its copies are loop invariants, so ptxas spills them (sm_90: 292 B, reloaded every
tile from L1; sm_80: 52 B outside the loop), which cost less than the second CTA gained. Neither a
compile-time token stride, nor unmasked whole tiles with the last tile peeled off, nor column
chunks of the tile, nor TMA copies (which pipeline, but then read the swizzled tile transposed
through registers) made it fit (triton 3.9). The table therefore takes the same 64-token tile
at 8 warps on sm_90 (no spills, one CTA a multiprocessor) with a third stage, so that two tiles
stay in flight a multiprocessor as with two CTAs of 64/4/2; see ``_TABLE`` for every row and
what a GPU run must confirm.

Contract (checked only with ``validate=True`` or ``HYBRIDKV_VALIDATE=1``, because checking device
data costs a host sync): ``1 <= seq_lens[b] <= max_seq_len`` (when given); every block id a
request uses (columns ``< cdiv(seq_lens[b], block_size)``) is in ``[0, num_blocks)``; columns
past that are never read and may hold anything (-1 included). Shapes, dtypes, strides and
``num_splits >= 1`` are always checked on the host. Outside the contract the kernel reads other
memory (the next layer's page for a block id equal to ``num_blocks``, bytes before the cache for
-1) or drops tokens (``max_seq_len`` too small).

Sparse contract (the same switch checks it, on the plan's list and on every run's): each entry
of ``token_indices[b]`` is ``-1`` (padding, anywhere in the row) or an absolute position in
``[0, seq_lens[b])``; a row's positions are distinct (a top-k's are; a duplicate would be
weighed twice) and every row lists at least one. Rows are contiguous, K is any length >= 1.
Outside it: entries below 0 or at or past ``seq_len`` are skipped (the kernel masks them, so
they read nothing, but the softmax silently drops them), a row of padding alone gives NaN,
and duplicates are counted twice (the reference counts them as listed, too).

Hopper: at 64 heads the scores ``[64, BLOCK_N]`` and the output update ``[64, 512]`` are what
wgmma takes (64 rows a warpgroup), and Triton emits wgmma on sm_90 with q and the latent tile
read from shared memory; the 8 warps split the 512-wide accumulator over two warpgroups that
share the tile, as FlashMLA does. Below 64 heads (Kimi-Linear's 32) Triton emits mma.sync,
unless ``plan_mla_decode(heads_per_program=64)`` pads the rows to a warpgroup's 64 (FlashMLA
pads the same way): compiled for sm_90 (Triton 3.9) that is 73 wgmma in the loop of a 16-token
tile at 8 warps (the only config the fit rule keeps at 64 rows), 255 registers, no spill,
128 KB of shared memory, against 88 mma.sync at 32 rows. Not measured yet: the GPU suite's MLA
sweep tries it (``paper.bench_kernels``), and the table takes it only if it wins there.
Not done: TMA for the latent tiles (each segment is a 2-D box ``[SEG, latent]`` at a
page-computed address: a host-side descriptor over the cache view takes the address math and
the per-thread copies off the SMs and Triton pipelines it, but the score dot then reads the
swizzled tile transposed through registers and spilled more, see above);
fp8 wgmma on the stored bytes (would let fp8 caches keep 64 heads a program and skip the
conversion, but needs q in fp8 too, which costs accuracy); a warp-specialised producer (TMA)
and consumers (wgmma) with 64-token tiles, which Triton's ``warp_specialize`` may reach.

Standalone: imports only torch and triton, so the file can be copied into another project.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

# ---- configs and the default table ------------------------------------------------------------


@dataclass(frozen=True)
class MlaConfig:
    """One compile-time choice of the partial kernel."""

    block_n: int  # tokens per tile, a power of two >= 16
    num_warps: int
    num_stages: int  # software pipelining: num_stages - 1 tiles in flight (num_stages, wgmma)

    def __str__(self) -> str:
        return f"BLOCK_N={self.block_n},num_warps={self.num_warps},num_stages={self.num_stages}"


#: what autotuning tries (``plan_mla_decode(autotune=True)``) and the compile check compiles
#: (those that fit the launch); every config of ``_TABLE`` is one of them. The kernel reads
#: only the cache and writes the partial buffers or the output, so tuning in place is safe.
#: 64/4/2, the H200's best at 32 heads, spills there (see ``config_fits``) and is never picked
#: for 32 heads; it stays so that a sweep can force it (``config=``) against the table.
CONFIGS: tuple[MlaConfig, ...] = (
    MlaConfig(64, 8, 3),
    MlaConfig(64, 8, 2),
    MlaConfig(32, 8, 2),
    MlaConfig(16, 8, 3),
    MlaConfig(32, 4, 2),
    MlaConfig(32, 4, 3),
    MlaConfig(16, 4, 3),
    MlaConfig(64, 4, 2),
)
#: split lengths are multiples of this, so the tiles of every config fit whole in a split
_MAX_BLOCK_N = max(c.block_n for c in CONFIGS)


@dataclass(frozen=True)
class MlaShape:
    """The shape class a launch's config is chosen by (and autotuning is keyed by)."""

    arch: int  # compute capability as 80, 90, ...; the interpreter counts as 80
    block_h: int  # heads a program (heads_per_program): 16, 32 or 64
    block_dc: int  # kv_lora_rank padded to a power of two
    block_dr: int  # qk_rope_head_dim padded to a power of two
    cache: str  # "16bit" | "fp32" | "fp8" (converted in hardware) | "fp8-bytes" (in software)
    q_bytes: int  # bytes of a query element: the dots' operand size (2, or 4 for fp32)
    page_align: int  # largest power of two dividing block_size, capped at _MAX_BLOCK_N
    work: int  # batch * head groups, rounded up to a power of two
    context: int  # max_seq_len (sparse: the index list's length), rounded up to a power of two
    sparse: bool = False  # walks a token-index list (then page_align is 1: rows are gathered)
    rope: bool = True  # False: a NoPE MLA (GLM-5-Next: qk_rope_head_dim 0), no k_pe dot

    @property
    def fp8(self) -> bool:
        return self.cache.startswith("fp8")

    @property
    def wgmma(self) -> bool:
        """Whether Triton emits wgmma: sm_90 and a full warpgroup of rows (64 heads)."""
        return self.arch >= 90 and self.block_h >= 64


@dataclass(frozen=True)
class MlaRule:
    """One row of the default table: the first row whose ranges (inclusive) all hold for a
    launch's :class:`MlaShape` gives its config; ``source`` says where the row comes from."""

    config: MlaConfig
    source: str
    arch: tuple[int, int] = (0, 1000)
    block_h: tuple[int, int] = (1, 1024)
    caches: tuple[str, ...] = ("16bit", "fp32", "fp8", "fp8-bytes")
    page_align: tuple[int, int] = (1, 1 << 20)
    work: tuple[int, int] = (1, 1 << 40)
    sparse: bool | None = None  # None: dense and sparse launches alike

    def matches(self, shape: MlaShape) -> bool:
        return (
            (self.sparse is None or self.sparse == shape.sparse)
            and self.arch[0] <= shape.arch <= self.arch[1]
            and self.block_h[0] <= shape.block_h <= self.block_h[1]
            and shape.cache in self.caches
            and self.page_align[0] <= shape.page_align <= self.page_align[1]
            and self.work[0] <= shape.work <= self.work[1]
        )


_H200 = (
    "H200 sweep 2026-11-26 (paper/results/kernels-before-h200-2026-11-26.md), % of copy bandwidth"
)
_CC = "compile check: python -m paper.compile_kernels (triton 3.9), latent 512+64"
#: the default configs, first match wins. Measured rows name the shape they were measured on;
#: the others are marked unmeasured and say what they are inferred from (the GPU suite sweeps
#: them: ``python -m paper.gpu_suite``).
_TABLE: tuple[MlaRule, ...] = (
    # sparse (token-index list) launches first: their gathered rows compile differently
    MlaRule(
        MlaConfig(64, 8, 3),
        "unmeasured: the sparse walk at 32 heads on sm_90, the dense sm_90 row's config: "
        f"64-token tiles at 8 warps gather without spills ({_CC}, k = 2048: 192 registers), "
        "4 warps spill (32-token tiles 244-252 B stored and loaded, 64-token 464 B)",
        arch=(90, 1000),
        block_h=(32, 32),
        caches=("16bit",),
        sparse=True,
    ),
    MlaRule(
        MlaConfig(64, 8, 2),
        "unmeasured: the sparse walk at 32 heads on sm_80, where the dense row's 32/4/2 "
        f"spills when gathering ({_CC}, k = 2048: 112 B); 64/8/2 does not (192 registers) "
        "and does the fewest MMAs and q reads a token",
        block_h=(32, 32),
        caches=("16bit",),
        sparse=True,
    ),
    MlaRule(
        MlaConfig(32, 4, 2),
        "unmeasured: the sparse walk at 16 heads, as the dense 16-head rows: 32-token tiles "
        f"at 4 warps gather without spills ({_CC}, k = 2048: 190-192 registers)",
        block_h=(16, 16),
        caches=("16bit",),
        sparse=True,
    ),
    MlaRule(
        MlaConfig(64, 8, 3),
        f"unmeasured: inferred from the {_H200}: Kimi-Linear (32 heads, latent 512+64, bf16, "
        "64-token pages) ctx 32k measured best at BLOCK_N=64, num_warps=4, num_stages=2 (75.1% "
        "at B=64, 59.8% at B=8; the old 8-warp 16/32-token configs 34-39%), but 64/4/2 spills "
        f"({_CC}: sm_90 292 B, its per-row copy offsets reloaded every tile; sm_80 52 B), and "
        "so do 32-token tiles at 4 warps on sm_90 (16 B). The nearest that does not: the same "
        "64-token tile (fewest MMAs and q reads a token) at 8 warps (255 registers, one CTA a "
        "multiprocessor), with a third stage so that two tiles (147 KB) stay in flight a "
        "multiprocessor as with two CTAs of 64/4/2 (188 KB of shared memory: sm_90 only)",
        arch=(90, 1000),
        block_h=(32, 32),
        caches=("16bit",),
        page_align=(64, 1 << 20),
    ),
    MlaRule(
        MlaConfig(32, 4, 3),
        "unmeasured: 16 heads a program (Kimi-Linear at TP2 and more) on sm_90; the 64-token "
        f"tile spills at 4 warps even beside a 64-register accumulator ({_CC}: 128 B), 32/4/3 "
        "does not and keeps two 32-token tiles in flight in each of two CTAs a multiprocessor",
        arch=(90, 1000),
        block_h=(16, 16),
        caches=("16bit",),
        page_align=(32, 1 << 20),
    ),
    MlaRule(
        MlaConfig(32, 4, 2),
        "unmeasured: sm_80 at 32 heads, one segment a tile; 64/4/2 spills and its 115 KB of "
        "shared memory leave an A100 (164 KB a multiprocessor) one CTA; 32/4/2 (76 KB, "
        f"no spills: {_CC}) leaves two, as 64/4/2 had on the H200",
        arch=(0, 89),
        block_h=(32, 32),
        caches=("16bit",),
        page_align=(32, 1 << 20),
    ),
    MlaRule(
        MlaConfig(32, 4, 2),
        "unmeasured: 16 heads a program elsewhere (sm_80, or 16-token pages): 32-token tiles at "
        f"4 warps take 165-177 registers and do not spill ({_CC}), where 8 warps with 64-token "
        "tiles of 16-token pages do",
        block_h=(16, 16),
        caches=("16bit",),
        page_align=(16, 1 << 20),
    ),
    MlaRule(
        MlaConfig(64, 8, 2),
        "unmeasured: 32 heads on pages of 16 tokens or other multiples of 16 that are not of "
        "32 (several segments a tile, whose addresses take registers: 32-token tiles at 4 "
        f"warps spill on both archs with 16-token pages, {_CC}); the 64-token tile at 8 warps "
        "does not",
        block_h=(32, 32),
        caches=("16bit",),
        page_align=(16, 1 << 20),
    ),
    MlaRule(
        MlaConfig(16, 8, 3),
        "unmeasured: 64 heads a program (wgmma, sm_90), where the [64, 512] accumulator leaves "
        f"room only for 16-token tiles at 8 warps ({_CC}); the old autotuner's only candidate",
        block_h=(64, 64),
        caches=("16bit",),
    ),
    MlaRule(
        MlaConfig(32, 8, 2),
        "unmeasured: fp8 caches, prefetched and converted in registers, spill at 4 warps and "
        f"with 64-token tiles ({_CC}); 32/8/2 does not, and does half the q reads a token of "
        "16-token tiles",
        block_h=(16, 32),
        caches=("fp8", "fp8-bytes"),
    ),
)

#: shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin): sm_80 163 KiB, sm_90 227
_SHARED_BYTES = {8: 166912, 9: 232448}
#: shared memory per multiprocessor and what each resident CTA reserves of it (1 KiB)
_SM_SHARED_BYTES = {8: 167936, 9: 233472}
_CTA_RESERVED_SHARED = 1024
#: registers per multiprocessor (every arch the configs are checked for)
_SM_REGISTERS = 65536


def shared_bytes(config: MlaConfig, shape: MlaShape) -> int:
    """Shared memory of one CTA (the compile check's ``metadata.shared`` for 16-bit caches):
    q, the latent tiles in flight (wgmma keeps ``num_stages`` of them, mma.sync
    ``num_stages - 1``) or for fp8 the converted tile, and the probabilities staged for the
    second dot."""
    width = shape.block_dc + shape.block_dr
    q = shape.block_h * width * shape.q_bytes
    if shape.fp8:  # prefetched in registers, converted, staged once for the dots
        return q + config.block_n * width * shape.q_bytes
    item = 4 if shape.cache == "fp32" else 2
    buffers = config.num_stages if shape.wgmma else config.num_stages - 1
    return q + buffers * config.block_n * width * item + shape.block_h * config.block_n * item


def config_fits(config: MlaConfig, shape: MlaShape) -> bool:
    """Whether ``config`` compiles for ``shape`` within the block's shared memory and without
    spills: the rule below reproduces ``python -m paper.compile_kernels`` (triton 3.9, ptxas of
    sm_80 / sm_90) at the latent 512 + 64 for 16, 32 and 64 heads a program, 16-bit and fp8
    caches, 16- and 64-token pages; the test suite checks the table against it. In registers
    a thread: ``acc`` for the float32 accumulator ``[BLOCK_H, Dc]``, ``vecs`` for the 16-byte
    pieces of a tile each thread copies (its row offsets stay in registers, and Triton loads a
    dot's whole operand before the MMAs):

    - ``acc`` 128 (32 heads at 4 warps): 16-token tiles; 32-token tiles on sm_80 with a
      tile in one page and a rope part (sm_90 spills 16 B, with 16-token pages both spill, a
      NoPE MLA spills 4-48 B on sm_80); 64-token tiles
      spill (64/4/2: 52 B on sm_80, 292 B on sm_90, reloaded every tile).
    - ``acc`` <= 64: up to 32-token tiles at 4 warps, 64-token tiles at 8 warps (64/4/2
      spills even at 16 heads).
    - 64 heads need 8 warps and wgmma (sm_90, 16-bit caches), which reads q and the tile from
      shared memory, and only 16-token tiles fit beside the accumulator.
    - fp8 tiles are prefetched and converted in registers: ``acc`` <= 64 and ``vecs`` <= 9
      (32 heads: 8 warps and up to 32-token tiles).
    - Tiles of more than 4 page segments (pages not a multiple of 16): ``vecs`` <= 9, as in
      the decode kernel. At 16 heads, 8 warps and 64-token tiles of several segments (16-token
      pages) spill: ptxas keeps them at 128 registers (16-24 B).
    - Sparse launches (an index list: one int64 offset a gathered row, ``page_align`` 1),
      16-bit caches, 16 and 32 heads: ``vecs`` <= 9 beside a 128-register accumulator (32
      heads at 4 warps: 16-token tiles), else ``vecs`` <= 18 (64-token tiles at 8 warps; at
      16 heads 32-token tiles at 4 warps too). fp8 sparse launches follow the fp8 rule.
    """
    if shared_bytes(config, shape) > _SHARED_BYTES.get(shape.arch // 10, _SHARED_BYTES[8]):
        return False
    threads = 32 * config.num_warps
    acc = shape.block_h * shape.block_dc // threads
    vecs = config.block_n * (shape.block_dc + shape.block_dr) // (8 * threads)
    segments = config.block_n // min(config.block_n, shape.page_align)
    if acc > 128:
        return False
    if shape.block_h > 32:
        return shape.wgmma and not shape.fp8 and config.num_warps == 8 and config.block_n == 16
    if shape.fp8:
        return acc <= 64 and vecs <= 9
    if shape.sparse:
        return vecs <= (9 if acc > 64 else 18)
    if segments > 4 and vecs > 9:
        return False
    if config.num_warps >= 8 and acc <= 32 and segments > 1 and vecs > 9:
        return False  # ptxas keeps these at 128 registers (two CTAs) and spills (16 heads)
    if acc > 64:
        # sm_80's exception holds with a rope part only: a NoPE MLA's 32-token tiles at 4
        # warps spill there (GLM-5-Next, 32 heads a program: 4-48 B)
        one_page_sm80 = shape.arch < 90 and segments == 1 and shape.rope
        return vecs <= 9 or (vecs <= 18 and one_page_sm80)
    return vecs <= 18


def one_split_fits(config: MlaConfig, shape: MlaShape) -> bool:
    """Whether the one-split epilogue (normalise and write the output, no partials and no
    reduce) compiles without spills for a config that fits (the compile check at latent
    512 + 64 with ``num_splits=1``): not beside 64 heads' accumulator (wgmma), not at 32 heads
    with 32-token tiles at 4 warps (sm_80: 16 B), not at 16 heads with 8 warps on sm_90, where
    ptxas stops at 128 registers (32/8/2: 16 B). Elsewhere such plans keep the reduce kernel:
    its partials are one row a request and head, little next to a one-split request's tokens.
    Sparse launches: every config that fits (16 and 32 heads, 16-bit and fp8) compiled
    without spills with the epilogue too (k = 2048)."""
    if shape.sparse:
        return shape.block_h <= 32
    threads = 32 * config.num_warps
    acc = shape.block_h * shape.block_dc // threads
    vecs = config.block_n * (shape.block_dc + shape.block_dr) // (8 * threads)
    if shape.block_h > 32 or (acc > 64 and vecs > 9):
        return False
    return not (shape.arch >= 90 and config.num_warps == 8 and acc < 64 and vecs == 9)


def choose_config(shape: MlaShape) -> tuple[MlaConfig, str]:
    """The default config of a shape class and where it comes from (a ``_TABLE`` row, or the
    first config of ``CONFIGS`` that fits when no row's config fits this shape)."""
    for rule in _TABLE:
        if rule.matches(shape) and config_fits(rule.config, shape):
            return rule.config, rule.source
    for config in CONFIGS:
        if config_fits(config, shape):
            return config, "no table row: the first config that fits"
    raise ValueError(f"no MLA decode config fits {shape}")


def ctas_per_sm(config: MlaConfig, shape: MlaShape) -> int:
    """CTAs of ``config`` one multiprocessor holds at once, by registers and shared memory.
    Every config that fits takes 156-255 registers a thread at 32 heads in the compile check
    (16 heads: 128-168), so 255 is assumed: 8 warps leave room for one CTA, 4 warps for two."""
    by_registers = _SM_REGISTERS // (config.num_warps * 32 * 256)
    per_cta = shared_bytes(config, shape) + _CTA_RESERVED_SHARED
    by_shared = _SM_SHARED_BYTES.get(shape.arch // 10, _SM_SHARED_BYTES[8]) // per_cta
    return max(1, min(by_registers, by_shared))


#: fewest tokens a split is worth
_MIN_SPLIT_TOKENS = 256
#: most splits (the reduce reads them all)
_MAX_SPLITS = 64
#: a split's partial (BLOCK_H x Dc float32, written once and read back once by the reduce)
#: may cost at most this share of the latent bytes the split reads
_MAX_PARTIAL_SHARE = 0.25


def choose_num_splits(
    batch: int,
    num_head_blocks: int,
    max_seq_len: int,
    num_sms: int = 132,
    ctas_per_sm: int = 1,
    partial_tokens: int = _MIN_SPLIT_TOKENS,
) -> int:
    """Split the context when ``batch * num_head_blocks`` programs cannot fill the GPU: as many
    splits as one wave of resident CTAs holds (``num_sms * ctas_per_sm`` programs), at least
    ``partial_tokens`` tokens a split (the partial-traffic bound, at least
    ``_MIN_SPLIT_TOKENS``), at most ``_MAX_SPLITS``.

    Measured (H200, 32 heads, B=8, ctx 32k): the old 8-warp configs (one CTA a
    multiprocessor) ran best at 16 splits (36%; 32 splits: 34%): 132 // 8 = 16 here, and the
    table's sm_90 config (64/8/3) holds one CTA too. A two-CTA config (64/4/2) gets
    264 // 8 = 33, i.e. 32 splits of 1024 tokens, the split count its 59.8% was measured at
    (and 4 at B=64, its 75.1%).
    """
    slots = num_sms * ctas_per_sm
    by_parallelism = slots // max(1, batch * num_head_blocks)
    by_length = max_seq_len // max(_MIN_SPLIT_TOKENS, partial_tokens)
    return max(1, min(by_parallelism, by_length, _MAX_SPLITS))


def partial_tokens(shape: MlaShape, dim_c: int, dim_r: int, cache_bytes: int) -> int:
    """Fewest tokens a split must read so that its partial (``BLOCK_H x Dc`` float32, written
    and read back) costs at most ``_MAX_PARTIAL_SHARE`` of their latent bytes (32 heads, bf16,
    latent 512+64: 456 tokens)."""
    partial = 2 * shape.block_h * dim_c * 4
    per_token = (dim_c + dim_r) * cache_bytes
    return -(-int(partial / _MAX_PARTIAL_SHARE) // per_token)


# ---- kernels ----------------------------------------------------------------------------------


# num_splits is not specialised: a plan of one split with the reduce (see one_split_fits) runs
# the binary of many splits (specialised to 1, 32/4/2 spilled 16 B on sm_80)
@triton.jit(do_not_specialize=["num_splits", "tune_work", "tune_context"])
def _mla_partial_kernel(
    q_nope_ptr,  # [B, H, Dc]
    q_pe_ptr,  # [B, H, Dr]
    cache_ptr,  # [num_blocks, block_size, Dc + Dr], strided (uint8 bytes when FP8 == 2)
    table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32/int64
    idx_ptr,  # [B, K] int32 token positions, -1 = padding (read only when SPARSE)
    scale_ptr,  # [1] float32 (read only when FP8)
    part_m_ptr,  # [B, H, S] float32, log2 units (unused when ONE_SPLIT)
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
    stride_idx_b,  # (read only when SPARSE)
    num_indices,  # K: the index list's length (read only when SPARSE)
    stride_c_block,
    stride_c_token,
    stride_out_b,
    stride_out_h,
    tune_work,  # batch x head-group bucket: read only by autotuning's key
    tune_context,  # context bucket: likewise
    DIM_C: tl.constexpr,
    DIM_R: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program, a power of two >= 16
    PAGE_ALIGN: tl.constexpr,  # largest power of two dividing block_size (capped)
    FP8: tl.constexpr,  # 0: no fp8; 1: fp8 cache converted in hardware; 2: e4m3 bytes
    ONE_SPLIT: tl.constexpr,  # num_splits == 1: normalise and write out directly
    SPARSE: tl.constexpr,  # walk the index list idx_ptr instead of the positions 0..seq_len-1
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
    if SPARSE:  # splits cover the index list
        end = tl.minimum(start + split_len, num_indices)
    else:
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
    # a NoPE MLA (GLM-5-Next: DIM_R 0) has no rope part: no q_pe and no k_pe dot; its k_pe
    # tiles are loads masked off entirely (m_dr is all False), read nothing and are never used
    if DIM_R > 0:
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

    if SPARSE:
        # per tile of BLOCK_N list entries: the entries, then each one's block id through the
        # request's table row and its slot in the page (int64 rows), loaded a tile ahead so
        # that no latent gather waits on an index or table load of its own iteration
        p_table = table_ptr + i_b64 * stride_table_b
        p_idx = idx_ptr + i_b64 * stride_idx_b
        rows, valid = _index_rows(
            p_idx, p_table, start, end, seq_len, block_size, stride_c_block, stride_c_token,
            BLOCK_N,
        )  # fmt: skip
        if FP8 > 0:  # prefetched by hand one tile ahead, as in the dense walk
            c_next, pe_next = _gather_rows(
                cache_ptr, rows, valid, offs_dc, offs_dr, m_dc, m_dr, DIM_C, DIM_R, BLOCK_DC,
                BLOCK_DR,
            )  # fmt: skip
            v_next = valid
            rows, valid = _index_rows(
                p_idx, p_table, start + BLOCK_N, end, seq_len, block_size, stride_c_block,
                stride_c_token, BLOCK_N,
            )  # fmt: skip
        for tile in range(start, end, BLOCK_N):
            if FP8 > 0:
                c, k_pe, m_n = c_next, pe_next, v_next
                c_next, pe_next = _gather_rows(
                    cache_ptr, rows, valid, offs_dc, offs_dr, m_dc, m_dr, DIM_C, DIM_R,
                    BLOCK_DC, BLOCK_DR,
                )  # fmt: skip
                v_next = valid
                next_ids = tile + 2 * BLOCK_N
            else:
                c, k_pe = _gather_rows(
                    cache_ptr, rows, valid, offs_dc, offs_dr, m_dc, m_dr, DIM_C, DIM_R,
                    BLOCK_DC, BLOCK_DR,
                )  # fmt: skip
                m_n = valid
                next_ids = tile + BLOCK_N
            rows, valid = _index_rows(
                p_idx, p_table, next_ids, end, seq_len, block_size, stride_c_block,
                stride_c_token, BLOCK_N,
            )  # fmt: skip
            c_t = _to_dot_dtype(tl.trans(c), q_nope.dtype, FP8)
            if DIM_R > 0:
                s = tl.dot(q_pe, _to_dot_dtype(tl.trans(k_pe), q_nope.dtype, FP8))
                s = tl.dot(q_nope, c_t, s)  # [BLOCK_H, BLOCK_N]
            else:
                s = tl.dot(q_nope, c_t)
            s = tl.where(m_n[None, :], s * qk_scale, float("-inf"))
            # a tile (or a whole split) may be all padding: keep m = -inf and weight 0
            # instead of exp2(-inf - -inf) = NaN
            m_new = tl.maximum(b_m, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(b_m - m_use)
            p = tl.exp2(s - m_use[:, None])
            b_l = b_l * alpha + tl.sum(p, axis=1)
            c = _to_dot_dtype(c, q_nope.dtype, FP8)
            b_acc = tl.dot(p.to(q_nope.dtype), c, b_acc * alpha[:, None])
            b_m = m_new
    else:
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
                cache_ptr, p_table, seg_block, start, end, block_size, stride_c_block,
                stride_c_token, offs_pages, offs_c_row, offs_pe_row, m_dc, m_dr,
                DIM_C, DIM_R, BLOCK_DC, BLOCK_DR, BLOCK_N, PAGES, SEG,
            )  # fmt: skip
            seg_block = _tile_ids(p_table, start + BLOCK_N, end, block_size, offs_pages, PAGES)
        for tile in range(start, end, BLOCK_N):
            if FP8 > 0:
                c, k_pe = c_next, pe_next
                c_next, pe_next = _load_tile(
                    cache_ptr, p_table, seg_block, tile + BLOCK_N, end, block_size, stride_c_block,
                    stride_c_token, offs_pages, offs_c_row, offs_pe_row, m_dc, m_dr,
                    DIM_C, DIM_R, BLOCK_DC, BLOCK_DR, BLOCK_N, PAGES, SEG,
                )  # fmt: skip
                next_ids = tile + 2 * BLOCK_N
            else:
                c, k_pe = _load_tile(
                    cache_ptr, p_table, seg_block, tile, end, block_size, stride_c_block,
                    stride_c_token, offs_pages, offs_c_row, offs_pe_row, m_dc, m_dr,
                    DIM_C, DIM_R, BLOCK_DC, BLOCK_DR, BLOCK_N, PAGES, SEG,
                )  # fmt: skip
                next_ids = tile + BLOCK_N
            seg_block = _tile_ids(p_table, next_ids, end, block_size, offs_pages, PAGES)
            m_n = tile + tl.arange(0, BLOCK_N) < end
            # each dot converts its own view of the tile (a 16-bit tile is read from one
            # shared-memory buffer by both)
            c_t = _to_dot_dtype(tl.trans(c), q_nope.dtype, FP8)
            if DIM_R > 0:
                s = tl.dot(q_pe, _to_dot_dtype(tl.trans(k_pe), q_nope.dtype, FP8))
                s = tl.dot(q_nope, c_t, s)  # [BLOCK_H, BLOCK_N]
            else:
                s = tl.dot(q_nope, c_t)
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
        # an empty split (start >= seq_len, or only padding entries) stores m = -inf,
        # l = 0, acc = 0: weight 0
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
    """The block id of the one-page tile starting at token ``tile`` (0 past ``end``), loaded
    an iteration ahead (a scalar keeps the base's divisibility visible, so the loads
    vectorise); a tile of several pages loads its ids per row in ``_load_tile`` instead."""
    if PAGES == 1:
        return tl.load(p_table + tile // block_size, mask=tile < end, other=0)
    else:
        return 0


@triton.jit
def _load_tile(
    cache_ptr,
    p_table,  # the request's block table row
    seg_block,  # a one-page tile's block id from _tile_ids
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
        # one id per row, loaded here: Triton's pipeliner (3.6 as well as 3.9) schedules the
        # table load stages ahead of the latent loads it feeds, where it leaves ids spread
        # from a per-page vector unpipelined in 3.6
        pos = tile + tl.arange(0, BLOCK_N)
        row_block = tl.load(p_table + pos // block_size, mask=pos < end, other=0)
        # each row's segment start: offs_*_row add the row's offset inside its segment
        rows = (
            row_block.to(tl.int64) * stride_c_block
            + (pos // SEG * SEG % block_size).to(tl.int64) * stride_c_token
        )
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
def _index_rows(
    p_idx,  # the request's index list row
    p_table,  # the request's block table row
    tile,  # first list entry of the tile
    end,
    seq_len,
    block_size,
    stride_c_block,
    stride_c_token,
    BLOCK_N: tl.constexpr,
):
    """The cache offsets (int64) of list entries ``tile .. tile + BLOCK_N - 1`` and which of
    them are tokens: entries at or past ``end``, padding (-1, any negative) and positions at
    or past ``seq_len`` (outside the contract) are not, and read nothing."""
    offs = tile + tl.arange(0, BLOCK_N)
    idx = tl.load(p_idx + offs, mask=offs < end, other=-1)
    valid = (idx >= 0) & (idx < seq_len)
    idx = tl.where(valid, idx, 0)
    block = tl.load(p_table + idx // block_size, mask=valid, other=0)
    rows = block.to(tl.int64) * stride_c_block + (idx % block_size).to(tl.int64) * stride_c_token
    return rows, valid


@triton.jit
def _gather_rows(
    cache_ptr,
    rows,  # [BLOCK_N] int64 offsets of the rows (_index_rows)
    valid,  # [BLOCK_N]
    offs_dc,
    offs_dr,
    m_dc,
    m_dr,
    DIM_C: tl.constexpr,
    DIM_R: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    BLOCK_DR: tl.constexpr,
):
    """The ``c_kv`` and ``k_pe`` rows of a gathered tile as stored; rows that are not tokens
    are zero (their memory is never read)."""
    p_rows = cache_ptr + rows[:, None]
    if BLOCK_DC == DIM_C:
        c = tl.load(p_rows + offs_dc[None, :], mask=valid[:, None], other=0.0)
    else:
        c = tl.load(p_rows + offs_dc[None, :], mask=valid[:, None] & m_dc[None, :], other=0.0)
    p_pe = p_rows + (DIM_C + offs_dr)[None, :]
    if BLOCK_DR == DIM_R:
        k_pe = tl.load(p_pe, mask=valid[:, None], other=0.0)
    else:
        k_pe = tl.load(p_pe, mask=valid[:, None] & m_dr[None, :], other=0.0)
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
    BLOCK_S: tl.constexpr,  # num_splits padded to a power of two
    CHUNK_S: tl.constexpr,  # splits merged per step
    BLOCK_DC: tl.constexpr,  # output columns per program
):
    # one program per (request, head, column block), merging CHUNK_S splits a step: at 32
    # splits a [32, 512] float32 tile in one go would be 128 values a thread and 256
    # programs at batch 8; column blocks give more programs and loads in flight
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    i_d = tl.program_id(2)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dc = i_d * BLOCK_DC + tl.arange(0, BLOCK_DC)
    m_dc = offs_dc < DIM_C
    row = (i_b.to(tl.int64) * num_heads + i_h) * num_splits
    m = tl.load(part_m_ptr + row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    l = tl.load(part_l_ptr + row + offs_s, mask=offs_s < num_splits, other=0.0)
    m_max = tl.max(m, axis=0)
    # empty splits (m = -inf, l = 0) get weight 0; at least one split is non-empty
    den = tl.sum(tl.where(l > 0, tl.exp2(m - m_max), 0.0) * l, axis=0)
    num = tl.zeros([BLOCK_DC], tl.float32)
    offs_c = tl.arange(0, CHUNK_S)
    for s0 in range(0, BLOCK_S, CHUNK_S):
        m_c = (s0 + offs_c) < num_splits
        m_s = tl.load(part_m_ptr + row + s0 + offs_c, mask=m_c, other=float("-inf"))
        l_s = tl.load(part_l_ptr + row + s0 + offs_c, mask=m_c, other=0.0)
        w = tl.where(l_s > 0, tl.exp2(m_s - m_max), 0.0)
        acc = tl.load(
            part_acc_ptr + (row + s0 + offs_c)[:, None] * DIM_C + offs_dc[None, :],
            mask=m_c[:, None] & m_dc[None, :],
            other=0.0,
        )
        num += tl.sum(acc * w[:, None], axis=0)
    tl.store(
        out_ptr + i_b.to(tl.int64) * stride_out_b + i_h * stride_out_h + offs_dc,
        (num / den).to(out_ptr.dtype.element_ty),
        mask=m_dc,
    )


# ---- host side --------------------------------------------------------------------------------

_FP8 = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability; the interpreter counts as the smallest supported one
    (sm_80), so the CPU tests run the configs an A100 would. The compile check monkeypatches
    this per target."""
    if device.type != "cuda":
        return (8, 0)
    return torch.cuda.get_device_capability(device)


def _fp8e4_in_hardware(device: torch.device) -> bool:
    """sm_89+ (Ada, Hopper) convert e4m3 in hardware; older GPUs get the raw bytes and a
    software conversion in the kernel. Tests and the compile check monkeypatch this."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Multiprocessors of the GPU, read once; on the CPU an H100's/H200's 132, so the CPU tests
    see the grids those GPUs would run."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def max_heads_per_program(capability: tuple[int, int], fp8: bool, page_align: int) -> int:
    """The most heads a program compiles without spills (see :func:`config_fits`): 64 on sm_90
    for 16-bit caches whose block size is a multiple of 16, else 32 (blocks of other sizes walk
    segments shorter than a tile, whose addresses spill next to 64 heads)."""
    return 64 if capability >= (9, 0) and not fp8 and page_align >= 16 else 32


def heads_per_program(
    num_heads: int, capability: tuple[int, int], fp8: bool = False, page_align: int = 64
) -> int:
    """``BLOCK_H``: the heads of a request rounded up to a power of two (at least 16, the
    smallest ``tl.dot``), capped at :func:`max_heads_per_program`."""
    limit = max_heads_per_program(capability, fp8, page_align)
    return min(max(16, triton.next_power_of_2(num_heads)), limit)


def check_heads_per_program(
    block_h: int, num_heads: int, capability: tuple[int, int], fp8: bool, page_align: int
) -> None:
    """Refuse a ``heads_per_program`` override the kernel cannot run without spills, naming the
    values it can."""
    limit = max_heads_per_program(capability, fp8, page_align)
    allowed = [h for h in (16, 32, 64) if h <= limit]
    if isinstance(block_h, bool) or not isinstance(block_h, int) or block_h not in allowed:
        arch = f"sm_{capability[0]}{capability[1]}"
        raise ValueError(
            f"heads_per_program={block_h!r} is not one this launch compiles without spills on "
            f"{arch} ({'an fp8' if fp8 else 'a 16-bit or fp32'} cache, pages aligned to "
            f"{page_align} tokens): choose one of {allowed}, or None for the rule's "
            f"{heads_per_program(num_heads, capability, fp8, page_align)}"
        )


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


def mla_shape(
    *,
    device: torch.device,
    num_heads: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    block_size: int,
    cache_dtype: torch.dtype,
    q_dtype: torch.dtype,
    batch: int,
    max_seq_len: int,
    num_indices: int | None = None,
    block_h: int | None = None,
) -> MlaShape:
    """The :class:`MlaShape` of a launch; ``num_indices`` (K) for a sparse launch, whose
    gathered rows each have their own address, as on pages of one token (``page_align`` 1);
    ``block_h`` overrides :func:`heads_per_program` (checked)."""
    major, minor = _capability(device)
    sparse = num_indices is not None
    page_align = 1 if sparse else min(block_size & -block_size, _MAX_BLOCK_N)
    fp8 = cache_dtype in _FP8
    if block_h is None:
        block_h = heads_per_program(num_heads, (major, minor), fp8, page_align)
    else:
        check_heads_per_program(block_h, num_heads, (major, minor), fp8, page_align)
    return MlaShape(
        arch=10 * major + minor,
        block_h=block_h,
        block_dc=max(16, triton.next_power_of_2(kv_lora_rank)),
        block_dr=max(16, triton.next_power_of_2(qk_rope_head_dim)),
        cache=_cache_kind(cache_dtype, device),
        q_bytes=q_dtype.itemsize,
        page_align=page_align,
        work=_bucket(batch * triton.cdiv(num_heads, block_h)),
        rope=qk_rope_head_dim > 0,
        context=_bucket(num_indices if sparse else max_seq_len),
        sparse=sparse,
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
            f"one (its own query token, position seq_len - 1, at least)"
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
            "DIM_C",
            "DIM_R",
            "BLOCK_H",
            "PAGE_ALIGN",
            "FP8",
            "SPARSE",
            "tune_work",
            "tune_context",
        ],
        prune_configs_by={"early_config_prune": _prune_for_autotune},
    )(_mla_partial_kernel)


def _config_of(c: triton.Config) -> MlaConfig:
    return MlaConfig(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)


def _prune_for_autotune(
    configs: list[triton.Config], nargs: dict, **kwargs
) -> list[triton.Config]:
    """Autotuning's candidates: the configs that fit the launch's shape class."""
    args = {**nargs, **kwargs}
    major, minor = _capability(args["q_nope_ptr"].device)
    item = args["cache_ptr"].element_size()
    cache = {1: "fp8", 4: "fp32"}.get(item, "16bit")
    if args["FP8"] == 2:
        cache = "fp8-bytes"
    shape = MlaShape(
        arch=10 * major + minor,
        block_h=args["BLOCK_H"],
        block_dc=args["BLOCK_DC"],
        block_dr=args["BLOCK_DR"],
        cache=cache,
        q_bytes=args["q_nope_ptr"].element_size(),
        page_align=args["PAGE_ALIGN"],
        work=args["tune_work"],
        context=args["tune_context"],
        sparse=bool(args.get("SPARSE", False)),
        rope=args["DIM_R"] > 0,
    )
    kept = [c for c in configs if config_fits(_config_of(c), shape)]
    return kept or configs[:1]


def _check_scale(scale: torch.Tensor | None) -> None:
    if scale is None or scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError(
            f"an fp8 latent cache needs k_scale: a float32 tensor holding one value, got "
            f"{None if scale is None else (scale.dtype, tuple(scale.shape))}"
        )


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

    def __call__(self, grid: tuple[int, ...], key: tuple, args: tuple, meta: dict) -> None:
        grid = (*grid, 1, 1)[:3]
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


_partial_launcher = _Launcher(_mla_partial_kernel)
_reduce_launcher = _Launcher(_mla_reduce_kernel)


@dataclass(frozen=True, eq=False)
class MlaDecodePlan:
    """Everything :meth:`run` needs that does not change between the layers of one step.

    Made by :func:`plan_mla_decode`; holds the step's block tables and lengths (by reference: a
    CUDA graph that captured :meth:`run` replays on whatever they hold then), the partial
    buffers, the config and the grid. A sparse plan (``num_indices`` = K, planned with
    ``token_indices``) runs only with a ``[B, K]`` index list, a dense one only without."""

    batch: int
    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    block_size: int
    cache_dtype: torch.dtype
    q_dtype: torch.dtype
    scale: float
    max_seq_len: int
    shape: MlaShape
    config: MlaConfig
    config_source: str  # the table row, "autotune" or "given"
    num_head_blocks: int
    num_splits: int
    split_len: int
    autotune: bool
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
    _qn_shape: tuple[int, int, int] = field(init=False, repr=False)
    _qp_shape: tuple[int, int, int] = field(init=False, repr=False)
    _grid: tuple[int] = field(init=False, repr=False)
    _meta: dict = field(init=False, repr=False)
    _launch_key: tuple = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)  # a frozen dataclass's derived fields

        batch, heads = self.batch, self.num_heads
        put("_qn_shape", (batch, heads, self.kv_lora_rank))
        put("_qp_shape", (batch, heads, self.qk_rope_head_dim))
        # the head group varies fastest in the launch order (see the kernel)
        put("_grid", (batch * self.num_splits * self.num_head_blocks,))
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
                tuple(None if t is None else t.data_ptr() % 16 for t in tensors),
                tuple(
                    _int_class(v)
                    for v in (self.block_size, self.split_len, heads, self.num_head_blocks,
                              self.num_splits, self.block_tables.stride(0),
                              self.num_indices or 0)
                ),
                tuple(sorted(self._meta.items())),
            ),
        )  # fmt: skip

    def run(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        token_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Absorbed MLA decode of one layer: ``q_nope [B, H, Dc]``, ``q_pe [B, H, Dr]`` over
        ``latent_cache [num_blocks, block_size, (1,) Dc + Dr]`` (any block and token strides)
        of the planned shape and dtype; an fp8 cache needs ``k_scale`` (float32, one value).
        A sparse plan needs this layer's ``token_indices [B, K] int32`` (the planned K, rows
        contiguous; ``plan.token_indices`` where layers share one top-k, as GLM-5-Next's MLA
        layers share their indexer's); a dense plan refuses one. Returns ``[B, H, Dc]`` in
        ``q_nope``'s dtype (in ``out`` if given: then nothing is allocated)."""
        batch, heads, dc = self.batch, self.num_heads, self.kv_lora_rank
        if self.num_indices is None:
            if token_indices is not None:
                raise ValueError(
                    "this plan attends to every cached token: it was made without "
                    "token_indices. Pass the step's [B, K] list to plan_mla_decode("
                    "token_indices=...) for a sparse (top-k) plan"
                )
            idx, stride_idx = self.seq_lens, 0  # never read
        else:
            if token_indices is None:
                raise ValueError(
                    f"this plan is sparse (planned with token_indices, K = "
                    f"{self.num_indices}): pass this layer's token_indices= [B, K] (or "
                    f"plan.token_indices), or plan without token_indices to attend to every "
                    f"cached token"
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
        latent = dc + self.qk_rope_head_dim
        for name, q, want in (("q_nope", q_nope, self._qn_shape), ("q_pe", q_pe, self._qp_shape)):
            if q.shape != want or q.dtype != self.q_dtype or q.stride(2) != 1:
                raise ValueError(
                    f"{name} must be {list(want)} {self.q_dtype} with a contiguous last dim "
                    f"(the plan's), got {tuple(q.shape)} {q.dtype}"
                )
        # the [nb, bs, D] or [nb, bs, 1, D] view is read through its block and token strides:
        # no view is made on the hot path
        shape, cs = latent_cache.shape, latent_cache.stride()
        if (
            len(shape) not in (3, 4)
            or (len(shape) == 4 and shape[2] != 1)
            or shape[1] != self.block_size
            or shape[-1] != latent
            or latent_cache.dtype != self.cache_dtype
            or cs[-1] != 1
        ):
            raise ValueError(
                f"latent_cache must be [num_blocks, {self.block_size}, (1,) {latent}] "
                f"{self.cache_dtype} with a contiguous last dim (the plan's), got "
                f"{tuple(shape)} {latent_cache.dtype}"
            )
        stride_block, stride_token = cs[0], cs[1]
        if stride_token * self.shape.page_align + latent >= 2**31:
            raise ValueError(
                f"the cache's token stride {stride_token} is too large: offsets inside a "
                f"{self.shape.page_align}-token segment must stay below 2**31 elements"
            )
        fp8 = self._constexprs["FP8"]
        if fp8:
            _check_scale(k_scale)
            if fp8 == 2:  # the kernel decodes the bytes itself
                latent_cache = latent_cache.view(torch.uint8)
        else:
            k_scale = self.seq_lens  # never read
        if out is None:
            out = torch.empty(self._qn_shape, dtype=self.q_dtype, device=q_nope.device)
        elif out.shape != self._qn_shape or out.stride(2) != 1 or out.dtype != self.q_dtype:
            raise ValueError(
                f"out must be {list(self._qn_shape)} {self.q_dtype}, contiguous in Dc, got "
                f"{tuple(out.shape)} {out.dtype}"
            )
        if batch == 0:
            return out
        one_split = self._constexprs["ONE_SPLIT"]
        qns, qps, os_ = q_nope.stride(), q_pe.stride(), out.stride()
        parts = (out, out, out) if one_split else (self.part_m, self.part_l, self.part_acc)
        args = (
            q_nope, q_pe, latent_cache, self.block_tables, self.seq_lens, idx, k_scale, *parts,
            out, self.scale, self.block_size, self.split_len, heads, self.num_head_blocks,
            self.num_splits, qns[0], qns[1], qps[0], qps[1], self.block_tables.stride(0),
            stride_idx, self.num_indices or 0, stride_block, stride_token, os_[0], os_[1],
            self.shape.work, self.shape.context,
        )  # fmt: skip
        if self.autotune:
            _autotuned_kernel()[self._grid](*args, **self._constexprs)
        else:
            # what may differ between the layers of a step and matters to Triton's
            # specialisation: the pointers' alignment and the strides
            key = (
                self._launch_key, q_nope.data_ptr() % 16, q_pe.data_ptr() % 16,
                latent_cache.data_ptr() % 16, out.data_ptr() % 16, k_scale.data_ptr() % 16,
                idx.data_ptr() % 16, _int_class(stride_idx), qns, qps, stride_block,
                stride_token, os_,
            )  # fmt: skip
            _partial_launcher(self._grid, key, args, self._meta)
        if not one_split:
            _reduce_launcher(
                self._reduce_grid,
                (self._launch_key, out.data_ptr() % 16, os_),
                (self.part_m, self.part_l, self.part_acc, out, os_[0], os_[1], heads,
                 self.num_splits),
                self._reduce_constexprs,
            )  # fmt: skip
        return out


def plan_mla_decode(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_heads: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    block_size: int,
    cache_dtype: torch.dtype,
    q_dtype: torch.dtype,
    scale: float,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: MlaConfig | None = None,
    autotune: bool = False,
    num_blocks: int | None = None,
    validate: bool | None = None,
    token_indices: torch.Tensor | None = None,
    heads_per_program: int | None = None,
) -> MlaDecodePlan:
    """Plan one step's MLA decode: ``block_tables [B, max_blocks] int32`` (row-contiguous),
    ``seq_lens [B] int32/int64`` (>= 1; the query is the last token) on the device the layers'
    tensors live on, and the shapes every MLA layer of the step shares (``kv_lora_rank`` = Dc,
    ``qk_rope_head_dim`` = Dr). Returns an :class:`MlaDecodePlan` whose
    :meth:`~MlaDecodePlan.run` serves every layer.

    ``max_seq_len`` (>= every seq_len) keeps planning free of device syncs; without it
    ``seq_lens`` is read back once. ``num_splits`` overrides :func:`choose_num_splits`;
    ``config`` (one of ``CONFIGS``) overrides the table (:func:`choose_config`);
    ``autotune=True`` tunes over ``CONFIGS`` on the GPU instead, keyed by the shape class.
    ``validate`` (default: the ``HYBRIDKV_VALIDATE`` switch) checks the lengths and, given
    ``num_blocks``, every block id the kernel will read (one sync; see the module's contract).

    ``token_indices [B, K] int32`` (rows contiguous, on the tables' device) makes a sparse
    plan: each request attends only to the tokens its row lists (absolute positions, distinct,
    each ``< seq_lens[b]``, at least one a row; ``-1`` pads a row, anywhere in it), as a
    DeepSeek-V3.2 / GLM-5-Next indexer's top-k gives. Splits then cover the K entries, not
    the context. The plan keeps the list (``plan.token_indices``) and every
    :meth:`~MlaDecodePlan.run` takes its layer's list of the same shape (the same tensor, or
    another layer's top-k); with ``validate`` the plan's list and every run's are checked.

    ``heads_per_program`` (16, 32 or 64, at most :func:`max_heads_per_program`) overrides the
    heads a program takes (``BLOCK_H``; rows past the request's heads are masked). 64 for a
    model of 32 heads or fewer pads the score and output tiles to the 64 rows a Hopper
    warpgroup's wgmma takes (FlashMLA pads the same way): twice the multiply-adds, half of them
    on masked rows, issued asynchronously from shared memory instead of as mma.sync; whether
    that is faster at Kimi-Linear's 32 heads is for the GPU suite's sweep to measure.
    """
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
    if q_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q_nope must be fp16/bf16/fp32, got {q_dtype}")
    if num_heads < 1 or kv_lora_rank < 1 or qk_rope_head_dim < 0 or block_size < 1:
        raise ValueError(
            f"num_heads, kv_lora_rank and block_size must be >= 1 and qk_rope_head_dim >= 0 "
            f"(0: a NoPE MLA), got {num_heads}, {kv_lora_rank}, {qk_rope_head_dim}, {block_size}"
        )
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 (or None to choose), got {num_splits}")
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if autotune and _INTERPRETED:
        raise ValueError(
            "autotune=True needs a GPU: the Triton interpreter cannot time configs; leave it "
            "off (the table's config) or pass config="
        )
    if autotune and config is not None:
        raise ValueError("pass config= or autotune=True, not both")
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
    check = _validate_enabled(validate)
    lens = None
    if batch and (max_seq_len is None or check):
        lens = _check_lengths(seq_lens, max_seq_len)
        if max_seq_len is None:
            max_seq_len = int(lens.max())
        if check:  # the host copy of seq_lens, not a second sync
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
    shape = mla_shape(
        device=device,
        num_heads=num_heads,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        block_size=block_size,
        cache_dtype=cache_dtype,
        q_dtype=q_dtype,
        batch=batch,
        max_seq_len=max_seq_len,
        num_indices=num_indices,
        block_h=heads_per_program,
    )
    if autotune:
        source = "autotune"
        config = choose_config(shape)[0]  # sizes the split count; the autotuner picks per launch
    elif config is None:
        config, source = choose_config(shape)
    else:
        if config not in CONFIGS:
            raise ValueError(f"{config} is not one of CONFIGS: {', '.join(map(str, CONFIGS))}")
        source = "given"
    num_head_blocks = triton.cdiv(num_heads, shape.block_h)
    if num_splits is None:
        num_splits = choose_num_splits(
            batch,
            num_head_blocks,
            num_indices or max_seq_len,
            _num_sms(device),
            ctas_per_sm(config, shape),
            partial_tokens(shape, kv_lora_rank, qk_rope_head_dim, cache_dtype.itemsize),
        )
    # each split covers whole tiles of any config (sparse: of the index list)
    walked = num_indices or max_seq_len
    split_len = triton.cdiv(triton.cdiv(walked, num_splits), _MAX_BLOCK_N) * _MAX_BLOCK_N
    num_splits = triton.cdiv(walked, split_len)
    # one split normalises and writes the output itself, saving the partials' round trip,
    # where that epilogue compiles without spills for every candidate config (see
    # one_split_fits): the same for the table's config and autotuning, so the compile check's
    # candidates include the table's binary
    candidates = [c for c in CONFIGS if config_fits(c, shape)] + [config]
    one_split = num_splits == 1 and all(one_split_fits(c, shape) for c in candidates)
    part_m = part_l = part_acc = None
    if not one_split:
        f32 = dict(dtype=torch.float32, device=device)
        part_m = torch.empty((batch, num_heads, num_splits), **f32)
        part_l = torch.empty((batch, num_heads, num_splits), **f32)
        part_acc = torch.empty((batch, num_heads, num_splits, kv_lora_rank), **f32)
    block_s = max(2, triton.next_power_of_2(num_splits))
    reduce_dc = min(shape.block_dc, 128)
    return MlaDecodePlan(
        batch=batch,
        num_heads=num_heads,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        block_size=block_size,
        cache_dtype=cache_dtype,
        q_dtype=q_dtype,
        scale=float(scale),
        max_seq_len=max_seq_len,
        shape=shape,
        config=config,
        config_source=source,
        num_head_blocks=num_head_blocks,
        num_splits=num_splits,
        split_len=split_len,
        autotune=autotune,
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
            DIM_C=kv_lora_rank,
            DIM_R=qk_rope_head_dim,
            BLOCK_DC=shape.block_dc,
            BLOCK_DR=shape.block_dr,
            BLOCK_H=shape.block_h,
            PAGE_ALIGN=shape.page_align,
            FP8={"fp8": 1, "fp8-bytes": 2}.get(shape.cache, 0),
            ONE_SPLIT=one_split,
            SPARSE=shape.sparse,
        ),
        _reduce_grid=(batch, num_heads, triton.cdiv(kv_lora_rank, reduce_dc)),
        _reduce_constexprs=dict(
            DIM_C=kv_lora_rank, BLOCK_S=block_s, CHUNK_S=min(block_s, 16), BLOCK_DC=reduce_dc
        ),
    )


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
    config: MlaConfig | None = None,
    autotune: bool = False,
    token_indices: torch.Tensor | None = None,
    heads_per_program: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode, one query token per request: :func:`plan_mla_decode` and
    :meth:`MlaDecodePlan.run` in one call (plan once and run per layer to save the host work).

    Shapes: ``q_nope [B, H, Dc]`` (already multiplied by ``W_UK``), ``q_pe [B, H, Dr]``,
    ``latent_cache [num_blocks, block_size, (1,) Dc + Dr]`` (any block and token strides),
    ``block_tables [B, max_blocks] int32``, ``seq_lens [B] int32`` (>= 1). Returns
    ``[B, H, Dc]`` (in ``out`` if given) in ``q_nope``'s dtype: the attention-weighted latent,
    before ``W_UV``. With ``max_seq_len`` (>= every seq_len) the call never syncs with the
    device; without it, it reads ``seq_lens`` back once. ``validate`` (default: the
    ``HYBRIDKV_VALIDATE`` environment switch) checks every block id and length the kernel will
    use (see the module's contract). An fp8 cache needs ``k_scale`` (a float32 scalar).
    ``token_indices [B, K] int32`` attends only to the listed tokens of each request (top-k
    sparse attention; see :func:`plan_mla_decode`). ``heads_per_program`` overrides the heads
    a program takes (see :func:`plan_mla_decode`).
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
    if q_pe.dtype != q_nope.dtype:
        raise ValueError(f"q_pe is {q_pe.dtype} but q_nope is {q_nope.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be an int32 [B, max_blocks] tensor with one row per request "
            f"(B = {batch}), got {tuple(block_tables.shape)}"
        )
    quant = cache.dtype in _FP8
    if quant and k_scale is None:
        raise ValueError("an fp8 latent cache needs k_scale (a float32 scalar)")
    plan = plan_mla_decode(
        block_tables,
        seq_lens,
        num_heads=num_heads,
        kv_lora_rank=dc,
        qk_rope_head_dim=dr,
        block_size=cache.shape[1],
        cache_dtype=cache.dtype,
        q_dtype=q_nope.dtype,
        scale=scale,
        max_seq_len=max_seq_len,
        num_splits=num_splits,
        config=config,
        autotune=autotune,
        num_blocks=cache.shape[0],
        validate=validate,
        token_indices=token_indices,
        heads_per_program=heads_per_program,
    )
    if quant:
        k_scale = k_scale.reshape(1).to(torch.float32)
    return plan.run(q_nope, q_pe, cache, k_scale, out=out, token_indices=token_indices)


def mla_decode_attention_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    token_indices: torch.Tensor | None = None,
    **_: object,
) -> torch.Tensor:
    """Plain torch: gather each request's latents through its block table, float32 softmax;
    with ``token_indices [B, K]`` over exactly the listed positions of each row (``-1`` entries
    skipped; the kernel's contract wants them distinct and ``< seq_len``, which this does not
    check: a listed position is read as listed)."""
    cache = _latent_3d(latent_cache)
    dc = q_nope.shape[2]
    block_size = cache.shape[1]
    out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
    for b, n in enumerate(seq_lens.tolist()):
        if token_indices is None:
            pos = torch.arange(n, device=cache.device)
        else:
            row = token_indices[b].to(cache.device).long()
            pos = row[row >= 0]
        lat = cache[block_tables[b].long()[pos // block_size], pos % block_size].float()
        if cache.dtype in _FP8:
            lat = lat * k_scale.float()
        c, k_pe = lat[:, :dc], lat[:, dc:]
        scores = (q_nope[b].float() @ c.T + q_pe[b].float() @ k_pe.T) * scale
        out[b] = (scores.softmax(-1) @ c).to(q_nope.dtype)
    return out
