"""Paged decode attention against the torch reference on every layout."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hybridkv.layouts import LAYOUTS
from hybridkv_kernels import paged_decode as pd
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


@pytest.mark.parametrize(
    "lens, hq, hkv, dk, dv, block_size, dtype",
    [
        pytest.param([97, 3, 33], 8, 2, 40, 24, 16, torch.float16, id="B3-gqa4-Dk40-Dv24"),
        pytest.param([300, 17], 5, 1, 32, 32, 32, torch.float32, id="B2-Hkv1-Hq5"),
    ],
)
def test_decode_vllms_interleaved_page(lens, hq, hkv, dk, dv, block_size, dtype):
    """vLLM 0.33's page ([tokens, heads, K | V]: each head's K then its V) read through its
    strides, K and V of different widths."""
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 6
    _, k_cache, v_cache = synthetic_caches(
        "kv-interleaved", num_blocks, block_size, hkv, dk, dv, dtype
    )
    assert k_cache.stride()[1:3] == v_cache.stride()[1:3] == (hkv * (dk + dv), dk + dv)
    tables = _fill(k_cache, v_cache, lens, dtype)
    q = torch.randn(len(lens), hq, dk).to(dtype)
    _check(q, k_cache, v_cache, tables, lens, 1 / math.sqrt(dk), None, 2)


def test_decode_on_a_vllm_format_plan():
    """A plan in vLLM's cache formats (K and V interleaved in its pages) serves decode."""
    _, k_cache, v_cache = plan_caches("inflate", "float16", cache_formats="vllm")
    assert v_cache.data_ptr() - k_cache.data_ptr() == 256 * 2  # V right after a head's K
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


# ---- configs, the default table and the plan / run API ------------------------------------------


@pytest.mark.parametrize("config", pd.CONFIGS, ids=str)
@pytest.mark.parametrize("block_size", [16, 48, 544], ids=lambda b: f"bs{b}")
def test_every_config_matches_the_reference(config, block_size):
    """Whatever the table or an autotuner picks computes the same attention: one-segment tiles
    (the tile inside a page) and tiles of several page segments, with a window and splits."""
    lens = [1, 2 * block_size + 7, 300]
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 3
    _, k_cache, v_cache = synthetic_caches(
        "packed3-layer1", num_blocks, block_size, 2, 32, 32, torch.float16
    )
    tables = _fill(k_cache, v_cache, lens, torch.float16)
    q = torch.randn(len(lens), 8, 32).half()
    seq = torch.tensor(lens, dtype=torch.int32)
    for window, splits in ((None, 1), (70, 3)):
        out = torch.full((3, 8, 32), float("nan"), dtype=torch.float16)
        got = paged_decode_attention(
            q, k_cache, v_cache, tables, seq, 0.2, window, num_splits=splits, out=out,
            config=config,
        )  # fmt: skip
        want = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq, 0.2, window)
        assert not got.isnan().any()
        assert (got.float() - want.float()).abs().max() <= TOL[torch.float16]


def test_many_splits_merge_in_chunks():
    """64 splits of one long request: the reduce merges them 16 at a time, over several column
    blocks of the output (head dim 100: not a multiple of the column block)."""
    block_size, lens = 16, [64 * 128 + 5, 40]
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 2
    _, k_cache, v_cache = synthetic_caches(
        "classic", num_blocks, block_size, 1, 100, 100, torch.float32
    )
    tables = _fill(k_cache, v_cache, lens, torch.float32)
    q = torch.randn(2, 2, 100)
    seq = torch.tensor(lens, dtype=torch.int32)
    plan = pd.plan_decode(
        tables, seq, num_heads=2, num_kv_heads=1, head_dim=100, block_size=block_size,
        cache_dtype=torch.float32, q_dtype=torch.float32, scale=0.1, max_seq_len=max(lens),
        num_splits=80,
    )  # fmt: skip
    assert plan.num_splits == 65  # splits of whole 128-token tiles: cdiv(8197, 128)
    out = torch.full((2, 2, 100), float("nan"))
    plan.run(q, k_cache, v_cache, out=out)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq, 0.1)
    assert (out - want).abs().max() <= TOL[torch.float32]


