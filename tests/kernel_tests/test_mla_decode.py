"""MLA latent-cache decode against the torch reference: synthetic strided caches, head counts
from one to DeepSeek's 128, block sizes that are not powers of two, fp8 (with the software e4m3
decode of GPUs before sm_89), input validation and the real plan views of Kimi-Linear
(MLA + KDA) in every layout."""

from __future__ import annotations

import math

import pytest
import torch

from hybridkv import models
from hybridkv.layouts import LAYOUTS, make_plan
from hybridkv_kernels import mla_decode
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


def _check(q_nope, q_pe, cache, tables, lens, scale, splits=None, k_scale=None, **kwargs):
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = _poisoned(q_nope.shape, q_nope.dtype)  # unwritten outputs would stay NaN
    got = mla_decode_attention(
        q_nope,
        q_pe,
        cache,
        tables,
        seq_lens,
        scale,
        k_scale=k_scale,
        num_splits=splits,
        out=out,
        **kwargs,
    )
    assert got is out
    want = mla_decode_attention_ref(q_nope, q_pe, cache, tables, seq_lens, scale, k_scale)
    assert not torch.isnan(got).any()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[q_nope.dtype], err
    return got


def _strided_cache(num_blocks, block_size, dc, dr, dtype):
    """A NaN-filled cache whose rows have slack after the latent and whose blocks are spaced
    out (as in a page packing several layers)."""
    token_stride = dc + dr + 8
    backing = _poisoned((num_blocks, 2 * block_size * token_stride), dtype)
    return torch.as_strided(
        backing,
        (num_blocks, block_size, dc + dr),
        (2 * block_size * token_stride, token_stride, 1),
    )


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
    cache = _strided_cache(num_blocks, block_size, dc, dr, dtype)
    tables = _tables(cache, lens, dtype)
    q_nope = torch.randn(len(lens), heads, dc).to(dtype)
    q_pe = torch.randn(len(lens), heads, dr).to(dtype)
    _check(q_nope, q_pe, cache, tables, lens, 1 / math.sqrt(dc + dr), splits)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_decode_on_real_plans(layout):
    """Kimi-Linear's MLA layers on a real plan: the last MLA layer's view of NaN-filled pools."""
    model = models.load("kimi-linear-48b-a3b", tp_size=4, kv_dtype="float16")
    plan = make_plan(model, layout, fit_tokens=6 * 64, max_num_seqs=2)
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


@pytest.mark.parametrize("capability", [(8, 0), (9, 0)], ids=["sm80", "sm90"])
@pytest.mark.parametrize("heads", [1, 20, 32, 64, 128])
def test_mla_decode_head_counts(heads, capability, monkeypatch):
    """Every head count, with the heads-per-program limit of an A100 and of an H100: heads past
    the limit go to further programs of the same request, padding heads are never stored."""
    monkeypatch.setattr(mla_decode, "_capability", lambda device: capability)
    torch.manual_seed(heads)
    lens, block_size, dc, dr = [70, 5], 16, 64, 16
    cache = _strided_cache(12, block_size, dc, dr, torch.float16)
    tables = _tables(cache, lens, torch.float16)
    q_nope = torch.randn(2, heads, dc).half()
    q_pe = torch.randn(2, heads, dr).half()
    _check(q_nope, q_pe, cache, tables, lens, 0.12, splits=2)


@pytest.mark.parametrize("heads, want", [(1, 16), (20, 32), (32, 32), (64, 64), (128, 64)])
def test_heads_per_program(heads, want):
    """Kimi-Linear's 32 heads (TP1) share one program on every GPU, so its latent cache is read
    once per request; DeepSeek's 128 take two programs on an H100, four on an A100 or with an
    fp8 cache."""
    assert mla_decode.heads_per_program(heads, (9, 0)) == want
    assert mla_decode.heads_per_program(heads, (8, 0)) == min(want, 32)
    assert mla_decode.heads_per_program(heads, (9, 0), fp8=True) == min(want, 32)


