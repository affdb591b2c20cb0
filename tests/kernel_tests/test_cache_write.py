"""Cache write against its torch reference on every layout: bit-exact, nothing else written."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

from hybridkv.layouts import LAYOUTS
from hybridkv_kernels import cache_write
from hybridkv_kernels.cache_write import (
    CONFIGS,
    WriteConfig,
    WriteShape,
    plan_write_kv_cache,
    write_kv_cache,
    write_kv_cache_ref,
)

from .paged import SYNTHETIC, plan_caches, synthetic_caches
from .test_state_copy import compile_cases

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


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


def test_write_vllms_interleaved_page():
    """vLLM 0.33's page ([tokens, heads, K | V]), K and V of different widths: every byte
    written is the reference's, the rest stays NaN (one of the synthetic cases)."""
    test_write_synthetic_layouts("kv-interleaved", 37, 3, 40, 24, 16, torch.float16)


@pytest.mark.parametrize(
    "layout, cache_formats",
    [*((layout, "transformers") for layout in LAYOUTS), ("inflate", "vllm")],
)
def test_write_into_real_plans(layout, cache_formats):
    buffers, k_cache, v_cache = plan_caches(layout, "float16", cache_formats=cache_formats)
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


# ---- every config, unaligned views, plan reuse --------------------------------------------------


def _poisoned(layout, num_blocks, block_size, heads, dk, dv, dtype, offset=0):
    """``synthetic_caches`` in ``dtype`` (fp8 too: bytes 0xFF, NaN in both formats), shifted by
    ``offset`` elements so that the views can be made unaligned."""
    backing, k, v = synthetic_caches(layout, num_blocks, block_size, heads, dk, dv, torch.float32)
    raw = torch.full((backing.numel() + offset,), 0xFF, dtype=torch.uint8)
    if dtype.itemsize > 1:
        raw = torch.full((backing.numel() + offset,), float("nan"), dtype=dtype)
    raw = raw.view(dtype)
    views = [
        torch.as_strided(raw, c.shape, c.stride(), c.storage_offset() + offset) for c in (k, v)
    ]
    return raw, *views


#: (layout, heads, dk, dv, key dtype, cache dtype, storage offset): aligned views; aligned head
#: dims in unaligned views (odd storage offset); odd head dims; fp8 caches (software encoders
#: under the interpreter) with values past the fp8 maximum
WRITE_CASES = [
    pytest.param("classic", 2, 64, 64, torch.bfloat16, torch.bfloat16, 0, id="aligned-bf16"),
    pytest.param("head-major", 3, 32, 32, torch.float16, torch.float16, 1, id="unaligned-view"),
    pytest.param("packed3-layer1", 3, 40, 24, torch.float16, torch.float16, 0, id="odd-dims"),
    pytest.param("layer-outer", 2, 64, 32, torch.float32, torch.float32, 0, id="aligned-fp32"),
    pytest.param("classic", 4, 32, 32, torch.bfloat16, E4M3, 0, id="e4m3"),
    pytest.param("packed3-layer1", 2, 48, 16, torch.float16, E5M2, 3, id="e5m2-unaligned"),
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("layout, heads, dk, dv, key_dtype, cache_dtype, offset", WRITE_CASES)
def test_every_config_matches_the_reference(
    config, layout, heads, dk, dv, key_dtype, cache_dtype, offset
):
    """Each config of ``CONFIGS`` (what autotuning may pick on a GPU) against the reference,
    the whole NaN-poisoned backing store bit for bit: 70 tokens (partial tiles for every
    ``BLOCK_T``), padding, a slot past the cache and one below -1 skipped."""
    num_blocks, block_size, tokens = 6, 16, 70
    raw, k_cache, v_cache = _poisoned(
        layout, num_blocks, block_size, heads, dk, dv, cache_dtype, offset
    )
    ref, k_ref, v_ref = _clone_views(raw, k_cache, v_cache)
    scale = 300.0 if cache_dtype == E5M2 else 3.0
    key = (torch.randn(tokens, heads, dk) * scale).to(key_dtype)
    value = (torch.randn(tokens, heads, dv) * scale).to(key_dtype)
    slots = _slots(tokens, num_blocks, block_size)
    slots[3], slots[8] = num_blocks * block_size, -3  # skipped, not reported without validate
    fp8 = cache_dtype in (E4M3, E5M2)
    k_scale, v_scale = (torch.tensor([0.011]), torch.tensor([0.007])) if fp8 else (None, None)
    write_kv_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale, config=config)
    live = torch.where((slots >= 0) & (slots < num_blocks * block_size), slots, -1)
    write_kv_cache_ref(key, value, k_ref, v_ref, live, k_scale, v_scale)
    assert _equal_bits(raw, ref)


