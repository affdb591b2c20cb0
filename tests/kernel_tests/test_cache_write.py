"""Cache write against its torch reference on every layout: bit-exact, nothing else written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hybridkv.layouts import LAYOUTS
from hybridkv_kernels import cache_write
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


def _fp8_caches(dtype, num_blocks=4, block_size=16, heads=2, d=32):
    backing, k_cache, v_cache = synthetic_caches(
        "classic", num_blocks, block_size, heads, d, d, torch.float32
    )
    backing8 = torch.full((backing.numel(),), 0x7F, dtype=torch.uint8).view(dtype)  # NaN
    k_cache = torch.as_strided(backing8, k_cache.shape, k_cache.stride(), k_cache.storage_offset())
    v_cache = torch.as_strided(backing8, v_cache.shape, v_cache.stride(), v_cache.storage_offset())
    return backing8, k_cache, v_cache


@pytest.mark.parametrize(
    "dtype, soft",
    [(torch.float8_e4m3fn, False), (torch.float8_e4m3fn, True), (torch.float8_e5m2, False)],
    ids=["e4m3", "e4m3-soft", "e5m2"],
)
def test_write_fp8_with_scale(dtype, soft, monkeypatch):
    if soft:  # as on an sm_80 GPU: the kernel writes bytes it encodes in software
        monkeypatch.setattr(cache_write, "_fp8e4_in_hardware", lambda device: False)
    backing8, k_cache, v_cache = _fp8_caches(dtype)
    ref_backing, k_ref, v_ref = _clone_views(backing8, k_cache, v_cache)
    # Inputs are fp8 values times power-of-two scales, so x / scale is exact and the test checks
    # scaling and addressing bit for bit. The interpreter's own fp8 conversion (the "hardware"
    # path on a CPU) rounds inexact values wrongly (e.g. -127.5 -> -64), so rounding is checked
    # on the software path below and on a GPU.
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


def _e4m3_boundary_values() -> torch.Tensor:
    """Every e4m3 value, every midpoint between neighbours (and past 448, where torch
    saturates), each with its fp32 neighbours on both sides; the subnormal and underflow
    boundaries; zeros, infinities, NaNs (with payloads), the fp32 extremes; both signs."""
    codes = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    midpoints = (codes[1:] + codes[:-1]) / 2
    above_max = [464.0, 480.0, 496.0, 512.0, 1e4, 3.4028235e38, float("inf")]
    tiny = [2.0**-10, 3 * 2.0**-11, 2.0**-6, 2.0**-7 + 2.0**-10, 1e-30, 1e-45, 1.1754942e-38]
    special = torch.tensor(above_max + tiny)
    values = torch.cat([codes, midpoints, special])
    up = torch.nextafter(values, torch.tensor(float("inf")))
    down = torch.nextafter(values, torch.tensor(0.0))
    values = torch.cat([values, up, down])
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF], dtype=torch.int32).view(
        torch.float32
    )
    values = torch.cat([values, nans])
    return torch.cat([values, -values])


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy, on signalling NaNs
def test_soft_e4m3_encodes_like_torch(monkeypatch):
    """The software encoder against torch's ``.to(float8_e4m3fn)``, byte for byte: rounding
    boundaries exhaustively, then random values over 2**-24 .. 2**12."""
    monkeypatch.setattr(cache_write, "_fp8e4_in_hardware", lambda device: False)
    gen = torch.Generator().manual_seed(torch.seed() % 2**32)
    scales = 2.0 ** torch.randint(-24, 12, (40000,), generator=gen).float()
    x = torch.cat([_e4m3_boundary_values(), torch.randn(40000, generator=gen) * scales])
    heads, d = 8, 256
    tokens = -(-x.numel() // (heads * d))
    key = torch.zeros(tokens * heads * d)
    key[: x.numel()] = x
    key = key.view(tokens, heads, d)
    _, k_cache, v_cache = _fp8_caches(torch.float8_e4m3fn, tokens, 1, heads, d)
    one = torch.tensor(1.0)
    write_kv_cache(key, key, k_cache, v_cache, torch.arange(tokens), one, one)
    got = k_cache.reshape(-1).view(torch.uint8)[: x.numel()]
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [
        (x[i].item(), hex(int(got[i])), hex(int(want[i]))) for i in bad[:10].tolist()
    ]
    assert torch.equal(
        v_cache.reshape(-1).view(torch.uint8), k_cache.reshape(-1).view(torch.uint8)
    )


@pytest.mark.parametrize(
    "layout, dtype",
    [("packed3-layer1", torch.float16), ("head-major", torch.bfloat16)],
    ids=["packed3-layer1-fp16", "head-major-bf16"],
)
def test_soft_e4m3_with_scales_matches_reference(layout, dtype, monkeypatch):
    """Inexact x / scale (division rounded as torch rounds it, then encoded) into strided
    pages: the whole backing store equals the reference's, padding and gaps untouched."""
    monkeypatch.setattr(cache_write, "_fp8e4_in_hardware", lambda device: False)
    backing, k_cache, v_cache = synthetic_caches(layout, 6, 16, 3, 64, 48, torch.float32)
    backing8 = torch.full((backing.numel(),), 0xFF, dtype=torch.uint8).view(torch.float8_e4m3fn)
    views = [
        torch.as_strided(backing8, c.shape, c.stride(), c.storage_offset())
        for c in (k_cache, v_cache)
    ]
    ref_backing, k_ref, v_ref = _clone_views(backing8, *views)
    key = (torch.randn(40, 3, 64) * 3).to(dtype)
    value = (torch.randn(40, 3, 48) * 100).to(dtype)
    k_scale, v_scale = torch.tensor(0.0137), torch.tensor(0.29)
    slots = _slots(40, 6, 16)
    write_kv_cache(key, value, *views, slots, k_scale, v_scale)
    write_kv_cache_ref(key, value, k_ref, v_ref, slots, k_scale, v_scale)
    assert _equal_bits(backing8, ref_backing)


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


