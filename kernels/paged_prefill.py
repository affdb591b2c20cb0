"""Paged prefill / extend attention over caches of any layout.

Many query tokens per request attend, causally, to the request's cached prefix plus the new
tokens, all read from the paged caches (the new K/V are written first by the cache-write kernel,
as vLLM's unified Triton attention does). Batches are varlen: request ``r`` has
``q_len = cu_seqlens_q[r+1] - cu_seqlens_q[r]`` query tokens at absolute positions
``seq_lens[r] - q_len .. seq_lens[r] - 1``.

The caches are typed strided views ``[num_blocks, block_size, num_kv_heads, head_dim]``: any
block, token and head strides (K-then-V pages, vLLM 0.33's ``[tokens, heads, K | V]`` pages,
packed pages, head-major pages, layer-outer tensors); only the last dim is contiguous.
Addressing is int64.

Plan once per step, run once per layer (FlashInfer's split): :func:`plan_prefill` takes the
step's block tables, query offsets, lengths and shapes and makes every host decision (config,
grid, the fp8 path, validation); :meth:`PrefillPlan.run` then launches with one layer's ``q`` and
cache views and does no allocation (given ``out``), no environment read and no device sync, so it
can be captured in a CUDA graph. :func:`paged_prefill_attention` is plan + run in one call.

- GQA packing: one program takes ``BLOCK_Q`` query tokens times all ``GROUP`` query heads of one
  KV head as the ``BLOCK_M`` rows of its tile, so each K/V tile is read once per KV head and
  query tile, not once per query head.
- Page walk and load/compute overlap as in ``paged_decode.py``: a one-page tile is a 2-D box
  whose block id is loaded one iteration ahead; a tile of several pages (64-128 keys on
  16-token pages) loads one id per row in its own iteration, which Triton's pipeliner (3.6 as
  well as 3.9) schedules stages ahead of the K/V loads, so K/V are multi-buffered either way.
- Causal masks only on the diagonal: the tiles wholly at or before a program's first query
  position run a loop with no causal or bounds masks; only the tiles from there to the last
  visible key (at most ``BLOCK_Q`` keys past it, rounded to tiles) build and apply the mask.
- Sliding window: keys below the first key visible to a tile are never loaded (their blocks may
  be freed to a null block holding NaN), not just masked after the dot.
- No host sync: programs find their request by a binary search over ``cu_seqlens_q`` (request
  ``r``'s tiles are numbered from ``cu_seqlens_q[r] // BLOCK_Q + r``), so the grid
  ``total_q // BLOCK_Q + B`` needs only host-known sizes; surplus programs exit at once.
- fp8 caches: the tile is converted to the query's dtype as stored and the per-tensor float32
  scales are folded into the scores (``k_scale``) and into the output once (``v_scale``), so a
  cached element costs one conversion, no float32 multiply. GPUs without hardware e4m3 (sm_80)
  get the cache's bytes and decode them in the kernel (exactly).
- Relative-position bias (``plan_prefill(rel_dim=...)``, Inkling): a key ``d`` tokens behind a
  query gets ``rel_states[t, h] @ rel_proj[:, d]`` added to its scaled logit (float32) for
  ``0 <= d < rel_extent``. A tile's rows (query tokens x heads) are ``BLOCK_Q + BLOCK_N - 1``
  consecutive distances away from its keys at most, so one small dot of the rows' states with
  that band of ``rel_proj``'s columns, ``[ROWS, rel_dim] x [rel_dim, BAND]``, holds every
  row's bias, and each row gathers its ``BLOCK_N`` (``tl.gather``); nothing of size ``[tokens,
  heads, rel_extent]`` is built. Scalar bounds split both loops (unmasked, diagonal) in two:
  tiles wholly ``rel_extent`` or more behind the program's first query run unbiased. The band
  stays in registers, so bias launches run 8-warp 64 x 16 or 32 x 32 tiles (``_REL_CONFIGS``;
  4-warp and 128-row tiles spill with it) and never the Hopper path: its 128-row tiles of
  64-128 keys would hold 64-128 band values a thread, where the generic path's 128-row tiles
  already spill 20-1704 B with the bias. The table skips Hopper configs for them and a given
  one is refused.

Configs come from a table of measurements (``_TABLE``: the H200 sweep of 2026-11-26, each row
with its source), keyed by the launch's shape class (:class:`PrefillShape`: architecture, page
segment, head dim, GQA group, cache dtype, and a sequence-length class: the longest query of the
step and the context, bucketed), so a first call compiles one config and never stalls on tuning.
``plan_prefill(autotune=True)`` tunes over ``CONFIGS`` instead, keyed by the same classes (a GPU
only).

Contract (checked only with ``validate=True`` or ``HYBRIDKV_VALIDATE=1``, which syncs):
``cu_seqlens_q`` rises from 0 to ``total_q``; ``1 <= seq_lens[r]``, ``q_len <= seq_lens[r]``
(and ``<= max_query_len``, ``seq_lens[r] <= max_seq_len`` where given); every block id in the
columns below ``cdiv(seq_lens[r], block_size)`` is in ``[0, num_blocks)``. Shapes, dtypes and
strides are always checked on the host. ``max_query_len`` and ``max_seq_len`` only choose the
config: a wrong value costs speed, never correctness.

Hopper path (configs with ``hopper=True``; sm_90+, 16-bit and hardware-fp8 caches): the same
kernel with three changes. A tile inside one page (page segment >= ``BLOCK_N``) comes in by TMA:
``run`` builds a host ``TensorDescriptor`` over the whole ``[num_blocks, block_size, Hkv, D]``
cache per layer (box ``[1, BLOCK_N, 1, D]``; where a layer's strides or base are not whole
16-byte units it takes the pointer path), so the loop has no per-key address math or cp.async
issue. A tile of several pages loads its block ids one tile ahead, so nothing in the loop waits
on them. Pages that are a power of two of at most 64 tokens map keys to pages by shifts. The
compiled loop (``python -m paper.compile_prefill_paths``) keeps one wait on its asynchronous
warpgroup MMAs an iteration. Triton's warp specialization is not used: Triton 3.6 does not
partition this loop on sm_90 and 3.9's Hopper pass fails on a plain TMA matmul. Default
table rows pick the Hopper path where the GPU suite's run 3 (an H200) timed it fastest: d 256 and
d 128 on 16-token page segments, GQA 16 at d 128 on 64-token pages.

Standalone: imports only torch and triton, so the file can be copied into another project.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

# ---- configs and the measured default table ---------------------------------------------------


@dataclass(frozen=True)
class PrefillConfig:
    """One compile-time choice of the kernel."""

    block_m: int  # tile rows: query tokens x the GQA group padded to a power of two
    block_n: int  # keys per tile, a power of two >= 16
    num_warps: int
    num_stages: int  # software-pipelining depth
    # the Hopper path (sm_90+, 16-bit and hardware-fp8 caches): TMA boxes for tiles inside one
    # page, block ids of multi-page tiles loaded a tile ahead, page math by shifts
    hopper: bool = False

    def __str__(self) -> str:
        return (
            f"BLOCK_M={self.block_m},BLOCK_N={self.block_n},num_warps={self.num_warps},"
            f"num_stages={self.num_stages}" + (",hopper" if self.hopper else "")
        )


#: what autotuning tries (``plan_prefill(autotune=True)``) and the compile check compiles; every
#: config of ``_TABLE`` is one of them. The first four are the H200 sweep's winners.
CONFIGS: tuple[PrefillConfig, ...] = (
    PrefillConfig(64, 16, 4, 3),
    PrefillConfig(64, 32, 4, 2),
    PrefillConfig(128, 16, 8, 3),
    PrefillConfig(64, 32, 4, 3),
    PrefillConfig(64, 64, 4, 3),
    PrefillConfig(128, 32, 8, 3),
    PrefillConfig(128, 64, 8, 3),
    PrefillConfig(64, 16, 8, 3),
    PrefillConfig(64, 32, 8, 3),
    PrefillConfig(32, 16, 8, 3),
    PrefillConfig(32, 32, 8, 3),
    # the Hopper path (TMA for tiles inside one page, multi-page ids a tile ahead): the sm_90
    # tiles that compile without spills at head dim 128 (all) and 256 (128 x 32, x 16, 64 x 16)
    # in ``python -m paper.compile_prefill_paths``; 64- and 128-key tiles for 16-token pages
    PrefillConfig(128, 64, 8, 3, hopper=True),
    PrefillConfig(128, 64, 8, 2, hopper=True),
    PrefillConfig(128, 128, 8, 2, hopper=True),
    PrefillConfig(128, 32, 8, 3, hopper=True),
    PrefillConfig(64, 64, 4, 3, hopper=True),
    PrefillConfig(64, 32, 4, 3, hopper=True),
    PrefillConfig(64, 16, 4, 3, hopper=True),
    PrefillConfig(128, 16, 8, 3, hopper=True),
)
#: the caches the Hopper path reads: 16-bit, and fp8 converted in hardware (sm_89+)
_HOPPER_CACHES = ("16bit", "fp8")
#: page segments are capped at the longest tile
_MAX_BLOCK_N = max(c.block_n for c in CONFIGS)


def tokens_per_tile(block_m: int, group: int) -> int:
    """Query tokens per program: ``BLOCK_M`` rows over the padded GQA group."""
    return max(1, block_m // triton.next_power_of_2(group))


#: the installed Triton's (major, minor): register allocation, hence spills, differ by version
_TRITON_VERSION = tuple(int(x) for x in triton.__version__.split(".")[:2])


@dataclass(frozen=True)
class PrefillShape:
    """The shape class a launch's config is chosen by (and autotuning is keyed by)."""

    arch: int  # compute capability as 80, 90, ...; the interpreter counts as 80
    page_align: int  # largest power of two dividing block_size, capped at 64: the segment
    group: int  # query heads per KV head
    head_dim: int  # max(head_dim_k, head_dim_v) padded to a power of two (>= 16)
    cache: str  # "16bit" | "fp32" | "fp8" (converted in hardware) | "fp8-bytes" (in software)
    query: int  # the step's longest query (new tokens of one request), rounded up to 2**k
    context: int  # max_seq_len, rounded up to a power of two
    rel: bool = False  # the launch adds a relative-position bias (rel_dim): generic path only

    @property
    def fp8(self) -> bool:
        return self.cache.startswith("fp8")