def test_unaligned_views_take_the_scalar_tile():
    """A plan holds an aligned and an unaligned launch; run picks by the views (an odd base or
    stride cannot prove 16-byte vectors). Unaligned tiles hold at most 8 elements a thread."""
    slots = torch.arange(40)
    plan = plan_write_kv_cache(
        slots,
        num_heads=2,
        head_dim=64,
        block_size=16,
        num_blocks=4,
        key_dtype=torch.float16,
        cache_dtype=torch.float16,
        config=WriteConfig(8, 4),
    )
    aligned, scalar = plan._aligned_launch.meta, plan._unaligned_launch.meta
    assert (aligned["BLOCK_T"], aligned["BLOCK_H"]) == (8, 2)
    assert scalar["BLOCK_T"] * scalar["BLOCK_H"] * 128 <= 8 * 32 * scalar["num_warps"]
    odd_dims = plan_write_kv_cache(
        slots,
        num_heads=2,
        head_dim=40,
        block_size=16,
        num_blocks=4,
        key_dtype=torch.float16,
        cache_dtype=torch.float16,
    )
    assert odd_dims._aligned_launch is None


def test_run_picks_the_tile_and_keys_the_direct_launcher(monkeypatch):
    """Run picks the vector tile for aligned views and the scalar tile for the same plan's
    unaligned ones; the direct launcher's key holds what Triton specialises on (alignment,
    strides, dtypes), so no compiled kernel is reused for another specialisation."""
    seen = []
    launcher = cache_write._write_launcher

    def spy(grid, key, args, meta):
        seen.append((key, meta["BLOCK_T"] * meta["BLOCK_H"]))
        launcher(grid, key, args, meta)

    monkeypatch.setattr(cache_write, "_write_launcher", spy)
    kw = dict(
        num_heads=2, head_dim=64, block_size=16, num_blocks=4, key_dtype=torch.float16,
        cache_dtype=torch.float16, config=WriteConfig(8, 4),
    )  # fmt: skip
    slots = torch.randperm(64)[:40]
    plan = plan_write_kv_cache(slots, **kw)
    key = torch.randn(40, 2, 64).half()
    raw = torch.full((2 * 4 * 16 * 2 * 64 + 1,), float("nan")).half()
    for offset in (0, 1, 0):  # aligned, unaligned, aligned again
        pages = raw[offset : offset + 2 * 4 * 16 * 128].view(4, 2, 16, 2, 64)
        ref = pages.clone()
        plan.run(key, -key, pages[:, 0], pages[:, 1])
        write_kv_cache_ref(key, -key, ref[:, 0], ref[:, 1], slots)
        assert _equal_bits(pages, ref)
    (k1, t1), (k2, t2), (k3, t3) = seen
    assert k1 == k3 != k2 and t1 == t3 == 16 and t2 < t1
    bf16 = plan_write_kv_cache(slots, **{**kw, "key_dtype": torch.bfloat16})
    bf16.run(key.bfloat16(), key.bfloat16(), *(t.view(4, 16, 2, 64) for t in (raw[:8192],) * 2))
    assert seen[-1][0] != k1  # same shapes and tile, another key dtype: another kernel


def test_small_tiles_keep_16_byte_vectors():
    """Aligned tiles hold at least one 16-byte vector of K a thread: fewer warps first, then
    more tokens (a 64-wide head of one token is 128 B, 8 threads' worth)."""
    for heads, d, kb in itertools.product((1, 2, 8), (16, 64, 256), (2, 4)):
        shape = WriteShape(90, "16bit", kb, heads, 2 * d, d, True, 256)
        for config in CONFIGS:
            block_t, block_h, warps = cache_write.tile(config, shape, True)
            assert block_t * block_h * d * kb >= 16 * 32 * warps
            assert warps <= config.num_warps and block_t >= config.block_t


