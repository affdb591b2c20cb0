"""Cache write against its torch reference on every layout: bit-exact, nothing else written."""

from __future__ import annotations

import pytest
import torch

from hybridkv.layouts import LAYOUTS
from hybridkv_kernels.cache_write import write_kv_cache, write_kv_cache_ref

from .paged import SYNTHETIC, plan_caches, synthetic_caches


def _clone_views(backing, k, v):
    b2 = backing.clone()
    k2 = torch.as_strided(b2, k.shape, k.stride(), k.storage_offset())
    v2 = torch.as_strided(b2, v.shape, v.stride(), v.storage_offset())
    return b2, k2, v2


def _slots(num_tokens: int, num_blocks: int, block_size: int, pad_every: int = 5):
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::pad_every] = -1
    return slots


def _equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("layout", SYNTHETIC)
@pytest.mark.parametrize(
    "tokens, heads, dk, dv, block_size, dtype",
    [
        pytest.param(1, 1, 16, 16, 16, torch.float32, id="T1-H1-D16-bs16-fp32"),
        pytest.param(37, 3, 40, 24, 16, torch.float16, id="T37-H3-Dk40-Dv24-bs16-fp16"),
        pytest.param(100, 5, 64, 64, 48, torch.bfloat16, id="T100-H5-D64-bs48-bf16"),
    ],
)
def test_write_synthetic_layouts(layout, tokens, heads, dk, dv, block_size, dtype):
    num_blocks = 9
    backing, k_cache, v_cache = synthetic_caches(
        layout, num_blocks, block_size, heads, dk, dv, dtype
    )
    ref_backing, k_ref, v_ref = _clone_views(backing, k_cache, v_cache)
    key = torch.randn(tokens, heads, dk).to(dtype)
    value = torch.randn(tokens, heads, dv).to(dtype)
    slots = _slots(tokens, num_blocks, block_size)
    write_kv_cache(key, value, k_cache, v_cache, slots)
    write_kv_cache_ref(key, value, k_ref, v_ref, slots)
    assert _equal_bits(backing, ref_backing)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_into_real_plans(layout):
    buffers, k_cache, v_cache = plan_caches(layout, "float16")
    (name,) = [
        n
        for n, b in buffers.items()
        if b.data_ptr() <= k_cache.data_ptr() < b.data_ptr() + b.numel()
    ]
    backing = buffers[name]
    ref_backing = backing.clone()
    offset_k = k_cache.data_ptr() - backing.data_ptr()
    offset_v = v_cache.data_ptr() - backing.data_ptr()
    typed = ref_backing.view(k_cache.dtype)
    es = k_cache.element_size()
    k_ref = torch.as_strided(typed, k_cache.shape, k_cache.stride(), offset_k // es)
    v_ref = torch.as_strided(typed, v_cache.shape, v_cache.stride(), offset_v // es)
    num_blocks, block_size, heads, dk = k_cache.shape
    tokens = 61
    key = torch.randn(tokens, heads, dk, dtype=torch.float16)
    value = torch.randn(tokens, heads, v_cache.shape[3], dtype=torch.float16)
    slots = _slots(tokens, min(num_blocks, 12), block_size)
    write_kv_cache(key, value, k_cache, v_cache, slots)
    write_kv_cache_ref(key, value, k_ref, v_ref, slots)
    assert _equal_bits(backing, ref_backing)


def test_write_fp8_with_scale():
    dtype = torch.float8_e4m3fn
    backing, k_cache, v_cache = synthetic_caches("classic", 4, 16, 2, 32, 32, torch.float32)
    backing8 = torch.zeros(backing.numel(), dtype=dtype)
    k_cache = torch.as_strided(backing8, k_cache.shape, k_cache.stride(), k_cache.storage_offset())
    v_cache = torch.as_strided(backing8, v_cache.shape, v_cache.stride(), v_cache.storage_offset())
    ref_backing, k_ref, v_ref = _clone_views(backing8, k_cache, v_cache)
    # Inputs are fp8 values times power-of-two scales, so x / scale is exact and the test checks
    # scaling and addressing bit for bit. Rounding of inexact values is the hardware's job: the
    # interpreter's fp8 conversion can miss a mantissa carry (e.g. -127.5 -> -64), so it is
    # checked on a GPU only.
    k_scale, v_scale = torch.tensor(0.0625), torch.tensor(0.03125)
    k8 = (torch.randn(20, 2, 32) * 40).to(dtype)
    v8 = (torch.randn(20, 2, 32) * 40).to(dtype)
    key, value = k8.float() * k_scale, v8.float() * v_scale
    slots = _slots(20, 4, 16)
    write_kv_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    write_kv_cache_ref(key, value, k_ref, v_ref, slots, k_scale, v_scale)
    assert _equal_bits(backing8, ref_backing)
    live = slots >= 0
    blocks, offsets = slots[live] // 16, slots[live] % 16
    assert torch.equal(k_cache[blocks, offsets].view(torch.uint8), k8[live].view(torch.uint8))


def test_write_rejects_bad_shapes():
    _, k, v = synthetic_caches("classic", 2, 16, 2, 16, 16, torch.float32)
    key = torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match="k_cache must be"):
        write_kv_cache(
            torch.randn(3, 4, 16), torch.randn(3, 4, 16), k, v, torch.zeros(3, dtype=torch.long)
        )
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(key, key, k, v, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="fp8 caches need"):
        k8 = torch.empty(2, 16, 2, 16, dtype=torch.float8_e4m3fn)
        write_kv_cache(key, key, k8, k8, torch.zeros(3, dtype=torch.long))
