"""vLLM's ``--kv-cache-dtype-skip-layers``: attention layers that keep the model dtype under a
quantized ``--kv-cache-dtype``.

vLLM 0.33 (and 0.32) reads the flag in ``Attention`` and ``MLAAttention`` (a layer index, or
``sliding_window`` for every sliding-window layer) and then lays out one pool of equal pages:
``Platform._align_hybrid_block_size`` sizes the block by the quantized page,
``_align_heterogeneous_kv_block_size`` raises it until that page covers the skipped layers' page
at the smallest kernel block, and ``unify_kv_cache_spec_page_size`` gives every page the size of
the widest (the skipped layers', at the block): a quantized layer's block is multiplied by the
ratio, a Mamba page padded. The numbers below are worked by hand from those rules."""

from __future__ import annotations

import json
import math
import random

import pytest
from alloc_serving import serve_prefill

from hybridkv import models
from hybridkv.alloc import AllocatorOptions, HybridAllocator
from hybridkv.cli import main
from hybridkv.doctor import diagnose, prefix_trace
from hybridkv.layouts import VllmTarget, make_plan
from hybridkv.layouts.shared import _tokens_within
from hybridkv.vllm_export import kv_cache_config, request_blocks

GIB = 2**30
QWEN = "qwen3-next-80b-a3b"  # 12 full-attention layers (3, 7, ..., 47): 2 KV heads x 256


def _qwen(skip=("3",), kv="fp8"):
    return models.load(QWEN, kv_dtype=kv, kv_dtype_skip_layers=skip)


def test_configure_keeps_the_skipped_layers_at_the_model_dtype():
    model = _qwen(skip=[47, "3", "3"])
    assert model.kv_dtype_skip_layers == ("3", "47")
    dtypes = {layer.index: layer.spec.kv_dtype for layer in model.attention_layers}
    assert dtypes.pop(3) == dtypes.pop(47) == "bfloat16"
    assert set(dtypes.values()) == {"fp8_e4m3"}
    per_token = 2 * 2 * 256  # K and V, 2 heads x 256
    assert model.kv_bytes_per_token == 2 * per_token * 2 + 10 * per_token
    # states are untouched
    assert model.state_bytes_per_seq == models.load(QWEN).state_bytes_per_seq


@pytest.mark.parametrize(
    "kv, skip, match",
    [
        ("auto", ["3"], "already has"),  # nothing is quantized: the flag would not act
        ("fp8", ["0"], r"layer 0 holds no attention KV cache.*3, 7, 11"),  # a GDN layer
        ("fp8", ["sliding_window"], "has none"),
        ("fp8", ["3,7"], "decoder layer indices"),  # vLLM's list is space-separated
        ("fp8", [True], "decoder layer indices"),
    ],
)
def test_a_flag_that_cannot_act_is_an_error(kv, skip, match):
    with pytest.raises(ValueError, match=match):
        _qwen(skip=skip, kv=kv)


def test_inflate_unifies_pages_as_vllm():
    """Qwen3-Next, fp8, layer 3 skipped, 40 GiB, 256 sequences. Phase 2 sizes the block by
    fp8's 1,024 B/token: 64 x cdiv(1,097,728, 64 x 1,024) = 1,088 tokens. Phase 3 keeps it
    (1,088 x 1,024 B >= 2,048 B x 16). Layer 3's bf16 page is then 1,088 x 2,048 B =
    2,228,224 B, twice the fp8 page, so the 11 fp8 layers take 2,176-token blocks and each GDN
    page is padded to 2,228,224 B. Buckets of 1, 11 and 36 layers make vLLM's group size 1."""
    model = _qwen()
    plan = make_plan(model, "inflate", memory=40 * GIB, max_num_seqs=256)
    page = 1088 * 2048
    assert plan.block_size == 1088 and plan.extra["page_bytes"] == page
    attention = {g.layers: g.block_size for g in plan.attention_groups}
    assert attention.pop(("layers.3.attn",)) == 1088
    assert set(attention.values()) == {2176} and len(attention) == 11
    assert {g.block_size for g in plan.state_groups} == {1088}
    assert all(g.page_bytes == page for g in plan.groups)
    assert plan.scheduler_block_size == 2176
    # capacity: a 2,176-token stretch needs 2 pages of layer 3 and one of each fp8 layer
    blocks = 40 * GIB // page - 1 - 36 * 256
    assert plan.capacity.token_capacity == blocks // 13 * 2176 + _extra(blocks % 13)
    for p in plan.kv_placements:  # each layer's bytes fill its page exactly
        assert p.k_bytes_per_block + p.v_bytes_per_block == page
    assert any("unify_kv_cache_spec_page_size" in note for note in plan.notes)