def test_plan_reused_over_two_layers():
    """One plan per step, run on every layer's K/V (two layers packed in one page) with each
    layer's own key/value; the third layer and the gaps stay NaN."""
    backing, k1, v1 = synthetic_caches("packed3-layer1", 5, 16, 2, 32, 32, torch.float16)
    layer = k1.storage_offset()  # layer 1 starts one layer's bytes into the page
    k0 = torch.as_strided(backing, k1.shape, k1.stride(), k1.storage_offset() - layer)
    v0 = torch.as_strided(backing, v1.shape, v1.stride(), v1.storage_offset() - layer)
    ref, k0r, v0r = _clone_views(backing, k0, v0)
    k1r = torch.as_strided(ref, k1.shape, k1.stride(), k1.storage_offset())
    v1r = torch.as_strided(ref, v1.shape, v1.stride(), v1.storage_offset())
    slots = _slots(30, 5, 16)
    plan = plan_write_kv_cache(
        slots,
        num_heads=2,
        head_dim=32,
        block_size=16,
        num_blocks=5,
        key_dtype=torch.float16,
        cache_dtype=torch.float16,
    )
    for k, v, kr, vr in ((k0, v0, k0r, v0r), (k1, v1, k1r, v1r)):
        key, value = torch.randn(30, 2, 32).half(), torch.randn(30, 2, 32).half()
        plan.run(key, value, k, v)
        write_kv_cache_ref(key, value, kr, vr, slots)
    assert _equal_bits(backing, ref)


def test_run_rejects_tensors_of_another_shape_or_dtype():
    _, k, v = synthetic_caches("classic", 4, 16, 2, 32, 32, torch.float16)
    plan = plan_write_kv_cache(
        torch.arange(5),
        num_heads=2,
        head_dim=32,
        block_size=16,
        num_blocks=4,
        key_dtype=torch.float16,
        cache_dtype=torch.float16,
    )
    key = torch.randn(5, 2, 32).half()
    plan.run(key, key, k, v)
    with pytest.raises(ValueError, match=r"key/value must be \[5, 2, 32/32\] torch.float16"):
        plan.run(torch.randn(6, 2, 32).half(), key, k, v)
    with pytest.raises(ValueError, match="key/value must be"):
        plan.run(key.float(), key.float(), k, v)
    with pytest.raises(ValueError, match=r"the last dim \(head_dim\) of key.* contiguous"):
        plan.run(torch.randn(5, 32, 2).half().transpose(1, 2), key, k, v)
    with pytest.raises(ValueError, match="must be contiguous"):
        plan.run(key, key, torch.zeros(4, 16, 32, 2).half().transpose(2, 3), v)
    with pytest.raises(ValueError, match=r"k_cache/v_cache must be \[4, 16, 2, 32/32\]"):
        plan.run(key, key, k[:3], v[:3])
    with pytest.raises(ValueError, match="k_cache/v_cache must be"):
        plan.run(key, key, k.float(), v.float())
    fp8 = plan_write_kv_cache(
        torch.arange(5),
        num_heads=2,
        head_dim=32,
        block_size=16,
        num_blocks=4,
        key_dtype=torch.float16,
        cache_dtype=E4M3,
    )
    k8 = torch.zeros(4, 16, 2, 32, dtype=E4M3)
    with pytest.raises(ValueError, match="an fp8 cache needs k_scale"):
        fp8.run(key, key, k8, k8)
    with pytest.raises(ValueError, match="an fp8 cache needs v_scale"):
        fp8.run(key, key, k8, k8, torch.ones(1), torch.ones(1, dtype=torch.float64))


