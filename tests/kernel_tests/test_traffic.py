"""Memory traffic of the attention kernels, counted under the interpreter (no GPU needed).

``traffic.count_loads`` adds up the bytes each launch loads from the caches and the block table
(mask-true elements whose addresses lie in the tensor's storage). The targets, from issue 10:

- decode: every cached K/V byte of a request's context is read once per KV head (not once per
  query head: one program serves a KV head's whole GQA group); with a sliding window only the
  window's tokens are read.
- prefill / extend: a request with a long cached prefix and fewer new tokens than one query tile
  reads each context K/V byte once per KV head; a fresh multi-tile prefill reads at most, per KV
  head, the keys each query tile can see (causal), summed over its query tiles.
- MLA: the latent cache is read once per request while the heads fit one program, and
  ``cdiv(heads, heads per program)`` times above that (DeepSeek's 128 heads).
- The block table is read once per page segment a program walks (not once per token).

What is assumed about tile sizes is read from the kernel modules where they expose it
(``paged_prefill.tokens_per_tile`` and the ``BLOCK_M`` of its configs, else its ``BLOCK_M``;
``mla_decode.heads_per_program``, else its ``BLOCK_H``); see the helpers below. Caches are fp16
(the counts do not depend on the dtype; fp16 keeps the interpreter's dots meaningful).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import triton
import triton.language as tl

from hybridkv_kernels import mla_decode, paged_decode, paged_prefill

from .traffic import LoadCounter, count_loads

ITEM = 2  # fp16
TOL = 0.02  # "within a few percent"; the counts are exact when the masks are


def _close(got: int, want: int) -> bool:
    return abs(got - want) <= TOL * want


def _caches(num_blocks: int, block_size: int, heads: int, d: int):
    """Separate K and V tensors (so their loads are told apart), random fp16 contents."""
    k = torch.randn(num_blocks, block_size, heads, d).to(torch.float16)
    v = torch.randn(num_blocks, block_size, heads, d).to(torch.float16)
    return k, v


def _tables(lens: list[int], block_size: int, spare: int = 2) -> tuple[torch.Tensor, int]:
    """Shuffled block tables (block 0 is the null block); returns (tables, num_blocks)."""
    need = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(need) + 1
    ids = torch.randperm(num_blocks - 1) + 1
    tables = torch.zeros(len(lens), max(need) + spare, dtype=torch.int32)
    start = 0
    for b, nb in enumerate(need):
        tables[b, :nb] = ids[start : start + nb].int()
        start += nb
    return tables, num_blocks


def _pages(lo: int, hi: int, block_size: int) -> int:
    """Pages holding tokens [lo, hi)."""
    return 0 if hi <= lo else (hi - 1) // block_size - lo // block_size + 1


# ---- the counter itself -------------------------------------------------------------------------


@triton.jit
def _copy_masked(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    first = tl.load(x_ptr)  # an unmasked scalar load: 1 element
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + first * 0, mask=offs < n)


def test_count_loads_counts_mask_true_elements_per_tensor():
    x = torch.randn(100, dtype=torch.float16)
    y = torch.full((100,), float("nan"), dtype=torch.float16)
    other = torch.zeros(7)
    with count_loads(x, other, y=y) as got:
        _copy_masked[(4,)](x, y, 90, BLOCK=32)
    assert torch.equal(y[:90], x[:90])
    assert got["0"] == (90 + 4) * 2  # 90 masked-in elements + one scalar per program, fp16
    # loads that touched x: 4 scalars and 3 vectors (program 3's offsets 96.. are all masked off)
    assert got.elements["0"] == 94 and got.loads["0"] == 7
    assert got["1"] == 0 and got["y"] == 0  # stores are not loads
    with pytest.raises(ValueError, match="share storage"), count_loads(a=x, b=x[10:]):
        pass


# ---- decode ------------------------------------------------------------------------------------
# Each case runs once (cached) and is checked twice: K/V bytes, and block-table entries.

DECODE_HKV, DECODE_D, BS = 2, 64, 16
DECODE_LENS = {"B3-mixed": (97, 3, 330), "B3-short": (1, 64, 200)}
WINDOW_LENS = (300, 77, 20)


@functools.cache
def _decode(group: int, lens: tuple[int, ...], window: int | None = None) -> LoadCounter:
    hkv, d = DECODE_HKV, DECODE_D
    tables, nblocks = _tables(list(lens), BS)
    k, v = _caches(nblocks, BS, hkv, d)
    q = torch.randn(len(lens), hkv * group, d).to(torch.float16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    with count_loads(k=k, v=v, table=tables) as got:
        paged_decode.paged_decode_attention(
            q, k, v, tables, seq_lens, d**-0.5, sliding_window=window, num_splits=1,
            max_seq_len=max(lens),
        )  # fmt: skip
    return got


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("lens", list(DECODE_LENS), ids=list(DECODE_LENS))
def test_decode_reads_kv_once_per_kv_head(group, lens):
    lens = DECODE_LENS[lens]
    got = _decode(group, lens)
    want = sum(lens) * DECODE_HKV * DECODE_D * ITEM
    for name in ("k", "v"):
        assert _close(got[name], want), (
            f"{name}: {got[name]} B read = {got[name] / want:.2f} x once per KV head ({want} B)"
        )


@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("lens", list(DECODE_LENS), ids=list(DECODE_LENS))
def test_decode_reads_block_table_once_per_page(group, lens):
    lens = DECODE_LENS[lens]
    got = _decode(group, lens)
    # one program per (request, KV head) with one split: one table entry per page it walks
    pages = sum(DECODE_HKV * _pages(0, n, BS) for n in lens)
    entries = got.elements["table"]
    assert entries <= pages, f"{entries} block-table entries loaded for {pages} pages walked"


def _max_block_n(module) -> int:
    """The longest key tile any config of the module's ``CONFIGS`` walks."""
    return max(c.block_n for c in module.CONFIGS)


