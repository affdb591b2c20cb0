"""Memory plans: vLLM's block sizes, exact accounting, and no two live regions overlapping."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv import models
from hybridkv.layouts import LAYOUTS, make_plan
from hybridkv.plan import KVPlacement, MemoryPlan
from hybridkv.target import VllmTarget

GiB = 2**30


# ---- vLLM's block sizes ------------------------------------------------------------------------
# (model, options, vLLM 0.33 default = prefix caching on (align mode) on Hopper, prefix caching off
# or vLLM 0.32). With prefix caching on, vLLM 0.33 makes a GDN model's block a multiple of
# lcm(16, 64): FlashInfer's GDN prefill checkpoints every 64 tokens. Mamba-2 models do not change.
@pytest.mark.parametrize(
    "name, options, pc_on, pc_off",
    [
        # 16 * cdiv(2,146,304, 16 * 4,096) = 16 * 33 (vLLM issue #40696); 64 * cdiv(.., 64 * 4,096)
        pytest.param("qwen3.5-4b", {}, 576, 528, id="qwen3.5-4b-bf16-576-528"),
        # fp8 halves the bytes per token: 16 * cdiv(2,146,304, 16 * 2,048) = 16 * 66
        pytest.param("qwen3.5-4b", {"kv_dtype": "fp8"}, 1088, 1056, id="qwen3.5-4b-fp8-1088-1056"),
        # TP2: state 36,864 + 2,097,152 B, 1,024 B/token -> 16 * cdiv(2,134,016, 16,384) (seed 001)
        pytest.param(
            "qwen3.5-397b-a17b", {"tp_size": 2}, 2112, 2096, id="qwen3.5-397b-tp2-2112-2096"
        ),
        # PR #35703's table: Qwen3.5/3.6-35B-A3B-like at bf16 -> 1056 (without prefix caching)
        pytest.param("qwen3.5-35b-a3b", {}, 1088, 1056, id="qwen3.5-35b-a3b-1088-1056"),
        # bf16 SSM state: 1,097,728 B / 2,048 B per token -> 544 (the issue: vLLM 0.33 gives 576)
        pytest.param("qwen3-next-80b-a3b", {}, 576, 544, id="qwen3-next-tp1-576-544"),
        # TP4: 274,432 B / 1,024 B per token -> 16 * 17 = 272, 64 * 5 = 320
        pytest.param("qwen3-next-80b-a3b", {"tp_size": 4}, 320, 272, id="qwen3-next-tp4-320-272"),
        # Nemotron-Nano-12B-v2: 672 with a bf16 SSM state (PyTorch blog), 1312 with fp32
        pytest.param(
            "nemotron-nano-12b-v2",
            {"ssm_dtype": "bfloat16"},
            672,
            672,
            id="nemotron-nano-12b-bf16-672",
        ),
        pytest.param(
            "nemotron-nano-12b-v2",
            {"ssm_dtype": "float32"},
            1312,
            1312,
            id="nemotron-nano-12b-fp32-1312",
        ),
    ],
)
def test_inflate_reproduces_vllm_block_size(name, options, pc_on, pc_off):
    model = models.load(name, **options)
    plan = make_plan(model, "inflate", memory="40GiB")
    assert plan.block_size == pc_on
    assert plan.vllm.mamba_cache_mode == "align"
    assert str(pc_on) in plan.block_size_rule
    # the page fits the state and is padded up to the attention page
    assert plan.extra["page_bytes"] >= plan.extra["max_state_bytes"]
    off = make_plan(
        model, "inflate", memory="40GiB", target=VllmTarget(enable_prefix_caching=False)
    )
    assert off.block_size == pc_off
    assert off.vllm.mamba_cache_mode == "none"
    # vLLM 0.32 has no checkpoint alignment: its block is the prefix-caching-off one
    old = make_plan(model, "inflate", memory="40GiB", target=VllmTarget(version="0.32"))
    assert old.block_size == pc_off
    assert old.vllm.mamba_cache_mode == "align"


def test_inflate_keeps_a_larger_user_block_size():
    plan = make_plan(models.load("qwen3.5-4b"), "inflate", memory="40GiB", block_size=1024)
    assert plan.block_size == 1024
    assert any("padded" in n for n in plan.notes)


@pytest.mark.parametrize(
    "target, unit",
    [(VllmTarget(enable_prefix_caching=False), 16), (VllmTarget(), 64)],
    ids=["pc-off-unit-16", "pc-on-flashinfer-gdn-unit-64"],
)
def test_pack_divides_block_size(target, unit):
    model = models.load("qwen3.5-35b-a3b")
    sizes = {
        n: make_plan(model, "pack", memory="40GiB", pack_size=n, target=target).block_size
        for n in (1, 2, 5)
    }
    # 2,146,304 B over 1, 2 or 5 layers of 2,048 B/token, rounded up to the unit
    assert sizes[1] == unit * -(-2146304 // (unit * 2048)) == {16: 1056, 64: 1088}[unit]
    assert sizes[2] == unit * -(-2146304 // (unit * 2 * 2048)) == {16: 528, 64: 576}[unit]
    assert sizes[5] == unit * -(-2146304 // (unit * 5 * 2048)) == {16: 224, 64: 256}[unit]


def test_aggregate_is_one_slot_and_one_group_per_state_layer():
    model = models.load("qwen3-next-80b-a3b")
    plan = make_plan(model, "aggregate", memory="40GiB")
    assert len(plan.tensors) == 1
    assert len(plan.state_groups) == len(model.state_layers)
    (attn,) = plan.attention_groups
    assert len(attn.layers) == len(model.attention_layers)
    # seed 000: layer i's K at 2*i*subpage, V at (2i+1)*subpage of the unit
    sub = plan.block_size * model.attention_layers[0].spec.bytes_per_token // 2
    for i, layer in enumerate(model.attention_layers):
        p = plan.placement(layer.name)
        assert (p.k_offset, p.v_offset) == (2 * i * sub, (2 * i + 1) * sub)


def test_inflate_grouping_matches_vllm_qwen3_next():
    # 12 full-attention + 36 GDN layers: 4 groups of 12 layers, 12 tensors
    plan = make_plan(models.load("qwen3-next-80b-a3b"), "inflate", memory="40GiB")
    assert len(plan.groups) == 4
    assert len(plan.tensors) == 12
    assert all(len(g.layers) == 12 for g in plan.groups)
    # stride assignment: state group i gets layers[i::3]
    state0 = plan.state_groups[0].layers
    gdn = [layer.name for layer in models.load("qwen3-next-80b-a3b").state_layers]
    assert list(state0) == gdn[0::3]


# ---- accounting ----------------------------------------------------------------------------
def _check_accounting(plan: MemoryPlan) -> None:
    cap = plan.capacity
    assert cap.state_reserved_bytes + cap.kv_reserved_bytes + cap.unusable_bytes == (
        plan.config.memory_bytes
    )
    assert plan.total_bytes <= plan.config.memory_bytes
    assert 0 < cap.token_capacity <= cap.ideal_token_capacity
    assert cap.padding_bytes >= 0 and cap.unusable_bytes >= 0
    # reserved state memory holds at least the real state of max_num_seqs requests
    assert cap.state_reserved_bytes >= cap.state_bytes
    # reserved KV memory holds at least the promised tokens
    model = models.load(plan.model_name, tp_size=plan.tp_size, kv_dtype=plan.kv_dtype)
    assert cap.kv_reserved_bytes >= cap.token_capacity * model.kv_bytes_per_token


# ---- regions ------------------------------------------------------------------------------------
def _all_regions(plan: MemoryPlan):
    """Arrays (tensor index, start, end, pool unit key) of every (layer, id) region."""
    tensor_index = {t.name: i for i, t in enumerate(plan.tensors)}
    rows = []
    for p in (*plan.kv_placements, *plan.state_placements):
        g = plan.group(p.group_id)
        pool = plan.pool_of(g.group_id)
        per_unit = pool.ids_per_page(g.group_id)
        n = p.num_blocks if isinstance(p, KVPlacement) else p.num_slots
        ids = np.arange(n, dtype=np.int64)
        units = ids // per_unit
        pool_key = plan.pools.index(pool)
        if isinstance(p, KVPlacement):
            if p.interleaves_kv:  # [tokens, heads, K | V]: one span of both
                spans = [(p.k_offset, p.k_bytes_per_block + p.v_bytes_per_block)]
            else:
                spans = [(p.k_offset, p.k_bytes_per_block)]
                if p.v_offset is not None:
                    spans.append((p.v_offset, p.v_bytes_per_block))
            stride = p.block_stride
        else:
            spans = [(p.offset + c.offset, c.nbytes) for c in p.components]
            stride = p.slot_stride
        for offset, size in spans:
            start = offset + ids * stride
            rows.append(
                np.stack(
                    [
                        np.full_like(ids, tensor_index[p.tensor]),
                        start,
                        start + size,
                        pool_key * 2**24 + units,
                        np.full_like(ids, p.group_id),
                    ],
                    axis=1,
                )
            )
    return np.concatenate(rows)


def _coverage(starts: np.ndarray, ends: np.ndarray, *weights: np.ndarray) -> list[np.ndarray]:
    """For each of ``weights``: the sum of the weights of the regions covering each elementary
    interval between endpoints (the endpoints sorted and located once for all of them)."""
    # sorted, then deduplicated by hand: np.unique's hash path (numpy >= 2.3) degrades to
    # seconds per call on these offsets (multiples of large strides), 50 s a model
    points = np.sort(np.concatenate([starts, ends]))
    points = points[np.concatenate([[True], points[1:] != points[:-1]])]
    at_start = np.searchsorted(points, starts)
    at_end = np.searchsorted(points, ends)
    out = []
    for w in weights:
        diff = np.zeros(len(points) + 1, dtype=np.int64)
        np.add.at(diff, at_start, w)
        np.add.at(diff, at_end, -w)
        out.append(np.cumsum(diff))
    return out


def _check_regions(plan: MemoryPlan) -> None:
    regions = _all_regions(plan)
    sizes = np.array([t.nbytes for t in plan.tensors], dtype=np.int64)
    # every region lies inside its tensor
    assert (regions[:, 1] >= 0).all()
    assert (regions[:, 2] <= sizes[regions[:, 0]]).all()
    for t in range(len(plan.tensors)):
        r = regions[regions[:, 0] == t]
        if not len(r):
            continue
        # within one group no two regions share a byte
        for g in np.unique(r[:, 4]):
            rg = r[r[:, 4] == g]
            (cover,) = _coverage(rg[:, 1], rg[:, 2], np.ones(len(rg), np.int64))
            assert cover.max() <= 1, f"group {g} overlaps itself in {plan.tensors[t].name}"
        # across groups, bytes are shared only inside one allocation unit, which the
        # allocator hands to one group at a time: all regions covering a byte have one unit
        unit = r[:, 3] - r[:, 3].min()
        count, s1, s2 = _coverage(r[:, 1], r[:, 2], np.ones(len(r), np.int64), unit, unit * unit)
        assert (count * s2 == s1 * s1).all(), f"two allocation units share bytes of tensor {t}"


def _small_budget(model, layout: str) -> int:
    """A budget that leaves a few dozen blocks: enough for two requests' states and some KV."""
    probe = make_plan(model, layout, memory=1 << 50, max_num_seqs=2)
    unit = probe.pools[-1].block_bytes if layout != "per_group" else 0
    need = (
        probe.capacity.state_reserved_bytes
        + 2 * unit
        + 48 * probe.block_size * model.kv_bytes_per_token
        + 2 * max(p.block_bytes for p in probe.pools)
    )
    return int(need * 1.3)