def test_plan_arguments():
    kw = dict(
        num_heads=2,
        head_dim=32,
        block_size=16,
        num_blocks=4,
        key_dtype=torch.float16,
        cache_dtype=torch.float16,
    )
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="not one of CONFIGS"):
        plan_write_kv_cache(slots, config=WriteConfig(3, 4), **kw)
    with pytest.raises(ValueError, match="autotune=True needs a GPU"):
        plan_write_kv_cache(slots, autotune=True, **kw)
    with pytest.raises(ValueError, match="autotune=True needs a GPU"):
        key = torch.zeros(3, 2, 32).half()
        write_kv_cache(key, key, *synthetic_caches("classic", 4, 16, 2, 32, 32, key.dtype)[1:],
                       slots, autotune=True)  # fmt: skip
    with pytest.raises(ValueError, match="slot_mapping must be"):
        plan_write_kv_cache(slots.float(), **kw)
    with pytest.raises(ValueError, match="key/value must be fp16/bf16/fp32"):
        plan_write_kv_cache(slots, **{**kw, "key_dtype": E4M3})
    plan = plan_write_kv_cache(slots, **kw)
    assert plan.config_source.startswith("unmeasured") and plan.config in CONFIGS
    assert plan_write_kv_cache(slots, config=CONFIGS[4], **kw).config_source == "given"


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
        k8 = torch.empty(2, 16, 2, 16, dtype=E4M3)
        write_kv_cache(key, key, k8, k8, torch.zeros(3, dtype=torch.long))


# ---- the table ----------------------------------------------------------------------------------


def _shapes_of(rule: cache_write.WriteRule):
    dims = [(16, 16), (32, 16), (64, 64), (128, 128), (256, 256), (512, 512)]
    caches = [("16bit", 2), ("16bit", 4), ("fp32", 4), ("fp8", 2), ("fp8-bytes", 2)]
    for arch, (cache, kb), heads, (dk, dv), aligned in itertools.product(
        (80, 90), caches, (1, 2, 4, 8, 16, 64), dims, (True, False)
    ):
        for tokens in rule.tokens:
            shape = WriteShape(arch, cache, kb, heads, dk + dv, min(dk, dv), aligned, tokens)
            if rule.matches(shape):
                yield shape


def test_table_invariants():
    """Every table config is in ``CONFIGS`` and fits every shape class its row can match; every
    row says where it comes from; every shape class gets a config."""
    for rule in cache_write._TABLE:
        assert rule.config in CONFIGS
        assert rule.source.startswith("unmeasured: inferred from")  # no GPU has run it yet
        shapes = list(_shapes_of(rule))
        assert shapes
        for shape in shapes:
            assert cache_write.config_fits(rule.config, shape), (rule.config, shape)
    for tokens in (1, 256, 300, 1024, 4096, 1 << 20):
        shape = WriteShape(90, "16bit", 2, 2, 512, 256, True, tokens)
        assert cache_write.choose_config(shape)[1].startswith("unmeasured")
    big = WriteShape(80, "fp8-bytes", 2, 64, 2048, 1024, True, 8192)  # head dims of 1024
    config, source = cache_write.choose_config(big)
    assert source == "no table row: the first config that fits"
    assert cache_write.config_fits(config, big)
    assert len(set(CONFIGS)) == len(CONFIGS)


# ---- int64 addressing ---------------------------------------------------------------------------