@dataclass(frozen=True)
class PrefillRule:
    """One row of the default table: the first row whose ranges (inclusive) all hold for a
    launch's :class:`PrefillShape` gives its config; ``source`` says where the row comes from."""

    config: PrefillConfig
    source: str
    arch: tuple[int, int] = (80, 1000)
    page_align: tuple[int, int] = (1, 64)
    head_dim: tuple[int, int] = (16, 256)
    group: tuple[int, int] = (1, 32)
    query: tuple[int, int] = (1, 1 << 40)
    caches: tuple[str, ...] = ("16bit", "fp32", "fp8", "fp8-bytes")
    #: the newest Triton (major, minor) the row holds for: register allocation, hence spills
    #: and speed, change between versions; a row measured on one version can stop there
    triton: tuple[int, int] = (99, 99)
    rel: bool = False  # a row for relative-bias launches (only those), or for the others

    def matches(self, shape: PrefillShape) -> bool:
        return (
            self.triton >= _TRITON_VERSION
            and self.rel == shape.rel
            and self.arch[0] <= shape.arch <= self.arch[1]
            and self.page_align[0] <= shape.page_align <= self.page_align[1]
            and self.head_dim[0] <= shape.head_dim <= self.head_dim[1]
            and self.group[0] <= shape.group <= self.group[1]
            and self.query[0] <= shape.query <= self.query[1]
            and shape.cache in self.caches
        )


_NOT_FP32 = ("16bit", "fp8", "fp8-bytes")
_H200 = "H200 sweep 2026-11-26 (paper/results/kernels-before-h200-2026-11-26.md), bf16, causal"
_H200_SUITE = (
    "H200 GPU suite run 2, 2026-11-26 (paper/results/h200-suite-2/sweep-NVIDIA-H200.json), "
    "bf16, causal"
)
_H200_SUITE_3 = (
    "H200 GPU suite run 3, 2026-11-27 (paper/results/h200-suite-3/sweep-NVIDIA-H200.json), "
    "causal, one 8k-token request"
)
_P = PrefillConfig

#: Hopper-path configs the sm_90 rule rejects (the spill list or the shared-memory bound) that
#: ran fastest on pages of <= 16 tokens at GQA 8 on an H200 (GPU suite run 3, Triton 3.6) and
#: compile without spills there, each with the newest Triton it is admitted for: 128 x 64 tiles
#: at d 256. bf16 on 2 stages compiles to 255 registers and 0 B of spills under Triton 3.6
#: (paper/results/compile-prefill-paths-triton3.6.md) but spills 108 B under 3.9
#: (compile-prefill-paths.json), so it is admitted up to 3.6 only; e4m3 on 3 stages spills
#: nothing under 3.9 (no 3.6 report) and ran there. On 576-token pages the bf16 one spills 168 B
#: (3.6; it still ran at 477.2 TFLOP/s there, the generic 128/32/8/3 at 376.7).
_HOPPER_PATH_VERIFIED_SMALL_PAGES: dict[tuple[str, int], dict[PrefillConfig, tuple[int, int]]] = {
    ("16bit", 256): {_P(128, 64, 8, 2, hopper=True): (3, 6)},
    ("fp8", 256): {_P(128, 64, 8, 3, hopper=True): (3, 9)},
}

#: the default configs, first match wins. Measured rows name the shape they were measured on
#: (one 8k-token bf16 request, so they match 16-bit caches and steps of >= 1k query tokens on
#: sm_90+); the others are marked unmeasured and say what they are inferred from.
_TABLE: tuple[PrefillRule, ...] = (
    PrefillRule(
        _P(32, 32, 8, 3),
        "unmeasured: relative-bias launches at GQA 3+, d <= 128, 16-bit caches, before Hopper, "
        "up to Triton 3.6: its ptxas holds 64 x 16 on 8 warps (the row below) to 255 registers "
        "and spills 16 B at GQA 4 with a window on sm_80; 32 x 32 on 8 warps compiles to "
        "179-180 registers with no spill (paper/results/compile-prefill-d256-triton-versions). "
        "Triton 3.8 compiles 64 x 16 to 188-195 registers",
        arch=(80, 89),
        head_dim=(16, 128),
        group=(3, 32),
        caches=("16bit",),
        triton=(3, 6),
        rel=True,
    ),
    PrefillRule(
        _P(64, 16, 8, 3),
        "unmeasured: relative-bias launches (Inkling: d 128, GQA 4 and 8), the tile that "
        "compiles without spills with the bias (compile check: 163-194 registers at d 128 on "
        "sm_80 / sm_90, bf16 and e4m3; 230-255 at d 256). GQA 3+: fewer heads a KV head put "
        "more query tokens in a tile and widen the bias band (_REL_CONFIGS)",
        head_dim=(16, 128),
        group=(3, 32),
        caches=("16bit", "fp32"),
        rel=True,
    ),
    PrefillRule(
        _P(64, 16, 8, 3),
        "unmeasured: as the row above at d 256, and for fp8 caches at d >= 128 (pre-Hopper "
        "fp8 at d 64 has no 64 x 16 tile on 8 warps: it spills there without the bias; fp32 "
        "at d 256 overflows the 99 KB of sm_86/89)",
        head_dim=(128, 256),
        group=(3, 32),
        caches=_NOT_FP32,
        rel=True,
    ),
    PrefillRule(
        _P(32, 32, 8, 3),
        "unmeasured: relative-bias launches at GQA 1-2, d <= 128 on 16-bit caches: 64-row "
        "tiles hold 16-32 band values a thread there and spill (8-100 B), 32 x 32 on 8 warps "
        "holds 8 and does not (compile check: 176-183 registers)",
        page_align=(16, 64),
        head_dim=(16, 128),
        group=(1, 2),
        caches=("16bit",),
        rel=True,
    ),
    PrefillRule(
        _P(128, 64, 8, 2, hopper=True),
        f"{_H200_SUITE_3}: Qwen3-Next (16 q / 2 KV heads, d 256) on 16-token pages, bf16, "
        "454.1 TFLOP/s; the generic 128/64/8/3 313.3 in the same run (359.5 in run 2), the "
        "Hopper path's 128/32/8/3 347.1. GQA 8 and Triton <= 3.6 only: it spills at GQA 1 "
        "and under Triton 3.9 (compile check), where the next row applies",
        arch=(90, 1000),
        page_align=(16, 16),
        head_dim=(256, 256),
        group=(8, 8),
        query=(1024, 1 << 40),
        caches=("16bit",),
        triton=_HOPPER_PATH_VERIFIED_SMALL_PAGES[("16bit", 256)][_P(128, 64, 8, 2, hopper=True)],
    ),
    PrefillRule(
        _P(128, 64, 8, 3, hopper=True),
        f"{_H200_SUITE_3}: Qwen3-Next (d 256, GQA 8) on 16-token pages, e4m3 cache, "
        "277.1 TFLOP/s; the generic 128/64/8/3 244.5, the Hopper path on 2 stages 265.9. "
        "Triton <= 3.9 (the newest it compiled without spills under)",
        arch=(90, 1000),
        page_align=(16, 16),
        head_dim=(256, 256),
        group=(8, 8),
        query=(1024, 1 << 40),
        caches=("fp8",),
        triton=_HOPPER_PATH_VERIFIED_SMALL_PAGES[("fp8", 256)][_P(128, 64, 8, 3, hopper=True)],
    ),
    PrefillRule(
        _P(128, 128, 8, 2, hopper=True),
        f"{_H200_SUITE_3}, d 128, bf16, pages whose segment is 16 tokens: Nemotron-H (GQA 4) "
        "on 16-token pages 381.8 TFLOP/s (generic 128/64/8/3: 280.1) and on 272-token pages "
        "304.0 (286.3), GQA 1 on 16-token pages 295.7 (218.8)",
        arch=(90, 1000),
        page_align=(16, 16),
        head_dim=(128, 128),
        query=(1024, 1 << 40),
        caches=("16bit",),
    ),
    PrefillRule(
        _P(64, 64, 4, 3, hopper=True),
        f"{_H200_SUITE_3}: GQA 16 (32 q / 2 KV heads, d 128) on 64-token pages, bf16, "
        "427.3 TFLOP/s; generic 128/64/8/3 403.2, the Hopper path's 128/128/8/2 368.5",
        arch=(90, 1000),
        page_align=(64, 64),
        head_dim=(128, 128),
        group=(16, 16),
        query=(1024, 1 << 40),
        caches=("16bit",),
    ),
    PrefillRule(
        _P(128, 64, 8, 3),
        f"{_H200_SUITE}: Qwen3-Next (16 q / 2 KV heads, d 256), one 8k request on 16-token "
        "pages, 359.5 TFLOP/s (357.2 in run 1); 64/16/4/3 (the first sweep's pick) 249.8. "
        "GQA 8 only: at GQA 1 and 4 it spills 4 B (compile check)",
        arch=(90, 1000),
        page_align=(16, 16),
        head_dim=(256, 256),
        group=(8, 8),
        query=(1024, 1 << 40),
        caches=("16bit", "fp8"),
    ),
    PrefillRule(
        _P(64, 32, 8, 3),
        "unmeasured: d 256 on 16-token pages at GQA other than 8 (the measured 128 x 64 tile "
        "spills there): the 64 x 32 tile on 8 warps, which compiles without spills under "
        "Triton 3.6, 3.8 and 3.9 (187-248 registers, bf16 and e4m3). The sweep's third best at "
        f"GQA 8, the same tile on 4 warps ({_H200_SUITE}: 293.3 TFLOP/s, 128 x 64: 359.5, "
        "64 x 16: 249.8), spills 32-40 B under 3.6 and 68-76 B under 3.8 (ptxas 12.9 for "
        "sm_90) at GQA 1 with e4m3 (compile check); under 3.9 it spilled nothing",
        arch=(90, 1000),
        page_align=(16, 16),
        head_dim=(256, 256),
        query=(1024, 1 << 40),
        caches=("16bit", "fp8"),
    ),
    PrefillRule(
        _P(128, 64, 8, 3),
        f"{_H200_SUITE}: one 8k request at d 128: Nemotron-H (GQA 4) on 16- and 272-token "
        "pages 279.4 / 286.0 TFLOP/s (128/16/8/3, the first sweep's pick: 176), GQA 1 on "
        "16-token pages 220.2 (137.3), GQA 16 on 64-token pages 403.7 (64/32/4/3: 346.9)",
        arch=(90, 1000),
        page_align=(16, 64),
        head_dim=(128, 128),
        query=(1024, 1 << 40),
        caches=("16bit",),
    ),
    PrefillRule(
        _P(128, 32, 8, 3),
        f"{_H200_SUITE}: Qwen3-Next (d 256) on 576-token pages, one 8k request, 376.3 TFLOP/s "
        "(64/32/4/3: 328.9, and it spills 8-56 B at GQA 1-4 in the compile check); "
        "128/64/8/3 is out of shared memory there under Triton 3.6 (262,144 B)",
        arch=(90, 1000),
        page_align=(32, 64),
        head_dim=(256, 256),
        caches=_NOT_FP32,
    ),
    PrefillRule(
        _P(64, 16, 4, 3),
        "unmeasured: the d 256 16-token-page winner (209.5 TFLOP/s) for other caches, shorter "
        "steps and pages of fewer than 16 tokens",
        arch=(90, 1000),
        page_align=(1, 16),
        head_dim=(256, 256),
        caches=_NOT_FP32,
    ),
    PrefillRule(
        _P(64, 16, 8, 3),
        "unmeasured: pre-Hopper, d 256: the sm_90 winners (64/16/4/3, 64/32/4/*) spill on "
        "sm_80 (48-650 B); the same 64-row tile on 8 warps does not (201 registers, 234 with "
        "e4m3 bytes) and fits the 99 KB of sm_86/89",
        arch=(80, 89),
        head_dim=(256, 256),
        caches=_NOT_FP32,
    ),
    PrefillRule(
        _P(128, 16, 8, 3),
        "unmeasured: the first sweep's d 128 16-token-page winner (Nemotron-H, 176.6 TFLOP/s "
        "on sm_90, where the GPU suite's 128 x 64 tile now leads for 16-bit caches) for other "
        "caches, head dims <= 64, smaller pages and sm_80 (179 registers there)",
        arch=(90, 1000),
        page_align=(1, 16),
        head_dim=(16, 128),
        query=(1024, 1 << 40),
        caches=_NOT_FP32,
    ),
    PrefillRule(
        _P(128, 16, 8, 3),
        "unmeasured: the first sweep's d 128 16-token-page winner (Nemotron-H, 176.6 TFLOP/s "
        "on sm_90, where the GPU suite's 128 x 64 tile now leads for 16-bit caches) for other "
        "caches, head dims <= 64, smaller pages and sm_80 (179 registers there)",
        arch=(80, 89),
        page_align=(1, 16),
        head_dim=(16, 128),
        query=(1024, 1 << 40),
        caches=("16bit",),
    ),
    PrefillRule(
        _P(64, 16, 8, 3),
        "unmeasured: pre-Hopper fp8 at d 128 and small pages, steps of < 1k query tokens: "
        "the 64 x 16 tile of the row below spills 4 B on 4 warps there (e5m2, since the loop "
        "was split into unmasked and diagonal tiles); on 8 warps it does not",
        arch=(80, 89),
        page_align=(1, 16),
        head_dim=(128, 128),
        caches=("fp8", "fp8-bytes"),
    ),
    PrefillRule(
        _P(64, 16, 4, 3),
        "unmeasured: pre-Hopper fp8 at d <= 64 and small pages: the same tile on 8 warps "
        "spills 8 B at GQA 1 with e4m3 bytes (compile check, table defaults); on 4 warps it "
        "compiles clean at d 64",
        arch=(80, 89),
        page_align=(1, 16),
        head_dim=(16, 64),
        caches=("fp8", "fp8-bytes"),
    ),
    PrefillRule(
        _P(64, 16, 4, 3),
        "unmeasured: steps of < 1k query tokens on small pages: half the rows of the 128-row "
        "winner give twice the programs, where a short step has few",
        page_align=(1, 16),
        head_dim=(16, 128),
        caches=("16bit",),
    ),
    PrefillRule(
        _P(64, 16, 4, 3),
        "unmeasured: as the row above, for fp8 caches on sm_90",
        arch=(90, 1000),
        page_align=(1, 16),
        head_dim=(16, 128),
        caches=("fp8", "fp8-bytes"),
    ),
    PrefillRule(
        _P(64, 32, 4, 3),
        "unmeasured: the d 128 256-token-page winner (Nemotron-H, 237.6 TFLOP/s on sm_90) for "
        "32- and 64-token segments, other caches, head dims <= 64, short steps and sm_80",
        page_align=(32, 64),
        head_dim=(16, 128),
        caches=_NOT_FP32,
    ),
    PrefillRule(
        _P(64, 16, 8, 3),
        "unmeasured: fp32 caches (tf32 dots on a GPU; the CPU tests) at d <= 128: fp32 tiles "
        "take twice the registers, so the 64-row 16-key tile on 8 warps (172 registers on "
        "sm_80, 160 on sm_90)",
        head_dim=(16, 128),
        caches=("fp32",),
    ),
    PrefillRule(
        _P(32, 16, 8, 3),
        "unmeasured: fp32 caches at d 256: every 64-row tile spills or overflows 99 KB of "
        "shared memory somewhere (sm_86/89); 32 rows do not",
        page_align=(16, 64),
        head_dim=(256, 256),
        caches=("fp32",),
    ),
)

