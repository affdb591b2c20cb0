"""Paged decode attention against the torch reference on every layout."""

from __future__ import annotations

import math

import pytest
import torch

from hybridkv.layouts import LAYOUTS
from hybridkv_kernels.cache_write import write_kv_cache_ref
from hybridkv_kernels.paged_decode import paged_decode_attention, paged_decode_attention_ref

from .paged import SYNTHETIC, plan_caches, synthetic_caches

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def _fill(k_cache, v_cache, seq_lens, dtype, num_blocks_used=None):
    """Random K/V for every request, written through shuffled, non-contiguous block tables."""
    num_blocks, block_size = k_cache.shape[:2]
    need = [math.ceil(n / block_size) for n in seq_lens]
    width = max(need) + 2
    free = torch.randperm(num_blocks - 1)[: sum(need)] + 1  # block 0 is the null block
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    start = 0
    for b, (n, nb) in enumerate(zip(seq_lens, need)):
        tables[b, :nb] = free[start : start + nb].int()
        tables[b, nb:] = 10**6  # garbage past the request's blocks: must never be read
        start += nb
        slots = tables[b, (torch.arange(n) // block_size)].long() * block_size + (
            torch.arange(n) % block_size
        )
        k = torch.randn(n, k_cache.shape[2], k_cache.shape[3]).to(dtype)
        v = torch.randn(n, v_cache.shape[2], v_cache.shape[3]).to(dtype)
        one = torch.tensor(1.0)  # fp8 caches store the raw values; the test scales on read
        write_kv_cache_ref(k, v, k_cache, v_cache, slots, one, one)
    return tables


def _check(q, k_cache, v_cache, tables, lens, scale, window=None, splits=None):
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = torch.full((q.shape[0], q.shape[1], v_cache.shape[3]), float("nan"), dtype=q.dtype)
    got = paged_decode_attention(
        q, k_cache, v_cache, tables, seq_lens, scale, window, num_splits=splits, out=out
    )
    assert got.data_ptr() == out.data_ptr()
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, scale, window)
    assert not torch.isnan(got).any()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[q.dtype], err


@pytest.mark.parametrize("layout", SYNTHETIC)
@pytest.mark.parametrize(
    "lens, hq, hkv, dk, dv, block_size, dtype, window, splits",
    [
        pytest.param([1], 4, 4, 16, 16, 16, torch.float32, None, None, id="len1-mha-fp32"),
        pytest.param(
            [97, 3, 33], 8, 2, 40, 40, 16, torch.float16, None, 1, id="B3-gqa4-D40-nosplit"
        ),
        pytest.param([300, 17], 5, 1, 32, 24, 32, torch.float32, None, 3, id="B2-Hkv1-Hq5-split3"),
        pytest.param([257, 64], 6, 3, 64, 64, 48, torch.float16, 50, 2, id="B2-window50-bs48"),
    ],
)
def test_decode_synthetic(layout, lens, hq, hkv, dk, dv, block_size, dtype, window, splits):
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 6
    _, k_cache, v_cache = synthetic_caches(layout, num_blocks, block_size, hkv, dk, dv, dtype)
    tables = _fill(k_cache, v_cache, lens, dtype)
    q = torch.randn(len(lens), hq, dk).to(dtype)
    _check(q, k_cache, v_cache, tables, lens, 1 / math.sqrt(dk), window, splits)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_on_real_plans(layout):
    # Qwen3.5-0.8B at TP2: 4 query heads per rank over 1 KV head of 256 dims
    _, k_cache, v_cache = plan_caches(layout, "float16")
    lens = [40, 1, 75]
    tables = _fill(k_cache, v_cache, lens, torch.float16)
    q = torch.randn(3, 4, 256, dtype=torch.float16)
    _check(q, k_cache, v_cache, tables, lens, 1 / 16, splits=2)


def test_decode_fp8_cache():
    _, k32, v32 = synthetic_caches("classic", 12, 16, 2, 32, 32, torch.float32)
    backing = torch.zeros(12 * 2 * 16 * 2 * 32 + 5, dtype=torch.float8_e4m3fn)
    k8 = torch.as_strided(backing, k32.shape, k32.stride(), k32.storage_offset())
    v8 = torch.as_strided(backing, v32.shape, v32.stride(), v32.storage_offset())
    lens = [70, 9]
    tables = _fill(k8, v8, lens, torch.float8_e4m3fn)
    q = torch.randn(2, 4, 32, dtype=torch.float16)
    ks, vs = torch.tensor(0.5), torch.tensor(0.25)
    seq = torch.tensor(lens, dtype=torch.int32)
    got = paged_decode_attention(q, k8, v8, tables, seq, 0.2, k_scale=ks, v_scale=vs)
    want = paged_decode_attention_ref(q, k8, v8, tables, seq, 0.2, k_scale=ks, v_scale=vs)
    assert (got.float() - want.float()).abs().max() < 3e-3


