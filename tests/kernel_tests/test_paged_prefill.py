"""Paged prefill / extend attention against the torch reference on every layout, every config of
``CONFIGS``, the plan/run API and the default table's invariants."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from hybridkv.layouts import LAYOUTS
from hybridkv_kernels import paged_prefill
from hybridkv_kernels.cache_write import write_kv_cache_ref
from hybridkv_kernels.paged_prefill import (
    CONFIGS,
    PrefillConfig,
    PrefillShape,
    choose_config,
    config_fits,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    plan_prefill,
)

from .paged import SYNTHETIC, plan_caches, synthetic_caches
from .test_paged_decode import _fill

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def _cid(c: PrefillConfig) -> str:
    return f"{c.block_m}x{c.block_n}-w{c.num_warps}-s{c.num_stages}" + ("-hopper" * c.hopper)


#: the generic kernel's configs (the Hopper path's are in test_paged_prefill_hopper.py)
GENERIC = [c for c in CONFIGS if not c.hopper]


def _cu(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)


def _run(k_cache, v_cache, lens, q_lens, hq, dtype, window=None, config=None):
    tables = _fill(k_cache, v_cache, lens, dtype)
    dk = k_cache.shape[3]
    cu = _cu(q_lens)
    q = torch.randn(int(cu[-1]), hq, dk).to(dtype)
    seq = torch.tensor(lens, dtype=torch.int32)
    scale = 1 / math.sqrt(dk)
    out = torch.full((q.shape[0], hq, v_cache.shape[3]), float("nan"), dtype=dtype)
    got = paged_prefill_attention(
        q, k_cache, v_cache, tables, cu, seq, scale, window, out=out, config=config
    )
    assert got.data_ptr() == out.data_ptr()
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


# ---- every config ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, window",
    [(torch.float16, None), (torch.float32, 37)],
    ids=["fp16-causal", "fp32-window37"],
)
@pytest.mark.parametrize("config", GENERIC, ids=_cid)
def test_every_config_matches_the_reference(config, dtype, window):
    """What a GPU may run (a table row, a forced config, the autotuner's pick): an extend after a
    long prefix, a request with no query token, a fresh prompt over several query tiles, GQA 4
    padded to the tile, head dims that are not powers of two and differ for K and V."""
    lens, q_lens = [133, 40, 9, 70], [35, 0, 9, 70]
    num_blocks = sum(math.ceil(n / 16) for n in lens) + 4
    _, k_cache, v_cache = synthetic_caches("head-major", num_blocks, 16, 2, 40, 24, dtype)
    _run(k_cache, v_cache, lens, q_lens, 8, dtype, window, config=config)


@pytest.mark.parametrize("block_size", [16, 48, 544], ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("config", [c for c in GENERIC if c.block_n == 16], ids=_cid)
def test_block_n_16_configs_walk_pages(config, block_size):
    """16-key tiles: one page segment on 16-token pages, inside odd-multiple pages (48 = 3 x 16),
    and many tiles to a page (544 = 17 x 32, vLLM's inflated Qwen3-Next block)."""
    lens, q_lens = [600, 100], [24, 100]
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 3
    _, k_cache, v_cache = synthetic_caches(
        "packed3-layer1", num_blocks, block_size, 1, 32, 32, torch.float16
    )
    _run(k_cache, v_cache, lens, q_lens, 4, torch.float16, config=config)


# ---- plan / run --------------------------------------------------------------------------------


def _layer(backing: torch.Tensor, view: torch.Tensor, layer_elems: int) -> torch.Tensor:
    """The same view one layer further into a packed page."""
    return torch.as_strided(
        backing, view.shape, view.stride(), view.storage_offset() + layer_elems
    )


def _write(k_cache, v_cache, tables, lens, dtype):
    """Random K/V for every request at the slots ``tables`` gives it."""
    block_size = k_cache.shape[1]
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[b, pos // block_size].long() * block_size + pos % block_size
        k = torch.randn(n, k_cache.shape[2], k_cache.shape[3]).to(dtype)
        v = torch.randn(n, v_cache.shape[2], v_cache.shape[3]).to(dtype)
        write_kv_cache_ref(k, v, k_cache, v_cache, slots)


def test_plan_reused_across_two_layers():
    """One plan serves two layers (two cache views of one packed buffer, two queries): each
    output equals the reference of its own layer, written into the given ``out``."""
    lens, q_lens, hq, hkv, d, bs = [90, 33, 7], [20, 33, 0], 8, 2, 32, 16
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 4
    backing, k1, v1 = synthetic_caches("packed3-layer1", num_blocks, bs, hkv, d, d, torch.float16)
    layer = bs * hkv * 2 * d  # one layer's K and V in a page
    k2, v2 = _layer(backing, k1, layer), _layer(backing, v1, layer)
    tables = _fill(k1, v1, lens, torch.float16)
    _write(k2, v2, tables, lens, torch.float16)
    cu, seq = _cu(q_lens), torch.tensor(lens, dtype=torch.int32)
    total = int(cu[-1])
    plan = plan_prefill(
        tables,
        cu,
        seq,
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        cache_dtype=torch.float16,
        q_dtype=torch.float16,
        scale=d**-0.5,
        total_q=total,
        max_query_len=max(q_lens),
        max_seq_len=max(lens),
        sliding_window=50,
    )
    assert plan.grid == (total // paged_prefill.tokens_per_tile(plan.config.block_m, 4) + 3, 2)
    assert plan.shape.query == 64 and plan.shape.context == 128
    for k, v in ((k1, v1), (k2, v2)):
        q = torch.randn(total, hq, d).half()
        out = torch.full((total, hq, d), float("nan"), dtype=torch.float16)
        got = plan.run(q, k, v, out=out)
        assert got.data_ptr() == out.data_ptr()
        want = paged_prefill_attention_ref(q, k, v, tables, cu, seq, d**-0.5, 50)
        assert not torch.isnan(out).any()
        assert (out.float() - want.float()).abs().max() <= TOL[torch.float16]


def _small_plan(cache_dtype=torch.float16, q_dtype=torch.float16, **kw):
    _, k, v = synthetic_caches("classic", 6, 16, 2, 16, 16, torch.float32)
    tables = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)
    plan = plan_prefill(
        tables,
        torch.tensor([0, 3, 5], dtype=torch.int32),
        torch.tensor([40, 20], dtype=torch.int32),
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=16,
        cache_dtype=cache_dtype,
        q_dtype=q_dtype,
        scale=0.25,
        total_q=5,
        **kw,
    )
    return plan, k.to(cache_dtype), v.to(cache_dtype)


@pytest.mark.parametrize(
    "case, match",
    [
        ("q-rows", r"q must be \[5, 4, 16\] torch.float16"),
        ("q-heads", r"q must be \[5, 4, 16\]"),
        ("q-dtype", r"q must be \[5, 4, 16\] torch.float16"),
        ("cache-block-size", r"k_cache/v_cache must be \[num_blocks, 16, 2, 16/16\]"),
        ("cache-heads", r"k_cache/v_cache must be"),
        ("cache-dtype", r"torch.float16 views"),
        ("v-head-dim", r"k_cache/v_cache must be"),
        ("out-dtype", r"out must be \[5, 4, 16\] torch.float16"),
    ],
)
def test_run_rejects_other_shapes_and_dtypes(case, match):
    plan, k, v = _small_plan()
    q = torch.randn(5, 4, 16).half()
    out = None
    if case == "q-rows":
        q = torch.randn(6, 4, 16).half()
    elif case == "q-heads":
        q = torch.randn(5, 8, 16).half()
    elif case == "q-dtype":
        q = q.float()
    elif case == "cache-block-size":
        k, v = (t.reshape(12, 8, 2, 16) for t in (k.contiguous(), v.contiguous()))
    elif case == "cache-heads":
        k, v = (t.reshape(6, 16, 1, 32)[..., :16] for t in (k.contiguous(), v.contiguous()))
    elif case == "cache-dtype":
        k, v = k.float(), v.float()
    elif case == "v-head-dim":
        v = torch.zeros(6, 16, 2, 32, dtype=torch.float16)
    else:
        out = torch.empty(5, 4, 16)
    with pytest.raises(ValueError, match=match):
        plan.run(q, k, v, out=out)


def test_run_fp8_needs_scales():
    plan, k, v = _small_plan(cache_dtype=torch.float8_e5m2)
    q = torch.randn(5, 4, 16).half()
    with pytest.raises(ValueError, match="an fp8 cache needs k_scale"):
        plan.run(q, k, v)
    with pytest.raises(ValueError, match="an fp8 cache needs v_scale"):
        plan.run(q, k, v, torch.tensor([0.5]), torch.tensor([1], dtype=torch.int32))


def test_autotune_refused_under_the_interpreter():
    _, k, v = synthetic_caches("classic", 6, 16, 2, 16, 16, torch.float16)
    tables = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    cu, seq = _cu([5]), torch.tensor([40], dtype=torch.int32)
    q = torch.randn(5, 4, 16).half()
    with pytest.raises(ValueError, match="autotune=True needs a GPU"):
        paged_prefill_attention(q, k, v, tables, cu, seq, 0.25, autotune=True)


def test_plan_rejects_unknown_config_and_config_with_autotune(monkeypatch):
    tables = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    kw = dict(
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=16,
        cache_dtype=torch.float16,
        q_dtype=torch.float16,
        scale=0.25,
        total_q=5,
    )
    args = (tables, _cu([5]), torch.tensor([40], dtype=torch.int32))
    with pytest.raises(ValueError, match="is not one of CONFIGS"):
        plan_prefill(*args, config=PrefillConfig(16, 16, 1, 1), **kw)
    monkeypatch.setattr(paged_prefill, "_INTERPRETED", False)  # as on a GPU
    with pytest.raises(ValueError, match="not both"):
        plan_prefill(*args, config=CONFIGS[0], autotune=True, **kw)


def test_plan_reads_no_device_data():
    """Planning a step never syncs: with index tensors on the meta device (nothing to read
    back) the plan is made from host-known sizes alone; without ``max_query_len`` /
    ``max_seq_len`` the bounds are ``total_q`` and the block table's width."""
    meta = torch.device("meta")
    tables = torch.empty(3, 40, dtype=torch.int32, device=meta)
    plan = plan_prefill(
        tables,
        torch.empty(4, dtype=torch.int32, device=meta),
        torch.empty(3, dtype=torch.int32, device=meta),
        num_heads=16,
        num_kv_heads=2,
        head_dim=256,
        block_size=16,
        cache_dtype=torch.bfloat16,
        q_dtype=torch.bfloat16,
        scale=1 / 16,
        total_q=1000,
    )
    assert (plan.max_query_len, plan.max_seq_len) == (1000, 640)
    assert (plan.shape.query, plan.shape.context) == (1024, 1024)
    tiles = 1000 // paged_prefill.tokens_per_tile(plan.config.block_m, 8) + 3
    assert plan.grid == (tiles, 2)


def test_reference_builds_on_q_device():
    """The reference's positions and masks live on ``q``'s device (a CPU mask on CUDA scores
    failed on the GPU); the meta device stands in for CUDA here."""
    meta = torch.device("meta")
    q = torch.empty(5, 4, 16, device=meta)
    k = torch.empty(4, 16, 2, 16, device=meta)
    tables = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    out = paged_prefill_attention_ref(
        q, k, k, tables, _cu([5]), torch.tensor([40], dtype=torch.int32), 0.25, 16
    )
    assert out.device == meta and out.shape == (5, 4, 16)


# ---- the default table -------------------------------------------------------------------------

#: every shape class the table's invariants are checked over
_ARCHS = (80, 86, 89, 90, 100)
_PAGES = (1, 2, 4, 8, 16, 32, 64)
_HEAD_DIMS = (16, 32, 64, 128, 256)
_GROUPS = (1, 2, 3, 4, 8, 16, 32)
_CACHES = ("16bit", "fp32", "fp8", "fp8-bytes")
_QUERIES = (1, 16, 512, 1024, 8192, 1 << 20)


def _classes():
    for arch, page, d, g, cache, query in itertools.product(
        _ARCHS, _PAGES, _HEAD_DIMS, _GROUPS, _CACHES, _QUERIES
    ):
        if cache == "fp8-bytes" and arch >= 89:
            continue  # hardware e4m3 there
        yield PrefillShape(arch, page, g, d, cache, query, 8192)


def test_table_rows_use_configs_and_fit_their_classes():
    """Every row's config is one of CONFIGS, fits every shape class the row matches (so the
    first matching row is what runs), says where it comes from, and matches some class."""
    classes = list(_classes())
    for rule in paged_prefill._TABLE:
        assert rule.config in CONFIGS, rule
        if rule.rel:  # rows for relative-bias launches: test_prefill_relative_bias_...
            continue
        assert rule.source.startswith(("H200", "unmeasured: ")), rule.source
        if rule.triton < paged_prefill._TRITON_VERSION:
            # a row for older Tritons matches nothing here; it must name the version it stops at
            assert f"Triton <= {rule.triton[0]}.{rule.triton[1]}" in rule.source, rule
            continue
        matched = [s for s in classes if rule.matches(s)]
        assert matched, f"{rule} matches no shape class"
        bad = [s for s in matched if not config_fits(rule.config, s)]
        assert not bad, f"{rule.config} does not fit {bad[0]} (row: {rule.source})"
        if rule.source.startswith("H200"):  # measured on an H200 (bf16 or e4m3 caches)
            assert rule.arch[0] >= 90 and set(rule.caches) & {"16bit", "fp8"}, rule


def test_table_covers_the_usual_classes():
    """GQA 1-16, head dims 64-256, pages of 16 tokens and more, every cache dtype, sm_80 and
    sm_90: a table row, never the fallback."""
    for shape in _classes():
        usual = shape.page_align >= 16 and shape.head_dim >= 64 and shape.group <= 16
        if usual and shape.arch in (80, 90):
            _, source = choose_config(shape)
            assert not source.startswith("no "), (shape, source)


_HOPPER_128 = PrefillConfig(128, 128, 8, 2, hopper=True)


@pytest.mark.parametrize(
    "hq, hkv, d, block_size, want, number",
    [
        # the Hopper path's 128 x 64 tile at d 256 holds up to Triton 3.6 (it spills under 3.9)
        pytest.param(
            16,
            2,
            256,
            16,
            *(
                (PrefillConfig(128, 64, 8, 2, hopper=True), "454.1")
                if paged_prefill._TRITON_VERSION <= (3, 6)
                else (PrefillConfig(128, 64, 8, 3), "359.5")
            ),
            id="qwen3next-bs16",
        ),
        pytest.param(16, 2, 256, 576, PrefillConfig(128, 32, 8, 3), "376.3", id="qwen3next-bs576"),
        pytest.param(32, 8, 128, 16, _HOPPER_128, "381.8", id="nemotronh-bs16"),
        pytest.param(32, 8, 128, 272, _HOPPER_128, "304.0", id="nemotronh-bs272"),
        pytest.param(
            32, 2, 128, 64, PrefillConfig(64, 64, 4, 3, hopper=True), "427.3", id="gqa16-bs64"
        ),
    ],
)
def test_measured_winners_are_the_h200_defaults(hq, hkv, d, block_size, want, number, monkeypatch):
    """The GPU suite's shapes (one 8k bf16 request) on sm_90 get the sweep's best config, with
    the measurement as the source; every winner is one of CONFIGS."""
    assert want in CONFIGS
    monkeypatch.setattr(paged_prefill, "_capability", lambda device: (9, 0))
    meta = torch.device("meta")
    plan = plan_prefill(
        torch.empty(1, 8192 // block_size + 1, dtype=torch.int32, device=meta),
        torch.empty(2, dtype=torch.int32, device=meta),
        torch.empty(1, dtype=torch.int32, device=meta),
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=block_size,
        cache_dtype=torch.bfloat16,
        q_dtype=torch.bfloat16,
        scale=d**-0.5,
        total_q=8192,
        max_query_len=8192,
        max_seq_len=8192,
    )
    assert plan.config == want
    assert number in plan.config_source


def test_sm80_defaults_fit_sm80():
    """Where an sm_90 winner spills on sm_80, the sm_80 rows choose a config that does not."""
    for shape in _classes():
        if shape.arch == 80 and shape.page_align >= 16 and shape.group <= 16:
            config, source = choose_config(shape)
            assert config_fits(config, shape), (shape, config, source)


# ---- the cases kept from before the plan/run rework ---------------------------------------------


@pytest.mark.parametrize(
    "layout, cache_formats",
    [*((layout, "transformers") for layout in LAYOUTS), ("inflate", "vllm")],
)
def test_prefill_on_real_plans(layout, cache_formats):
    # vllm: K and V side by side per token and head in a page, as vLLM keeps it
    _, k_cache, v_cache = plan_caches(layout, "float16", cache_formats=cache_formats)
    _run(k_cache, v_cache, [50, 33], [20, 33], 4, torch.float16)


def test_prefill_errors():
    _, k, v = synthetic_caches("classic", 4, 16, 2, 16, 16, torch.float32)
    q = torch.randn(5, 4, 16)
    tables = torch.ones(1, 4, dtype=torch.int32)
    seq = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="more query tokens"):
        paged_prefill_attention(
            q, k, v, tables, torch.tensor([0, 5]).int(), seq, 1.0, validate=True
        )
    with pytest.raises(ValueError, match="rise from 0"):
        paged_prefill_attention(
            q, k, v, tables, torch.tensor([0, 4]).int(), seq, 1.0, validate=True
        )
    with pytest.raises(ValueError, match="multiple of Hkv"):
        paged_prefill_attention(
            torch.randn(5, 3, 16), k, v, tables, torch.tensor([0, 5]).int(), seq, 1.0
        )
    with pytest.raises(ValueError, match="max_seq_len 80 needs 5 blocks"):
        paged_prefill_attention(
            q, k, v, tables, torch.tensor([0, 5]).int(), seq, 1.0, max_seq_len=80
        )


@pytest.mark.parametrize("layout", SYNTHETIC)
@pytest.mark.parametrize(
    "ctx_len, q_len, window, block_size",
    [
        pytest.param(300, 40, 64, 16, id="w64-bs16"),
        pytest.param(500, 33, 100, 48, id="w100-bs48-ragged-tile"),
        pytest.param(1000, 70, 256, 128, id="w256-bs128"),
    ],
)
def test_prefill_window_ignores_freed_blocks(layout, ctx_len, q_len, window, block_size):
    """What an allocator does for a sliding-window layer: blocks wholly below the window of the
    chunk's first query are freed to the null block 0, whose bytes nothing initialises. Here the
    null block and the freed blocks hold NaN; a kernel that lets them into ``p @ v`` (0 x NaN)
    returns NaN for whole query tiles."""
    seq_len = ctx_len + q_len
    num_blocks = math.ceil(seq_len / block_size) + 4
    _, k_cache, v_cache = synthetic_caches(
        layout, num_blocks, block_size, 2, 32, 32, torch.float16
    )
    tables = _fill(k_cache, v_cache, [seq_len], torch.float16)
    first_visible = ctx_len - window + 1  # of the chunk's first query token
    freed = first_visible // block_size  # blocks [0, freed) hold no visible key
    for b in tables[0, :freed].tolist():
        k_cache[b] = float("nan")
        v_cache[b] = float("nan")
    tables[0, :freed] = 0
    k_cache[0] = float("nan")
    v_cache[0] = float("nan")
    cu = torch.tensor([0, q_len], dtype=torch.int32)
    seq = torch.tensor([seq_len], dtype=torch.int32)
    q = torch.randn(q_len, 4, 32).half()
    out = torch.full((q_len, 4, 32), float("nan"), dtype=torch.float16)
    got = paged_prefill_attention(q, k_cache, v_cache, tables, cu, seq, 32**-0.5, window, out=out)
    assert got.data_ptr() == out.data_ptr()
    want = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, seq, 32**-0.5, window)
    assert not torch.isnan(want).any(), "the reference must not see the freed blocks either"
    assert not torch.isnan(out).any()
    assert (out.float() - want.float()).abs().max() <= TOL[torch.float16]


@pytest.mark.parametrize(
    "lens, q_lens, hq, hkv, block_size",
    [
        pytest.param([40, 7, 90, 5], [40, 0, 33, 0], 8, 2, 16, id="empty-requests-gqa4"),
        pytest.param([200, 64], [70, 64], 16, 1, 48, id="gqa16-bs48"),
        pytest.param([300], [45], 12, 4, 544, id="gqa3-bs544"),
        pytest.param([129, 17], [129, 17], 2, 2, 128, id="mha-bs128"),
        pytest.param([77], [77], 4, 1, 7, id="bs7"),
        pytest.param([100, 3], [20, 3], 6, 3, 80, id="bs80"),
    ],
)
def test_prefill_varlen_page_walk(lens, q_lens, hq, hkv, block_size):
    """Requests with no query token (their grid programs must exit), GQA groups that fill a
    tile's rows, and page sizes whose segments are 16, 32, 64 or 1 tokens."""
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 3
    _, k_cache, v_cache = synthetic_caches(
        "packed3-layer1", num_blocks, block_size, hkv, 32, 32, torch.float16
    )
    _run(k_cache, v_cache, lens, q_lens, hq, torch.float16)


@pytest.mark.parametrize("head_dim", [64, 256], ids=["d64", "d256"])
@pytest.mark.parametrize("software", [False, True], ids=["hw-convert", "byte-decode"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_prefill_fp8(dtype, software, head_dim, monkeypatch):
    """``byte-decode`` is the sm_80 path for e4m3 caches (no hardware e4m3): the kernel gets the
    bytes and decodes them itself, with the config the sm_80 rows choose for it. Every e4m3
    byte value but NaN, subnormals included, lands in the first request."""
    from .test_paged_decode import _fp8_caches

    if software:
        monkeypatch.setattr(paged_prefill, "_fp8e4_in_hardware", lambda device: False)
    k8, v8 = _fp8_caches(20, 16, 2, head_dim, dtype)
    lens, q_lens = [70, 9, 130], [70, 4, 30]
    tables = _fill(k8, v8, lens, dtype)
    if dtype == torch.float8_e4m3fn:
        raw = torch.arange(256, dtype=torch.uint8)
        raw = raw[(raw & 0x7F) != 0x7F]
        per_token = 2 * head_dim  # 2 KV heads
        rows = math.ceil(raw.numel() / per_token)
        raw = raw.repeat(rows * per_token // raw.numel() + 1)[: rows * per_token]
        k8[int(tables[0, 0]), :rows] = raw.view(dtype).reshape(rows, 2, head_dim)
    cu = _cu(q_lens)
    q = torch.randn(int(cu[-1]), 4, head_dim, dtype=torch.float16)
    ks, vs = torch.tensor(0.5), torch.tensor(0.25)
    seq = torch.tensor(lens, dtype=torch.int32)
    got = paged_prefill_attention(q, k8, v8, tables, cu, seq, 0.2, k_scale=ks, v_scale=vs)
    want = paged_prefill_attention_ref(q, k8, v8, tables, cu, seq, 0.2, k_scale=ks, v_scale=vs)
    assert not torch.isnan(got).any()
    assert (got.float() - want.float()).abs().max() < 3e-3


@pytest.mark.parametrize(
    "case, match",
    [
        ("block-id-num_blocks", r"block_tables\[0, 1\] = 6 is outside \[0, 6\)"),
        ("block-id-minus-1", r"block_tables\[1, 0\] = -1 is outside"),
        ("seq_len-0", r"seq_lens\[1\] = 0: every request needs seq_len >= 1"),
        ("cu-not-from-0", r"cu_seqlens_q must rise from 0"),
        ("table-too-narrow", r"block_tables has 3 columns, needs 4"),
        ("max_query_len-too-small", r"request 0 has 3 query tokens, more than max_query_len = 2"),
        ("max_seq_len-too-small", r"seq_lens\[0\] = 40 exceeds max_seq_len = 33"),
    ],
)
def test_prefill_validate_catches_bad_input(case, match, monkeypatch):
    _, k, v = synthetic_caches("classic", 6, 16, 2, 16, 16, torch.float32)
    tables = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)
    seq = torch.tensor([40, 20], dtype=torch.int32)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    bounds: dict = {}
    if case == "block-id-num_blocks":
        tables[0, 1] = 6
    elif case == "block-id-minus-1":
        tables[1, 0] = -1
    elif case == "seq_len-0":
        seq[1], cu[2] = 0, 3
    elif case == "cu-not-from-0":
        cu[0] = 1
    elif case == "max_query_len-too-small":
        bounds["max_query_len"] = 2
    elif case == "max_seq_len-too-small":
        bounds["max_seq_len"] = 33
    else:
        seq[0] = 60
    q = torch.randn(int(cu[-1]), 4, 16)
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(q, k, v, tables, cu, seq, 0.25, validate=True, **bounds)
    monkeypatch.setenv("HYBRIDKV_VALIDATE", "1")
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(q, k, v, tables, cu, seq, 0.25, **bounds)


@pytest.mark.parametrize("window", [None, 24], ids=["causal", "window24"])
@pytest.mark.parametrize(
    ("config", "dtype"),
    [
        (GENERIC[0], torch.float32),
        (GENERIC[0], torch.float16),
        # the Hopper path reads 16-bit and fp8 caches only
        (next(c for c in CONFIGS if c.hopper and c.block_n == 16), torch.float16),
    ],
    ids=lambda v: _cid(v) if isinstance(v, PrefillConfig) else str(v).split(".")[-1],
)
def test_prefill_with_attention_sinks(config, dtype, window):
    """Per-head sink logits (GraniteSWA, GPT-OSS): one more logit in each head's softmax, with
    no value, on the generic and the Hopper path; an extend after cached tokens and a fresh
    prompt in one varlen batch."""
    lens, q_lens, hq, hkv, d, bs = [90, 37], [30, 37], 6, 2, 32, 16
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 4
    _, k_cache, v_cache = synthetic_caches("classic", num_blocks, bs, hkv, d, d, dtype)
    tables = _fill(k_cache, v_cache, lens, dtype)
    cu, seq = _cu(q_lens), torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d).to(dtype)
    sinks = torch.randn(hq) * 4
    sinks[1] = 12.0  # the sink takes almost all of head 1's weight
    out = torch.full((q.shape[0], hq, d), float("nan"), dtype=dtype)
    got = paged_prefill_attention(
        q, k_cache, v_cache, tables, cu, seq, 0.2, window, out=out, config=config, sinks=sinks
    )
    want = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, seq, 0.2, window,
                                       sinks=sinks)  # fmt: skip
    plain = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, seq, 0.2, window)
    assert not torch.isnan(got).any()
    assert (got.float() - want.float()).abs().max() <= TOL[dtype]
    assert want[:, 1].abs().max() < 0.1 * plain[:, 1].abs().max()
    assert (want.float() - plain.float()).abs().max() > 10 * TOL[dtype]


def test_prefill_sinks_are_planned_for():
    plan, k, v = _small_plan()
    q = torch.randn(5, 4, 16).half()
    with pytest.raises(ValueError, match="plan with sinks=True"):
        plan.run(q, k, v, sinks=torch.zeros(4))
    with_sinks = dataclasses.replace(plan, has_sinks=True)
    with pytest.raises(ValueError, match="pass the layer's sinks"):
        with_sinks.run(q, k, v)
    with pytest.raises(ValueError, match=r"sinks must be \[4\] float32"):
        with_sinks.run(q, k, v, sinks=torch.zeros(4, 1))


#: the table's tile for relative-bias launches at GQA >= 4, and GQA 1-2's (_REL_CONFIGS)
_REL_WIDE, _REL_NARROW = PrefillConfig(64, 16, 8, 3), PrefillConfig(32, 32, 8, 3)


@pytest.mark.parametrize("window", [None, 64], ids=["causal", "window64"])
@pytest.mark.parametrize(
    ("config", "dtype", "hkv"),
    [
        (_REL_WIDE, torch.float32, 2),  # GQA 3: 16 query tokens a tile, as many as keys
        (_REL_WIDE, torch.float16, 6),  # GQA 1: 64 query tokens a tile, more than keys
        (_REL_NARROW, torch.float16, 2),  # GQA 3: 8 query tokens a tile, fewer than keys
    ],
    ids=["64x16-gqa3-fp32", "64x16-gqa1-fp16", "32x32-gqa3-fp16"],
)
def test_prefill_with_relative_bias(config, dtype, hkv, window):
    """Inkling's relative-position bias on varlen chunks that start mid-context (60 and 65
    tokens cached) beside a fresh prompt: every distance from 0 to 89 occurs and rel_extent is
    45, so tiles straddle it; the 64-token window is wider than it (masked tiles below the band
    run unbiased). Against the torch reference; the bias matters (rel_proj zeroed gives the
    plain attention, beyond tolerance away)."""
    lens, q_lens, hq, d, rel_dim, extent = [90, 37, 70], [30, 37, 5], 6, 32, 16, 45
    num_blocks = sum(math.ceil(n / 16) for n in lens) + 4
    _, k_cache, v_cache = synthetic_caches("classic", num_blocks, 16, hkv, d, d, dtype)
    tables = _fill(k_cache, v_cache, lens, dtype)
    cu, seq = _cu(q_lens), torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d).to(dtype)
    rel_states = torch.randn(q.shape[0], hq, rel_dim).to(dtype)
    rel_proj = (torch.randn(rel_dim, extent) / math.sqrt(rel_dim)).to(dtype)

    def run(proj):
        out = torch.full((q.shape[0], hq, d), float("nan"), dtype=dtype)
        return paged_prefill_attention(q, k_cache, v_cache, tables, cu, seq, 0.2, window,
                                       out=out, config=config, rel_states=rel_states,
                                       rel_proj=proj)  # fmt: skip

    got, zeroed = run(rel_proj), run(torch.zeros_like(rel_proj))
    want = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, seq, 0.2, window,
                                       rel_states=rel_states, rel_proj=rel_proj)  # fmt: skip
    plain = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, seq, 0.2, window)
    assert not torch.isnan(got).any()
    # fp16 outputs reach ~3 where the bias sharpens a softmax: two ulps of fp16 there
    tol = TOL[dtype] * max(1.0, want.float().abs().max().item())
    assert (got.float() - want.float()).abs().max() <= tol
    assert (zeroed.float() - plain.float()).abs().max() <= tol
    assert (got.float() - zeroed.float()).abs().max() > 10 * tol


