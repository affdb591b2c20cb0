"""Qwen4-Exp's QSA pool scores (``plan_indexer_scores(pool="mean_norm_rope")``: each pool's key
is its tokens' raw keys averaged, RMS-normalised and rotated at the pool's first position)
against the torch reference ``mean_norm_rope_scores_ref``: fp32 and fp16 rows, pools
straddling pages, strided pages with NaN wherever no request owns the bytes, the rotation on
all, some or none of the dims, NaN-poisoned outputs, bad inputs refused. bf16 runs on a GPU
only (the interpreter's bf16 ``tl.dot`` is unreliable). Inputs are fresh random values every
run. The pick made from these scores is checked against transformers' own indexer in
``tests/test_e2e_qwen4.py``."""

from __future__ import annotations

import math

import pytest
import torch

from hybridkv_kernels.indexer_scores import mean_norm_rope_scores_ref, plan_indexer_scores

from .test_indexer import _close, _queries

_LENS = [70, 2, 41, 9]
_PICKS = [[1, 40, *range(62, 70)], [0, 1], [40], [5, 8]]


def _raw_rows(num_blocks, block_size, d, dtype, slack=0, device="cpu"):
    """NaN-filled pages ``[num_blocks, block_size, 1, d]`` of raw keys; with ``slack``, each
    row is followed by unused elements and pages are spaced out (a buffer packing layers)."""
    token = d + slack
    page = block_size * token * (2 if slack else 1)
    backing = torch.full((num_blocks * page + 5,), float("nan"), dtype=dtype, device=device)
    return torch.as_strided(
        backing, (num_blocks, block_size, 1, d), (page, token, d, 1), 5 if slack else 0
    )