def test_mla_decode_deepseek_128_heads(monkeypatch):
    """DeepSeek-V3 at TP1: 128 heads, latent 512 + 64, one split and several."""
    monkeypatch.setattr(mla_decode, "_capability", lambda device: (9, 0))
    torch.manual_seed(128)
    lens, block_size, dc, dr = [90, 33], 64, 512, 64
    cache = _strided_cache(5, block_size, dc, dr, torch.float16)
    tables = _tables(cache, lens, torch.float16)
    q_nope = torch.randn(2, 128, dc).half()
    q_pe = torch.randn(2, 128, dr).half()
    one = _check(q_nope, q_pe, cache, tables, lens, (dc + dr) ** -0.5, splits=1)
    two = _check(q_nope, q_pe, cache, tables, lens, (dc + dr) ** -0.5, splits=2)
    assert (one.float() - two.float()).abs().max() <= TOL[torch.float16]


@pytest.mark.parametrize("config", range(len(mla_decode._CONFIGS)))
@pytest.mark.parametrize("block_size", [16, 64, 48, 80, 7])
def test_mla_decode_block_sizes(block_size, config, monkeypatch):
    """Page walk: tiles of every config over pages that are not a power of two (48, 80: 16-token
    segments, several per tile) or odd (7: one token per segment), with splits that start
    inside a page."""
    monkeypatch.setenv("HYBRIDKV_INTERPRET_CONFIG", str(config))
    torch.manual_seed(block_size + config)
    lens, dc, dr = [200, 3, 129], 32, 16
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 2
    cache = _strided_cache(num_blocks, block_size, dc, dr, torch.float32)
    tables = _tables(cache, lens, torch.float32)
    # 12 heads (BLOCK_H 16): the 64-token config is kept only up to 16 heads
    q_nope, q_pe = torch.randn(3, 12, dc), torch.randn(3, 12, dr)
    _check(q_nope, q_pe, cache, tables, lens, 0.2, splits=3)