def _extra(left: int) -> int:
    """Tokens beyond whole 2,176-token stretches: 1,088 more need 2 pages (layer 3's and one
    fp8 page), and a whole stretch needs 13."""
    return 1088 if left >= 12 else 0


def test_fp8_everywhere_and_without_the_flag_are_unchanged():
    plain = make_plan(models.load(QWEN, kv_dtype="fp8"), "inflate", memory=40 * GIB)
    assert plain.block_size == 1088
    assert {g.block_size for g in plain.groups} == {1088}
    assert plain.extra["page_bytes"] == 1088 * 1024


def test_every_layer_skipped_still_sizes_the_block_by_fp8():
    """vLLM sizes the block by --kv-cache-dtype's page even when no layer keeps it: 1,088
    tokens of bf16 pages (2,228,224 B), where bf16 without the flag has 576-token blocks."""
    model = _qwen(skip=[str(i) for i in range(3, 48, 4)])
    plan = make_plan(model, "inflate", memory=40 * GIB)
    assert {g.block_size for g in plan.groups} == {1088}
    assert plan.extra["page_bytes"] == 1088 * 2048
    bf16 = make_plan(models.load(QWEN), "inflate", memory=40 * GIB)
    assert bf16.block_size == 576
    assert plan.capacity.token_capacity < bf16.capacity.token_capacity


def test_the_heterogeneous_alignment_raises_a_small_block():
    """LFM2-350M's conv state is small, so phase 2 leaves the default 16 tokens for fp8; phase
    3 raises it to 16 x cdiv(2,048 B x 16, 16 x 1,024 B) = 32 tokens (the fp8 page must cover the
    bf16 page at the 16-token kernel block), and the unification doubles the fp8 layers' blocks
    to 64."""
    model = models.load("lfm2-350m", kv_dtype="fp8", kv_dtype_skip_layers=["2"])
    bf16_per_token = model.layer("layers.2.attn").spec.bytes_per_token
    fp8 = next(layer for layer in model.attention_layers if layer.index != 2)
    assert bf16_per_token == 2 * fp8.spec.bytes_per_token == 2048  # 8 KV heads x 64
    unskipped = make_plan(models.load("lfm2-350m", kv_dtype="fp8"), "inflate", memory=GIB)
    assert unskipped.block_size == 16  # the premise: phase 2 alone gives 16
    plan = make_plan(model, "inflate", memory=GIB)
    assert plan.block_size == 32
    assert "_align_heterogeneous_kv_block_size: raised to 32" in plan.block_size_rule
    blocks = {g.layers: g.block_size for g in plan.attention_groups}
    assert blocks.pop(("layers.2.attn",)) == 32 and set(blocks.values()) == {64}
    assert {g.block_size for g in plan.state_groups} == {32}


def test_shared_pools_refuse_sliding_window_skips():
    """Every attention layer of RecurrentGemma slides: vLLM fits those by their own rule
    (skip_page_size_padded), not modelled in a shared pool; the own-pool layouts plan them."""
    model = models.load(
        "recurrentgemma-2b", kv_dtype="fp8", kv_dtype_skip_layers=["sliding_window"]
    )
    for layout in ("inflate", "pack", "aggregate"):
        with pytest.raises(ValueError, match=r"sliding_window.*per_group or two_level"):
            make_plan(model, layout, memory=40 * GIB, max_num_seqs=16)
    for layout in ("per_group", "two_level"):
        plan = make_plan(model, layout, memory=40 * GIB, max_num_seqs=16)
        assert {p.dtype for p in plan.kv_placements} == {"bfloat16"}