@pytest.mark.parametrize("window", [50, 200])
def test_decode_window_reads_only_the_window(window):
    got = _decode(4, WINDOW_LENS, window)
    per_token = DECODE_HKV * DECODE_D * ITEM
    want = sum(min(n, window) for n in WINDOW_LENS) * per_token
    # every window token must be read; a tile may round the start down (at most one tile)
    slack = len(WINDOW_LENS) * _max_block_n(paged_decode) * per_token
    for name in ("k", "v"):
        assert want <= got[name] <= want + slack, f"{name}: {got[name]} B, the window is {want} B"
        assert _close(got[name], want), f"{name}: {got[name]} B read, the window is {want} B"


@pytest.mark.parametrize("window", [50, 200])
def test_decode_window_reads_block_table_once_per_page(window):
    got = _decode(4, WINDOW_LENS, window)
    # the window's pages, plus the pages of a tile rounded down to its start
    pages = sum(DECODE_HKV * _pages(max(0, n - window), n, BS) for n in WINDOW_LENS)
    slack = len(WINDOW_LENS) * DECODE_HKV * (_max_block_n(paged_decode) // BS)
    assert got.elements["table"] <= pages + slack, (
        f"{got.elements['table']} block-table entries loaded for {pages} pages in the windows"
    )


# ---- prefill / extend ---------------------------------------------------------------------------

PREFILL_HKV, PREFILL_D = 2, 64


def _prefill_tile_tokens(group: int) -> tuple[int, str]:
    """Query tokens per program tile, and where the number comes from. With several configs the
    smallest tile is taken: smaller tiles re-read more of the prefix, so the bound holds for
    every config."""
    if hasattr(paged_prefill, "tokens_per_tile"):
        ms = {c.block_m for c in paged_prefill.CONFIGS}
        if ms:
            return min(paged_prefill.tokens_per_tile(m, group) for m in ms), "tokens_per_tile"
    return paged_prefill.BLOCK_M, "BLOCK_M query tokens per program"


@functools.cache
def _prefill(lens: tuple[int, ...], q_lens: tuple[int, ...], hkv: int, group: int, d: int):
    tables, nblocks = _tables(list(lens), BS)
    k, v = _caches(nblocks, BS, hkv, d)
    q = torch.randn(sum(q_lens), hkv * group, d).to(torch.float16)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    with count_loads(k=k, v=v, table=tables) as got:
        paged_prefill.paged_prefill_attention(q, k, v, tables, cu, seq_lens, d**-0.5)
    return got


# long cached prefixes, 3 new tokens each: fewer than one query tile
EXTEND_LENS, EXTEND_Q = (300, 130), (3, 3)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_extend_reads_context_once_per_kv_head(group):
    tile, source = _prefill_tile_tokens(group)
    assert max(EXTEND_Q) <= tile, f"the case assumes one query tile ({tile} tokens, {source})"
    got = _prefill(EXTEND_LENS, EXTEND_Q, PREFILL_HKV, group, PREFILL_D)
    want = sum(EXTEND_LENS) * PREFILL_HKV * PREFILL_D * ITEM
    for name in ("k", "v"):
        assert _close(got[name], want), (
            f"{name}: {got[name]} B read = {got[name] / want:.2f} x once per KV head ({want} B)"
        )


@pytest.mark.parametrize("group", [1, 8])
def test_extend_reads_block_table_once_per_page(group):
    got = _prefill(EXTEND_LENS, EXTEND_Q, PREFILL_HKV, group, PREFILL_D)
    pages = sum(PREFILL_HKV * _pages(0, n, BS) for n in EXTEND_LENS)
    assert got.elements["table"] <= pages, (
        f"{got.elements['table']} block-table entries loaded for {pages} pages walked"
    )


FRESH = 200  # a fresh prompt: every token is a query


def _fresh_tiles(group: int) -> tuple[list[int], int, str]:
    """Keys visible to each query tile: tile t holds queries [t*T, (t+1)*T) and sees keys
    [0, min(n, (t+1)*T))."""
    tile, source = _prefill_tile_tokens(group)
    visible = [min(FRESH, (t + 1) * tile) for t in range(math.ceil(FRESH / tile))]
    return visible, tile, source


@pytest.mark.parametrize("group", [1, 4])
def test_prefill_reads_at_most_the_causal_keys_per_query_tile(group):
    got = _prefill((FRESH,), (FRESH,), 1, group, 32)
    visible, tile, source = _fresh_tiles(group)
    bound = sum(visible) * 32 * ITEM
    for name in ("k", "v"):
        assert got[name] <= bound * (1 + TOL), (
            f"{name}: {got[name]} B read, at most {bound} B for {len(visible)} query tiles of "
            f"{tile} tokens ({source}) per KV head"
        )


@pytest.mark.parametrize("group", [1, 4])
def test_prefill_reads_block_table_once_per_page(group):
    got = _prefill((FRESH,), (FRESH,), 1, group, 32)
    visible, _, _ = _fresh_tiles(group)
    pages = sum(_pages(0, x, BS) for x in visible)
    assert got.elements["table"] <= pages, (
        f"{got.elements['table']} block-table entries loaded for {pages} pages walked"
    )


# ---- MLA ---------------------------------------------------------------------------------------

MLA_DC, MLA_DR, MLA_LENS = 512, 64, (70, 33)


def _mla_heads_per_program(heads: int) -> int:
    if hasattr(mla_decode, "heads_per_program"):
        cap = mla_decode._capability(torch.device("cpu"))
        return mla_decode.heads_per_program(heads, cap)
    return mla_decode.BLOCK_H


@functools.cache
def _mla(heads: int) -> LoadCounter:
    dc, dr, lens = MLA_DC, MLA_DR, MLA_LENS
    tables, nblocks = _tables(list(lens), BS)
    cache = torch.randn(nblocks, BS, dc + dr).to(torch.float16)
    q_nope = torch.randn(len(lens), heads, dc).to(torch.float16) * 0.05
    q_pe = torch.randn(len(lens), heads, dr).to(torch.float16) * 0.05
    with count_loads(cache=cache, table=tables) as got:
        mla_decode.mla_decode_attention(
            q_nope, q_pe, cache, tables, torch.tensor(lens, dtype=torch.int32),
            (dc + dr) ** -0.5, num_splits=1, max_seq_len=max(lens),
        )  # fmt: skip
    return got


@pytest.mark.parametrize("heads", [16, 32, 128])
def test_mla_reads_latent_once_per_request(heads):
    got = _mla(heads)
    once = sum(MLA_LENS) * (MLA_DC + MLA_DR) * ITEM
    per_program = _mla_heads_per_program(heads)
    # the target: one read per request while the heads fit one program (16 and 32 heads); above
    # that, once per group of heads (the module's documented heads per program)
    times = 1 if heads <= 32 else math.ceil(heads / per_program)
    assert _close(got["cache"], times * once), (
        f"{heads} heads: latent read {got['cache'] / once:.2f} x per request, expected {times} "
        f"(heads per program: {per_program})"
    )


def _mla_tile(heads: int) -> int:
    """The keys per tile of the config MLA decode plans for the ``_mla`` case."""
    tables, _ = _tables(list(MLA_LENS), BS)
    plan = mla_decode.plan_mla_decode(
        tables, torch.tensor(MLA_LENS, dtype=torch.int32), num_heads=heads,
        kv_lora_rank=MLA_DC, qk_rope_head_dim=MLA_DR, block_size=BS,
        cache_dtype=torch.float16, q_dtype=torch.float16, scale=1.0, num_splits=1,
        max_seq_len=max(MLA_LENS),
    )  # fmt: skip
    return plan.config.block_n


@pytest.mark.parametrize("heads", [32, 128])
def test_mla_reads_block_table_once_per_page(heads):
    """One id per page a program walks with one-page tiles; a tile of several pages loads one
    id per row instead (what Triton 3.6's pipeliner multi-buffers), 4 bytes a token beside the
    latent's 1,152: then once per token walked."""
    got = _mla(heads)
    groups = math.ceil(heads / _mla_heads_per_program(heads))
    if _mla_tile(heads) <= BS:
        bound, what = sum(groups * _pages(0, n, BS) for n in MLA_LENS), "pages walked"
    else:
        bound, what = sum(groups * n for n in MLA_LENS), "tokens walked"
    assert got.elements["table"] <= bound, (
        f"{got.elements['table']} block-table entries loaded for {bound} {what}"
    )
