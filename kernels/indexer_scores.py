"""Pool scores of a DSA indexer with k-pool compression (GLM-5-Next; Qwen4-Exp's QSA) over its
paged rows.

Two ways of making a pool's key (``plan_indexer_scores(pool=...)``, the kernel's ``POOL``):
``gated``, GLM-5-Next's, described below; and ``mean_norm_rope``, Qwen4-Exp's QSA indexer
(transformers' ``Qwen4ExpTextQSAIndexer``), whose rows are the raw per-token keys ``[D]``:

    pool_key[p]  = rope_p(rmsnorm(mean_j key[p, j]) * (1 + k_layernorm.weight))
    score[t, p]  = sum_h weights[t, h] * relu(q[t, h] . pool_key[p] * softmax_scale)

(the mean in float32, rounded to the rows' dtype; ``rope_p`` rotates the first ``rotary_dim``
dims, rotate-half layout, by the model's rotary at position ``p * kpool``, the pool's first
token, from ``cos`` / ``sin`` tables the caller passes, one row a pool; each step rounded to
the rows' dtype as transformers computes it in that dtype; the engine passes ``weights = 1 /
sqrt(D)`` and ``softmax_scale = 1``: transformers' ``relu(q . k).sum(heads) / sqrt(D)``). The
rotation pairs dim ``d`` with ``d +- rotary_dim / 2``: the pooling loop also sums each row
read at the partner's offsets (the same cache lines), so both halves of a pair are in
registers. Everything else (tiles, page walk, the dot, visibility) is shared.

GLM-5-Next's sparse attention picks, for each query token, the tokens its MLA attends to: an
indexer scores *pools* of ``kpool`` consecutive tokens of the context and the MLA reads the
tokens of the best pools (and of the open pool, the context's incomplete tail). Per token the
indexer keeps one row ``[key (D) | gate (D) | valid (1)]`` (transformers' ``packed_states``;
a memory plan's indexer pages ``[num_blocks, block_size, 1, 2 * D + 1]``). For a request whose
context holds ``num_pools`` complete pools (pool ``p``: tokens ``p * kpool .. p * kpool +
kpool - 1``) and a query token ``t`` at position ``pos[t]``:

    pool_key[p]  = sum_j softmax_j(gate[p, j] + ape[j]) * key[p, j]     # per dim, over the
                                                                         # pool's kpool tokens
    score[t, p]  = sum_h weights[t, h] * relu(q[t, h] . pool_key[p] * softmax_scale)
    score[t, p]  = -inf   where p * kpool + kpool - 1 > pos[t]           # not fully visible

(``ape = index_kpool_compress_ape [kpool, D]``; ``weights`` come already scaled by the
caller, transformers' ``weights_proj(x) * n_heads ** -0.5``.) The top-k over pools and the
tail stay with the caller (``torch.topk``): this file computes ``scores [N, max_pools]``
float32 for a batch of query tokens of any requests, each token ``t`` of request ``seg[t]``
(its block-table row and ``num_pools[seg[t]]``) at position ``query_pos[t]``. Pools at or past
a request's ``num_pools`` and columns past it up to ``max_pools`` are -inf too (transformers
masks with ``finfo.min``; either sorts below every score, and the caller turns a pick of one
into padding).

Design (why it is shaped so):

- Tiles: one program per (token tile, pool tile). A token tile is up to ``tokens_per_tile``
  consecutive query tokens of *one* request, so the program pools its ``BLOCK_P`` pools once
  and scores them against every token of the tile: in a prefill the pooling (``kpool`` rows of
  ``2 * D`` elements a pool, the kernel's memory traffic) is shared by the tile's tokens
  instead of redone per token. The tiles are a host decision (the runs of equal ``seg``), so
  there is a plan/run split: :func:`plan_indexer_scores` builds the tile list ``[tiles, 4]``
  (first token, token count, request, pools the tile can see) once per forward from host
  copies of ``seg``, ``query_pos`` and ``num_pools`` (one device sync where they live on a
  GPU), and :meth:`IndexerScoresPlan.run` launches per indexer layer with no host work
  beyond argument checks and no allocation (given ``out``). Pool tiles past what a token tile
  can see (causality: about half of a long prefill's) only write -inf: no row is read, no dot
  is run. The token tile varies fastest in the launch order, so a request's tiles that read
  the same pool rows run together and all but the first read them from L2.
- Page walk: a pool's ``kpool`` tokens are addressed one by one through the block table
  (``table[pos // block_size]``, int64 page offsets), so a pool may straddle pages: any
  ``block_size`` works, a multiple of ``kpool`` or not. The table reads are ``BLOCK_P`` int32
  a token of the pool, from the same few cache lines; the row reads are ``2 * D`` elements a
  token, so the per-token lookup costs little next to them.
- Pooling in float32: the ``kpool`` tokens of a pool are visited in a loop, each a
  ``[BLOCK_P, D]`` tile of keys and one of gates, with an online softmax per (pool, dim)
  (running max, sum and weighted key, in log2 units): the rows are read once and the pool's
  tokens never need to be held at once (``kpool = 16``, ``D = 128`` would be 2,048 values a
  pool). transformers rounds the probabilities to the rows' dtype and sums the weighted keys
  in that dtype; here both stay in float32 (the same for float32 rows, up to summation
  order). The ``valid`` column is not read: every row the engine writes is valid (it pads
  nothing), and a pool is scored only when its last token is visible to the query.
- Head dot products as ``tl.dot``: per query token ``[BLOCK_H, D] x [D, BLOCK_P]``
  (``BLOCK_H`` = the heads rounded up to a power of two, at least 16 for ``tl.dot``), then the
  ReLU, the weighted head sum and the visibility mask in registers. The dot's operands take
  ``q``'s dtype. 16-bit ``q`` rounds the pool keys to its dtype and runs on the tensor cores
  (mma.sync on sm_80 and sm_90: 32 heads are below wgmma's 64 rows) with float32
  accumulation. float32 ``q`` (what transformers multiplies, ``q.float() @ keys.float()``, and
  what the engine passes) runs as an IEEE float32 dot (``input_precision="ieee"``), on the FMA
  units (the compile check finds no MMA): TF32 would round both operands to 10 mantissa bits
  and move scores by about 1e-3 relative, enough to reorder pools of close scores and lose
  token parity with transformers.

Configs: ``CONFIGS`` (pools a tile, warps, stages); :func:`config_fits` reproduces which
compile without spills (``python -m paper.compile_kernels --only indexer``: ptxas of sm_80 and
sm_90 on a CPU) and the default is 32 pools at 8 warps (121-124 registers at 32 heads and
D = 128, no spills, on both: two CTAs a multiprocessor). Measured on an H200 (GPU suite runs 3-5,
2026-11-27, GLM-5-Next's sizes on 64-token pages, bf16 rows): the default is the best of
``CONFIGS`` for decode, at 32-35% of copy bandwidth with float32 queries and 48% with bf16
ones (B = 8 at 32k, B = 64 at 8k); for a 2,048-token prefill chunk (float32 queries) 4 warps
ran 1.6x faster (5.7 against 3.5 TFLOP/s) but spill in the compile check, so the default stays
for every shape. The rows' ``2 * D + 1`` elements put no row on a 16-byte boundary, so the row
loads are not vectorised: the likely reason decode stays far from the copy bandwidth. Under the
interpreter one config is pinned (no autotuning without a driver);
``plan_indexer_scores(autotune=True)`` tunes over ``CONFIGS`` on a GPU.

Contract (checked on the host at plan time, from the host copies the tiling needs anyway):
``seg[t]`` in ``[0, R)``, ``query_pos[t] >= 0``, ``num_pools[r] >= 0``, every request's
``num_pools * kpool`` tokens covered by its table row's columns, ``max_pools >=
max(num_pools)``. The rows of positions ``< num_pools[r] * kpool`` of request ``r`` must have
been written; their block ids must be in ``[0, num_blocks)`` (checked only with
``validate=True`` or ``HYBRIDKV_VALIDATE=1``: one more sync for the table); other columns are
never read and may hold anything.

Not done: caching the pooled keys. transformers rebuilds every pool key at every step, and so
does this kernel: a decode step reads the request's whole indexer context (``2 * D + 1``
values a token) to score ``num_pools`` pools. A pool's key never changes once its last token
is written, so a cache of pool keys (``D`` values a pool, written when a pool completes) would
cut a decode step's reads by about ``2 * kpool`` (32x at GLM-5.3-Flash's ``kpool = 16``); that
is a memory-plan change (another page kind), not a kernel one. Nor a direct launcher (as in
``mla_decode.py``): Triton's argument binding costs tens of microseconds a launch, once per
indexer layer.

Standalone: imports only torch and triton, so the file can be copied into another project.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

# ---- configs and the default table ------------------------------------------------------------


@dataclass(frozen=True)
class IndexerConfig:
    """One compile-time choice of the scores kernel."""

    block_p: int  # pools a program, a power of two >= 16 (the dot's N)
    num_warps: int
    num_stages: int  # software pipelining of the pooling loop's row loads

    def __str__(self) -> str:
        return f"BLOCK_P={self.block_p},num_warps={self.num_warps},num_stages={self.num_stages}"


#: what autotuning tries (``plan_indexer_scores(autotune=True)``) and the compile check
#: compiles (those that fit the launch, :func:`config_fits`); the default is the first. The
#: kernel reads only the rows and writes ``out``, so tuning in place is safe. 16-pool tiles at
#: 4 warps are left out: at 32 heads and 16-bit queries ptxas caps them at 128 registers on
#: sm_90 and spills (12 B stored, 20 B loaded), and they offer nothing the 32-pool tile does not.
CONFIGS: tuple[IndexerConfig, ...] = (
    IndexerConfig(32, 8, 2),
    IndexerConfig(32, 4, 2),
    IndexerConfig(64, 8, 2),
    IndexerConfig(32, 4, 3),
    IndexerConfig(64, 8, 3),
)

#: query tokens of one request a program scores against its pool tile (the host's tiling)
TOKENS_PER_TILE = 16

#: the config pinned under the interpreter (no autotuning without a driver; warps and stages
#: mean nothing there): 16 pools, the smallest tile, so that short test contexts still span
#: several pool tiles
_INTERPRETER_CONFIG = IndexerConfig(16, 4, 1)

#: the largest heads and head dim (padded) the compile check has covered
_MAX_BLOCK_H, _MAX_BLOCK_D = 64, 128


@dataclass(frozen=True)
class IndexerShape:
    """The shape class a launch's config is chosen by."""

    arch: int  # compute capability as 80, 90, ...; the interpreter counts as 80
    block_h: int  # heads padded to a power of two, >= 16
    block_d: int  # index_head_dim padded to a power of two, >= 16
    rows_bytes: int  # element size of the indexer rows
    q_bytes: int  # element size of q: 4 runs the IEEE float32 dot