#: shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin); unknown GPUs get the least
_SHARED_BYTES = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448}
_SHARED_FALLBACK = 101376

#: pre-Hopper GPUs (mma.sync, sm_80/86/89): the configs that compile without spills, by (cache
#: class, head-dim class), from ``python -m paper.compile_kernels`` over every config on
#: 16- and 576-token pages (triton 3.9's ptxas; "fp8": e4m3 bytes and e5m2 both spill-free).
#: The kernel before the plan/run rework (same triton) had smaller sets, e.g. 16-bit d 128:
#: only 64 x 32 on 4 warps and 128 x 32 on 8; this one folds the fp8 scales out of the tiles
#: and works in exp2.
_PRE_HOPPER: dict[tuple[str, int], frozenset[PrefillConfig]] = {
    # 64 x 32 at 8 warps spills 8 B at GQA 8 on 16-token pages (128 registers; compile check
    # of the attention-sink cases, d 64, with and without sinks)
    ("16bit", 64): frozenset(
        {
            _P(64, 16, 4, 3),
            _P(64, 32, 4, 2),
            _P(128, 16, 8, 3),
            _P(64, 32, 4, 3),
            _P(64, 64, 4, 3),
            _P(128, 32, 8, 3),
            _P(128, 64, 8, 3),
            _P(64, 16, 8, 3),
            _P(32, 16, 8, 3),
            _P(32, 32, 8, 3),
        }
    ),
    # 64 x 64 tiles at 4 warps spill 20-84 B, 128 x 64 at 8 warps 32 B on 576-token pages
    ("16bit", 128): frozenset(
        {
            _P(64, 16, 4, 3),
            _P(64, 32, 4, 2),
            _P(128, 16, 8, 3),
            _P(64, 32, 4, 3),
            _P(128, 32, 8, 3),
            _P(64, 16, 8, 3),
            _P(64, 32, 8, 3),
            _P(32, 16, 8, 3),
            _P(32, 32, 8, 3),
        }
    ),
    # 64 rows on 4 warps and 128 rows on 8 hold 128 accumulator values a thread: spills
    ("16bit", 256): frozenset(
        {_P(64, 16, 8, 3), _P(64, 32, 8, 3), _P(32, 16, 8, 3), _P(32, 32, 8, 3)}
    ),
    # e4m3 bytes: 64 x 32 at 8 warps spills 16 B; since the per-row block ids of multi-page
    # tiles, 64 x 16 at 8 warps 8 B (GQA 1) and 128 x 16 at 8 warps 12-16 B
    ("fp8", 64): frozenset(
        {
            _P(64, 16, 4, 3),
            _P(64, 32, 4, 2),
            _P(64, 32, 4, 3),
            _P(64, 64, 4, 3),
            _P(128, 32, 8, 3),
            _P(128, 64, 8, 3),
            _P(32, 16, 8, 3),
            _P(32, 32, 8, 3),
        }
    ),
    # 128 x 32 / 128 x 64 at 8 warps, 64 x 64 at 4 and (e5m2) 32 x 32 at 8 spill; since the
    # loop split in two (unmasked tiles, then the diagonal) 64 x 16 at 4 warps spills 4 B (e5m2)
    ("fp8", 128): frozenset(
        {
            _P(64, 32, 4, 2),
            _P(128, 16, 8, 3),
            _P(64, 32, 4, 3),
            _P(64, 16, 8, 3),
            _P(64, 32, 8, 3),
            _P(32, 16, 8, 3),
        }
    ),
    ("fp8", 256): frozenset(
        {_P(64, 16, 8, 3), _P(64, 32, 8, 3), _P(32, 16, 8, 3), _P(32, 32, 8, 3)}
    ),
}

_PRE_HOPPER.update(
    {
        # fp32 caches (tf32 dots on a GPU): Q and K/V in fp32 registers, so fewer configs
        ("fp32", 64): _PRE_HOPPER[("16bit", 64)],
        ("fp32", 128): frozenset(
            {
                _P(128, 16, 8, 3),
                _P(128, 32, 8, 3),
                _P(64, 16, 4, 3),
                _P(64, 16, 8, 3),
                _P(64, 32, 8, 3),
                _P(32, 16, 8, 3),
            }
        ),
        ("fp32", 256): frozenset({_P(64, 16, 8, 3), _P(32, 16, 8, 3), _P(32, 32, 8, 3)}),
    }
)

#: configs the sm_90 rule admits that ptxas still spills (the compile check): 2 stages of
#: 64 x 32 tiles at d 256 on 4 warps (8-12 B; with 3 stages: none)
_HOPPER_SPILLS: dict[tuple[str, int], frozenset[PrefillConfig]] = {
    ("16bit", 256): frozenset({_P(64, 32, 4, 2)}),
    # 8 B (e4m3 with int64 addressing); 32 x 16 at 8 warps 20 B (e4m3, GQA 1, int64)
    ("fp8", 256): frozenset({_P(32, 32, 8, 3), _P(32, 16, 8, 3)}),
    ("fp8", 128): frozenset({_P(32, 32, 8, 3)}),  # 8 B (e5m2, GQA 8)
}

#: configs the sm_90 rule's shared-memory bound rejects that compile without spills and ran on
#: an H200 (GPU suite run 2) on pages of <= 16 tokens at GQA 8 (at GQA 1 and 4 they spill 4 B;
#: GQA 16 is unchecked): 128 x 64 tiles at d 256 keep Q in
#: registers for wgmma and stage only 3 K/V buffers (196,864 B bf16, 164,096 B e4m3; 252-255
#: registers), where the bound counts Q and P in shared memory too. On single-page tiles
#: (pages of >= 32 tokens) Triton 3.6 stages a fourth buffer and runs out (262,144 B).
_HOPPER_VERIFIED_SMALL_PAGES: dict[tuple[str, int], frozenset[PrefillConfig]] = {
    ("16bit", 256): frozenset({_P(128, 64, 8, 3)}),
    ("fp8", 256): frozenset({_P(128, 64, 8, 3)}),
}


