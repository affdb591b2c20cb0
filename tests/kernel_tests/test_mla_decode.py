"""MLA latent-cache decode against the torch reference: synthetic strided caches, head counts
from one to DeepSeek's 128, block sizes that are not powers of two, fp8 (with the software e4m3
decode of GPUs before sm_89), input validation, the real plan views of Kimi-Linear (MLA + KDA)
in every layout, every config of ``CONFIGS``, the plan / run API and the default table; the
sparse (top-k token-index list) walk against the reference, unlisted tokens poisoned."""

from __future__ import annotations

import math

import pytest
import torch

from hybridkv import models
from hybridkv.layouts import LAYOUTS, make_plan
from hybridkv_kernels import mla_decode
from hybridkv_kernels.mla_decode import (
    CONFIGS,
    MlaConfig,
    MlaShape,
    mla_decode_attention,
    mla_decode_attention_ref,
    plan_mla_decode,
)

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


def _check(
    q_nope, q_pe, cache, tables, lens, scale, splits=None, k_scale=None, token_indices=None,
    **kwargs,
):  # fmt: skip
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
        token_indices=token_indices,
        **kwargs,
    )
    assert got is out
    want = mla_decode_attention_ref(
        q_nope, q_pe, cache, tables, seq_lens, scale, k_scale, token_indices=token_indices
    )
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
    with pytest.raises(ValueError, match="fp16/bf16/fp32"):
        mla_decode_attention(q_nope.double(), q_pe.double(), cache.double(), tables, one, 1.0)
    with pytest.raises(ValueError, match="needs k_scale"):
        mla_decode_attention(q_nope, q_pe, cache.to(torch.float8_e4m3fn), tables, one, 1.0)


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


