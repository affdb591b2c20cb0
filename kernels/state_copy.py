"""Recurrent-state pool kernels: gather, scatter and slot-to-slot copy.

A state pool holds one component of a layer's state (e.g. a Mamba conv state ``[K-1, conv_dim]``
or a GDN recurrent state ``[heads, dv, dk]``) for every slot: a view ``[num_slots, *shape]`` whose
slot stride is arbitrary (a slot may be a page that also holds other components or layers) and
whose per-slot part is contiguous. Each slot is therefore one flat row of ``prod(shape)``
elements; these kernels move rows in tiles with int64 addressing (pools exceed 2**31 elements).
They only move bits, so every pool is handed to the kernels as unsigned/signed integers of its
element size: fp8 pools (e4m3 included) compile on sm_80 too, and NaN payloads survive.

Plan once per step, run once per pool view (FlashInfer's split): :func:`plan_gather_states`,
:func:`plan_scatter_states` and :func:`plan_copy_states` take the step's slot ids and the row
shape and make every host decision (config, tile, grid, validation); the plan's ``run`` then
moves one layer's rows and does no allocation (given ``out``), no environment read and no device
sync, and after a specialisation's first launch it skips Triton's argument binding (a direct
launcher, as in ``paged_decode.py``). :func:`gather_states`, :func:`scatter_states` and
:func:`copy_states` are plan + run.

Tiling (why it is shaped so). A copy is bound by how many bytes each multiprocessor keeps in
flight: at ~4.3 TB/s and ~1 us of loaded DRAM latency (Little's law) the GPU needs ~4 MiB in
flight, ~32 KiB per SM of an H100/H200. A program moves a row's tiles of ``BLOCK`` elements in a
loop, ``16 * vecs`` bytes per thread per tile (``vecs`` 16-byte vectors, all issued before the
first store waits), and the grid is sized to the GPU: ``num_sms * programs_per_sm`` programs
split over the rows (at least one per row; a row's tiles split evenly over its programs). At
batch 8 with 1 MiB rows that is 128 programs a row, 8 resident per SM with 8 KiB each: 64 KiB in
flight per SM in one wave; at batch 256 each program loops over 32 tiles, and the slot id is
loaded once per program instead of once per tile. The measurement this replaces (one program per
tile and per row, H200): 40% of copy bandwidth at batch 8, 80-90% at batch >= 64.

Aligned rows (``row_numel``, the row strides and the base pointers 16-divisible, what Triton's
argument specialisation needs to prove 16-byte vectors) use the config's tile. Other rows are
copied element by element (a 64-bit address and a predicate each), so their tile is capped at
``_MAX_UNALIGNED_PER_THREAD`` elements per thread (more spills on sm_80 and sm_90). A plan holds
both launches when the row length allows vectors, and ``run`` picks by the views it is given
(a few integer tests), so any view of any layer runs correctly and without spills.

Contract
--------
- ``pool``: ``[num_slots, *shape]``, per-slot part contiguous, slot stride arbitrary; element
  size 1, 2, 4 or 8 bytes. Batches (``out``, ``src``) are ``[B, *shape]`` of the pool's dtype.
- Slot ids (``slot_ids``, ``src_slots``, ``dst_slots``): 1-D int32 or int64 on the pool's
  device. Valid ids are ``0 .. num_slots - 1`` and ``-1`` (padding: the row, or the copy pair,
  is skipped).
- ``scatter_states``: live slot ids distinct. ``copy_states``: ``src_slots`` and ``dst_slots``
  of equal length; live destinations distinct and none of them the source of another live pair
  (the pairs run in parallel, so such a pair would read old or new state at random). A pair
  copying a slot onto itself is allowed (a no-op).
- Always checked on the host (no device sync): shapes, dtypes, devices, strides, lengths.
- Checked only with ``validate=True`` (or ``HYBRIDKV_VALIDATE=1``; one sync, at plan time):
  every id's range, and the distinctness rules above. Without it an id outside
  ``[-1, num_slots)`` is not reported; the kernels skip its row (never reading or writing past
  the pool, e.g. into the next layer's state), and the distinctness rules are the caller's
  promise.

Autotuning (``autotune=True``, a GPU only) runs each candidate several times on the real pool,
with no ``restore_value``: every launch is idempotent (a gather writes only ``out``; a scatter
writes the same rows to the same slots; a copy's destinations are never its sources, see the
contract), so the trials leave exactly what one launch leaves, without cloning the pool (a
spike the size of the pool on the first call per key).

Hopper: no matmul, so wgmma does not apply. TMA (``cp.async.bulk``) could move a whole row
through shared memory with one thread issuing, freeing the registers that hold a tile in
flight; the copies here are already 16-byte vectorised and bound by memory bandwidth for
aligned rows, so the expected gain is small, and unaligned rows (not a multiple of 16
elements) could not use it (TMA needs 16-byte aligned addresses and sizes).

Standalone: imports only torch and triton, so the file can be copied into another project.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

# ---- configs and the default table ------------------------------------------------------------


@dataclass(frozen=True)
class StateConfig:
    """One compile-time choice of the copy kernels, and the grid it is launched with."""

    vecs: int  # 16-byte vectors per thread per tile (aligned rows), a power of two
    num_warps: int
    programs_per_sm: int  # the grid: num_sms * programs_per_sm programs, split over the rows

    def __str__(self) -> str:
        return (
            f"vecs={self.vecs},num_warps={self.num_warps},programs_per_sm={self.programs_per_sm}"
        )


#: what autotuning tries (``autotune=True``), the GPU suite sweeps and the compile check
#: compiles; every config of ``_TABLE`` is one of them. Around the default (4 vectors, 4 warps,
#: 8 programs an SM: 64 KiB in flight per SM) they vary one lever at a time: the grid (16
#: programs an SM), the tile (1, 2, 8 vectors: 2-16 KiB a program) and the warps (8). The loop
#: body is load-then-store with nothing to overlap inside a program, so ``num_stages`` stays 1:
#: the bytes in flight come from the tile times the programs resident on an SM.
CONFIGS: tuple[StateConfig, ...] = (
    StateConfig(4, 4, 8),
    StateConfig(4, 4, 16),
    StateConfig(2, 4, 16),
    StateConfig(8, 4, 4),
    StateConfig(8, 4, 8),
    StateConfig(4, 8, 4),
    StateConfig(4, 8, 8),
    StateConfig(1, 4, 16),
)

#: Elements per thread when a row is not aligned. Triton then cannot prove 16-byte alignment, so
#: each element is its own load and store with its own 64-bit address and predicate; at 16 per
#: thread ptxas spills (seen for 1- and 2-byte elements on sm_80 and sm_90: predicates moved to
#: registers, addresses to local memory). At 8 it does not, for any element size.
_MAX_UNALIGNED_PER_THREAD = 8

#: registers of a multiprocessor and the most warps / programs resident on one (sm_80, sm_90)
_SM_REGISTERS = 65536
_SM_WARPS = 64
_SM_PROGRAMS = 32


@dataclass(frozen=True)
class StateShape:
    """The shape class a launch's config is chosen by (and autotuning is keyed by)."""

    arch: int  # compute capability as 80, 90, ...; the interpreter counts as 80
    elem_bytes: int  # 1, 2, 4 or 8
    aligned: bool  # row_numel % 16 == 0: 16-byte vectors possible (views checked at run)
    row_bytes: int  # bytes per row, rounded up to a power of two
    rows: int  # rows (batch or copy pairs), rounded up to a power of two