#: Hopper-path configs the sm_90 rule admits that ptxas spills (``python -m
#: paper.compile_prefill_paths``, 16- and 576-token pages, GQA 1 and 8): at head dim 256,
#: 128 x 64 tiles on 2 stages (32-112 B) and 64 x 32 on 4 warps (20-44 B)
_HOPPER_PATH_SPILLS: dict[tuple[str, int], frozenset[PrefillConfig]] = {
    key: frozenset({_P(128, 64, 8, 2, hopper=True), _P(64, 32, 4, 3, hopper=True)})
    for key in (("16bit", 256), ("fp8", 256))
}


#: relative-bias launches (``rel_dim``): the configs that compile without spills, each with the
#: widest head dim checked (``python -m paper.compile_kernels`` over every 8-warp config, d 128
#: GQA 1/2/4/8 and d 256 GQA 8, bf16 and e4m3, sm_80 and sm_90). The bias band
#: ``[BLOCK_M, BAND]`` float32, the rows' states and the gather's indices stay in registers
#: beside the tile, so 4-warp tiles spill (4-152 B at d 128) and 128-row ones too (20-1704 B
#: but GQA 8 at 16 keys); 32 x 16 is held to 128 registers and spills 8-20 B.
_REL_CONFIGS: dict[PrefillConfig, int] = {_P(64, 16, 8, 3): 256, _P(32, 32, 8, 3): 128}


def _rel_band_values(config: PrefillConfig, shape: PrefillShape) -> int:
    """Float32 values of the relative bias's band a thread holds: ``BLOCK_M`` rows by ``BAND =
    2 * max(BLOCK_Q, BLOCK_N)`` distances (``_rel_bias``)."""
    band = 2 * max(tokens_per_tile(config.block_m, shape.group), config.block_n)
    return config.block_m * band // (32 * config.num_warps)


def _rel_fits(config: PrefillConfig, shape: PrefillShape) -> bool:
    """Whether a relative-bias launch compiles without spills at ``config``: a config of
    ``_REL_CONFIGS`` at most as wide as checked whose band is at most 8 values a thread (64 x
    16 at GQA 2 holds 16 and spills 8 B on sm_80, at GQA 1 32 and spills 36-100 B). The Hopper
    path is not taken (see the module's docstring)."""
    widest = _REL_CONFIGS.get(config, 0)
    return shape.head_dim <= widest and _rel_band_values(config, shape) <= 8


def _width_class(head_dim: int) -> int:
    """The head-dim class the spill rules are measured for: 64 (and below), 128, 256."""
    return max(64, head_dim)


def shared_bytes(config: PrefillConfig, shape: PrefillShape) -> int:
    """An upper bound of the kernel's shared memory (checked against the compile check's
    ``metadata.shared``): the pipelined K and V tiles as stored (``num_stages`` buffers on
    sm_90, ``num_stages - 1`` before), their converted copies when the cache is fp8, the packed
    Q tile, P, and 1 KiB of reduction scratch."""
    item = {"16bit": 2, "fp32": 4}.get(shape.cache, 1)
    q_item = 4 if shape.cache == "fp32" else 2
    buffers = config.num_stages if shape.arch >= 90 else config.num_stages - 1
    kv = buffers * config.block_n * 2 * shape.head_dim * item
    if shape.fp8:
        kv += config.block_n * 2 * shape.head_dim * q_item
    return kv + config.block_m * (shape.head_dim + config.block_n) * q_item + 1024


def config_fits(config: PrefillConfig, shape: PrefillShape) -> bool:
    """Whether ``config`` compiles for ``shape`` without spills and within shared memory (the
    rule matches ``python -m paper.compile_kernels`` over ``CONFIGS`` at head dims 64-256 on
    pages of 1, 8, 16 and 576 tokens, every cache dtype; it may reject a config that would
    compile well, never admit one that spills; the test suite checks the table against it).
    Pre-Hopper GPUs: the measured sets of ``_PRE_HOPPER``. sm_90 (wgmma keeps the accumulator
    of a warpgroup's 64 rows in registers): at most 128 float32 accumulator values and 64
    K-tile values a thread, less the measured exceptions of ``_HOPPER_SPILLS``, plus those of
    ``_HOPPER_VERIFIED_SMALL_PAGES``."""
    if triton.next_power_of_2(shape.group) > config.block_m or shape.head_dim > 256:
        return False  # more rows than the config's, or wider than anything checked
    if shape.rel and not _rel_fits(config, shape):
        return False
    if shape.page_align < 16 and (config.block_n > 16 or config.block_m < 64):
        # segments of 1-8 tokens: their addresses take registers; on pages of 8 and 1 tokens
        # 32-key tiles and 32-row tiles spill 4-56 B where 16-key tiles of 64+ rows do not
        return False
    key = ("fp8" if shape.fp8 else shape.cache, _width_class(shape.head_dim))
    if config.hopper:
        if shape.arch < 90 or shape.cache not in _HOPPER_CACHES or shape.rel:
            return False
        newest = _HOPPER_PATH_VERIFIED_SMALL_PAGES.get(key, {}).get(config)
        small_pages = shape.page_align <= 16 and shape.group == 8
        if small_pages and newest is not None and newest >= _TRITON_VERSION:
            return True
        if config in _HOPPER_PATH_SPILLS.get(key, ()):
            return False
    verified = _HOPPER_VERIFIED_SMALL_PAGES.get(key, ())
    if (
        not config.hopper
        and shape.arch >= 90
        and shape.page_align <= 16
        and shape.group == 8
        and config in verified
    ):
        return True
    if shared_bytes(config, shape) > _SHARED_BYTES.get(shape.arch, _SHARED_FALLBACK):
        return False
    if shape.arch < 90:
        return config in _PRE_HOPPER.get(key, ())
    # fp32 caches: Q and the K/V tiles are fp32 too, so half the accumulator and tile values
    wide = 2 if shape.cache == "fp32" else 1
    threads = 32 * config.num_warps
    if config.block_m * shape.head_dim * wide > 128 * threads:
        return False
    if config.block_n * shape.head_dim * wide > 64 * threads:
        return False
    return config not in _HOPPER_SPILLS.get(key, ())


def choose_config(shape: PrefillShape) -> tuple[PrefillConfig, str]:
    """The default config of a shape class and where it comes from (a ``_TABLE`` row, or the
    first config of ``CONFIGS`` that fits when no row matches)."""
    for rule in _TABLE:
        if rule.matches(shape) and config_fits(rule.config, shape):
            return rule.config, rule.source
    for config in CONFIGS:
        if config_fits(config, shape):
            return config, "no table row: the first config that fits"
    # nothing is verified this wide or with this many heads per KV head: the smallest tile
    config = min(CONFIGS, key=lambda c: (c.block_m, c.block_n, -c.num_warps, c.num_stages))
    return config, "no config is checked for this shape class: the smallest tile (may spill)"


