"""``hybridkv.vllm_export``: plans as vLLM 0.33's ``KVCacheConfig``.

Field lists are checked against vLLM 0.33.0's dataclasses twice: against the list checked in
below (so the test runs on a machine without vLLM), and, where vLLM's source is on the machine
(``HYBRIDKV_VLLM_SRC`` pointing at an unpacked ``vllm`` package, or an installed one), against the
fields parsed from ``vllm/v1/kv_cache_interface.py`` with ``ast``. The layout facts (strides,
offsets, ``num_blocks``, block sizes) are checked against vLLM's own formulas, written out here
from ``get_kv_cache_config_from_groups`` / ``compute_layout_strides``
(``vllm/v1/core/kv_cache_planning.py``, ``vllm/v1/kv_cache_interface.py``).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
from vllm_planning import glm5_registered, planner_config

from hybridkv import models
from hybridkv.layouts import make_plan
from hybridkv.plan import KVPlacement
from hybridkv.target import VllmTarget
from hybridkv.vllm_export import (
    DERIVED_KEYS,
    FIELDS,
    VLLM_FAMILIES,
    kv_cache_config,
    layer_names,
    logged_capacity,
    vllm_disagreements,
    vllm_family,
    vllm_objects,
)

# vLLM 0.33.0's dataclass fields (vllm/v1/kv_cache_interface.py), checked in
VLLM_033_FIELDS = {
    "KVCacheConfig": [
        "num_blocks",
        "kv_cache_tensors",
        "kv_cache_groups",
        "prefix_cache_retention_interval",
        "kv_cache_layout",
        "hash_block_size",
        "cache_hit_alignment_tokens",
        "hisparse_host_num_blocks",
        "hisparse_host_block_stride",
        "hisparse_shared_host_pool",
        "kv_tp_replicas",
    ],
    "KVCacheTensor": ["size", "layers", "layer_stride", "block_stride", "offset", "host_resident"],
    "KVCacheGroupSpec": [
        "layer_names",
        "kv_cache_spec",
        "is_eagle_group",
        "host_resident",
        "enable_kv_transfer",
        "role",
    ],
    "FullAttentionSpec": [
        "block_size",
        "dcp_sharded",
        "block_stride_alignment",
        "is_draft",
        "max_tp_shards",
        "num_kv_heads",
        "head_size",
        "dtype",
        "head_size_v",
        "kv_quant_mode",
        "page_size_padded",
        "num_head_slots",
        "state_content_bytes",
        "tokens_per_state",
        "sliding_window",
        "attention_chunk_size",
        "non_causal",
    ],
    "MLAAttentionSpec": [
        "block_size",
        "dcp_sharded",
        "block_stride_alignment",
        "is_draft",
        "max_tp_shards",
        "num_kv_heads",
        "head_size",
        "dtype",
        "head_size_v",
        "kv_quant_mode",
        "page_size_padded",
        "num_head_slots",
        "state_content_bytes",
        "tokens_per_state",
        "sliding_window",
        "attention_chunk_size",
        "non_causal",
        "cache_dtype_str",
        "topk_buffer_width",
        "alignment",
        "model_version",
        "cache_role",
        "is_index_group_leader",
        "non_causal_multi_token_decode",
    ],
    "SlidingWindowSpec": [
        "block_size",
        "dcp_sharded",
        "block_stride_alignment",
        "is_draft",
        "max_tp_shards",
        "num_kv_heads",
        "head_size",
        "dtype",
        "head_size_v",
        "kv_quant_mode",
        "page_size_padded",
        "num_head_slots",
        "state_content_bytes",
        "tokens_per_state",
        "sliding_window",
        "extra_retained_tokens",
    ],
    "CircularBufferSpec": [
        "block_size",
        "dcp_sharded",
        "block_stride_alignment",
        "is_draft",
        "max_tp_shards",
        "num_kv_heads",
        "head_size",
        "dtype",
        "head_size_v",
        "kv_quant_mode",
        "page_size_padded",
        "num_head_slots",
        "state_content_bytes",
        "tokens_per_state",
    ],
    "UniformTypeKVCacheSpecs": [
        "block_size",
        "dcp_sharded",
        "block_stride_alignment",
        "is_draft",
        "kv_cache_specs",
    ],
    "MambaSpec": [
        "block_size",
        "dcp_sharded",
        "block_stride_alignment",
        "is_draft",
        "shapes",
        "dtypes",
        "page_size_padded",
        "mamba_type",
        "mamba_cache_mode",
        "num_speculative_blocks",
        "num_prefill_checkpoint_blocks",
        "prefill_checkpoint_alignment",
        "num_heads",
        "tokens_per_state",
        "tp_replicated",
    ],
}

# (zoo model, family's vLLM file): the models every check runs on, at TP 1 and 2
MODELS = [
    "qwen3.5-4b",
    "qwen3-next-80b-a3b",
    "nemotron-h-8b",
    "falcon-h1-0.5b",
    "jamba-v0.1",
    "kimi-linear-48b-a3b",
    "lfm2-1.2b",
    "zamba2-1.2b",
    "zamba2-2.7b",
    "granite-4.0-h-tiny",
    "nemotron-3-nano-30b-a3b",
    "nemotron-nano-9b-v2",
    "lfm2-8b-a1b",
    "olmo-hybrid-7b",
]
CASES = [pytest.param(name, tp, id=f"{name}-tp{tp}") for name in MODELS for tp in (1, 2)]
# families vLLM 0.33 does not serve: the export refuses them
NOT_SERVED = {
    "minimax-text-01": "0.23",
    "bamba-9b": "0.23",
    "recurrentgemma-2b": "RecurrentGemma",
    "zamba-7b-v1": "Zamba v1",
}
# known plan-vs-vLLM differences (see vllm_disagreements); anything else fails the test
KNOWN_NOTES = ("group order:", "page contents:")
KNOWN_EXTRA = {
    "zamba2-2.7b": ("groups:",),  # num_mem_blocks 2: vLLM's attention slot order differs
    "olmo-hybrid-7b": ("block size:",),  # OLMo's GDN exports no prefill checkpoints
}


def _plan(name: str, tp: int, layout: str = "inflate", **kwargs):
    model = models.load(name, tp_size=tp)
    plan = make_plan(model, layout, memory="64GiB", max_num_seqs=8, **kwargs)
    return model, plan


@pytest.fixture(scope="module")
def exported():
    cache: dict = {}

    def get(name: str, tp: int, layout: str = "inflate", **kwargs):
        key = (name, tp, layout, tuple(sorted(kwargs.items())))
        if key not in cache:
            model, plan = _plan(name, tp, layout, **kwargs)
            cache[key] = (model, plan, kv_cache_config(plan, model))
        return cache[key]

    return get


# ---- field lists ----------------------------------------------------------------------------


def _vllm_source() -> Path | None:
    candidates = [os.environ.get("HYBRIDKV_VLLM_SRC")]
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is not None and spec.origin:
        candidates.append(str(Path(spec.origin).parent))
    for c in candidates:
        if c and (Path(c) / "v1" / "kv_cache_interface.py").is_file():
            return Path(c) / "v1" / "kv_cache_interface.py"
    return None


def _parse_fields(path: Path) -> dict[str, list[str]]:
    """Dataclass fields of every class in ``path``, bases first (as ``dataclasses.fields``)."""
    tree = ast.parse(path.read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def own(name: str) -> list[str]:
        out = []
        for stmt in classes[name].body:
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and not ast.unparse(stmt.annotation).startswith("ClassVar")
            ):
                out.append(stmt.target.id)
        return out

    def fields(name: str) -> list[str]:
        result: list[str] = []
        for base in reversed(classes[name].bases):
            base_name = ast.unparse(base)
            if base_name in classes:
                result += [f for f in fields(base_name) if f not in result]
        return result + [f for f in own(name) if f not in result]

    return {name: fields(name) for name in VLLM_033_FIELDS}


def test_checked_in_fields_are_the_exporters():
    assert {k: list(v) for k, v in FIELDS.items()} == VLLM_033_FIELDS


def test_checked_in_fields_match_vllm_source():
    path = _vllm_source()
    if path is None:
        pytest.skip("vLLM 0.33 source not on this machine")
    assert _parse_fields(path) == VLLM_033_FIELDS


# ---- the export, model by model -------------------------------------------------------------


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_every_key_is_a_vllm_field(exported, name, tp):
    _, _, config = exported(name, tp)
    assert list(config) == VLLM_033_FIELDS["KVCacheConfig"]
    for tensor in config["kv_cache_tensors"]:
        assert list(tensor) == VLLM_033_FIELDS["KVCacheTensor"]
    for group in config["kv_cache_groups"]:
        assert list(group) == VLLM_033_FIELDS["KVCacheGroupSpec"]
        spec = group["kv_cache_spec"]
        assert spec["kind"] in VLLM_033_FIELDS
        assert set(spec) - set(DERIVED_KEYS) == set(VLLM_033_FIELDS[spec["kind"]])
        assert set(DERIVED_KEYS) <= set(spec)
    assert json.loads(json.dumps(config)) == config  # JSON-ready as it is


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_num_blocks_and_tensor_sizes(exported, name, tp):
    _, plan, config = exported(name, tp)
    pool = plan.pools[0]
    assert config["num_blocks"] == pool.num_blocks
    for tensor in config["kv_cache_tensors"]:
        assert tensor["size"] == config["num_blocks"] * pool.block_bytes
    # vLLM's _get_kv_cache_bytes_per_block (layer-outer): the largest group's padded pages
    per_block = max(
        len(g["layer_names"]) * g["kv_cache_spec"]["page_size_bytes"]
        for g in config["kv_cache_groups"]
    )
    assert per_block == pool.block_bytes
    assert config["num_blocks"] == plan.config.memory_bytes // per_block


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_layer_names_unique_and_cover_every_cache_layer(exported, name, tp):
    model, _, config = exported(name, tp)
    in_groups = [n for g in config["kv_cache_groups"] for n in g["layer_names"]]
    in_tensors = [n for t in config["kv_cache_tensors"] for n in t["layers"]]
    assert len(set(in_groups)) == len(in_groups) == len(model.layers)
    assert sorted(in_tensors) == sorted(in_groups)
    assert set(in_groups) == set(layer_names(model).values())


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_spec_pages_are_the_plan_page(exported, name, tp):
    _, plan, config = exported(name, tp)
    page = plan.extra["page_bytes"]
    for group in config["kv_cache_groups"]:
        spec = group["kv_cache_spec"]
        assert spec["page_size_bytes"] == page
        if spec["kind"] == "MambaSpec":
            size = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2}
            state = sum(
                math.prod(shape) * size[dtype]
                for shape, dtype in zip(spec["shapes"], spec["dtypes"])
            )
            # Platform._align_hybrid_block_size pads the state page to the attention page
            assert spec["page_size_padded"] == (None if state == page else page)
            assert state <= page


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_inflate_tensors_are_vllms(exported, name, tp):
    """get_kv_cache_config_from_groups, layer-outer (LBNHC): one tensor per group, aliasing from
    byte 0, layer_stride = padded page * num_blocks, block_stride = page."""
    _, _, config = exported(name, tp)
    assert config["kv_cache_layout"] == "LBNHC"
    groups = config["kv_cache_groups"]
    tensors = config["kv_cache_tensors"]
    assert len(tensors) == len(groups)
    for tensor, group in zip(tensors, groups):
        page = group["kv_cache_spec"]["page_size_bytes"]
        assert tensor["layers"] == group["layer_names"]
        assert tensor["offset"] == 0
        assert tensor["block_stride"] == page
        assert tensor["layer_stride"] == page * config["num_blocks"]


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_tensor_addresses_are_the_plans(exported, name, tp):
    """Every layer's block b starts where the plan puts it (the plan's tensors end to end)."""
    _, plan, config = exported(name, tp)
    names = {v: k for k, v in layer_names(exported(name, tp)[0]).items()}
    pool = plan.pools[0]
    size = plan.tensor(pool.tensors[0]).nbytes
    for tensor in config["kv_cache_tensors"]:
        for slot, vllm_name in enumerate(tensor["layers"]):
            p = plan.placement(names[vllm_name])
            base = pool.tensors.index(p.tensor) * size
            start = p.k_offset if isinstance(p, KVPlacement) else p.offset
            for block in (0, 1, config["num_blocks"] - 1):
                vllm_at = tensor["offset"] + slot * tensor["layer_stride"]
                vllm_at += block * tensor["block_stride"]
                stride = p.block_stride if isinstance(p, KVPlacement) else p.slot_stride
                assert vllm_at == base + start + block * stride


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_block_sizes_in_align_mode(exported, name, tp):
    _, plan, config = exported(name, tp)
    for group in config["kv_cache_groups"]:
        spec = group["kv_cache_spec"]
        assert spec["block_size"] == plan.block_size
        if spec["kind"] == "MambaSpec":
            assert spec["mamba_cache_mode"] == "align"
    assert config["hash_block_size"] == plan.block_size
    assert config["cache_hit_alignment_tokens"] == plan.block_size


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_block_sizes_without_prefix_caching(name, tp):
    """none mode: MambaModelConfig makes the Mamba block max_model_len; the attention block is
    the plan's (no checkpoint alignment)."""
    model = models.load(name, tp_size=tp)
    target = VllmTarget(enable_prefix_caching=False)
    plan = make_plan(model, "inflate", memory="64GiB", max_num_seqs=8, target=target)
    config = kv_cache_config(plan, model)
    max_len = plan.vllm.max_model_len
    assert max_len == model.max_position_embeddings
    sizes = set()
    for group in config["kv_cache_groups"]:
        spec = group["kv_cache_spec"]
        if spec["kind"] == "MambaSpec":
            assert spec["block_size"] == max_len
            assert spec["mamba_cache_mode"] == "none"
            # only MambaMixer2 declares a checkpoint block outside align mode
            mamba2 = spec["mamba_type"] == "MAMBA2"
            assert spec["num_prefill_checkpoint_blocks"] == int(mamba2)
            assert spec["prefill_checkpoint_alignment"] == (1 if mamba2 else None)
        else:
            assert spec["block_size"] == plan.block_size
        sizes.add(spec["block_size"])
    # no prefix caching: hashes and hits at the scheduler block, the lcm of the group blocks
    assert config["hash_block_size"] == math.lcm(*sizes)
    assert config["cache_hit_alignment_tokens"] == math.lcm(*sizes)


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_grouping_is_vllms_apart_from_known_notes(exported, name, tp):
    model, plan, _ = exported(name, tp)
    allowed = KNOWN_NOTES + KNOWN_EXTRA.get(name, ())
    for note in vllm_disagreements(plan, model):
        assert note.startswith(allowed), note


