"""Count the bytes kernels load from given tensors, under the Triton interpreter (no GPU).

The interpreter runs every program of a launch with numpy and performs each ``tl.load`` through
``InterpreterBuilder.create_masked_load(ptrs, mask, other, ...)`` (``create_load`` builds an
all-true mask and calls it): ``ptrs.data`` holds one address per element and ``mask.data`` says
which elements are loaded. Masked-off elements cost no memory traffic on a GPU either, so only
mask-true elements are counted. CPU tensors keep their storage under the interpreter (it wraps
the same storage), so an address belongs to a tensor when it falls in that tensor's storage byte
range; views of a tensor (``cache.view(torch.uint8)``, strided K/V views) share it.

    with count_loads(k=k_cache, v=v_cache, table=block_tables) as loaded:
        paged_decode_attention(...)
    loaded["k"]  # bytes loaded from k_cache's storage, summed over every program and launch

What this measures is DRAM-level traffic only if every load misses the caches; it counts what the
kernel asks for, which is what the kernel's structure decides (a K/V tile loaded once per query
head instead of once per KV head shows up as a multiple).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


def storage_range(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses of the tensor's whole storage."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


class LoadCounter(dict):
    """``name -> bytes loaded``, plus ``elements`` (name -> elements loaded) and ``loads``
    (name -> number of ``tl.load`` calls that touched the tensor)."""

    def __init__(self, names):
        super().__init__({n: 0 for n in names})
        self.elements = {n: 0 for n in names}
        self.loads = {n: 0 for n in names}


@contextmanager
def count_loads(*tensors: torch.Tensor, **named: torch.Tensor) -> Iterator[LoadCounter]:
    """Count bytes loaded from each tensor's storage while the block runs.

    Positional tensors are named ``0``, ``1``, ...; keyword tensors by their keyword. Tensors
    must not share a storage (each byte would count for both)."""
    from triton.runtime import interpreter

    items = [(str(i), t) for i, t in enumerate(tensors)] + list(named.items())
    ranges = [(name, *storage_range(t)) for name, t in items]
    for i, (a, lo_a, hi_a) in enumerate(ranges):
        for b, lo_b, hi_b in ranges[i + 1 :]:
            if lo_a < hi_b and lo_b < hi_a:
                raise ValueError(f"tensors {a!r} and {b!r} share storage; pass separate tensors")
    counter = LoadCounter([name for name, _ in items])
    builder = interpreter.InterpreterBuilder
    masked_load, plain_load = builder.create_masked_load, builder.create_load
    depth = [0]  # create_load calls create_masked_load: count the outer call only

    def count(ptrs, mask) -> None:
        addr = np.asarray(ptrs.data).astype(np.uint64, copy=False)
        live = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        for name, lo, hi in ranges:
            hit = live & (addr >= np.uint64(lo)) & (addr < np.uint64(hi))
            n = int(np.count_nonzero(hit))
            if n:
                counter[name] += n * size
                counter.elements[name] += n
                counter.loads[name] += 1

    def create_masked_load(self, ptrs, mask, *args, **kwargs):
        if depth[0] == 0:
            count(ptrs, mask)
        depth[0] += 1
        try:
            return masked_load(self, ptrs, mask, *args, **kwargs)
        finally:
            depth[0] -= 1

    def create_load(self, ptr, *args, **kwargs):
        if depth[0] == 0:
            count(ptr, _AllTrue())
        depth[0] += 1
        try:
            return plain_load(self, ptr, *args, **kwargs)
        finally:
            depth[0] -= 1

    builder.create_masked_load, builder.create_load = create_masked_load, create_load
    try:
        yield counter
    finally:
        builder.create_masked_load, builder.create_load = masked_load, plain_load


class _AllTrue:
    data = True
