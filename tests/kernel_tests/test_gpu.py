"""GPU-only checks: bf16 attention (the interpreter's bf16 ``tl.dot`` is unreliable), fp8 on
hardware, the fp8 saturation contract against the GPU's own conversions, the direct launcher and
CUDA-graph capture of every ``plan.run``. Run on a GPU with
``HYBRIDKV_TEST_GPU=1 pytest -m gpu tests/kernel_tests`` (the variable keeps ``tests/conftest.py``
from switching the interpreter on); ``python -m paper.gpu_suite`` runs them first.

Inputs are fresh random values every run; outputs are NaN-poisoned before each launch; caches
hold NaN wherever no request owns the bytes."""

from __future__ import annotations

import math

import pytest
import torch

from hybridkv_kernels import paged_decode as pd
from hybridkv_kernels.paged_decode import paged_decode_attention, paged_decode_attention_ref
from hybridkv_kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_ref

from .paged import SYNTHETIC, synthetic_caches
from .test_paged_decode import _fill

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: bf16 has 8 mantissa bits: attention outputs agree to a few bf16 ulps of their scale
BF16_TOL = 2e-2


def _on_gpu(backing, *views):
    on_gpu = backing.cuda()
    return [torch.as_strided(on_gpu, v.shape, v.stride(), v.storage_offset()) for v in views]


def _nan(*shape, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = BF16_TOL) -> None:
    """Within ``tol`` relative to the output's scale (a bf16 ulp grows with the value: the
    synthetic caches' long-context outputs reach ~3, where one ulp is 0.016)."""
    assert not got.isnan().any(), "an output the kernel should have written is NaN"
    err = (got.float() - want.float()).abs().max().item()
    scale = max(1.0, want.float().abs().max().item())
    assert err < tol * scale, (err, scale)


def _paged_on_gpu(layout: str, lens: list[int], bs: int, hkv: int, d: int, dtype=torch.bfloat16):
    """K/V caches in ``layout`` holding ``lens`` tokens of fresh random values (NaN where no
    request owns the bytes), on the GPU with their block tables and lengths:
    ``k_cache, v_cache, tables [B, max_blocks] int32, seq_lens [B] int32``."""
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 4
    backing, k_cache, v_cache = synthetic_caches(layout, num_blocks, bs, hkv, d, d, dtype)
    tables = _fill(k_cache, v_cache, lens, dtype)
    k_cache, v_cache = _on_gpu(backing, k_cache, v_cache)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, tables.cuda(), seq


# and vLLM 0.33's [tokens, heads, K | V] page (a plan in vLLM's cache formats), bf16 on a GPU
@pytest.mark.parametrize("layout", [*SYNTHETIC, "kv-interleaved"])
@pytest.mark.parametrize("lens", [[1, 300, 4097], [8192]], ids=["mixed", "long"])
def test_bf16_decode_and_prefill(layout, lens):
    dtype, hq, hkv, d, bs = torch.bfloat16, 16, 2, 128, 16
    k_cache, v_cache, tables, seq = _paged_on_gpu(layout, lens, bs, hkv, d, dtype)
    q = torch.randn(len(lens), hq, d, device="cuda", dtype=dtype)
    out = _nan(len(lens), hq, d)
    got = paged_decode_attention(q, k_cache, v_cache, tables, seq, d**-0.5, out=out)
    _close(got, paged_decode_attention_ref(q, k_cache, v_cache, tables, seq, d**-0.5))
    cu = torch.tensor([0, *torch.tensor([min(n, 64) for n in lens]).cumsum(0).tolist()])
    cu = cu.to(torch.int32).cuda()
    qp = torch.randn(int(cu[-1]), hq, d, device="cuda", dtype=dtype)
    out = _nan(int(cu[-1]), hq, d)
    got = paged_prefill_attention(qp, k_cache, v_cache, tables, cu, seq, d**-0.5, out=out)
    _close(got, paged_prefill_attention_ref(qp, k_cache, v_cache, tables, cu, seq, d**-0.5))


# the page sizes the zoo's plans produce, at the head dims and GQA of the models they come from
PAGE_CASES = [
    pytest.param(bs, hq, hkv, d, id=f"bs{bs}-gqa{hq // hkv}-d{d}")
    for bs, hq, hkv, d in [
        (16, 16, 2, 256), (64, 16, 2, 256), (192, 16, 2, 256), (576, 16, 2, 256),
        (16, 32, 8, 128), (272, 32, 8, 128), (528, 32, 8, 128), (1040, 32, 8, 128),
        (16, 8, 8, 128), (16, 32, 2, 128),
    ]
]  # fmt: skip


