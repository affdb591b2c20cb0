"""MLA latent-cache decode against the torch reference: synthetic strided caches and the real
plan views of Kimi-Linear (MLA + KDA) in every layout."""

from __future__ import annotations

import math

import pytest
import torch

from hybridkv import models
from hybridkv.layouts import LAYOUTS, make_plan
from hybridkv_kernels.mla_decode import mla_decode_attention, mla_decode_attention_ref

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def _tables(cache: torch.Tensor, lens: list[int], dtype: torch.dtype, scale: float = 1.0):
    """Write random latents for every request through shuffled, non-contiguous block tables;
    columns past a request's blocks hold garbage ids that must never be read."""
    num_blocks, block_size = cache.shape[:2]
    need = [math.ceil(n / block_size) for n in lens]
    free = torch.randperm(num_blocks - 1)[: sum(need)] + 1  # block 0: the null block
    tables = torch.full((len(lens), max(need) + 2), 10**6, dtype=torch.int32)
    start = 0
    for b, (n, nb) in enumerate(zip(lens, need)):
        tables[b, :nb] = free[start : start + nb].int()
        start += nb
        pos = torch.arange(n)
        rows = tables[b, pos // block_size].long()
        cache[rows, pos % block_size] = (torch.randn(n, *cache.shape[2:]) * scale).to(dtype)
    return tables


def _check(q_nope, q_pe, cache, tables, lens, scale, splits=None, k_scale=None):
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = _poisoned(q_nope.shape, q_nope.dtype)  # unwritten outputs would stay NaN
    got = mla_decode_attention(
        q_nope, q_pe, cache, tables, seq_lens, scale, k_scale=k_scale, num_splits=splits, out=out
    )
    assert got is out
    want = mla_decode_attention_ref(q_nope, q_pe, cache, tables, seq_lens, scale, k_scale)
    assert not torch.isnan(got).any()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[q_nope.dtype], err


@pytest.mark.parametrize(
    "lens, heads, dc, dr, block_size, dtype, splits",
    [
        pytest.param([1], 16, 64, 16, 64, torch.float32, None, id="len1-H16"),
        pytest.param([65, 3, 130], 20, 64, 16, 64, torch.float16, 1, id="B3-H20-nosplit"),
        pytest.param([300, 64], 8, 48, 16, 64, torch.float32, 3, id="H8-tp-sharded-split3"),
        pytest.param([257], 16, 512, 64, 64, torch.float16, 2, id="deepseek-dims"),
        pytest.param([40, 7], 4, 32, 8, 16, torch.float32, None, id="small-block-Dr8"),
    ],
)
def test_mla_decode_synthetic(lens, heads, dc, dr, block_size, dtype, splits):
    """A strided cache whose rows have slack after the latent and whose blocks are spaced out
    (as in a page packing several layers)."""
    torch.manual_seed(sum(lens) + heads)
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 3
    token_stride = dc + dr + 8
    backing = _poisoned((num_blocks, 2 * block_size * token_stride), dtype)
    cache = torch.as_strided(
        backing,
        (num_blocks, block_size, dc + dr),
        (2 * block_size * token_stride, token_stride, 1),
    )
    tables = _tables(cache, lens, dtype)
    q_nope = torch.randn(len(lens), heads, dc).to(dtype)
    q_pe = torch.randn(len(lens), heads, dr).to(dtype)
    _check(q_nope, q_pe, cache, tables, lens, 1 / math.sqrt(dc + dr), splits)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_decode_on_real_plans(layout):
    """Kimi-Linear's MLA layers on a real plan: the last MLA layer's view of NaN-filled pools."""
    model = models.load("kimi-linear-48b-a3b", tp_size=4, kv_dtype="float16")
    probe = make_plan(model, layout, memory=1 << 40, max_num_seqs=2)
    memory = probe.capacity.state_reserved_bytes + 4 * max(p.block_bytes for p in probe.pools)
    memory += 6 * probe.block_size * model.kv_bytes_per_token
    plan = make_plan(model, layout, memory=memory, max_num_seqs=2)
    buffers = plan.allocate("cpu")
    for b in buffers.values():
        b.view(torch.uint8).fill_(0xFF)  # NaN in every float dtype
    spec = model.attention_layers[-1].spec
    cache, v = plan.kv_views(buffers, model.attention_layers[-1].name)
    assert v is None and cache.shape[2:] == (1, spec.latent_dim)
    lens = [cache.shape[1] + 5, 1]
    torch.manual_seed(0)
    tables = _tables(cache, lens, torch.float16)
    heads = spec.num_heads // spec.tp_size  # the latent is whole on every rank, heads are not
    q_nope = torch.randn(2, heads, spec.kv_lora_rank).half()
    q_pe = torch.randn(2, heads, spec.qk_rope_head_dim).half()
    _check(q_nope, q_pe, cache, tables, lens, 1 / math.sqrt(192), splits=2)


def test_mla_decode_fp8_cache():
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        pytest.skip("no float8_e4m3fn in this torch")
    torch.manual_seed(3)
    cache = torch.full((6, 16, 1, 40), float("nan")).to(fp8)
    # values exactly representable in e4m3 (the interpreter's float8 rounding can differ from
    # torch's by one ulp; the GPU test checks rounding)
    lens = [37]
    tables = torch.tensor([[4, 1, 3, 10**6]], dtype=torch.int32)
    pos = torch.arange(37)
    vals = torch.randint(-8, 9, (37, 1, 40)).float() / 4
    cache[tables[0, pos // 16].long(), pos % 16] = vals.to(fp8)
    q_nope, q_pe = torch.randn(1, 16, 32), torch.randn(1, 16, 8)
    _check(q_nope, q_pe, cache, tables, lens, 0.1, k_scale=torch.tensor(0.5))


def test_mla_decode_int64_addressing():
    """Block 2 starts at element 2**31 of a ~4 GiB buffer that is never touched."""
    block_size, dc, dr = 16, 16, 16
    stride = 2**30
    backing = torch.empty(2 * stride + block_size * (dc + dr), dtype=torch.float16)
    cache = torch.as_strided(backing, (3, block_size, dc + dr), (stride, dc + dr, 1))
    cache[0] = torch.randn(block_size, dc + dr).half()
    cache[2] = torch.randn(block_size, dc + dr).half()
    tables = torch.tensor([[2, 0]], dtype=torch.int32)
    q_nope, q_pe = torch.randn(1, 16, dc).half(), torch.randn(1, 16, dr).half()
    _check(q_nope, q_pe, cache, tables, [29], 0.25)


def test_mla_decode_errors():
    cache = torch.zeros(4, 16, 40)
    tables = torch.ones(1, 2, dtype=torch.int32)
    q_nope, q_pe = torch.randn(1, 16, 32), torch.randn(1, 16, 8)
    one = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="latent dim 40"):
        mla_decode_attention(q_nope, torch.randn(1, 16, 4), cache, tables, one, 1.0)
    with pytest.raises(ValueError, match="one head"):
        mla_decode_attention(q_nope, q_pe, torch.zeros(4, 16, 2, 40), tables, one, 1.0)
    with pytest.raises(ValueError, match="seq_len >= 1"):
        mla_decode_attention(q_nope, q_pe, cache, tables, torch.tensor([0]).int(), 1.0)
    with pytest.raises(ValueError, match="needs 3 blocks"):
        mla_decode_attention(q_nope, q_pe, cache, tables, torch.tensor([40]).int(), 1.0)
    with pytest.raises(ValueError, match="int32"):
        mla_decode_attention(q_nope, q_pe, cache, tables.long(), one, 1.0)
