"""Paged prefill / extend attention against the torch reference on every layout."""

from __future__ import annotations

import math

import pytest
import torch

from hybridkv.layouts import LAYOUTS
from hybridkv_kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_ref

from .paged import SYNTHETIC, plan_caches, synthetic_caches
from .test_paged_decode import _fill

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def _run(k_cache, v_cache, lens, q_lens, hq, dtype, window=None):
    tables = _fill(k_cache, v_cache, lens, dtype)
    dk = k_cache.shape[3]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, dk).to(dtype)
    seq = torch.tensor(lens, dtype=torch.int32)
    scale = 1 / math.sqrt(dk)
    out = torch.full((q.shape[0], hq, v_cache.shape[3]), float("nan"), dtype=dtype)
    got = paged_prefill_attention(q, k_cache, v_cache, tables, cu, seq, scale, window, out=out)
    assert got.data_ptr() == out.data_ptr()
    want = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, seq, scale, window)
    assert not torch.isnan(got).any()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype], err


@pytest.mark.parametrize("layout", SYNTHETIC)
@pytest.mark.parametrize(
    "lens, q_lens, hq, hkv, dk, dv, block_size, dtype, window",
    [
        pytest.param([1], [1], 2, 2, 16, 16, 16, torch.float32, None, id="single-token"),
        pytest.param([70, 5], [70, 5], 4, 2, 32, 32, 16, torch.float16, None, id="fresh-prefill"),
        pytest.param(
            [133, 40, 9], [35, 1, 9], 6, 2, 40, 24, 32, torch.float32, None, id="extend-prefix"
        ),
        pytest.param([150], [64], 3, 1, 64, 64, 48, torch.float16, 37, id="window37-bs48"),
    ],
)
def test_prefill_synthetic(layout, lens, q_lens, hq, hkv, dk, dv, block_size, dtype, window):
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 4
    _, k_cache, v_cache = synthetic_caches(layout, num_blocks, block_size, hkv, dk, dv, dtype)
    _run(k_cache, v_cache, lens, q_lens, hq, dtype, window)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_on_real_plans(layout):
    _, k_cache, v_cache = plan_caches(layout, "float16")
    _run(k_cache, v_cache, [50, 33], [20, 33], 4, torch.float16)


def test_prefill_errors():
    _, k, v = synthetic_caches("classic", 4, 16, 2, 16, 16, torch.float32)
    q = torch.randn(5, 4, 16)
    tables = torch.ones(1, 4, dtype=torch.int32)
    seq = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="more query tokens"):
        paged_prefill_attention(
            q, k, v, tables, torch.tensor([0, 5]).int(), seq, 1.0, validate=True
        )
    with pytest.raises(ValueError, match="rise from 0"):
        paged_prefill_attention(
            q, k, v, tables, torch.tensor([0, 4]).int(), seq, 1.0, validate=True
        )


@pytest.mark.parametrize("layout", SYNTHETIC)
@pytest.mark.parametrize(
    "ctx_len, q_len, window, block_size",
    [
        pytest.param(300, 40, 64, 16, id="w64-bs16"),
        pytest.param(500, 33, 100, 48, id="w100-bs48-ragged-tile"),
        pytest.param(1000, 70, 256, 128, id="w256-bs128"),
    ],
)
def test_prefill_window_ignores_freed_blocks(layout, ctx_len, q_len, window, block_size):
    """What an allocator does for a sliding-window layer: blocks wholly below the window of the
    chunk's first query are freed to the null block 0, whose bytes nothing initialises. Here the
    null block and the freed blocks hold NaN; a kernel that lets them into ``p @ v`` (0 x NaN)
    returns NaN for whole query tiles."""
    seq_len = ctx_len + q_len
    num_blocks = math.ceil(seq_len / block_size) + 4
    _, k_cache, v_cache = synthetic_caches(
        layout, num_blocks, block_size, 2, 32, 32, torch.float16
    )
    tables = _fill(k_cache, v_cache, [seq_len], torch.float16)
    first_visible = ctx_len - window + 1  # of the chunk's first query token
    freed = first_visible // block_size  # blocks [0, freed) hold no visible key
    for b in tables[0, :freed].tolist():
        k_cache[b] = float("nan")
        v_cache[b] = float("nan")
    tables[0, :freed] = 0
    k_cache[0] = float("nan")
    v_cache[0] = float("nan")
    cu = torch.tensor([0, q_len], dtype=torch.int32)
    seq = torch.tensor([seq_len], dtype=torch.int32)
    q = torch.randn(q_len, 4, 32).half()
    out = torch.full((q_len, 4, 32), float("nan"), dtype=torch.float16)
    got = paged_prefill_attention(q, k_cache, v_cache, tables, cu, seq, 32**-0.5, window)
    out.copy_(got)
    want = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, seq, 32**-0.5, window)
    assert not torch.isnan(want).any(), "the reference must not see the freed blocks either"
    assert not torch.isnan(out).any()
    assert (out.float() - want.float()).abs().max() <= TOL[torch.float16]