def test_qwen3_next_groups_in_vllm_order(exported):
    """Layer 0 is a GDN layer, so vLLM's first bucket (and groups 0-2) is GDN; group i of a
    bucket takes layers[i::3]."""
    _, _, config = exported("qwen3-next-80b-a3b", 1)
    groups = config["kv_cache_groups"]
    assert [g["kv_cache_spec"]["kind"] for g in groups] == ["MambaSpec"] * 3 + [
        "FullAttentionSpec"
    ]
    gdn = [i for i in range(48) if i % 4 != 3]
    for k in range(3):
        assert groups[k]["layer_names"] == [f"model.layers.{i}.linear_attn" for i in gdn[k::3]]
    attn = [f"model.layers.{i}.self_attn.attn" for i in range(3, 48, 4)]
    assert groups[3]["layer_names"] == attn


def test_falcon_h1_keeps_attention_first(exported):
    """Falcon-H1 builds layer i's attention before its SSM branch, which vLLM names
    model.{num_hidden_layers + i}.mixer."""
    model, _, config = exported("falcon-h1-0.5b", 1)
    first, second = config["kv_cache_groups"]
    assert first["kv_cache_spec"]["kind"] == "FullAttentionSpec"
    assert first["layer_names"][:2] == ["model.layers.0.attn", "model.layers.1.attn"]
    assert second["layer_names"][:2] == ["model.36.mixer", "model.37.mixer"]
    assert model.num_hidden_layers == 36


@pytest.mark.parametrize(
    ("name", "layer", "expected"),
    [
        ("qwen3.5-4b", "layers.3.attn", "language_model.model.layers.3.self_attn.attn"),
        ("qwen3.5-4b", "layers.0.mixer", "language_model.model.layers.0.linear_attn"),
        ("qwen3-next-80b-a3b", "layers.3.attn", "model.layers.3.self_attn.attn"),
        ("qwen3-next-80b-a3b", "layers.0.mixer", "model.layers.0.linear_attn"),
        ("nemotron-h-8b", "layers.7.attn", "model.layers.7.mixer.attn"),
        ("nemotron-h-8b", "layers.0.mixer", "model.layers.0.mixer"),
        ("nemotron-3-nano-30b-a3b", "layers.5.attn", "model.layers.5.mixer.attn"),
        ("granite-4.0-h-tiny", "layers.5.attn", "model.layers.5.self_attn.attn"),
        ("granite-4.0-h-tiny", "layers.0.mixer", "model.layers.0.mixer"),
        ("falcon-h1-0.5b", "layers.0.attn", "model.layers.0.attn"),
        ("falcon-h1-0.5b", "layers.0.mixer", "model.36.mixer"),
        ("jamba-v0.1", "layers.4.attn", "model.layers.4.attn"),
        ("jamba-v0.1", "layers.0.mixer", "model.layers.0.mixer"),
        ("kimi-linear-48b-a3b", "layers.3.attn", "model.layers.3.self_attn"),
        ("kimi-linear-48b-a3b", "layers.0.mixer", "model.layers.0.self_attn"),
        ("lfm2-1.2b", "layers.2.attn", "model.layers.2.self_attn.attn"),
        ("lfm2-1.2b", "layers.0.mixer", "model.layers.0.short_conv"),
        ("lfm2-8b-a1b", "layers.0.mixer", "model.layers.0.short_conv"),
        ("olmo-hybrid-7b", "layers.3.attn", "model.layers.3.self_attn.attn"),
        ("olmo-hybrid-7b", "layers.0.mixer", "model.layers.0.linear_attn"),
        # Zamba2: Mamba layers as str(hybrid layers + i) + ".mixer", shared attention as
        # model.attn.j; 1.2B has 6 hybrid layers and one shared block (j = k)
        ("zamba2-1.2b", "layers.0.mixer", "6.mixer"),
        ("zamba2-1.2b", "layers.11.attn", "model.attn.1"),
        # 2.7B: 9 hybrid layers, two shared blocks: block 1's j starts at (9 + 1) // 2 = 5
        ("zamba2-2.7b", "layers.0.mixer", "9.mixer"),
        ("zamba2-2.7b", "layers.6.attn", "model.attn.0"),
        ("zamba2-2.7b", "layers.12.attn", "model.attn.5"),
        ("zamba2-2.7b", "layers.18.attn", "model.attn.1"),
    ],
    ids=lambda v: v if isinstance(v, str) and "/" not in v else None,
)
def test_layer_name(name, layer, expected):
    assert layer_names(models.load(name))[layer] == expected


def test_family_table_names_a_vllm_file_for_each_family():
    for fam in VLLM_FAMILIES.values():
        assert fam.source.startswith("vllm/")
        assert fam.state