def test_int64_addressing_beyond_2_31_elements():
    """Block 2 of this cache starts past element 2**31: int32 offsets would wrap around (the
    storage is never zero-filled; only the pages written and read are touched)."""
    heads, d, bs = 2, 64, 16
    stride = 2**30 + 4096  # elements between blocks
    backing = torch.empty(2 * stride + 2 * bs * heads * d, dtype=torch.float16)
    k = torch.as_strided(backing, (3, bs, heads, d), (stride, heads * d, d, 1))
    v = torch.as_strided(backing, (3, bs, heads, d), (stride, heads * d, d, 1), bs * heads * d)
    key, value = torch.randn(3, heads, d).half(), torch.randn(3, heads, d).half()
    slots = torch.tensor([2 * bs + 5, 3, 2 * bs + 15])
    write_kv_cache(key, value, k, v, slots)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(k[slot // bs, slot % bs], key[t])
        assert torch.equal(v[slot // bs, slot % bs], value[t])


# ---- fp8: the software encoders and the saturation contract -------------------------------------


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
    [(E4M3, False), (E4M3, True), (E5M2, False)],
    ids=["e4m3", "e4m3-soft", "e5m2"],
)
def test_write_fp8_with_scale(dtype, soft, monkeypatch):
    if soft:  # as on an sm_80 GPU: the kernel writes bytes it encodes in software
        monkeypatch.setattr(cache_write, "_fp8e4_in_hardware", lambda device: False)
    backing8, k_cache, v_cache = _fp8_caches(dtype)
    ref_backing, k_ref, v_ref = _clone_views(backing8, k_cache, v_cache)
    # Inputs are fp8 values times power-of-two scales, so x / scale is exact and the test checks
    # scaling and addressing bit for bit
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


def test_the_interpreter_encodes_fp8_in_software(monkeypatch):
    """Interpreted, both formats take the software encoders (the interpreter's narrowing casts
    round wrongly: 31.5 -> 16); on a GPU e4m3 takes Triton's conversion from sm_89 and the
    encoder below, e5m2 Triton's conversion everywhere."""
    cpu = torch.device("cpu")
    assert cache_write._INTERPRETED
    assert cache_write._fp8_mode(E4M3, cpu) == 2 and cache_write._fp8_mode(E5M2, cpu) == 3
    assert cache_write._fp8_mode(torch.bfloat16, cpu) == 0
    # the values the interpreter's own cast gets wrong, through the kernel
    x = torch.tensor([31.5, 14.5, 500.0, 60000.0, 7.9, 30.0, -31.5, 1e30])
    for dtype in (E4M3, E5M2):
        assert torch.equal(_encode(x, dtype), contract_cast(x, dtype)), dtype
    # what a GPU launch decides (the interpreter's cast is left alone from here on)
    monkeypatch.setattr(cache_write, "_INTERPRETED", False)
    assert cache_write._fp8_mode(E4M3, cpu) == 1 and cache_write._fp8_mode(E5M2, cpu) == 1
    monkeypatch.setattr(cache_write, "_fp8e4_in_hardware", lambda device: False)
    assert cache_write._fp8_mode(E4M3, cpu) == 2 and cache_write._fp8_mode(E5M2, cpu) == 1


def contract_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The saturation contract on float32 ``x``: round to nearest even, saturate to the largest
    finite value (infinities too), NaN stays NaN (with its sign), as bytes."""
    top = cache_write.FP8_MAX[dtype]
    return x.float().clamp(-top, top).to(dtype).view(torch.uint8)


def _encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) through the kernel into an fp8 cache with scale 1, as bytes."""
    heads, d = 8, 256
    tokens = -(-x.numel() // (heads * d))
    key = torch.zeros(tokens * heads * d)
    key[: x.numel()] = x
    key = key.view(tokens, heads, d)
    _, k_cache, v_cache = _fp8_caches(dtype, tokens, 1, heads, d)
    one = torch.tensor(1.0)
    write_kv_cache(key, key, k_cache, v_cache, torch.arange(tokens), one, one)
    got = k_cache.reshape(-1).view(torch.uint8)
    assert torch.equal(v_cache.reshape(-1).view(torch.uint8), got)
    return got[: x.numel()]


def _with_neighbours(values: torch.Tensor) -> torch.Tensor:
    up = torch.nextafter(values, torch.tensor(float("inf")))
    down = torch.nextafter(values, torch.tensor(0.0))
    return torch.cat([values, up, down])


_NANS = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF], dtype=torch.int32).view(torch.float32)


def _e4m3_boundary_values() -> torch.Tensor:
    """Every e4m3 value, every midpoint between neighbours (and past 448, where the contract
    saturates), each with its fp32 neighbours on both sides; the subnormal and underflow
    boundaries; zeros, infinities, NaNs (with payloads), the fp32 extremes; both signs."""
    codes = torch.arange(0x7F, dtype=torch.uint8).view(E4M3).float()
    midpoints = (codes[1:] + codes[:-1]) / 2
    above_max = [464.0, 480.0, 496.0, 512.0, 1e4, 3.4028235e38, float("inf")]
    tiny = [2.0**-10, 3 * 2.0**-11, 2.0**-6, 2.0**-7 + 2.0**-10, 1e-30, 1e-45, 1.1754942e-38]
    special = torch.tensor(above_max + tiny)
    values = _with_neighbours(torch.cat([codes, midpoints, special]))
    values = torch.cat([values, _NANS])
    return torch.cat([values, -values])


def _e5m2_boundary_values() -> torch.Tensor:
    """Every float16 value (NaNs and infinities included), every e5m2 midpoint (and the one
    past 57344, where the contract saturates instead of rounding to inf) with its fp32
    neighbours, values far past the maximum, the subnormal and underflow boundaries, fp32
    NaNs with payloads; both signs."""
    every_f16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    every_f16 = every_f16.view(torch.float16).float()
    codes = torch.arange(0x7C, dtype=torch.uint8).view(E5M2).float()  # 0 .. 57344
    midpoints = (codes[1:] + codes[:-1]) / 2
    above_max = [61440.0, 65504.0, 65536.0, 1e5, 1e30, 3.4028235e38, float("inf")]
    tiny = [2.0**-16, 2.0**-17, 3 * 2.0**-17, 2.0**-14, 2.0**-15 + 2.0**-17, 1e-30, 1e-45]
    boundaries = _with_neighbours(torch.cat([codes, midpoints, torch.tensor(above_max + tiny)]))
    values = torch.cat([boundaries, _NANS, torch.tensor([0.0])])
    return torch.cat([every_f16, values, -values])


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy, on signalling NaNs
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_soft_encoders_follow_the_contract_exhaustively(dtype, monkeypatch):
    """The software encoders (``_f32_to_e4m3`` / ``_f32_to_e5m2``, what the kernel runs under
    the interpreter and e4m3 on sm_80) against torch's cast of the clamped value, byte for
    byte: every rounding boundary and its fp32 neighbours (e5m2: every float16 too, and
    midpoints that rounding through float16 would get wrong), values past the maximum and
    infinities (saturated), NaNs (0x7F with the sign), signed zeros; then random values over
    2**-24 .. 2**12 and far past the maximum."""
    monkeypatch.setattr(cache_write, "_fp8e4_in_hardware", lambda device: False)
    gen = torch.Generator().manual_seed(torch.seed() % 2**32)
    top = 12 if dtype == E4M3 else 17
    scales = 2.0 ** torch.randint(-24, top, (40000,), generator=gen).float()
    boundary = _e4m3_boundary_values() if dtype == E4M3 else _e5m2_boundary_values()
    x = torch.cat([boundary, torch.randn(40000, generator=gen) * scales])
    got, want = _encode(x, dtype), contract_cast(x, dtype)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [
        (x[i].item(), hex(int(got[i])), hex(int(want[i]))) for i in bad[:10].tolist()
    ]


def test_e5m2_rounds_from_float32_not_through_float16():
    """Just above a midpoint, rounding to float16 first lands on the midpoint and then ties to
    even (down): the encoder must round up. And the contract's saturation points."""
    above = torch.tensor([1.125, 1.625, 2.0**-17, 61440.0])
    above = torch.nextafter(above, torch.tensor(float("inf")))
    got = _encode(above, E5M2).tolist()
    assert got == [0x3D, 0x3F, 0x01, 0x7B]  # 1.25, 1.75, 2**-16, 57344 (not inf)
    via_f16 = above.half().float().to(E5M2).view(torch.uint8).tolist()
    assert via_f16[:3] == [0x3C, 0x3E, 0x00]  # the double rounding the encoder avoids
    specials = torch.tensor([float("inf"), -float("inf"), 1e6, -0.0, float("nan")])
    assert _encode(specials, E5M2).tolist() == [0x7B, 0xFB, 0x7B, 0x80, 0x7F]
    assert _encode(specials, E4M3).tolist() == [0x7E, 0xFE, 0x7E, 0x80, 0x7F]


def test_reference_implements_the_contract():
    """``write_kv_cache_ref`` saturates like the kernels whatever the torch version does with
    values out of range (torch 2.11 casts e4m3 >= 464 to NaN; both versions round e5m2 past
    61440 to inf)."""
    x = torch.tensor([7e4, -1e30, float("inf"), -float("inf"), 61440.0, float("nan"), 448.0])
    for dtype, top in ((E4M3, 0x7E), (E5M2, 0x7B)):
        k = torch.full((1, 16, 1, 8), 0x55, dtype=torch.uint8).view(dtype)
        key = torch.zeros(1, 1, 8)
        key[0, 0, :7] = x
        write_kv_cache_ref(
            key, key, k, k.clone(), torch.tensor([3]), torch.ones(()), torch.ones(())
        )
        got = k[0, 3, 0].view(torch.uint8).tolist()
        in_range = 0x7E if dtype == E4M3 else 0x5F  # 448 is in range for both
        assert got[:5] == [top, 0x80 | top, top, 0x80 | top, top], (dtype, got)
        assert got[5] & 0x7F == 0x7F and got[6] == in_range
    # the kernel agrees on the same inputs, scale included
    for dtype in (E4M3, E5M2):
        raw, k_cache, v_cache = _poisoned("classic", 2, 16, 1, 16, 16, dtype)
        ref, k_ref, v_ref = _clone_views(raw, k_cache, v_cache)
        key = torch.cat([x, torch.full((9,), 7e4)]).view(1, 1, 16).repeat(4, 1, 1)
        scale = torch.tensor([0.5])
        slots = torch.tensor([0, 7, 16, -1])
        write_kv_cache(key, -key, k_cache, v_cache, slots, scale, scale)
        write_kv_cache_ref(key, -key, k_ref, v_ref, slots, scale, scale)
        assert _equal_bits(raw, ref)


@pytest.mark.parametrize(
    "layout, dtype, cache",
    [
        ("packed3-layer1", torch.float16, E4M3),
        ("head-major", torch.bfloat16, E4M3),
        ("layer-outer", torch.bfloat16, E5M2),
    ],
    ids=["packed3-layer1-fp16-e4m3", "head-major-bf16-e4m3", "layer-outer-bf16-e5m2"],
)
def test_fp8_with_scales_matches_reference(layout, dtype, cache, monkeypatch):
    """Inexact x / scale (division rounded as torch rounds it, then encoded) into strided
    pages: the whole backing store equals the reference's, padding and gaps untouched."""
    monkeypatch.setattr(cache_write, "_fp8e4_in_hardware", lambda device: False)
    raw, k_cache, v_cache = _poisoned(layout, 6, 16, 3, 64, 48, cache)
    ref, k_ref, v_ref = _clone_views(raw, k_cache, v_cache)
    key = (torch.randn(40, 3, 64) * 3).to(dtype)
    value = (torch.randn(40, 3, 48) * 100).to(dtype)
    k_scale, v_scale = torch.tensor(0.0137), torch.tensor(0.0029)
    slots = _slots(40, 6, 16)
    write_kv_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    write_kv_cache_ref(key, value, k_ref, v_ref, slots, k_scale, v_scale)
    assert _equal_bits(raw, ref)


# ---- validation (contract in the module docstring) ----------------------------------------------


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


# ---- tuning and compilation ---------------------------------------------------------------------


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


def test_gpu_autotuner_keeps_the_cache_and_tries_only_fitting_configs():
    """Built without the interpreter, the autotuned kernel is a real Autotuner with no
    ``restore_value`` (which would clone the whole cache on the first call per key), keyed by
    the token bucket, over the tiles of the configs that fit."""
    code = (
        "import triton\n"
        "from hybridkv_kernels import cache_write as m\n"
        "shape = m.WriteShape(90, '16bit', 2, 2, 512, 256, True, 1)\n"
        "k = m._autotuned_kernel(shape, True)\n"
        "assert isinstance(k, triton.runtime.autotuner.Autotuner), type(k)\n"
        "assert list(k.restore_value) == [], k.restore_value\n"
        "assert k.keys == ['tune_tokens'], k.keys\n"
        "want = {m.tile(c, shape, True) for c in m.CONFIGS if m.config_fits(c, shape)}\n"
        "got = {(c.kwargs['BLOCK_T'], c.kwargs['BLOCK_H'], c.num_warps) for c in k.configs}\n"
        "assert got == want, (got, want)\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def _write_case(shape: WriteShape, config: WriteConfig, dk: int, aligned: bool, fp8: int):
    """A compile case of the write kernel for ``shape`` (head dims ``dk`` both) and ``config``,
    with the divisibility Triton's specialisation sees for aligned or unaligned views."""
    block_t, block_h, warps = cache_write.tile(config, shape, aligned)
    key_type = {2: "bf16", 4: "fp32"}[shape.key_bytes]
    cache_type = {0: key_type, 1: "fp8e4nv", 2: "u8", 3: "u8"}[fp8]
    ints = ["num_tokens", "num_heads", "block_size", "num_slots"]
    strides = ["stride_key_t", "stride_key_h", "stride_value_t", "stride_value_h"]
    strides += [f"stride_{c}c_{s}" for c in "kv" for s in ("block", "token", "head")]
    pointers = ["key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr"]
    signature = {
        "key_ptr": f"*{key_type}",
        "value_ptr": f"*{key_type}",
        "k_cache_ptr": f"*{cache_type}",
        "v_cache_ptr": f"*{cache_type}",
        "slot_ptr": "*i64",
        "k_scale_ptr": "*fp32",
        "v_scale_ptr": "*fp32",
        **dict.fromkeys([*ints, *strides, "tune_tokens"], "i32"),
        **dict.fromkeys(
            ["HEAD_DIM_K", "HEAD_DIM_V", "BLOCK_DK", "BLOCK_DV", "FP8", "BLOCK_T", "BLOCK_H"],
            "constexpr",
        ),
    }
    divisible = ["slot_ptr", "k_scale_ptr", "v_scale_ptr"]
    if aligned:
        divisible += pointers + strides
    bd = 1 << (dk - 1).bit_length()
    return dict(
        module="hybridkv_kernels.cache_write",
        kernel="_write_kv_kernel",
        signature=signature,
        constexprs=dict(
            HEAD_DIM_K=dk,
            HEAD_DIM_V=dk,
            BLOCK_DK=bd,
            BLOCK_DV=bd,
            FP8=fp8,
            BLOCK_T=block_t,
            BLOCK_H=block_h,
        ),
        divisible=divisible,
        arch=shape.arch,
        num_warps=warps,
        aligned=aligned,
    )


@pytest.mark.slow  # ~1-2 minutes of compiles on 2 cores
def test_compiled_tiles_vectorise_without_spills():
    """Compiled for sm_80 and sm_90 (no GPU, no interpreter): every config's aligned tile for
    Qwen3-Next (2 KV heads x 256, bf16; e4m3 caches in hardware on sm_90, in software on sm_80)
    moves 16-byte vectors (LDG.E.128 / STG.E.128), and no tile spills, the unaligned ones (3
    heads of 40, which the compile check's matrix does not cover) included."""
    cases, seen = [], set()
    for arch, config in itertools.product((80, 90), CONFIGS):
        qwen = WriteShape(arch, "16bit", 2, 2, 512, 256, True, 8192)
        fp8 = WriteShape(arch, "fp8" if arch == 90 else "fp8-bytes", 2, 2, 512, 256, True, 8192)
        odd = WriteShape(arch, "16bit", 2, 4, 128, 64, False, 8192)
        candidates = [_write_case(qwen, config, 256, True, 0)]
        if cache_write.config_fits(config, fp8):
            candidates.append(_write_case(fp8, config, 256, True, 1 if arch == 90 else 2))
        candidates.append(_write_case(odd, config, 40, False, 0))
        for case in candidates:
            key = (arch, tuple(case["constexprs"].items()), case["num_warps"], case["aligned"])
            if key not in seen:  # unaligned tiles collapse: compile each once
                seen.add(key)
                cases.append(case)
    for got in compile_cases(cases):
        where = (got["arch"], got["constexprs"], got["num_warps"])
        assert got["local"] == 0, where
        if got["aligned"]:
            assert "LDG.E.128" in got["loads"], where
            if got["constexprs"]["FP8"] == 0:
                assert got["stores"] == ["STG.E.128"], (where, got["stores"])