def _plan_for(k_cache, tables, lens, q, **kw):
    return pd.plan_decode(
        tables, torch.tensor(lens, dtype=torch.int32), num_heads=q.shape[1],
        num_kv_heads=k_cache.shape[2], head_dim=q.shape[2], block_size=k_cache.shape[1],
        cache_dtype=k_cache.dtype, q_dtype=q.dtype, scale=0.25, max_seq_len=max(lens), **kw,
    )  # fmt: skip


def test_one_plan_serves_every_layer():
    """Two layers of one packed page (layers 0 and 1 of ``packed3``): one plan, one run each,
    each against its own reference; the partial buffers are reused between the runs."""
    lens, bs = [97, 3, 330], 16
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 4
    backing, k1, v1 = synthetic_caches("packed3-layer1", num_blocks, bs, 2, 32, 32, torch.float16)
    page = k1.stride(0)
    layer = page // 3
    k0 = torch.as_strided(backing, k1.shape, k1.stride(), 0)
    v0 = torch.as_strided(backing, v1.shape, v1.stride(), v1.storage_offset() - layer)
    tables = _fill(k1, v1, lens, torch.float16)
    for b, n in enumerate(lens):  # layer 0's K/V of the same tokens
        pos = torch.arange(n)
        blocks = tables[b, pos // bs].long()
        k0[blocks, pos % bs] = torch.randn(n, 2, 32).half()
        v0[blocks, pos % bs] = torch.randn(n, 2, 32).half()
    seq = torch.tensor(lens, dtype=torch.int32)
    plan = _plan_for(k1, tables, lens, torch.empty(3, 8, 32, dtype=torch.float16), num_splits=2)
    for k, v in ((k0, v0), (k1, v1)):
        q = torch.randn(3, 8, 32).half()
        out = torch.full((3, 8, 32), float("nan"), dtype=torch.float16)
        assert plan.run(q, k, v, out=out) is out
        want = paged_decode_attention_ref(q, k, v, tables, seq, 0.25)
        assert (out.float() - want.float()).abs().max() <= TOL[torch.float16]


def test_run_rejects_what_the_plan_was_not_made_for():
    q, k, v, tables, seq = _small_case()
    plan = _plan_for(k, tables, seq.tolist(), q)
    with pytest.raises(ValueError, match=r"q must be \[2, 4, 16\] torch.float32"):
        plan.run(q.half(), k, v)
    with pytest.raises(ValueError, match=r"q must be \[2, 4, 16\]"):
        plan.run(q[:1], k, v)
    with pytest.raises(ValueError, match=r"k_cache/v_cache must be \[num_blocks, 16, 2, 16/16\]"):
        plan.run(q, k[:, :8], v[:, :8])
    with pytest.raises(ValueError, match="out must be"):
        plan.run(q, k, v, out=torch.empty(2, 4, 15))
    k8 = torch.zeros(k.shape, dtype=torch.float8_e4m3fn)
    plan8 = _plan_for(k8, tables, seq.tolist(), q)
    with pytest.raises(ValueError, match="an fp8 cache needs k_scale: a float32 tensor"):
        plan8.run(q, k8, k8.clone(), k_scale=torch.tensor(1.0, dtype=torch.float64))


def test_plan_choices():
    """What the plan decides: a table config, one split (no partials, no second launch) when
    the batch fills the GPU, the splits choose_num_splits gives otherwise."""
    q, k, _, tables, seq = _small_case()
    plan = _plan_for(k, tables, seq.tolist(), q)
    assert plan.config in pd.CONFIGS and plan.config_source
    assert plan.num_splits == 1 and plan.part_acc is None
    big = torch.zeros(1, 200, dtype=torch.int32)
    plan = _plan_for(k, big, [3072], q[:1])
    assert plan.num_splits == pd.choose_num_splits(1, 2, 3072) == 12  # 256 tokens each
    assert plan.part_acc.shape == (1, 4, 12, 16)
    # plans of other dtypes never share a compiled kernel in the direct launcher
    half = _plan_for(k.half(), tables, seq.tolist(), q.half())
    assert half._launch_key != _plan_for(k, tables, seq.tolist(), q)._launch_key
    with pytest.raises(ValueError, match="not one of CONFIGS"):
        _plan_for(k, tables, seq.tolist(), q, config=pd.DecodeConfig(8, 1, 1))
    with pytest.raises(ValueError, match="autotune=True needs a GPU"):
        _plan_for(k, tables, seq.tolist(), q, autotune=True)
    with pytest.raises(ValueError, match="validate=True checks block ids: pass num_blocks"):
        _plan_for(k, tables, seq.tolist(), q, validate=True)


def _shapes_matching(rule):
    for arch in (80, 90):
        for page_align in (1, 2, 4, 8, 16, 32, 64, 128):
            for head_dim in (16, 32, 64, 128, 256, 512):
                for cache in ("16bit", "fp32", "fp8", "fp8-bytes"):
                    for work in (1, 8, 64, 1024):
                        shape = pd.DecodeShape(arch, page_align, 4, head_dim, cache, work, 4096)
                        if rule.matches(shape):
                            yield shape


def test_table_rows_are_candidates_and_fit_the_common_shapes():
    """Every row's config is one autotuning would try, and fits every shape of 16-bit or
    hardware-fp8 caches at the measured head dims (128, 256) that the row can match; for any
    head dim up to 256 the table's choice fits (a row whose config does not fit a shape falls
    through to the next row that does)."""
    for rule in pd._TABLE:
        assert rule.config in pd.CONFIGS, rule
        assert rule.source, rule
        for shape in _shapes_matching(rule):
            if shape.head_dim in (128, 256) and shape.cache in ("16bit", "fp8"):
                assert pd.config_fits(rule.config, shape), (rule.config, shape)
            if shape.head_dim <= 256:  # attention heads; MLA's 576-wide latent has its kernel
                config, _ = pd.choose_config(shape)
                assert pd.config_fits(config, shape)


def test_measured_rows_pick_the_measured_configs():
    """The H200 winners: 16-token segments 16/2/3 at any batch (GPU suite), 256-token pages at
    head dim 128: 128/4/2, 576-token pages at head dim 256: 32/4/3 (first sweep)."""

    def pick(block_size, head_dim, work):
        return pd.choose_config(
            pd.decode_shape(
                device=torch.device("cpu"), block_size=block_size, group=8,
                head_dim_k=head_dim, head_dim_v=head_dim, cache_dtype=torch.bfloat16,
                batch=work, num_kv_heads=1, max_seq_len=8192,
            )
        )[0]  # fmt: skip

    assert pick(16, 256, 128) == pd.DecodeConfig(16, 2, 3)
    assert pick(1040, 128, 512) == pd.DecodeConfig(16, 2, 3)  # 16-token segments of big pages
    assert pick(16, 256, 2) == pd.DecodeConfig(16, 2, 3)
    assert pick(256, 128, 128) == pd.DecodeConfig(128, 4, 2)
    assert pick(576, 256, 128) == pd.DecodeConfig(32, 4, 3)


def test_split_counts_follow_the_measured_occupancy():
    """2-warp programs fill one wave of what fits at once (Qwen3-Next d 256 on an H200: 4 a
    multiprocessor, so B=8 x 2 KV heads at 32k takes 33 splits -> 32 of 1024 tokens, where 32
    measured 88.7% and 37 66.6%; B=64 x 2: 4, where 3 measured 92.5% and 6 79.9%); Nemotron-H
    d 128: 6 a multiprocessor, B=8 x 8 KV heads 12 splits (10 measured 96%, 5 81%); 4-warp
    programs two a multiprocessor, rounded up; long enough splits; at most _MAX_SPLITS."""

    def splits(batch, hkv, context, head_dim, config, fp8=False):
        shape = pd.decode_shape(
            device=torch.device("cpu"), block_size=16, group=8, head_dim_k=head_dim,
            head_dim_v=head_dim, cache_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
            batch=batch, num_kv_heads=hkv, max_seq_len=context,
        )  # fmt: skip
        shape = dataclasses.replace(shape, arch=90)
        return pd.choose_num_splits(
            batch, hkv, context, 132, per_sm=pd.programs_per_sm(config, shape),
            one_wave=config.num_warps <= 2,
        )  # fmt: skip

    small, large = pd.DecodeConfig(16, 2, 3), pd.DecodeConfig(32, 4, 3)
    assert splits(8, 2, 32768, 256, small) == 33
    assert splits(64, 2, 8192, 256, small) == 4
    assert splits(256, 2, 4096, 256, small) == 1
    assert splits(8, 8, 32768, 128, small) == 12
    assert splits(64, 8, 8192, 128, small, fp8=True) == 2
    assert splits(8, 2, 32768, 256, large) == 17  # 2048-token splits: the plan runs 16
    assert splits(64, 2, 8192, 256, large) == 3
    assert splits(1, 2, 1 << 20, 256, small) == pd._MAX_SPLITS
    assert splits(1, 2, 1000, 256, small) == 1000 // pd._MIN_SPLIT_TOKENS


def test_launcher_skips_triton_binding_once_a_specialisation_is_compiled(monkeypatch):
    """``_Launcher`` with a stand-in for a compiled kernel (the interpreter has none): the first
    call of a key goes through ``fn[grid]``, later ones call the compiled kernel's launcher with
    every parameter in order (constexprs last), a new key compiles again, and launch hooks
    force Triton's path (which calls them)."""
    import triton

    calls = []

    class Compiled:
        function, packed_metadata = "function", "metadata"

        def run(self, *a):
            calls.append(("direct", a))

    class Fn:
        arg_names = ("x_ptr", "n", "BLOCK", "FLAG")

        def __getitem__(self, grid):
            def launch(*args, **meta):
                calls.append(("triton", grid, args, meta))
                return Compiled()

            return launch

    class Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 1234

    monkeypatch.setattr(pd, "_DIRECT_LAUNCH", True)
    monkeypatch.setattr(type(triton.runtime.driver), "active", property(lambda self: Driver()))
    launcher = pd._Launcher(Fn())
    meta = {"BLOCK": 16, "FLAG": True, "num_warps": 2}
    launcher((3, 1, 1), ("a",), ("X", 7), meta)
    launcher((3, 1, 1), ("a",), ("Y", 8), meta)
    launcher((5, 2, 1), ("b",), ("Z", 9), meta)
    assert [c[0] for c in calls] == ["triton", "direct", "triton"]
    assert calls[1][1] == (
        3,
        1,
        1,
        1234,
        "function",
        "metadata",
        None,
        None,
        None,
        "Y",
        8,
        16,
        True,
    )
    hook = triton.knobs.runtime.launch_enter_hook
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    launcher((3, 1, 1), ("a",), ("W", 1), meta)
    assert calls[-1][0] == "triton"
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", hook)
    monkeypatch.setattr(pd, "_DIRECT_LAUNCH", False)
    fresh = pd._Launcher(Fn())
    fresh((1, 1, 1), ("c",), ("V", 2), meta)
    fresh((1, 1, 1), ("c",), ("V", 2), meta)
    assert [c[0] for c in calls[-2:]] == ["triton", "triton"]


@pytest.mark.parametrize("q_scale", [1.0, 3e3, 1e-4], ids=["unit", "large", "small"])
@pytest.mark.parametrize("software", [False, True], ids=["hw-convert", "byte-decode"])
def test_fp8_cache_with_bf16_queries_runs_its_dots_in_fp16(q_scale, software, monkeypatch):
    """A bf16 query over an fp8 cache is scaled by a power of two into fp16's range and the dots
    run in fp16 (one conversion instruction a pair of fp8 values, where bf16 takes four): the
    result stays within bf16's rounding of the float32 reference, for queries far above fp16's
    largest value (3e3 x randn: a near one-hot softmax) and far below its smallest normal."""
    if software:
        monkeypatch.setattr(pd, "_fp8e4_in_hardware", lambda device: False)
    dtype = torch.float8_e4m3fn
    k8, v8 = _fp8_caches(20, 16, 2, 64, dtype)
    lens = [70, 9, 130]
    tables = _fill(k8, v8, lens, dtype)
    q = (torch.randn(3, 4, 64) * q_scale).to(torch.bfloat16)
    ks, vs = torch.tensor(0.5), torch.tensor(0.25)
    seq = torch.tensor(lens, dtype=torch.int32)
    plan = _plan_for(k8, tables, lens, q)
    assert plan._constexprs["Q_TO_F16"]
    got = plan.run(q, k8, v8, ks, vs)
    want = paged_decode_attention_ref(q, k8, v8, tables, seq, 0.25, k_scale=ks, v_scale=vs)
    assert not torch.isnan(got).any()
    err = (got.float() - want.float()).abs().max().item()
    assert err < 2e-2 * want.float().abs().max().item(), err


@pytest.mark.parametrize("window", [None, 40], ids=["full", "window40"])
@pytest.mark.parametrize("splits", [1, 3], ids=["one-split", "split3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_decode_with_attention_sinks(splits, window, dtype):
    """Per-head sink logits (GraniteSWA, GPT-OSS): one more logit in each head's softmax, with
    no value. Added once whether the keys run as one split or several (the reduce adds it),
    and large enough on some heads to take most of the weight, negative on others."""
    lens, hq, hkv, d, bs = [130, 7, 61], 6, 2, 32, 16
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 4
    _, k_cache, v_cache = synthetic_caches("classic", num_blocks, bs, hkv, d, d, dtype)
    tables = _fill(k_cache, v_cache, lens, dtype)
    q = torch.randn(len(lens), hq, d).to(dtype)
    sinks = torch.randn(hq) * 4
    sinks[0] = 12.0  # the sink takes almost all of head 0's weight
    seq = torch.tensor(lens, dtype=torch.int32)
    out = torch.full((len(lens), hq, d), float("nan"), dtype=dtype)
    got = paged_decode_attention(
        q, k_cache, v_cache, tables, seq, 0.2, window, num_splits=splits, out=out, sinks=sinks
    )
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq, 0.2, window, sinks=sinks)
    plain = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq, 0.2, window)
    assert not torch.isnan(got).any()
    assert (got.float() - want.float()).abs().max() <= TOL[dtype]
    # the sinks matter: head 0's output shrinks toward zero, the others move
    assert want[:, 0].abs().max() < 0.1 * plain[:, 0].abs().max()
    assert (want.float() - plain.float()).abs().max() > 10 * TOL[dtype]


def test_sinks_are_planned_for():
    q, k, v, tables, seq = _small_case()
    plain = _plan_for(k, tables, seq.tolist(), q)
    with pytest.raises(ValueError, match="plan with sinks=True"):
        plain.run(q, k, v, sinks=torch.zeros(4))
    with_sinks = _plan_for(k, tables, seq.tolist(), q, sinks=True)
    with pytest.raises(ValueError, match="pass the layer's sinks"):
        with_sinks.run(q, k, v)
    with pytest.raises(ValueError, match=r"sinks must be \[4\] float32"):
        with_sinks.run(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match=r"sinks must be \[4\] float32"):
        with_sinks.run(q, k, v, sinks=torch.zeros(4, dtype=torch.float16))


def _rel_case(lens, hq, hkv, d, dtype, rel_dim=16, extent=50):
    """Caches, tables, q and a relative bias: ``rel_states [B, Hq, rel_dim]`` and ``rel_proj
    [rel_dim, extent]`` scaled so the bias moves the logits by about one."""
    bs = 16
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 4
    _, k_cache, v_cache = synthetic_caches("classic", num_blocks, bs, hkv, d, d, dtype)
    tables = _fill(k_cache, v_cache, lens, dtype)
    q = torch.randn(len(lens), hq, d).to(dtype)
    rel_states = torch.randn(len(lens), hq, rel_dim).to(dtype)
    rel_proj = (torch.randn(rel_dim, extent) / math.sqrt(rel_dim)).to(dtype)
    return k_cache, v_cache, tables, q, rel_states, rel_proj


@pytest.mark.parametrize("window", [None, 80], ids=["full", "window80"])
@pytest.mark.parametrize("splits", [1, 3], ids=["one-split", "split3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_decode_with_relative_bias(splits, window, dtype):
    """Inkling's relative-position bias: ``rel_states[b, h] @ rel_proj[:, distance]`` added to
    each scaled logit for distances below rel_extent (50 here: requests of 300 and 61 tokens
    straddle it, one of 7 lies inside it; the 80-token window is wider than it, so tiles below
    the band run the plain loop). Compared with the torch reference; the bias matters (the
    same launch with rel_proj zeroed gives the plain attention, beyond tolerance away)."""
    lens, hq, hkv, d = [300, 7, 61], 6, 2, 32
    k_cache, v_cache, tables, q, rel_states, rel_proj = _rel_case(lens, hq, hkv, d, dtype)
    seq = torch.tensor(lens, dtype=torch.int32)

    def run(proj):
        out = torch.full((len(lens), hq, d), float("nan"), dtype=dtype)
        return paged_decode_attention(q, k_cache, v_cache, tables, seq, 0.2, window,
                                      num_splits=splits, out=out, rel_states=rel_states,
                                      rel_proj=proj)  # fmt: skip

    got, zeroed = run(rel_proj), run(torch.zeros_like(rel_proj))
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq, 0.2, window,
                                      rel_states=rel_states, rel_proj=rel_proj)  # fmt: skip
    plain = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq, 0.2, window)
    assert not torch.isnan(got).any()
    assert (got.float() - want.float()).abs().max() <= TOL[dtype]
    assert (zeroed.float() - plain.float()).abs().max() <= TOL[dtype]
    assert (got.float() - zeroed.float()).abs().max() > 10 * TOL[dtype]


def test_one_plan_serves_layers_with_their_own_relative_bias():
    """Plan once with rel_dim, run per layer: each layer brings its own states and bank, and
    the bank's width (rel_extent: Inkling's sliding layers use their window, full layers 1024)
    is read from the run's rel_proj."""
    lens, hq, hkv, d = [130, 20], 4, 2, 32
    k_cache, v_cache, tables, q, rel_states, rel_proj = _rel_case(lens, hq, hkv, d, torch.float32)
    plan = _plan_for(k_cache, tables, lens, q, rel_dim=16)
    seq = torch.tensor(lens, dtype=torch.int32)
    for states, proj in ((rel_states, rel_proj), (-rel_states, torch.randn(16, 7))):
        got = plan.run(q, k_cache, v_cache, rel_states=states, rel_proj=proj)
        want = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq, 0.25,
                                          rel_states=states, rel_proj=proj)  # fmt: skip
        assert (got - want).abs().max() <= TOL[torch.float32]