def _fp8_case(fp8, block_size=16, lens=(37, 70)):
    """An fp8 cache of random bytes (every finite value, subnormals included) in NaN pages."""
    torch.manual_seed(7)
    dc, dr = 32, 16
    cache = torch.full((12, block_size, 1, dc + dr), float("nan")).to(fp8)
    tables = _tables(cache, list(lens), fp8)  # allocates the pages
    pos_rows = [
        (tables[b, torch.arange(n) // block_size].long(), torch.arange(n) % block_size)
        for b, n in enumerate(lens)
    ]
    for rows, offs in pos_rows:
        bits = torch.randint(0, 256, (len(rows), 1, dc + dr), dtype=torch.uint8)
        nan = 0x7F if fp8 == torch.float8_e4m3fn else 0x7C
        bits = torch.where((bits & 0x7F) >= nan, bits & 0x80 | 0x3C, bits)  # no NaN / inf
        cache.view(torch.uint8)[rows, offs] = bits
    q_nope, q_pe = torch.randn(len(lens), 16, dc), torch.randn(len(lens), 16, dr)
    return q_nope.half(), q_pe.half(), cache, tables, list(lens)


@pytest.mark.parametrize("splits", [1, 2])
def test_mla_decode_e4m3_software_decode(splits, monkeypatch):
    """sm_80 has no e4m3 conversion: the kernel decodes the bytes itself. Software, hardware
    and the torch reference agree."""
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        pytest.skip("no float8_e4m3fn in this torch")
    q_nope, q_pe, cache, tables, lens = _fp8_case(fp8)
    k_scale = torch.tensor(1 / 448)  # latents within [-1, 1]: fp16 outputs are exact to 1e-3
    monkeypatch.setattr(mla_decode, "_fp8e4_in_hardware", lambda device: False)
    soft = _check(q_nope, q_pe, cache, tables, lens, 0.5, splits=splits, k_scale=k_scale)
    monkeypatch.setattr(mla_decode, "_fp8e4_in_hardware", lambda device: True)
    hard = _check(q_nope, q_pe, cache, tables, lens, 0.5, splits=splits, k_scale=k_scale)
    assert (soft.float() - hard.float()).abs().max() <= 1e-3


def test_mla_decode_e5m2_cache():
    fp8 = getattr(torch, "float8_e5m2", None)
    if fp8 is None:
        pytest.skip("no float8_e5m2 in this torch")
    q_nope, q_pe, cache, tables, lens = _fp8_case(fp8, block_size=48)
    _check(q_nope, q_pe, cache, tables, lens, 0.5, splits=2, k_scale=torch.tensor(1 / 57344))


def _validation_case():
    cache = _strided_cache(6, 16, 32, 16, torch.float32)
    lens = [40, 17]
    tables = _tables(cache, lens, torch.float32)  # columns past a request's blocks: 10**6
    q_nope, q_pe = torch.randn(2, 4, 32), torch.randn(2, 4, 16)
    return q_nope, q_pe, cache, tables, lens


@pytest.mark.parametrize("bad_id", [6, -1], ids=["num_blocks", "minus-one"])
def test_validate_rejects_block_ids(bad_id, monkeypatch):
    q_nope, q_pe, cache, tables, lens = _validation_case()
    _check(q_nope, q_pe, cache, tables, lens, 0.2, validate=True)  # garbage past the end: fine
    tables[1, 1] = bad_id
    seq = torch.tensor(lens, dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"block_tables\[1, 1\] = {bad_id} is outside \[0, 6\)"):
        mla_decode_attention(q_nope, q_pe, cache, tables, seq, 0.2, validate=True)
    monkeypatch.setenv("HYBRIDKV_VALIDATE", "1")
    with pytest.raises(ValueError, match="block_tables"):
        mla_decode_attention(q_nope, q_pe, cache, tables, seq, 0.2, max_seq_len=40)


def test_validate_rejects_short_max_seq_len():
    q_nope, q_pe, cache, tables, lens = _validation_case()
    seq = torch.tensor(lens, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 40 exceeds max_seq_len = 39"):
        mla_decode_attention(q_nope, q_pe, cache, tables, seq, 0.2, max_seq_len=39, validate=True)
    _check(q_nope, q_pe, cache, tables, lens, 0.2, max_seq_len=40, validate=True)


@pytest.mark.parametrize("splits", [0, -2])
def test_num_splits_must_be_positive(splits):
    """Checked on the host, validate or not."""
    q_nope, q_pe, cache, tables, lens = _validation_case()
    seq = torch.tensor(lens, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"num_splits must be >= 1.*got {splits}"):
        mla_decode_attention(q_nope, q_pe, cache, tables, seq, 0.2, num_splits=splits)


def test_every_config_fits_the_gpus():
    """The pruning model keeps at least one config for every realistic launch (latent 512 + 64;
    the compile check verifies each kept one with ptxas)."""
    for capability in [(8, 0), (9, 0)]:
        for heads in [1, 16, 32, 64, 128]:
            for cache_bytes, fp8 in [(2, False), (1, True)]:
                fits = dict(
                    block_h=mla_decode.heads_per_program(heads, capability, fp8),
                    block_dc=512,
                    block_dr=64,
                    q_bytes=2,
                    cache_bytes=cache_bytes,
                    fp8=fp8,
                    capability=capability,
                )
                kept = [c for c in mla_decode._CONFIGS if mla_decode._config_fits(c, **fits)]
                assert kept, fits


def test_prune_drops_what_does_not_fit(monkeypatch):
    """A launch's args decide: 64-token fp16 tiles need 164 KiB of shared memory at 16 heads,
    more than an A100 has, and spill at 32 heads; 64 heads fit only 16-token tiles with wgmma
    (sm_90)."""
    meta = dict(device="meta")
    args = dict(
        q_nope_ptr=torch.empty(1, 32, 512, dtype=torch.float16, **meta),
        cache_ptr=torch.empty(4, 64, 576, dtype=torch.float16, **meta),
        BLOCK_H=32,
        BLOCK_DC=512,
        BLOCK_DR=64,
        FP8=0,
    )
    kept = mla_decode._prune(mla_decode._CONFIGS, args)
    assert [c.kwargs["BLOCK_N"] for c in kept] == [16, 16, 32]  # the interpreter is an sm_80
    assert len(mla_decode._prune(mla_decode._CONFIGS, {**args, "BLOCK_H": 16})) == 3
    monkeypatch.setattr(mla_decode, "_capability", lambda device: (9, 0))
    assert mla_decode._prune(mla_decode._CONFIGS, {**args, "BLOCK_H": 16}) == mla_decode._CONFIGS
    assert len(mla_decode._prune(mla_decode._CONFIGS, args)) == 3
    kept = mla_decode._prune(mla_decode._CONFIGS, {**args, "BLOCK_H": 64})
    assert {(c.kwargs["BLOCK_N"], c.num_warps) for c in kept} == {(16, 8)}
