"""Recurrent-state pool kernels: gather, scatter and slot-to-slot copy.

A state pool holds one component of a layer's state (e.g. a Mamba conv state ``[K-1, conv_dim]``
or a GDN recurrent state ``[heads, dv, dk]``) for every slot: a view ``[num_slots, *shape]`` whose
slot stride is arbitrary (a slot may be a page that also holds other components or layers) and
whose per-slot part is contiguous. Each slot is therefore one flat row of ``prod(shape)``
elements; these kernels move rows in tiles with int64 addressing (pools exceed 2**31 elements).
They only move bits, so every pool is handed to the kernels as unsigned/signed integers of its
element size: fp8 pools (e4m3 included) compile on sm_80 too, and NaN payloads survive.

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
- Checked only with ``validate=True`` (or ``HYBRIDKV_VALIDATE=1``; one sync): every id's range,
  and the distinctness rules above. Without it an id outside ``[-1, num_slots)`` is not
  reported; the kernels skip its row (never reading or writing past the pool, e.g. into the next
  layer's state), and the distinctness rules are the caller's promise.

Hopper: no matmul, so wgmma does not apply. TMA (``cp.async.bulk``) could move a whole row
through shared memory with one thread issuing, freeing the registers that hold a tile in
flight; the copies here are already 16-byte vectorised and bound by memory bandwidth for
aligned rows, so the expected gain is small, and unaligned rows (not a multiple of 16
elements) could not use it (TMA needs 16-byte aligned addresses and sizes).

Standalone: imports only torch and triton, so the file can be copied into another project.
"""

from __future__ import annotations

import math
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


def _validate_enabled(validate: bool | None) -> bool:
    if validate is None:
        return os.environ.get("HYBRIDKV_VALIDATE", "") not in ("", "0")
    return validate


# Copies are bandwidth bound: wide tiles, a few warps. No ``restore_value`` for the kernels
# that write the pool: tuning runs each candidate several times in place, and every launch is
# idempotent (a scatter writes the same rows to the same slots; a copy's destinations are never
# its sources, see the contract), so the trials leave exactly what one launch leaves, without
# cloning the whole pool (a spike the size of the pool on the first call per key).
_CONFIGS = [
    triton.Config({"BLOCK": 1024}, num_warps=4),
    triton.Config({"BLOCK": 2048}, num_warps=8),
    triton.Config({"BLOCK": 4096}, num_warps=8),
    triton.Config({"BLOCK": 8192}, num_warps=16),
]

# Elements per thread when a row is not ALIGNED. Triton then cannot prove 16-byte alignment, so
# each element is its own load and store with its own 64-bit address and predicate; at 16 per
# thread ptxas spills (seen for 1- and 2-byte elements on sm_80 and sm_90: predicates moved to
# registers, addresses to local memory). At 8 it does not, for any element size.
_MAX_UNALIGNED_PER_THREAD = 8


def _prune_configs(
    configs: list[triton.Config], named_args: dict, **kwargs
) -> list[triton.Config]:
    """Aligned rows keep every config (16-byte accesses, few per thread); unaligned ones
    only those with at most ``_MAX_UNALIGNED_PER_THREAD`` elements per thread."""
    if {**named_args, **kwargs}["ALIGNED"]:
        return configs
    return [
        c for c in configs if c.kwargs["BLOCK"] <= _MAX_UNALIGNED_PER_THREAD * 32 * c.num_warps
    ]


# ALIGNED is in the key so that a choice made for an aligned row is never reused for an
# unaligned one of the same length (where it might be a pruned, spilling config).
_TUNING = dict(
    key=["row_numel", "ALIGNED"], prune_configs_by={"early_config_prune": _prune_configs}
)