@dataclass(frozen=True)
class StateRule:
    """One row of the default table: the first row whose ranges (inclusive) all hold for a
    launch's :class:`StateShape` gives its config; ``source`` says where the row comes from."""

    config: StateConfig
    source: str
    aligned: bool | None = None
    row_bytes: tuple[int, int] = (1, 1 << 40)
    rows: tuple[int, int] = (1, 1 << 40)

    def matches(self, shape: StateShape) -> bool:
        return (
            (self.aligned is None or self.aligned == shape.aligned)
            and self.row_bytes[0] <= shape.row_bytes <= self.row_bytes[1]
            and self.rows[0] <= shape.rows <= self.rows[1]
        )


_OLD = (
    "the H200 run of 2026-11-26 (hybridkv's paper/results/kernels-before-h200-2026-11-26.md) "
    "measured only the previous kernel (one program per 1-row tile): 1 MiB rows 40% of "
    "copy bandwidth at B=8, 80-90% at B >= 64"
)
_SUITE = (
    "H200 GPU suite run 2, 2026-11-26 (hybridkv's paper/results/h200-suite-2/), % of copy "
    "bandwidth"
)
#: the default configs, first match wins. Measured rows name the shapes they were measured on;
#: the others are marked unmeasured and say what they are inferred from (the GPU suite sweeps
#: ``CONFIGS``).
_TABLE: tuple[StateRule, ...] = (
    StateRule(
        StateConfig(2, 4, 16),
        f"{_SUITE}: 1 MiB rows (bf16) at B=64, gather / scatter / copy 80.3 / 78.5 / 78.6% "
        "(4/4/8: 74.5 / 74.8 / 74.6%), at B=256 86.0% (4/4/8: 84.6-84.8%); at B=8 every "
        "config is within 40-46% (launch-bound: 16 MiB moved in ~9 us)",
        aligned=True,
        row_bytes=(1 << 19, 1 << 40),
        rows=(64, 1 << 40),
    ),
    StateRule(
        StateConfig(4, 4, 8),
        f"unmeasured: inferred from {_OLD}; and Little's law: 8 programs x 128 threads x 4 "
        "16-byte vectors = 64 KiB in flight per SM, 2x the ~32 KiB that 4.3 TB/s x ~1 us "
        "needs; 32 registers (compile check), so 16 programs fit an SM and the grid is one "
        "wave; B=8 x 1 MiB rows = 1024 programs of one 8 KiB tile, every SM busy",
        aligned=True,
    ),
    StateRule(
        StateConfig(4, 4, 8),
        f"unmeasured: inferred from {_OLD}; scalar copies of 8 elements a thread (the "
        "spill-free maximum), 48 registers (64 for 8-byte elements), so 8-10 programs fit an "
        "SM: 16 KiB in flight per SM for 2-byte elements, issue-bound rather than "
        "latency-bound",
        aligned=False,
    ),
)


def registers_estimate(config: StateConfig, elem_bytes: int, aligned: bool) -> int:
    """Registers a thread of the copy kernels needs, an upper bound of what ``ptxas`` allocated
    for gather, scatter and copy with every element size on sm_80 and sm_90 (triton 3.9, no
    spills anywhere): aligned tiles of 1 / 2 / 4 / 8 vectors a thread 18-22 / 23-26 / 31-32
    (40 at 8 warps) / 54-58; unaligned tiles of <= 4 elements a thread 18-26, of 8 elements
    32-48 (61 for 8-byte elements: each needs two registers)."""
    per_thread = tile_elements(config, elem_bytes, aligned) // (32 * config.num_warps)
    if aligned:
        vectors = per_thread * elem_bytes // 16
        if vectors <= 4:
            return 24 if vectors <= 1 else 32 if config.num_warps <= 4 else 40
        return 64
    return 32 if per_thread <= 4 else 64 if elem_bytes == 8 else 48