@pytest.mark.parametrize("bs, hq, hkv, d", PAGE_CASES)
@pytest.mark.parametrize("lens", [[8200, 5, 3000], [1, 17000]], ids=["B3", "B2-long"])
def test_bf16_decode_on_every_page_size(bs, hq, hkv, d, lens):
    """The config the table picks for each page class, and the split counts the plan picks
    (one split at a batch that fills the GPU, many for one long request)."""
    k_cache, v_cache, tables, seq = _paged_on_gpu("classic", lens, bs, hkv, d)
    q = torch.randn(len(lens), hq, d, device="cuda", dtype=torch.bfloat16)
    plan = pd.plan_decode(
        tables, seq, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
        cache_dtype=torch.bfloat16, q_dtype=torch.bfloat16, scale=d**-0.5,
        max_seq_len=max(lens),
    )  # fmt: skip
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq, d**-0.5)
    for _ in range(2):  # the second launch takes the direct launcher
        out = _nan(len(lens), hq, d)
        _close(plan.run(q, k_cache, v_cache, out=out), want)


@pytest.mark.parametrize("config", pd.CONFIGS, ids=str)
def test_bf16_decode_every_config_that_fits(config):
    bs, hq, hkv, d, lens = 16, 16, 2, 256, [700, 33]
    k_cache, v_cache, tables, seq = _paged_on_gpu("classic", lens, bs, hkv, d)
    shape = pd.decode_shape(
        device=torch.device("cuda"), block_size=bs, group=hq // hkv, head_dim_k=d, head_dim_v=d,
        cache_dtype=torch.bfloat16, batch=2, num_kv_heads=hkv, max_seq_len=700,
    )  # fmt: skip
    if not pd.config_fits(config, shape):
        pytest.skip("the config does not fit this shape (it would spill)")
    q = torch.randn(2, hq, d, device="cuda", dtype=torch.bfloat16)
    out = _nan(2, hq, d)
    got = paged_decode_attention(
        q, k_cache, v_cache, tables, seq, d**-0.5, num_splits=3, out=out, config=config
    )
    _close(got, paged_decode_attention_ref(q, k_cache, v_cache, tables, seq, d**-0.5))