def test_decode_errors():
    _, k, v = synthetic_caches("classic", 4, 16, 2, 16, 16, torch.float32)
    q = torch.randn(1, 4, 16)
    tables = torch.ones(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_len >= 1"):
        paged_decode_attention(q, k, v, tables, torch.tensor([0], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="needs 3 blocks"):
        paged_decode_attention(q, k, v, tables, torch.tensor([40], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        paged_decode_attention(torch.randn(1, 3, 16), k, v, tables, torch.tensor([4]).int(), 1.0)


def test_decode_and_prefill_int64_addressing():
    """Block 2 of this cache starts at element 2**31 of a ~4 GiB (never touched) buffer."""
    from hybridkv_kernels.paged_prefill import (
        paged_prefill_attention,
        paged_prefill_attention_ref,
    )

    block_size, heads, d = 16, 1, 16
    stride = 2**30
    backing = torch.empty(2 * stride + 2 * block_size * heads * d, dtype=torch.float16)
    k = torch.as_strided(backing, (3, block_size, heads, d), (stride, heads * d, d, 1), 0)
    v = torch.as_strided(
        backing, (3, block_size, heads, d), (stride, heads * d, d, 1), block_size * heads * d
    )
    for b in (0, 2):
        k[b] = torch.randn(block_size, heads, d).half()
        v[b] = torch.randn(block_size, heads, d).half()
    tables = torch.tensor([[2, 0]], dtype=torch.int32)
    seq = torch.tensor([29], dtype=torch.int32)
    q = torch.randn(1, 2, d).half()
    got = paged_decode_attention(q, k, v, tables, seq, 0.25)
    want = paged_decode_attention_ref(q, k, v, tables, seq, 0.25)
    assert (got.float() - want.float()).abs().max() < 2e-3
    cu = torch.tensor([0, 5], dtype=torch.int32)
    qp = torch.randn(5, 2, d).half()
    got = paged_prefill_attention(qp, k, v, tables, cu, seq, 0.25)
    want = paged_prefill_attention_ref(qp, k, v, tables, cu, seq, 0.25)
    assert (got.float() - want.float()).abs().max() < 2e-3


@pytest.mark.parametrize(
    "block_size",
    [16, 48, 80, 128, 544, 24, 7],
    ids=lambda b: f"bs{b}",
)
def test_decode_page_walk_block_sizes(block_size):
    """Tiles are page segments of the largest power of two dividing block_size: 16 (several
    pages per tile), 48/80 (segments of 16 inside odd-multiple pages), 128 (one page holds many
    tiles), 544 (vLLM's inflated Qwen3-Next block: segments of 32), 24 (8) and 7 (1)."""
    lens = [1, block_size, 3 * block_size + 5, 301]
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 3
    _, k_cache, v_cache = synthetic_caches(
        "classic", num_blocks, block_size, 2, 32, 32, torch.float16
    )
    tables = _fill(k_cache, v_cache, lens, torch.float16)
    q = torch.randn(len(lens), 8, 32).half()
    _check(q, k_cache, v_cache, tables, lens, 32**-0.5, splits=2)


@pytest.mark.parametrize("window", [1, 50, 200])
def test_decode_window_ignores_freed_blocks(window):
    """Blocks wholly below the window are freed to the null block 0; both hold NaN."""
    block_size, lens = 16, [333, 40]
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 3
    _, k_cache, v_cache = synthetic_caches(
        "classic", num_blocks, block_size, 2, 32, 32, torch.float16
    )
    tables = _fill(k_cache, v_cache, lens, torch.float16)
    for b, n in enumerate(lens):
        freed = max(0, n - window) // block_size
        for blk in tables[b, :freed].tolist():
            k_cache[blk], v_cache[blk] = float("nan"), float("nan")
        tables[b, :freed] = 0
    k_cache[0], v_cache[0] = float("nan"), float("nan")
    q = torch.randn(len(lens), 4, 32).half()
    _check(q, k_cache, v_cache, tables, lens, 32**-0.5, window, splits=3)


def _fp8_caches(num_blocks, block_size, heads, d, dtype):
    _, k32, v32 = synthetic_caches(
        "packed3-layer1", num_blocks, block_size, heads, d, d, torch.float32
    )
    backing = torch.full((k32.untyped_storage().nbytes() // 4,), 0x7F, dtype=torch.uint8)
    backing = backing.view(dtype)  # bytes no request owns: never read
    k8 = torch.as_strided(backing, k32.shape, k32.stride(), k32.storage_offset())
    v8 = torch.as_strided(backing, v32.shape, v32.stride(), v32.storage_offset())
    return k8, v8


@pytest.mark.parametrize("software", [False, True], ids=["hw-convert", "byte-decode"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_decode_fp8(dtype, software, monkeypatch):
    """fp8 caches; ``byte-decode`` is what an sm_80 GPU runs for e4m3 (no hardware e4m3): the
    kernel gets the bytes and decodes them itself, which must equal the hardware path."""
    from hybridkv_kernels import paged_decode

    if software:
        monkeypatch.setattr(paged_decode, "_fp8e4_in_hardware", lambda device: False)
    k8, v8 = _fp8_caches(20, 16, 2, 64, dtype)
    lens = [70, 9, 130]
    tables = _fill(k8, v8, lens, dtype)
    # every e4m3 byte value but NaN, subnormals included, lands in the first request
    if dtype == torch.float8_e4m3fn:
        raw = torch.arange(256, dtype=torch.uint8)
        raw = raw[(raw & 0x7F) != 0x7F][: 2 * 64]
        k8[int(tables[0, 0]), 0] = raw.view(dtype).reshape(2, 64)
    q = torch.randn(3, 4, 64, dtype=torch.float16)
    ks, vs = torch.tensor(0.5), torch.tensor(0.25)
    seq = torch.tensor(lens, dtype=torch.int32)
    got = paged_decode_attention(q, k8, v8, tables, seq, 0.2, k_scale=ks, v_scale=vs)
    want = paged_decode_attention_ref(q, k8, v8, tables, seq, 0.2, k_scale=ks, v_scale=vs)
    assert not torch.isnan(got).any()
    assert (got.float() - want.float()).abs().max() < 3e-3


def _small_case():
    _, k, v = synthetic_caches("classic", 6, 16, 2, 16, 16, torch.float32)
    tables = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)
    seq = torch.tensor([40, 20], dtype=torch.int32)
    for t in (k, v):
        t[1:6] = torch.randn(5, 16, 2, 16)
    return torch.randn(2, 4, 16), k, v, tables, seq


@pytest.mark.parametrize(
    "case, match",
    [
        ("block-id-num_blocks", r"block_tables\[0, 2\] = 6 is outside \[0, 6\)"),
        ("block-id-minus-1", r"block_tables\[1, 1\] = -1 is outside"),
        ("max_seq_len-too-small", r"seq_lens\[0\] = 40 exceeds max_seq_len = 33"),
        ("seq_len-0", r"seq_lens\[1\] = 0: every request needs seq_len >= 1"),
    ],
)
def test_decode_validate_catches_bad_ids(case, match, monkeypatch):
    q, k, v, tables, seq = _small_case()
    max_len = None
    if case == "block-id-num_blocks":
        tables[0, 2] = 6  # the next layer's page in a real plan
    elif case == "block-id-minus-1":
        tables[1, 1] = -1
    elif case == "max_seq_len-too-small":
        max_len = 33
    else:
        seq[1] = 0
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(q, k, v, tables, seq, 0.25, max_seq_len=max_len, validate=True)
    monkeypatch.setenv("HYBRIDKV_VALIDATE", "1")  # the environment switch does the same
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(q, k, v, tables, seq, 0.25, max_seq_len=max_len)


def test_decode_validate_passes_good_input_and_ignores_unused_columns():
    q, k, v, tables, seq = _small_case()
    tables[1, 2] = 10**6  # past request 1's seq_len: never read, so not an error
    got = paged_decode_attention(q, k, v, tables, seq, 0.25, max_seq_len=40, validate=True)
    want = paged_decode_attention_ref(q, k, v, tables, seq, 0.25)
    assert (got - want).abs().max() < 2e-5


@pytest.mark.parametrize("splits", [0, -3])
def test_decode_num_splits_must_be_positive(splits):
    q, k, v, tables, seq = _small_case()
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        paged_decode_attention(q, k, v, tables, seq, 0.25, num_splits=splits, max_seq_len=40)