def test_prefill_relative_bias_takes_the_generic_path():
    """Relative-bias launches never get a Hopper-path config (the table skips them, a given
    one is refused), and every default they get is one the compile check found spill-free
    with the bias."""
    rows = [rule for rule in paged_prefill._TABLE if rule.rel]
    assert all(rule.source.startswith("unmeasured: ") for rule in rows)
    for shape in (dataclasses.replace(s, rel=True) for s in _classes()):
        # a row's config fits every class the row matches, and rows match rel classes only
        assert all(config_fits(r.config, shape) for r in rows if r.matches(shape)), shape
        assert not any(r.matches(dataclasses.replace(shape, rel=False)) for r in rows)
        config = choose_config(shape)[0]
        assert not config.hopper, (shape, config)
        if config_fits(config, shape):
            assert config in paged_prefill._REL_CONFIGS, (shape, config)
            assert paged_prefill._rel_band_values(config, shape) <= 8
    inkling = PrefillShape(90, 16, 8, 128, "16bit", 2048, 8192, rel=True)
    assert choose_config(inkling)[0] == _REL_WIDE
    assert choose_config(dataclasses.replace(inkling, rel=False))[0].hopper
    hopper = next(c for c in CONFIGS if c.hopper)
    with pytest.raises(ValueError, match="takes no relative-position bias"):
        _small_plan(config=hopper, rel_dim=16)


def test_prefill_relative_bias_is_planned_for():
    plan, k, v = _small_plan()
    q = torch.randn(5, 4, 16).half()
    states, proj = torch.zeros(5, 4, 16).half(), torch.zeros(16, 8).half()
    with pytest.raises(ValueError, match="plan with rel_dim="):
        plan.run(q, k, v, rel_states=states, rel_proj=proj)
    planned, _, _ = _small_plan(rel_dim=16)
    with pytest.raises(ValueError, match=r"rel_states \[total_q, Hq, 16\]"):
        planned.run(q, k, v)
    with pytest.raises(ValueError, match=r"rel_states must be \[total_q=5, Hq=4, rel_dim=16\]"):
        planned.run(q, k, v, rel_states=states[:4], rel_proj=proj)
    with pytest.raises(ValueError, match="pass rel_states and rel_proj together"):
        planned.run(q, k, v, rel_proj=proj)
    with pytest.raises(ValueError, match=r"rel_states must be torch\.float16"):
        planned.run(q, k, v, rel_states=states.float(), rel_proj=proj)
