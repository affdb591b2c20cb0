"""State pool kernels against their torch references: bit-exact, padding rows untouched."""

from __future__ import annotations

import pytest
import torch

from hybridkv_kernels.state_copy import (
    copy_states,
    copy_states_ref,
    gather_states,
    gather_states_ref,
    scatter_states,
    scatter_states_ref,
)


def _pool(num_slots: int, shape: tuple[int, ...], slot_pad: int, dtype) -> torch.Tensor:
    """A pool whose slots sit ``slot_pad`` elements apart beyond their payload, like a state
    component inside a larger page; the gaps are NaN-poisoned so stray writes show."""
    numel = 1
    for s in shape:
        numel *= s
    stride = numel + slot_pad
    backing = torch.full((num_slots * stride + 7,), float("nan"), dtype=torch.float32)
    backing = backing.to(dtype)
    inner = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        inner[i] = inner[i + 1] * shape[i + 1]
    view = torch.as_strided(backing, (num_slots, *shape), (stride, *inner), 3)
    view.copy_(torch.randn(view.shape).to(dtype))
    return backing, view


CASES = [
    pytest.param((3, 40), 0, torch.float32, id="conv-3x40-contig-fp32"),
    pytest.param((3, 1000), 57, torch.bfloat16, id="conv-3x1000-padded-bf16"),
    pytest.param((4, 16, 33), 5, torch.float32, id="ssm-4x16x33-fp32"),
    pytest.param((7,), 1, torch.float16, id="rglru-7-fp16"),
    pytest.param((2, 64, 48), 128, torch.float16, id="gdn-2x64x48-fp16"),
]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int8) if a.element_size() == 1 else a, b) or torch.equal(
        a.float().nan_to_num(1e9), b.float().nan_to_num(1e9)
    )


@pytest.mark.parametrize("shape, pad, dtype", CASES)
def test_gather(shape, pad, dtype):
    _, pool = _pool(11, shape, pad, dtype)
    slots = torch.tensor([5, -1, 0, 10, 3, -1, 7], dtype=torch.int32)
    out = torch.full((len(slots), *shape), float("nan")).to(dtype)
    expected = out.clone()
    gather_states_ref(pool, slots, expected)
    gather_states(pool, slots, out)
    assert _same(out, expected)
    assert torch.isnan(out[1].float()).all()  # padding rows untouched when `out` is given
    fresh = gather_states(pool, slots.long())
    assert torch.equal(fresh[1], torch.zeros_like(fresh[1]))  # zero-filled when allocated
    assert torch.equal(fresh[0], pool[5])


@pytest.mark.parametrize("shape, pad, dtype", CASES)
def test_scatter_touches_only_its_slots(shape, pad, dtype):
    backing, pool = _pool(9, shape, pad, dtype)
    ref_backing = backing.clone()
    ref_pool = torch.as_strided(ref_backing, pool.shape, pool.stride(), pool.storage_offset())
    slots = torch.tensor([8, -1, 2, 4], dtype=torch.int64)
    src = torch.randn((4, *shape)).to(dtype)
    scatter_states(pool, slots, src)
    scatter_states_ref(ref_pool, slots, src)
    # the whole backing store, gaps included, matches: nothing written outside the slots
    assert _same(backing, ref_backing)


@pytest.mark.parametrize("shape, pad, dtype", CASES)
def test_copy_slot_to_slot(shape, pad, dtype):
    backing, pool = _pool(10, shape, pad, dtype)
    ref_backing = backing.clone()
    ref_pool = torch.as_strided(ref_backing, pool.shape, pool.stride(), pool.storage_offset())
    src = torch.tensor([1, 4, -1, 7, 0], dtype=torch.int32)
    dst = torch.tensor([2, 9, 3, -1, 5], dtype=torch.int32)
    copy_states(pool, src, dst)
    copy_states_ref(ref_pool, src, dst)
    assert _same(backing, ref_backing)


def test_bad_inputs():
    _, pool = _pool(4, (3, 8), 0, torch.float32)
    with pytest.raises(ValueError, match="1-D int32/int64"):
        gather_states(pool, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="differ"):
        copy_states(pool, torch.tensor([0]), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="contiguous"):
        gather_states(pool.transpose(1, 2), torch.tensor([0]))
    with pytest.raises(ValueError, match="src must be"):
        scatter_states(pool, torch.tensor([0]), torch.zeros(2, 3, 8))


def test_int64_addressing_beyond_2_31_elements():
    """Slot 2 of this pool starts past element 2**31: int32 offsets would wrap around."""
    row = 64
    stride = 2**30 + 4096  # elements between slots
    backing = torch.empty(2 * stride + row, dtype=torch.int8)  # ~2 GiB, never zero-filled
    pool = torch.as_strided(backing, (3, row), (stride, 1))
    payload = torch.randint(-100, 100, (3, row), dtype=torch.int8)
    pool.copy_(payload)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    out = gather_states(pool, slots)
    assert torch.equal(out, payload[[2, 0]])
    new = torch.randint(-100, 100, (1, row), dtype=torch.int8)
    scatter_states(pool, torch.tensor([2]), new)
    assert torch.equal(pool[2], new[0]) and torch.equal(pool[1], payload[1])
    copy_states(pool, torch.tensor([2]), torch.tensor([1]))
    assert torch.equal(pool[1], new[0])
