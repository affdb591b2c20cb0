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
    got = paged_prefill_attention(q, k_cache, v_cache, tables, cu, seq, scale, window)
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
        paged_prefill_attention(q, k, v, tables, torch.tensor([0, 5]).int(), seq, 1.0)
    with pytest.raises(ValueError, match="rise from 0"):
        paged_prefill_attention(q, k, v, tables, torch.tensor([0, 4]).int(), seq, 1.0)