@pytest.mark.parametrize(
    "heads, per_program, splits",
    [(32, 64, 1), (32, 64, 3), (20, 64, 2), (16, 32, 1), (128, 16, 2)],
)
def test_heads_per_program_override(heads, per_program, splits, monkeypatch):
    """``heads_per_program`` pads a program's rows (Kimi-Linear's 32 heads to the 64 rows of a
    Hopper warpgroup) or splits a request's heads over more programs; either way the output
    equals the reference and padding rows are never stored (the output starts as NaN)."""
    monkeypatch.setattr(mla_decode, "_capability", lambda device: (9, 0))
    torch.manual_seed(heads + per_program)
    lens, block_size, dc, dr = [70, 5, 33], 16, 64, 16
    cache = _strided_cache(14, block_size, dc, dr, torch.float16)
    tables = _tables(cache, lens, torch.float16)
    q_nope = torch.randn(3, heads, dc).half()
    q_pe = torch.randn(3, heads, dr).half()
    plan = plan_mla_decode(
        tables, torch.tensor(lens, dtype=torch.int32), num_heads=heads, kv_lora_rank=dc,
        qk_rope_head_dim=dr, block_size=block_size, cache_dtype=torch.float16,
        q_dtype=torch.float16, scale=0.12, max_seq_len=max(lens), num_splits=splits,
        heads_per_program=per_program,
    )  # fmt: skip
    assert plan.shape.block_h == per_program
    assert plan.num_head_blocks == -(-heads // per_program)
    _check(q_nope, q_pe, cache, tables, lens, 0.12, splits=splits, heads_per_program=per_program)


@pytest.mark.parametrize(
    "capability, dtype, block_size, per_program",
    [
        ((8, 0), torch.float16, 16, 64),  # mma.sync keeps q in registers: 64 rows spill
        ((9, 0), torch.float8_e4m3fn, 16, 64),  # fp8 tiles are converted in registers
        ((9, 0), torch.float16, 8, 64),  # segments shorter than a tile
        ((9, 0), torch.float16, 16, 48),  # not a power of two
        ((9, 0), torch.float16, 16, 8),  # below tl.dot's 16 rows
    ],
)
def test_heads_per_program_refuses_what_does_not_compile(
    capability, dtype, block_size, per_program, monkeypatch
):
    monkeypatch.setattr(mla_decode, "_capability", lambda device: capability)
    tables = torch.zeros((1, 8), dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"heads_per_program={per_program} .*choose one of"):
        plan_mla_decode(
            tables, torch.tensor([40], dtype=torch.int32), num_heads=32, kv_lora_rank=64,
            qk_rope_head_dim=16, block_size=block_size, cache_dtype=dtype,
            q_dtype=torch.float16, scale=1.0, max_seq_len=40, heads_per_program=per_program,
        )  # fmt: skip


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


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("block_size", [16, 64, 48, 80, 7])
def test_mla_decode_block_sizes(block_size, config):
    """Page walk: tiles of every config over pages that are not a power of two (48, 80: 16-token
    segments, several per tile) or odd (7: one token per segment), with splits that start
    inside a page (float32)."""
    torch.manual_seed(block_size + config.block_n)
    lens, dc, dr = [200, 3, 129], 32, 16
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 2
    cache = _strided_cache(num_blocks, block_size, dc, dr, torch.float32)
    tables = _tables(cache, lens, torch.float32)
    q_nope, q_pe = torch.randn(3, 12, dc), torch.randn(3, 12, dr)
    _check(q_nope, q_pe, cache, tables, lens, 0.2, splits=3, config=config)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_every_config_matches_the_reference(config):
    """Whatever the table or an autotuner picks computes the same attention (fp16, 32 heads,
    latent 128 + 32 on 64-token pages): one split (the kernel normalises and writes the output)
    and three (partials and the reduce), with a request shorter than a tile and one that ends
    inside a tile."""
    torch.manual_seed(config.block_n * config.num_warps + config.num_stages)
    lens, dc, dr, block_size = [3, 150, 64], 128, 32, 64
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 2
    cache = _strided_cache(num_blocks, block_size, dc, dr, torch.float16)
    tables = _tables(cache, lens, torch.float16)
    q_nope = torch.randn(3, 32, dc).half()
    q_pe = torch.randn(3, 32, dr).half()
    for splits in (1, 3):
        _check(q_nope, q_pe, cache, tables, lens, (dc + dr) ** -0.5, splits, config=config)


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


# ---- the plan / run API -------------------------------------------------------------------------


def _plan_for(cache, tables, lens, q_nope, q_pe, **kw):
    return plan_mla_decode(
        tables, torch.tensor(lens, dtype=torch.int32), num_heads=q_nope.shape[1],
        kv_lora_rank=q_nope.shape[2], qk_rope_head_dim=q_pe.shape[2],
        block_size=cache.shape[1], cache_dtype=cache.dtype, q_dtype=q_nope.dtype, scale=0.25,
        max_seq_len=max(lens), **kw,
    )  # fmt: skip


def test_one_plan_serves_every_layer():
    """Two MLA layers packed in one page (layer 1's latent rows sit after layer 0's): one plan,
    one run each with its own queries, each against its own reference; the partial buffers
    are reused between the runs, and a 4-D ``[nb, bs, 1, D]`` view works as well."""
    lens, bs, dc, dr = [97, 3, 130], 16, 64, 16
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 4
    backing = _poisoned((num_blocks, bs, 2, dc + dr), torch.float16)
    layer0, layer1 = backing[:, :, 0], backing[:, :, 1:]  # [nb, bs, D] and [nb, bs, 1, D]
    tables = _tables(layer1, lens, torch.float16)
    for b, n in enumerate(lens):  # layer 0's latents of the same tokens
        pos = torch.arange(n)
        layer0[tables[b, pos // bs].long(), pos % bs] = torch.randn(n, dc + dr).half()
    seq = torch.tensor(lens, dtype=torch.int32)
    q_shape = torch.empty(3, 20, dc, dtype=torch.float16), torch.empty(3, 20, dr).half()
    plan = _plan_for(layer0, tables, lens, *q_shape, num_splits=2)
    assert plan.num_splits == 2 and plan.part_acc is not None
    for cache in (layer0, layer1):
        q_nope, q_pe = torch.randn(3, 20, dc).half(), torch.randn(3, 20, dr).half()
        out = _poisoned((3, 20, dc), torch.float16)
        assert plan.run(q_nope, q_pe, cache, out=out) is out
        want = mla_decode_attention_ref(q_nope, q_pe, cache, tables, seq, 0.25)
        assert (out.float() - want.float()).abs().max() <= TOL[torch.float16]


def test_run_rejects_what_the_plan_was_not_made_for():
    q_nope, q_pe, cache, tables, lens = _validation_case()
    plan = _plan_for(cache, tables, lens, q_nope, q_pe)
    with pytest.raises(ValueError, match=r"q_nope must be \[2, 4, 32\] torch.float32"):
        plan.run(q_nope.half(), q_pe, cache)
    with pytest.raises(ValueError, match=r"q_nope must be \[2, 4, 32\]"):
        plan.run(q_nope[:1], q_pe, cache)
    with pytest.raises(ValueError, match=r"q_pe must be \[2, 4, 16\]"):
        plan.run(q_nope, q_pe[:, :2], cache)
    with pytest.raises(ValueError, match=r"latent_cache must be \[num_blocks, 16, \(1,\) 48\]"):
        plan.run(q_nope, q_pe, cache[:, :8])
    with pytest.raises(ValueError, match=r"latent_cache must be"):
        plan.run(q_nope, q_pe, cache[:, :, :40])
    with pytest.raises(ValueError, match=r"latent_cache must be"):
        plan.run(q_nope, q_pe, cache.half())
    with pytest.raises(ValueError, match=r"latent_cache must be"):
        plan.run(q_nope, q_pe, torch.zeros(6, 16, 2, 48))
    with pytest.raises(ValueError, match="out must be"):
        plan.run(q_nope, q_pe, cache, out=torch.empty(2, 4, 31))
    cache8 = torch.zeros(cache.shape, dtype=torch.float8_e4m3fn)
    plan8 = _plan_for(cache8, tables, lens, q_nope, q_pe)
    with pytest.raises(ValueError, match="needs k_scale: a float32 tensor"):
        plan8.run(q_nope, q_pe, cache8, k_scale=torch.tensor(1.0, dtype=torch.float64))
    wide = torch.empty_strided((6, 16, 48), (2**30, 2**27, 1), device="meta")  # no storage
    with pytest.raises(ValueError, match="token stride 134217728 is too large"):
        plan.run(q_nope, q_pe, wide)


def test_plan_choices():
    """What the plan decides: a table config, one split (no partials, no second launch) when
    the batch fills the GPU, the splits choose_num_splits gives otherwise."""
    q_nope, q_pe, cache, tables, lens = _validation_case()
    plan = _plan_for(cache, tables, lens, q_nope, q_pe, num_splits=1)
    assert plan.config in CONFIGS and plan.config_source
    assert plan.num_splits == 1 and plan.part_acc is None
    plan = _plan_for(cache, tables, lens, q_nope, q_pe, config=CONFIGS[-1])
    assert plan.config == CONFIGS[-1] and plan.config_source == "given"
    with pytest.raises(ValueError, match="not one of CONFIGS"):
        _plan_for(cache, tables, lens, q_nope, q_pe, config=MlaConfig(8, 1, 1))
    with pytest.raises(ValueError, match="validate=True checks block ids: pass num_blocks"):
        _plan_for(cache, tables, lens, q_nope, q_pe, validate=True)
    with pytest.raises(ValueError, match="seq_lens is on"):
        plan_mla_decode(
            tables, torch.tensor(lens, device="meta"), num_heads=4, kv_lora_rank=32,
            qk_rope_head_dim=16, block_size=16, cache_dtype=torch.float32,
            q_dtype=torch.float32, scale=0.2, max_seq_len=40,
        )  # fmt: skip


def test_autotune_needs_a_gpu():
    """Under the interpreter autotuning is refused with a clear error, from the plan and from
    the one-call wrapper."""
    q_nope, q_pe, cache, tables, lens = _validation_case()
    with pytest.raises(ValueError, match="autotune=True needs a GPU"):
        _plan_for(cache, tables, lens, q_nope, q_pe, autotune=True)
    seq = torch.tensor(lens, dtype=torch.int32)
    with pytest.raises(ValueError, match="autotune=True needs a GPU"):
        mla_decode_attention(q_nope, q_pe, cache, tables, seq, 0.2, autotune=True)


def _kimi_plan(batch, ctx, capability, monkeypatch, dtype=torch.bfloat16, heads=32):
    monkeypatch.setattr(mla_decode, "_capability", lambda device: capability)
    tables = torch.zeros(batch, ctx // 64, dtype=torch.int32)
    return plan_mla_decode(
        tables, torch.full((batch,), ctx, dtype=torch.int32), num_heads=heads,
        kv_lora_rank=512, qk_rope_head_dim=64, block_size=64, cache_dtype=dtype,
        q_dtype=torch.bfloat16, scale=576**-0.5, max_seq_len=ctx,
    )  # fmt: skip


def test_split_count_at_the_measured_points(monkeypatch):
    """Kimi-Linear (32 heads, one program a request) on an H100/H200 (132 multiprocessors, the
    CPU's count): one wave of resident CTAs. The table's sm_90 config holds one CTA a
    multiprocessor: 132 // 8 = 16 splits at B=8 ctx 32k (the split count the H200 measured
    best there), 2 at B=64; on sm_80 32/4/2 holds two: 264 // 8 = 33 -> 32 splits of 1024
    tokens. Short contexts split less: a split's float32 partial may cost at most a quarter of
    the latent bytes it reads."""
    plan = _kimi_plan(8, 32768, (9, 0), monkeypatch)
    assert mla_decode.ctas_per_sm(plan.config, plan.shape) == 1
    assert plan.num_splits == 16 and plan.split_len == 2048
    assert _kimi_plan(64, 32768, (9, 0), monkeypatch).num_splits == 2
    assert _kimi_plan(256, 8192, (9, 0), monkeypatch).num_splits == 1
    plan = _kimi_plan(8, 32768, (8, 0), monkeypatch)
    assert mla_decode.ctas_per_sm(plan.config, plan.shape) == 2
    assert plan.num_splits == 32 and plan.split_len == 1024
    plan = _kimi_plan(8, 8192, (8, 0), monkeypatch)  # 8192 // 456 = 17: 17 splits of 512
    assert mla_decode.partial_tokens(plan.shape, 512, 64, 2) == 456
    assert plan.num_splits == 16 and plan.split_len == 512
    assert mla_decode.choose_num_splits(8, 1, 32768, 132, 1) == 16
    assert mla_decode.choose_num_splits(8, 1, 32768, 132, 2) == 33
    assert mla_decode.choose_num_splits(1, 1, 100, 132, 2) == 1
    assert mla_decode.choose_num_splits(1, 1, 10**6, 132, 2) == 64


def test_one_split_epilogue_only_where_it_compiles(monkeypatch):
    """One split normalises in the partial kernel and skips the reduce, except where that
    epilogue spilled in the compile check: then the plan keeps partials of one split and the
    reduce (32/4/2 at 32 heads on sm_80, and 32/4/3 beside it, though it compiled; 64 heads a
    program on sm_90)."""
    h100 = _kimi_plan(512, 512, (9, 0), monkeypatch)
    assert h100.num_splits == 1 and h100.config == MlaConfig(64, 8, 3)
    assert h100.part_acc is None and h100._constexprs["ONE_SPLIT"]
    a100 = _kimi_plan(512, 512, (8, 0), monkeypatch)
    assert a100.num_splits == 1 and a100.config == MlaConfig(32, 4, 2)
    assert a100.part_acc.shape == (512, 32, 1, 512) and not a100._constexprs["ONE_SPLIT"]
    deepseek = _kimi_plan(512, 512, (9, 0), monkeypatch, heads=128)
    assert deepseek.num_splits == 1 and deepseek.part_acc is not None
    for shape in (h100.shape, a100.shape):
        for config in CONFIGS:
            if mla_decode.config_fits(config, shape):
                at_the_edge = config.block_n == 32 and config.num_warps == 4  # 32/4/3: kept out
                assert mla_decode.one_split_fits(config, shape) != at_the_edge, (config, shape)


# ---- the default table --------------------------------------------------------------------------


def _shapes_matching(rule):
    """Every shape class a row can match at the latents the models use (512 + 64, DeepSeek
    and Kimi-Linear; 128 + 32 and 32 + 16, small test latents) with 16-bit queries, dense and
    sparse (whose page_align is 1)."""
    for arch in (80, 90):
        for block_h in (16, 32, 64):
            for dc, dr in ((512, 64), (128, 32), (32, 16)):
                for cache in ("16bit", "fp32", "fp8", "fp8-bytes"):
                    for page_align in (1, 2, 4, 8, 16, 32, 64):
                        for work in (1, 8, 64, 1024):
                            for sparse in (False, True) if page_align == 1 else (False,):
                                q_bytes = 4 if cache == "fp32" else 2
                                shape = MlaShape(
                                    arch, block_h, dc, dr, cache, q_bytes, page_align, work,
                                    4096, sparse,
                                )  # fmt: skip
                                if rule.matches(shape):
                                    yield shape


def _possible(shape):
    """A shape heads_per_program can produce: 64 heads a program only on sm_90 with 16-bit
    caches and 16-token segments (so never sparse)."""
    if shape.block_h == 64:
        return shape.arch >= 90 and shape.cache == "16bit" and shape.page_align >= 16
    return True


def test_table_rows_are_candidates_and_fit_what_they_match():
    """Every row's config is one autotuning would try, its source says where it comes from,
    and it fits every possible shape class the row can match at the models' 16-bit or fp8
    latents; wherever no row fits, choose_config still finds a fitting config."""
    for rule in mla_decode._TABLE:
        assert rule.config in CONFIGS, rule
        assert rule.source.startswith(("H200 sweep", "unmeasured:")), rule
        for shape in _shapes_matching(rule):
            if _possible(shape) and shape.cache != "fp32":
                assert mla_decode.config_fits(rule.config, shape), (rule.config, shape)
    for rule in mla_decode._TABLE:
        for shape in _shapes_matching(rule):
            if _possible(shape):
                config, _ = mla_decode.choose_config(shape)
                assert mla_decode.config_fits(config, shape), (config, shape)


def test_fits_follow_the_compile_check():
    """config_fits against what ``python -m paper.compile_kernels`` measured at latent 512 + 64
    (triton 3.9, ptxas for sm_80 / sm_90): at 32 heads, 4 warps spill with 64-token tiles
    (the H200's measured best, 64/4/2: 52 B on sm_80, 292 B on sm_90) and, on sm_90, with
    32-token ones (16 B); 8 warps do not. fp8 tiles converted in registers spill at 4 warps."""

    def fits(config, arch, block_h=32, cache="16bit", page_align=64):
        shape = MlaShape(arch, block_h, 512, 64, cache, 2, page_align, 8, 32768)
        return mla_decode.config_fits(config, shape)

    c = MlaConfig
    for arch in (80, 90):
        assert not fits(c(64, 4, 2), arch)
        assert fits(c(64, 8, 2), arch)
        assert fits(c(16, 8, 3), arch)
        assert not fits(c(32, 4, 2), arch, cache="fp8")
        assert fits(c(32, 8, 2), arch, cache="fp8")
    assert fits(c(32, 4, 2), 80) and not fits(c(32, 4, 2), 90)
    assert not fits(c(64, 8, 2), 90, block_h=64)  # only 16-token tiles beside 64 heads
    assert fits(c(16, 8, 3), 90, block_h=64)
    for arch in (80, 90):  # 16 heads: 64-token tiles need 8 warps, and one page segment
        assert not fits(c(64, 4, 2), arch, block_h=16)
        assert fits(c(64, 8, 2), arch, block_h=16)
        assert not fits(c(64, 8, 2), arch, block_h=16, page_align=16)
        assert fits(c(32, 4, 2), arch, block_h=16, page_align=16)


def test_measured_rows_pick_the_configs_they_name(monkeypatch):
    """Kimi-Linear at 32 heads: sm_90 takes the nearest config to the H200's measured best
    (64/4/2, which spills) that compiles without spills, 64/8/3; sm_80 32/4/2 (two CTAs on an
    A100); fp8 caches 32/8/2; DeepSeek's 64 heads a program on sm_90 16/8/3; 16 heads (TP2)
    32/4/3 on sm_90, 32/4/2 on sm_80."""
    assert _kimi_plan(8, 32768, (9, 0), monkeypatch).config == MlaConfig(64, 8, 3)
    assert _kimi_plan(64, 32768, (8, 0), monkeypatch).config == MlaConfig(32, 4, 2)
    fp8 = _kimi_plan(8, 32768, (9, 0), monkeypatch, dtype=torch.float8_e4m3fn)
    assert fp8.config == MlaConfig(32, 8, 2)
    deepseek = _kimi_plan(8, 32768, (9, 0), monkeypatch, heads=128)
    assert deepseek.shape.block_h == 64 and deepseek.config == MlaConfig(16, 8, 3)
    assert _kimi_plan(8, 32768, (9, 0), monkeypatch, heads=16).config == MlaConfig(32, 4, 3)
    assert _kimi_plan(8, 32768, (8, 0), monkeypatch, heads=16).config == MlaConfig(32, 4, 2)


def test_autotune_prune_keeps_what_fits(monkeypatch):
    """Autotuning's candidates are the configs that fit the launch (read from its arguments
    as the autotuner passes them)."""
    meta = dict(device="meta")
    args = dict(
        q_nope_ptr=torch.empty(1, 32, 512, dtype=torch.bfloat16, **meta),
        cache_ptr=torch.empty(4, 64, 576, dtype=torch.bfloat16, **meta),
        BLOCK_H=32, BLOCK_DC=512, BLOCK_DR=64, DIM_R=64, PAGE_ALIGN=64, FP8=0, tune_work=8,
        tune_context=32768,
    )  # fmt: skip
    configs = [
        mla_decode.triton.Config({"BLOCK_N": c.block_n}, num_warps=c.num_warps,
                                 num_stages=c.num_stages)
        for c in CONFIGS
    ]  # fmt: skip
    for arch in ((8, 0), (9, 0)):
        monkeypatch.setattr(mla_decode, "_capability", lambda device, a=arch: a)
        shape = MlaShape(10 * arch[0], 32, 512, 64, "16bit", 2, 64, 8, 32768)
        kept = [mla_decode._config_of(c) for c in mla_decode._prune_for_autotune(configs, args)]
        assert kept == [c for c in CONFIGS if mla_decode.config_fits(c, shape)]
        assert MlaConfig(64, 4, 2) not in kept and MlaConfig(64, 8, 2) in kept


# ---- sparse: a token-index list (top-k) ---------------------------------------------------------


def _top_k(lens, k, seed=0, pad_inside=True):
    """A top-k-like list a request: distinct positions, each row's first and last token
    included, -1 padding (rows with fewer than k tokens, plus some slots in the middle when
    ``pad_inside``), shuffled as an indexer's top-k may come."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.full((len(lens), k), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        take = min(n, k - (k // 5 if pad_inside and n > 2 else 0))
        middle = torch.randperm(max(0, n - 2), generator=gen)[: max(0, take - 2)] + 1
        pos = torch.cat([torch.tensor([0, n - 1])[: min(n, 2)], middle]).int()
        slots = torch.randperm(k, generator=gen)[: len(pos)]
        idx[b, slots] = pos
    return idx


def _unlisted_to_nan(cache, tables, lens, idx):
    """Poison the latent rows of every cached token not in the list."""
    block_size = cache.shape[1]
    for b, n in enumerate(lens):
        listed = set(idx[b][idx[b] >= 0].tolist())
        pos = torch.tensor([p for p in range(n) if p not in listed], dtype=torch.long)
        if len(pos):
            cache[tables[b, pos // block_size].long(), pos % block_size] = float("nan")


@pytest.mark.parametrize(
    "lens, k, heads, dc, dr, block_size, dtype, splits",
    [
        pytest.param([200, 3, 129], 96, 12, 32, 16, 16, torch.float32, 3, id="fp32-split3"),
        pytest.param([200, 3, 129], 96, 12, 32, 16, 48, torch.float32, 1, id="fp32-bs48-nosplit"),
        pytest.param([150, 64, 1], 160, 20, 64, 16, 64, torch.float16, None, id="fp16-K>len"),
        pytest.param([257, 90], 200, 16, 128, 32, 64, torch.float16, 3, id="fp16-split3"),
        pytest.param([40, 7], 17, 4, 32, 8, 7, torch.float32, 2, id="odd-block-K17"),
    ],
)
def test_sparse_matches_the_reference(lens, k, heads, dc, dr, block_size, dtype, splits):
    """The index-list walk against the reference over exactly the listed tokens: shuffled,
    non-contiguous tables with garbage past each request's blocks, a NaN-slack strided cache,
    unequal -1 padding (inside rows as well as at their ends), first and last token listed, K
    not a multiple of a tile; then the unlisted tokens' rows are poisoned with NaN and the
    result does not change by a bit."""
    torch.manual_seed(sum(lens) + k)
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 3
    cache = _strided_cache(num_blocks, block_size, dc, dr, dtype)
    tables = _tables(cache, lens, dtype)
    idx = _top_k(lens, k, seed=k)
    q_nope = torch.randn(len(lens), heads, dc).to(dtype)
    q_pe = torch.randn(len(lens), heads, dr).to(dtype)
    scale = 1 / math.sqrt(dc + dr)
    got = _check(q_nope, q_pe, cache, tables, lens, scale, splits, token_indices=idx).clone()
    _unlisted_to_nan(cache, tables, lens, idx)
    again = _check(q_nope, q_pe, cache, tables, lens, scale, splits, token_indices=idx)
    assert torch.equal(got, again)


@pytest.mark.parametrize("splits", [1, 3])
def test_sparse_over_every_position_is_dense(splits):
    """Listing every position (reversed, or in order after 80 padding entries) attends to
    what the dense walk does; request 1's first tile is all padding (its softmax starts on
    a later tile), and with 3 splits its whole first split is (an empty partial)."""
    torch.manual_seed(splits)
    lens, block_size, dc, dr = [150, 70], 16, 32, 16
    cache = _strided_cache(16, block_size, dc, dr, torch.float32)
    tables = _tables(cache, lens, torch.float32)
    q_nope, q_pe = torch.randn(2, 16, dc), torch.randn(2, 16, dr)
    dense = _check(q_nope, q_pe, cache, tables, lens, 0.2, splits).clone()
    idx = torch.full((2, 150), -1, dtype=torch.int32)
    idx[0] = torch.arange(150).flip(0)
    idx[1, 80:] = torch.arange(70)
    sparse = _check(q_nope, q_pe, cache, tables, lens, 0.2, splits, token_indices=idx)
    assert (sparse - dense).abs().max() <= TOL[torch.float32]


def test_sparse_fp8_caches(monkeypatch):
    """fp8 tiles are prefetched a tile ahead by hand, gathered too: e4m3 decoded in hardware
    and in software (sm_80), one split and two."""
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        pytest.skip("no float8_e4m3fn in this torch")
    lens = (37, 100)  # 10 of the case's 11 pages
    q_nope, q_pe, cache, tables, lens = _fp8_case(fp8, lens=lens)
    idx = _top_k(lens, 90, seed=5)
    k_scale = torch.tensor(1 / 448)
    for hardware in (True, False):
        monkeypatch.setattr(mla_decode, "_fp8e4_in_hardware", lambda device, h=hardware: h)
        for splits in (1, 2):
            _check(q_nope, q_pe, cache, tables, lens, 0.5, splits, k_scale, token_indices=idx)


def test_sparse_int64_addressing():
    """Listed tokens in block 2, which starts at element 2**31 of a ~4 GiB buffer that is
    never touched."""
    block_size, dc, dr = 16, 16, 16
    stride = 2**30
    backing = torch.empty(2 * stride + block_size * (dc + dr), dtype=torch.float16)
    cache = torch.as_strided(backing, (3, block_size, dc + dr), (stride, dc + dr, 1))
    cache[0] = torch.randn(block_size, dc + dr).half()
    cache[2] = torch.randn(block_size, dc + dr).half()
    tables = torch.tensor([[2, 0]], dtype=torch.int32)
    idx = torch.tensor([[28, -1, 3, 15, 16, 0]], dtype=torch.int32)
    q_nope, q_pe = torch.randn(1, 16, dc).half(), torch.randn(1, 16, dr).half()
    _check(q_nope, q_pe, cache, tables, [29], 0.25, token_indices=idx)


def _sparse_plan(cache, tables, lens, idx, heads=4, **kw):
    return plan_mla_decode(
        tables, torch.tensor(lens, dtype=torch.int32), num_heads=heads,
        kv_lora_rank=cache.shape[-1] - 16, qk_rope_head_dim=16, block_size=cache.shape[1],
        cache_dtype=cache.dtype, q_dtype=torch.float32, scale=0.25, max_seq_len=max(lens),
        token_indices=idx, **kw,
    )  # fmt: skip


def test_sparse_plan_serves_layers_with_their_own_lists():
    """One sparse plan, two layers: one runs the planned list (layers sharing a top-k), the
    other its own list of the same K (each layer its own indexer, as DeepSeek-V3.2); each
    matches its reference."""
    q_nope, q_pe, cache, tables, lens = _validation_case()
    seq = torch.tensor(lens, dtype=torch.int32)
    mine, other = _top_k(lens, 24, seed=1), _top_k(lens, 24, seed=2)
    plan = _sparse_plan(cache, tables, lens, mine, num_splits=1)
    assert plan.num_indices == 24 and plan.token_indices is mine and plan.shape.sparse
    assert plan.shape.page_align == 1 and plan._constexprs["SPARSE"]
    for idx in (plan.token_indices, other):
        got = plan.run(q_nope, q_pe, cache, token_indices=idx)
        want = mla_decode_attention_ref(q_nope, q_pe, cache, tables, seq, 0.25, token_indices=idx)
        assert (got - want).abs().max() <= TOL[torch.float32]


def test_sparse_plan_splits_the_list():
    """Splits cover the K entries, not the context: DeepSeek-V3.2's top-2048 of a 128k
    context at batch 1 (32 heads a program) splits like a 2048-token dense context."""
    tables = torch.zeros(1, 2048, dtype=torch.int32)
    idx = torch.zeros(1, 2048, dtype=torch.int32)
    kw = dict(
        num_heads=32, kv_lora_rank=512, qk_rope_head_dim=64, block_size=64,
        cache_dtype=torch.bfloat16, q_dtype=torch.bfloat16, scale=0.05, max_seq_len=131072,
    )  # fmt: skip
    seq = torch.tensor([131072], dtype=torch.int32)
    sparse = plan_mla_decode(tables, seq, token_indices=idx, **kw)
    dense = plan_mla_decode(tables, seq, **kw)
    assert (
        sparse.num_splits * sparse.split_len >= 2048 > (sparse.num_splits - 1) * sparse.split_len
    )
    assert sparse.num_splits == mla_decode.choose_num_splits(
        1, 1, 2048, 132, mla_decode.ctas_per_sm(sparse.config, sparse.shape),
        mla_decode.partial_tokens(sparse.shape, 512, 64, 2),
    )  # fmt: skip
    assert dense.num_splits > sparse.num_splits and sparse.shape.context == 2048
    assert mla_decode.config_fits(sparse.config, sparse.shape)


def test_sparse_and_dense_plans_refuse_each_others_runs():
    q_nope, q_pe, cache, tables, lens = _validation_case()
    idx = _top_k(lens, 24)
    dense = _plan_for(cache, tables, lens, q_nope, q_pe)
    with pytest.raises(ValueError, match=r"made without token_indices.*plan_mla_decode"):
        dense.run(q_nope, q_pe, cache, token_indices=idx)
    sparse = _sparse_plan(cache, tables, lens, idx)
    with pytest.raises(ValueError, match=r"sparse \(planned with token_indices, K = 24\)"):
        sparse.run(q_nope, q_pe, cache)
    with pytest.raises(ValueError, match=r"K = 23 entries.*made for K = 24"):
        sparse.run(q_nope, q_pe, cache, token_indices=idx[:, :23].contiguous())
    with pytest.raises(ValueError, match=r"int32 \[B, K\]"):
        sparse.run(q_nope, q_pe, cache, token_indices=idx.long())
    with pytest.raises(ValueError, match="rows must be contiguous"):
        sparse.run(q_nope, q_pe, cache, token_indices=idx.t().contiguous().t())


def test_sparse_shape_and_dtype_errors():
    q_nope, q_pe, cache, tables, lens = _validation_case()
    seq = torch.tensor(lens, dtype=torch.int32)
    idx = _top_k(lens, 24)
    for bad, match in (
        (idx.long(), "int32"),
        (idx[0], r"\[B, K\]"),
        (idx[:1], r"B = 2"),
        (idx[:, :0], r"K = 0"),
        (idx.to("meta"), "token_indices is on meta"),
    ):
        with pytest.raises(ValueError, match=match):
            mla_decode_attention(q_nope, q_pe, cache, tables, seq, 0.2, token_indices=bad)


@pytest.mark.parametrize(
    "entry, match",
    [
        (40, r"token_indices\[0, 3\] = 40 is outside \[0, 40\)"),
        (-2, r"token_indices\[0, 3\] = -2 is outside"),
        (5, "lists position 5 more than once"),
    ],
)
def test_validate_rejects_bad_indices(entry, match, monkeypatch):
    q_nope, q_pe, cache, tables, lens = _validation_case()
    seq = torch.tensor(lens, dtype=torch.int32)
    idx = torch.tensor([[5, 0, 39, 7], [16, -1, 0, -1]], dtype=torch.int32)
    _check(q_nope, q_pe, cache, tables, lens, 0.2, token_indices=idx, validate=True)
    bad = idx.clone()
    bad[0, 3] = entry
    with pytest.raises(ValueError, match=match):
        mla_decode_attention(q_nope, q_pe, cache, tables, seq, 0.2, token_indices=bad,
                             validate=True)  # fmt: skip
    plan = _sparse_plan(cache, tables, lens, idx, validate=True, num_blocks=6)
    with pytest.raises(ValueError, match=match):  # each run's list too
        plan.run(q_nope, q_pe, cache, token_indices=bad)
    monkeypatch.setenv("HYBRIDKV_VALIDATE", "1")
    with pytest.raises(ValueError, match=match):
        mla_decode_attention(q_nope, q_pe, cache, tables, seq, 0.2, token_indices=bad)
    empty = idx.clone()
    empty[1] = -1
    with pytest.raises(ValueError, match=r"token_indices\[1\] lists no token"):
        mla_decode_attention(q_nope, q_pe, cache, tables, seq, 0.2, token_indices=empty)


def test_sparse_fits_follow_the_compile_check():
    """config_fits for the sparse walk against ``python -m paper.compile_kernels`` (k = 2048,
    latent 512 + 64, every config forced): at 32 heads 4 warps spill except with 16-token
    tiles, 8 warps never do; at 16 heads only 64-token tiles at 4 warps spill; 64/8/3's
    188 KB of shared memory fit sm_90 only."""

    def fits(config, arch, block_h=32, cache="16bit"):
        shape = MlaShape(arch, block_h, 512, 64, cache, 2, 1, 8, 2048, sparse=True)
        return mla_decode.config_fits(config, shape)

    c = MlaConfig
    for arch in (80, 90):
        for config in (c(64, 8, 2), c(32, 8, 2), c(16, 8, 3), c(16, 4, 3)):
            assert fits(config, arch), (config, arch)
        for config in (c(32, 4, 2), c(32, 4, 3), c(64, 4, 2)):
            assert not fits(config, arch), (config, arch)
        assert fits(c(32, 4, 2), arch, block_h=16) and fits(c(64, 8, 2), arch, block_h=16)
        assert not fits(c(64, 4, 2), arch, block_h=16)
        assert fits(c(32, 8, 2), arch, cache="fp8") and not fits(c(64, 8, 2), arch, cache="fp8")
    assert fits(c(64, 8, 3), 90) and not fits(c(64, 8, 3), 80)


def _sparse_kimi_plan(capability, monkeypatch, heads=32, dtype=torch.bfloat16, batch=8):
    monkeypatch.setattr(mla_decode, "_capability", lambda device: capability)
    ctx = 32768
    return plan_mla_decode(
        torch.zeros(batch, ctx // 64, dtype=torch.int32), torch.full((batch,), ctx).int(),
        num_heads=heads, kv_lora_rank=512, qk_rope_head_dim=64, block_size=64,
        cache_dtype=dtype, q_dtype=torch.bfloat16, scale=576**-0.5, max_seq_len=ctx,
        token_indices=torch.zeros(batch, 2048, dtype=torch.int32),
    )  # fmt: skip


def test_sparse_rows_pick_the_configs_they_name(monkeypatch):
    """Sparse plans at latent 512 + 64: sm_90 64/8/3 and sm_80 64/8/2 at 32 heads, 32/4/2 at
    16, the fp8 row's 32/8/2; DeepSeek-V3.2's 128 heads take 32 a program (beside 64
    heads' accumulator the gather spills: 16/8/3, 52 B on sm_90)."""
    assert _sparse_kimi_plan((9, 0), monkeypatch).config == MlaConfig(64, 8, 3)
    assert _sparse_kimi_plan((8, 0), monkeypatch).config == MlaConfig(64, 8, 2)
    for arch in ((8, 0), (9, 0)):
        assert _sparse_kimi_plan(arch, monkeypatch, heads=16).config == MlaConfig(32, 4, 2)
        fp8 = _sparse_kimi_plan(arch, monkeypatch, dtype=torch.float8_e4m3fn)
        assert fp8.config == MlaConfig(32, 8, 2)
    deepseek = _sparse_kimi_plan((9, 0), monkeypatch, heads=128)
    assert deepseek.shape.block_h == 32 and deepseek.config == MlaConfig(64, 8, 3)
    for plan in (deepseek, _sparse_kimi_plan((8, 0), monkeypatch)):
        assert plan.config_source.startswith("unmeasured: the sparse walk")
    # one split normalises in the partial kernel (the epilogue compiled without spills for
    # every sparse config that fits)
    for arch in ((8, 0), (9, 0)):
        full = _sparse_kimi_plan(arch, monkeypatch, batch=512)
        assert full.num_splits == 1 and full._constexprs["ONE_SPLIT"] and full.part_acc is None


@pytest.mark.parametrize(
    "lens, k, dtype, splits",
    [
        pytest.param([70, 5, 129], None, torch.float32, None, id="dense-fp32"),
        pytest.param([300, 64], None, torch.float16, 3, id="dense-fp16-split3"),
        pytest.param([200, 3, 129], 40, torch.float32, 2, id="sparse-fp32-split2"),
        pytest.param([150, 64, 1], 96, torch.float16, 1, id="sparse-fp16"),
    ],
)
def test_nope_mla_without_a_rope_part(lens, k, dtype, splits):
    """A NoPE MLA (GLM-5-Next's: ``qk_rope_head_dim`` 0) caches the latent alone and has no
    ``q_pe``: dense and sparse walks match the reference over a NaN-slack strided cache whose
    rows are exactly ``Dc`` wide, with a ``[B, H, 0]`` q_pe."""
    torch.manual_seed(sum(lens) + (k or 0))
    heads, dc, block_size = 12, 32, 16
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 3
    cache = _strided_cache(num_blocks, block_size, dc, 0, dtype)
    tables = _tables(cache, lens, dtype)
    idx = None if k is None else _top_k(lens, k, seed=k)
    q_nope = torch.randn(len(lens), heads, dc).to(dtype)
    q_pe = torch.empty(len(lens), heads, 0, dtype=dtype)
    _check(q_nope, q_pe, cache, tables, lens, 1 / math.sqrt(dc), splits, token_indices=idx)


@pytest.mark.parametrize("splits", [1, 2])
def test_nope_mla_e4m3_software_decode(splits, monkeypatch):
    """The NoPE walk over an e4m3 cache, decoded in software (sm_80) and in hardware."""
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        pytest.skip("no float8_e4m3fn in this torch")
    torch.manual_seed(splits)
    lens, dc = [90, 17], 64
    cache = _strided_cache(sum(math.ceil(n / 16) for n in lens) + 2, 16, dc, 0, torch.float32)
    tables = _tables(cache, lens, torch.float32)
    cache = cache.clamp(-1, 1).to(fp8)
    q_nope = torch.randn(len(lens), 16, dc).half()
    q_pe = torch.empty(len(lens), 16, 0, dtype=torch.float16)
    k_scale = torch.tensor(1 / 448)
    got = []
    for hardware in (False, True):
        monkeypatch.setattr(mla_decode, "_fp8e4_in_hardware", lambda device, hw=hardware: hw)
        got.append(_check(q_nope, q_pe, cache, tables, lens, 0.5, splits=splits, k_scale=k_scale))
    assert (got[0].float() - got[1].float()).abs().max() <= 1e-3


def test_nope_mla_on_sm80_keeps_clear_of_the_spilling_tile():
    """GLM-5-Next's NoPE MLA (no rope part) at 32 heads a program on sm_80: 32-token tiles at
    4 warps spill there (the compile check: 48 B at 2 stages, 4 B at 3), where the same tiles
    with Kimi-Linear's 64-wide rope part do not; the table then picks 64-token tiles at 8
    warps (199 registers, no spills)."""
    from hybridkv_kernels.mla_decode import MlaConfig, MlaShape, choose_config, config_fits

    rope = MlaShape(80, 32, 512, 64, "16bit", 2, 64, 8, 32768)
    nope = MlaShape(80, 32, 512, 16, "16bit", 2, 64, 8, 32768, rope=False)
    assert config_fits(MlaConfig(32, 4, 2), rope)
    assert not config_fits(MlaConfig(32, 4, 2), nope)
    assert not config_fits(MlaConfig(32, 4, 3), nope)
    assert choose_config(rope)[0] == MlaConfig(32, 4, 2)
    assert choose_config(nope)[0] == MlaConfig(64, 8, 2)