def resident_programs(config: StateConfig, elem_bytes: int, aligned: bool) -> int:
    """Programs of ``config`` one multiprocessor holds at once: the least of its program and
    warp limits and what its registers allow (:func:`registers_estimate`)."""
    threads = 32 * config.num_warps
    regs = registers_estimate(config, elem_bytes, aligned)
    return min(_SM_PROGRAMS, _SM_WARPS // config.num_warps, _SM_REGISTERS // (threads * regs))


def config_fits(config: StateConfig, shape: StateShape) -> bool:
    """Whether ``config`` compiles for ``shape`` without spills (at most 8 vectors, 128 B, a
    thread: checked by ``python -m paper.compile_kernels``) and its grid is one resident wave
    (``programs_per_sm`` <= :func:`resident_programs`), so no program waits for another to
    finish before its loads are issued."""
    return config.vecs <= 8 and config.programs_per_sm <= resident_programs(
        config, shape.elem_bytes, shape.aligned
    )


def choose_config(shape: StateShape) -> tuple[StateConfig, str]:
    """The default config of a shape class and where it comes from (a ``_TABLE`` row, or the
    first config of ``CONFIGS`` that fits when a row's config does not fit this shape)."""
    for rule in _TABLE:
        if rule.matches(shape) and config_fits(rule.config, shape):
            return rule.config, rule.source
    for config in CONFIGS:
        if config_fits(config, shape):
            return config, "no table row: the first config that fits"
    raise ValueError(f"no state-copy config fits {shape}")


def tile_elements(config: StateConfig, elem_bytes: int, aligned: bool) -> int:
    """Elements per tile (``BLOCK``): ``vecs`` 16-byte vectors a thread for aligned rows; at most
    ``_MAX_UNALIGNED_PER_THREAD`` elements a thread for the others."""
    per_thread = config.vecs * 16 // elem_bytes
    if not aligned:
        per_thread = min(per_thread, _MAX_UNALIGNED_PER_THREAD)
    return per_thread * 32 * config.num_warps


def programs_per_row(rows: int, row_numel: int, block: int, programs_per_sm: int, sms: int) -> int:
    """Programs a row is split over: the grid targets ``sms * programs_per_sm`` programs (one
    resident wave), at least one a row and at most one a tile; the count is then trimmed so that
    every program gets the same number of tiles (the last one fewer)."""
    tiles = max(1, triton.cdiv(row_numel, block))  # empty rows launch nothing anyway
    split = max(1, min(tiles, sms * programs_per_sm // max(1, rows)))
    return triton.cdiv(tiles, triton.cdiv(tiles, split))


# ---- kernels ----------------------------------------------------------------------------------


@triton.jit
def _program_tiles(row_numel, BLOCK: tl.constexpr):
    """The tiles of its row this program moves: ``count`` tiles from ``first``. The row's tiles
    split evenly over the grid's second axis (any grid is correct: a program past the last tile
    gets none)."""
    num_tiles = tl.cdiv(row_numel, BLOCK)
    per = tl.cdiv(num_tiles, tl.num_programs(1))
    first = tl.program_id(1) * per
    return first, tl.minimum(per, num_tiles - first)


@triton.jit(do_not_specialize=["tune_rows", "tune_row_bytes"])
def _gather_kernel(
    pool_ptr,  # [num_slots, row_numel] integers of the element size, rows at stride_pool_slot
    slot_ptr,  # [B] int32/int64, -1 = padding
    out_ptr,  # [B, row_numel] rows at stride_out_row
    num_slots,  # ids at or past it are skipped
    row_numel,  # elements per slot
    stride_pool_slot,  # elements between slots
    stride_out_row,  # elements between rows of out
    tune_rows,  # batch bucket: read only by autotuning's key
    tune_row_bytes,  # row-size bucket: likewise
    BLOCK: tl.constexpr,  # elements per tile
    GRID_PER_SM: tl.constexpr,  # what the grid was sized with: read by the grid function only
):
    i_row = tl.program_id(0)
    slot = tl.load(slot_ptr + i_row).to(tl.int64)
    # -1 is padding; other ids outside the pool are caller bugs that validate mode reports.
    # Skipping them costs one compare and keeps them from reading another layer's state.
    if (slot < 0) | (slot >= num_slots):
        return
    first, count = _program_tiles(row_numel, BLOCK)
    p_src = pool_ptr + slot * stride_pool_slot
    p_dst = out_ptr + i_row.to(tl.int64) * stride_out_row
    offs = tl.arange(0, BLOCK)
    for i in range(count):
        o = (first + i).to(tl.int64) * BLOCK + offs
        m = o < row_numel
        tl.store(p_dst + o, tl.load(p_src + o, mask=m), mask=m)


@triton.jit(do_not_specialize=["tune_rows", "tune_row_bytes"])
def _scatter_kernel(
    pool_ptr,  # [num_slots, row_numel] integers of the element size, rows at stride_pool_slot
    slot_ptr,  # [B] int32/int64, -1 = padding
    src_ptr,  # [B, row_numel] rows at stride_src_row
    num_slots,  # ids at or past it are skipped
    row_numel,  # elements per slot
    stride_pool_slot,  # elements between slots
    stride_src_row,  # elements between rows of src
    tune_rows,  # batch bucket: read only by autotuning's key
    tune_row_bytes,  # row-size bucket: likewise
    BLOCK: tl.constexpr,  # elements per tile
    GRID_PER_SM: tl.constexpr,  # what the grid was sized with: read by the grid function only
):
    i_row = tl.program_id(0)
    slot = tl.load(slot_ptr + i_row).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):  # padding, or out of range (see _gather_kernel)
        return
    first, count = _program_tiles(row_numel, BLOCK)
    p_src = src_ptr + i_row.to(tl.int64) * stride_src_row
    p_dst = pool_ptr + slot * stride_pool_slot
    offs = tl.arange(0, BLOCK)
    for i in range(count):
        o = (first + i).to(tl.int64) * BLOCK + offs
        m = o < row_numel
        tl.store(p_dst + o, tl.load(p_src + o, mask=m), mask=m)


@triton.jit(do_not_specialize=["tune_rows", "tune_row_bytes"])
def _copy_kernel(
    pool_ptr,  # [num_slots, row_numel] integers of the element size, rows at stride_pool_slot
    src_slot_ptr,  # [N] int32/int64, -1 = skip the pair
    dst_slot_ptr,  # [N] int32/int64, -1 = skip the pair
    num_slots,  # ids at or past it are skipped
    row_numel,  # elements per slot
    stride_pool_slot,  # elements between slots
    tune_rows,  # pair-count bucket: read only by autotuning's key
    tune_row_bytes,  # row-size bucket: likewise
    BLOCK: tl.constexpr,  # elements per tile
    GRID_PER_SM: tl.constexpr,  # what the grid was sized with: read by the grid function only
):
    i_pair = tl.program_id(0)
    src = tl.load(src_slot_ptr + i_pair).to(tl.int64)
    dst = tl.load(dst_slot_ptr + i_pair).to(tl.int64)
    # padding, or out of range (see _gather_kernel)
    if (src < 0) | (dst < 0) | (src >= num_slots) | (dst >= num_slots):
        return
    first, count = _program_tiles(row_numel, BLOCK)
    p_src = pool_ptr + src * stride_pool_slot
    p_dst = pool_ptr + dst * stride_pool_slot
    offs = tl.arange(0, BLOCK)
    for i in range(count):
        o = (first + i).to(tl.int64) * BLOCK + offs
        m = o < row_numel
        tl.store(p_dst + o, tl.load(p_src + o, mask=m), mask=m)


_KERNELS = {"gather": _gather_kernel, "scatter": _scatter_kernel, "copy": _copy_kernel}

# ---- host side --------------------------------------------------------------------------------

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# ---- launching ----------------------------------------------------------------------------------

#: Triton versions whose compiled-kernel launch API ``_Launcher`` calls directly (the same check
#: as ``paged_decode.py``)
_DIRECT_LAUNCH = not _INTERPRETED and (3, 6) <= tuple(
    int(x) for x in triton.__version__.split(".")[:2]
) <= (3, 9)


class _Launcher:
    """Launch a ``@triton.jit`` kernel without Triton's per-call argument binding once its
    specialisation has been compiled (as in ``paged_decode.py``): ``JITFunction.run`` binds and
    specialises every argument on every call (tens of microseconds), while an engine launches
    the same specialisation for every layer of every step. The caller names the
    specialisation by a ``key`` holding whatever in its arguments may change between calls and
    matters to Triton (dtypes, pointer alignment, integer classes, constexprs); the first call
    of a key goes through Triton and keeps the compiled kernel, later ones call its launcher
    directly. Triton's path is always taken under the interpreter, while launch hooks are set
    (profilers), or with a Triton whose compiled-kernel API was not checked."""

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


_LAUNCHERS = {op: _Launcher(kernel) for op, kernel in _KERNELS.items()}


def _capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability; the CPU (the interpreter) counts as sm_80. The compile
    check monkeypatches this per target."""
    if device.type != "cuda":
        return (8, 0)
    return torch.cuda.get_device_capability(device)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Multiprocessors of the GPU; on the CPU an H100's 132, so the CPU tests see the grids an
    H100 would run."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _validate_enabled(validate: bool | None) -> bool:
    if validate is None:
        return os.environ.get("HYBRIDKV_VALIDATE", "") not in ("", "0")
    return validate


def _bucket(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the element's size: the kernels copy bits, whatever the
    dtype (and Triton cannot even name fp8 e4m3 on sm_80)."""
    return t if t.dtype == _BITS[t.element_size()] else t.view(_BITS[t.element_size()])


def _aligned(row_numel: int, *rows: tuple[torch.Tensor, int]) -> bool:
    """What Triton's argument specialisation needs to vectorise a row into 16-byte accesses:
    the row length and every row stride divisible by 16 elements, every base 16-byte aligned."""
    return row_numel % 16 == 0 and all(
        stride % 16 == 0 and t.data_ptr() % 16 == 0 for t, stride in rows
    )


def _check_pool(pool: torch.Tensor) -> int:
    """Number of elements in one slot; the per-slot part must be contiguous."""
    if pool.dim() < 2:
        raise ValueError(f"a state pool is [num_slots, *shape], got shape {tuple(pool.shape)}")
    if pool.element_size() not in _BITS:
        raise ValueError(f"pool elements must be 1, 2, 4 or 8 bytes, got {pool.dtype}")
    shape = pool.shape[1:]
    if math.prod(shape) == 0:  # empty rows: nothing to address
        return 0
    expected = 1
    for size, stride in zip(reversed(shape), reversed(pool.stride()[1:])):
        if size > 1 and stride != expected:
            raise ValueError(
                "the per-slot part of a state pool must be contiguous (only the slot stride may "
                f"be arbitrary); got strides {pool.stride()} for shape {tuple(pool.shape)}"
            )
        expected *= size
    return math.prod(shape)


def _check_ids(ids: torch.Tensor, name: str, device: torch.device | None = None) -> None:
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {ids.dtype} {ids.shape}")
    if device is not None and ids.device != device:
        raise ValueError(f"{name} is on {ids.device} but the pool is on {device}")


def _first_out_of_range(ids: torch.Tensor, name: str, num_slots: int) -> None:
    """Validate mode: raise for the first id outside ``[-1, num_slots)``."""
    bad = ((ids < -1) | (ids >= num_slots)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        value = int(ids[i])
        what = (
            "past the last slot (it would reach the memory after the pool, e.g. the next "
            "layer's state)"
            if value >= num_slots
            else "negative; only -1 means padding"
        )
        raise ValueError(
            f"{name}[{i}] = {value} is out of range: valid ids are -1 (padding) or "
            f"0..{num_slots - 1} (num_slots {num_slots}); {value} is {what}. Pass a slot "
            "below num_slots, or -1 to skip the row"
        )


def _first_duplicate(ids: torch.Tensor, name: str, why: str) -> None:
    """Validate mode: raise for the first live id that appears twice."""
    live = ids[ids >= 0]
    uniq, counts = live.unique(return_counts=True)
    if (counts > 1).any():
        value = int(uniq[counts > 1][0])
        first, second = (ids == value).nonzero().flatten()[:2].tolist()
        raise ValueError(
            f"{name}[{first}] and {name}[{second}] are both {value}: {why}; give each row its "
            "own slot (or -1 to skip one)"
        )


def _check_copy_pairs(src: torch.Tensor, dst: torch.Tensor, num_slots: int) -> None:
    """Validate mode for ``copy_states``: ranges, distinct destinations, no destination that
    another live pair reads."""
    _first_out_of_range(src, "src_slots", num_slots)
    _first_out_of_range(dst, "dst_slots", num_slots)
    live = (src >= 0) & (dst >= 0)
    live_dst = torch.where(live, dst, -1)
    _first_duplicate(
        live_dst, "dst_slots", "two pairs write that slot and which copy lands is unspecified"
    )
    # a live destination read by another live pair: count the live sources equal to each
    # destination, less the pair's own source (a slot copied onto itself is harmless)
    index = live.nonzero().flatten()
    live_src, live_dst = src[index], dst[index]
    sorted_src = live_src.sort().values
    readers = torch.searchsorted(sorted_src, live_dst, right=True) - torch.searchsorted(
        sorted_src, live_dst
    )
    clash = (readers - (live_src == live_dst).long() > 0).nonzero().flatten()
    if clash.numel():
        i = int(index[clash[0]])
        value = int(dst[i])
        j = next(int(k) for k in index if int(src[k]) == value and int(k) != i)
        raise ValueError(
            f"dst_slots[{i}] = {value} is also src_slots[{j}]: the pairs run in parallel, so "
            f"pair {j} would read the old or the new state of slot {value} at random. Split "
            "them into two calls (the pair that reads the slot first)"
        )


def state_shape(*, device: torch.device, elem_bytes: int, row_numel: int, rows: int) -> StateShape:
    """The :class:`StateShape` of a launch."""
    major, minor = _capability(device)
    return StateShape(
        arch=10 * major + minor,
        elem_bytes=elem_bytes,
        aligned=row_numel % 16 == 0,
        row_bytes=_bucket(row_numel * elem_bytes),
        rows=_bucket(rows),
    )


@functools.cache
def _autotuned_kernel(op: str, elem_bytes: int, aligned: bool, arch: int):
    """The ``op`` kernel under ``triton.autotune`` over the ``CONFIGS`` that fit this element
    size, alignment and arch (their tiles differ by both), keyed by the batch and row-size
    buckets. Built on first use: the interpreter cannot autotune. No ``restore_value``: see
    the module docstring (every launch is idempotent)."""
    configs: dict[tuple, triton.Config] = {}
    for c in CONFIGS:
        shape = StateShape(arch, elem_bytes, aligned, 1, 1)
        if not config_fits(c, shape):
            continue
        block = tile_elements(c, elem_bytes, aligned)
        # unaligned tiles cap the elements a thread, so configs collapse: keep one of each
        configs.setdefault(
            (block, c.num_warps, c.programs_per_sm),
            triton.Config(
                {"BLOCK": block, "GRID_PER_SM": c.programs_per_sm},
                num_warps=c.num_warps,
                num_stages=1,
            ),
        )
    return triton.autotune(list(configs.values()), key=["tune_rows", "tune_row_bytes"])(
        _KERNELS[op]
    )


@dataclass(frozen=True)
class _Launch:
    """One way to launch a plan's kernel: its grid, its constexprs and options, the plan's part
    of the direct launcher's key, or the autotuner that launches instead."""

    grid: tuple[int, int, int] | Callable
    meta: dict
    key: tuple = ()
    autotuned: Callable | None = None


@dataclass(frozen=True, eq=False)
class _StatePlan:
    """Everything ``run`` needs that does not change between the pool views (layers) of one
    step. Holds the slot ids by reference: a CUDA graph that captured ``run`` replays on
    whatever they hold then."""

    op: str  # "gather" | "scatter" | "copy"
    rows: int
    row_numel: int
    row_shape: tuple[int, ...] | None  # checked against every pool when planned with it
    dtype: torch.dtype
    shape: StateShape
    config: StateConfig
    config_source: str  # the table row, "autotune" or "given"
    autotune: bool
    slots: torch.Tensor = field(repr=False)
    _aligned_launch: _Launch | None = field(repr=False)  # None: row_numel % 16 != 0
    _unaligned_launch: _Launch = field(repr=False)

    # derived once, for run's fast checks: the contiguous strides of row_shape
    _row_strides: tuple[int, ...] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        strides = None
        if self.row_shape is not None:
            inner, acc = [], 1
            for n in reversed(self.row_shape):
                inner.append(acc)
                acc *= n
            strides = tuple(reversed(inner))
        object.__setattr__(self, "_row_strides", strides)  # a frozen dataclass's derived field

    def _check_pool(self, pool: torch.Tensor) -> None:
        if (
            self._row_strides is not None
            and pool.dtype == self.dtype
            and pool.shape[1:] == self.row_shape
            and pool.stride()[1:] == self._row_strides
        ):
            return  # the usual case, checked in a few comparisons
        if (
            pool.dtype != self.dtype
            or pool.dim() < 2
            or math.prod(pool.shape[1:]) != self.row_numel
            or (self.row_shape is not None and tuple(pool.shape[1:]) != self.row_shape)
        ):
            want = list(self.row_shape) if self.row_shape is not None else self.row_numel
            raise ValueError(
                f"pool must be [num_slots, *shape] {self.dtype} with slots of {want} elements "
                f"(the plan's), got {tuple(pool.shape)} {pool.dtype}"
            )
        _check_pool(pool)

    def _rows(self, batch: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """``batch [B, *shape]`` as rows: itself and its row stride when its per-row part is
        contiguous, else None."""
        if self._row_strides is not None and batch.stride()[1:] == self._row_strides:
            return batch, batch.stride(0)
        rows = batch.reshape(self.rows, self.row_numel)
        if rows.data_ptr() != batch.data_ptr() or rows.stride(1) != 1:
            return None
        return rows, rows.stride(0)

    def _launch(self, pool: torch.Tensor, *args: object, batch: tuple | None = None) -> None:
        """Launch on ``pool``'s bits; ``batch`` is ``(rows tensor, its row stride)`` for
        gather and scatter. The aligned tile when the views allow 16-byte vectors."""
        num_slots, stride = pool.shape[0], pool.stride(0)
        pool_align = pool.data_ptr() % 16
        batch_align = batch[0].data_ptr() % 16 if batch else 0
        # what Triton's specialisation needs to prove 16-byte vectors (see _aligned)
        aligned = (
            self._aligned_launch is not None
            and pool_align == 0
            and stride % 16 == 0
            and (batch is None or (batch_align == 0 and batch[1] % 16 == 0))
        )
        launch = self._aligned_launch if aligned else self._unaligned_launch
        extra = (batch[1],) if batch else ()
        args = (
            _as_bits(pool), *args, num_slots, self.row_numel, stride, *extra, self.shape.rows,
            self.shape.row_bytes,
        )  # fmt: skip
        if launch.autotuned is not None:
            launch.autotuned[launch.grid](*args, **launch.meta)
            return
        # what may differ between the views of a step and matters to Triton's specialisation
        key = (launch.key, pool_align, _int_class(num_slots), _int_class(stride))
        if batch:
            key += (batch_align, _int_class(batch[1]))
        _LAUNCHERS[self.op](launch.grid, key, args, launch.meta)


@dataclass(frozen=True, eq=False)
class GatherPlan(_StatePlan):
    """A planned :func:`gather_states` (made by :func:`plan_gather_states`)."""

    def run(self, pool: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather ``pool[slot_ids]`` into ``out [B, *shape]`` (allocated zero-filled when not
        given: then a padding row is zeros; a given ``out`` keeps its padding rows)."""
        self._check_pool(pool)
        if out is None:
            out = torch.zeros((self.rows, *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
        elif (
            out.dtype != pool.dtype or out.shape[0] != self.rows or out.shape[1:] != pool.shape[1:]
        ):
            raise ValueError(
                f"out must be {(self.rows, *pool.shape[1:])} {pool.dtype}, got "
                f"{tuple(out.shape)} {out.dtype}"
            )
        if self.rows == 0 or self.row_numel == 0:
            return out
        rows = self._rows(out)
        if rows is None:
            raise ValueError("out must have a contiguous per-row layout")
        self._launch(pool, self.slots, _as_bits(rows[0]), batch=rows)
        return out


@dataclass(frozen=True, eq=False)
class ScatterPlan(_StatePlan):
    """A planned :func:`scatter_states` (made by :func:`plan_scatter_states`)."""

    def run(self, pool: torch.Tensor, src: torch.Tensor) -> None:
        """Write ``src[i]`` (``[B, *shape]``, the pool's dtype) into ``pool[slot_ids[i]]``."""
        self._check_pool(pool)
        if src.dtype != pool.dtype or src.shape[0] != self.rows or src.shape[1:] != pool.shape[1:]:
            raise ValueError(
                f"src must be {(self.rows, *pool.shape[1:])} {pool.dtype}, got "
                f"{tuple(src.shape)} {src.dtype}"
            )
        if self.rows == 0 or self.row_numel == 0:
            return
        rows = self._rows(src)
        if rows is None:  # a strided src: copied (the only allocation of a run)
            src = src.reshape(self.rows, self.row_numel).contiguous()
            rows = (src, src.stride(0))
        self._launch(pool, self.slots, _as_bits(rows[0]), batch=rows)


@dataclass(frozen=True, eq=False)
class CopyPlan(_StatePlan):
    """A planned :func:`copy_states` (made by :func:`plan_copy_states`); ``slots`` holds the
    sources."""

    dst_slots: torch.Tensor | None = field(default=None, repr=False)

    def run(self, pool: torch.Tensor) -> None:
        """Copy slot ``src_slots[i]`` of ``pool`` to slot ``dst_slots[i]``."""
        self._check_pool(pool)
        if self.rows == 0 or self.row_numel == 0:
            return
        self._launch(pool, self.slots, self.dst_slots)


def _plan(
    cls: type,
    op: str,
    slots: torch.Tensor,
    *,
    row_shape: tuple[int, ...] | None,
    row_numel: int | None,
    dtype: torch.dtype,
    config: StateConfig | None,
    autotune: bool,
    **extra: object,
) -> _StatePlan:
    """What the three planners share: shape class, config, both launches."""
    elem_bytes = torch.empty((), dtype=dtype).element_size()
    if elem_bytes not in _BITS:
        raise ValueError(f"pool elements must be 1, 2, 4 or 8 bytes, got {dtype}")
    if (row_shape is None) == (row_numel is None):
        raise ValueError(
            "pass the per-slot shape as row_shape= (checked against every pool) or its "
            "element count as row_numel=, one of them"
        )
    if row_shape is not None:
        row_shape = tuple(int(n) for n in row_shape)
        row_numel = math.prod(row_shape)
    if row_numel < 0 or (row_shape is not None and min(row_shape, default=0) < 0):
        raise ValueError(f"row_shape / row_numel must not be negative: {row_shape or row_numel}")
    if autotune and _INTERPRETED:
        raise ValueError(
            "autotune=True needs a GPU: the Triton interpreter cannot time configs; leave it "
            "off (the table's config) or pass config="
        )
    if autotune and config is not None:
        raise ValueError("pass config= or autotune=True, not both")
    device = slots.device
    rows = slots.shape[0]
    shape = state_shape(device=device, elem_bytes=elem_bytes, row_numel=row_numel, rows=rows)
    if autotune:
        source = "autotune"
        config = choose_config(shape)[0]  # recorded only; the autotuner picks per launch
    elif config is None:
        config, source = choose_config(shape)
    else:
        if config not in CONFIGS:
            raise ValueError(f"{config} is not one of CONFIGS: {', '.join(map(str, CONFIGS))}")
        source = "given"
    sms = _num_sms(device)
    ids = (slots, *[t for t in extra.values() if isinstance(t, torch.Tensor)])
    # the plan's part of the direct launcher's key: every dtype, the ids' alignment, the
    # integers' classes (the views' parts are added per run)
    plan_key = (
        op, device, _BITS[elem_bytes], tuple(t.dtype for t in ids),
        tuple(t.data_ptr() % 16 for t in ids), _int_class(row_numel), _int_class(shape.rows),
        _int_class(shape.row_bytes),
    )  # fmt: skip

    def launch(aligned: bool) -> _Launch:
        if autotune:
            return _Launch(
                lambda meta: (
                    rows,
                    programs_per_row(rows, row_numel, meta["BLOCK"], meta["GRID_PER_SM"], sms),
                    1,
                ),
                {},
                autotuned=_autotuned_kernel(op, elem_bytes, aligned, shape.arch),
            )
        block = tile_elements(config, elem_bytes, aligned)
        split = programs_per_row(rows, row_numel, block, config.programs_per_sm, sms)
        meta = dict(
            BLOCK=block,
            GRID_PER_SM=config.programs_per_sm,
            num_warps=config.num_warps,
            num_stages=1,
        )
        return _Launch((rows, split, 1), meta, (plan_key, tuple(sorted(meta.items()))))

    return cls(
        op=op,
        rows=rows,
        row_numel=row_numel,
        row_shape=row_shape,
        dtype=dtype,
        shape=shape,
        config=config,
        config_source=source,
        autotune=autotune,
        slots=slots,
        _aligned_launch=launch(True) if shape.aligned else None,
        _unaligned_launch=launch(False),
        **extra,
    )


def plan_gather_states(
    slot_ids: torch.Tensor,
    *,
    dtype: torch.dtype,
    row_shape: tuple[int, ...] | None = None,
    row_numel: int | None = None,
    num_slots: int | None = None,
    config: StateConfig | None = None,
    autotune: bool = False,
    validate: bool | None = None,
) -> GatherPlan:
    """Plan a gather of ``slot_ids [B]`` (int32/int64, -1 = padding) from pools of ``dtype``
    whose slots are ``row_shape`` (checked against every pool; or only their element count,
    ``row_numel``); :meth:`GatherPlan.run` serves every pool view. ``config`` overrides the
    table (:func:`choose_config`); ``autotune=True`` tunes over ``CONFIGS`` on the GPU instead.
    ``validate`` (default: ``HYBRIDKV_VALIDATE``) checks every id against ``num_slots`` (one
    sync)."""
    _check_ids(slot_ids, "slot_ids")
    if _validate_enabled(validate):
        _need_num_slots(num_slots)
        _first_out_of_range(slot_ids.detach().cpu(), "slot_ids", num_slots)
    return _plan(
        GatherPlan,
        "gather",
        slot_ids,
        row_shape=row_shape,
        row_numel=row_numel,
        dtype=dtype,
        config=config,
        autotune=autotune,
    )


def plan_scatter_states(
    slot_ids: torch.Tensor,
    *,
    dtype: torch.dtype,
    row_shape: tuple[int, ...] | None = None,
    row_numel: int | None = None,
    num_slots: int | None = None,
    config: StateConfig | None = None,
    autotune: bool = False,
    validate: bool | None = None,
) -> ScatterPlan:
    """Plan a scatter into ``slot_ids [B]`` (live ids distinct); :meth:`ScatterPlan.run`
    serves every pool view. Arguments as :func:`plan_gather_states`; validation also checks
    that live ids are distinct."""
    _check_ids(slot_ids, "slot_ids")
    if _validate_enabled(validate):
        _need_num_slots(num_slots)
        ids = slot_ids.detach().cpu()
        _first_out_of_range(ids, "slot_ids", num_slots)
        _first_duplicate(ids, "slot_ids", "which row lands in that slot would be unspecified")
    return _plan(
        ScatterPlan,
        "scatter",
        slot_ids,
        row_shape=row_shape,
        row_numel=row_numel,
        dtype=dtype,
        config=config,
        autotune=autotune,
    )


def plan_copy_states(
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    dtype: torch.dtype,
    row_shape: tuple[int, ...] | None = None,
    row_numel: int | None = None,
    num_slots: int | None = None,
    config: StateConfig | None = None,
    autotune: bool = False,
    validate: bool | None = None,
) -> CopyPlan:
    """Plan slot-to-slot copies ``src_slots[i] -> dst_slots[i]`` (see the module's contract);
    :meth:`CopyPlan.run` serves every pool view. Arguments as :func:`plan_gather_states`."""
    _check_ids(src_slots, "src_slots")
    _check_ids(dst_slots, "dst_slots", src_slots.device)
    if src_slots.shape != dst_slots.shape:
        raise ValueError(
            f"src_slots {tuple(src_slots.shape)} and dst_slots {tuple(dst_slots.shape)} differ "
            "in length: pass one destination per source (-1 on either side skips a pair)"
        )
    if _validate_enabled(validate):
        _need_num_slots(num_slots)
        _check_copy_pairs(src_slots.detach().cpu(), dst_slots.detach().cpu(), num_slots)
    return _plan(
        CopyPlan,
        "copy",
        src_slots,
        row_shape=row_shape,
        row_numel=row_numel,
        dtype=dtype,
        config=config,
        autotune=autotune,
        dst_slots=dst_slots,
    )


def _need_num_slots(num_slots: int | None) -> None:
    if num_slots is None:
        raise ValueError("validate=True checks slot ids: pass num_slots (the pool's)")


# ---- the one-call wrappers ----------------------------------------------------------------------


def gather_states(
    pool: torch.Tensor,
    slot_ids: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    validate: bool | None = None,
    config: StateConfig | None = None,
    autotune: bool = False,
) -> torch.Tensor:
    """Gather ``pool[slot_ids]`` into a contiguous batch ``[B, *shape]``.

    Rows whose slot is ``-1`` are left as they are in ``out`` when it is given, and zero-filled
    when the function allocates ``out`` (so a padding row never carries stale state).
    ``validate`` (default: ``HYBRIDKV_VALIDATE``) checks every id, see the module's contract.
    :func:`plan_gather_states` + :meth:`GatherPlan.run` in one call.
    """
    _check_pool(pool)
    _check_ids(slot_ids, "slot_ids", pool.device)
    if out is not None and out.device != pool.device:
        raise ValueError(f"out is on {out.device} but the pool is on {pool.device}")
    plan = plan_gather_states(
        slot_ids,
        row_shape=tuple(pool.shape[1:]),
        dtype=pool.dtype,
        num_slots=pool.shape[0],
        config=config,
        autotune=autotune,
        validate=validate,
    )
    return plan.run(pool, out)


def scatter_states(
    pool: torch.Tensor,
    slot_ids: torch.Tensor,
    src: torch.Tensor,
    *,
    validate: bool | None = None,
    config: StateConfig | None = None,
    autotune: bool = False,
) -> None:
    """Write ``src[i]`` into ``pool[slot_ids[i]]``; rows with slot ``-1`` are skipped.

    Slot ids must be distinct (apart from ``-1``); which row wins a duplicate is unspecified.
    ``validate`` (default: ``HYBRIDKV_VALIDATE``) checks every id, see the module's contract.
    :func:`plan_scatter_states` + :meth:`ScatterPlan.run` in one call.
    """
    _check_pool(pool)
    _check_ids(slot_ids, "slot_ids", pool.device)
    batch = slot_ids.shape[0]
    if src.shape != (batch, *pool.shape[1:]) or src.dtype != pool.dtype:
        raise ValueError(
            f"src must be {(batch, *pool.shape[1:])} {pool.dtype}, got {tuple(src.shape)} "
            f"{src.dtype}"
        )
    if src.device != pool.device:
        raise ValueError(f"src is on {src.device} but the pool is on {pool.device}")
    plan = plan_scatter_states(
        slot_ids,
        row_shape=tuple(pool.shape[1:]),
        dtype=pool.dtype,
        num_slots=pool.shape[0],
        config=config,
        autotune=autotune,
        validate=validate,
    )
    plan.run(pool, src)


def copy_states(
    pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    validate: bool | None = None,
    config: StateConfig | None = None,
    autotune: bool = False,
) -> None:
    """Copy slot ``src_slots[i]`` to slot ``dst_slots[i]`` (prefix-cache checkpoints and hits).

    A pair with ``-1`` on either side is skipped. Destinations must be distinct and must not be
    sources of other pairs in the same call (the pairs run in parallel). ``validate`` (default:
    ``HYBRIDKV_VALIDATE``) checks every id and these rules, see the module's contract.
    :func:`plan_copy_states` + :meth:`CopyPlan.run` in one call.
    """
    _check_pool(pool)
    _check_ids(src_slots, "src_slots", pool.device)
    _check_ids(dst_slots, "dst_slots", pool.device)
    plan = plan_copy_states(
        src_slots,
        dst_slots,
        row_shape=tuple(pool.shape[1:]),
        dtype=pool.dtype,
        num_slots=pool.shape[0],
        config=config,
        autotune=autotune,
        validate=validate,
    )
    plan.run(pool)


#: the planners under the names of issue 27's brief
plan_state_gather = plan_gather_states
plan_state_scatter = plan_scatter_states
plan_state_copy = plan_copy_states


# ---- references (plain torch) -----------------------------------------------------------------


def gather_states_ref(
    pool: torch.Tensor, slot_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    batch = slot_ids.shape[0]
    if out is None:
        out = torch.zeros((batch, *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    live = slot_ids >= 0
    out[live] = pool[slot_ids[live].long()]
    return out


def scatter_states_ref(pool: torch.Tensor, slot_ids: torch.Tensor, src: torch.Tensor) -> None:
    live = slot_ids >= 0
    pool[slot_ids[live].long()] = src[live]


def copy_states_ref(pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    live = (src_slots >= 0) & (dst_slots >= 0)
    pool[dst_slots[live].long()] = pool[src_slots[live].long()].clone()