# ---- kernel -----------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["tune_query", "tune_context"])
def _prefill_kernel(
    q_ptr,  # [total_q, Hq, Dk]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, Dk], strided (uint8 bytes when FP8 == 2)
    v_cache_ptr,  # [num_blocks, block_size, Hkv, Dv], strided
    k_desc,  # KV_TMA: a TensorDescriptor of k_cache, box [1, BLOCK_N, 1, BLOCK_DK]; else unused
    v_desc,  # KV_TMA: likewise of v_cache, box [1, BLOCK_N, 1, BLOCK_DV]
    table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32, total KV length incl. the new tokens
    cu_q_ptr,  # [B + 1] int32
    k_scale_ptr,  # [1] float32 (read only when FP8)
    v_scale_ptr,  # [1] float32
    sinks_ptr,  # [Hq] float32 attention-sink logits (read only when HAS_SINKS)
    rel_states_ptr,  # [total_q, Hq, D_REL] in q's dtype, last dim contiguous (HAS_REL)
    rel_proj_ptr,  # [D_REL, rel_extent] in q's dtype, last dim contiguous (HAS_REL)
    out_ptr,  # [total_q, Hq, Dv]
    sm_scale,
    batch,
    block_size,
    window,  # <= 0: full causal attention
    rel_extent,  # HAS_REL: distances 0 .. rel_extent - 1 get a bias, farther keys none
    stride_rs_t,  # rel_states' strides (HAS_REL)
    stride_rs_h,
    stride_rp_r,  # rel_proj's row stride (HAS_REL)
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
    tune_query,  # longest-query bucket: read only by autotuning's key
    tune_context,  # context bucket: likewise
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    HEAD_DIM_K: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGE_ALIGN: tl.constexpr,  # largest power of two dividing block_size (capped)
    FP8: tl.constexpr,  # 0: no fp8; 1: fp8 cache converted in hardware; 2: e4m3 bytes
    IDS_AHEAD: tl.constexpr,  # multi-page tiles load the next tile's block ids one tile ahead
    POW2_PAGES: tl.constexpr,  # block_size == PAGE_ALIGN: page math by shifts, no division
    KV_TMA: tl.constexpr,  # one-page tiles come in by TMA through k_desc / v_desc
    HAS_SINKS: tl.constexpr,  # per-head sink logits join each softmax's denominator
    HAS_REL: tl.constexpr,  # a relative-position bias rel_states @ rel_proj[:, distance]
    D_REL: tl.constexpr,  # relative states per head (HAS_REL)
    BLOCK_R: tl.constexpr,  # D_REL padded for tl.dot (>= 16)
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
    # finite initial max: fully masked rows (padding, or no key yet) stay finite
    b_m = tl.full([ROWS], -1e30, tl.float32)
    b_l = tl.zeros([ROWS], tl.float32)
    if HAS_SINKS:  # a sink is one more logit with no value: the softmax starts from it
        b_m = tl.load(sinks_ptr + rows_h, mask=offs_g < GROUP, other=0.0) * 1.4426950408889634
        b_l = tl.full([ROWS], 1.0, tl.float32)
    b_acc = tl.zeros([ROWS, BLOCK_DV], tl.float32)
    hi = tl.minimum(seq_len, ctx + q_first + BLOCK_Q)
    lo = 0
    if window > 0:  # the first key the tile's first query sees
        lo = tl.maximum(0, ctx + q_first - window + 1)
    tile_lo = lo // BLOCK_N * BLOCK_N  # BLOCK_N-aligned, so segments stay inside pages

    p_k_head = k_cache_ptr + i_kvh.to(tl.int64) * stride_kc_head
    p_v_head = v_cache_ptr + i_kvh.to(tl.int64) * stride_vc_head
    p_table = table_ptr + req.to(tl.int64) * stride_table_b
    offs_seg = tl.arange(0, BLOCK_N) % SEG
    offs_k_row = offs_seg[:, None] * stride_kc_token + offs_dk[None, :]
    offs_v_row = offs_seg[:, None] * stride_vc_token + offs_dv[None, :]

    # Tiles wholly at or before the tile's first query position are visible to every row: no
    # causal mask, no bounds (a window masks every tile, so then all go the masked way). The
    # tiles from there to ``hi`` hold the diagonal.
    full_end = tile_lo
    if window <= 0:
        full_end = (ctx + q_first + 1) // BLOCK_N * BLOCK_N
    seg_block = _first_block_id(
        p_table, tile_lo, hi, block_size, PAGES, IDS_AHEAD, POW2_PAGES, PAGE_ALIGN, BLOCK_N
    )
    # HAS_REL: tiles wholly more than rel_extent - 1 keys behind the tile's first query get
    # no bias; they run the plain loops, the others the biased ones (bounds, not a per-tile test)
    plain_end = full_end
    masked_plain_end = hi
    rel_q = q  # HAS_REL: the rows' relative states [ROWS, BLOCK_R]; else unused
    p_rel = q_ptr
    if HAS_REL:
        offs_i = tl.arange(0, BLOCK_R)
        p_rs = rel_states_ptr + (rows_t * stride_rs_t + rows_h * stride_rs_h)[:, None]
        m_i = offs_i < D_REL
        rel_q = tl.load(p_rs + offs_i[None, :], mask=m_r[:, None] & m_i[None, :], other=0.0)
        p_rel = rel_proj_ptr + offs_i.to(tl.int64)[:, None] * stride_rp_r  # int64 row bases
        band = tl.maximum(ctx + q_first - rel_extent + 1, 0) // BLOCK_N * BLOCK_N
        plain_end = tl.minimum(tl.maximum(band, tile_lo), full_end)
        masked_plain_end = tl.minimum(tl.maximum(band, full_end), hi)
    b_m, b_l, b_acc, seg_block = _attend_tiles(
        tile_lo, plain_end, q, qk_scale, b_m, b_l, b_acc, rel_q, p_rel, rel_extent, pos_r,
        ctx + q_first, p_k_head, p_v_head, k_desc, v_desc, i_kvh, p_table, seg_block, lo, hi,
        window, block_size, stride_kc_block, stride_kc_token, stride_vc_block,
        stride_vc_token, offs_k_row, offs_v_row, offs_dk, offs_dv, m_dk, m_dv, False, False,
        FP8, BLOCK_N, PAGES, IDS_AHEAD, POW2_PAGES, PAGE_ALIGN, KV_TMA, D_REL, BLOCK_R,
        BLOCK_Q, GROUP_PAD,
    )  # fmt: skip
    if HAS_REL:
        b_m, b_l, b_acc, seg_block = _attend_tiles(
            plain_end, full_end, q, qk_scale, b_m, b_l, b_acc, rel_q, p_rel, rel_extent,
            pos_r, ctx + q_first, p_k_head, p_v_head, k_desc, v_desc, i_kvh, p_table,
            seg_block, lo, hi, window, block_size, stride_kc_block, stride_kc_token,
            stride_vc_block, stride_vc_token, offs_k_row, offs_v_row, offs_dk, offs_dv, m_dk,
            m_dv, False, True, FP8, BLOCK_N, PAGES, IDS_AHEAD, POW2_PAGES, PAGE_ALIGN,
            KV_TMA, D_REL, BLOCK_R, BLOCK_Q, GROUP_PAD,
        )  # fmt: skip
    # seg_block now holds the ids of the tile at full_end (loaded ahead by the last full tile)
    b_m, b_l, b_acc, seg_block = _attend_tiles(
        full_end, masked_plain_end, q, qk_scale, b_m, b_l, b_acc, rel_q, p_rel, rel_extent,
        pos_r, ctx + q_first, p_k_head, p_v_head, k_desc, v_desc, i_kvh, p_table, seg_block,
        lo, hi, window, block_size, stride_kc_block, stride_kc_token, stride_vc_block,
        stride_vc_token, offs_k_row, offs_v_row, offs_dk, offs_dv, m_dk, m_dv, True, False,
        FP8, BLOCK_N, PAGES, IDS_AHEAD, POW2_PAGES, PAGE_ALIGN, KV_TMA, D_REL, BLOCK_R,
        BLOCK_Q, GROUP_PAD,
    )  # fmt: skip
    if HAS_REL:
        b_m, b_l, b_acc, seg_block = _attend_tiles(
            masked_plain_end, hi, q, qk_scale, b_m, b_l, b_acc, rel_q, p_rel, rel_extent,
            pos_r, ctx + q_first, p_k_head, p_v_head, k_desc, v_desc, i_kvh, p_table,
            seg_block, lo, hi, window, block_size, stride_kc_block, stride_kc_token,
            stride_vc_block, stride_vc_token, offs_k_row, offs_v_row, offs_dk, offs_dv, m_dk,
            m_dv, True, True, FP8, BLOCK_N, PAGES, IDS_AHEAD, POW2_PAGES, PAGE_ALIGN,
            KV_TMA, D_REL, BLOCK_R, BLOCK_Q, GROUP_PAD,
        )  # fmt: skip

    out = b_acc * (out_scale / b_l)[:, None]
    tl.store(
        out_ptr + (rows_t * stride_out_t + rows_h * stride_out_h)[:, None] + offs_dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_r[:, None] & m_dv[None, :],
    )


@triton.jit
def _attend_tiles(
    first,  # first tile, a multiple of BLOCK_N
    last,  # the loop stops before this key
    q,  # [ROWS, BLOCK_DK] in the dots' dtype
    qk_scale,
    b_m,  # the online softmax's running max, sum and accumulator
    b_l,
    b_acc,
    rel_q,  # BIAS: [ROWS, BLOCK_R] the rows' relative states
    p_rel,  # BIAS: [BLOCK_R, 1] pointers to rel_proj's rows
    rel_extent,
    pos_r,  # [ROWS] the rows' absolute positions
    pos_first,  # the program's first query position
    p_k_head,
    p_v_head,
    k_desc,
    v_desc,
    i_kvh,
    p_table,
    seg_block,  # the ids of tile ``first``, loaded ahead (see _first_block_id)
    lo,
    hi,
    window,
    block_size,
    stride_kc_block,
    stride_kc_token,
    stride_vc_block,
    stride_vc_token,
    offs_k_row,
    offs_v_row,
    offs_dk,
    offs_dv,
    m_dk,
    m_dv,
    MASKED: tl.constexpr,  # the diagonal's tiles or a window's: causal and bounds masks
    BIAS: tl.constexpr,  # add the relative-position bias (_rel_bias) to the scores
    FP8: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGES: tl.constexpr,
    IDS_AHEAD: tl.constexpr,
    POW2_PAGES: tl.constexpr,
    PAGE_ALIGN: tl.constexpr,
    KV_TMA: tl.constexpr,
    D_REL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    GROUP_PAD: tl.constexpr,
):
    """The online softmax over the tiles ``first, first + BLOCK_N, ...`` below ``last``:
    ``(b_m, b_l, b_acc)`` and the block id(s) of the tile after them."""
    for tile in range(first, last, BLOCK_N):
        k, v, seg_block = _kv_tile(
            p_k_head, p_v_head, k_desc, v_desc, i_kvh, p_table, seg_block, tile, lo, hi,
            block_size, stride_kc_block, stride_kc_token, stride_vc_block, stride_vc_token,
            offs_k_row, offs_v_row, offs_dk, offs_dv, m_dk, m_dv, q.dtype, MASKED, FP8,
            BLOCK_N, PAGES, IDS_AHEAD, POW2_PAGES, PAGE_ALIGN, KV_TMA,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [ROWS, BLOCK_N]
        if BIAS:
            s += _rel_bias(
                rel_q, p_rel, pos_first - tile, rel_extent, D_REL, BLOCK_R, BLOCK_Q, GROUP_PAD,
                BLOCK_N,
            )  # fmt: skip
        if MASKED:
            offs_n = tile + tl.arange(0, BLOCK_N)
            visible = (offs_n[None, :] >= lo) & (offs_n[None, :] <= pos_r[:, None])
            visible = visible & (offs_n[None, :] < hi)
            if window > 0:
                visible = visible & (offs_n[None, :] > pos_r[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        b_m, b_l, b_acc = _softmax_step(s, v, b_m, b_l, b_acc)
    return b_m, b_l, b_acc, seg_block


@triton.jit
def _rel_bias(
    rel_q,  # [ROWS, BLOCK_R] the rows' relative states
    p_rel,  # [BLOCK_R, 1] pointers to rel_proj's rows
    behind,  # how far the program's first query is past the tile's first key
    rel_extent,
    D_REL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``[ROWS, BLOCK_N]`` float32 bias in log2 units: row ``r`` (query token ``j = r //
    GROUP_PAD`` of the program) and key ``n`` of the tile are ``behind + j - n`` apart. The
    tile's distances span ``BLOCK_Q + BLOCK_N - 1`` consecutive values, so one small dot of the
    rows' states with rel_proj's columns of that band, ``[ROWS, BLOCK_R] x [BLOCK_R, BAND]``,
    holds every row's bias, and each row gathers its ``BLOCK_N`` (band column ``j - n +
    BLOCK_N - 1``). Distances outside ``[0, rel_extent)`` load zero columns."""
    BAND: tl.constexpr = 2 * max(BLOCK_Q, BLOCK_N)  # a power of two >= BLOCK_Q + BLOCK_N - 1
    dist = behind - (BLOCK_N - 1) + tl.arange(0, BAND)
    m_d = (dist >= 0) & (dist < rel_extent)
    m_i = tl.arange(0, BLOCK_R) < D_REL
    proj = tl.load(p_rel + dist[None, :], mask=m_i[:, None] & m_d[None, :], other=0.0)
    band = tl.dot(rel_q, proj)  # [ROWS, BAND] float32
    row_q = tl.arange(0, BLOCK_Q * GROUP_PAD) // GROUP_PAD
    column = row_q[:, None] - tl.arange(0, BLOCK_N)[None, :] + (BLOCK_N - 1)
    return tl.gather(band, column, axis=1) * 1.4426950408889634


@triton.jit
def _page_of(pos, block_size, POW2_PAGES: tl.constexpr, PAGE_ALIGN: tl.constexpr):
    """The block-table column of key ``pos`` and its slot in that page: shifts and masks when
    pages are a power of two of at most 64 tokens (``block_size == PAGE_ALIGN``), else one
    division."""
    if POW2_PAGES:
        return pos // PAGE_ALIGN, pos % PAGE_ALIGN
    else:
        return pos // block_size, pos % block_size


@triton.jit
def _first_block_id(
    p_table,
    tile,
    hi,
    block_size,
    PAGES: tl.constexpr,
    IDS_AHEAD: tl.constexpr,
    POW2_PAGES: tl.constexpr,
    PAGE_ALIGN: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The block id(s) the first tile at ``tile`` reads (0 past ``hi``): a one-page tile's one
    id; with ``IDS_AHEAD`` a multi-page tile's id per key ``[BLOCK_N]``; else nothing (a
    multi-page tile then loads its ids in its own iteration)."""
    if PAGES == 1:
        return tl.load(p_table + tile // block_size, mask=tile < hi, other=0)
    elif IDS_AHEAD:
        pos = tile + tl.arange(0, BLOCK_N)
        col, _ = _page_of(pos, block_size, POW2_PAGES, PAGE_ALIGN)
        return tl.load(p_table + col, mask=pos < hi, other=0)
    else:
        return 0


@triton.jit
def _kv_tile(
    p_k_head,  # the KV head's base in each cache
    p_v_head,
    k_desc,  # KV_TMA: descriptors of the whole caches [num_blocks, block_size, Hkv, D]
    v_desc,
    i_kvh,  # the KV head (the descriptors' third coordinate)
    p_table,  # the request's block table row
    seg_block,  # the tile's block id(s), loaded one iteration ahead (see _first_block_id)
    tile,  # first key of the tile, a multiple of BLOCK_N
    lo,  # first key any query of the program sees (a window's start)
    hi,  # one past the last key any query of the program sees
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
    dtype: tl.constexpr,  # the dot's dtype (the query's)
    MASKED: tl.constexpr,  # keys outside [lo, hi) may be in the tile
    FP8: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGES: tl.constexpr,
    IDS_AHEAD: tl.constexpr,
    POW2_PAGES: tl.constexpr,
    PAGE_ALIGN: tl.constexpr,
    KV_TMA: tl.constexpr,
):
    """K and V of keys ``tile .. tile + BLOCK_N - 1`` in the dot's dtype, and the next tile's
    block id(s). A one-page tile is a 2-D box at one page address whose id was loaded an
    iteration ahead: a TMA copy with ``KV_TMA`` (the descriptor zero-fills past the head dim),
    else pointer loads. A tile of several pages takes one id per key: loaded one tile ahead
    with ``IDS_AHEAD`` (the Hopper path: the loads' latency hides behind a whole tile's MMAs
    and nothing waits on them in the loop), else in its own iteration, which Triton's pipeliner
    (3.6 as well as 3.9) schedules stages ahead of the K/V loads it feeds (ids spread from a
    per-page vector with a reshape, it leaves unpipelined in 3.6). Keys outside ``[lo, hi)``
    read as zero (their pages may hold NaN)."""
    next_tile = tile + BLOCK_N
    if PAGES == 1:
        in_page = tile % block_size
        if KV_TMA:
            k = k_desc.load([seg_block, in_page, i_kvh, 0]).reshape(BLOCK_N, k_desc.block_shape[3])
            v = v_desc.load([seg_block, in_page, i_kvh, 0]).reshape(BLOCK_N, v_desc.block_shape[3])
        else:
            p_k = p_k_head + (seg_block.to(tl.int64) * stride_kc_block + in_page * stride_kc_token)
            p_v = p_v_head + (seg_block.to(tl.int64) * stride_vc_block + in_page * stride_vc_token)
            p_k = p_k + offs_k_row
            p_v = p_v + offs_v_row
        seg_block = tl.load(p_table + next_tile // block_size, mask=next_tile < hi, other=0)
    else:
        pos = tile + tl.arange(0, BLOCK_N)
        col, in_page = _page_of(pos, block_size, POW2_PAGES and IDS_AHEAD, PAGE_ALIGN)
        if IDS_AHEAD:
            row_block = seg_block
            pos_next = next_tile + tl.arange(0, BLOCK_N)
            col_next, _ = _page_of(pos_next, block_size, POW2_PAGES, PAGE_ALIGN)
            seg_block = tl.load(p_table + col_next, mask=pos_next < hi, other=0)
        elif MASKED:
            row_block = tl.load(p_table + col, mask=pos < hi, other=0)
        else:
            row_block = tl.load(p_table + col)
        k_rows = row_block.to(tl.int64) * stride_kc_block + in_page * stride_kc_token
        v_rows = row_block.to(tl.int64) * stride_vc_block + in_page * stride_vc_token
        p_k = p_k_head + k_rows[:, None] + offs_dk[None, :]
        p_v = p_v_head + v_rows[:, None] + offs_dv[None, :]
    if PAGES == 1 and KV_TMA:
        if MASKED:  # a where, not a product: masked keys' pages may hold NaN
            offs_n = tile + tl.arange(0, BLOCK_N)
            m_n = (offs_n >= lo) & (offs_n < hi)
            k = tl.where(m_n[:, None], k, 0.0)
            v = tl.where(m_n[:, None], v, 0.0)
    elif MASKED:
        offs_n = tile + tl.arange(0, BLOCK_N)
        m_n = (offs_n >= lo) & (offs_n < hi)
        k = tl.load(p_k, mask=m_n[:, None] & m_dk[None, :], other=0.0)
        v = tl.load(p_v, mask=m_n[:, None] & m_dv[None, :], other=0.0)
    else:
        k = tl.load(p_k, mask=m_dk[None, :], other=0.0)
        v = tl.load(p_v, mask=m_dv[None, :], other=0.0)
    if FP8 == 2:
        k = _e4m3_to_f16_div256(k).to(dtype)
        v = _e4m3_to_f16_div256(v).to(dtype)
    else:  # 16-bit caches: a no-op; fp8: one conversion, the scale is folded out
        k = k.to(dtype)
        v = v.to(dtype)
    return k, v, seg_block


@triton.jit
def _softmax_step(s, v, b_m, b_l, b_acc):
    """One tile of the online softmax: scores ``s [ROWS, BLOCK_N]`` (log2 units, -inf where
    masked), values ``v [BLOCK_N, Dv]``."""
    m_new = tl.maximum(b_m, tl.max(s, axis=1))
    alpha = tl.exp2(b_m - m_new)
    p = tl.exp2(s - m_new[:, None])
    b_l = b_l * alpha + tl.sum(p, axis=1)
    b_acc = b_acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, b_l, b_acc


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
def _e4m3_to_f16_div256(x):
    """e4m3fn bytes (uint8) to float16 / 256, exactly: the fields are placed in an fp16 (same
    mantissa, exponent field widened); the rebias 2**(15 - 7) is left to the caller's scale.
    Subnormals map to fp16 subnormals, so they are exact too. 0x7F / 0xFF are NaN."""
    x16 = x.to(tl.uint16)
    bits = ((x16 & 0x7F) << 7) | ((x16 & 0x80) << 8)
    y = bits.to(tl.float16, bitcast=True)
    return tl.where((x16 & 0x7F) == 0x7F, float("nan"), y)


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
    the hardware path. Tests and the compile check monkeypatch this."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


#: Triton versions whose compiled-kernel launch API ``_Launcher`` calls directly (checked)
_DIRECT_LAUNCH = not _INTERPRETED and (3, 6) <= _TRITON_VERSION <= (3, 9)


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


_prefill_launcher = _Launcher(_prefill_kernel)


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


def prefill_shape(
    *,
    device: torch.device,
    block_size: int,
    group: int,
    head_dim_k: int,
    head_dim_v: int,
    cache_dtype: torch.dtype,
    max_query_len: int,
    max_seq_len: int,
    rel: bool = False,
) -> PrefillShape:
    """The :class:`PrefillShape` of a launch."""
    major, minor = _capability(device)
    return PrefillShape(
        arch=10 * major + minor,
        page_align=min(block_size & -block_size, _MAX_BLOCK_N),
        group=group,
        head_dim=max(16, triton.next_power_of_2(max(head_dim_k, head_dim_v))),
        cache=_cache_kind(cache_dtype, device),
        query=_bucket(max_query_len),
        context=_bucket(max_seq_len),
        rel=rel,
    )


def _check_lengths(
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    total_q: int,
    num_blocks: int,
    block_size: int,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
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
    if max_query_len is not None and len(q_lens) and int(q_lens.max()) > max_query_len:
        r = int(q_lens.argmax())
        raise ValueError(
            f"request {r} has {int(q_lens[r])} query tokens, more than max_query_len = "
            f"{max_query_len}; pass max_query_len >= the longest query (or None)"
        )
    if max_seq_len is not None and len(lens) and int(lens.max()) > max_seq_len:
        r = int(lens.argmax())
        raise ValueError(
            f"seq_lens[{r}] = {int(lens[r])} exceeds max_seq_len = {max_seq_len}; pass "
            f"max_seq_len >= max(seq_lens) (or None)"
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


@functools.cache
def _autotuned_kernel():
    """The kernel under ``triton.autotune`` over ``CONFIGS``, keyed by the shape class (the
    constexprs plus the longest-query and context buckets). Built on first use: the
    interpreter cannot autotune. The kernel writes a fresh output, so tuning in place is
    safe."""
    configs = [
        triton.Config(
            {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "IDS_AHEAD": c.hopper},
            num_warps=c.num_warps,
            num_stages=c.num_stages,
        )
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
            "HAS_REL",  # a bias launch prunes to other configs (config_fits)
            "tune_query",
            "tune_context",
        ],
        prune_configs_by={"early_config_prune": _prune_for_autotune},
    )(_prefill_kernel)


def _config_of(c: triton.Config) -> PrefillConfig:
    kw = c.kwargs
    return PrefillConfig(kw["BLOCK_M"], kw["BLOCK_N"], c.num_warps, c.num_stages, kw["IDS_AHEAD"])


def _prune_for_autotune(
    configs: list[triton.Config], nargs: dict, **kwargs
) -> list[triton.Config]:
    """Autotuning's candidates: the configs that fit the launch's shape class."""
    args = {**nargs, **kwargs}
    major, minor = _capability(args["q_ptr"].device)
    item = args["k_cache_ptr"].element_size()
    cache = {1: "fp8", 4: "fp32"}.get(item, "16bit")
    if args["FP8"] == 2:
        cache = "fp8-bytes"
    shape = PrefillShape(
        arch=10 * major + minor,
        page_align=args["PAGE_ALIGN"],
        group=args["GROUP"],
        head_dim=max(args["BLOCK_DK"], args["BLOCK_DV"]),
        cache=cache,
        query=args["tune_query"],
        context=args["tune_context"],
        rel=bool(args["HAS_REL"]),
    )
    kept = [c for c in configs if config_fits(_config_of(c), shape)]
    return kept or configs[:1]


@dataclass(frozen=True, eq=False)
class PrefillPlan:
    """Everything :meth:`run` needs that does not change between the layers of one step.

    Made by :func:`plan_prefill`; holds the step's block tables, query offsets and lengths (by
    reference: a CUDA graph that captured :meth:`run` replays on whatever they hold then), the
    config and the grid."""

    batch: int
    total_q: int
    num_heads: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    block_size: int
    cache_dtype: torch.dtype
    q_dtype: torch.dtype
    scale: float
    sliding_window: int  # 0: full causal attention
    max_query_len: int
    max_seq_len: int
    shape: PrefillShape
    config: PrefillConfig
    config_source: str  # the table row, "autotune" or "given"
    autotune: bool
    has_sinks: bool  # run takes each layer's per-head attention-sink logits
    rel_dim: int  # > 0: run takes each layer's relative-position bias (rel_states, rel_proj)
    grid: tuple[int, int]  # (query tiles, KV heads) of the planned config
    block_tables: torch.Tensor = field(repr=False)
    cu_seqlens_q: torch.Tensor = field(repr=False)
    seq_lens: torch.Tensor = field(repr=False)
    _constexprs: dict = field(repr=False)
    # derived once, for run's checks and launch
    _q_shape: tuple[int, int, int] = field(init=False, repr=False)
    _out_shape: tuple[int, int, int] = field(init=False, repr=False)
    _k_tail: tuple[int, int, int] = field(init=False, repr=False)
    _v_tail: tuple[int, int, int] = field(init=False, repr=False)
    _meta: dict = field(init=False, repr=False)
    _meta_tma: dict = field(init=False, repr=False)
    _tma_planned: bool = field(init=False, repr=False)
    _launch_key: tuple = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)  # a frozen dataclass's derived fields

        bs, hkv = self.block_size, self.num_kv_heads
        put("_q_shape", (self.total_q, self.num_heads, self.head_dim_k))
        put("_out_shape", (self.total_q, self.num_heads, self.head_dim_v))
        put("_k_tail", (bs, hkv, self.head_dim_k))
        put("_v_tail", (bs, hkv, self.head_dim_v))
        c = self.config
        meta = dict(self._constexprs, BLOCK_M=c.block_m, BLOCK_N=c.block_n, IDS_AHEAD=c.hopper)
        put("_meta", dict(meta, num_warps=c.num_warps, num_stages=c.num_stages))
        put("_meta_tma", dict(self._meta, KV_TMA=True))
        # TMA needs one page segment per tile (a box at one page address); decided per run
        # by the layer's strides and base address
        put("_tma_planned", c.hopper and self.shape.page_align >= c.block_n)
        # the plan's part of every launch's specialisation: its tensors' alignment, its
        # integers' classes, the constexprs and options
        tensors = (self.block_tables, self.seq_lens, self.cu_seqlens_q)
        put(
            "_launch_key",
            (
                self.block_tables.device,
                (self.q_dtype, self.cache_dtype, self.seq_lens.dtype),
                tuple(t.data_ptr() % 16 for t in tensors),
                tuple(
                    _int_class(v)
                    for v in (self.batch, bs, self.sliding_window, self.block_tables.stride(0))
                ),
                tuple(sorted(self._meta.items())),
            ),
        )

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
    ) -> torch.Tensor:
        """Causal attention of one layer: ``q [total_q, Hq, Dk]`` over ``k_cache``/``v_cache``
        ``[num_blocks, block_size, Hkv, D]`` (any strides but the last) of the planned shape
        and dtype; fp8 caches need ``k_scale``/``v_scale`` (float32, one value each). Returns
        ``[total_q, Hq, Dv]`` in ``q``'s dtype (in ``out`` if given: then nothing is
        allocated). ``sinks [Hq] float32``: the layer's attention-sink logits, required when
        the plan was made with ``sinks=True`` and refused otherwise. ``rel_states [total_q,
        Hq, rel_dim]`` and ``rel_proj [rel_dim, rel_extent]`` (q's dtype, last dims
        contiguous): the layer's relative-position bias, required when the plan was made with
        ``rel_dim`` and refused otherwise (see :func:`plan_prefill`)."""
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
                f"{self.head_dim_k}/{self.head_dim_v}] {self.cache_dtype} views with a "
                f"contiguous last dim (the plan's), got {tuple(k_cache.shape)} {k_cache.dtype} "
                f"and {tuple(v_cache.shape)} {v_cache.dtype}"
            )
        fp8 = self._constexprs["FP8"]
        if fp8:
            _check_scale(k_scale, "k_scale")
            _check_scale(v_scale, "v_scale")
            if fp8 == 2:  # the kernel decodes the bytes itself
                k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        else:
            k_scale = v_scale = self.seq_lens  # never read
        sinks = _check_sinks(sinks, self.has_sinks, self.num_heads, q.device)
        if sinks is None:
            sinks = self.seq_lens  # never read
        _check_rel(rel_states, rel_proj, self.rel_dim, self.total_q, self.num_heads, q)
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
        if self.total_q == 0 or self.batch == 0:
            return out
        qs, os_ = q.stride(), out.stride()
        k_desc, v_desc, meta = k_cache, v_cache, self._meta  # the pointer path: unused
        tma = self._tma_planned and _tma_ready(k_cache) and _tma_ready(v_cache)
        if tma:
            c, dk, dv = self.config, self._constexprs["BLOCK_DK"], self._constexprs["BLOCK_DV"]
            k_desc = TensorDescriptor.from_tensor(k_cache, [1, c.block_n, 1, dk])
            v_desc = TensorDescriptor.from_tensor(v_cache, [1, c.block_n, 1, dv])
            meta = self._meta_tma
        args = (
            q, k_cache, v_cache, k_desc, v_desc, self.block_tables, self.seq_lens,
            self.cu_seqlens_q, k_scale, v_scale, sinks, rel_states, rel_proj, out, self.scale,
            self.batch, self.block_size, self.sliding_window, *rel_ints, qs[0], qs[1], os_[0],
            os_[1], self.block_tables.stride(0), ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
            self.shape.query, self.shape.context,
        )  # fmt: skip
        if self.autotune:
            group, batch, kv_heads = self.shape.group, self.batch, self.num_kv_heads
            total_q = self.total_q
            # the tile count follows the config the autotuner tries
            grid = lambda meta: (
                total_q // tokens_per_tile(meta["BLOCK_M"], group) + batch,
                kv_heads,
            )
            _autotuned_kernel()[grid](*args, **self._constexprs)
        else:
            # what may differ between the layers of a step and matters to Triton's
            # specialisation: the pointers' alignment and the strides
            key = (
                self._launch_key, q.data_ptr() % 16, k_cache.data_ptr() % 16,
                v_cache.data_ptr() % 16, out.data_ptr() % 16, k_scale.data_ptr() % 16,
                v_scale.data_ptr() % 16, sinks.data_ptr() % 16, rel_states.data_ptr() % 16,
                rel_proj.data_ptr() % 16, tuple(_int_class(v) for v in rel_ints), qs, os_, ks,
                vs, tma,
            )  # fmt: skip
            _prefill_launcher((*self.grid, 1), key, args, meta)
        return out


def _tma_ready(cache: torch.Tensor) -> bool:
    """Whether a TMA descriptor can address ``cache [num_blocks, block_size, Hkv, D]``: a
    16-byte aligned base, strides of whole 16-byte units but the last (contiguous) one, and rows
    of at least 16 bytes. Packed and head-major pages qualify; a view that starts or steps at
    odd bytes takes the pointer path."""
    item = cache.element_size()
    strides = cache.stride()
    return (
        cache.data_ptr() % 16 == 0
        and strides[3] == 1
        and all(st * item % 16 == 0 for st in strides[:3])
        and cache.shape[3] * item >= 16
    )


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
) -> None:
    """A run's relative-position bias: ``rel_states [total_q, Hq, rel_dim]`` and ``rel_proj
    [rel_dim, rel_extent]`` in ``q``'s dtype on its device with contiguous last dims, given
    exactly when the plan was made with ``rel_dim`` (> 0)."""
    given = (rel_states is not None, rel_proj is not None)
    if given == (False, False):
        if rel_dim:
            raise ValueError(
                f"this plan was made with rel_dim={rel_dim}: pass the layer's rel_states "
                f"[total_q, Hq, {rel_dim}] and rel_proj [{rel_dim}, rel_extent]"
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
            f"rel_states must be [total_q={rows}, Hq={num_heads}, rel_dim={rel_dim}] (one row "
            f"per query token) with a contiguous last dim, got {tuple(rel_states.shape)} "
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


def plan_prefill(
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    cache_dtype: torch.dtype,
    q_dtype: torch.dtype,
    scale: float,
    total_q: int,
    head_dim_v: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    config: PrefillConfig | None = None,
    autotune: bool = False,
    num_blocks: int | None = None,
    validate: bool | None = None,
    sinks: bool = False,
    rel_dim: int | None = None,
) -> PrefillPlan:
    """Plan one step's prefill: ``block_tables [B, max_blocks] int32`` (row-contiguous),
    ``cu_seqlens_q [B+1] int32`` (request ``r``'s queries are rows ``cu[r]:cu[r+1]`` of q) and
    ``seq_lens [B] int32`` (each request's KV length including its new tokens, already in the
    cache), on the device the layers' tensors live on, and the shapes every layer of the step
    shares; ``total_q`` is q's row count. Returns a :class:`PrefillPlan` whose
    :meth:`~PrefillPlan.run` serves every layer.

    Planning never syncs with the device: ``max_query_len`` (>= every request's query count;
    default ``total_q``) and ``max_seq_len`` (>= every seq_len; default what the block table
    can hold) only pick the config's sequence-length class. ``config`` overrides the table
    (:func:`choose_config`); ``autotune=True`` tunes over ``CONFIGS`` on the GPU instead, keyed
    by the shape class. ``validate`` (default: the ``HYBRIDKV_VALIDATE`` switch) checks the
    module's contract (one sync; block ids need ``num_blocks``, the cache's). A config with
    ``hopper=True`` (the Hopper path) needs a 16-bit or hardware-fp8 cache and, on a GPU,
    sm_90+; the interpreter runs it anywhere (the tests). ``sinks=True``: the layers have
    learnable per-head attention sinks (one more logit per head in each softmax's
    denominator, with no value), passed to each :meth:`~PrefillPlan.run`. ``rel_dim``: the
    layers add a hidden-state-conditioned relative-position bias (Inkling): each
    :meth:`~PrefillPlan.run` takes ``rel_states [total_q, Hq, rel_dim]`` and ``rel_proj
    [rel_dim, rel_extent]``, and key ``k`` of a query at position ``p`` gets ``rel_states[t, h]
    @ rel_proj[:, p - k]`` added to its scaled logit where ``p - k < rel_extent``. Such plans
    take the generic path (see the module's docstring): the table skips Hopper-path configs
    for them and a given one is refused.
    """
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError("block_tables must be an int32 [B, max_blocks] tensor")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    batch = block_tables.shape[0]
    if cu_seqlens_q.shape != (batch + 1,) or seq_lens.shape != (batch,):
        raise ValueError(
            f"cu_seqlens_q must be [B+1] and seq_lens [B] for the B={batch} rows of "
            f"block_tables, got {tuple(cu_seqlens_q.shape)} and {tuple(seq_lens.shape)}"
        )
    if cu_seqlens_q.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(
            f"cu_seqlens_q and seq_lens must be int32, got {cu_seqlens_q.dtype} and "
            f"{seq_lens.dtype}"
        )
    device = block_tables.device
    if cu_seqlens_q.device != device or seq_lens.device != device:
        raise ValueError(
            f"block_tables ({device}), cu_seqlens_q ({cu_seqlens_q.device}) and seq_lens "
            f"({seq_lens.device}) must be on one device"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"Hq={num_heads} is not a multiple of Hkv={num_kv_heads}")
    if total_q < 0:
        raise ValueError(f"total_q must be >= 0, got {total_q}")
    if max_query_len is not None and max_query_len < 0:
        raise ValueError(f"max_query_len must be >= 0 (or None), got {max_query_len}")
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1 (or None), got {max_seq_len}")
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(f"sliding_window must be None, 0 (off) or positive: {sliding_window}")
    if q_dtype in _FP8:
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
    if max_seq_len is not None:
        needed = triton.cdiv(max_seq_len, block_size)
        if needed > block_tables.shape[1]:
            raise ValueError(
                f"block_tables has {block_tables.shape[1]} columns but max_seq_len "
                f"{max_seq_len} needs {needed} blocks"
            )
    if _validate_enabled(validate):
        if num_blocks is None:
            raise ValueError("validate=True checks block ids: pass num_blocks (the cache's)")
        _check_lengths(
            cu_seqlens_q,
            seq_lens,
            block_tables,
            total_q,
            num_blocks,
            block_size,
            max_query_len,
            max_seq_len,
        )
    # host-known bounds where the caller gave none: no request has more queries than q has
    # rows, nor more tokens than its block-table row holds
    query_len = total_q if max_query_len is None else min(max_query_len, total_q)
    seq_len = block_tables.shape[1] * block_size if max_seq_len is None else max_seq_len
    group = num_heads // num_kv_heads
    shape = prefill_shape(
        device=device,
        block_size=block_size,
        group=group,
        head_dim_k=head_dim,
        head_dim_v=head_dim_v,
        cache_dtype=cache_dtype,
        max_query_len=query_len,
        max_seq_len=seq_len,
        rel=bool(rel_dim),
    )
    if autotune:
        source = "autotune"
        config = choose_config(shape)[0]  # recorded only; the autotuner picks per launch
    elif config is None:
        config, source = choose_config(shape)
    else:
        if config not in CONFIGS:
            raise ValueError(f"{config} is not one of CONFIGS: {', '.join(map(str, CONFIGS))}")
        if config.hopper and shape.cache not in _HOPPER_CACHES:
            raise ValueError(
                f"{config} takes the Hopper path, which reads 16-bit caches and fp8 converted "
                f"in hardware, not {cache_dtype} ({shape.cache}); pick a config without hopper"
            )
        if config.hopper and rel_dim:
            raise ValueError(
                f"{config} takes the Hopper path, which takes no relative-position bias (its "
                f"wide tiles would hold the bias band in registers): pick a config without "
                f"hopper"
            )
        if config.hopper and device.type == "cuda" and shape.arch < 90:
            raise ValueError(
                f"{config} takes the Hopper path (TMA), which needs sm_90+; this GPU is "
                f"sm_{shape.arch}: pick a config without hopper"
            )
        source = "given"
    # request r owns tiles cu[r] // BLOCK_Q + r ...: at most total_q // BLOCK_Q + B of them
    tiles = total_q // tokens_per_tile(config.block_m, group) + batch
    return PrefillPlan(
        batch=batch,
        total_q=total_q,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim_k=head_dim,
        head_dim_v=head_dim_v,
        block_size=block_size,
        cache_dtype=cache_dtype,
        q_dtype=q_dtype,
        scale=float(scale),
        sliding_window=sliding_window or 0,
        max_query_len=query_len,
        max_seq_len=seq_len,
        shape=shape,
        config=config,
        config_source=source,
        autotune=autotune,
        has_sinks=bool(sinks),
        rel_dim=rel_dim or 0,
        grid=(tiles, num_kv_heads),
        block_tables=block_tables,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        _constexprs=dict(
            GROUP=group,
            GROUP_PAD=triton.next_power_of_2(group),
            HEAD_DIM_K=head_dim,
            HEAD_DIM_V=head_dim_v,
            BLOCK_DK=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_DV=max(16, triton.next_power_of_2(head_dim_v)),
            PAGE_ALIGN=shape.page_align,
            FP8={"fp8": 1, "fp8-bytes": 2}.get(shape.cache, 0),
            POW2_PAGES=block_size == shape.page_align,  # read by the Hopper path only
            KV_TMA=False,  # run turns it on where the layer's caches allow
            HAS_SINKS=bool(sinks),
            HAS_REL=bool(rel_dim),
            D_REL=rel_dim or 0,
            BLOCK_R=max(16, triton.next_power_of_2(rel_dim or 1)),
        ),
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
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    config: PrefillConfig | None = None,
    autotune: bool = False,
    sinks: torch.Tensor | None = None,
    rel_states: torch.Tensor | None = None,
    rel_proj: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [total_q, Hq, Dk]`` over each request's paged K/V:
    :func:`plan_prefill` and :meth:`PrefillPlan.run` in one call (plan once and run per layer
    to save the host work).

    ``cu_seqlens_q [B+1] int32`` splits ``q`` into requests; ``seq_lens [B] int32`` is each
    request's KV length including its new tokens (already in the cache). Returns
    ``[total_q, Hq, Dv]`` in ``q``'s dtype. Never syncs with the device unless ``validate``
    (default: the ``HYBRIDKV_VALIDATE`` environment switch) asks for the contract's checks.
    ``out [total_q, Hq, Dv]`` (contiguous in Dv), if given, receives the result.
    ``max_query_len`` / ``max_seq_len`` (bounds of the step's query counts and KV lengths)
    pick the config's sequence-length class; ``config`` forces one of ``CONFIGS``;
    ``autotune=True`` tunes on the GPU. fp8 caches need ``k_scale``/``v_scale`` (float32
    scalars). ``sinks [Hq] float32``: per-head attention-sink logits (none by default).
    ``rel_states [total_q, Hq, rel_dim]`` with ``rel_proj [rel_dim, rel_extent]`` (q's dtype):
    a relative-position bias (see :func:`plan_prefill`; none by default).
    """
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(
            f"q must be [total_q, Hq, D] with a contiguous last dim, got {tuple(q.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError("k_cache and v_cache must be [num_blocks, block_size, Hkv, D] views")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError("k_cache and v_cache disagree on blocks, block size or heads")
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"q head_dim {q.shape[2]} != k_cache head_dim {k_cache.shape[3]}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    quant = k_cache.dtype in _FP8
    if quant and (k_scale is None or v_scale is None):
        raise ValueError("fp8 caches need k_scale and v_scale (float32 scalars)")
    plan = plan_prefill(
        block_tables,
        cu_seqlens_q,
        seq_lens,
        num_heads=q.shape[1],
        num_kv_heads=k_cache.shape[2],
        head_dim=q.shape[2],
        head_dim_v=v_cache.shape[3],
        block_size=k_cache.shape[1],
        cache_dtype=k_cache.dtype,
        q_dtype=q.dtype,
        scale=scale,
        total_q=q.shape[0],
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        sliding_window=sliding_window,
        config=config,
        autotune=autotune,
        num_blocks=k_cache.shape[0],
        validate=validate,
        sinks=sinks is not None,
        rel_dim=None if rel_states is None else rel_states.shape[-1],
    )
    if quant:
        k_scale = k_scale.reshape(1).to(torch.float32)
        v_scale = v_scale.reshape(1).to(torch.float32)
    return plan.run(
        q, k_cache, v_cache, k_scale, v_scale, out=out, sinks=sinks, rel_states=rel_states,
        rel_proj=rel_proj,
    )  # fmt: skip


# ---- reference --------------------------------------------------------------------------------


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
    sinks: torch.Tensor | None = None,
    rel_states: torch.Tensor | None = None,
    rel_proj: torch.Tensor | None = None,
    **_: object,
) -> torch.Tensor:
    """Plain torch: gather each request's K/V through its block table, causal softmax in fp32
    (with ``sinks [Hq]``, over one more logit per head whose weight is dropped). Keys no query
    of the request can see (below a sliding window) are not read: an allocator may have freed
    their blocks. Every tensor it builds lives on ``q``'s device. Given ``rel_states
    [total_q, Hq, rel_dim]`` and ``rel_proj [rel_dim, rel_extent]``, each scaled score gets
    ``rel_states[t, h] @ rel_proj[:, distance]`` added in float32 (none from distance
    ``rel_extent`` on)."""
    from einops import repeat

    device = q.device
    out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[3], dtype=q.dtype, device=device)
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    tables = block_tables.to(device=device, dtype=torch.long)
    cu = cu_seqlens_q.tolist()
    for r, n in enumerate(seq_lens.tolist()):
        a, b = cu[r], cu[r + 1]
        first = max(0, n - (b - a) - sliding_window + 1) if sliding_window else 0
        pos = torch.arange(first, n, device=device)
        blocks = tables[r][pos // block_size]
        k = k_cache[blocks, pos % block_size].float()
        v = v_cache[blocks, pos % block_size].float()
        if k_cache.dtype in _FP8:
            k = k * k_scale.to(device=device, dtype=torch.float32).reshape(())
            v = v * v_scale.to(device=device, dtype=torch.float32).reshape(())
        k = repeat(k, "n h d -> n (h g) d", g=group)
        v = repeat(v, "n h d -> n (h g) d", g=group)
        qpos = torch.arange(n - (b - a), n, device=device)
        visible = pos[None, :] <= qpos[:, None]
        if sliding_window:
            visible &= pos[None, :] > qpos[:, None] - sliding_window
        scores = torch.einsum("mhd,nhd->hmn", q[a:b].float(), k) * scale
        if rel_states is not None:
            dist = qpos[:, None] - pos[None, :]
            scores = scores + _rel_bias_ref(rel_states[a:b], rel_proj, dist)
        scores = scores.masked_fill(~visible[None], float("-inf"))
        if sinks is not None:
            sink = sinks.to(device=device, dtype=torch.float32)[:, None, None]
            scores = torch.cat([scores, sink.expand(-1, b - a, 1)], dim=2)
        weights = scores.softmax(-1)[..., : k.shape[0]]
        out[a:b] = torch.einsum("hmn,nhd->mhd", weights, v).to(q.dtype)
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