@pytest.mark.parametrize("software", [False, True], ids=["hw-convert", "byte-decode"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_decode(dtype, software, monkeypatch):
    """fp8 caches on the GPU, scales folded out of the tile: the hardware conversion and (e4m3)
    the byte decode an A100 runs, against the float32 reference."""
    if software and dtype != torch.float8_e4m3fn:
        pytest.skip("only e4m3 has a software decode")
    if software:
        monkeypatch.setattr(pd, "_fp8e4_in_hardware", lambda device: False)
    elif dtype == torch.float8_e4m3fn and not pd._fp8e4_in_hardware(torch.device("cuda")):
        pytest.skip("no hardware e4m3 on this GPU")
    bs, hq, hkv, d, lens = 16, 16, 2, 256, [3000, 17]
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 4
    k = torch.randn(num_blocks, bs, hkv, d, device="cuda").to(dtype)
    v = torch.randn(num_blocks, bs, hkv, d, device="cuda").to(dtype)
    need = [math.ceil(n / bs) for n in lens]
    ids = (torch.randperm(num_blocks - 1)[: sum(need)] + 1).int()
    tables = torch.zeros(2, need[0], dtype=torch.int32)  # columns past a request: never read
    tables[0], tables[1, : need[1]] = ids[: need[0]], ids[need[0] :]
    tables = tables.cuda()
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(2, hq, d, device="cuda", dtype=torch.bfloat16)
    ks = torch.tensor([0.37], device="cuda")
    vs = torch.tensor([1.9], device="cuda")
    out = _nan(2, hq, d)
    got = paged_decode_attention(q, k, v, tables, seq, d**-0.5, k_scale=ks, v_scale=vs, out=out)
    want = paged_decode_attention_ref(q, k, v, tables, seq, d**-0.5, k_scale=ks, v_scale=vs)
    _close(got, want, tol=2 * BF16_TOL * 1.9)  # the output is scaled by v_scale


@pytest.mark.parametrize("lens", [[1, 300, 4097], [16384]], ids=["mixed", "long"])
def test_bf16_mla_decode(lens):
    from hybridkv_kernels.mla_decode import mla_decode_attention, mla_decode_attention_ref

    from .test_mla_decode import _tables

    dtype, heads, dc, dr, bs = torch.bfloat16, 32, 512, 64, 64
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 4
    cache = torch.full((num_blocks, bs, 1, dc + dr), float("nan"), dtype=dtype)
    tables = _tables(cache, lens, dtype).cuda()
    cache = cache.cuda()
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q_nope = torch.randn(len(lens), heads, dc, device="cuda", dtype=dtype)
    q_pe = torch.randn(len(lens), heads, dr, device="cuda", dtype=dtype)
    scale = (dc + dr) ** -0.5
    out = _nan(len(lens), heads, dc)
    got = mla_decode_attention(q_nope, q_pe, cache, tables, seq, scale, out=out)
    _close(got, mla_decode_attention_ref(q_nope, q_pe, cache, tables, seq, scale))


@pytest.mark.parametrize("heads, splits", [(32, None), (128, 1)], ids=["kimi", "deepseek-1split"])
def test_bf16_mla_sparse_decode(heads, splits):
    """The top-k walk in bf16: k = 2048 of a 16k context and a short request padded with -1,
    first and last token listed, against the reference; then the unlisted tokens' rows are
    poisoned with NaN and the output does not change."""
    from hybridkv_kernels.mla_decode import mla_decode_attention, mla_decode_attention_ref

    from .test_mla_decode import _tables, _top_k, _unlisted_to_nan

    dtype, dc, dr, bs, lens = torch.bfloat16, 512, 64, 64, [16384, 300]
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 4
    cache = torch.full((num_blocks, bs, 1, dc + dr), float("nan"), dtype=dtype)
    tables = _tables(cache, lens, dtype)
    idx = _top_k(lens, 2048, seed=heads)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q_nope = torch.randn(len(lens), heads, dc, device="cuda", dtype=dtype)
    q_pe = torch.randn(len(lens), heads, dr, device="cuda", dtype=dtype)
    scale = (dc + dr) ** -0.5
    args = (tables.cuda(), seq, scale)
    out = _nan(len(lens), heads, dc)
    got = mla_decode_attention(
        q_nope, q_pe, cache.cuda(), *args, num_splits=splits, out=out,
        token_indices=idx.cuda(),
    ).clone()  # fmt: skip
    want = mla_decode_attention_ref(q_nope, q_pe, cache.cuda(), *args, token_indices=idx.cuda())
    _close(got, want)
    _unlisted_to_nan(cache, tables, lens, idx)
    again = mla_decode_attention(
        q_nope, q_pe, cache.cuda(), *args, num_splits=splits, token_indices=idx.cuda()
    )
    assert torch.equal(got, again)


@pytest.mark.parametrize("splits", [None, 1], ids=["auto-splits", "one-split"])
def test_bf16_sparse_gqa_decode(splits):
    """The GQA decode's token-list walk in bf16 (Qwen4-Exp's QSA pick: 2,048 + 63 entries of
    a 16k context, -1 padded, and a short request), against the reference; then the unlisted
    tokens' K and V are poisoned with NaN and the output does not change."""
    from .test_paged_decode_sparse import _pick, _poison_unlisted

    dtype, d, bs, lens, hq, hkv = torch.bfloat16, 128, 64, [16384, 300], 16, 2
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 4
    _, k_cache, v_cache = synthetic_caches("classic", num_blocks, bs, hkv, d, d, dtype)
    tables = _fill(k_cache, v_cache, lens, dtype)
    idx = _pick(lens, 2048 + 63, seed=splits or 0)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), hq, d, device="cuda", dtype=dtype)
    args = (tables.cuda(), seq, d**-0.5)
    out = _nan(len(lens), hq, d)
    got = paged_decode_attention(
        q, k_cache.cuda(), v_cache.cuda(), *args, num_splits=splits, out=out,
        token_indices=idx.cuda(),
    ).clone()  # fmt: skip
    want = paged_decode_attention_ref(
        q, k_cache.cuda(), v_cache.cuda(), *args, token_indices=idx.cuda()
    )
    _close(got, want)
    _poison_unlisted(k_cache, v_cache, tables, lens, idx)
    again = paged_decode_attention(
        q, k_cache.cuda(), v_cache.cuda(), *args, num_splits=splits, token_indices=idx.cuda()
    )
    assert torch.equal(got, again)