@pytest.mark.parametrize(
    ("model_type", "key"),
    [
        ("qwen3_next", "qwen3_next"),
        ("qwen3_5", "qwen3_5"),
        ("qwen3_5_moe", "qwen3_5"),
        ("qwen3_5_text", "qwen3_5"),  # a multimodal config.json reads as its text model type
        ("qwen3_5_moe_text", "qwen3_5"),
        ("nemotron_h", "nemotron_h"),
        ("granitemoehybrid", "granitemoehybrid"),
        ("falcon_h1", "falcon_h1"),
        ("jamba", "jamba"),
        ("kimi_linear", "kimi_linear"),
        ("lfm2", "lfm2"),
        ("lfm2_moe", "lfm2_moe"),
        ("zamba2", "zamba2"),
        ("olmo_hybrid", "olmo_hybrid"),
    ],
)
def test_hf_model_types(model_type, key):
    model = replace(models.load("qwen3.5-4b"), family=model_type)
    assert vllm_family(model).key == key


def test_text_only_qwen3_5_has_no_language_model_prefix():
    model = replace(
        models.load("qwen3.5-4b"),
        family="qwen3_5_text",
        extra={"architectures": ["Qwen3_5ForCausalLM"]},
    )
    assert layer_names(model)["layers.3.attn"] == "model.layers.3.self_attn.attn"


@pytest.mark.parametrize("config", ["qwen3.5-9b", "qwen3-next-80b-a3b", "falcon-h1-34b"])
def test_config_json_models_export(config):
    path = Path(__file__).parent / "data" / "hf_configs" / f"{config}.json"
    model = models.from_hf_config(path)
    plan = make_plan(model, "inflate", memory="80GiB", max_num_seqs=8)
    names = [n for g in kv_cache_config(plan, model)["kv_cache_groups"] for n in g["layer_names"]]
    prefix = "language_model.model." if config.startswith("qwen3.5") else "model."
    assert all(n.startswith(prefix) for n in names)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", sorted(NOT_SERVED))
def test_families_vllm_does_not_serve_are_refused(name, tp):
    model = models.load(name, tp_size=tp)
    plan = make_plan(model, "inflate", memory="200GiB", max_num_seqs=4)
    with pytest.raises(ValueError, match=re.escape(NOT_SERVED[name])):
        kv_cache_config(plan, model)


def test_qwen4_exp_in_transformers_formats_is_refused():
    """A Qwen4-Exp plan in transformers' formats (one raw indexer key per token riding in the
    attention's page) is not vLLM's layout: the export says what vLLM keeps instead, where vLLM
    says it, and how to plan vLLM's; the same model in vLLM's formats exports."""
    pytest.importorskip("transformers")
    from hybridkv.e2e import hybrid_model_for
    from hybridkv.e2e.families import TINY_CONFIGS

    model = hybrid_model_for(TINY_CONFIGS["qwen4_exp"](), "bfloat16")
    assert "indexer" in model.layer_kinds
    plan = make_plan(model, "inflate", memory="1GiB", max_num_seqs=4)
    assert plan.kv_cache_layout is None
    with pytest.raises(ValueError) as exc:
        kv_cache_config(plan, model)
    for fact in (
        "transformers' format",
        "QSACompressedKeyCache",
        "QSAKeyStateCache",
        "_get_packed_kv_cache_groups",
        "cache_formats='vllm'",
        "--format vllm",
    ):
        assert fact in str(exc.value)
    target = VllmTarget(cache_formats="vllm")
    packed = make_plan(model, "inflate", memory="1GiB", max_num_seqs=4, target=target)
    assert kv_cache_config(packed, model)["kv_cache_layout"] == "BLNHC"


def test_glm5_next_in_transformers_formats_is_refused():
    """A GLM-5-Next plan in transformers' formats (the default: per-token indexer rows riding in
    the latent's page, what the e2e engine serves) is not vLLM's layout: the export says what
    vLLM keeps instead, where vLLM says it, and how to plan vLLM's."""
    pytest.importorskip("transformers")
    from hybridkv.e2e import hybrid_model_for
    from hybridkv.e2e.families import TINY_CONFIGS

    model = hybrid_model_for(TINY_CONFIGS["glm5_next"](), "bfloat16")
    plan = make_plan(model, "inflate", memory="1GiB", max_num_seqs=4)
    assert plan.kv_cache_layout is None
    with pytest.raises(ValueError) as exc:
        kv_cache_config(plan, model)
    for fact in (
        "transformers' format",
        "Glm5NextIndexerCache",
        "Glm5NextTailCache",
        "_get_packed_kv_cache_groups",
        "cache_formats='vllm'",
        "--format vllm",
    ):
        assert fact in str(exc.value)


# ---- spec fields ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "mamba_type", "blocks", "alignment"),
    [
        ("qwen3-next-80b-a3b", "GDN_ATTN", 1, "block"),  # Qwen GDN + FlashInfer: the grid
        ("qwen3.5-4b", "GDN_ATTN", 1, "block"),
        ("nemotron-h-8b", "MAMBA2", 1, 1),  # MambaMixer2.get_kv_cache_spec
        ("falcon-h1-0.5b", "MAMBA2", 1, 1),
        ("jamba-v0.1", "MAMBA1", 0, None),
        ("kimi-linear-48b-a3b", "GDN_ATTN", 0, None),  # KDA is a GatedDeltaNetAttention
        ("lfm2-1.2b", "SHORT_CONV", 0, None),
        ("olmo-hybrid-7b", "GDN_ATTN", 0, None),  # OLMo's GDN exports no checkpoints
    ],
)
def test_mamba_spec_fields(exported, name, mamba_type, blocks, alignment):
    model, plan, config = exported(name, 1)
    specs = [g["kv_cache_spec"] for g in config["kv_cache_groups"]]
    mamba = [s for s in specs if s["kind"] == "MambaSpec"]
    assert mamba
    for spec in mamba:
        assert spec["mamba_type"] == mamba_type
        assert spec["num_prefill_checkpoint_blocks"] == blocks
        expected = plan.block_size if alignment == "block" else alignment
        assert spec["prefill_checkpoint_alignment"] == expected
        assert spec["num_speculative_blocks"] == 0
        assert spec["dcp_sharded"] is False
        layer = model.layer(plan.state_placements[0].layer)
        tensors = layer.spec.state_tensors()
        assert spec["shapes"] == [list(t.shape) for t in tensors]
        assert spec["dtypes"] == [f"torch.{t.dtype}" for t in tensors]


def test_attention_spec_fields(exported):
    _, plan, config = exported("qwen3-next-80b-a3b", 2)
    (spec,) = [
        g["kv_cache_spec"]
        for g in config["kv_cache_groups"]
        if g["kv_cache_spec"]["kind"] == "FullAttentionSpec"
    ]
    assert spec["num_kv_heads"] == 1  # 2 KV heads over TP 2
    assert (spec["head_size"], spec["head_size_v"]) == (256, 256)
    assert spec["dtype"] == "torch.bfloat16"
    assert spec["kv_quant_mode"] == "NONE"
    assert spec["page_size_padded"] is None
    assert spec["dcp_sharded"] is True
    assert spec["page_size_bytes"] == plan.block_size * 1 * 512 * 2


def test_mla_fp8_spec_fields():
    model = models.load("kimi-linear-48b-a3b", kv_dtype="fp8", tp_size=2)
    plan = make_plan(model, "inflate", memory="64GiB", max_num_seqs=8)
    config = kv_cache_config(plan, model)
    (spec,) = [
        g["kv_cache_spec"]
        for g in config["kv_cache_groups"]
        if g["kv_cache_spec"]["kind"] == "MLAAttentionSpec"
    ]
    assert spec["dtype"] == "torch.uint8"  # STR_DTYPE_TO_TORCH_DTYPE["fp8"]
    assert spec["kv_quant_mode"] == "FP8_PER_TENSOR"
    assert spec["cache_dtype_str"] == "fp8"
    assert (spec["num_kv_heads"], spec["head_size"], spec["head_size_v"]) == (1, 576, 0)
    assert spec["max_tp_shards"] == 1
    assert spec["block_size"] % 128 == 0  # MLA hybrids align to 128
    assert spec["page_size_bytes"] == spec["block_size"] * 576
    assert config["kv_tp_replicas"] == 1  # the Mamba groups are TP-sharded