def config_fits(config: IndexerConfig, shape: IndexerShape) -> bool:
    """Whether ``config`` compiles for ``shape`` without spills: a rule that reproduces the
    compile check (``python -m paper.compile_kernels --only indexer``, the full matrix: triton
    3.9, ptxas of sm_80 and sm_90, fp16/bf16 rows, bf16/fp16 and float32 queries, 32 and 64
    heads at D 128, kpool 4 and 16, 16 heads at D 64). In values a thread: ``pooling`` for the
    pooling loop's float32 running max, sum and weighted key and the key and gate tiles (five
    ``[BLOCK_P, D]`` tiles), ``operands`` for the dot's ``q [BLOCK_H, D]`` and pool keys
    ``[D, BLOCK_P]`` in ``q``'s dtype (4-byte units).

    - ``pooling`` <= 80 (32 pools at 8 warps, D 128): 77-174 registers, no spills anywhere.
    - ``pooling`` 160 (32 pools at 4 warps, 64 at 8) reaches 212-255 registers and spills
      where the operands pass 32 (float32 queries: 32 pools, 4 warps, 3 stages at 32 heads,
      616 B on sm_80; 64 pools at 64 heads: ptxas falls back to 32 registers and spills 17-21
      KB), so it fits only with ``operands`` <= 32 (16-bit queries, up to 64 heads).
    - More than 64 heads or D > 128: not compiled yet, refused (run the compile check on such
      a case and extend this rule)."""
    if shape.block_h > _MAX_BLOCK_H or shape.block_d > _MAX_BLOCK_D:
        return False
    threads = 32 * config.num_warps
    pooling = 5 * config.block_p * shape.block_d // threads
    operands = (shape.block_h + config.block_p) * shape.block_d * shape.q_bytes // (4 * threads)
    return pooling <= 80 or operands <= 32


def choose_config(shape: IndexerShape) -> tuple[IndexerConfig, str]:
    """The default config of a shape class and where it comes from: the first of ``CONFIGS``
    that fits, 32 pools at 8 warps wherever the compile check reached (121-124 registers at
    32 heads and D 128, so two CTAs a multiprocessor). Measured only at GLM-5-Next's sizes
    (32 heads, D 128, bf16 rows) on sm_90, where it is the sweep's best for decode (see the
    module docstring)."""
    for config in CONFIGS:
        if config_fits(config, shape):
            if (shape.arch >= 90, shape.block_h, shape.block_d, shape.rows_bytes) == (
                True, 32, 128, 2,
            ):  # fmt: skip
                return config, (
                    "H200 GPU suite runs 3-5, 2026-11-27 (paper/results/h200-suite-4/"
                    "sweep-NVIDIA-H200.json): the best of CONFIGS for decode at 32 heads, D 128"
                )
            return config, "unmeasured: the first config of CONFIGS that fits (compile check)"
    raise ValueError(
        f"no indexer-scores config is known to fit {shape.block_h} heads x D {shape.block_d} "
        f"(padded): the compile check covers up to {_MAX_BLOCK_H} heads and D {_MAX_BLOCK_D}. "
        f"Compile such a case (paper/compile_kernels.py) and extend config_fits, or pass "
        f"config= at your own risk"
    )