@pytest.mark.parametrize(
    "lens, q_lens, hq, hkv, block_size",
    [
        pytest.param([40, 7, 90, 5], [40, 0, 33, 0], 8, 2, 16, id="empty-requests-gqa4"),
        pytest.param([200, 64], [70, 64], 16, 1, 48, id="gqa16-bs48"),
        pytest.param([300], [45], 12, 4, 544, id="gqa3-bs544"),
        pytest.param([129, 17], [129, 17], 2, 2, 128, id="mha-bs128"),
        pytest.param([77], [77], 4, 1, 7, id="bs7"),
        pytest.param([100, 3], [20, 3], 6, 3, 80, id="bs80"),
    ],
)
def test_prefill_varlen_page_walk(lens, q_lens, hq, hkv, block_size):
    """Requests with no query token (their grid programs must exit), GQA groups that fill a
    tile's rows, and page sizes whose segments are 16, 32, 64 or 1 tokens."""
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 3
    _, k_cache, v_cache = synthetic_caches(
        "packed3-layer1", num_blocks, block_size, hkv, 32, 32, torch.float16
    )
    _run(k_cache, v_cache, lens, q_lens, hq, torch.float16)


@pytest.mark.parametrize("head_dim", [64, 256], ids=["d64", "d256"])
@pytest.mark.parametrize("software", [False, True], ids=["hw-convert", "byte-decode"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_prefill_fp8(dtype, software, head_dim, monkeypatch):
    """``byte-decode`` is the sm_80 path for e4m3 caches (no hardware e4m3); at head dim 256
    such GPUs run 32-row tiles (see ``_prune``)."""
    from hybridkv_kernels import paged_prefill

    from .test_paged_decode import _fp8_caches

    if software:
        monkeypatch.setattr(paged_prefill, "_fp8e4_in_hardware", lambda device: False)
    k8, v8 = _fp8_caches(20, 16, 2, head_dim, dtype)
    lens, q_lens = [70, 9, 130], [70, 4, 30]
    tables = _fill(k8, v8, lens, dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 4, head_dim, dtype=torch.float16)
    ks, vs = torch.tensor(0.5), torch.tensor(0.25)
    seq = torch.tensor(lens, dtype=torch.int32)
    got = paged_prefill_attention(q, k8, v8, tables, cu, seq, 0.2, k_scale=ks, v_scale=vs)
    want = paged_prefill_attention_ref(q, k8, v8, tables, cu, seq, 0.2, k_scale=ks, v_scale=vs)
    assert not torch.isnan(got).any()
    assert (got.float() - want.float()).abs().max() < 3e-3


@pytest.mark.parametrize(
    "case, match",
    [
        ("block-id-num_blocks", r"block_tables\[0, 1\] = 6 is outside \[0, 6\)"),
        ("block-id-minus-1", r"block_tables\[1, 0\] = -1 is outside"),
        ("seq_len-0", r"seq_lens\[1\] = 0: every request needs seq_len >= 1"),
        ("cu-not-from-0", r"cu_seqlens_q must rise from 0"),
        ("table-too-narrow", r"block_tables has 3 columns, needs 4"),
    ],
)
def test_prefill_validate_catches_bad_input(case, match, monkeypatch):
    _, k, v = synthetic_caches("classic", 6, 16, 2, 16, 16, torch.float32)
    tables = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)
    seq = torch.tensor([40, 20], dtype=torch.int32)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    if case == "block-id-num_blocks":
        tables[0, 1] = 6
    elif case == "block-id-minus-1":
        tables[1, 0] = -1
    elif case == "seq_len-0":
        seq[1], cu[2] = 0, 3
    elif case == "cu-not-from-0":
        cu[0] = 1
    else:
        seq[0] = 60
    q = torch.randn(int(cu[-1]), 4, 16)
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(q, k, v, tables, cu, seq, 0.25, validate=True)
    monkeypatch.setenv("HYBRIDKV_VALIDATE", "1")
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(q, k, v, tables, cu, seq, 0.25)