# ---- layouts --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "layout", "kwargs"),
    [
        ("qwen3-next-80b-a3b", "pack", {"pack_size": 3}),
        ("qwen3-next-80b-a3b", "pack", {"pack_size": 5}),  # 12 layers: a partial last pack
        ("qwen3-next-80b-a3b", "aggregate", {}),
        ("nemotron-h-8b", "pack", {"pack_size": 2}),
        ("kimi-linear-48b-a3b", "pack", {"pack_size": 7}),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_packed_layouts_export(exported, name, layout, kwargs):
    model, plan, config = exported(name, 1, layout, **kwargs)
    assert config["kv_cache_layout"] == "BLNHC"
    assert config["num_blocks"] == plan.pools[0].num_blocks
    page = plan.extra["page_bytes"]
    names = {v: k for k, v in layer_names(model).items()}
    size = plan.tensor(plan.pools[0].tensors[0]).nbytes
    for tensor in config["kv_cache_tensors"]:
        assert tensor["block_stride"] == page
        assert tensor["layer_stride"] == size
        for slot, vllm_name in enumerate(tensor["layers"]):
            p = plan.placement(names[vllm_name])
            start = p.k_offset if isinstance(p, KVPlacement) else p.offset
            base = plan.pools[0].tensors.index(p.tensor) * size + start
            assert tensor["offset"] + slot * tensor["layer_stride"] == base
    for group in config["kv_cache_groups"]:
        spec = group["kv_cache_spec"]
        if spec["kind"] == "MambaSpec":
            assert spec["page_size_bytes"] == page
        else:
            assert spec["page_size_bytes"] * plan.pack_size <= page
    in_tensors = sorted(n for t in config["kv_cache_tensors"] for n in t["layers"])
    assert in_tensors == sorted(layer_names(model).values())


@pytest.mark.parametrize("layout", ["per_group", "two_level"])
def test_layouts_with_more_than_one_pool_are_refused(layout):
    model, plan = _plan("qwen3.5-4b", 1, layout)
    with pytest.raises(ValueError, match=r"one shared block pool.*--layout inflate"):
        kv_cache_config(plan, model)


def test_plan_for_vllm_032_is_refused():
    model = models.load("qwen3.5-4b")
    plan = make_plan(
        model, "inflate", memory="64GiB", max_num_seqs=8, target=VllmTarget(version="0.32")
    )
    with pytest.raises(ValueError, match=re.escape("--vllm-version 0.33")):
        kv_cache_config(plan, model)


def test_plan_and_model_must_match():
    _, plan = _plan("qwen3.5-4b", 1)
    with pytest.raises(ValueError, match="TP"):
        kv_cache_config(plan, models.load("qwen3.5-4b", tp_size=2))


def test_olmo_hybrid_exports_no_gdn_checkpoints(exported):
    """OLMo-Hybrid's GDN layer class exports no FlashInfer checkpoints: vLLM's 16-token unit."""
    model, plan, config = exported("olmo-hybrid-7b", 1)
    assert plan.block_size % 64 != 0 or plan.vllm.checkpoint_alignment is None
    assert plan.vllm.checkpoint_alignment is None
    (state,) = {
        json.dumps(g["kv_cache_spec"]["num_prefill_checkpoint_blocks"])
        for g in config["kv_cache_groups"]
        if g["kv_cache_spec"]["kind"] == "MambaSpec"
    }
    assert state == "0"
    assert not any(n.startswith("block size") for n in vllm_disagreements(plan, model))


# ---- real vLLM objects ----------------------------------------------------------------------


def test_vllm_objects_need_vllm():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed")
    model, plan = _plan("qwen3.5-4b", 1)
    with pytest.raises(ImportError, match="vLLM"):
        vllm_objects(plan, model)


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_vllm_objects_page_sizes(name, tp):
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import compute_layout_strides
    from vllm.v1.kv_cache_layout import KVCacheLayout

    model, plan = _plan(name, tp)
    config = vllm_objects(plan, model)
    exported_config = kv_cache_config(plan, model)
    assert config.num_blocks == exported_config["num_blocks"]
    for group, data in zip(config.kv_cache_groups, exported_config["kv_cache_groups"]):
        assert group.kv_cache_spec.page_size_bytes == data["kv_cache_spec"]["page_size_bytes"]
        assert group.kv_cache_spec.page_size_bytes == plan.extra["page_bytes"]
    for tensor, group in zip(config.kv_cache_tensors, config.kv_cache_groups):
        strides = compute_layout_strides(
            group.kv_cache_spec, config.num_blocks, len(tensor.layers), KVCacheLayout.LBNHC
        )
        assert strides[:2] == (tensor.layer_stride, tensor.block_stride)


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_vllm_planner_builds_the_same_config(name, tp):
    """vLLM's own grouping and placement, run on the exported specs in vLLM's layer
    registration order, give the exported groups, tensors and num_blocks."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.v1.core import kv_cache_planning as kp
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from hybridkv.vllm_export import _names_and_order

    model, plan = _plan(name, tp)
    config = vllm_objects(plan, model)
    names, order = _names_and_order(model)
    by_vllm_name = {v: k for k, v in names.items()}
    specs = {n: g.kv_cache_spec for g in config.kv_cache_groups for n in g.layer_names}
    registered = dict(sorted(specs.items(), key=lambda kv: order[by_vllm_name[kv[0]]]))
    groups = kp._get_kv_cache_groups_uniform_page_size(registered)
    ours = [g.layer_names for g in config.kv_cache_groups]
    if "groups:" in KNOWN_EXTRA.get(name, ()):
        assert [g.layer_names for g in groups] != ours  # a known, reported difference
        return
    assert [g.layer_names for g in groups] == ours
    layout = KVCacheLayout[config.kv_cache_layout]
    vllm_config = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            num_gpu_blocks_override=None,
            prefix_cache_retention_interval=0,
        ),
    )
    theirs = kp.get_kv_cache_config_from_groups(vllm_config, groups, plan.config.memory_bytes)
    assert theirs.num_blocks == config.num_blocks

    def rows(c):
        return [(t.size, t.layers, t.layer_stride, t.block_stride, t.offset) for t in c]

    assert rows(theirs.kv_cache_tensors) == rows(config.kv_cache_tensors)


# ---- GLM-5-Next in vLLM's cache formats -----------------------------------------------------
#
# Hand-derived from vLLM 0.33.0's source (the layer classes in vllm/models/glm5next/common/,
# _get_packed_kv_cache_groups, _get_kv_cache_bytes_per_block and
# get_kv_cache_config_from_groups in vllm/v1/core/kv_cache_planning.py; see
# hybridkv/layouts/vllm_packed.py). transformers' Glm5NextConfig defaults: 45 layers, MLA on
# i % 4 == 3 (11 layers: 3, 7, ..., 43), KDA elsewhere (34), kv_lora_rank 512 (NoPE),
# index_head_dim 128, index_kpool 16, index_topk 2048, 64 KDA heads of 128.

_GLM = "language_model.model.layers.{}.self_attn"
_GLM_MLA = list(range(3, 45, 4))
_GLM_KDA = [i for i in range(45) if i % 4 != 3]


def _glm5(text_config=None, *, kv="auto", tp=1, spec=0, memory="64GiB", **target):
    transformers = pytest.importorskip("transformers")
    config = transformers.Glm5NextConfig(text_config=text_config or None).to_dict()
    model = models.from_hf_config(config, kv_dtype=kv, tp_size=tp, num_spec_tokens=spec)
    vllm_target = VllmTarget(cache_formats="vllm", **target)
    plan = make_plan(model, "inflate", memory=memory, max_num_seqs=8, target=vllm_target)
    return model, plan, kv_cache_config(plan, model)


@pytest.fixture(scope="module")
def glm5_default():
    return _glm5()


def test_glm5_next_groups_and_tensors_are_vllms(glm5_default):
    """bf16, TP 1, prefix caching (align mode), 64 GiB.

    Pages (block 4,608: tests/test_vllm_parity.py derives it):
      latent  L = 4,608 x 512 x 2                      = 4,718,592
      indexer X = 4,608 / 16 entries x (128 + 4)       =    38,016
      ring    R = 2 heads x 16 slots x 128 x 2         =     8,192
      KDA       = 64x128x128x4 + 3x(3x64x128)x2 = 4,341,760, padded to L (_align_hybrid_block_size)
    Buckets, in registration order (KDA layer 0 first; an MLA layer registers indexer.k_cache,
    indexer.tail_cache, attn): KDA (34), indexer + latent (22: 11 of X, 11 of L), rings (11).
    Repeats per group: _approximate_gcd([34, 11, 11], lower bound 11): padding 10 at 11, 4 at
    12, 9 at 13, more above: 12, so the indexer + latent bucket is one group (cdiv(11, 12)).
    anchor = 11 x (X + L) = 52,322,688; a KDA group holds anchor // L = 11 states, so
    cdiv(34, 11) = 4 groups, KDA layers [k::4]: 9, 9, 8, 8; the rings fit one group.
    Bytes per block: 52,322,688 up to a multiple of lcm(1,024 latent row, 4,224 indexer page at
    its gcd(1,024, 4,608) = 512-token kernel block: 32 x 132) = 33,792: 1,549 x 33,792 =
    52,343,808. num_blocks = 64 GiB // 52,343,808 = 1,312."""
    _, plan, config = glm5_default
    block_bytes = 52_343_808
    assert block_bytes == 33_792 * 1_549 and 1_548 * 33_792 < 11 * (38_016 + 4_718_592)
    assert config["num_blocks"] == 2**36 // block_bytes == 1_312
    assert config["kv_cache_layout"] == "BLHNC"  # KpoolTailBackend's only supported layout
    kda = [_GLM.format(i) for i in _GLM_KDA]
    mla = [(_GLM.format(i) + ".indexer.k_cache", _GLM.format(i) + ".attn") for i in _GLM_MLA]
    rings = [_GLM.format(i) + ".indexer.tail_cache" for i in _GLM_MLA]
    expected_groups = [
        kda[0::4],
        kda[1::4],
        kda[2::4],
        kda[3::4],
        [name for pair in mla for name in pair],
        rings,
    ]
    groups = config["kv_cache_groups"]
    assert [g["layer_names"] for g in groups] == expected_groups
    assert [len(g) for g in expected_groups] == [9, 9, 8, 8, 22, 11]
    size = 1_312 * block_bytes
    L, X, R = 4_718_592, 38_016, 8_192
    expected_tensors = [
        (kda[0::4], L, 0),
        (kda[1::4], L, 0),
        (kda[2::4], L, 0),
        (kda[3::4], L, 0),
        ([k for k, _ in mla], X, 0),  # the indexer keys first: their spec appears first
        ([a for _, a in mla], L, 11 * X),  # 418,176
        (rings, R, 0),
    ]
    assert [
        (t["layers"], t["layer_stride"], t["offset"]) for t in config["kv_cache_tensors"]
    ] == expected_tensors
    for t in config["kv_cache_tensors"]:
        assert (t["size"], t["block_stride"], t["host_resident"]) == (size, block_bytes, False)
    pages = [g["kv_cache_spec"]["page_size_bytes"] for g in groups]
    assert pages == [9 * L, 9 * L, 8 * L, 8 * L, 11 * (X + L), 11 * R]
    assert max(pages) == 52_322_688 <= block_bytes
    # the plan owns all of it: one backing tensor, the pool's blocks, each page where vLLM puts it
    assert plan.pools[0].block_bytes == block_bytes and plan.tensors[0].nbytes == size
    assert plan.kv_cache_layout == "BLHNC"
    # hash and hit granularity: the rings are not prefix-cacheable, so gcd(4,608 x 5) = 4,608,
    # and no Mamba block exceeds it (no partial hits): both 4,608
    assert (config["hash_block_size"], config["cache_hit_alignment_tokens"]) == (4_608, 4_608)
    assert config["kv_tp_replicas"] == 1  # the KDA states are TP-sharded
    assert config["prefix_cache_retention_interval"] == 0


def test_glm5_next_spec_fields(glm5_default):
    """Every dataclass field of each kind of layer spec, as vLLM 0.33's layers fill it."""
    _, _, config = glm5_default
    groups = config["kv_cache_groups"]
    base = {"block_size": 4_608, "block_stride_alignment": None, "is_draft": False}
    for g in groups:
        spec = g["kv_cache_spec"]
        first = spec["kv_cache_specs"][g["layer_names"][0]]
        assert spec["kind"] == "UniformTypeKVCacheSpecs"  # _get_packed_kv_cache_groups' groups
        assert list(spec["kv_cache_specs"]) == g["layer_names"]
        assert spec["block_size"] == first["block_size"]
        assert spec["dcp_sharded"] == first["dcp_sharded"]  # UniformTypeKVCacheSpecs.__post_init__
        assert (spec["block_stride_alignment"], spec["is_draft"]) == (None, False)
    mla_tail = {
        "sliding_window": None,
        "attention_chunk_size": None,
        "non_causal": False,
        "alignment": None,
        "model_version": None,
        "non_causal_multi_token_decode": False,
    }
    attention = {
        "max_tp_shards": 1,
        "num_kv_heads": 1,
        "head_size_v": 0,
        "kv_quant_mode": "NONE",
        "page_size_padded": None,
        "num_head_slots": None,
        "state_content_bytes": None,
    }
    latent = groups[4]["kv_cache_spec"]["kv_cache_specs"][_GLM.format(3) + ".attn"]
    assert latent == {
        "kind": "MLAAttentionSpec",
        **base,
        "dcp_sharded": True,
        # FlashInferMLASparseSM90Backend.customize_spec: blocks a whole latent row apart
        "block_stride_alignment": 1_024,
        **attention,
        "head_size": 512,
        "dtype": "torch.bfloat16",
        "tokens_per_state": 1,
        **mla_tail,
        "cache_dtype_str": "auto",
        "topk_buffer_width": 2_176,  # round_up(2,048 + 16 - 1, 128)
        "cache_role": "SPARSE",
        "is_index_group_leader": True,  # its MLAAttention has the indexer
        "page_size_bytes": 4_718_592,
    }
    indexer = groups[4]["kv_cache_spec"]["kv_cache_specs"][_GLM.format(3) + ".indexer.k_cache"]
    assert indexer == {
        "kind": "MLAAttentionSpec",
        **base,
        "dcp_sharded": True,
        # customize_attention_spec: Glm5NextIndexerBackend's blocks are 16 x (32, 64), all ints
        "block_stride_alignment": {"MultipleOf": 1_024},
        **attention,
        "head_size": 132,  # 128 fp8 + 128 // 128 x 4 float32 scale
        "dtype": "torch.uint8",
        "tokens_per_state": 16,
        **mla_tail,
        "cache_dtype_str": None,
        "topk_buffer_width": None,
        "cache_role": "INDEXER",
        "is_index_group_leader": False,
        "page_size_bytes": 38_016,
    }
    ring = groups[5]["kv_cache_spec"]["kv_cache_specs"][_GLM.format(3) + ".indexer.tail_cache"]
    assert ring == {
        "kind": "CircularBufferSpec",
        **base,
        "block_size": 16,  # 16 x next_power_of_2(cdiv(16 + 0, 16))
        "dcp_sharded": False,
        **attention,
        "max_tp_shards": None,
        "num_kv_heads": 2,  # the raw key and the gate score
        "head_size": 128,
        "dtype": "torch.bfloat16",
        "tokens_per_state": 1,
        "page_size_bytes": 8_192,
    }
    state = groups[0]["kv_cache_spec"]["kv_cache_specs"][_GLM.format(0)]
    assert state == {
        "kind": "MambaSpec",
        **base,
        "dcp_sharded": False,
        "shapes": [[3, 24_576], [64, 128, 128]],  # kda_state_shape: conv (k - 1, 3 x 64 x 128)
        "dtypes": ["torch.bfloat16", "torch.float32"],
        "page_size_padded": 4_718_592,
        "mamba_type": "GDN_ATTN",
        "mamba_cache_mode": "align",
        "num_speculative_blocks": 0,
        # Glm5NextLinearAttention.get_kv_cache_spec under FlashKDA (Hopper, bf16, head 128,
        # bounded gate): one checkpoint block at kda_prefill_checkpoint_alignment's 16
        "num_prefill_checkpoint_blocks": 1,
        "prefill_checkpoint_alignment": 16,
        "num_heads": 1,
        "tokens_per_state": -1,
        "tp_replicated": False,
        "page_size_bytes": 4_718_592,
    }


def test_glm5_next_keys_are_vllm_fields(glm5_default):
    _, _, config = glm5_default
    assert list(config) == VLLM_033_FIELDS["KVCacheConfig"]
    for tensor in config["kv_cache_tensors"]:
        assert list(tensor) == VLLM_033_FIELDS["KVCacheTensor"]
    for group in config["kv_cache_groups"]:
        assert list(group) == VLLM_033_FIELDS["KVCacheGroupSpec"]
        outer = group["kv_cache_spec"]
        for spec in (outer, *outer["kv_cache_specs"].values()):
            keys = list(spec)
            assert keys[0] == "kind" and keys[-1] == "page_size_bytes"
            assert keys[1:-1] == VLLM_033_FIELDS[spec["kind"]]
    assert json.loads(json.dumps(config)) == config


# (text_config, kv, tp, spec tokens) -> (block, ring, bytes per block, num_blocks), all at 64 GiB
# and 12 repeats per group as above (the bucket counts do not change):
_GLM5_VARIANTS = [
    # fp8 latent (512 B/token): block 8,704 = 512 x 17; L = 8,704 x 512 = 4,456,448,
    # X = 544 x 132 = 71,808; anchor 11 x (X + L) = 49,810,816 holds 11 states: KDA 9/9/8/8;
    # lcm(512 fp8 row, gcd(1,024, 8,704) = 512 -> 32 x 132 = 4,224) = 16,896; 2,949 x 16,896 =
    # 49,826,304; 2^36 // 49,826,304 = 1,379
    pytest.param(None, "fp8", 1, 0, (8_704, 16, 49_826_304, 1_379), id="fp8"),
    # TP 2: 32 KDA heads a rank: 2,097,152 + 3 x 12,288 x 2 = 2,170,880 B; block 512 x
    # cdiv(2,170,880, 524,288) = 2,560; L = 2,621,440, X = 160 x 132 = 21,120; anchor
    # 29,068,160 holds 11 states; lcm(1,024, 4,224) = 33,792: 861 x 33,792 = 29,094,912;
    # 2^36 // 29,094,912 = 2,361
    pytest.param(None, "auto", 2, 0, (2_560, 16, 29_094_912, 2_361), id="tp2"),
    # index_kpool 8, 32 KDA heads: block 2,304 (test_vllm_parity); L = 2,359,296,
    # X = 288 x 132 = 38,016, ring 8 slots (4,096 B); anchor 26,370,432 holds 11 states;
    # kernel blocks 8 x (32, 64): gcd(512, 2,304) = 256 -> 32 x 132 = 4,224; lcm 33,792:
    # 781 x 33,792 = 26,391,552; 2^36 // 26,391,552 = 2,603
    pytest.param(
        {"index_kpool": 8, "linear_num_heads": 32},
        "auto",
        1,
        0,
        (2_304, 8, 26_391_552, 2_603),
        id="kpool8",
    ),
    # 3 speculative tokens, fp8: conv (3 + 3) x 24,576 x 2 = 294,912 + 4,194,304 = 4,489,216 B;
    # block 512 x 18 = 9,216; ring 16 x next_power_of_2(cdiv(19, 16)) = 32 slots (16,384 B);
    # L = 4,718,592, X = 576 x 132 = 76,032; anchor 52,740,864 holds 11 states; gcd(1,024,
    # 9,216) = 1,024 -> 64 x 132 = 8,448; lcm(512, 8,448) = 16,896: 3,122 x 16,896 =
    # 52,749,312; 2^36 // 52,749,312 = 1,302
    pytest.param(None, "fp8", 1, 3, (9_216, 32, 52_749_312, 1_302), id="fp8-spec3"),
]


@pytest.mark.parametrize(("text_config", "kv", "tp", "spec", "expected"), _GLM5_VARIANTS)
def test_glm5_next_variants(text_config, kv, tp, spec, expected):
    block, ring, block_bytes, num_blocks = expected
    _, plan, config = _glm5(text_config, kv=kv, tp=tp, spec=spec)
    assert config["num_blocks"] == num_blocks == 2**36 // block_bytes
    assert plan.block_size == block
    sizes = [len(g["layer_names"]) for g in config["kv_cache_groups"]]
    assert sizes == [9, 9, 8, 8, 22, 11]
    specs = [g["kv_cache_spec"] for g in config["kv_cache_groups"]]
    assert [s["block_size"] for s in specs] == [block] * 5 + [ring]
    assert {t["block_stride"] for t in config["kv_cache_tensors"]} == {block_bytes}
    latent = specs[4]["kv_cache_specs"][_GLM.format(3) + ".attn"]
    fp8 = kv == "fp8"
    assert latent["dtype"] == ("torch.uint8" if fp8 else "torch.bfloat16")
    assert latent["kv_quant_mode"] == ("FP8_PER_TENSOR" if fp8 else "NONE")
    assert latent["cache_dtype_str"] == ("fp8" if fp8 else "auto")
    assert latent["block_stride_alignment"] == 512 * (1 if fp8 else 2)
    state = specs[0]["kv_cache_specs"][_GLM.format(0)]
    assert state["num_speculative_blocks"] == spec
    assert state["page_size_padded"] == block * 512 * (1 if fp8 else 2)
    assert specs[5]["page_size_bytes"] == 11 * 2 * ring * 128 * 2


def test_glm5_next_without_prefix_caching():
    """none mode: the KDA groups' block is max_model_len (32,768 here), the rest as in align
    mode (the block does not change: tests/test_vllm_parity.py); the scheduler block is
    lcm(32,768, 4,608, 16) = 294,912, and without prefix caching the hash block is the same."""
    _, _, config = _glm5(enable_prefix_caching=False, max_model_len=32_768)
    specs = [g["kv_cache_spec"] for g in config["kv_cache_groups"]]
    assert [s["block_size"] for s in specs] == [32_768] * 4 + [4_608, 16]
    state = specs[0]["kv_cache_specs"][_GLM.format(0)]
    assert state["mamba_cache_mode"] == "none" and state["block_size"] == 32_768
    assert state["num_prefill_checkpoint_blocks"] == 1  # the KDA layer declares it in any mode
    assert config["hash_block_size"] == config["cache_hit_alignment_tokens"] == 294_912
    assert math.lcm(32_768, 4_608, 16) == 294_912
    assert config["num_blocks"] == 1_312  # the packing is the same


def test_glm5_next_logged_capacity(glm5_default):
    """get_max_concurrency_for_kv_cache_config: the latent group cdiv(1,048,576, 4,608) = 228
    blocks a request, each KDA group 2 + 0 + 1 (the FlashKDA checkpoint block) = 3, the ring
    group 1: 228 + 4 x 3 + 1 = 241 blocks; 1,312 / 241 x 1,048,576 tokens."""
    model, plan, _ = glm5_default
    logged = logged_capacity(plan, model)
    assert (logged.attention_blocks_per_request, logged.state_blocks_per_request) == (228, 12)
    assert logged.ring_blocks_per_request == 1 and logged.blocks_per_request == 241
    assert logged.tokens == int(1_312 / 241 * 1_048_576)
    assert vllm_disagreements(plan, model) == []


def test_glm5_next_causal_lm_names():
    """A text-only checkpoint (Glm5NextForCausalLM) has no language_model. prefix."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Glm5NextConfig().to_dict()["text_config"]
    model = models.from_hf_config({**config, "architectures": ["Glm5NextForCausalLM"]})
    names = layer_names(model)
    assert names["layers.3.attn"] == "model.layers.3.self_attn.attn"
    assert names["layers.3.indexer"] == "model.layers.3.self_attn.indexer.k_cache"
    assert names["layers.0.mixer"] == "model.layers.0.self_attn"
    plan = make_plan(model, "inflate", memory="64GiB", target=VllmTarget(cache_formats="vllm"))
    rings = kv_cache_config(plan, model)["kv_cache_groups"][5]["layer_names"]
    assert rings[0] == "model.layers.3.self_attn.indexer.tail_cache"


def test_glm5_next_vllm_planner_builds_the_same_config():
    """vLLM's own grouping and placement (get_kv_cache_groups with a BLHNC layout, then
    get_kv_cache_config_from_groups), run on the exported specs in vLLM's registration order,
    give the exported groups, tensors and num_blocks."""
    pytest.importorskip("vllm")

    from vllm.v1.core import kv_cache_planning as kp
    from vllm.v1.kv_cache_layout import KVCacheLayout

    cases = [(None, "auto", 1, 0, None), *(v.values for v in _GLM5_VARIANTS)]
    for text_config, kv, tp, spec, _ in cases:
        model, plan, _ = _glm5(text_config, kv=kv, tp=tp, spec=spec)
        config = vllm_objects(plan, model)
        specs = {
            n: s for g in config.kv_cache_groups for n, s in g.kv_cache_spec.kv_cache_specs.items()
        }
        ordered = dict(sorted(specs.items(), key=lambda item: glm5_registered(item[0])))
        layout = KVCacheLayout[config.kv_cache_layout]
        vllm_config = planner_config(layout)
        groups = kp.get_kv_cache_groups(vllm_config, ordered)
        assert [g.layer_names for g in groups] == [g.layer_names for g in config.kv_cache_groups]
        assert [g.kv_cache_spec for g in groups] == [
            g.kv_cache_spec for g in config.kv_cache_groups
        ]
        theirs = kp.get_kv_cache_config_from_groups(vllm_config, groups, plan.config.memory_bytes)
        assert theirs.num_blocks == config.num_blocks

        def rows(c):
            return [(t.size, t.layers, t.layer_stride, t.block_stride, t.offset) for t in c]

        assert rows(theirs.kv_cache_tensors) == rows(config.kv_cache_tensors)


# ---- Qwen4-Exp in vLLM's cache formats ------------------------------------------------------
#
# Hand-derived from vLLM 0.33.0's source (Qwen4ExpDecoderLayer, Qwen4ExpQSAAttention, QSAIndexer,
# QSAKeyStateCache, QSACompressedKeyCache, Qwen4ExpPLELayer in vllm/models/qwen4_exp/, then
# _get_packed_kv_cache_groups, _get_kv_cache_bytes_per_block and get_kv_cache_config_from_groups
# in vllm/v1/core/kv_cache_planning.py; see hybridkv/layouts/vllm_packed.py). No Qwen4-Exp config
# is released and transformers' Qwen4ExpTextConfig defaults have no QSA indexer and no PLE
# layer, so these plan its defaults plus examples/qwen4_exp-qsa.json's fields (chosen here, not
# released): 40 layers, GQA with its QSA indexer on i % 4 == 3 (10 layers: 3, 7, ..., 39), GDN
# elsewhere (30), PLE on layers 0 and 1; 2 KV heads of 256; GDN 16 key heads and 32 value
# heads of 128, conv kernel 4; PLE hc_count 4 x hidden 2,048 channels, kernel 4, dilation 3;
# indexer_head_dim 128, indexer_compress_ratio 4, partial_rotary_factor 0.25 (rotary 64 <= 128,
# which transformers checks).

_QWEN4 = "language_model.model.layers.{}"
_QWEN4_ATTN = list(range(3, 40, 4))
_QWEN4_GDN = [i for i in range(40) if i % 4 != 3]
_QWEN4_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "qwen4_exp-qsa.json"


def _qwen4(text=None, *, kv="auto", tp=1, spec=0, memory="64GiB", wrapper=True, **target):
    transformers = pytest.importorskip("transformers")
    fields = {**json.loads(_QWEN4_EXAMPLE.read_text())["text_config"], **(text or {})}
    if wrapper:
        config = transformers.Qwen4ExpConfig(text_config=fields).to_dict()
    else:
        config = transformers.Qwen4ExpTextConfig(**fields).to_dict()
        config["architectures"] = ["Qwen4ExpForCausalLM"]
    model = models.from_hf_config(config, kv_dtype=kv, tp_size=tp, num_spec_tokens=spec)
    vllm_target = VllmTarget(cache_formats="vllm", **target)
    plan = make_plan(model, "inflate", memory=memory, max_num_seqs=8, target=vllm_target)
    return model, plan, kv_cache_config(plan, model)


@pytest.fixture(scope="module")
def qwen4_default():
    return _qwen4()


def test_qwen4_exp_example_file_is_transformers_defaults_plus_its_fields():
    """examples/qwen4_exp-qsa.json (the README's command) names only the fields it sets; read
    by hybridkv it is the model transformers builds from the same fields."""
    transformers = pytest.importorskip("transformers")
    text = json.loads(_QWEN4_EXAMPLE.read_text())["text_config"]
    from_file = models.from_hf_config(json.loads(_QWEN4_EXAMPLE.read_text()))
    built = models.from_hf_config(transformers.Qwen4ExpConfig(text_config=text).to_dict())
    assert [(x.name, x.spec) for x in from_file.layers] == [(x.name, x.spec) for x in built.layers]
    assert from_file.layer_kinds == {
        "gated_deltanet": 30,
        "ple_conv": 2,
        "full_attention": 10,
        "indexer": 10,
    }


def test_qwen4_exp_groups_and_tensors_are_vllms(qwen4_default):
    """bf16, TP 1, prefix caching (align mode), Hopper, 64 GiB.

    Block: K/V 2 heads x (256 + 256) x 2 = 2,048 B/token; the largest state is the GDN's: conv
    (3, 2 x 16 x 128 + 32 x 128 = 8,192) x 2 = 49,152 plus recurrent 32 x 128 x 128 x 2 =
    1,048,576, 1,097,728 B (the PLE's (3 x 3 rows, 4 x 2,048) x 2 = 147,456 is smaller). Unit:
    max(16, 16) = 16 (no backend declares a larger kernel block), lcm with the GDN's FlashInfer
    checkpoint alignment 64 (the PLE's 1 leaves it) = 64: 64 x cdiv(1,097,728, 64 x 2,048) =
    576 tokens.
    Pages: K/V A = 576 x 2,048 = 1,179,648 (states padded to it); compressed keys
    C = 576 / 4 x 128 x 2 = 36,864; ring R = 4 slots x 128 x 2 = 1,024.
    Buckets in registration order (layer 0 registers ple then linear_attn; an indexed layer
    raw_key_cache, compressed_key_cache, attn): PLE (2: tp_replicated, so not with the GDN), GDN
    (30), rings (10), compressed + K/V (20: 10 of C, 10 of A). Repeats: _approximate_gcd([2, 30,
    10, 10], lower bound 10): padding 8 at 10, 14 at 11, more above: 10, so the compressed + K/V
    bucket is one group and the GDN three (cdiv(30, 10)); anchor = 10 x (C + A) = 12,165,120
    holds 10 states, cdiv(30, 10) = 3 GDN groups, GDN layers [k::3]; one PLE group, one ring.
    Bytes per block: 12,165,120 (every block-stride alignment is 1). num_blocks = 64 GiB //
    12,165,120 = 5,648."""
    _, plan, config = qwen4_default
    block_bytes = 12_165_120
    assert block_bytes == 10 * (36_864 + 1_179_648)
    assert config["num_blocks"] == 2**36 // block_bytes == 5_648
    assert config["kv_cache_layout"] == "BLNHC"  # QSAStateBackend's first supported layout
    assert plan.block_size == 576 == 64 * -(-1_097_728 // (64 * 2_048))
    gdn = [_QWEN4.format(i) + ".linear_attn" for i in _QWEN4_GDN]
    ple = [_QWEN4.format(i) + ".ple" for i in (0, 1)]
    qsa = [
        (
            _QWEN4.format(i) + ".self_attn.indexer.compressed_key_cache",
            _QWEN4.format(i) + ".self_attn.attn",
        )
        for i in _QWEN4_ATTN
    ]
    rings = [_QWEN4.format(i) + ".self_attn.indexer.raw_key_cache" for i in _QWEN4_ATTN]
    expected_groups = [
        ple,
        gdn[0::3],
        gdn[1::3],
        gdn[2::3],
        rings,
        [name for pair in qsa for name in pair],
    ]
    groups = config["kv_cache_groups"]
    assert [g["layer_names"] for g in groups] == expected_groups
    assert [len(g) for g in expected_groups] == [2, 10, 10, 10, 10, 20]
    A, C, R = 1_179_648, 36_864, 1_024
    expected_tensors = [
        (ple, A, 0),
        (gdn[0::3], A, 0),
        (gdn[1::3], A, 0),
        (gdn[2::3], A, 0),
        (rings, R, 0),
        ([k for k, _ in qsa], C, 0),  # the compressed keys first: their spec appears first
        ([a for _, a in qsa], A, 10 * C),  # 368,640
    ]
    assert [
        (t["layers"], t["layer_stride"], t["offset"]) for t in config["kv_cache_tensors"]
    ] == expected_tensors
    size = 5_648 * block_bytes
    for t in config["kv_cache_tensors"]:
        assert (t["size"], t["block_stride"], t["host_resident"]) == (size, block_bytes, False)
    pages = [g["kv_cache_spec"]["page_size_bytes"] for g in groups]
    assert pages == [2 * A, 10 * A, 10 * A, 10 * A, 10 * R, 10 * (C + A)]
    assert plan.pools[0].block_bytes == block_bytes and plan.tensors[0].nbytes == size
    # the rings are not prefix-cacheable: the hash block is gcd(576, ...) = 576 and no Mamba
    # block exceeds it, so hits land on lcm(576, 4) = 576
    assert (config["hash_block_size"], config["cache_hit_alignment_tokens"]) == (576, 576)
    assert config["kv_tp_replicas"] == 1


def test_qwen4_exp_spec_fields(qwen4_default):
    """Every dataclass field of each kind of layer spec, as vLLM 0.33's layers fill it."""
    _, _, config = qwen4_default
    groups = config["kv_cache_groups"]
    for g in groups:
        spec = g["kv_cache_spec"]
        first = spec["kv_cache_specs"][g["layer_names"][0]]
        assert spec["kind"] == "UniformTypeKVCacheSpecs"
        assert list(spec["kv_cache_specs"]) == g["layer_names"]
        assert (spec["block_size"], spec["dcp_sharded"]) == (
            first["block_size"],
            first["dcp_sharded"],
        )
    base = {"block_size": 576, "block_stride_alignment": None, "is_draft": False}
    attention = {
        "dcp_sharded": True,  # AttentionSpec's default; none of these layers changes it
        "max_tp_shards": None,
        "kv_quant_mode": "NONE",
        "page_size_padded": None,
        "num_head_slots": None,
        "state_content_bytes": None,
    }
    state = {
        "kind": "MambaSpec",
        **base,
        "dcp_sharded": False,
        "page_size_padded": 1_179_648,  # padded to the K/V page
        "mamba_cache_mode": "align",
        "num_speculative_blocks": 0,
        # FlashInfer's GDN prefill declares 64, the PLE conv 1: both export one checkpoint
        # block on the prefix-cache grid (the block)
        "num_prefill_checkpoint_blocks": 1,
        "prefill_checkpoint_alignment": 576,
        "num_heads": 1,
        "tokens_per_state": -1,
        "page_size_bytes": 1_179_648,
    }
    specs = {n: s for g in groups for n, s in g["kv_cache_spec"]["kv_cache_specs"].items()}
    assert specs[_QWEN4.format(0) + ".ple"] == {
        **state,
        "shapes": [[9, 8_192]],  # (ple_conv_kernel_size - 1) x ngram_size rows, 4 x 2,048
        "dtypes": ["torch.bfloat16"],
        "mamba_type": "SHORT_CONV",
        "tp_replicated": True,  # Qwen4ExpPLELayer.is_kv_cache_tp_replicated
    }
    assert specs[_QWEN4.format(0) + ".linear_attn"] == {
        **state,
        "shapes": [[3, 8_192], [32, 128, 128]],
        "dtypes": ["torch.bfloat16", "torch.bfloat16"],  # mamba_ssm_dtype unset: the model's
        "mamba_type": "GDN_ATTN",
        "tp_replicated": False,
    }
    layer = _QWEN4.format(3) + ".self_attn"
    assert specs[layer + ".indexer.raw_key_cache"] == {
        "kind": "CircularBufferSpec",
        **base,
        **attention,
        "block_size": 4,  # round_up(4 + 0 speculative tokens, 4)
        "num_kv_heads": 1,
        "head_size": 128,  # no MRoPE section: the key alone
        "dtype": "torch.bfloat16",
        "head_size_v": 0,
        "tokens_per_state": 1,
        "page_size_bytes": 1_024,
    }
    assert specs[layer + ".indexer.compressed_key_cache"] == {
        "kind": "MLAAttentionSpec",
        **base,
        **attention,
        "num_kv_heads": 1,
        "head_size": 128,
        "dtype": "torch.bfloat16",  # indexer_kv_dtype auto: bf16
        "head_size_v": 0,
        "tokens_per_state": 4,
        "sliding_window": None,
        "attention_chunk_size": None,
        "non_causal": False,
        "cache_dtype_str": None,
        "topk_buffer_width": None,
        "alignment": None,
        "model_version": None,
        "cache_role": "SPARSE",  # the dataclass default: QSACompressedKeyCache sets no role
        "is_index_group_leader": False,
        "non_causal_multi_token_decode": False,
        "page_size_bytes": 36_864,
    }
    assert specs[layer + ".attn"] == {
        "kind": "FullAttentionSpec",
        **base,
        **attention,
        "num_kv_heads": 2,
        "head_size": 256,
        "dtype": "torch.bfloat16",
        "head_size_v": 256,
        "tokens_per_state": 1,
        "sliding_window": None,
        "attention_chunk_size": None,
        "non_causal": False,
        "page_size_bytes": 1_179_648,
    }


def test_qwen4_exp_keys_are_vllm_fields(qwen4_default):
    _, _, config = qwen4_default
    assert list(config) == VLLM_033_FIELDS["KVCacheConfig"]
    for group in config["kv_cache_groups"]:
        outer = group["kv_cache_spec"]
        for spec in (outer, *outer["kv_cache_specs"].values()):
            keys = list(spec)
            assert keys[0] == "kind" and keys[-1] == "page_size_bytes"
            assert keys[1:-1] == VLLM_033_FIELDS[spec["kind"]]
    assert json.loads(json.dumps(config)) == config


# (text_config, kv, tp, spec tokens, target) -> (block, ring slots, bytes per block, num_blocks),
# all at 64 GiB; the groups stay [2, 10, 10, 10, 10, 20] (10 repeats, as above)
_QWEN4_VARIANTS = [
    # fp8 K/V (1,024 B/token): block 64 x cdiv(1,097,728, 65,536) = 1,088; A = 1,114,112,
    # C = 272 x 256 = 69,632; 10 x (C + A) = 11,837,440; 2^36 // 11,837,440 = 5,805
    pytest.param(None, "fp8", 1, 0, {}, (1_088, 4, 11_837_440, 5_805), id="fp8"),
    # TP 2: one KV head a rank (1,024 B/token); GDN (3, 4,096) x 2 + 16 x 128 x 128 x 2 =
    # 548,864 B (the PLE's 147,456 stays whole); block 64 x 9 = 576; A = 589,824, C = 36,864;
    # 10 x (C + A) = 6,266,880; 2^36 // 6,266,880 = 10,965
    pytest.param(None, "auto", 2, 0, {}, (576, 4, 6_266_880, 10_965), id="tp2"),
    # indexer_compress_ratio 16: C = 36 x 256 = 9,216, a 16-slot ring (4,096 B);
    # 10 x (9,216 + 1,179,648) = 11,888,640; 2^36 // 11,888,640 = 5,780
    pytest.param(
        {"indexer_compress_ratio": 16}, "auto", 1, 0, {}, (576, 16, 11_888_640, 5_780), id="r16"
    ),
    # indexer_kv_dtype fp8: C = 144 x 128 x 1 = 18,432; 10 x (18,432 + 1,179,648) =
    # 11,980,800; 2^36 // 11,980,800 = 5,735
    pytest.param(
        None, "auto", 1, 0, {"indexer_kv_dtype": "fp8"}, (576, 4, 11_980_800, 5_735), id="ifp8"
    ),
    # 3 speculative tokens: ring round_up(4 + 3, 4) = 8 slots (2,048 B); GDN conv 6 rows:
    # 98,304 + 1,048,576 = 1,146,880 B, still 9 units: block 576, bytes as the default
    pytest.param(None, "auto", 1, 3, {}, (576, 8, 12_165_120, 5_648), id="spec3"),
]


@pytest.mark.parametrize(("text", "kv", "tp", "spec", "target", "expected"), _QWEN4_VARIANTS)
def test_qwen4_exp_variants(text, kv, tp, spec, target, expected):
    block, ring, block_bytes, num_blocks = expected
    _, plan, config = _qwen4(text, kv=kv, tp=tp, spec=spec, **target)
    assert config["num_blocks"] == num_blocks == 2**36 // block_bytes
    assert plan.block_size == block
    assert [len(g["layer_names"]) for g in config["kv_cache_groups"]] == [2, 10, 10, 10, 10, 20]
    specs = [g["kv_cache_spec"] for g in config["kv_cache_groups"]]
    assert [s["block_size"] for s in specs] == [block] * 4 + [ring, block]
    assert {t["block_stride"] for t in config["kv_cache_tensors"]} == {block_bytes}
    layer = _QWEN4.format(3) + ".self_attn"
    attn = specs[5]["kv_cache_specs"][layer + ".attn"]
    fp8 = kv == "fp8"
    assert attn["dtype"] == ("torch.uint8" if fp8 else "torch.bfloat16")
    assert attn["kv_quant_mode"] == ("FP8_PER_TENSOR" if fp8 else "NONE")
    compressed = specs[5]["kv_cache_specs"][layer + ".indexer.compressed_key_cache"]
    indexer_fp8 = target.get("indexer_kv_dtype") == "fp8"
    assert compressed["dtype"] == ("torch.float8_e4m3fn" if indexer_fp8 else "torch.bfloat16")
    state = specs[1]["kv_cache_specs"][_QWEN4.format(0) + ".linear_attn"]
    assert state["num_speculative_blocks"] == spec
    assert state["page_size_padded"] == attn["page_size_bytes"]


def test_qwen4_exp_without_prefix_caching():
    """none mode: no checkpoint alignment, so the unit is 16: 16 x cdiv(1,097,728, 16 x 2,048)
    = 544; the state groups' block is max_model_len (32,768), no state exports a checkpoint;
    C = 136 x 256 = 34,816, A = 1,114,112, 10 x (C + A) = 11,489,280 B a block, 2^36 // that =
    5,981; hash and hit block lcm(32,768, 544, 4) = 557,056."""
    _, plan, config = _qwen4(enable_prefix_caching=False, max_model_len=32_768)
    assert plan.block_size == 544 and config["num_blocks"] == 5_981 == 2**36 // 11_489_280
    specs = [g["kv_cache_spec"] for g in config["kv_cache_groups"]]
    assert [s["block_size"] for s in specs] == [32_768] * 4 + [4, 544]
    state = specs[0]["kv_cache_specs"][_QWEN4.format(0) + ".ple"]
    assert state["mamba_cache_mode"] == "none"
    assert (state["num_prefill_checkpoint_blocks"], state["prefill_checkpoint_alignment"]) == (
        0,
        None,
    )
    assert config["hash_block_size"] == config["cache_hit_alignment_tokens"] == 557_056
    assert math.lcm(32_768, 544, 4) == 557_056


def test_qwen4_exp_block_counts_the_configs_ple_state():
    """vLLM sizes the block by the larger of the GDN state and the PLE state of the config
    (Qwen4ExpForCausalLM.get_mamba_specs_from_config), PLE layers or none: with hc_count 8 and
    no PLE layer, at TP 8 (one KV head of 256: 1,024 B/token), the GDN state is (3, 1,024) x 2 +
    4 x 128 x 128 x 2 = 137,216 B (block 64 x 3 = 192 alone) but the PLE's (9, 8 x 2,048) x 2 =
    294,912 B makes it 64 x cdiv(294,912, 65,536) = 320."""
    text = {"ple_layer_ids": [], "hc_count": 8}
    model, plan, _ = _qwen4(text, tp=8)
    assert "ple_conv" not in model.layer_kinds
    assert plan.block_size == 320 == 64 * -(-294_912 // 65_536)
    plain = _qwen4({"ple_layer_ids": []}, tp=8)[1]
    assert plain.block_size == 192 == 64 * -(-147_456 // 65_536)  # PLE 147,456 > GDN 137,216


def test_qwen4_exp_logged_capacity(qwen4_default):
    """get_max_concurrency_for_kv_cache_config at max_model_len 32,768 (the config's
    max_position_embeddings): the compressed + K/V group cdiv(32,768, 576) = 57 blocks a request,
    each of the 4 state groups 2 + 0 + 1 (the prefill checkpoint block) = 3, the ring group 1:
    57 + 12 + 1 = 70 blocks; 5,648 / 70 x 32,768 tokens. vllm_disagreements finds nothing: the
    packing and the K/V order inside a page are vLLM's."""
    model, plan, _ = qwen4_default
    logged = logged_capacity(plan, model)
    assert (logged.attention_blocks_per_request, logged.state_blocks_per_request) == (57, 12)
    assert logged.ring_blocks_per_request == 1 and logged.blocks_per_request == 70
    assert logged.tokens == int(5_648 / 70 * 32_768)
    assert vllm_disagreements(plan, model) == []


def test_qwen4_exp_causal_lm_names():
    """A text-only checkpoint (Qwen4ExpForCausalLM) has no language_model. prefix."""
    model, _, config = _qwen4(wrapper=False)
    names = layer_names(model)
    assert names["layers.3.attn"] == "model.layers.3.self_attn.attn"
    assert names["layers.3.indexer"] == "model.layers.3.self_attn.indexer.compressed_key_cache"
    assert names["layers.0.mixer"] == "model.layers.0.linear_attn"
    assert names["layers.0.ple"] == "model.layers.0.ple"
    rings = config["kv_cache_groups"][4]["layer_names"]
    assert rings[0] == "model.layers.3.self_attn.indexer.raw_key_cache"


_QWEN4_RANK = {
    "ple": 0,
    "linear_attn": 1,
    "self_attn.indexer.raw_key_cache": 2,
    "self_attn.indexer.compressed_key_cache": 3,
    "self_attn.attn": 4,
}


def _qwen4_registered(name: str) -> tuple[int, int]:
    """vLLM's registration order of a Qwen4-Exp cache: by decoder layer; inside one the PLE
    module, then the mixer (a GDN, or the QSA indexer's raw and compressed key caches, then the
    attention)."""
    layer, _, rest = name.removeprefix("language_model.model.layers.").partition(".")
    return int(layer), _QWEN4_RANK[rest]


def test_qwen4_exp_vllm_planner_builds_the_same_config():
    """vLLM's own grouping and placement (get_kv_cache_groups with the BLNHC layout, then
    get_kv_cache_config_from_groups), run on the exported specs in vLLM's registration order,
    give the exported groups, tensors and num_blocks."""
    pytest.importorskip("vllm")

    from vllm.v1.core import kv_cache_planning as kp
    from vllm.v1.kv_cache_layout import KVCacheLayout

    cases = [(None, "auto", 1, 0, {}, None), *(v.values for v in _QWEN4_VARIANTS)]
    for text, kv, tp, spec, target, _ in cases:
        model, plan, _ = _qwen4(text, kv=kv, tp=tp, spec=spec, **target)
        config = vllm_objects(plan, model)
        specs = {
            n: s for g in config.kv_cache_groups for n, s in g.kv_cache_spec.kv_cache_specs.items()
        }
        ordered = dict(sorted(specs.items(), key=lambda item: _qwen4_registered(item[0])))
        layout = KVCacheLayout[config.kv_cache_layout]
        vllm_config = planner_config(layout)
        groups = kp.get_kv_cache_groups(vllm_config, ordered)
        assert [g.layer_names for g in groups] == [g.layer_names for g in config.kv_cache_groups]
        assert [g.kv_cache_spec for g in groups] == [
            g.kv_cache_spec for g in config.kv_cache_groups
        ]
        theirs = kp.get_kv_cache_config_from_groups(vllm_config, groups, plan.config.memory_bytes)
        assert theirs.num_blocks == config.num_blocks

        def rows(c):
            return [(t.size, t.layers, t.layer_stride, t.block_stride, t.offset) for t in c]

        assert rows(theirs.kv_cache_tensors) == rows(config.kv_cache_tensors)


def test_qwen4_exp_mrope_widens_the_ring():
    """Under MRoPE (an mrope_section in rope_parameters) QSAKeyStateCache keeps the three int64
    positions after the key: round_up(128, 4) + 3 x 4 = 140 bf16 a slot, 4 x 140 x 2 = 1,120 B a
    ring; the causal-LM class strips the section (Qwen4ExpForCausalLMConfig), so its ring stays
    128 wide. The other pages do not change."""
    rope = {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    }
    ring = _QWEN4.format(3) + ".self_attn.indexer.raw_key_cache"
    _, _, config = _qwen4({"rope_parameters": rope})
    spec = config["kv_cache_groups"][4]["kv_cache_spec"]["kv_cache_specs"][ring]
    assert (spec["head_size"], spec["page_size_bytes"]) == (140, 1_120)
    assert config["num_blocks"] == 5_648
    _, _, text_only = _qwen4({"rope_parameters": rope}, wrapper=False)
    name = "model.layers.3.self_attn.indexer.raw_key_cache"
    spec = text_only["kv_cache_groups"][4]["kv_cache_spec"]["kv_cache_specs"][name]
    assert (spec["head_size"], spec["page_size_bytes"]) == (128, 1_024)
