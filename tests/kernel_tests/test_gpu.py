"""GPU-only checks: bf16 attention (the interpreter's bf16 ``tl.dot`` is unreliable) and fp8
rounding on hardware. Run on a GPU with ``HYBRIDKV_TEST_GPU=1 pytest -m gpu tests/kernel_tests``
(the variable keeps ``tests/conftest.py`` from switching the interpreter on)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridkv_kernels.cache_write import write_kv_cache, write_kv_cache_ref
from hybridkv_kernels.paged_decode import paged_decode_attention, paged_decode_attention_ref
from hybridkv_kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_ref

from .paged import SYNTHETIC, synthetic_caches
from .test_paged_decode import _fill

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("layout", SYNTHETIC)
@pytest.mark.parametrize("lens", [[1, 300, 4097], [8192]], ids=["mixed", "long"])
def test_bf16_decode_and_prefill(layout, lens):
    dtype, hq, hkv, d, bs = torch.bfloat16, 16, 2, 128, 16
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 4
    backing, k_cache, v_cache = synthetic_caches(layout, num_blocks, bs, hkv, d, d, dtype)
    tables = _fill(k_cache, v_cache, lens, dtype)
    on_gpu = backing.cuda()
    k_cache = torch.as_strided(on_gpu, k_cache.shape, k_cache.stride(), k_cache.storage_offset())
    v_cache = torch.as_strided(on_gpu, v_cache.shape, v_cache.stride(), v_cache.storage_offset())
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    tables = tables.cuda()
    q = torch.randn(len(lens), hq, d, device="cuda", dtype=dtype)
    got = paged_decode_attention(q, k_cache, v_cache, tables, seq, d**-0.5)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq, d**-0.5)
    # bf16 has 8 mantissa bits: outputs of unit-scale attention agree to a few bf16 ulps
    assert (got.float() - want.float()).abs().max() < 2e-2
    cu = torch.tensor([0, *torch.tensor([min(n, 64) for n in lens]).cumsum(0).tolist()])
    cu = cu.to(torch.int32).cuda()
    qp = torch.randn(int(cu[-1]), hq, d, device="cuda", dtype=dtype)
    got = paged_prefill_attention(qp, k_cache, v_cache, tables, cu, seq, d**-0.5)
    want = paged_prefill_attention_ref(qp, k_cache, v_cache, tables, cu, seq, d**-0.5)
    assert (got.float() - want.float()).abs().max() < 2e-2


@pytest.mark.parametrize("soft", [False, True], ids=["hw-e4m3", "soft-e4m3"])
def test_fp8_write_rounds_like_torch(soft, monkeypatch):
    """Random values, and for the software encoder (what an sm_80 GPU runs; forced here on
    any GPU) also every rounding boundary, infinities and NaNs, against torch byte for byte."""
    from hybridkv_kernels import cache_write

    from .test_cache_write import _e4m3_boundary_values

    if soft:
        monkeypatch.setattr(cache_write, "_fp8e4_in_hardware", lambda device: False)
    elif not cache_write._fp8e4_in_hardware(torch.device("cuda")):
        pytest.skip("no hardware e4m3 on this GPU (the soft case covers it)")
    backing, k, v = synthetic_caches("classic", 8, 16, 2, 64, 64, torch.float32)
    b8 = torch.zeros(backing.numel(), dtype=torch.float8_e4m3fn, device="cuda")
    k8 = torch.as_strided(b8, k.shape, k.stride(), k.storage_offset())
    v8 = torch.as_strided(b8, v.shape, v.stride(), v.storage_offset())
    r8 = b8.clone()
    kr = torch.as_strided(r8, k.shape, k.stride(), k.storage_offset())
    vr = torch.as_strided(r8, v.shape, v.stride(), v.storage_offset())
    key, value = (torch.randn(100, 2, 64, device="cuda") for _ in range(2))
    boundary = _e4m3_boundary_values()
    if not soft:  # the hardware's NaN and infinity encodings are its own business
        boundary = boundary[boundary.isfinite()]
    key.view(-1)[: boundary.numel()] = boundary.cuda()
    ks, vs = torch.tensor(0.01, device="cuda"), torch.tensor(0.013, device="cuda")
    slots = torch.randperm(128, device="cuda")[:100]
    write_kv_cache(key, value, k8, v8, slots, ks, vs)
    write_kv_cache_ref(key, value, kr, vr, slots, ks, vs)
    assert torch.equal(b8.view(torch.uint8), r8.view(torch.uint8))
    one = torch.ones((), device="cuda")
    write_kv_cache(key, value, k8, v8, slots, one, one)
    write_kv_cache_ref(key, value, kr, vr, slots, one, one)
    assert torch.equal(b8.view(torch.uint8), r8.view(torch.uint8))


@pytest.mark.parametrize("lens", [[1, 300, 4097], [16384]], ids=["mixed", "long"])
def test_bf16_mla_decode(lens):
    from hybridkv_kernels.mla_decode import mla_decode_attention, mla_decode_attention_ref

    from .test_mla_decode import _tables

    dtype, heads, dc, dr, bs = torch.bfloat16, 16, 512, 64, 64
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 4
    cache = torch.full((num_blocks, bs, 1, dc + dr), float("nan"), dtype=dtype)
    tables = _tables(cache, lens, dtype).cuda()
    cache = cache.cuda()
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q_nope = torch.randn(len(lens), heads, dc, device="cuda", dtype=dtype)
    q_pe = torch.randn(len(lens), heads, dr, device="cuda", dtype=dtype)
    scale = (dc + dr) ** -0.5
    got = mla_decode_attention(q_nope, q_pe, cache, tables, seq, scale)
    want = mla_decode_attention_ref(q_nope, q_pe, cache, tables, seq, scale)
    assert not got.isnan().any()
    assert (got.float() - want.float()).abs().max() < 2e-2
