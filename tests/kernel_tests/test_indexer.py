"""GLM-5-Next's DSA indexer pool scores (``indexer_scores``) against the torch reference:
fp32 and fp16 rows, requests of unequal lengths (one shorter than a pool, a query that sees no
pool), pages a multiple of ``kpool`` and not (pools straddling pages), shuffled block tables
with NaN in every row no request owns and garbage in the unused columns, strided pages, token
tiles cut inside a request, every config of ``CONFIGS``, the real plan views of every layout;
the top-k picked from the kernel's scores against the engine's torch pick (``_pick_pools``);
bad inputs refused. bf16 (the interpreter's bf16 ``tl.dot`` is unreliable) runs on a GPU only.

Inputs are fresh random values every run; outputs are NaN-poisoned before the kernel writes
them."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from hybridkv.layouts import LAYOUTS
from hybridkv_kernels.indexer_scores import (
    CONFIGS,
    indexer_scores,
    indexer_scores_ref,
    plan_indexer_scores,
)

#: (rtol, atol) a score; fp16 rounds the pool keys to fp16 before the dot, in the kernel and the
#: reference alike, but a float32 pool key a last bit apart may round to another fp16 value
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}


def _rows(
    num_blocks: int, block_size: int, d: int, dtype, slack: int = 0, device: str = "cpu"
) -> torch.Tensor:
    """NaN-filled indexer pages ``[num_blocks, block_size, 1, 2 * d + 1]``; with ``slack``, each
    token's row is followed by ``slack`` unused elements and pages are spaced out by one more
    page (as in a buffer packing several layers)."""
    width = 2 * d + 1
    token = width + slack
    page = block_size * token * (2 if slack else 1)
    backing = torch.full((num_blocks * page + 7,), float("nan"), dtype=dtype, device=device)
    return torch.as_strided(
        backing, (num_blocks, block_size, 1, width), (page, token, width, 1), 3 if slack else 0
    )


def _fill(rows: torch.Tensor, lens: list[int], scale: float = 1.0) -> torch.Tensor:
    """Random rows for every request's ``lens[r]`` tokens through shuffled, non-contiguous
    block tables (block 0 never used); columns past a request's blocks hold an id far out of
    range, which must never be read."""
    num_blocks, block_size = rows.shape[:2]
    need = [math.ceil(n / block_size) for n in lens]
    free = torch.randperm(num_blocks - 1)[: sum(need)] + 1
    tables = torch.full((len(lens), max(need, default=0) + 2), 10**6, dtype=torch.int32)
    start = 0
    for r, (n, nb) in enumerate(zip(lens, need)):
        tables[r, :nb] = free[start : start + nb].int()
        start += nb
        pos = torch.arange(n)
        values = torch.randn(n, rows.shape[-1]) * scale
        values[:, -1] = 1.0  # the valid flag
        blocks, slots = tables[r, pos // block_size].long(), pos % block_size
        rows[blocks.to(rows.device), slots.to(rows.device), 0] = values.to(rows)
    return tables


def _queries(lens: list[int], picks: list[list[int]]):
    """``seg [N]`` and ``query_pos [N]`` int32 of the query tokens of each request (``picks[r]``:
    their positions, each below the request's length ``lens[r]``)."""
    seg = torch.tensor([r for r, ps in enumerate(picks) for _ in ps], dtype=torch.int32)
    pos = torch.tensor([p for ps in picks for p in ps], dtype=torch.int32)
    assert all(p < n for n, ps in zip(lens, picks) for p in ps)
    return seg, pos


def _inputs(n: int, heads: int, d: int, kpool: int, dtype):
    q = torch.randn(n, heads, d).to(dtype)
    weights = torch.randn(n, heads)
    ape = torch.randn(kpool, d)
    return q, weights, ape


def _close(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    assert not got.isnan().any(), "a score the kernel should have written is NaN"
    assert torch.equal(got.isinf(), want.isinf()), "the masked pools differ"
    assert (got[got.isinf()] < 0).all()
    live = ~want.isinf()
    rtol, atol = TOL[dtype]
    scale = max(1.0, want[live].abs().max().item()) if live.any() else 1.0
    torch.testing.assert_close(got[live], want[live], rtol=rtol, atol=atol * scale)


def _check(q, weights, rows, ape, tables, seg, pos, num_pools, scale, dtype, **kwargs):
    max_pools = kwargs.pop("max_pools", None)
    width = max_pools if max_pools is not None else int(num_pools.max())
    out = torch.full((len(seg), width), float("nan"))  # unwritten scores would stay NaN
    got = indexer_scores(
        q, weights, rows, ape, tables, seg, pos, num_pools, scale, max_pools=max_pools,
        out=out, **kwargs,
    )  # fmt: skip
    assert got is out
    want = indexer_scores_ref(
        q, weights, rows, ape, tables, seg, pos, num_pools, scale, max_pools=max_pools
    )
    _close(got, want, dtype)
    return got, want


# lens: context lengths; the query tokens: each request's last few positions, plus a query at
# position 1 (sees no pool) in the first request; request 1 is shorter than a pool
_LENS = [70, 2, 41, 9]
_PICKS = [[1, 40, *range(62, 70)], [0, 1], [40], [5, 8]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "block_size, kpool, heads, d, slack",
    [
        pytest.param(8, 4, 16, 16, 0, id="bs8-kpool4-H16-D16"),
        pytest.param(6, 4, 20, 16, 3, id="bs6-straddle-H20-strided"),
        pytest.param(16, 3, 8, 24, 0, id="bs16-kpool3-H8-D24"),
        pytest.param(64, 16, 32, 32, 5, id="bs64-kpool16-H32-strided"),
    ],
)
def test_indexer_scores_synthetic(dtype, block_size, kpool, heads, d, slack):
    torch.manual_seed(block_size * 131 + kpool * 7 + heads + d)
    lens, picks = _LENS, _PICKS
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 4
    rows = _rows(num_blocks, block_size, d, dtype, slack)
    tables = _fill(rows, lens)
    seg, pos = _queries(lens, picks)
    num_pools = torch.tensor([n // kpool for n in lens], dtype=torch.int32)
    q, weights, ape = _inputs(len(seg), heads, d, kpool, dtype)
    got, _ = _check(q, weights, rows, ape, tables, seg, pos, num_pools, d**-0.5, dtype)
    # the cases the test is for: a request with no pool, a query that sees none, some scores
    assert int(num_pools.min()) == 0 and got[10:12].isinf().all() and got[0].isinf().all()
    assert (~got.isinf()).sum() > 20


def test_indexer_scores_token_tiles_and_interleaved_requests():
    """Token tiles cut inside a request (3 tokens a tile), requests whose tokens interleave
    (runs of one token), ``max_pools`` wider than any request's pools, int64 indices."""
    torch.manual_seed(5)
    dtype, d, heads, kpool, bs = torch.float32, 16, 16, 4, 8
    lens = [50, 37]
    rows = _rows(sum(math.ceil(n / bs) for n in lens) + 2, bs, d, dtype)
    tables = _fill(rows, lens)
    seg = torch.tensor([0] * 7 + [1, 0, 1, 0, 1] + [1] * 5, dtype=torch.int64)
    pos = torch.tensor([*range(40, 47), 20, 47, 21, 48, 22, *range(30, 35)], dtype=torch.int64)
    num_pools = torch.tensor([n // kpool for n in lens], dtype=torch.int64)
    q, weights, ape = _inputs(len(seg), heads, d, kpool, dtype)
    plan = plan_indexer_scores(
        tables, seg, pos, num_pools, num_heads=heads, head_dim=d, kpool=kpool, block_size=bs,
        rows_dtype=dtype, q_dtype=dtype, softmax_scale=0.3, max_pools=20, tokens_per_tile=3,
    )  # fmt: skip
    # 7 tokens of request 0 (3 + 3 + 1), four runs of one, then 6 tokens of request 1 (the
    # last interleaved one joins the 5 after it: 3 + 3)
    assert plan.tiles[:, 1].tolist() == [3, 3, 1, 1, 1, 1, 1, 3, 3]
    assert plan.tiles[:, 2].tolist() == [0, 0, 0, 1, 0, 1, 0, 1, 1]
    out = torch.full((len(seg), 20), float("nan"))
    got = plan.run(q, weights, rows, ape.contiguous(), out=out)
    want = indexer_scores_ref(q, weights, rows, ape, tables, seg, pos, num_pools, 0.3, 20)
    _close(got, want, dtype)
    assert got[:, 13:].isinf().all()  # past every request's pools


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_every_config(config):
    torch.manual_seed(hash(str(config)) % 1000)
    dtype, d, heads, kpool, bs = torch.float32, 16, 16, 4, 8
    lens = [300, 65]  # 75 pools: several tiles of 16 and 32, two of 64
    rows = _rows(sum(math.ceil(n / bs) for n in lens) + 2, bs, d, dtype)
    tables = _fill(rows, lens)
    seg, pos = _queries(lens, [[299, 150, 3], [64, 63]])
    num_pools = torch.tensor([n // kpool for n in lens], dtype=torch.int32)
    q, weights, ape = _inputs(len(seg), heads, d, kpool, dtype)
    _check(q, weights, rows, ape, tables, seg, pos, num_pools, 0.25, dtype, config=config)


def test_no_pools_and_no_tokens():
    """Every request shorter than a pool: ``[N, 0]`` scores; no query token: ``[0, P]``."""
    d, heads, kpool, bs = 16, 16, 4, 8
    rows = _rows(4, bs, d, torch.float32)
    tables = _fill(rows, [3, 2])
    seg, pos = _queries([3, 2], [[0, 2], [1]])
    q, weights, ape = _inputs(3, heads, d, kpool, torch.float32)
    got = indexer_scores(q, weights, rows, ape, tables, seg, pos, torch.tensor([0, 0]), 0.25)
    assert got.shape == (3, 0)
    empty = torch.zeros(0, dtype=torch.int32)
    q0, w0, _ = _inputs(0, heads, d, kpool, torch.float32)
    got = indexer_scores(q0, w0, rows, ape, tables, empty, empty, torch.tensor([1, 0]), 0.25)
    assert got.shape == (0, 1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_indexer_scores_on_real_plans(layout):
    """The tiny GLM-5-Next's indexer pages in a real plan (NaN-filled pools, the view the engine
    reads: its page and token strides)."""
    pytest.importorskip("transformers")
    from hybridkv.e2e import make_tiny_plan
    from hybridkv.e2e.families import TINY_CONFIGS

    config = TINY_CONFIGS["glm5_next"]()
    plan = make_tiny_plan(config, layout)
    buffers = plan.allocate("cpu")
    for b in buffers.values():
        b.view(torch.uint8).fill_(0xFF)  # NaN in every float dtype
    (placement,) = [p for p in plan.kv_placements if p.kind == "indexer"][-1:]
    rows = plan.kv_views(buffers, placement.layer)[0]
    text = config.get_text_config()
    d, heads, kpool = text.index_head_dim, text.index_n_heads, text.index_kpool
    assert rows.shape[1:] == (plan.block_size, 1, 2 * d + 1)
    torch.manual_seed(11)
    lens = [130, 70]
    tables = _fill(rows, lens)
    seg, pos = _queries(lens, [list(range(100, 130)), [69]])
    num_pools = torch.tensor([n // kpool for n in lens], dtype=torch.int32)
    q, weights, ape = _inputs(len(seg), heads, d, kpool, rows.dtype)
    _check(q, weights, rows, ape, tables, seg, pos, num_pools, d**-0.5, rows.dtype)


def _pick_pools(
    ix: torch.nn.Module,
    context: torch.Tensor,
    q: torch.Tensor,
    weights: torch.Tensor,
    query_pos: torch.Tensor,
    tail: int,
) -> torch.Tensor:
    """One request's pick in torch (the engine's path before the ``indexer_scores`` kernel,
    kept here as its reference): ``context [L, row]`` (its indexer rows), ``q [T, H, D]`` and
    ``weights [T, H]`` (float32) of its query tokens at ``query_pos [T]``. The same pooling,
    scores and masking as transformers' ``Glm5NextTextIndexer`` (its pools start at the first
    token: no padding here), so the same pools win. Up to ties: pools of equal score (every
    head's ReLU zero) at the cut are ordered by ``torch.topk``, whose row here is the request's
    context and in transformers the forward's (a one-shot prefill's is longer), so another pool
    of the same score may be picked."""
    from hybridkv.e2e.attn import _pick_from_scores

    kpool, dim = ix.index_kpool, ix.head_dim
    length = context.shape[0]
    num_pools = length // kpool  # complete pools; transformers keeps no other
    keys, gates = context[:, :dim], context[:, dim : 2 * dim]
    if not num_pools:
        scores = torch.zeros((len(query_pos), 0), dtype=torch.float32)
        return _pick_from_scores(scores, query_pos, kpool, ix.index_topk, tail)
    span = num_pools * kpool
    grouped_keys = keys[:span].reshape(num_pools, kpool, dim)
    logits = gates[:span].reshape(num_pools, kpool, dim).float()
    logits = logits + ix.index_kpool_compress_ape.float()[None]
    probs = logits.softmax(dim=1).to(grouped_keys.dtype)
    pool_keys = (probs * grouped_keys).sum(dim=1)  # [P, D]
    scores = torch.relu(torch.matmul(q, pool_keys.float().T) * ix.softmax_scale)  # [T, H, P]
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [T, P]
    pool_end = torch.arange(num_pools) * kpool + kpool - 1
    visible = pool_end[None, :] <= query_pos[:, None]
    index_scores = index_scores.masked_fill(~visible, torch.finfo(index_scores.dtype).min)
    return _pick_from_scores(index_scores, query_pos, kpool, ix.index_topk, tail)


def _indexer(kpool: int, d: int, topk: int, ape: torch.Tensor) -> SimpleNamespace:
    """What ``_pick_pools`` reads of transformers' ``Glm5NextTextIndexer``."""
    return SimpleNamespace(
        index_kpool=kpool,
        head_dim=d,
        index_topk=topk,
        index_kpool_compress_ape=ape,
        softmax_scale=d**-0.5,
    )


def test_top_k_from_kernel_scores_is_the_engines_torch_pick():
    """The engine's pick from the kernel's scores of every query token at once (one launch, one
    ``torch.topk`` over the forward's widest row) lists the same tokens as the torch path
    (``_pick_pools``, one request at a time over its own context); from each request's own
    columns of the kernel's scores, the very same rows. No ties: the reference scores of the
    visible pools are checked to be apart at every cut."""
    from hybridkv.e2e.attn import _pick_from_scores

    torch.manual_seed(3)
    dtype, d, heads, kpool, bs, topk = torch.float32, 16, 16, 4, 6, 16
    tail = kpool - 1
    lens = [90, 3, 41, 23]
    picks = [[1, 2, 30, *range(80, 90)], [0, 2], [17, 40], [3, 11, 22]]
    rows = _rows(sum(math.ceil(n / bs) for n in lens) + 3, bs, d, dtype)
    tables = _fill(rows, lens)
    seg, pos = _queries(lens, picks)
    num_pools = torch.tensor([n // kpool for n in lens], dtype=torch.int32)
    q, weights, ape = _inputs(len(seg), heads, d, kpool, dtype)
    weights = weights.abs() + 0.1  # scores of visible pools > 0: no ties at 0
    scores, want = _check(q, weights, rows, ape, tables, seg, pos, num_pools, d**-0.5, dtype)
    select = topk // kpool
    for row in want:
        live = row[~row.isinf()].sort(descending=True).values
        if len(live) > select:  # the cut is between two distinct scores
            assert live[select - 1] - live[select] > 1e-4 * live[0]
        assert live.unique().numel() == live.numel()

    batched = _pick_from_scores(scores, pos.long(), kpool, topk, tail)
    ix = _indexer(kpool, d, topk, ape)
    for r, n in enumerate(lens):
        mine = (seg == r).nonzero().flatten()
        ctx = torch.arange(n)
        context = rows[tables[r, ctx // bs].long(), ctx % bs, 0].float()
        torch_pick = _pick_pools(ix, context, q[mine], weights[mine], pos[mine].long(), tail)
        own = _pick_from_scores(scores[mine, : n // kpool], pos[mine].long(), kpool, topk, tail)
        assert torch.equal(own, torch_pick), r
        # the batched row lists the same tokens; only where its -1 padding sits may differ
        assert torch.equal(batched[mine].sort(dim=1).values, torch_pick.sort(dim=1).values), r
        assert (torch_pick >= 0).any()


def _plan_args(**over):
    args = dict(
        num_heads=16, head_dim=16, kpool=4, block_size=8, rows_dtype=torch.float32,
        q_dtype=torch.float32, softmax_scale=0.25,
    )  # fmt: skip
    args.update(over)
    return args


def test_bad_inputs_are_refused():
    d, heads, kpool, bs = 16, 16, 4, 8
    rows = _rows(6, bs, d, torch.float32)
    tables = _fill(rows, [20, 9])
    seg, pos = _queries([20, 9], [[19], [8]])
    pools = torch.tensor([5, 2], dtype=torch.int32)
    q, w, ape = _inputs(2, heads, d, kpool, torch.float32)
    call = indexer_scores

    with pytest.raises(ValueError, match=r"rows hold 32 elements a token but .* is 33"):
        call(q, w, rows[..., : 2 * d], ape, tables, seg, pos, pools, 0.25)
    with pytest.raises(ValueError, match="q and ape disagree on index_head_dim"):
        call(q, w, rows, ape[:, :8], tables, seg, pos, pools, 0.25)
    with pytest.raises(ValueError, match="weights must be"):
        call(q, w[:, :4], rows, ape, tables, seg, pos, pools, 0.25)
    with pytest.raises(ValueError, match="q must be"):
        call(q[0], w, rows, ape, tables, seg, pos, pools, 0.25)
    with pytest.raises(ValueError, match="block_tables must be an int32"):
        call(q, w, rows, ape, tables.long(), seg, pos, pools, 0.25)
    with pytest.raises(ValueError, match=r"seg\[1\] = 2 is not a request"):
        call(q, w, rows, ape, tables, torch.tensor([0, 2]), pos, pools, 0.25)
    with pytest.raises(ValueError, match="query_pos has 1 entries"):
        call(q, w, rows, ape, tables, seg, pos[:1], pools, 0.25)
    with pytest.raises(ValueError, match=r"query_pos\[0\] = -1"):
        call(q, w, rows, ape, tables, seg, torch.tensor([-1, 3]), pools, 0.25)
    with pytest.raises(ValueError, match="need 6 blocks of 8 but block_tables has 5 columns"):
        call(q, w, rows, ape, tables, seg, pos, torch.tensor([12, 2]), 0.25)
    with pytest.raises(ValueError, match="max_pools = 3 is below request 0's 5 pools"):
        call(q, w, rows, ape, tables, seg, pos, pools, 0.25, max_pools=3)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        call(q.double(), w, rows, ape, tables, seg, pos, pools, 0.25)
    bad = tables.clone()
    bad[1, 0] = 6  # one past the rows' blocks, in a column request 1 reads
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\] = 6 is outside \[0, 6\)"):
        call(q, w, rows, ape, bad, seg, pos, pools, 0.25, validate=True)
    with pytest.raises(ValueError, match="autotune=True needs a GPU"):
        call(q, w, rows, ape, tables, seg, pos, pools, 0.25, autotune=True)

    plan = plan_indexer_scores(tables, seg, pos, pools, **_plan_args())
    with pytest.raises(ValueError, match=r"q must be \[2, 16, 16\] torch.float32"):
        plan.run(q.half(), w, rows, ape)
    with pytest.raises(ValueError, match="ape must be a contiguous"):
        plan.run(q, w, rows, ape.t().contiguous().t())
    with pytest.raises(ValueError, match=r"rows must be \[num_blocks, 8"):
        plan.run(q, w, _rows(6, 4, d, torch.float32), ape)
    with pytest.raises(ValueError, match="out must be"):
        plan.run(q, w, rows, ape, out=torch.empty(2, 4))
    with pytest.raises(ValueError, match="rows hold 17 elements a token"):
        plan.run(q, w, _rows(6, bs, 8, torch.float32), ape)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32], ids=["q-bf16", "q-fp32"])
def test_bf16_rows_on_gpu(q_dtype):
    """bf16 rows (GLM-5.3-Flash's sizes: 32 heads, D 128, kpool 16, 64-token pages) on a GPU,
    with bf16 queries (the tensor-core dot) and float32 ones (the engine's, an IEEE dot)."""
    torch.manual_seed(0)
    d, heads, kpool, bs = 128, 32, 16, 64
    lens = [4100, 700, 15]
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 4
    rows = _rows(num_blocks, bs, d, torch.bfloat16, slack=8, device="cuda")
    tables = _fill(rows, lens)
    seg, pos = _queries(lens, [[4099, 2000, 17], list(range(600, 700)), [14]])
    num_pools = torch.tensor([n // kpool for n in lens], dtype=torch.int32)
    q, weights, ape = _inputs(len(seg), heads, d, kpool, q_dtype)
    args = (q.cuda(), weights.cuda(), rows, ape.cuda(), tables.cuda(), seg.cuda(), pos.cuda(),
            num_pools.cuda(), d**-0.5)  # fmt: skip
    out = torch.full((len(seg), int(num_pools.max())), float("nan"), device="cuda")
    got = indexer_scores(*args, out=out)
    want = indexer_scores_ref(*args)
    assert not got.isnan().any()
    assert torch.equal(got.isinf(), want.isinf())
    live = ~want.isinf()
    tol = 2e-2 if q_dtype == torch.bfloat16 else 1e-4
    scale = max(1.0, want[live].abs().max().item())
    assert (got[live] - want[live]).abs().max().item() < tol * scale


def test_default_config_and_the_compile_check_rule():
    """The default (32 pools, 8 warps) fits every shape the compile check covered; the rule
    keeps the configs that spilled there out (float32 queries beside 160 pooling values a
    thread) and refuses shapes it never compiled; the interpreter pins its own config."""
    from hybridkv_kernels.indexer_scores import (
        IndexerConfig,
        IndexerShape,
        choose_config,
        config_fits,
    )

    glm = IndexerShape(arch=90, block_h=32, block_d=128, rows_bytes=2, q_bytes=4)
    assert choose_config(glm)[0] == IndexerConfig(32, 8, 2)
    # measured on an H200 at these sizes only; elsewhere the source says it is not
    assert choose_config(glm)[1].startswith("H200 GPU suite")
    sm80 = IndexerShape(arch=80, block_h=32, block_d=128, rows_bytes=2, q_bytes=4)
    assert choose_config(sm80)[1].startswith("unmeasured")
    assert [c for c in CONFIGS if config_fits(c, glm)] == [IndexerConfig(32, 8, 2)]
    bf16_q = IndexerShape(arch=80, block_h=32, block_d=128, rows_bytes=2, q_bytes=2)
    assert all(config_fits(c, bf16_q) for c in CONFIGS)
    with pytest.raises(ValueError, match="covers up to 64 heads and D 128"):
        choose_config(IndexerShape(arch=90, block_h=128, block_d=128, rows_bytes=2, q_bytes=2))
    rows = _rows(4, 8, 16, torch.float32)
    tables = _fill(rows, [9])
    plan = plan_indexer_scores(tables, *_queries([9], [[8]]), torch.tensor([2]), **_plan_args())
    assert plan.config_source == "interpreter" and plan.config.block_p == 16