@_autotune(_CONFIGS, **_TUNING)
@triton.jit
def _gather_kernel(
    pool_ptr,  # [num_slots, row_numel] rows at stride_pool_slot
    slot_ptr,  # [B] int32/int64, -1 = padding
    out_ptr,  # [B, row_numel] rows at stride_out_row
    num_slots,  # ids at or past it are skipped
    row_numel,  # elements per slot
    stride_pool_slot,  # elements between slots
    stride_out_row,  # elements between rows of out
    ALIGNED: tl.constexpr,  # row_numel, strides and pointers 16-divisible (keys and prunes)
    BLOCK: tl.constexpr,
):
    i_row = tl.program_id(0)
    i_tile = tl.program_id(1)
    slot = tl.load(slot_ptr + i_row).to(tl.int64)
    # -1 is padding; other ids outside the pool are caller bugs that validate mode reports.
    # Skipping them costs one compare and keeps them from reading another layer's state.
    if (slot < 0) | (slot >= num_slots):
        return
    offs = i_tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_row = offs < row_numel
    x = tl.load(pool_ptr + slot * stride_pool_slot + offs, mask=m_row)
    tl.store(out_ptr + i_row.to(tl.int64) * stride_out_row + offs, x, mask=m_row)


@_autotune(_CONFIGS, **_TUNING)
@triton.jit
def _scatter_kernel(
    pool_ptr,  # [num_slots, row_numel] rows at stride_pool_slot
    slot_ptr,  # [B] int32/int64, -1 = padding
    src_ptr,  # [B, row_numel] rows at stride_src_row
    num_slots,  # ids at or past it are skipped
    row_numel,  # elements per slot
    stride_pool_slot,  # elements between slots
    stride_src_row,  # elements between rows of src
    ALIGNED: tl.constexpr,  # row_numel, strides and pointers 16-divisible (keys and prunes)
    BLOCK: tl.constexpr,
):
    i_row = tl.program_id(0)
    i_tile = tl.program_id(1)
    slot = tl.load(slot_ptr + i_row).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):  # padding, or out of range (see _gather_kernel)
        return
    offs = i_tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_row = offs < row_numel
    x = tl.load(src_ptr + i_row.to(tl.int64) * stride_src_row + offs, mask=m_row)
    tl.store(pool_ptr + slot * stride_pool_slot + offs, x, mask=m_row)


@_autotune(_CONFIGS, **_TUNING)
@triton.jit
def _copy_kernel(
    pool_ptr,  # [num_slots, row_numel] rows at stride_pool_slot
    src_slot_ptr,  # [N] int32/int64, -1 = skip the pair
    dst_slot_ptr,  # [N] int32/int64, -1 = skip the pair
    num_slots,  # ids at or past it are skipped
    row_numel,  # elements per slot
    stride_pool_slot,  # elements between slots
    ALIGNED: tl.constexpr,  # row_numel, stride and pointer 16-divisible (keys and prunes)
    BLOCK: tl.constexpr,
):
    i_pair = tl.program_id(0)
    i_tile = tl.program_id(1)
    src = tl.load(src_slot_ptr + i_pair).to(tl.int64)
    dst = tl.load(dst_slot_ptr + i_pair).to(tl.int64)
    # padding, or out of range (see _gather_kernel)
    if (src < 0) | (dst < 0) | (src >= num_slots) | (dst >= num_slots):
        return
    offs = i_tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_row = offs < row_numel
    x = tl.load(pool_ptr + src * stride_pool_slot + offs, mask=m_row)
    tl.store(pool_ptr + dst * stride_pool_slot + offs, x, mask=m_row)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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


def _grid(rows: int, row_numel: int):
    return lambda meta: (rows, triton.cdiv(row_numel, meta["BLOCK"]))