_FP8_CASES = [
    pytest.param(torch.float8_e4m3fn, False, id="e4m3-hw"),
    pytest.param(torch.float8_e4m3fn, True, id="e4m3-soft"),
    pytest.param(torch.float8_e5m2, False, id="e5m2"),
]


@pytest.mark.parametrize("dtype, soft", _FP8_CASES)
def test_fp8_write_follows_the_saturation_contract(dtype, soft, monkeypatch):
    """Every rounding boundary with its fp32 neighbours, values past the largest finite value
    (torch 2.11 gives NaN for e4m3 >= 464 and inf for e5m2 >= 61440), infinities, NaNs and
    random values, at two scales, on the GPU's conversions (and the software e4m3 encoder an
    A100 runs): the kernel's bytes equal ``write_kv_cache_ref`` (saturate to the largest
    finite value, NaN stays NaN) for every non-NaN input, NaN inputs give NaN (the hardware
    picks its own NaN code), bytes no token owns stay poisoned, and in range the bytes equal
    torch's own CUDA cast."""
    from hybridkv_kernels import cache_write

    from .test_cache_write import _e4m3_boundary_values, _e5m2_boundary_values

    if soft:
        monkeypatch.setattr(cache_write, "_fp8e4_in_hardware", lambda device: False)
    elif dtype == torch.float8_e4m3fn and not cache_write._fp8e4_in_hardware(torch.device("cuda")):
        pytest.skip("no hardware e4m3 on this GPU (the soft case covers it)")
    boundary = _e4m3_boundary_values() if dtype == torch.float8_e4m3fn else _e5m2_boundary_values()
    tokens, heads, d = -(-boundary.numel() // 128), 2, 64
    bs = 16
    num_blocks = -(-tokens // bs) + 2
    poison = 0x5A  # a finite byte in both formats that no input here maps to by chance
    caches = torch.full((2, num_blocks, bs, heads, d), poison, dtype=torch.uint8, device="cuda")
    k8, v8 = caches[0].view(dtype), caches[1].view(dtype)
    ref = caches.clone()
    kr, vr = ref[0].view(dtype), ref[1].view(dtype)
    key = torch.randn(tokens, heads, d, device="cuda") * 100
    key.view(-1)[: boundary.numel()] = boundary.cuda()
    value = torch.randn(tokens, heads, d, device="cuda")
    slots = (torch.randperm((num_blocks - 1) * bs, device="cuda")[:tokens] + bs).long()
    nan_in = key.isnan()
    for ks in (0.01, 1.0):
        ks, vs = torch.tensor(ks, device="cuda"), torch.tensor(0.013, device="cuda")
        cache_write.write_kv_cache(key, value, k8, v8, slots, ks, vs)
        cache_write.write_kv_cache_ref(key, value, kr, vr, slots, ks, vs)
        got = caches[0].view(-1, heads, d)[slots]
        want = ref[0].view(-1, heads, d)[slots]
        assert torch.equal(got[~nan_in], want[~nan_in])
        assert got[nan_in].view(dtype).float().isnan().all()
        assert torch.equal(caches[1], ref[1])
    assert (caches.view(2, -1, heads, d).sum(-1) != 0).any()  # something was written
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert (caches[0].view(-1, heads, d)[untouched] == poison).all()
    # in range, the same bytes as torch's own cast (scale 1: the last write)
    finite_max = 464.0 if dtype == torch.float8_e4m3fn else 61440.0
    in_range = key.abs() < finite_max
    torch_cast = key.to(dtype).view(torch.uint8)
    assert torch.equal(got[in_range], torch_cast[in_range])


def test_every_plan_run_captures_in_a_cuda_graph():
    """Every kernel's ``plan.run`` (and the direct launcher it takes after its first call)
    replays from a CUDA graph to the eager result."""
    from paper.bench_host import _cases, _graph_ok

    bad = [k for k, _wrapper, _plan, run, result in _cases(torch.device("cuda"))
           if not _graph_ok(run, result)]  # fmt: skip
    assert not bad, f"the graph's replay differs from eager: {bad}"


# ---- the prefill's Hopper path -----------------------------------------------------------------


def _hopper_configs() -> list:
    from hybridkv_kernels.paged_prefill import CONFIGS

    return [c for c in CONFIGS if c.hopper]


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.skipif(not _sm90(), reason="the Hopper path needs sm_90+")
@pytest.mark.parametrize("layout", SYNTHETIC)
@pytest.mark.parametrize(
    "bs, hq, hkv, d",
    [
        pytest.param(16, 16, 2, 256, id="bs16-gqa8-d256"),
        pytest.param(576, 16, 2, 256, id="bs576-gqa8-d256"),
        pytest.param(64, 32, 8, 128, id="bs64-gqa4-d128"),
    ],
)
def test_bf16_prefill_hopper_configs(layout, bs, hq, hkv, d):
    """Every Hopper config that fits the class, on every cache layout, bf16, twice (the second
    launch takes the direct launcher, TMA descriptors included): an extend after a long prefix
    beside fresh prompts."""
    from hybridkv_kernels.paged_prefill import config_fits, plan_prefill

    lens, q_lens = [3000, 700, 64], [500, 700, 64]
    k_cache, v_cache, tables, seq = _paged_on_gpu(layout, lens, bs, hkv, d)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
    q = torch.randn(int(cu[-1]), hq, d, device="cuda", dtype=torch.bfloat16)
    want = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, seq, d**-0.5)
    ran = 0
    for config in _hopper_configs():
        plan = plan_prefill(
            tables, cu, seq, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
            cache_dtype=torch.bfloat16, q_dtype=torch.bfloat16, scale=d**-0.5,
            total_q=int(cu[-1]), max_query_len=max(q_lens), max_seq_len=max(lens),
            config=config,
        )  # fmt: skip
        if not config_fits(config, plan.shape):
            continue
        for _ in range(2):
            out = _nan(int(cu[-1]), hq, d)
            _close(plan.run(q, k_cache, v_cache, out=out), want)
        ran += 1
    assert ran, "no Hopper config fits this class"


@pytest.mark.skipif(not _sm90(), reason="the Hopper path needs sm_90+")
@pytest.mark.parametrize("bs", [16, 64], ids=["bs16", "bs64-tma"])
def test_fp8_prefill_hopper_and_cuda_graph(bs):
    """An e4m3 cache on the Hopper path (TMA boxes of fp8 bytes on 64-token pages) against the
    reference, and the same plan's run replayed from a CUDA graph."""
    from hybridkv_kernels.paged_prefill import PrefillConfig, plan_prefill

    hq, hkv, d, lens, q_lens = 16, 2, 128, [900, 64], [300, 64]
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 4
    backing, k16, v16 = synthetic_caches("classic", num_blocks, bs, hkv, d, d, torch.float32)
    tables = _fill(k16, v16, lens, torch.float32)
    k32, v32 = _on_gpu(backing, k16, v16)
    k8, v8 = k32.to(torch.float8_e4m3fn), v32.to(torch.float8_e4m3fn)
    ks = torch.tensor([0.5], device="cuda")
    vs = torch.tensor([0.25], device="cuda")
    tables, seq = tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
    q = torch.randn(int(cu[-1]), hq, d, device="cuda", dtype=torch.bfloat16)
    plan = plan_prefill(
        tables, cu, seq, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
        cache_dtype=torch.float8_e4m3fn, q_dtype=torch.bfloat16, scale=d**-0.5,
        total_q=int(cu[-1]), config=PrefillConfig(128, 64, 8, 3, hopper=True),
    )  # fmt: skip
    want = paged_prefill_attention_ref(q, k8, v8, tables, cu, seq, d**-0.5, k_scale=ks, v_scale=vs)
    out = _nan(int(cu[-1]), hq, d)
    _close(plan.run(q, k8, v8, ks, vs, out=out), want)
    graph = torch.cuda.CUDAGraph()
    out.fill_(float("nan"))
    with torch.cuda.graph(graph):
        plan.run(q, k8, v8, ks, vs, out=out)
    q.copy_(torch.randn_like(q))  # fresh inputs after capture: the replay must use them
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = paged_prefill_attention_ref(q, k8, v8, tables, cu, seq, d**-0.5, k_scale=ks, v_scale=vs)
    _close(out, want)


@pytest.mark.parametrize("window", [None, 128], ids=["full", "window128"])
@pytest.mark.parametrize("splits", [1, 4], ids=["one-split", "four-splits"])
def test_bf16_attention_sinks(splits, window):
    """GPT-OSS / GraniteSWA's per-head sink logits in bf16 (the interpreter tests cover fp32 and
    fp16): decode with one split (added before normalising) and several (added in the reduce),
    prefill on the generic path and, on sm_90, every Hopper config that fits; sinks of both
    signs and one large enough to take most of a head's weight."""
    from hybridkv_kernels.paged_prefill import config_fits, plan_prefill

    bs, hq, hkv, d, lens, q_lens = 16, 64, 8, 64, [2000, 300, 17], [64, 300, 17]
    k_cache, v_cache, tables, seq = _paged_on_gpu("classic", lens, bs, hkv, d)
    sinks = torch.randn(hq, device="cuda") * 3
    sinks[0] = 12.0  # takes nearly all of head 0's weight
    common = dict(
        num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, cache_dtype=torch.bfloat16,
        q_dtype=torch.bfloat16, scale=d**-0.5, max_seq_len=max(lens), sliding_window=window,
        sinks=True,
    )  # fmt: skip
    q = torch.randn(len(lens), hq, d, device="cuda", dtype=torch.bfloat16)
    want = paged_decode_attention_ref(
        q, k_cache, v_cache, tables, seq, d**-0.5, sliding_window=window, sinks=sinks
    )
    plan = pd.plan_decode(tables, seq, num_splits=splits, **common)
    for _ in range(2):  # the second launch takes the direct launcher
        _close(plan.run(q, k_cache, v_cache, out=_nan(len(lens), hq, d), sinks=sinks), want)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
    qp = torch.randn(int(cu[-1]), hq, d, device="cuda", dtype=torch.bfloat16)
    want = paged_prefill_attention_ref(
        qp, k_cache, v_cache, tables, cu, seq, d**-0.5, sliding_window=window, sinks=sinks
    )
    configs = [None, *(_hopper_configs() if _sm90() else [])]
    ran = 0
    for config in configs:
        plan = plan_prefill(
            tables, cu, seq, total_q=int(cu[-1]), max_query_len=max(q_lens), config=config,
            **common,
        )  # fmt: skip
        if config is not None and not config_fits(config, plan.shape):
            continue
        out = _nan(int(cu[-1]), hq, d)
        _close(plan.run(qp, k_cache, v_cache, out=out, sinks=sinks), want)
        ran += 1
    assert ran >= 1


@pytest.mark.parametrize("window", [None, 512], ids=["full", "window512"])
@pytest.mark.parametrize("splits", [1, 4], ids=["one-split", "four-splits"])
def test_bf16_relative_bias(splits, window):
    """Inkling's relative-position bias in bf16 (the interpreter tests cover fp32 and fp16) at
    its default sizes (d_rel 16, rel_extent 1024, head dim 128, GQA 8, a 512-token window on its
    sliding layers): decode with one split and several, prefill (bias launches take the generic
    path); requests longer and shorter than the band, a prefill chunk starting mid-context; the
    bias moves the output beyond tolerance (a zeroed bank gives plain attention)."""
    bs, hq, hkv, d, rel_dim, extent = 16, 64, 8, 128, 16, 1024
    lens, q_lens = [3000, 700, 9], [64, 700, 9]
    k_cache, v_cache, tables, seq = _paged_on_gpu("classic", lens, bs, hkv, d)
    proj = (torch.randn(rel_dim, extent, device="cuda") / rel_dim**0.5).to(torch.bfloat16)
    q = torch.randn(len(lens), hq, d, device="cuda", dtype=torch.bfloat16)
    states = torch.randn(len(lens), hq, rel_dim, device="cuda", dtype=torch.bfloat16)
    kw = dict(rel_states=states, rel_proj=proj)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq, d**-0.5, window, **kw)
    plain = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq, d**-0.5, window)
    got = paged_decode_attention(
        q, k_cache, v_cache, tables, seq, d**-0.5, window, num_splits=splits,
        out=_nan(len(lens), hq, d), **kw,
    )  # fmt: skip
    _close(got, want)
    assert (got.float() - plain.float()).abs().max() > 10 * BF16_TOL
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
    qp = torch.randn(int(cu[-1]), hq, d, device="cuda", dtype=torch.bfloat16)
    kw = dict(rel_states=torch.randn(int(cu[-1]), hq, rel_dim, device="cuda").bfloat16(),
              rel_proj=proj)  # fmt: skip
    want = paged_prefill_attention_ref(
        qp, k_cache, v_cache, tables, cu, seq, d**-0.5, sliding_window=window, **kw
    )
    got = paged_prefill_attention(
        qp, k_cache, v_cache, tables, cu, seq, d**-0.5, sliding_window=window,
        out=_nan(int(cu[-1]), hq, d), **kw,
    )  # fmt: skip
    _close(got, want)