def test_mla_pages_unify_as_full_attention_pages():
    """Kimi-Linear, fp8 with layer 3's latent kept bf16: vLLM 0.33 scales the fp8 MLA block
    (its 576 B/token page divides the bf16 latent's 1,152) and pads the KDA states, as for full
    attention: layer 3 at 3,840 tokens, the six fp8 layers at 7,680, every page 3,840 x 1,152 B;
    a pack of three fp8 latents (1,728 B/token) is not a multiple of the bf16 page, which vLLM
    cannot pad for MLA: refused."""
    model = models.load("kimi-linear-48b-a3b", kv_dtype="fp8", kv_dtype_skip_layers=["3"])
    plan = make_plan(model, "inflate", memory=40 * GIB, max_num_seqs=256)
    blocks = {g.layers[0]: g.block_size for g in plan.groups if g.kind == "mla"}
    assert blocks.pop("layers.3.attn") == 3840 and set(blocks.values()) == {7680}
    assert {g.page_bytes for g in plan.groups} == {3840 * 1152}
    # 7,680 tokens take 8 pages of 4,423,680 B (2 bf16, 6 fp8), where fp8 everywhere takes 14
    # of half the size; states fill twice as many bytes: well under 8/7 of the capacity is left
    plain = make_plan(models.load("kimi-linear-48b-a3b", kv_dtype="fp8"), "inflate",
                      memory=40 * GIB, max_num_seqs=256)  # fmt: skip
    assert 0.5 < plan.capacity.token_capacity / plain.capacity.token_capacity < 7 / 8
    config = kv_cache_config(plan, model)
    specs = [g["kv_cache_spec"] for g in config["kv_cache_groups"]]
    assert {s["page_size_padded"] for s in specs if s["kind"] == "MambaSpec"} == {3840 * 1152}
    with pytest.raises(ValueError, match="MLA layers a page that does not divide"):
        make_plan(model, "pack", memory=40 * GIB, max_num_seqs=256, pack_size=3)


def test_own_pool_layouts_hold_the_bytes_the_layers_need():
    model = _qwen()
    for layout in ("per_group", "two_level"):
        plan = make_plan(model, layout, memory=40 * GIB, max_num_seqs=256)
        kv = plan.capacity.token_capacity * model.kv_bytes_per_token
        # at least 96% of what the budget leaves after the states holds KV
        states = 256 * model.state_bytes_per_seq
        assert kv >= 0.96 * (40 * GIB - states), layout
        skipped = [p for p in plan.kv_placements if p.layer == "layers.3.attn"]
        assert skipped[0].dtype == "bfloat16"