def gather_states(
    pool: torch.Tensor,
    slot_ids: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    validate: bool | None = None,
) -> torch.Tensor:
    """Gather ``pool[slot_ids]`` into a contiguous batch ``[B, *shape]``.

    Rows whose slot is ``-1`` are left as they are in ``out`` when it is given, and zero-filled
    when the function allocates ``out`` (so a padding row never carries stale state).
    ``validate`` (default: ``HYBRIDKV_VALIDATE``) checks every id, see the module's contract.
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
    if out.device != pool.device:
        raise ValueError(f"out is on {out.device} but the pool is on {pool.device}")
    if _validate_enabled(validate):
        _first_out_of_range(slot_ids.detach().cpu(), "slot_ids", pool.shape[0])
    if batch == 0 or row_numel == 0:
        return out
    out_rows = out.reshape(batch, row_numel)
    if out_rows.data_ptr() != out.data_ptr() or out_rows.stride(1) != 1:
        raise ValueError("out must have a contiguous per-row layout")
    pool_bits, out_bits = _as_bits(pool), _as_bits(out_rows)
    _gather_kernel[_grid(batch, row_numel)](
        pool_bits,
        slot_ids,
        out_bits,
        pool.shape[0],
        row_numel,
        pool.stride(0),
        out_rows.stride(0),
        ALIGNED=_aligned(row_numel, (pool, pool.stride(0)), (out_rows, out_rows.stride(0))),
    )
    return out


def scatter_states(
    pool: torch.Tensor,
    slot_ids: torch.Tensor,
    src: torch.Tensor,
    *,
    validate: bool | None = None,
) -> None:
    """Write ``src[i]`` into ``pool[slot_ids[i]]``; rows with slot ``-1`` are skipped.

    Slot ids must be distinct (apart from ``-1``); which row wins a duplicate is unspecified.
    ``validate`` (default: ``HYBRIDKV_VALIDATE``) checks every id, see the module's contract.
    """
    row_numel = _check_pool(pool)
    _check_ids(slot_ids, "slot_ids", pool.device)
    batch = slot_ids.shape[0]
    if src.shape != (batch, *pool.shape[1:]) or src.dtype != pool.dtype:
        raise ValueError(
            f"src must be {(batch, *pool.shape[1:])} {pool.dtype}, got {tuple(src.shape)} "
            f"{src.dtype}"
        )
    if src.device != pool.device:
        raise ValueError(f"src is on {src.device} but the pool is on {pool.device}")
    if _validate_enabled(validate):
        ids = slot_ids.detach().cpu()
        _first_out_of_range(ids, "slot_ids", pool.shape[0])
        _first_duplicate(ids, "slot_ids", "which row lands in that slot would be unspecified")
    if batch == 0 or row_numel == 0:
        return
    src_rows = src.reshape(batch, row_numel)
    if src_rows.stride(1) != 1:
        src_rows = src_rows.contiguous()
    _scatter_kernel[_grid(batch, row_numel)](
        _as_bits(pool),
        slot_ids,
        _as_bits(src_rows),
        pool.shape[0],
        row_numel,
        pool.stride(0),
        src_rows.stride(0),
        ALIGNED=_aligned(row_numel, (pool, pool.stride(0)), (src_rows, src_rows.stride(0))),
    )


def copy_states(
    pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    validate: bool | None = None,
) -> None:
    """Copy slot ``src_slots[i]`` to slot ``dst_slots[i]`` (prefix-cache checkpoints and hits).

    A pair with ``-1`` on either side is skipped. Destinations must be distinct and must not be
    sources of other pairs in the same call (the pairs run in parallel). ``validate`` (default:
    ``HYBRIDKV_VALIDATE``) checks every id and these rules, see the module's contract.
    """
    row_numel = _check_pool(pool)
    _check_ids(src_slots, "src_slots", pool.device)
    _check_ids(dst_slots, "dst_slots", pool.device)
    if src_slots.shape != dst_slots.shape:
        raise ValueError(
            f"src_slots {tuple(src_slots.shape)} and dst_slots {tuple(dst_slots.shape)} differ "
            "in length: pass one destination per source (-1 on either side skips a pair)"
        )
    if _validate_enabled(validate):
        _check_copy_pairs(src_slots.detach().cpu(), dst_slots.detach().cpu(), pool.shape[0])
    n = src_slots.shape[0]
    if n == 0 or row_numel == 0:
        return
    _copy_kernel[_grid(n, row_numel)](
        _as_bits(pool),
        src_slots,
        dst_slots,
        pool.shape[0],
        row_numel,
        pool.stride(0),
        ALIGNED=_aligned(row_numel, (pool, pool.stride(0))),
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