# ---- validation (contract in the module docstring) --------------------------------------------


def _small(slot_dtype=torch.int64):
    backing, k, v = synthetic_caches("layer-outer", 3, 16, 2, 16, 16, torch.float32)
    key = torch.randn(4, 2, 16)
    slots = torch.tensor([0, 17, -1, 40], dtype=slot_dtype)
    return backing, k, v, key, slots


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    "bad, message",
    [
        (
            48,
            r"slot_mapping\[1\] = 48 is out of range: valid slots are -1 \(padding\) or "
            r"0\.\.47 \(num_blocks 3 \* block_size 16\); 48 is past the end of the cache",
        ),
        (-2, r"slot_mapping\[1\] = -2 is out of range.*negative; only -1 means a padding"),
        (10**6, r"slot_mapping\[1\] = 1000000 is out of range"),
    ],
    ids=["num_blocks*block_size", "minus-2", "far"],
)
def test_validate_rejects_out_of_range_slots(slot_dtype, bad, message):
    _, k, v, key, slots = _small(slot_dtype)
    slots[1] = bad
    with pytest.raises(ValueError, match=message):
        write_kv_cache(key, key, k, v, slots, validate=True)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_validate_rejects_duplicate_slots(slot_dtype):
    _, k, v, key, slots = _small(slot_dtype)
    slots[3] = 17
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] and slot_mapping\[3\] are both 17"):
        write_kv_cache(key, key, k, v, slots, validate=True)


def test_validate_follows_the_environment(monkeypatch):
    _, k, v, key, slots = _small()
    slots[0] = 48
    monkeypatch.setenv("HYBRIDKV_VALIDATE", "1")
    with pytest.raises(ValueError, match="out of range"):
        write_kv_cache(key, key, k, v, slots)
    write_kv_cache(key, key, k, v, slots, validate=False)  # the argument wins
    monkeypatch.setenv("HYBRIDKV_VALIDATE", "0")
    write_kv_cache(key, key, k, v, slots)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_unvalidated_bad_slots_never_write_outside_the_cache(slot_dtype):
    """Without validate a slot past the cache is skipped, not written into the next layer's
    tensor that follows it in memory (layer-outer: this cache is layer 2 of 4)."""
    backing, k, v, key, slots = _small(slot_dtype)
    slots[1], slots[3] = 48, -2
    ref_backing, k_ref, v_ref = _clone_views(backing, k, v)
    write_kv_cache(key, key, k, v, slots, validate=False)
    live = torch.tensor([0, -1, -1, -1], dtype=slot_dtype)
    write_kv_cache_ref(key, key, k_ref, v_ref, live)
    assert _equal_bits(backing, ref_backing)


def test_int32_and_int64_slots_write_the_same():
    b32, k32, v32 = synthetic_caches("packed3-layer1", 5, 16, 3, 32, 32, torch.float16)
    b64, k64, v64 = _clone_views(b32, k32, v32)
    key, value = torch.randn(30, 3, 32).half(), torch.randn(30, 3, 32).half()
    slots = _slots(30, 5, 16)
    write_kv_cache(key, value, k32, v32, slots.int(), validate=True)
    write_kv_cache(key, value, k64, v64, slots.long(), validate=True)
    assert _equal_bits(b32, b64)


# ---- tuning ------------------------------------------------------------------------------------


def test_writing_twice_equals_writing_once():
    """What lets the autotuner run its trials on the real cache without restoring it."""
    once, k1, v1 = synthetic_caches("classic", 4, 16, 2, 32, 32, torch.float16)
    twice, k2, v2 = _clone_views(once, k1, v1)
    key, value = torch.randn(40, 2, 32).half(), torch.randn(40, 2, 32).half()
    slots = _slots(40, 4, 16)
    write_kv_cache(key, value, k1, v1, slots)
    write_kv_cache(key, value, k2, v2, slots)
    write_kv_cache(key, value, k2, v2, slots)
    assert _equal_bits(once, twice)


def test_prune_keeps_tiles_no_wider_than_the_heads():
    prune = cache_write._prune_configs
    for heads, widest in [(1, 1), (2, 2), (3, 4), (5, 8), (16, 8)]:
        kept = prune(cache_write._CONFIGS, {"num_heads": heads})
        assert max(c.kwargs["BLOCK_H"] for c in kept) == widest


def test_gpu_autotuner_does_not_clone_the_cache():
    """Compiled for a GPU (no interpreter), the kernel is a real Autotuner with no
    ``restore_value`` (which would clone the whole cache on the first call per key) and the
    pruning hook."""
    code = (
        "import triton\n"
        "from hybridkv_kernels import cache_write as m\n"
        "k = m._write_kv_kernel\n"
        "assert isinstance(k, triton.runtime.autotuner.Autotuner), type(k)\n"
        "assert list(k.restore_value) == [], k.restore_value\n"
        "assert k.early_config_prune is m._prune_configs\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
