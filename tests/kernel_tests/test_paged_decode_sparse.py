"""Paged GQA decode over a token-index list (``plan_decode(token_indices=...)``, Qwen4-Exp's
QSA pick) against the torch reference: fresh random caches, lists and queries each case,
NaN-poisoned outputs and unlisted tokens, fp16 and fp32 (bf16 is a GPU test:
``test_gpu.py::test_bf16_sparse_gqa_decode``, the interpreter's bf16 dots being wrong)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridkv_kernels import paged_decode as pd
from hybridkv_kernels.paged_decode import paged_decode_attention, paged_decode_attention_ref

from .paged import synthetic_caches
from .test_paged_decode import TOL, _fill


def _pick(lens, k, seed, pad_inside=True):
    """A QSA-like list a request: distinct positions, the last one (the query's own token)
    always listed, -1 padding at the end of short rows and, with ``pad_inside``, in the middle
    of long ones, in a shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.full((len(lens), k), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        take = min(n, k - (k // 4 if pad_inside and n > 2 else 0))
        rest = torch.randperm(n - 1, generator=gen)[: take - 1]
        pos = torch.cat([torch.tensor([n - 1]), rest]).int()
        slots = torch.randperm(k, generator=gen)[: len(pos)]
        idx[b, slots] = pos
    return idx


def _poison_unlisted(k_cache, v_cache, tables, lens, idx):
    """NaN into the K and V rows of every cached token the list leaves out."""
    bs = k_cache.shape[1]
    for b, n in enumerate(lens):
        listed = set(idx[b][idx[b] >= 0].tolist())
        pos = torch.tensor([p for p in range(n) if p not in listed], dtype=torch.long)
        if len(pos):
            blocks = tables[b, pos // bs].long()
            k_cache[blocks, pos % bs] = float("nan")
            v_cache[blocks, pos % bs] = float("nan")


def _case(lens, hq, hkv, d, bs, dtype, k, seed):
    torch.manual_seed(seed)
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 4
    _, k_cache, v_cache = synthetic_caches("classic", num_blocks, bs, hkv, d, d, dtype)
    tables = _fill(k_cache, v_cache, lens, dtype)
    idx = _pick(lens, k, seed)
    q = torch.randn(len(lens), hq, d).to(dtype)
    return q, k_cache, v_cache, tables, idx


@pytest.mark.parametrize(
    "lens, hq, hkv, d, bs, k, dtype, splits, sinks",
    [
        pytest.param([130, 7, 61], 4, 2, 32, 16, 40, torch.float32, None, False, id="fp32"),
        pytest.param([130, 7, 61], 4, 2, 32, 16, 40, torch.float32, 3, False, id="fp32-split3"),
        pytest.param([200, 33], 8, 2, 64, 48, 150, torch.float16, None, False, id="fp16-bs48"),
        pytest.param([200, 33], 8, 2, 64, 48, 150, torch.float16, 2, True, id="fp16-split2-sinks"),
        pytest.param([90, 1, 17], 6, 3, 16, 7, 19, torch.float32, 1, True, id="odd-block-sinks"),
    ],
)
def test_sparse_decode_matches_the_reference(lens, hq, hkv, d, bs, k, dtype, splits, sinks):
    """The list walk against the reference over exactly the listed tokens, then the unlisted
    tokens' K and V poisoned with NaN: the result does not change by a bit (nothing unlisted
    is read), and differs from dense attention (the list matters)."""
    q, k_cache, v_cache, tables, idx = _case(lens, hq, hkv, d, bs, dtype, k, seed=sum(lens) + k)
    seq = torch.tensor(lens, dtype=torch.int32)
    sink = torch.randn(hq) * 2 if sinks else None
    out = torch.full((len(lens), hq, d), float("nan"), dtype=dtype)
    got = paged_decode_attention(
        q, k_cache, v_cache, tables, seq, 0.3, num_splits=splits, out=out, sinks=sink,
        token_indices=idx, validate=True,
    ).clone()  # fmt: skip
    want = paged_decode_attention_ref(
        q, k_cache, v_cache, tables, seq, 0.3, sinks=sink, token_indices=idx
    )
    dense = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq, 0.3, sinks=sink)
    assert not torch.isnan(got).any()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype], err
    assert (want.float() - dense.float()).abs().max() > 100 * TOL[dtype]
    _poison_unlisted(k_cache, v_cache, tables, lens, idx)
    again = paged_decode_attention(
        q, k_cache, v_cache, tables, seq, 0.3, num_splits=splits, sinks=sink, token_indices=idx
    )
    assert torch.equal(again, got)


@pytest.mark.parametrize("splits", [1, 4])
def test_sparse_over_every_position_is_dense(splits):
    """A list of every position (shuffled, -1 padded) is dense attention."""
    lens = [100, 37]
    q, k_cache, v_cache, tables, _ = _case(lens, 4, 1, 32, 16, torch.float32, 1, seed=3)
    idx = torch.full((2, 128), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        idx[b, torch.randperm(128)[:n]] = torch.randperm(n).int()
    seq = torch.tensor(lens, dtype=torch.int32)
    sparse = paged_decode_attention(
        q, k_cache, v_cache, tables, seq, 0.2, num_splits=splits, token_indices=idx
    )
    dense = paged_decode_attention(q, k_cache, v_cache, tables, seq, 0.2)
    assert (sparse - dense).abs().max() <= TOL[torch.float32]


def test_sparse_split_of_padding_alone_weighs_nothing():
    """A split (and its tiles) holding only -1 entries: no NaN from an all -inf tile, the
    merge gives it no weight."""
    lens = [300]
    q, k_cache, v_cache, tables, _ = _case(lens, 4, 2, 16, 16, torch.float32, 1, seed=5)
    idx = torch.full((1, 512), -1, dtype=torch.int32)
    idx[0, :10] = torch.arange(290, 300, dtype=torch.int32)  # the rest (3 of 4 splits): padding
    seq = torch.tensor(lens, dtype=torch.int32)
    got = paged_decode_attention(q, k_cache, v_cache, tables, seq, 0.25, num_splits=4,
                                 token_indices=idx)  # fmt: skip
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq, 0.25, token_indices=idx)
    assert not torch.isnan(got).any()
    assert (got - want).abs().max() <= TOL[torch.float32]


def test_sparse_int64_addressing():
    """Block 2 of this cache starts at element 2**31 of a ~4 GiB (never touched) buffer; the
    list reaches into it."""
    bs, heads, d = 16, 1, 16
    stride = 2**30
    backing = torch.empty(2 * stride + 2 * bs * heads * d, dtype=torch.float16)
    k = torch.as_strided(backing, (3, bs, heads, d), (stride, heads * d, d, 1), 0)
    v = torch.as_strided(backing, (3, bs, heads, d), (stride, heads * d, d, 1), bs * heads * d)
    for b in (0, 2):
        k[b] = torch.randn(bs, heads, d).half()
        v[b] = torch.randn(bs, heads, d).half()
    tables = torch.tensor([[2, 0]], dtype=torch.int32)
    seq = torch.tensor([29], dtype=torch.int32)
    idx = torch.tensor([[3, -1, 15, 20, 28, 0]], dtype=torch.int32)
    q = torch.randn(1, 2, d).half()
    got = paged_decode_attention(q, k, v, tables, seq, 0.25, token_indices=idx)
    want = paged_decode_attention_ref(q, k, v, tables, seq, 0.25, token_indices=idx)
    assert (got.float() - want.float()).abs().max() < 2e-3


def test_sparse_plan_and_run_refuse_what_they_were_not_made_for():
    q, k_cache, v_cache, tables, idx = _case([50, 20], 4, 2, 16, 16, torch.float32, 8, seed=1)
    seq = torch.tensor([50, 20], dtype=torch.int32)
    kw = dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
              cache_dtype=torch.float32, q_dtype=torch.float32, scale=0.25)  # fmt: skip
    sparse = pd.plan_decode(tables, seq, token_indices=idx, **kw)
    assert sparse.shape.sparse and sparse.shape.page_align == 1 and sparse.num_indices == 8
    with pytest.raises(ValueError, match="this plan is sparse"):
        sparse.run(q, k_cache, v_cache)
    with pytest.raises(ValueError, match="K = 9 entries a request but the plan was made for"):
        sparse.run(q, k_cache, v_cache, token_indices=torch.zeros(2, 9, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32 \\[B, K\\]"):
        sparse.run(q, k_cache, v_cache, token_indices=idx.long())
    dense = pd.plan_decode(tables, seq, **kw)
    with pytest.raises(ValueError, match="made without token_indices"):
        dense.run(q, k_cache, v_cache, token_indices=idx)
    with pytest.raises(ValueError, match="no sliding window or relative bias"):
        pd.plan_decode(tables, seq, token_indices=idx, sliding_window=8, **kw)
    with pytest.raises(ValueError, match="K = 0"):
        pd.plan_decode(tables, seq, token_indices=idx[:, :0], **kw)


@pytest.mark.parametrize(
    "entry, match",
    [
        (50, "outside \\[0, 50\\)"),
        (-2, "outside \\[0, 50\\)"),
        ("dup", "more than once"),
        ("empty", "lists no token"),
    ],
)
def test_sparse_validate_catches_bad_lists(entry, match):
    q, k_cache, v_cache, tables, idx = _case([50, 20], 4, 2, 16, 16, torch.float32, 8, seed=2)
    seq = torch.tensor([50, 20], dtype=torch.int32)
    bad = idx.clone()
    if entry == "dup":
        bad[0, :2] = 7
    elif entry == "empty":
        bad[1] = -1
    else:
        bad[0, 0] = entry
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(q, k_cache, v_cache, tables, seq, 0.25, token_indices=bad,
                               validate=True)  # fmt: skip