def _fill_raw(rows, lens):
    """Random keys (with a per-token offset, so pool means are not near zero) for every
    request through shuffled block tables; unused columns hold an id far out of range."""
    num_blocks, block_size = rows.shape[:2]
    need = [math.ceil(n / block_size) for n in lens]
    free = torch.randperm(num_blocks - 1)[: sum(need)] + 1
    tables = torch.full((len(lens), max(need) + 2), 10**6, dtype=torch.int32)
    start = 0
    for r, (n, nb) in enumerate(zip(lens, need)):
        tables[r, :nb] = free[start : start + nb].int()
        start += nb
        pos = torch.arange(n)
        values = torch.randn(n, rows.shape[-1]) + torch.randn(1, rows.shape[-1])
        blocks, slots = tables[r, pos // block_size].long(), pos % block_size
        rows[blocks, slots, 0] = values.to(rows)
    return tables


def _rotary(pools, kpool, rot, dtype):
    """cos / sin ``[pools, rot]`` float32 at positions ``p * kpool`` (rotate-half layout), the
    values a model of ``dtype`` holds (rounded to it)."""
    inv = 1.0 / (1000.0 ** (torch.arange(0, rot, 2).float() / max(rot, 1)))
    ang = (torch.arange(pools) * kpool).float()[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype).float(), ang.sin().to(dtype).float()


def _run(dtype, block_size, kpool, heads, d, rot, slack, seed):
    torch.manual_seed(seed)
    num_blocks = sum(math.ceil(n / block_size) for n in _LENS) + 4
    rows = _raw_rows(num_blocks, block_size, d, dtype, slack)
    tables = _fill_raw(rows, _LENS)
    seg, pos = _queries(_LENS, _PICKS)
    num_pools = torch.tensor([n // kpool for n in _LENS], dtype=torch.int32)
    most = int(num_pools.max())
    q = torch.randn(len(seg), heads, d).to(dtype)
    weights = torch.full((len(seg), heads), d**-0.5)
    norm = 1.0 + 0.3 * torch.randn(d)
    cos, sin = _rotary(most + 3, kpool, rot, dtype)  # more rows than pools: a longer table
    plan = plan_indexer_scores(
        tables, seg, pos, num_pools, num_heads=heads, head_dim=d, kpool=kpool,
        block_size=block_size, rows_dtype=dtype, q_dtype=dtype, softmax_scale=1.0,
        pool="mean_norm_rope", rotary_dim=rot, norm_eps=1e-6, num_blocks=num_blocks,
        validate=True,
    )  # fmt: skip
    out = torch.full((len(seg), most), float("nan"))
    got = plan.run(q, weights, rows, out=out, norm=norm, cos=cos, sin=sin)
    assert got is out
    want = mean_norm_rope_scores_ref(
        q, weights, rows, norm, cos, sin, tables, seg, pos, num_pools, 1.0, kpool, 1e-6
    )
    _close(got, want, dtype)
    return got, want, (q, weights, rows, norm, cos, sin, tables, seg, pos, num_pools, kpool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "block_size, kpool, heads, d, rot, slack",
    [
        pytest.param(8, 4, 4, 16, 16, 0, id="bs8-kpool4-rot-all"),
        pytest.param(6, 4, 2, 16, 8, 3, id="bs6-straddle-rot-half-strided"),
        pytest.param(16, 3, 8, 24, 0, 0, id="bs16-kpool3-no-rot"),
        pytest.param(7, 8, 3, 32, 12, 2, id="bs7-kpool8-rot12-strided"),
    ],
)
def test_qsa_scores_match_the_reference(dtype, block_size, kpool, heads, d, rot, slack):
    got, want, _ = _run(dtype, block_size, kpool, heads, d, rot, slack, seed=block_size + d)
    # the cases the test is for: a request with no pool, a query that sees none, many scores,
    # and relu'd heads: some pools score exactly 0 (ties transformers' topk breaks its way)
    assert got[0].isinf().all() and got[10:12].isinf().all()
    assert (~got.isinf()).sum() > 20
    if heads <= 4:
        assert (want == 0).any()


def test_qsa_transform_matters():
    """The norm weight and the rotation each move the scores: a kernel that skipped either
    would fail the reference comparison above (the reference here is run without them)."""
    got, _, args = _run(torch.float32, 8, 4, 4, 16, 16, 0, seed=11)
    q, weights, rows, norm, cos, sin, tables, seg, pos, num_pools, kpool = args
    live = ~got.isinf()
    for n, c, s in ((torch.ones_like(norm), cos, sin), (norm, torch.ones_like(cos), 0 * sin)):
        other = mean_norm_rope_scores_ref(
            q, weights, rows, n, c, s, tables, seg, pos, num_pools, 1.0, kpool
        )
        assert (other[live] - got[live]).abs().max() > 1e-2


def test_qsa_bad_inputs_are_refused():
    rows = _raw_rows(4, 8, 16, torch.float32)
    tables = torch.ones(1, 3, dtype=torch.int32)
    seg = pos = torch.zeros(1, dtype=torch.int32)
    pools = torch.ones(1, dtype=torch.int32)
    kw = dict(num_heads=2, head_dim=16, kpool=4, block_size=8, rows_dtype=torch.float32,
              q_dtype=torch.float32, softmax_scale=1.0)  # fmt: skip
    with pytest.raises(ValueError, match="pool must be one of"):
        plan_indexer_scores(tables, seg, pos, pools, pool="mean", **kw)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        plan_indexer_scores(tables, seg, pos, pools, pool="mean_norm_rope", rotary_dim=5, **kw)
    with pytest.raises(ValueError, match="a gated pool rotates nothing"):
        plan_indexer_scores(tables, seg, pos, pools, rotary_dim=8, **kw)
    plan = plan_indexer_scores(tables, seg, pos, pools, pool="mean_norm_rope", rotary_dim=8, **kw)
    q, w = torch.randn(1, 2, 16), torch.ones(1, 2)
    norm, cos = torch.ones(16), torch.ones(1, 8)
    with pytest.raises(ValueError, match="needs norm"):
        plan.run(q, w, rows, norm=norm, cos=cos)
    with pytest.raises(ValueError, match="takes norm, cos and sin instead"):
        plan.run(q, w, rows, torch.zeros(4, 16), norm=norm, cos=cos, sin=cos)
    with pytest.raises(ValueError, match=r"cos must be \[>= 1, 8\]"):
        plan.run(q, w, rows, norm=norm, cos=torch.ones(1, 16), sin=cos)
    with pytest.raises(ValueError, match="a raw key of index_head_dim 16 is 16"):
        plan.run(q, w, torch.zeros(4, 8, 1, 33), norm=norm, cos=cos, sin=cos)
    gated = plan_indexer_scores(tables, seg, pos, pools, **kw)
    with pytest.raises(ValueError, match="pass ape only"):
        gated.run(q, w, torch.zeros(4, 8, 1, 33), torch.zeros(4, 16), norm=norm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_qsa_rows_on_gpu():
    """bf16 raw keys (Qwen4-Exp's sizes: 32 heads, D 128 with 64 rotated dims, ratio 16,
    64-token pages) and float32 queries (the engine's), each transform step rounded to bf16
    in the kernel as in the reference."""
    torch.manual_seed(0)
    d, heads, kpool, bs, rot = 128, 32, 16, 64, 64
    lens = [4100, 700, 15]
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 4
    rows = _raw_rows(num_blocks, bs, d, torch.bfloat16, slack=8)
    tables = _fill_raw(rows, lens)
    seg, pos = _queries(lens, [[4099, 2000, 17], list(range(600, 700)), [14]])
    num_pools = torch.tensor([n // kpool for n in lens], dtype=torch.int32)
    most = int(num_pools.max())
    q = torch.randn(len(seg), heads, d)
    weights = torch.full((len(seg), heads), d**-0.5)
    norm = 1.0 + 0.3 * torch.randn(d)
    cos, sin = _rotary(most, kpool, rot, torch.bfloat16)
    rows = rows.cuda()
    args = [t.cuda() for t in (q, weights)]
    plan = plan_indexer_scores(
        tables.cuda(), seg.cuda(), pos.cuda(), num_pools.cuda(), num_heads=heads, head_dim=d,
        kpool=kpool, block_size=bs, rows_dtype=torch.bfloat16, q_dtype=torch.float32,
        softmax_scale=1.0, pool="mean_norm_rope", rotary_dim=rot,
    )  # fmt: skip
    out = torch.full((len(seg), most), float("nan"), device="cuda")
    got = plan.run(*args, rows, out=out, norm=norm.cuda(), cos=cos.cuda(), sin=sin.cuda())
    want = mean_norm_rope_scores_ref(
        *args, rows, norm.cuda(), cos.cuda(), sin.cuda(), tables.cuda(), seg, pos, num_pools,
        1.0, kpool,
    )  # fmt: skip
    assert not got.isnan().any()
    assert torch.equal(got.isinf(), want.isinf())
    live = ~want.isinf()
    assert (got[live] - want[live]).abs().max().item() < 1e-3 * max(1.0, want[live].abs().max())