def test_relative_bias_is_planned_for():
    q, k, v, tables, seq = _small_case()
    states, proj = torch.zeros(2, 4, 16), torch.zeros(16, 32)
    plain = _plan_for(k, tables, seq.tolist(), q)
    with pytest.raises(ValueError, match="plan with rel_dim="):
        plain.run(q, k, v, rel_states=states, rel_proj=proj)
    planned = _plan_for(k, tables, seq.tolist(), q, rel_dim=16)
    with pytest.raises(ValueError, match=r"pass the layer's rel_states \[B, Hq, 16\]"):
        planned.run(q, k, v)
    with pytest.raises(ValueError, match="pass rel_states and rel_proj together"):
        planned.run(q, k, v, rel_states=states)
    with pytest.raises(ValueError, match=r"rel_states must be \[B=2, Hq=4, rel_dim=16\]"):
        planned.run(q, k, v, rel_states=torch.zeros(2, 4, 8), rel_proj=proj)
    with pytest.raises(ValueError, match=r"rel_proj must be \[rel_dim=16, rel_extent >= 1\]"):
        planned.run(q, k, v, rel_states=states, rel_proj=torch.zeros(8, 32))
    with pytest.raises(ValueError, match=r"pass rel_proj\.contiguous\(\)"):
        planned.run(q, k, v, rel_states=states, rel_proj=torch.zeros(32, 16).t())
    with pytest.raises(ValueError, match=r"rel_proj must be torch\.float32"):
        planned.run(q, k, v, rel_states=states, rel_proj=proj.half())
    with pytest.raises(ValueError, match="rel_dim must be None"):
        _plan_for(k, tables, seq.tolist(), q, rel_dim=0)
