"""``hybridkv.layouts.vllm_packed``: GLM-5-Next and Qwen4-Exp planned as vLLM 0.33 packs them.

The export's tests (``tests/test_vllm_export.py``) hold the resulting ``KVCacheConfig`` to
vLLM's numbers; these hold the plan itself together: its pages where the config says, its
capacity worked by hand, its refusals.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from hybridkv import models
from hybridkv.alloc import HybridAllocator
from hybridkv.dtypes import dtype_bytes
from hybridkv.layouts import make_plan
from hybridkv.plan import KVPlacement
from hybridkv.target import VllmTarget

transformers = pytest.importorskip("transformers")

VLLM = VllmTarget(cache_formats="vllm")


def _model(text_config=None, **options):
    config = transformers.Glm5NextConfig(text_config=text_config or None).to_dict()
    return models.from_hf_config(config, **options)


@pytest.fixture(scope="module")
def plan():
    return make_plan(_model(), "inflate", memory="64GiB", max_num_seqs=8, target=VLLM)


_QWEN4_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "qwen4_exp-qsa.json"


def _qwen4(text=None, **options):
    fields = {**json.loads(_QWEN4_EXAMPLE.read_text())["text_config"], **(text or {})}
    config = transformers.Qwen4ExpConfig(text_config=fields).to_dict()
    return models.from_hf_config(config, **options)


@pytest.fixture(scope="module")
def qwen4_plan():
    return make_plan(_qwen4(), "inflate", memory="64GiB", max_num_seqs=8, target=VLLM)


@pytest.fixture(params=["glm5_next", "qwen4_exp"])
def either_plan(request, plan, qwen4_plan):
    return plan if request.param == "glm5_next" else qwen4_plan


def test_pages_of_a_block_do_not_overlap(either_plan):
    """Inside one block a group's pages sit back to back from the block's start (as
    get_kv_cache_config_from_groups puts them: a state's page padded to the latent page) and
    within the block; groups alias each other from byte 0 (a block id is one group's at a
    time)."""
    plan = either_plan
    block_bytes = plan.pools[0].block_bytes
    b = 5
    for group in plan.groups:
        pages = []
        for p in plan.placements_of(group.group_id):
            regions = p.regions(b)
            if isinstance(p, KVPlacement):
                # a K/V page: K for every token, V right after it
                page = p.k_bytes_per_block + p.v_bytes_per_block
                assert all(r.start == q.end for q, r in itertools.pairwise(regions))
                assert regions[-1].end - regions[0].start == page
            else:
                page = group.page_bytes  # the state's components lie inside its padded page
                assert regions[-1].end <= regions[0].start + page
            pages.append((regions[0].start, page))
        pages.sort()
        assert pages[0][0] == b * block_bytes
        assert all(s + n == t for (s, n), (t, _) in itertools.pairwise(pages))
        assert pages[-1][0] + pages[-1][1] <= (b + 1) * block_bytes
        assert plan.id_data_bytes(group.group_id) <= plan.id_bytes(group.group_id) == block_bytes


def test_placements_hold_vllms_rows(plan):
    latent = plan.placement("layers.3.attn")
    indexer = plan.placement("layers.3.indexer")
    ring = plan.placement("layers.3.indexer.ring")
    assert isinstance(latent, KVPlacement) and latent.k_bytes_per_block == 4_608 * 1_024
    # one 132-byte entry (128 fp8 + a float32 scale) per 16 tokens: 288 rows
    assert (indexer.tokens_per_state, indexer.rows_per_block) == (16, 288)
    assert indexer.k_bytes_per_block == 288 * 132
    # BLHNC: the ring's two head slots (key, gate score) each hold its 16 slots together
    assert (ring.block_size, ring.num_kv_heads, ring.head_dim) == (16, 2, 128)
    assert (ring.token_stride, ring.head_stride) == (256, 16 * 256)
    assert [name for name, _ in ring.parts(1)] == ["ring"]
    assert [name for name, _ in indexer.parts(1)] == ["indexer"]
    buffers = plan.allocate("meta")
    k, v = plan.kv_views(buffers, "layers.3.indexer")
    assert v is None and tuple(k.shape) == (plan.pools[0].num_blocks, 288, 1, 132)
    k, _ = plan.kv_views(buffers, "layers.3.indexer.ring")
    assert tuple(k.shape) == (plan.pools[0].num_blocks, 16, 2, 128)
    views = plan.state_views(buffers, "layers.0.mixer")
    assert tuple(views["ssm"].shape)[1:] == (64, 128, 128)


def test_capacity_by_hand(plan):
    """1,312 blocks of 52,343,808 B: block 0 is the null block; 8 requests hold 1 id in each of
    the 4 KDA groups and 1 in the ring group (40); the latent group gets the other 1,271 blocks:
    1,271 x 4,608 = 5,856,768 tokens. The ideal, in vLLM's formats: 64 GiB less 8 x 34 x
    4,341,760 B of state and 8 x 11 x 8,192 B of rings, at 11 x (1,024 + 132 / 16) B a token."""
    cap = plan.capacity
    block_bytes = 52_343_808
    assert plan.pools[0].num_blocks == 1_312
    assert cap.token_capacity == (1_312 - 1 - 40) * 4_608 == 5_856_768
    assert cap.state_reserved_bytes == 40 * block_bytes
    assert cap.kv_reserved_bytes == 1_271 * block_bytes
    assert cap.unusable_bytes == 2**36 - 1_311 * block_bytes
    state, rings = 8 * 34 * 4_341_760, 8 * 11 * 8_192
    assert cap.state_bytes == state
    assert cap.ideal_token_capacity == (2**36 - state - rings) * 16 // (11 * (16 * 1_024 + 132))
    assert 0.98 < cap.fraction_of_ideal < 1


def _same_but_kv_order(a, b) -> None:
    """``b`` (vLLM's formats) is ``a`` (transformers') with K and V side by side per token
    and head in every attention page: the same groups, states, pages and capacity."""
    assert (a.groups, a.state_placements, a.capacity) == (b.groups, b.state_placements, b.capacity)
    assert b.kv_cache_layout is None
    for x, y in zip(a.kv_placements, b.kv_placements, strict=True):
        assert not x.interleaves_kv and y.interleaves_kv
        pair = (y.head_dim + y.head_dim_v) * dtype_bytes(y.dtype)
        assert (y.head_stride, y.token_stride) == (pair, pair * y.num_kv_heads)
        assert y.v_offset - y.k_offset == x.head_stride  # one head's K, then its V
        assert (
            dataclasses.replace(
                y, v_offset=x.v_offset, token_stride=x.token_stride, head_stride=x.head_stride
            )
            == x
        )


def test_other_models_differ_only_in_kv_order():
    """Only GLM-5-Next's and Qwen4-Exp's indexers have vLLM formats of their own; every other
    model plans the same pages in both, K and V interleaved per token and head in vLLM's."""
    model = models.load("qwen3.5-4b")
    a = make_plan(model, "inflate", memory="24GiB")
    b = make_plan(model, "inflate", memory="24GiB", target=VLLM)
    _same_but_kv_order(a, b)


@pytest.mark.parametrize("layout", ["pack", "aggregate", "per_group", "two_level"])
def test_only_inflate_lays_out_vllms_formats(layout):
    with pytest.raises(ValueError, match="which is layout 'inflate'"):
        make_plan(_model(), layout, memory="64GiB", target=VLLM)


@pytest.mark.parametrize(
    ("options", "target", "match"),
    [
        ({}, VllmTarget(cache_formats="vllm", version="0.32"), "vLLM 0.32's layout"),
        ({}, VllmTarget(cache_formats="vllm", gpu="ampere"), "none of its sparse MLA"),
        # 540 speculative tokens: a 1,024-slot ring (16 x next_power_of_2(cdiv(556, 16))) and a
        # block of 512 x cdiv(4,194,304 + 543 x 24,576 x 2, 512 x 1,024) = 512 x 59 = 30,208
        ({"num_spec_tokens": 540}, VLLM, "1024-slot tail ring does not divide the 30208"),
    ],
    ids=["vllm-0.32", "ampere", "ring"],
)
def test_refusals(options, target, match):
    with pytest.raises(ValueError, match=match):
        make_plan(_model(**options), "inflate", memory="64GiB", target=target)


def test_a_kernel_alignment_override_is_refused():
    with pytest.raises(ValueError, match="fix its kernel blocks"):
        make_plan(_model(), "inflate", memory="64GiB", target=VLLM, kernel_alignment=64)


def test_shared_indexer_layers_are_refused():
    """vLLM 0.33 builds an indexer on every MLA layer, ignoring indexer_types: a model whose
    'shared' layers keep no indexer cache has no vLLM layout to plan."""
    text = {
        "num_hidden_layers": 8,
        "layer_types": ["linear_attention"] * 3
        + ["indexed_attention"]
        + ["linear_attention"] * 3
        + ["indexed_attention"],
        "mlp_layer_types": ["dense"] * 8,
        "indexer_types": ["full"] * 4 + ["shared"] * 4,
    }
    with pytest.raises(ValueError, match=r"MLA layers \[7\] keep no indexer cache"):
        make_plan(_model(text), "inflate", memory="64GiB", target=VLLM)


def test_an_open_pool_left_out_is_refused():
    config = transformers.Glm5NextConfig().to_dict()
    config["text_config"]["index_kpool_always_select_tail"] = False
    model = models.from_hf_config(config)
    with pytest.raises(ValueError, match="_validate_supported_config"):
        make_plan(model, "inflate", memory="64GiB", target=VLLM)


# ---- Qwen4-Exp ------------------------------------------------------------------------------


def test_qwen4_exp_placements_hold_vllms_rows(qwen4_plan):
    """Block 576 (tests/test_vllm_export.py derives it): K/V of 2 heads x 256 (each token's
    and head's K, then its V: vLLM's BLNHC page), one compressed bf16 key of 128 per 4 tokens
    (144 rows), a 4-slot ring of one bf16 key of 128, GDN and PLE states back to back from
    their page's start."""
    plan = qwen4_plan
    attn = plan.placement("layers.3.attn")
    indexer = plan.placement("layers.3.indexer")
    ring = plan.placement("layers.3.indexer.ring")
    assert isinstance(attn, KVPlacement)
    assert (attn.num_kv_heads, attn.head_dim, attn.head_dim_v) == (2, 256, 256)
    assert attn.k_bytes_per_block == attn.v_bytes_per_block == 576 * 2 * 256 * 2
    assert attn.v_offset == attn.k_offset + 256 * 2
    assert (attn.token_stride, attn.head_stride) == (2 * 512 * 2, 512 * 2)
    assert (indexer.tokens_per_state, indexer.rows_per_block) == (4, 144)
    assert indexer.k_bytes_per_block == 144 * 128 * 2 and indexer.dtype == "bfloat16"
    assert (ring.block_size, ring.num_kv_heads, ring.head_dim, ring.token_stride) == (
        4,
        1,
        128,
        256,
    )
    assert [name for name, _ in attn.parts(1)] == ["K|V"]
    buffers = plan.allocate("meta")
    k, v = plan.kv_views(buffers, "layers.3.indexer")
    assert v is None and tuple(k.shape) == (plan.pools[0].num_blocks, 144, 1, 128)
    k, v = plan.kv_views(buffers, "layers.3.attn")
    assert tuple(k.shape) == tuple(v.shape) == (plan.pools[0].num_blocks, 576, 2, 256)
    assert tuple(plan.state_views(buffers, "layers.0.ple")["ple"].shape)[1:] == (9, 8_192)
    assert tuple(plan.state_views(buffers, "layers.0.mixer")["ssm"].shape)[1:] == (32, 128, 128)


def test_qwen4_exp_capacity_by_hand(qwen4_plan):
    """5,648 blocks of 12,165,120 B: block 0 is the null block; 8 requests hold 1 id in each of
    the 4 state groups (PLE and 3 GDN) and 1 in the ring group (40); the compressed + K/V group
    gets the other 5,607: 5,607 x 576 tokens. The ideal, in vLLM's formats: 64 GiB less 8 x
    (30 x 1,097,728 + 2 x 147,456) B of state and 8 x 10 x 1,024 B of rings, at 10 x (2,048 +
    256 / 4) B a token."""
    cap = qwen4_plan.capacity
    block_bytes = 12_165_120
    assert cap.token_capacity == (5_648 - 1 - 40) * 576 == 3_229_632
    assert cap.state_reserved_bytes == 40 * block_bytes
    assert cap.kv_reserved_bytes == 5_607 * block_bytes
    state, rings = 8 * (30 * 1_097_728 + 2 * 147_456), 8 * 10 * 1_024
    assert cap.state_bytes == state
    assert cap.ideal_token_capacity == (2**36 - state - rings) * 4 // (10 * (4 * 2_048 + 256))
    assert 0.95 < cap.fraction_of_ideal < 1


def test_qwen4_exp_without_an_indexer_is_the_plain_inflate():
    """Without the indexer_* fields vLLM builds Qwen3NextAttention (K/V alone): equal pages,
    the plain inflate, in either format (K and V interleaved in vLLM's)."""
    model = models.from_hf_config(transformers.Qwen4ExpConfig().to_dict())
    assert "indexer" not in model.layer_kinds
    a = make_plan(model, "inflate", memory="24GiB")
    b = make_plan(model, "inflate", memory="24GiB", target=VLLM)
    _same_but_kv_order(a, b)


@pytest.mark.parametrize(
    ("text", "options", "target", "kwargs", "match"),
    [
        ({}, {}, VllmTarget(cache_formats="vllm", version="0.32"), {}, "vLLM 0.32's layout"),
        ({}, {"kv_dtype": "fp8_e5m2"}, VLLM, {}, "bf16 or fp8 e4m3 K/V cache only"),
        ({"dtype": "float16"}, {}, VLLM, {}, "runs in bf16 only"),
        # _QSAStateCache checks the block the model is built with (16) against the ratio
        ({"indexer_compress_ratio": 32, "indexer_budget": 2048}, {}, VLLM, {}, "does not divide"),
        ({}, {}, VLLM, {"kernel_alignment": 64}, "fix its kernel blocks"),
        # none mode, ratio 8 and 9 speculative tokens: a round_up(17, 8) = 24-slot ring; GDN
        # conv 12 rows: 196,608 + 1,048,576 = 1,245,184 B, block 16 x cdiv(1,245,184, 32,768)
        # = 608 = 24 x 25 + 8
        (
            {"indexer_compress_ratio": 8},
            {"num_spec_tokens": 9},
            VllmTarget(cache_formats="vllm", enable_prefix_caching=False, max_model_len=4096),
            {},
            "24-slot QSA ring does not divide the 608",
        ),
    ],
    ids=["vllm-0.32", "fp8-e5m2", "fp16-model", "ratio-32", "kernel-alignment", "ring"],
)
def test_qwen4_exp_refusals(text, options, target, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_plan(_qwen4(text, **options), "inflate", memory="64GiB", target=target, **kwargs)


def test_the_allocator_serves_vllms_rings(either_plan):
    """The rings (kind indexer_ring) are served as vLLM 0.33's CircularBufferManager serves
    them: one block per request, never cached (tests/test_alloc_ring.py has the rest)."""
    ring = next(g for g in either_plan.groups if g.kind == "indexer_ring")
    a = HybridAllocator(either_plan)
    a.add_request("r", list(range(3 * either_plan.block_size)))
    assert len(a.block_ids("r")[ring.group_id]) == 1


def test_qwen4_exp_fp8_indexer_needs_vllms_formats():
    """indexer_kv_dtype changes vLLM's compressed keys; transformers' per-token rows keep the
    model dtype, so asking for it there is refused rather than ignored."""
    fp8 = VllmTarget(indexer_kv_dtype="fp8")
    with pytest.raises(ValueError, match="plan with cache_formats='vllm'"):
        make_plan(_qwen4(), "inflate", memory="64GiB", target=fp8)
    with pytest.raises(ValueError, match="indexer_kv_dtype must be one of auto, bf16, fp8"):
        VllmTarget(indexer_kv_dtype="fp8_e4m3")
