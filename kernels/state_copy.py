"""Recurrent-state pool kernels: gather, scatter and slot-to-slot copy.

A state pool holds one component of a layer's state (e.g. a Mamba conv state ``[K-1, conv_dim]``
or a GDN recurrent state ``[heads, dv, dk]``) for every slot: a view ``[num_slots, *shape]`` whose
slot stride is arbitrary (a slot may be a page that also holds other components or layers) and
whose per-slot part is contiguous. Each slot is therefore one flat row of ``prod(shape)``
elements; these kernels move rows in tiles with int64 addressing (pools exceed 2**31 elements).

Slot id ``-1`` marks a padding row and is skipped.

Standalone: imports only torch and triton, so the file can be copied into another project.
"""

from __future__ import annotations

import math
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


# Copies are bandwidth bound: wide tiles, a few warps. These kernels only read their source and
# write their destination, so tuning in place is harmless for gather (it writes `out`) but not
# for scatter/copy, which write the pool: those restore it between trials.
_CONFIGS = [
    triton.Config({"BLOCK": 1024}, num_warps=4),
    triton.Config({"BLOCK": 2048}, num_warps=8),
    triton.Config({"BLOCK": 4096}, num_warps=8),
    triton.Config({"BLOCK": 8192}, num_warps=16),
]


@_autotune(_CONFIGS, key=["row_numel"])
@triton.jit
def _gather_kernel(
    pool_ptr,  # [num_slots, row_numel] rows at stride_pool_slot
    slot_ptr,  # [B] int32/int64, -1 = padding
    out_ptr,  # [B, row_numel] rows at stride_out_row
    row_numel,
    stride_pool_slot,
    stride_out_row,
    BLOCK: tl.constexpr,
):
    i_row = tl.program_id(0)
    i_tile = tl.program_id(1)
    slot = tl.load(slot_ptr + i_row).to(tl.int64)
    if slot < 0:
        return
    offs = i_tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    x = tl.load(pool_ptr + slot * stride_pool_slot + offs, mask=mask)
    tl.store(out_ptr + i_row.to(tl.int64) * stride_out_row + offs, x, mask=mask)


@_autotune(_CONFIGS, key=["row_numel"], restore_value=["pool_ptr"])
@triton.jit
def _scatter_kernel(
    pool_ptr,  # [num_slots, row_numel] rows at stride_pool_slot
    slot_ptr,  # [B] int32/int64, -1 = padding
    src_ptr,  # [B, row_numel] rows at stride_src_row
    row_numel,
    stride_pool_slot,
    stride_src_row,
    BLOCK: tl.constexpr,
):
    i_row = tl.program_id(0)
    i_tile = tl.program_id(1)
    slot = tl.load(slot_ptr + i_row).to(tl.int64)
    if slot < 0:
        return
    offs = i_tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    x = tl.load(src_ptr + i_row.to(tl.int64) * stride_src_row + offs, mask=mask)
    tl.store(pool_ptr + slot * stride_pool_slot + offs, x, mask=mask)


@_autotune(_CONFIGS, key=["row_numel"], restore_value=["pool_ptr"])
@triton.jit
def _copy_kernel(
    pool_ptr,  # [num_slots, row_numel] rows at stride_pool_slot
    src_slot_ptr,  # [N] int32/int64, -1 = skip the pair
    dst_slot_ptr,  # [N] int32/int64, -1 = skip the pair
    row_numel,
    stride_pool_slot,
    BLOCK: tl.constexpr,
):
    i_pair = tl.program_id(0)
    i_tile = tl.program_id(1)
    src = tl.load(src_slot_ptr + i_pair).to(tl.int64)
    dst = tl.load(dst_slot_ptr + i_pair).to(tl.int64)
    if (src < 0) | (dst < 0):
        return
    offs = i_tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    x = tl.load(pool_ptr + src * stride_pool_slot + offs, mask=mask)
    tl.store(pool_ptr + dst * stride_pool_slot + offs, x, mask=mask)