ZOO = models.list_models()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ZOO)
def test_regions_disjoint_and_inside_over_zoo(name, layout):
    base = models.load(name)
    for tp in (1, 2, 4):
        for kv in ("auto", "fp8"):
            try:
                model = base.configure(tp_size=tp, kv_dtype=kv)
            except ValueError:
                continue  # this TP does not divide the model's heads
            plan = make_plan(model, layout, memory=_small_budget(model, layout), max_num_seqs=2)
            _check_accounting(plan)
            _check_regions(plan)


@pytest.mark.parametrize("cache_formats", ["transformers", "vllm"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_views_on_real_cpu_memory_do_not_overlap(layout, cache_formats):
    """Give every allocation unit to one group, write a distinct value into every (layer, id)
    region through the kernels' views, and read every value back (vllm: K and V interleaved
    per token and head in a page)."""
    model = models.load("qwen3.5-0.8b").configure(kv_dtype="float32", ssm_dtype="float32")
    plan = make_plan(
        model, layout, memory=_small_budget(model, layout), max_num_seqs=2,
        target=VllmTarget(cache_formats=cache_formats),
    )  # fmt: skip
    _check_regions(plan)
    buffers = plan.allocate("cpu", fill=0)
    owner: dict[tuple[str, int], int] = {}
    expected = []
    counter = 1.0
    for g in plan.groups:
        pool = plan.pool_of(g.group_id)
        k = pool.ids_per_page(g.group_id)
        for block in range(1, plan.num_ids(g.group_id)):
            unit = (pool.name, block // k)
            if owner.setdefault(unit, g.group_id) != g.group_id:
                continue
            for layer in g.layers:
                if g.is_state:
                    for comp, view in plan.state_views(buffers, layer).items():
                        view[block] = counter
                        expected.append((layer, comp, block, counter))
                        counter += 1
                else:
                    kc, vc = plan.kv_views(buffers, layer)
                    kc[block] = counter
                    expected.append((layer, "k", block, counter))
                    counter += 1
                    if vc is not None:
                        vc[block] = counter
                        expected.append((layer, "v", block, counter))
                        counter += 1
    assert len(expected) > 50
    for layer, comp, block, value in expected:
        if comp in ("k", "v"):
            kc, vc = plan.kv_views(buffers, layer)
            view = kc if comp == "k" else vc
        else:
            view = plan.state_views(buffers, layer)[comp]
        assert torch.all(view[block] == value), (layer, comp, block)


def test_meta_allocation_of_a_large_plan():
    model = models.load("qwen3.5-397b-a17b", tp_size=2, kv_dtype="fp8")
    for layout in LAYOUTS:
        plan = make_plan(model, layout, memory="70GiB", max_num_seqs=512)
        buffers = plan.allocate("meta")
        assert sum(b.numel() for b in buffers.values()) == plan.total_bytes
        layer = model.attention_layers[-1].name
        k, v = plan.kv_views(buffers, layer)
        assert k.shape[1] == plan.block_size and v.device.type == "meta"
        state = plan.state_views(buffers, model.state_layers[-1].name)
        assert set(state) == {"conv", "ssm"}


# ---- property test over random budgets ------------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(ZOO),
    layout=st.sampled_from(LAYOUTS),
    memory_gib=st.floats(min_value=4, max_value=160),
    max_num_seqs=st.integers(min_value=1, max_value=64),
    block=st.sampled_from([None, 16, 32, 64, 128]),
    slots=st.integers(min_value=1, max_value=3),
)
def test_random_plans_account_for_every_byte(name, layout, memory_gib, max_num_seqs, block, slots):
    model = models.load(name)
    if (
        block is not None
        and block % 64
        and any(layer.spec.kind == "mla" for layer in model.attention_layers)
    ):
        block = 64
    try:
        plan = make_plan(
            model,
            layout,
            memory=int(memory_gib * GiB),
            max_num_seqs=max_num_seqs,
            block_size=block,
            state_slots_per_seq=slots,
        )
    except ValueError as exc:
        assert "too small" in str(exc)
        return
    _check_accounting(plan)


# ---- errors -------------------------------------------------------------------------------------
def test_memory_too_small_says_what_to_change():
    with pytest.raises(ValueError, match="max-num-seqs"):
        make_plan(models.load("qwen3-next-80b-a3b"), "inflate", memory="1GiB", max_num_seqs=1024)
    # small budgets keep their digits (MiB, not "0.00 GiB")
    with pytest.raises(ValueError, match=r"^3\.00 MiB is too small .* needs 168\.07 MiB"):
        make_plan(models.load("qwen3.5-0.8b"), "per_group", memory="3MiB", max_num_seqs=8)


def test_block_size_must_match_kernel_alignment():
    with pytest.raises(ValueError, match=r"multiple of the kernel alignment.*use 16 or 32"):
        make_plan(models.load("qwen3.5-4b"), "per_group", memory="8GiB", block_size=24)
    # MLA needs 64-token blocks
    with pytest.raises(ValueError, match=r"\(64 tokens"):
        make_plan(models.load("kimi-linear-48b-a3b"), "per_group", memory="8GiB", block_size=32)


def test_unknown_layout_and_bad_memory():
    model = models.load("qwen3.5-4b")
    with pytest.raises(ValueError, match="choose one of"):
        make_plan(model, "paged", memory="8GiB")
    with pytest.raises(ValueError, match="byte size"):
        make_plan(model, "inflate", memory="8 gigs")
    with pytest.raises(ValueError, match="pack_size"):
        make_plan(model, "pack", memory="8GiB", pack_size=0)


# ---- the plan answers layout questions ----------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ["falcon-h1-0.5b", "kimi-linear-48b-a3b", "recurrentgemma-2b"])
def test_placements_carry_layer_index_and_kind(name, layout):
    # Falcon-H1 holds attention and Mamba-2 in every decoder layer: indices repeat across kinds
    model = models.load(name)
    plan = make_plan(model, layout, memory=GiB, max_num_seqs=2)
    placements = (*plan.kv_placements, *plan.state_placements)
    assert len(placements) == len(model.layers)
    for p in placements:
        layer = model.layer(p.layer)
        assert (p.layer_index, p.kind) == (layer.index, layer.spec.kind)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_placements_answer_offsets_alike(layout):
    """``id_stride``, ``byte_offset`` and ``parts`` mean the same on both placement kinds."""
    plan = make_plan(models.load("qwen3.5-0.8b"), layout, memory=GiB, max_num_seqs=2)
    kv, state = plan.kv_placements[0], plan.state_placements[0]
    assert kv.byte_offset(3) == kv.k_byte_offset(3) == kv.byte_offset(2) + kv.id_stride
    assert (
        state.byte_offset(3) == state.slot_byte_offset(3) == state.byte_offset(2) + state.id_stride
    )
    assert [name for name, _ in kv.parts(3)] == ["K", "V"]
    assert [r for _, r in kv.parts(3)] == kv.regions(3)
    assert [name for name, _ in state.parts(3)] == ["conv", "ssm"]
    assert [r for _, r in state.parts(3)] == state.regions(3)


def test_mla_placement_has_one_latent_part():
    plan = make_plan(models.load("kimi-linear-48b-a3b"), "inflate", memory=GiB, max_num_seqs=2)
    assert [name for name, _ in plan.kv_placements[0].parts(1)] == ["latent"]


@pytest.mark.parametrize(
    "layout, checkpoint, scheduler",
    [
        # vLLM 0.33's align mode: the shared block (576) is the state block too
        pytest.param("inflate", 576, 576, id="inflate-576"),
        pytest.param("pack", 192, 192, id="pack-192"),
        pytest.param("aggregate", 64, 64, id="aggregate-64"),
        # dedicated state pools checkpoint at the requested attention block
        pytest.param("per_group", 16, 16, id="per_group-16"),
        pytest.param("two_level", 16, 16, id="two_level-16"),
    ],
)
def test_checkpoint_granularity_and_scheduler_block(layout, checkpoint, scheduler):
    plan = make_plan(models.load("qwen3-next-80b-a3b"), layout, memory="40GiB")
    assert plan.checkpoint_granularity == checkpoint
    assert plan.scheduler_block_size == scheduler
    no_states = dataclasses.replace(plan, groups=plan.attention_groups)
    assert no_states.checkpoint_granularity == 1
    assert no_states.scheduler_block_size == plan.attention_groups[0].block_size


@pytest.mark.parametrize(
    "layout, shares_ids, two_level",
    [
        pytest.param("inflate", True, False, id="inflate-shared"),
        pytest.param("pack", True, False, id="pack-shared"),
        pytest.param("aggregate", True, False, id="aggregate-shared"),
        pytest.param("per_group", False, False, id="per_group-own-ids"),
        pytest.param("two_level", False, True, id="two_level-large-pages"),
    ],
)
def test_pool_says_how_its_ids_are_shared(layout, shares_ids, two_level):
    plan = make_plan(models.load("qwen3.5-0.8b"), layout, memory=GiB, max_num_seqs=2)
    for pool in plan.pools:
        assert (pool.shares_ids, pool.is_two_level) == (shares_ids, two_level)
    for g in plan.groups:
        pool = plan.pool_of(g.group_id)
        # one id of a two-level pool is one small page; elsewhere a whole block of the pool
        want = g.page_bytes if two_level else pool.block_bytes
        assert plan.id_bytes(g.group_id) == want


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unit_rows_hold_every_region_of_the_unit(layout):
    plan = make_plan(models.load("qwen3.5-0.8b"), layout, memory=GiB, max_num_seqs=2)
    for g in plan.groups:
        pool = plan.pool_of(g.group_id)
        rows = plan.unit_rows(g.group_id, 2)
        assert len({r.nbytes for r in rows}) == 1, "rows of a unit have one width"
        if pool.shares_ids:
            assert [r.label for r in rows] == list(pool.tensors)
        elif pool.is_two_level:
            k = pool.ids_per_page(g.group_id)
            assert [r.block_id for r in rows] == list(range(2 * k, 3 * k))
        else:
            assert [r.label for r in rows] == list(g.layers)
        placed = 0
        for r in rows:
            assert plan.allocation_unit(g.group_id, r.block_id) == (pool.name, 2)
            for layer in r.layers:
                for region in plan.placement(layer).regions(r.block_id):
                    assert (
                        region.tensor == r.tensor and r.start <= region.start < region.end <= r.end
                    )
                    placed += 1
        assert placed == sum(len(p.regions(0)) for p in plan.placements_of(g.group_id)) * len(
            {r.block_id for r in rows}
        )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ["qwen3.5-0.8b", "kimi-linear-48b-a3b", "recurrentgemma-2b"])
def test_fit_tokens_is_the_smallest_plan_that_holds_them(name, layout):
    model = models.load(name)
    plan = make_plan(model, layout, fit_tokens=1000, max_num_seqs=3)
    assert plan.capacity.token_capacity >= 1000
    assert plan.config.max_num_seqs == 3
    try:
        one_less = make_plan(model, layout, memory=plan.config.memory_bytes - 1, max_num_seqs=3)
    except ValueError:
        return  # one byte less cannot even hold the states
    assert one_less.capacity.token_capacity < 1000


def test_fit_tokens_keeps_the_other_options():
    model = models.load("qwen3.5-0.8b")
    plan = make_plan(model, "per_group", fit_tokens=640, block_size=32, cache_state_slots=4)
    assert (plan.block_size, plan.config.cache_state_slots) == (32, 4)
    assert plan.capacity.token_capacity >= 640


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param({"memory": GiB, "fit_tokens": 10}, "not both", id="memory-and-fit_tokens"),
        pytest.param({}, "either memory or fit_tokens", id="neither"),
        pytest.param({"fit_tokens": 0}, "positive number of tokens", id="zero-tokens"),
        pytest.param({"fit_tokens": -5}, "positive number of tokens", id="negative-tokens"),
        pytest.param({"fit_tokens": 10**20}, "cannot hold", id="more-than-any-budget"),
        pytest.param({"fit_tokens": 64, "block_size": 24}, "kernel alignment", id="bad-block"),
    ],
)
def test_fit_tokens_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_plan(models.load("qwen3.5-0.8b"), "per_group", **kwargs)