# ---- the kernel -------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["max_pools"])
def _indexer_scores_kernel(
    q_ptr,  # [N, H, D] query tokens' indexer queries (fp32 / fp16 / bf16), last dim contiguous
    w_ptr,  # [N, H] float32 head weights (the caller's scaling included), last dim contiguous
    rows_ptr,  # [num_blocks, block_size, (1,) 2 * D + 1] indexer rows: key | gate | valid
    ape_ptr,  # [KPOOL, D] float32 gate bias of each position in a pool (GATED only)
    norm_ptr,  # [D] float32 pooled-key RMSNorm weight, 1 + weight (MEAN_NORM_ROPE only)
    cos_ptr,  # [>= max_pools, ROT] float32 rotary cos at each pool's first position (likewise)
    sin_ptr,  # [>= max_pools, ROT] float32 rotary sin, rows as cos (likewise)
    table_ptr,  # [R, max_blocks] int32 block tables, rows contiguous
    pos_ptr,  # [N] int32 each query token's position in its request
    tile_ptr,  # [num_tiles, 4] int32: first token, tokens, request, pools the tile sees
    out_ptr,  # [N, max_pools] float32 scores, last dim contiguous
    scale,  # float: softmax_scale, applied to each head's dot before the ReLU
    eps,  # float: the pooled-key RMSNorm's epsilon (MEAN_NORM_ROPE)
    stride_cs,  # cos / sin: row (pool) stride
    num_heads,  # H
    max_pools,  # columns of out
    block_size,  # tokens a page
    stride_q_t,  # q: token stride (elements)
    stride_q_h,  # q: head stride
    stride_w_t,  # weights: token stride
    stride_rows_block,  # rows: page stride (elements; int64 math)
    stride_rows_token,  # rows: token stride inside a page
    stride_table,  # block tables: request stride
    stride_out_t,  # out: token stride
    POOL: tl.constexpr,  # 0 GATED (GLM-5-Next), 1 MEAN_NORM_ROPE (Qwen4-Exp's QSA)
    ROT: tl.constexpr,  # MEAN_NORM_ROPE: rotary dims of the pooled key (even, <= D; 0: none)
    DIM: tl.constexpr,  # D = index_head_dim
    KPOOL: tl.constexpr,  # tokens a pool
    BLOCK_H: tl.constexpr,  # heads padded to a power of two >= 16
    BLOCK_D: tl.constexpr,  # D padded to a power of two >= 16
    BLOCK_P: tl.constexpr,  # pools a program (config)
    IEEE: tl.constexpr,  # float32 q: the dot in IEEE float32 (not TF32)
):
    i_tile = tl.program_id(0)
    i_pool = tl.program_id(1)
    p_tile = tile_ptr + i_tile * 4
    first = tl.load(p_tile).to(tl.int64)  # scalar: the tile's first token
    count = tl.load(p_tile + 1)  # tokens of the tile (all of one request)
    request = tl.load(p_tile + 2).to(tl.int64)
    seen = tl.load(p_tile + 3)  # pools the tile's last token sees (<= num_pools[request])

    offs_p = i_pool * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P] pool ids
    m_p = offs_p < seen
    m_store = offs_p < max_pools
    offs_d = tl.arange(0, BLOCK_D)
    m_d = offs_d < DIM
    offs_h = tl.arange(0, BLOCK_H)
    m_h = offs_h < num_heads

    if i_pool * BLOCK_P < seen:
        p_table = table_ptr + request * stride_table
        if POOL == 1:
            pool_t = _mean_norm_rope_pool(
                rows_ptr, p_table, offs_p, m_p, offs_d, m_d, norm_ptr, cos_ptr, sin_ptr,
                stride_cs, eps, block_size, stride_rows_block, stride_rows_token, DIM, KPOOL,
                ROT, BLOCK_P, BLOCK_D,
            )  # fmt: skip
        else:
            # pool keys of this tile, float32 online softmax per (pool, dim) in log2 units: the
            # kpool rows of a pool are visited one position at a time, each a [BLOCK_P, D] tile
            b_m = tl.full([BLOCK_P, BLOCK_D], float("-inf"), tl.float32)
            b_l = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
            b_acc = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
            m_pd = m_p[:, None] & m_d[None, :]
            for j in range(KPOOL):
                tok = offs_p * KPOOL + j  # [BLOCK_P] positions: a pool may straddle pages
                block = tl.load(p_table + tok // block_size, mask=m_p, other=0)  # [BLOCK_P]
                base = (
                    block.to(tl.int64) * stride_rows_block
                    + (tok % block_size).to(tl.int64) * stride_rows_token
                )  # [BLOCK_P] int64 row offsets
                p_row = rows_ptr + base[:, None] + offs_d[None, :]  # [BLOCK_P, BLOCK_D]
                key = tl.load(p_row, mask=m_pd, other=0.0).to(tl.float32)
                gate = tl.load(p_row + DIM, mask=m_pd, other=0.0).to(tl.float32)
                ape = tl.load(ape_ptr + j * DIM + offs_d, mask=m_d, other=0.0)  # [BLOCK_D]
                g = (gate + ape[None, :]) * 1.4426950408889634
                m_new = tl.maximum(b_m, g)
                alpha = tl.exp2(b_m - m_new)  # 0 at j = 0 (b_m = -inf, m_new finite)
                p = tl.exp2(g - m_new)
                b_l = b_l * alpha + p
                b_acc = b_acc * alpha + p * key
                b_m = m_new
            pool_t = tl.trans(b_acc / b_l)  # [BLOCK_D, BLOCK_P]; masked pools hold 0
        end = KPOOL * offs_p + KPOOL - 1  # [BLOCK_P] each pool's last position
        for i in range(count):
            t = first + i
            pos = tl.load(pos_ptr + t)
            q = tl.load(
                q_ptr + t * stride_q_t + offs_h[:, None] * stride_q_h + offs_d[None, :],
                mask=m_h[:, None] & m_d[None, :],
                other=0.0,
            )  # [BLOCK_H, BLOCK_D]
            w = tl.load(w_ptr + t * stride_w_t + offs_h, mask=m_h, other=0.0)  # [BLOCK_H]
            if IEEE:
                s = tl.dot(q, pool_t, input_precision="ieee")  # [BLOCK_H, BLOCK_P]
            else:
                s = tl.dot(q, pool_t.to(q.dtype))
            s = tl.maximum(s * scale, 0.0)
            score = tl.sum(s * w.to(tl.float32)[:, None], axis=0)  # [BLOCK_P]
            score = tl.where(m_p & (end <= pos), score, float("-inf"))
            tl.store(out_ptr + t * stride_out_t + offs_p, score, mask=m_store)
    else:
        # no pool of this tile is visible to any token of the token tile: read nothing
        dead = tl.full([BLOCK_P], float("-inf"), tl.float32)
        for i in range(count):
            tl.store(out_ptr + (first + i) * stride_out_t + offs_p, dead, mask=m_store)


@triton.jit
def _round_to(x, like_ptr):
    """``x`` (float32) rounded to the element type of ``like_ptr`` and back: a 16-bit model
    rounds each step of the pooled key's transform to its dtype (a no-op for float32)."""
    return x.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _mean_norm_rope_pool(
    rows_ptr,  # [num_blocks, block_size, (1,) D] raw per-token keys
    p_table,  # the request's block-table row
    offs_p,  # [BLOCK_P] pool ids
    m_p,  # [BLOCK_P] pools the tile scores
    offs_d,  # [BLOCK_D]
    m_d,
    norm_ptr,  # [D] float32, 1 + the RMSNorm's weight
    cos_ptr,  # [pools, ROT] float32
    sin_ptr,
    stride_cs,
    eps,
    block_size,
    stride_rows_block,
    stride_rows_token,
    DIM: tl.constexpr,
    KPOOL: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Qwen4-Exp's compressed keys, ``[BLOCK_D, BLOCK_P]`` float32: each pool's ``KPOOL`` raw
    keys averaged in float32 and rounded to the rows' dtype, RMS-normalised over ``D`` (times
    ``1 + weight``, rounded), then rotated (rotate-half layout) by the rotary of the pool's
    first position on the first ``ROT`` dims, each product and the sum rounded to the rows'
    dtype as transformers computes them in it. The rotation pairs dim ``d`` with ``d +- ROT /
    2``, which a register tile cannot fetch from another column: the pooling sums each row a
    second time read at the partner's offsets (the same cache lines), so both halves of every
    pair are at hand after the loop."""
    HALF: tl.constexpr = ROT // 2
    partner = tl.where(offs_d < HALF, offs_d + HALF, tl.where(offs_d < ROT, offs_d - HALF, offs_d))
    m_pd = m_p[:, None] & m_d[None, :]
    acc = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
    acc_partner = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
    for j in range(KPOOL):
        tok = offs_p * KPOOL + j  # [BLOCK_P] positions: a pool may straddle pages
        block = tl.load(p_table + tok // block_size, mask=m_p, other=0)
        base = (
            block.to(tl.int64) * stride_rows_block
            + (tok % block_size).to(tl.int64) * stride_rows_token
        )  # [BLOCK_P] int64 row offsets
        acc += tl.load(rows_ptr + base[:, None] + offs_d[None, :], mask=m_pd, other=0.0).to(
            tl.float32
        )
        if ROT > 0:
            acc_partner += tl.load(
                rows_ptr + base[:, None] + partner[None, :], mask=m_pd, other=0.0
            ).to(tl.float32)
    mean = _round_to(acc / KPOOL, rows_ptr)
    rstd = 1.0 / tl.sqrt(tl.sum(mean * mean, axis=1) / DIM + eps)  # [BLOCK_P]
    w = tl.load(norm_ptr + offs_d, mask=m_d, other=0.0)
    key = _round_to(mean * rstd[:, None] * w[None, :], rows_ptr)
    if ROT > 0:
        w_partner = tl.load(norm_ptr + partner, mask=m_d, other=0.0)
        mean_partner = _round_to(acc_partner / KPOOL, rows_ptr)
        key_partner = _round_to(mean_partner * rstd[:, None] * w_partner[None, :], rows_ptr)
        m_rot = m_p[:, None] & (offs_d < ROT)[None, :]
        p_cs = offs_p.to(tl.int64)[:, None] * stride_cs + offs_d[None, :]
        cos = tl.load(cos_ptr + p_cs, mask=m_rot, other=1.0)
        sin = tl.load(sin_ptr + p_cs, mask=m_rot, other=0.0)
        # rotate_half: -x[d + ROT / 2] below ROT / 2, x[d - ROT / 2] from ROT / 2 to ROT
        rotated = tl.where((offs_d < HALF)[None, :], -key_partner, key_partner)
        roped = _round_to(_round_to(key * cos, rows_ptr) + _round_to(rotated * sin, rows_ptr),
                          rows_ptr)  # fmt: skip
        key = tl.where(m_rot, roped, key)
    return tl.trans(tl.where(m_pd, key, 0.0))


# ---- host side --------------------------------------------------------------------------------

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability; the interpreter (and the CPU) counts as sm_80. The compile
    check monkeypatches this per target."""
    if device.type != "cuda":
        return (8, 0)
    return torch.cuda.get_device_capability(device)


def _validate_enabled(validate: bool | None) -> bool:
    if validate is None:
        return os.environ.get("HYBRIDKV_VALIDATE", "") not in ("", "0")
    return validate


def indexer_shape(
    *,
    device: torch.device,
    num_heads: int,
    head_dim: int,
    rows_dtype: torch.dtype,
    q_dtype: torch.dtype,
) -> IndexerShape:
    """The :class:`IndexerShape` of a launch."""
    major, minor = _capability(device)
    return IndexerShape(
        arch=10 * major + minor,
        block_h=max(16, triton.next_power_of_2(num_heads)),
        block_d=max(16, triton.next_power_of_2(head_dim)),
        rows_bytes=rows_dtype.itemsize,
        q_bytes=q_dtype.itemsize,
    )


@functools.cache
def _autotuned_kernel():
    """The kernel under ``triton.autotune`` over ``CONFIGS``, keyed by the shape class. Built
    on first use: the interpreter cannot autotune."""
    configs = [
        triton.Config({"BLOCK_P": c.block_p}, num_warps=c.num_warps, num_stages=c.num_stages)
        for c in CONFIGS
    ]
    return triton.autotune(
        configs,
        key=["POOL", "ROT", "DIM", "KPOOL", "BLOCK_H", "BLOCK_D", "IEEE"],
        prune_configs_by={"early_config_prune": _prune_for_autotune},
    )(_indexer_scores_kernel)


def _prune_for_autotune(
    configs: list[triton.Config], nargs: dict, **kwargs
) -> list[triton.Config]:
    """Autotuning's candidates: the configs that fit the launch's shape class."""
    args = {**nargs, **kwargs}
    major, minor = _capability(args["q_ptr"].device)
    shape = IndexerShape(
        arch=10 * major + minor,
        block_h=args["BLOCK_H"],
        block_d=args["BLOCK_D"],
        rows_bytes=args["rows_ptr"].element_size(),
        q_bytes=args["q_ptr"].element_size(),
    )
    kept = [
        c
        for c in configs
        if config_fits(IndexerConfig(c.kwargs["BLOCK_P"], c.num_warps, c.num_stages), shape)
    ]
    return kept or configs[:1]


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: how a pool's key is made from its tokens' rows (the kernel's ``POOL``): ``gated``,
#: GLM-5-Next's softmax of gate + ape per dim over rows ``[key | gate | valid]``; and
#: ``mean_norm_rope``, Qwen4-Exp's QSA: the mean of raw keys (rows ``[key]``), RMS-normalised
#: and rotated at the pool's first position
POOLS = ("gated", "mean_norm_rope")


def _rows_3d(rows: torch.Tensor) -> torch.Tensor:
    """Accept ``[nb, bs, row]`` or a plan's ``[nb, bs, 1, row]`` view (no copy)."""
    if rows.dim() == 4 and rows.shape[2] == 1:
        return rows[:, :, 0]
    if rows.dim() != 3:
        raise ValueError(
            f"rows must be the indexer pages [num_blocks, block_size, (1,) 2 * D + 1], got "
            f"shape {tuple(rows.shape)}"
        )
    return rows


def _tiles(
    seg: torch.Tensor,
    pos: torch.Tensor,
    num_pools: torch.Tensor,
    kpool: int,
    tokens_per_tile: int,
) -> torch.Tensor:
    """``[num_tiles, 4]`` int32 on the host: runs of consecutive tokens of one request, cut
    every ``tokens_per_tile`` tokens; each with its first token, its token count, its request
    and the pools its tokens see (``min(num_pools, (max position + 1) // kpool)``)."""
    n = seg.numel()
    if n == 0:
        return torch.zeros((0, 4), dtype=torch.int32)
    idx = torch.arange(n)
    new_run = torch.ones(n, dtype=torch.bool)
    new_run[1:] = seg[1:] != seg[:-1]
    run_start = torch.cummax(torch.where(new_run, idx, 0), dim=0).values
    starts = new_run | ((idx - run_start) % tokens_per_tile == 0)
    first = idx[starts]
    count = torch.diff(first, append=torch.tensor([n]))
    tile_of = torch.cumsum(starts.long(), 0) - 1
    last_pos = torch.zeros(len(first), dtype=torch.int64).scatter_reduce(
        0, tile_of, pos, "amax", include_self=False
    )
    request = seg[first]
    seen = torch.minimum(num_pools[request], (last_pos + 1) // kpool)
    return torch.stack([first, count, request, seen], dim=1).to(torch.int32)


def _index_tensor(x: torch.Tensor, name: str, length: int | None = None) -> torch.Tensor:
    """A 1-D int32/int64 tensor, returned on the host as int64 (one copy; a sync on a GPU)."""
    if (
        not isinstance(x, torch.Tensor)
        or x.dim() != 1
        or x.dtype not in (torch.int32, torch.int64)
    ):
        got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {got}")
    if length is not None and x.numel() != length:
        raise ValueError(f"{name} has {x.numel()} entries, expected {length}")
    return x.detach().cpu().to(torch.int64)


def check_block_tables(
    block_tables: torch.Tensor,
    num_pools: torch.Tensor,
    kpool: int,
    block_size: int,
    num_blocks: int,
) -> None:
    """Every column a request reads (those holding its ``num_pools * kpool`` pooled tokens) is
    a block id in ``[0, num_blocks)``. Syncs with the device."""
    tables = block_tables.detach().cpu().long()
    used = (num_pools.long() * kpool + block_size - 1) // block_size  # [R] columns read
    cols = torch.arange(tables.shape[1])[None, :] < used[:, None]
    bad = cols & ((tables < 0) | (tables >= num_blocks))
    if bad.any():
        r, c = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"block_tables[{r}, {c}] = {int(tables[r, c])} is outside [0, {num_blocks}): "
            f"request {r} reads that column for its {int(num_pools[r])} pools of {kpool} "
            f"tokens (block_size {block_size}); give every used column a block id of these rows"
        )


@dataclass(frozen=True, eq=False)
class IndexerScoresPlan:
    """Everything :meth:`run` needs that does not change between the indexer layers of one
    forward: the token tiles, the block tables and positions (by reference), the config and
    the grid. Made by :func:`plan_indexer_scores`."""

    num_tokens: int  # N
    num_heads: int
    head_dim: int
    kpool: int
    block_size: int
    max_pools: int
    rows_dtype: torch.dtype
    q_dtype: torch.dtype
    softmax_scale: float
    shape: IndexerShape
    config: IndexerConfig
    config_source: str  # "unmeasured: ...", "autotune", "given" or "interpreter"
    autotune: bool
    pool: str  # one of POOLS
    rotary_dim: int  # mean_norm_rope: the pooled key's rotated dims (0: none)
    norm_eps: float  # mean_norm_rope: the pooled key's RMSNorm epsilon
    block_tables: torch.Tensor = field(repr=False)
    query_pos: torch.Tensor = field(repr=False)  # [N] int32 on the tables' device
    tiles: torch.Tensor = field(repr=False)  # [num_tiles, 4] int32 on the tables' device
    _constexprs: dict = field(repr=False)

    def run(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        rows: torch.Tensor,
        ape: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        *,
        norm: torch.Tensor | None = None,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer's scores: ``q [N, H, D]`` (the plan's ``q_dtype``, last dim contiguous),
        ``weights [N, H]`` float32, ``rows [num_blocks, block_size, (1,) 2 * D + 1]`` (the
        plan's dtype and block size, any page and token strides, last dim contiguous),
        ``ape [kpool, D]`` float32 (contiguous). Returns ``[N, max_pools]`` float32 (in
        ``out`` if given: then nothing is allocated); see the module docstring for what a
        score is. A ``mean_norm_rope`` plan (Qwen4-Exp) takes ``rows [num_blocks,
        block_size, (1,) D]`` (the raw keys), no ``ape``, and ``norm [D]`` (``1 + weight`` of
        the indexer's k_layernorm), ``cos`` / ``sin [>= max_pools, rotary_dim]`` (the model's
        rotary at each pool's first position, ``p * kpool``), all float32 with contiguous
        last dims."""
        n, h, d = self.num_tokens, self.num_heads, self.head_dim
        gated = self.pool == "gated"
        if q.shape != (n, h, d) or q.dtype != self.q_dtype or q.stride(2) != 1:
            raise ValueError(
                f"q must be [{n}, {h}, {d}] {self.q_dtype} with a contiguous last dim (the "
                f"plan's tokens, heads and index_head_dim), got {tuple(q.shape)} {q.dtype}"
            )
        if weights.shape != (n, h) or weights.dtype != torch.float32 or weights.stride(1) != 1:
            raise ValueError(
                f"weights must be [{n}, {h}] float32 with a contiguous last dim (one weight a "
                f"query token and head), got {tuple(weights.shape)} {weights.dtype}"
            )
        if gated:
            if norm is not None or cos is not None or sin is not None:
                raise ValueError(
                    "norm / cos / sin are a mean_norm_rope plan's (Qwen4-Exp); this plan pools "
                    "with gates: pass ape only"
                )
            if (
                ape is None
                or ape.shape != (self.kpool, d)
                or ape.dtype != torch.float32
                or not ape.is_contiguous()
            ):
                raise ValueError(
                    f"ape must be a contiguous [{self.kpool}, {d}] float32 tensor (the "
                    f"indexer's index_kpool_compress_ape, .float().contiguous()), got "
                    f"{None if ape is None else (tuple(ape.shape), ape.dtype)}"
                )
            norm = cos = sin = ape  # never read
        else:
            if ape is not None:
                raise ValueError(
                    "ape is a gated plan's (GLM-5-Next); this mean_norm_rope plan takes norm, "
                    "cos and sin instead"
                )
            _check_pool_transform(norm, cos, sin, d, self.rotary_dim, self.max_pools)
            ape = norm  # never read
        r3 = _rows_3d(rows)
        width = 2 * d + 1 if gated else d
        if r3.shape[2] != width:
            what = "[key | gate | valid]" if gated else "a raw key"
            raise ValueError(
                f"rows hold {r3.shape[2]} elements a token but {what} of index_head_dim {d} is "
                f"{width}: these are not this indexer's pages (or D, or the pool kind, is wrong)"
            )
        if r3.shape[1] != self.block_size or r3.dtype != self.rows_dtype or r3.stride(2) != 1:
            raise ValueError(
                f"rows must be [num_blocks, {self.block_size}, (1,) {width}] {self.rows_dtype} "
                f"with a contiguous last dim (the plan's), got {tuple(rows.shape)} {rows.dtype}"
            )
        devices = {t.device for t in (q, weights, r3, ape, norm, cos, sin)}
        if len(devices) != 1:
            raise ValueError(
                f"q, weights, rows and the pool's tensors must be on one device, got {devices}"
            )
        if out is None:
            out = torch.empty((n, self.max_pools), dtype=torch.float32, device=q.device)
        elif out.shape != (n, self.max_pools) or out.dtype != torch.float32 or out.stride(1) != 1:
            raise ValueError(
                f"out must be [{n}, {self.max_pools}] float32 with a contiguous last dim, got "
                f"{tuple(out.shape)} {out.dtype}"
            )
        if n == 0 or self.max_pools == 0 or self.tiles.shape[0] == 0:
            return out
        args = (
            q, weights, r3, ape, norm, cos, sin, self.block_tables, self.query_pos, self.tiles,
            out, self.softmax_scale, self.norm_eps, cos.stride(0), h, self.max_pools,
            self.block_size, q.stride(0), q.stride(1), weights.stride(0), r3.stride(0),
            r3.stride(1), self.block_tables.stride(0), out.stride(0),
        )  # fmt: skip
        num_tiles = self.tiles.shape[0]
        if self.autotune:
            max_pools = self.max_pools

            def grid(meta: dict) -> tuple[int, int]:
                return (num_tiles, triton.cdiv(max_pools, meta["BLOCK_P"]))

            _autotuned_kernel()[grid](*args, **self._constexprs)
        else:
            c = self.config
            grid = (num_tiles, triton.cdiv(self.max_pools, c.block_p))
            _indexer_scores_kernel[grid](
                *args, **self._constexprs, BLOCK_P=c.block_p, num_warps=c.num_warps,
                num_stages=c.num_stages,
            )  # fmt: skip
        return out


def plan_indexer_scores(
    block_tables: torch.Tensor,
    seg: torch.Tensor,
    query_pos: torch.Tensor,
    num_pools: torch.Tensor,
    *,
    num_heads: int,
    head_dim: int,
    kpool: int,
    block_size: int,
    rows_dtype: torch.dtype,
    q_dtype: torch.dtype,
    softmax_scale: float,
    max_pools: int | None = None,
    config: IndexerConfig | None = None,
    autotune: bool = False,
    tokens_per_tile: int = TOKENS_PER_TILE,
    num_blocks: int | None = None,
    validate: bool | None = None,
    pool: str = "gated",
    rotary_dim: int = 0,
    norm_eps: float = 1e-6,
) -> IndexerScoresPlan:
    """Plan one forward's indexer scores: ``block_tables [R, max_blocks] int32`` (rows
    contiguous), ``seg [N]`` (each query token's request), ``query_pos [N]`` (its position)
    and ``num_pools [R]`` (each request's complete pools: its context length // kpool), int32
    or int64, and the shapes every indexer layer of the forward shares. Returns an
    :class:`IndexerScoresPlan` whose :meth:`~IndexerScoresPlan.run` serves every layer.

    ``seg``, ``query_pos`` and ``num_pools`` are read back to the host once (the tiles are
    built there; a device sync on a GPU). ``max_pools`` (>= every ``num_pools``; default their
    max) is the scores' width. ``config`` (one of ``CONFIGS``) overrides the default;
    ``autotune=True`` tunes over ``CONFIGS`` on a GPU instead. ``tokens_per_tile`` caps the
    query tokens a program scores. ``validate`` (default: the ``HYBRIDKV_VALIDATE`` switch)
    also checks every block id the kernel will read (needs ``num_blocks``; one more sync).
    ``pool`` (one of :data:`POOLS`) says how a pool's key is made: ``gated`` (GLM-5-Next, the
    default) or ``mean_norm_rope`` (Qwen4-Exp's QSA: rows of raw keys averaged, RMS-normalised
    with ``norm_eps``, the first ``rotary_dim`` dims rotated at the pool's first position; see
    :meth:`IndexerScoresPlan.run`)."""
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    if pool == "mean_norm_rope" and not (0 <= rotary_dim <= head_dim and rotary_dim % 2 == 0):
        raise ValueError(
            f"rotary_dim must be even and in [0, head_dim = {head_dim}] (the pooled key's "
            f"rotated dims, rotate-half layout), got {rotary_dim}"
        )
    if pool == "gated" and rotary_dim:
        raise ValueError("rotary_dim is a mean_norm_rope plan's; a gated pool rotates nothing")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(
            f"block_tables must be an int32 [R, max_blocks] tensor, got "
            f"{tuple(block_tables.shape)} {block_tables.dtype}"
        )
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous (.contiguous())")
    if q_dtype not in _DTYPES or rows_dtype not in _DTYPES:
        raise ValueError(
            f"q and the indexer rows must be fp16, bf16 or fp32, got q {q_dtype}, rows "
            f"{rows_dtype}"
        )
    if min(num_heads, head_dim, kpool, block_size, tokens_per_tile) < 1:
        raise ValueError(
            f"num_heads, head_dim, kpool, block_size and tokens_per_tile must be >= 1, got "
            f"{num_heads}, {head_dim}, {kpool}, {block_size}, {tokens_per_tile}"
        )
    if autotune and _INTERPRETED:
        raise ValueError(
            "autotune=True needs a GPU: the Triton interpreter cannot time configs; leave it "
            "off (the default config) or pass config="
        )
    if autotune and config is not None:
        raise ValueError("pass config= or autotune=True, not both")
    if config is not None and config not in CONFIGS:
        raise ValueError(f"{config} is not one of CONFIGS: {', '.join(map(str, CONFIGS))}")
    batch = block_tables.shape[0]
    host_seg = _index_tensor(seg, "seg")
    n = host_seg.numel()
    host_pos = _index_tensor(query_pos, "query_pos", n)
    host_pools = _index_tensor(num_pools, "num_pools", batch)
    if n and (int(host_seg.min()) < 0 or int(host_seg.max()) >= batch):
        t = int(((host_seg < 0) | (host_seg >= batch)).nonzero()[0])
        raise ValueError(
            f"seg[{t}] = {int(host_seg[t])} is not a request: block_tables has {batch} rows"
        )
    if n and int(host_pos.min()) < 0:
        t = int(host_pos.argmin())
        raise ValueError(f"query_pos[{t}] = {int(host_pos[t])}: positions start at 0")
    if batch and int(host_pools.min()) < 0:
        r = int(host_pools.argmin())
        raise ValueError(f"num_pools[{r}] = {int(host_pools[r])} is negative")
    most = int(host_pools.max()) if batch else 0
    cols = triton.cdiv(most * kpool, block_size)
    if cols > block_tables.shape[1]:
        r = int(host_pools.argmax())
        raise ValueError(
            f"request {r}'s {most} pools of {kpool} tokens need {cols} blocks of {block_size} "
            f"but block_tables has {block_tables.shape[1]} columns"
        )
    if max_pools is None:
        max_pools = most
    elif max_pools < most:
        raise ValueError(
            f"max_pools = {max_pools} is below request {int(host_pools.argmax())}'s {most} "
            f"pools: its scores would be cut; pass max_pools >= max(num_pools)"
        )
    if _validate_enabled(validate) and batch:
        if num_blocks is None:
            raise ValueError("validate=True checks block ids: pass num_blocks (the rows')")
        check_block_tables(block_tables, host_pools, kpool, block_size, num_blocks)
    device = block_tables.device
    shape = indexer_shape(
        device=device,
        num_heads=num_heads,
        head_dim=head_dim,
        rows_dtype=rows_dtype,
        q_dtype=q_dtype,
    )
    if autotune:
        config, source = choose_config(shape)[0], "autotune"  # recorded; the autotuner picks
    elif config is not None:
        source = "given"
    elif _INTERPRETED:
        config, source = _INTERPRETER_CONFIG, "interpreter"
    else:
        config, source = choose_config(shape)
    tiles = _tiles(host_seg, host_pos, host_pools, kpool, tokens_per_tile)
    return IndexerScoresPlan(
        num_tokens=n,
        num_heads=num_heads,
        head_dim=head_dim,
        kpool=kpool,
        block_size=block_size,
        max_pools=max_pools,
        rows_dtype=rows_dtype,
        q_dtype=q_dtype,
        softmax_scale=float(softmax_scale),
        shape=shape,
        config=config,
        config_source=source,
        autotune=autotune,
        pool=pool,
        rotary_dim=rotary_dim,
        norm_eps=float(norm_eps),
        block_tables=block_tables,
        query_pos=host_pos.to(device=device, dtype=torch.int32),
        tiles=tiles.to(device),
        _constexprs=dict(
            POOL=POOLS.index(pool),
            ROT=rotary_dim,
            DIM=head_dim,
            KPOOL=kpool,
            BLOCK_H=shape.block_h,
            BLOCK_D=shape.block_d,
            IEEE=q_dtype == torch.float32,
        ),
    )


def _check_pool_transform(
    norm: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    dim: int,
    rotary_dim: int,
    max_pools: int,
) -> None:
    """A ``mean_norm_rope`` run's ``norm [D]``, ``cos`` / ``sin [>= max_pools, rotary_dim]``:
    float32, contiguous last dims, cos and sin alike."""
    if norm is None or cos is None or sin is None:
        raise ValueError(
            "a mean_norm_rope plan (Qwen4-Exp's QSA) needs norm [D] (1 + k_layernorm.weight) "
            "and cos / sin [pools, rotary_dim] (the rotary at each pool's first position)"
        )
    if norm.shape != (dim,) or norm.dtype != torch.float32 or not norm.is_contiguous():
        raise ValueError(
            f"norm must be a contiguous [{dim}] float32 tensor (1 + the indexer's "
            f"k_layernorm.weight), got {tuple(norm.shape)} {norm.dtype}"
        )
    for name, t in (("cos", cos), ("sin", sin)):
        if (
            t.dim() != 2
            or t.shape[0] < max_pools
            or t.shape[1] != rotary_dim
            or t.dtype != torch.float32
            or (rotary_dim > 1 and t.stride(1) != 1)
        ):
            raise ValueError(
                f"{name} must be [>= {max_pools}, {rotary_dim}] float32 with a contiguous last "
                f"dim (one row per pool, the rotary at its first position), got "
                f"{tuple(t.shape)} {t.dtype}"
            )
    if cos.stride() != sin.stride():
        raise ValueError(f"cos and sin must share strides, got {cos.stride()} and {sin.stride()}")


def _check_inputs(
    q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, ape: torch.Tensor
) -> tuple[int, int, int]:
    """The shapes the one-call wrapper and the reference share: ``(N, H, D)``."""
    if q.dim() != 3:
        raise ValueError(f"q must be [N, H, D] (query tokens, heads, index_head_dim), got "
                         f"{tuple(q.shape)}")  # fmt: skip
    n, h, d = q.shape
    if ape.dim() != 2 or ape.shape[1] != d:
        raise ValueError(
            f"ape must be [kpool, D] with q's D = {d} (index_kpool_compress_ape), got "
            f"{tuple(ape.shape)}: q and ape disagree on index_head_dim"
        )
    if weights.shape != (n, h):
        raise ValueError(
            f"weights must be [N, H] = [{n}, {h}] (one weight a query token and head, as q), "
            f"got {tuple(weights.shape)}"
        )
    width = _rows_3d(rows).shape[2]
    if width != 2 * d + 1:
        raise ValueError(
            f"rows hold {width} elements a token but [key | gate | valid] of index_head_dim "
            f"{d} is {2 * d + 1}: the rows were written for another D (or q's D is wrong)"
        )
    return n, h, d


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    rows: torch.Tensor,
    ape: torch.Tensor,
    block_tables: torch.Tensor,
    seg: torch.Tensor,
    query_pos: torch.Tensor,
    num_pools: torch.Tensor,
    softmax_scale: float,
    max_pools: int | None = None,
    out: torch.Tensor | None = None,
    validate: bool | None = None,
    config: IndexerConfig | None = None,
    autotune: bool = False,
) -> torch.Tensor:
    """The pool scores of a DSA indexer with k-pool compression: :func:`plan_indexer_scores`
    and :meth:`IndexerScoresPlan.run` in one call (plan once per forward and run per layer to
    save the host work).

    Shapes: ``q [N, H, D]`` (fp16/bf16/fp32), ``weights [N, H]`` float32, ``rows [num_blocks,
    block_size, (1,) 2 * D + 1]`` (fp16/bf16/fp32, any page and token strides), ``ape [kpool,
    D]`` (float32 after a cast), ``block_tables [R, max_blocks] int32``, ``seg [N]``,
    ``query_pos [N]``, ``num_pools [R]`` (int32/int64). Returns ``[N, max_pools]`` float32
    (``max_pools`` default: ``max(num_pools)``), -inf where a pool is not fully visible."""
    _check_inputs(q, weights, rows, ape)
    r3 = _rows_3d(rows)
    plan = plan_indexer_scores(
        block_tables,
        seg,
        query_pos,
        num_pools,
        num_heads=q.shape[1],
        head_dim=q.shape[2],
        kpool=ape.shape[0],
        block_size=r3.shape[1],
        rows_dtype=r3.dtype,
        q_dtype=q.dtype,
        softmax_scale=softmax_scale,
        max_pools=max_pools,
        config=config,
        autotune=autotune,
        num_blocks=r3.shape[0],
        validate=validate,
    )
    ape = ape.to(torch.float32).contiguous()
    return plan.run(q, weights.to(torch.float32), rows, ape, out=out)


def indexer_scores_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    rows: torch.Tensor,
    ape: torch.Tensor,
    block_tables: torch.Tensor,
    seg: torch.Tensor,
    query_pos: torch.Tensor,
    num_pools: torch.Tensor,
    softmax_scale: float,
    max_pools: int | None = None,
    **_: object,
) -> torch.Tensor:
    """Plain torch, per request: gather the rows of its ``num_pools * kpool`` tokens through
    its block table, pool them (float32 softmax of ``gate + ape`` over each pool's tokens, per
    dim; float32 weighted sum of the keys), score (the pool keys rounded to ``q``'s dtype as
    the kernel's dot takes them, float32 products), mask the pools a token does not fully see
    with -inf. The pooling is transformers' ``Glm5NextTextIndexer.get_pooled_states`` for a
    context without padding, in float32."""
    _, _, d = _check_inputs(q, weights, rows, ape)

    def gated_pools(context: torch.Tensor, pools: int) -> torch.Tensor:
        context = context.float()
        keys = context[:, :d].reshape(pools, kpool, d)
        logits = context[:, d : 2 * d].reshape(pools, kpool, d) + ape.float()[None]
        return (logits.softmax(dim=1) * keys).sum(dim=1)  # [P, D]

    kpool = ape.shape[0]
    return _pool_scores_ref(
        q, weights, rows, block_tables, seg, query_pos, num_pools, softmax_scale, kpool,
        max_pools, gated_pools,
    )  # fmt: skip


def _pool_scores_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    rows: torch.Tensor,
    block_tables: torch.Tensor,
    seg: torch.Tensor,
    query_pos: torch.Tensor,
    num_pools: torch.Tensor,
    softmax_scale: float,
    kpool: int,
    max_pools: int | None,
    pool_keys_of: Callable[[torch.Tensor, int], torch.Tensor],
) -> torch.Tensor:
    """What both references share, per request: gather the rows of its ``num_pools * kpool``
    tokens through its block table (``[P * kpool, row]`` in the rows' dtype), make its ``P``
    pool keys of them (``pool_keys_of(context, P)`` -> ``[P, D]``, the family's pooling),
    round them to ``q``'s dtype as the kernel's dot takes them, and score every query token
    of the request: float32 ReLU of each head's scaled dot, weighted over the heads, -inf where
    the token does not see a pool whole. Returns ``[N, max_pools]`` float32."""
    n = q.shape[0]
    r3 = _rows_3d(rows)
    block_size = r3.shape[1]
    seg, query_pos, num_pools = seg.cpu().long(), query_pos.cpu().long(), num_pools.cpu().long()
    if max_pools is None:
        max_pools = int(num_pools.max()) if num_pools.numel() else 0
    out = torch.full((n, max_pools), float("-inf"), dtype=torch.float32, device=q.device)
    for r in range(num_pools.numel()):
        tokens = (seg == r).nonzero().flatten()
        pools = int(num_pools[r])
        if tokens.numel() == 0 or pools == 0:
            continue
        ctx = torch.arange(pools * kpool)
        blocks = block_tables[r].cpu().long()[ctx // block_size]
        context = r3[blocks.to(r3.device), (ctx % block_size).to(r3.device)]
        pool_keys = pool_keys_of(context, pools).to(q.dtype).float()
        tq = tokens.to(q.device)
        scores = torch.relu(torch.matmul(q[tq].float(), pool_keys.T) * softmax_scale)  # [T,H,P]
        scores = torch.matmul(weights[tq].float().unsqueeze(-2), scores).squeeze(-2)  # [T, P]
        end = torch.arange(pools) * kpool + kpool - 1
        visible = (end[None, :] <= query_pos[tokens][:, None]).to(q.device)
        out[tq, :pools] = scores.masked_fill(~visible, float("-inf"))
    return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def mean_norm_rope_scores_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    rows: torch.Tensor,
    norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    block_tables: torch.Tensor,
    seg: torch.Tensor,
    query_pos: torch.Tensor,
    num_pools: torch.Tensor,
    softmax_scale: float,
    kpool: int,
    norm_eps: float = 1e-6,
    max_pools: int | None = None,
) -> torch.Tensor:
    """Plain torch, per request, of a ``mean_norm_rope`` plan (Qwen4-Exp's QSA indexer,
    transformers' ``Qwen4ExpTextQSAIndexer``): gather the raw keys of its ``num_pools * kpool``
    tokens (``rows [num_blocks, block_size, (1,) D]``) through its block table, average each
    pool's in float32 and round to the rows' dtype, RMS-normalise (times ``norm``, ``1 +
    k_layernorm.weight``; rounded), rotate the first ``cos.shape[1]`` dims by ``cos`` / ``sin``
    (rows: pools; rotate-half, in the rows' dtype), then score as :func:`indexer_scores_ref`
    (keys rounded to ``q``'s dtype, ReLU of each head's scaled dot, weighted head sum, -inf
    where a pool is not wholly visible). Returns ``[N, max_pools]`` float32."""
    d, rot, dtype = q.shape[2], cos.shape[1], rows.dtype

    def mean_norm_rope_pools(context: torch.Tensor, pools: int) -> torch.Tensor:
        pooled = context.reshape(pools, kpool, d).float().mean(dim=1).to(dtype)
        x = pooled.float()
        normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm_eps) * norm).to(dtype)
        c, s = cos[:pools].to(dtype), sin[:pools].to(dtype)
        k_rope = normed[:, :rot]
        return torch.cat([k_rope * c + _rotate_half(k_rope) * s, normed[:, rot:]], dim=-1)

    return _pool_scores_ref(
        q, weights, rows, block_tables, seg, query_pos, num_pools, softmax_scale, kpool,
        max_pools, mean_norm_rope_pools,
    )  # fmt: skip
