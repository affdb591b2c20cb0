"""Decode context parallelism for sparse MLA beside KDA (GLM-5-Next, vLLM 0.33): the latent
and the k-pooled indexer keys are sharded like MLA (``dcp_sharded``), the indexer's tail ring
and the KDA states are not; vLLM's own conditions hold: an interleave
(``--cp-kv-cache-interleave-size``) covering whole k-pools and dividing a block's rows, a
bfloat16 latent (FlashMLA's sparse backend, the one with DCP). Qwen4-Exp's QSA is refused as
vLLM refuses it."""

from __future__ import annotations

import json
import warnings

import pytest
from vllm_planning import glm5_registered, planner_config

from hybridkv import models
from hybridkv.cli import main
from hybridkv.costmodel import H100_SXM, StepCoster, attention_flops
from hybridkv.layouts import LAYOUTS, VllmTarget, make_plan
from hybridkv.vllm_export import kv_cache_config

GLM = "examples/glm5_next-defaults.json"  # index_kpool 16, 64 heads: TP 8 replicates the latent
QWEN4 = "examples/qwen4_exp-qsa.json"
VLLM_FORMATS = VllmTarget(cache_formats="vllm")


def _glm(dcp: int = 1, interleave: int = 1, **configure):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the example config's transformers defaults, noted
        base = models.from_hf_config(GLM)
    return base.configure(
        tp_size=8, dcp_size=dcp, cp_kv_cache_interleave_size=interleave, **configure
    )


@pytest.mark.parametrize(
    ("configure", "match"),
    [
        (
            dict(dcp=4),
            r"multiple of the pool \(16 tokens.*got 1; give --cp-kv-cache-interleave-size 16",
        ),
        (dict(dcp=4, interleave=24), "multiple of the pool .*got 24"),
        (dict(dcp=4, interleave=16, kv_dtype="fp8"), "FLASHMLA_SPARSE .*not fp8_e4m3"),
        (dict(interleave=16), r"there are none \(dcp_size 1\)"),
        (dict(dcp=4, interleave=0), "cp_kv_cache_interleave_size must be a positive integer"),
        (dict(dcp=3, interleave=16), "must divide the tensor-parallel size 8"),
    ],
)
def test_vllms_conditions_for_sparse_mla_under_dcp(configure, match):
    with pytest.raises(ValueError, match=match):
        _glm(**configure)


def test_qwen4_exp_qsa_is_refused_as_vllm_refuses_it():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = models.from_hf_config(QWEN4)
    with pytest.raises(ValueError, match="Qwen4Exp QSA does not support context parallelism"):
        model.configure(tp_size=8, dcp_size=2)


def test_the_largest_size_and_the_interleave_it_needs():
    """MLA's latent is on every rank, so any size TP divides passes (8 at TP 8), with an
    interleave of one k-pool; fp8 latents pass none."""
    model = _glm()
    assert (model.largest_dcp_size(), model.dcp_interleave_unit) == (8, 16)
    assert _glm(kv_dtype="fp8").largest_dcp_size() == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_holds_dcp_times_the_tokens_in_the_same_bytes(layout):
    """The pages, pools and placements of the plan without DCP; the latent's group (with the
    indexer's per-token rows) spans dcp times its rows, states keep their blocks; so exactly
    dcp times the tokens."""
    plain = make_plan(_glm(), layout, memory="80GiB")
    for dcp in (2, 4, 8):
        plan = make_plan(_glm(dcp, 16), layout, memory="80GiB")
        assert plan.pools == plain.pools and plan.kv_placements == plain.kv_placements
        for g, p in zip(plan.groups, plain.groups, strict=True):
            assert (g.kind, g.layers, g.page_bytes) == (p.kind, p.layers, p.page_bytes)
            assert g.dcp_size == (1 if g.is_state else dcp)
            assert (g.rows_per_block, g.block_size) == (
                p.block_size,
                p.block_size * g.dcp_size,
            )
        assert plan.capacity.token_capacity == dcp * plain.capacity.token_capacity