@pytest.mark.parametrize("layout", ["inflate", "pack", "per_group"])
def test_vllm_formats_lay_a_page_out_as_vllm_reads_it(layout):
    """vLLM 0.33 reads an attention page as [tokens, heads, K | V] (logical [B, H, N, 2 * D],
    laid out LBNHC: :attr:`VllmTarget.interleaves_kv`). Written through the plan's views, the
    page read that way holds each head's K then its V; the same bytes per page as K then V."""
    model = models.load("qwen3-next-80b-a3b").configure(kv_dtype="float32")
    target = VllmTarget(cache_formats="vllm")
    plan = make_plan(model, layout, memory="1GiB", max_num_seqs=2, target=target)
    planes = make_plan(model, layout, memory="1GiB", max_num_seqs=2)
    assert plan.capacity == planes.capacity and plan.total_bytes == planes.total_bytes
    layer = model.attention_layers[0].name
    p = plan.placement(layer)
    assert p.interleaves_kv and not planes.placement(layer).interleaves_kv
    assert [name for name, _ in p.parts(3)] == ["K|V"]
    buffers = plan.allocate("cpu", fill=0)
    k, v = plan.kv_views(buffers, layer)
    k.copy_(torch.randn(k.shape))
    v.copy_(torch.randn(v.shape))
    d, dv, heads = p.head_dim, p.head_dim_v, p.num_kv_heads
    typed = buffers[p.tensor].view(torch.float32)
    page = torch.as_strided(
        typed,
        (p.num_blocks, p.block_size, heads, d + dv),
        (p.block_stride // 4, heads * (d + dv), d + dv, 1),
        p.k_offset // 4,
    )
    assert torch.equal(page[..., :d], k) and torch.equal(page[..., d:], v)