@pytest.mark.parametrize("sizes", [[16], [16, 32], [32, 16, 16], [1088, 2176], [48, 64]])
def test_tokens_within_is_the_most_every_group_holds(sizes):
    rng = random.Random(sum(sizes))
    for _ in range(50):
        blocks = rng.randrange(0, 500)
        t = _tokens_within(blocks, sizes)
        need = sum(-(-t // b) for b in sizes)
        assert need <= blocks
        step = math.gcd(*sizes)
        assert sum(-(-(t + step) // b) for b in sizes) > blocks


def test_two_level_splits_pages_by_what_each_kind_needs():
    """One bf16 layer beside 11 fp8 layers: the attention kinds' pages hold the same tokens, so
    the fp8 kind (5.5x the bytes a token) gets most large pages, not half of them."""
    model = _qwen()
    plan = make_plan(model, "two_level", memory=40 * GIB, max_num_seqs=256)
    pool = plan.pools[0]
    per_page = dict(pool.ids_per_large_page)
    ids = {g.group_id: plan.num_ids(g.group_id) for g in plan.attention_groups}
    tokens = plan.capacity.token_capacity
    assert tokens % plan.block_size == 0 and tokens > 0
    for gid in ids:
        assert per_page[gid] > 0
    fraction = plan.capacity.fraction_of_ideal
    assert fraction > 0.95


def _allocator(policy: str = "align", **extra) -> HybridAllocator:
    plan = make_plan(_qwen(), "inflate", memory=40 * GIB, max_num_seqs=8)
    options = AllocatorOptions(
        checkpoint_policy=policy, hash_block_size=1088, max_model_len=20_000, **extra
    )
    return HybridAllocator(plan, options)


@pytest.mark.parametrize(
    "policy, extra",
    [("align", {}), ("last", {}), ("marconi", {}), ("periodic", {"checkpoint_interval": 2176})],
)
def test_every_hit_is_a_whole_quantized_block(policy, extra):
    """The allocator on the unified plan under each checkpoint policy: prompts sharing random
    prefixes hit only multiples of 2,176 tokens (the fp8 layers' block; vLLM's hit lengths are
    multiples of every full-attention group's block), and the pool stays consistent."""
    a = _allocator(policy, **extra)
    rng = random.Random(11)
    base = [rng.randrange(1, 50_000) for _ in range(9000)]
    hits = []
    for i in range(8):
        shared = rng.randrange(500, 8000)
        prompt = base[:shared] + [50_001 + 1000 * i + j for j in range(rng.randrange(1, 900))]
        hits.append(a.find_longest_cache_hit(prompt))
        serve_prefill(a, f"r{i}", prompt)
    assert all(h % 2176 == 0 for h in hits)
    if policy in ("align", "periodic"):  # states inside prompts that later prompts share
        assert any(hits)


def test_align_keeps_its_checkpoint_on_the_scheduler_block():
    """vLLM's align mode backs a prompt's checkpoint off to the scheduler block (the lcm of the
    groups' blocks, 2,176 here; ``Scheduler.block_size``), where the fp8 layers' hits land: a
    prompt of 3 x 1,088 tokens is served from 2,176, one of 4 x 1,088 from all of them."""
    rng = random.Random(3)
    for blocks, want in ((4, 4 * 1088), (3, 2176)):
        a = _allocator()
        first = [rng.randrange(1, 50_000) for _ in range(blocks * 1088 + 5)]
        serve_prefill(a, "first", first)
        again = first[: blocks * 1088] + [50_001 + j for j in range(300)]
        assert a.find_longest_cache_hit(again) == want


def test_export_matches_vllms_specs():
    plan = make_plan(_qwen(), "inflate", memory=40 * GIB, max_num_seqs=256)
    config = kv_cache_config(plan, _qwen())
    page = 1088 * 2048
    specs = [g["kv_cache_spec"] for g in config["kv_cache_groups"]]
    attention = [s for s in specs if s["kind"] == "FullAttentionSpec"]
    assert sorted((s["block_size"], s["dtype"]) for s in attention) == sorted(
        [(1088, "torch.bfloat16")] + [(2176, "torch.uint8")] * 11  # vLLM keeps fp8 KV as bytes
    )
    assert {s["page_size_bytes"] for s in specs} == {page}
    mamba = [s for s in specs if s["kind"] == "MambaSpec"]
    assert {s["block_size"] for s in mamba} == {1088}
    assert {s["page_size_padded"] for s in mamba} == {page}
    assert config["hash_block_size"] == 1088  # the gcd of the group blocks


def test_doctor_names_the_cost_and_the_remedy():
    """A 2,000-token shared prefix: fp8 everywhere hits its first 1,088-token block; with
    layer 3 skipped a hit needs 2,176 tokens, so none."""
    trace = prefix_trace(3000, 2000, 32)

    def load(**options):
        return models.load(QWEN, **options)

    runtime = dict(kv_dtype="fp8", kv_dtype_skip_layers=("3",))
    d = diagnose(
        load, runtime=runtime, memory=40 * GIB, max_num_seqs=64, target=VllmTarget(),
        trace=trace,
    )  # fmt: skip
    skip = d.finding("skip_layers")
    assert skip.data["attention_block_sizes"] == [1088, 2176]
    assert skip.data["page_bytes"] == 2 * skip.data["page_bytes_without_skip"]
    plans = {
        kind: make_plan(load(**options), "inflate", memory=40 * GIB, max_num_seqs=64)
        for kind, options in (("given", runtime), ("plain", dict(kv_dtype="fp8")))
    }
    ratio = plans["given"].capacity.token_capacity / plans["plain"].capacity.token_capacity
    assert skip.data["capacity_ratio"] == ratio < 0.9
    assert d.finding("min_hit").data["min_shared_tokens"] == 2176
    assert "fp8 KV (layer 3 kept bfloat16, as given) buys" in d.finding("fp8").text
    remedies = {r.key: r for r in d.remedies}
    assert remedies["as_given"].token_hit_rate == 0.0
    off = remedies["skip_layers_off"]
    assert off.token_hit_rate > 0.3
    assert off.token_capacity == plans["plain"].capacity.token_capacity


def test_doctor_fp8_finding_compares_fp8_with_bf16():
    """With --kv-cache-dtype fp8 given, the fp8 finding weighs it against bf16 (it once
    compared fp8 with itself: 1.00x)."""

    def load(**options):
        return models.load(QWEN, **options)

    d = diagnose(
        load, runtime=dict(kv_dtype="fp8"), memory=40 * GIB, max_num_seqs=64,
        target=VllmTarget(),
    )  # fmt: skip
    fp8 = d.finding("fp8")
    assert fp8.data["block_size_bf16"] == 576 and fp8.data["block_size_fp8"] == 1088
    assert 1.9 < fp8.data["capacity_ratio"] < 2.1


def _skip_doctor(memory: int, **target):
    return diagnose(
        lambda **options: models.load(QWEN, **options),
        runtime=dict(kv_dtype="fp8", kv_dtype_skip_layers=("3",)),
        memory=memory, max_num_seqs=16, target=VllmTarget(**target),
    )  # fmt: skip


def test_start_up_check_counts_each_groups_blocks():
    """A max_model_len request takes cdiv(n, 1088) pages in layer 3's group and cdiv(n, 2176)
    in each fp8 group: the longest length the doctor says starts does start (a multiple of
    2,176: 2 + 11 pages a step), and one 1,088-token block more does not (12 more pages)."""
    memory = 3 * GIB
    with pytest.raises(ValueError, match="1088- and 2176-token blocks") as refused:
        _skip_doctor(memory)
    longest = int(refused.value.args[0].rsplit("(to ", 1)[1].split(" ")[0].replace(",", ""))
    assert longest % 2176 == 0
    plan = make_plan(_qwen(), "inflate", memory=memory, max_num_seqs=16)
    blocks = request_blocks(plan, _qwen(), longest)
    spare = blocks.num_blocks - 1 - blocks.state
    assert blocks.attention == 13 * longest // 2176 <= spare < blocks.attention + 12
    started = _skip_doctor(memory, max_model_len=longest).finding("concurrency")
    assert started.data["concurrent_requests"] == 1
    with pytest.raises(ValueError, match="would not start"):
        _skip_doctor(memory, max_model_len=longest + 1088)


def test_concurrency_counts_pages_at_each_groups_block():
    """3,000 tokens: 3 pages of 1,088 tokens for layer 3 and 2 of 2,176 in each of the 11 fp8
    groups, beside 3 state blocks in each of the 36 state groups."""
    d = diagnose(
        lambda **options: models.load(QWEN, **options),
        runtime=dict(kv_dtype="fp8", kv_dtype_skip_layers=("3",)),
        memory=40 * GIB, max_num_seqs=64, target=VllmTarget(),
        trace=prefix_trace(3000, 100, num_requests=8),
    )  # fmt: skip
    f = d.finding("concurrency")
    mean = f.data["request_tokens"]
    assert 2176 < mean <= 3264
    assert f.data["pages_per_request"] == 3 + 11 * 2 + 36 * 3
    assert f.data["tokens_held"] == 4352
    assert "up to 4,352 tokens of KV in whole 1088- and 2176-token blocks" in f.text


def test_cli_reads_vllms_flag(capsys):
    code = main(
        ["plan", "--model", QWEN, "--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers",
         "3", "47", "--layout", "inflate", "--json"]
    )  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    text = json.dumps(out)
    assert "2176" in text and "unify_kv_cache_spec_page_size" in text
    code = main(["plan", "--model", QWEN, "--kv-cache-dtype-skip-layers", "3"])
    assert code != 0
    assert "quantized --kv-cache-dtype" in capsys.readouterr().err