def _check_pool(pool: torch.Tensor) -> int:
    """Number of elements in one slot; the per-slot part must be contiguous."""
    if pool.dim() < 2:
        raise ValueError(f"a state pool is [num_slots, *shape], got shape {tuple(pool.shape)}")
    shape = pool.shape[1:]
    expected = 1
    for size, stride in zip(reversed(shape), reversed(pool.stride()[1:])):
        if size > 1 and stride != expected:
            raise ValueError(
                "the per-slot part of a state pool must be contiguous (only the slot stride may "
                f"be arbitrary); got strides {pool.stride()} for shape {tuple(pool.shape)}"
            )
        expected *= size
    return math.prod(shape)


def _check_ids(ids: torch.Tensor, name: str, device: torch.device) -> None:
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {ids.dtype} {ids.shape}")
    if ids.device != device:
        raise ValueError(f"{name} is on {ids.device} but the pool is on {device}")


def _grid(rows: int, row_numel: int):
    return lambda meta: (rows, triton.cdiv(row_numel, meta["BLOCK"]))


def gather_states(
    pool: torch.Tensor, slot_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Gather ``pool[slot_ids]`` into a contiguous batch ``[B, *shape]``.

    Rows whose slot is ``-1`` are left as they are in ``out`` when it is given, and zero-filled
    when the function allocates ``out`` (so a padding row never carries stale state).
    """
    row_numel = _check_pool(pool)
    _check_ids(slot_ids, "slot_ids", pool.device)
    batch = slot_ids.shape[0]
    if out is None:
        out = torch.zeros((batch, *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    elif out.shape != (batch, *pool.shape[1:]) or out.dtype != pool.dtype:
        raise ValueError(
            f"out must be {(batch, *pool.shape[1:])} {pool.dtype}, got {tuple(out.shape)} "
            f"{out.dtype}"
        )
    if batch == 0 or row_numel == 0:
        return out
    out_rows = out.reshape(batch, row_numel)
    if out_rows.data_ptr() != out.data_ptr() or out_rows.stride(1) != 1:
        raise ValueError("out must have a contiguous per-row layout")
    _gather_kernel[_grid(batch, row_numel)](
        pool, slot_ids, out_rows, row_numel, pool.stride(0), out_rows.stride(0)
    )
    return out


def scatter_states(pool: torch.Tensor, slot_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Write ``src[i]`` into ``pool[slot_ids[i]]``; rows with slot ``-1`` are skipped.

    Slot ids must be distinct (apart from ``-1``); which row wins a duplicate is unspecified.
    """
    row_numel = _check_pool(pool)
    _check_ids(slot_ids, "slot_ids", pool.device)
    batch = slot_ids.shape[0]
    if src.shape != (batch, *pool.shape[1:]) or src.dtype != pool.dtype:
        raise ValueError(
            f"src must be {(batch, *pool.shape[1:])} {pool.dtype}, got {tuple(src.shape)} "
            f"{src.dtype}"
        )
    if batch == 0 or row_numel == 0:
        return
    src_rows = src.reshape(batch, row_numel)
    if src_rows.stride(1) != 1:
        src_rows = src_rows.contiguous()
    _scatter_kernel[_grid(batch, row_numel)](
        pool, slot_ids, src_rows, row_numel, pool.stride(0), src_rows.stride(0)
    )


def copy_states(pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copy slot ``src_slots[i]`` to slot ``dst_slots[i]`` (prefix-cache checkpoints and hits).

    A pair with ``-1`` on either side is skipped. Destinations must be distinct and must not be
    sources of other pairs in the same call (the pairs run in parallel).
    """
    row_numel = _check_pool(pool)
    _check_ids(src_slots, "src_slots", pool.device)
    _check_ids(dst_slots, "dst_slots", pool.device)
    if src_slots.shape != dst_slots.shape:
        raise ValueError(
            f"src_slots {tuple(src_slots.shape)} and dst_slots {tuple(dst_slots.shape)} differ"
        )
    n = src_slots.shape[0]
    if n == 0 or row_numel == 0:
        return
    _copy_kernel[_grid(n, row_numel)](pool, src_slots, dst_slots, row_numel, pool.stride(0))


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