def test_vllms_packed_layout_shards_the_latent_and_keys_not_the_ring():
    """In vLLM's cache formats: the latent + k-pooled key group spans dcp blocks of rows, the
    tail ring (one block a request) and the KDA states do not; the exported specs say so, the
    hash block is the gcd of the prefix-cacheable spans (4,096 and the 1,024-token Mamba block:
    1,024) and hits land on it."""
    plain = make_plan(_glm(), "inflate", memory="40GiB", target=VLLM_FORMATS)
    model = _glm(4, 16)
    plan = make_plan(model, "inflate", memory="40GiB", target=VLLM_FORMATS)
    assert plan.block_size == plain.block_size == 1024
    spans = {(g.kind, g.block_size, g.dcp_size) for g in plan.groups}
    assert spans == {("mla", 4096, 4), ("state", 1024, 1), ("indexer_ring", 16, 1)}
    assert plan.capacity.token_capacity == 4 * plain.capacity.token_capacity
    assert plan.kv_placements == plain.kv_placements
    config = kv_cache_config(plan, model)
    sharded = {}
    for group in config["kv_cache_groups"]:
        for spec in group["kv_cache_spec"]["kv_cache_specs"].values():
            sharded.setdefault(spec["kind"], set()).add((spec["block_size"], spec["dcp_sharded"]))
    assert sharded == {
        "MambaSpec": {(1024, False)},
        "MLAAttentionSpec": {(1024, True)},  # latents and k-pooled keys: a rank's rows
        "CircularBufferSpec": {(16, False)},
    }
    assert (config["hash_block_size"], config["cache_hit_alignment_tokens"]) == (1024, 1024)
    assert config["kv_tp_replicas"] == 1


def test_an_interleave_must_divide_a_blocks_rows():
    """vLLM asserts the block size is at least the interleave and a multiple of it."""
    with pytest.raises(ValueError, match=r"blocks hold 64 rows a rank, which .* 128 does not"):
        make_plan(_glm(4, 128), "per_group", memory="80GiB")
    assert make_plan(_glm(4, 64), "per_group", memory="80GiB").dcp_size == 4


def test_cli_and_doctor(capsys):
    """The flag reaches the model (simulate's JSON says so); the doctor offers DCP with the
    interleave it needs, and under DCP says fp8 is no option rather than failing."""
    argv = ["--model", GLM, "-tp", "8", "--gpu-memory", "40GiB", "--json"]
    assert main(["plan", *argv, "-dcp", "4", "--cp-kv-cache-interleave-size", "16"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert {(g["kind"], g["dcp_size"]) for g in plan["groups"]} == {("mla", 4), ("state", 1)}
    assert main(["plan", *argv, "-dcp", "4"]) == 2
    assert "give --cp-kv-cache-interleave-size 16" in capsys.readouterr().err

    assert main(["doctor", *argv]) == 0
    remedies = {r["key"]: r for r in json.loads(capsys.readouterr().out)["remedies"]}
    assert remedies["dcp"]["flags"] == [
        "--decode-context-parallel-size",
        "8",
        "--cp-kv-cache-interleave-size",
        "16",
    ]
    assert remedies["dcp"]["token_capacity"] == 8 * remedies["as_given"]["token_capacity"]
    assert main(["doctor", *argv, "-dcp", "4", "--cp-kv-cache-interleave-size", "16"]) == 0
    out = json.loads(capsys.readouterr().out)
    findings = {f["key"]: f for f in out["findings"]}
    assert "FLASHMLA_SPARSE" in findings["fp8"]["data"]["refused"]
    assert findings["dcp"]["data"]["token_capacity"] == (
        4 * findings["dcp"]["data"]["token_capacity_without_dcp"]
    )
    sim = ["simulate", *argv, "--trace", "multi_turn_chat", "--requests", "4"]
    assert main([*sim, "-dcp", "4", "--cp-kv-cache-interleave-size", "16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["config"]["dcp_size"], out["config"]["cp_kv_cache_interleave_size"]) == (4, 16)
    assert out["result"]["finished"] == 4


def test_a_rank_scores_only_the_indexer_keys_it_keeps():
    """Under DCP the indexer (on every rank, no TP split) scores a rank's share of the pooled
    keys, so its FLOPs per context token fall dcp times; the latent's attention keeps its
    FLOPs (queries gathered), and a rank reads one token in dcp of the KV."""
    one, four = _glm(), _glm(4, 16)
    indexers = [layer.spec for layer in one.attention_layers if layer.spec.kind == "indexer"]
    per_ctx = sum(2 * s.index_n_heads * s.index_head_dim / s.pool_tokens for s in indexers)
    new, cached = 1, 100_000  # one decode token: every term is linear in the context read
    gap = attention_flops(one, new, cached) - attention_flops(four, new, cached)
    assert per_ctx > 0 and gap == pytest.approx(per_ctx * (cached + new) * (1 - 1 / 4))
    kv = one.kv_bytes_per_token
    a, b = StepCoster(one, H100_SXM), StepCoster(four, H100_SXM)
    assert a.decode_bytes(8, 80_000) - b.decode_bytes(8, 80_000) == pytest.approx(
        kv * (80_000 + 8) * (1 - 1 / 4)
    )


def test_vllms_own_functions_agree_under_dcp():
    """Where vLLM 0.33 is importable: its grouping of the exported specs is the export's (the
    latent and pooled keys sharded, rings and states not), its coordinator's DCP condition
    holds for every group (full attention, or not sharded), and its resolution of the
    scheduler block, hash block, hit alignment and TP replicas gives the export's; its own
    coordinator takes the scheduler's config, its managers' blocks the plan's groups'."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.v1.core import kv_cache_planning as kp
    from vllm.v1.core import kv_cache_utils as ku
    from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from hybridkv.vllm_export import vllm_objects

    for dcp in (2, 4, 8):
        model = _glm(dcp, 16)
        plan = make_plan(model, "inflate", memory="40GiB", target=VLLM_FORMATS)
        config, exported = vllm_objects(plan, model), kv_cache_config(plan, model)
        layout = KVCacheLayout[config.kv_cache_layout]
        vllm_config = planner_config(
            layout, block_size=plan.block_size, prefix_match_unit=None, enable_prefix_caching=True
        )
        vllm_config.parallel_config = SimpleNamespace(decode_context_parallel_size=dcp)
        vllm_config.kv_transfer_config = None
        specs = {
            n: s for g in config.kv_cache_groups for n, s in g.kv_cache_spec.kv_cache_specs.items()
        }
        groups = kp.get_kv_cache_groups(
            vllm_config, dict(sorted(specs.items(), key=lambda item: glm5_registered(item[0])))
        )
        assert [g.layer_names for g in groups] == [g.layer_names for g in config.kv_cache_groups]
        # the scheduler's config (a group's first layer spec), then vLLM's own coordinator: it
        # asserts every sharded group is full attention, and its managers' blocks are ours
        scheduler_config = ku.generate_scheduler_kv_cache_config([config])
        for g in scheduler_config.kv_cache_groups:
            assert (
                isinstance(g.kv_cache_spec, FullAttentionSpec) or not g.kv_cache_spec.dcp_sharded
            )
        scheduler, hash_block = ku.resolve_kv_cache_block_sizes(config, vllm_config)
        coordinator = get_kv_cache_coordinator(
            scheduler_config, 32_768, 8_192, False, True, False,
            dcp, 1, scheduler, hash_block,
        )  # fmt: skip
        managers = coordinator.single_type_managers
        assert [m.block_size for m in managers] == [g.block_size for g in plan.groups]
        assert coordinator.enable_partial_hash_hits
        assert (scheduler, hash_block) == (plan.scheduler_block_size, exported["hash_block_size"])
        hits = ku.resolve_cache_hit_alignment_tokens(
            scheduler_config, vllm_config, scheduler, hash_block
        )
        assert hits == exported["cache_hit_alignment_tokens"]
        assert {m.cache_hit_alignment_tokens for m in managers} == {hits}
        replicas = kp.kv_cache_groups_tp_replicas(config.kv_cache_groups, 8, dcp)
        assert replicas == exported["kv_tp_replicas"]
