"""The Hugging Face config reader against real config.json files, vLLM's SSM-dtype rules,
transformers' default configs of every family, pure-attention / pure-state models, and malformed
fields (always a ``ValueError`` naming the field)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from test_models import (
    BAMBA,
    FALCON_H1_7B,
    GRANITE_SMALL,
    JAMBA,
    KIMI,
    KIMI_TF5,
    LFM2_12B,
    MINIMAX,
    NEMOTRON_3_NANO_TF5,
    NEMOTRON_H_8B,
    QWEN3_NEXT,
    QWEN35_4B,
    RG,
    ZAMBA2_27B,
)

from hybridkv import models
from hybridkv.layouts import make_plan
from hybridkv.models.hf_config import ARCHITECTURES, FAMILIES, parse_hf_config

DATA = Path(__file__).parent / "data" / "hf_configs"
REAL_CONFIGS = sorted(p.stem for p in DATA.glob("*.json"))


def _without(config: dict, *keys: str) -> dict:
    return {k: v for k, v in config.items() if k not in keys}


def _layers(model):
    return [(layer.name, layer.spec) for layer in model.layers]


# ---- real config.json files (tests/data/hf_configs, sources in its README) ---------------------


def test_every_stored_config_is_a_zoo_model_with_a_source():
    readme = (DATA / "README.md").read_text()
    assert len(REAL_CONFIGS) >= 11
    for name in REAL_CONFIGS:
        assert name in models.list_models(), name
        assert f"`{name}.json`" in readme, f"{name}.json has no source line in the README"


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_real_config_gives_the_zoo_model(name):
    """The zoo entry and the model's own config.json give the same model: the same cache layers
    with the same specs, the same model and declared SSM dtypes, and the same runtime result."""
    parsed = models.from_hf_config(DATA / f"{name}.json", name=name)
    zoo = models.load(name)
    assert _layers(parsed) == _layers(zoo)
    assert parsed.num_hidden_layers == zoo.num_hidden_layers
    assert (parsed.dtype, parsed.ssm_dtype_declared) == (zoo.dtype, zoo.ssm_dtype_declared)
    assert parsed.max_position_embeddings == zoo.max_position_embeddings
    for options in ({"tp_size": 2}, {"kv_dtype": "fp8", "conv_dtype": "float16"}):
        got = models.from_hf_config(DATA / f"{name}.json", **options)
        want = models.load(name, **options)
        assert _layers(got) == _layers(want)


def test_nemotron_h_plans_its_ssm_state_in_float32():
    """Nemotron-H-56B's config declares no mamba_ssm_cache_dtype; vLLM's NemotronH hook makes
    the SSM state float32 (so Nemotron-H-8B's vLLM block is 1040 tokens, not 528)."""
    raw = json.loads((DATA / "nemotron-h-56b.json").read_text())
    assert "mamba_ssm_cache_dtype" not in raw
    for name in ("nemotron-h-8b", "nemotron-h-56b", "nemotron-nano-9b-v2"):
        state = models.load(name).state_layers[0].spec
        assert (state.conv_dtype, state.ssm_dtype) == ("bfloat16", "float32"), name
    # an explicit --mamba-ssm-cache-dtype still wins
    assert models.load("nemotron-h-8b", ssm_dtype="bf16").ssm_dtype == "bfloat16"
    # 8B: conv 3 * 10240 * 2 + SSM 128 * 64 * 128 * 4 = 4,255,744 B per Mamba layer
    assert models.load("nemotron-h-8b").state_layers[0].spec.state_bytes == 4_255_744


def test_nvfp4_configs_quantize_the_weights_not_the_zoo_cache():
    """The Qwen3.6 files are NVIDIA's NVFP4 checkpoints' configs. Their quantization_config is not
    read (the zoo models the BF16 releases' cache), though the 27B's declares an FP8 KV cache,
    which vLLM's ``--kv-cache-dtype auto`` takes for that checkpoint: its block is then 1,568
    tokens, not the 784 of the BF16 release (16 x cdiv(state page, 16 x one token's KV page));
    aiconfigurator's Nemotron-3.5-Lightning copy has its quantization_config dropped."""
    raw = json.loads((DATA / "qwen3.6-27b.json").read_text())
    fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    assert raw["quantization_config"]["kv_cache_scheme"] == fp8
    bare = {k: v for k, v in raw.items() if k != "quantization_config"}
    assert _layers(models.from_hf_config(bare)) == _layers(models.from_hf_config(raw))
    for kv, block in (("auto", 784), ("fp8", 1568)):
        model = models.load("qwen3.6-27b", kv_dtype=kv)
        state = model.state_layers[0].spec.state_bytes
        token = model.attention_layers[0].spec.page_bytes(1)
        assert 16 * -(-state // (16 * token)) == block, kv
    lightning = json.loads((DATA / "nemotron-3.5-lightning-30b-a3b.json").read_text())
    assert "quantization_config" not in lightning


def test_nemotron_3_ultra_counts_its_layers_from_its_block_list():
    """Nemotron-3-Ultra-550B-A55B's config (aiconfigurator's BF16, FP8 and NVFP4 copies are one
    file) has no num_hidden_layers: its 108 layers are its layers_block_type's length, as
    transformers' NemotronHConfig derives them (48 Mamba-2, 12 attention, 48 MoE), and its
    float32 SSM state makes vLLM 0.33's blocks 16 x cdiv(state page, 16 x one token's KV page):
    8,304 tokens at TP1 with bf16 KV, halved by every TP doubling once the 2 KV heads are
    split, doubled by fp8 KV."""
    raw = json.loads((DATA / "nemotron-3-ultra-550b-a55b.json").read_text())
    assert "num_hidden_layers" not in raw and "quantization_config" not in raw
    parsed = models.from_hf_config(raw)
    assert parsed.num_hidden_layers == len(raw["layers_block_type"]) == 108
    assert parsed.layer_kinds == {"mamba2": 48, "full_attention": 12}
    from hybridkv.layouts import make_plan

    blocks = {
        (1, "auto"): 8304, (2, "auto"): 8304, (4, "auto"): 4160, (8, "auto"): 2080,
        (1, "fp8"): 16608, (2, "fp8"): 16608, (4, "fp8"): 8304, (8, "fp8"): 4160,
    }  # fmt: skip
    for (tp, kv), block in blocks.items():
        model = models.load("nemotron-3-ultra-550b-a55b", tp_size=tp, kv_dtype=kv)
        plan = make_plan(model, "inflate", memory="120GiB", max_num_seqs=16)
        assert plan.block_size == block, (tp, kv)


# ---- the SSM dtype each family declares (vLLM 0.33 vllm/model_executor/models/config.py) -------


def _declared(config: dict) -> str | None:
    return parse_hf_config(config).ssm_dtype_declared


NEMO_NO_ARCH = {k: v for k, v in NEMOTRON_H_8B.items() if k != "mamba_ssm_cache_dtype"}
QWEN_TEXT = {k: v for k, v in QWEN35_4B["text_config"].items() if k != "mamba_ssm_dtype"}


@pytest.mark.parametrize(
    "config, declared",
    [
        pytest.param(NEMO_NO_ARCH, "float32", id="nemotron-h-absent-is-float32"),
        pytest.param(
            {**NEMO_NO_ARCH, "mamba_ssm_cache_dtype": "bfloat16"}, "bfloat16", id="nemotron-h-bf16"
        ),
        pytest.param(
            {**NEMO_NO_ARCH, "mamba_ssm_cache_dtype": "auto"}, None, id="nemotron-h-auto-is-conv"
        ),
        pytest.param(
            {**NEMO_NO_ARCH, "architectures": ["NemotronHForCausalLM"]},
            "float32",
            id="nemotron-h-arch",
        ),
        pytest.param(
            {**NEMO_NO_ARCH, "architectures": ["NemotronHPuzzleForCausalLM"]},
            "float32",
            id="nemotron-h-puzzle-arch",
        ),
        pytest.param(
            {
                "architectures": ["NemotronH_Nano_VL_V2"],
                "text_config": {**NEMO_NO_ARCH, "mamba_ssm_cache_dtype": "float16"},
            },
            "float16",
            id="nemotron-nano-vl-reads-text_config",
        ),
        pytest.param(
            {"architectures": ["NemotronH_Nano_VL_V2"], "text_config": NEMO_NO_ARCH},
            "float32",
            id="nemotron-nano-vl-absent-is-float32",
        ),
        pytest.param(
            {
                "architectures": ["NemotronH_Nano_VL_V2"],
                "model_type": "NemotronH_Nano_VL_V2",
                "text_config": _without(NEMO_NO_ARCH, "model_type"),
            },
            "float32",
            id="nemotron-nano-vl-dispatch-by-architecture",
        ),
        pytest.param(
            # vLLM 0.33 has no config hook for the Omni architecture: auto stays auto
            {"architectures": ["NemotronH_Nano_Omni_Reasoning_V3"], "text_config": NEMO_NO_ARCH},
            None,
            id="nemotron-omni-no-hook",
        ),
        pytest.param(QWEN35_4B, "float32", id="qwen3.5-mamba_ssm_dtype"),
        pytest.param(
            {**QWEN35_4B, "text_config": QWEN_TEXT}, None, id="qwen3.5-absent-is-conv-dtype"
        ),
        pytest.param(
            {**QWEN_TEXT, "architectures": ["Qwen3_5ForCausalLM"], "mamba_ssm_dtype": "bfloat16"},
            "bfloat16",
            id="qwen3.5-causal-lm-arch",
        ),
        pytest.param(
            {**QWEN_TEXT, "model_type": "qwen3_5_moe_text", "mamba_ssm_dtype": "float32"},
            "float32",
            id="qwen3.5-moe-text-family",
        ),
        pytest.param(
            {**QWEN3_NEXT, "mamba_ssm_dtype": "float32"}, None, id="qwen3-next-ignores-it"
        ),
        pytest.param({**BAMBA, "mamba_ssm_dtype": "float32"}, None, id="bamba-ignores-it"),
        pytest.param(
            {**GRANITE_SMALL, "mamba_ssm_cache_dtype": "float32"}, None, id="granite-ignores-it"
        ),
        pytest.param(
            {**FALCON_H1_7B, "mamba_ssm_dtype": "float32"}, None, id="falcon-h1-ignores-it"
        ),
        pytest.param({**JAMBA, "mamba_ssm_dtype": "float32"}, None, id="jamba-ignores-it"),
        pytest.param(
            # the Nemotron key on a Qwen3.5 config is not Qwen3.5's key
            {**QWEN35_4B, "text_config": {**QWEN_TEXT, "mamba_ssm_cache_dtype": "float32"}},
            None,
            id="qwen3.5-ignores-the-nemotron-key",
        ),
    ],
)
def test_ssm_dtype_declared_like_vllm(config, declared):
    original = copy.deepcopy(config)
    assert _declared(config) == declared
    assert config == original, "parsing must not modify the config"


def test_declared_dtype_reaches_the_ssm_state_only():
    model = models.from_hf_config({**NEMO_NO_ARCH, "torch_dtype": "float16"})
    spec = model.state_layers[0].spec
    assert (model.kv_dtype, spec.conv_dtype, spec.ssm_dtype) == ("float16", "float16", "float32")
    bamba = models.from_hf_config({**BAMBA, "mamba_ssm_dtype": "float32"})
    assert bamba.state_layers[0].spec.ssm_dtype == "bfloat16"  # the conv dtype


# ---- transformers' default config of every family ----------------------------------------------

# model type -> layer kinds transformers' default config gives
DEFAULT_KINDS = {
    "qwen3_next": {"full_attention", "gated_deltanet"},
    "qwen3_5": {"full_attention", "gated_deltanet"},
    "qwen3_5_text": {"full_attention", "gated_deltanet"},
    "qwen3_5_moe": {"full_attention", "gated_deltanet"},
    "qwen3_5_moe_text": {"full_attention", "gated_deltanet"},
    "nemotron_h": {"full_attention", "mamba2"},
    "granitemoehybrid": {"mamba2"},  # no attention layer: all Mamba-2
    "bamba": {"mamba2"},
    "falcon_h1": {"full_attention", "mamba2"},
    "jamba": {"full_attention", "mamba1"},
    "zamba": {"full_attention", "mamba1"},
    "zamba2": {"full_attention", "mamba2"},
    "lfm2": {"full_attention"},  # Lfm2Config(): full_attn_idxs defaults to every layer
    "lfm2_moe": {"full_attention"},  # no layer_types: read as Lfm2Config does
    "lfm3": {"full_attention", "sliding_window", "short_conv"},
    "minimax": {"full_attention", "linear_attention"},
    "kimi_linear": {"mla", "kda"},
    "bailing_hybrid": {"mla", "kda"},
    "olmo_hybrid": {"full_attention", "gated_deltanet"},
    "recurrent_gemma": {"sliding_window", "rglru"},
    "mamba": {"mamba1"},
    "falcon_mamba": {"mamba1"},
    "mamba2": {"mamba2"},
    "granite_swa": {"full_attention", "sliding_window"},
    "granitemoe_swa": {"full_attention", "sliding_window"},
    "rwkv": {"rwkv4"},
    "xlstm": {"mlstm"},
    # GLM-5-Next: KDA, and NoPE MLA with its DSA indexer on every 4th layer
    "glm5_next": {"mla", "indexer", "kda"},
    "glm5_next_text": {"mla", "indexer", "kda"},
    # Qwen4ExpTextConfig() sets no indexer_* fields and no PLE layers
    "qwen4_exp": {"full_attention", "gated_deltanet"},
    "qwen4_exp_text": {"full_attention", "gated_deltanet"},
    # Inkling: attention in every layer (one full in six, the rest sliding), four short convs
    "inkling_mm_model": {"full_attention", "sliding_window", "inkling_sconv"},
    "inkling_text": {"full_attention", "sliding_window", "inkling_sconv"},
    # ZAYA: full attention and a CCA state in every layer (no hybrid_sliding by default)
    "zaya": {"full_attention", "cca"},
}
# families transformers does not ship (remote-code formats), read from their own configs
NOT_IN_TRANSFORMERS = {"minimax_text_01", "minimax_m1"}


def test_every_family_is_covered_here():
    assert set(FAMILIES) == set(DEFAULT_KINDS) | NOT_IN_TRANSFORMERS
    assert set(ARCHITECTURES.values()) <= set(FAMILIES)


@pytest.mark.parametrize("model_type", sorted(DEFAULT_KINDS))
def test_transformers_default_config_parses(model_type):
    auto_config = pytest.importorskip("transformers").AutoConfig
    saved = auto_config.for_model(model_type).to_dict()
    model = models.from_hf_config(saved)
    assert set(model.layer_kinds) == DEFAULT_KINDS[model_type]
    assert model.num_hidden_layers >= len({layer.index for layer in model.layers})
    for options in ({"kv_dtype": "fp8"}, {"ssm_dtype": "fp32", "num_spec_tokens": 1}):
        assert models.from_hf_config(saved, **options).layers


@pytest.mark.parametrize("wrapper", ["lfm2_vl", "lfm3_vl", "nemotron_h_omni"])
def test_transformers_multimodal_wrappers_read_their_text_config(wrapper):
    auto_config = pytest.importorskip("transformers").AutoConfig
    saved = auto_config.for_model(wrapper).to_dict()
    text = saved["text_config"]
    assert models.from_hf_config(saved).layers == models.from_hf_config(text).layers


def test_default_bamba_and_granite_are_pure_mamba2():
    transformers = pytest.importorskip("transformers")
    for cls in (transformers.BambaConfig, transformers.GraniteMoeHybridConfig):
        model = models.from_hf_config(cls().to_dict())
        assert not model.attention_layers and not model.is_hybrid
        assert [layer.index for layer in model.state_layers] == list(range(32))
        assert model.kv_bytes_per_token == 0


# ---- pure-attention and pure-state configs: fields of an absent kind are not needed ------------


MAMBA2_KEYS = ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel")
ATTENTION_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim")
GDN_KEYS = tuple(k for k in QWEN3_NEXT if k.startswith("linear_"))


@pytest.mark.parametrize(
    "config, kinds, n_layers",
    [
        pytest.param(
            {**_without(NEMOTRON_H_8B, *MAMBA2_KEYS), "hybrid_override_pattern": "*-" * 26},
            {"full_attention": 26},
            52,
            id="nemotron-h-all-attention-no-mamba-fields",
        ),
        pytest.param(
            {**_without(NEMOTRON_H_8B, *ATTENTION_KEYS), "hybrid_override_pattern": "M" * 52},
            {"mamba2": 52},
            52,
            id="nemotron-h-all-mamba-no-attention-fields",
        ),
        pytest.param(
            {**JAMBA, "attn_layer_period": 1, "attn_layer_offset": 0},
            {"full_attention": 32},
            32,
            id="jamba-all-attention",
        ),
        pytest.param(
            {**_without(JAMBA, *ATTENTION_KEYS), "attn_layer_offset": 8},
            {"mamba1": 32},
            32,
            id="jamba-no-attention",
        ),
        pytest.param(
            {**_without(QWEN3_NEXT, *GDN_KEYS), "layer_types": ["full_attention"] * 48},
            {"full_attention": 48},
            48,
            id="qwen3-next-all-attention-no-linear-fields",
        ),
        pytest.param(
            {**_without(GRANITE_SMALL, *ATTENTION_KEYS), "layer_types": ["mamba"] * 40},
            {"mamba2": 40},
            40,
            id="granite-all-mamba",
        ),
        pytest.param(
            {**_without(BAMBA, "attn_layer_indices", *ATTENTION_KEYS)},
            {"mamba2": 32},
            32,
            id="bamba-no-attn_layer_indices",
        ),
        pytest.param(
            {**_without(LFM2_12B, *ATTENTION_KEYS), "full_attn_idxs": [], "conv_dim": 2048},
            {"short_conv": 16},
            16,
            id="lfm2-all-conv",
        ),
        pytest.param(
            {**KIMI_TF5, "layer_types": ["full_attention"] * 27},
            {"mla": 27},
            27,
            id="kimi-all-mla",
        ),
        pytest.param(
            {**MINIMAX, "attn_type_list": [0] * 80},
            {"linear_attention": 80},
            80,
            id="minimax-all-lightning",
        ),
        pytest.param(
            {**RG, "block_types": ["recurrent"]}, {"rglru": 26}, 26, id="recurrentgemma-no-attn"
        ),
    ],
)
def test_pure_models_parse(config, kinds, n_layers):
    model = models.from_hf_config(config)
    assert model.layer_kinds == kinds
    assert model.num_hidden_layers == n_layers
    assert not model.is_hybrid


def test_pure_models_plan():
    """A model with one kind of cache plans under every layout (vLLM plans it as one group)."""
    from hybridkv.layouts import LAYOUTS, make_plan

    transformers = pytest.importorskip("transformers")
    pure = [
        models.from_hf_config(transformers.BambaConfig().to_dict()),
        models.from_hf_config({**JAMBA, "attn_layer_period": 1, "attn_layer_offset": 0}),
        models.from_hf_config(transformers.MambaConfig().to_dict()),
    ]
    for model in pure:
        for layout in LAYOUTS:
            plan = make_plan(model, layout, memory="40GiB", max_num_seqs=16)
            assert plan is not None, (model.name, layout)


def test_config_with_no_cache_layer_is_refused():
    with pytest.raises(ValueError, match="no layer holds a KV cache or a recurrent state"):
        models.from_hf_config({**NEMOTRON_H_8B, "hybrid_override_pattern": "-E" * 26})


# ---- LFM2: vLLM's short-conv width -------------------------------------------------------------


def test_lfm2_conv_width_follows_vllm():
    # lfm2.py: MambaStateShapeCalculator.short_conv_state_shape(intermediate_size=conv_dim)
    dense = models.from_hf_config({**LFM2_12B, "conv_dim": 1024})
    assert {layer.spec.conv_dim for layer in dense.state_layers} == {1024}
    assert not dense.doubts.count("conv_dim")
    # no conv_dim (transformers' Lfm2Config has none): hidden_size, and the model says so
    bare = models.from_hf_config(LFM2_12B)
    assert {layer.spec.conv_dim for layer in bare.state_layers} == {2048}
    assert "no conv_dim" in bare.doubts
    # lfm2_moe.py sizes the state on hidden_size, whatever conv_dim says
    moe = models.from_hf_config({**LFM2_12B, "model_type": "lfm2_moe", "conv_dim": 1024})
    assert {layer.spec.conv_dim for layer in moe.state_layers} == {2048}
    # both: attention head_dim = hidden_size // heads, a head_dim field is not read
    odd = models.from_hf_config({**LFM2_12B, "conv_dim": 2048, "head_dim": 128})
    assert {layer.spec.head_dim for layer in odd.attention_layers} == {64}


# ---- new families ------------------------------------------------------------------------------


def test_zamba_v1_layer_list_equals_the_period_rule():
    raw = json.loads((DATA / "zamba-7b-v1.json").read_text())
    listed = {
        **raw,
        "layers_block_type": [
            "hybrid" if i == 2 or (i >= 3 and (i - 3) % 6 == 4) else "mamba" for i in range(76)
        ],
    }
    assert _layers(models.from_hf_config(listed)) == _layers(models.from_hf_config(raw))
    model = models.load("zamba-7b-v1")
    assert model.layer("layers.2.attn").spec.head_dim == 2 * 3712 // 16
    assert model.layer("layers.0.mixer").spec.d_inner == 2 * 3712
    bad = {**raw, "n_mamba_heads": 3}
    with pytest.raises(ValueError, match="n_mamba_heads=3 does not divide"):
        models.from_hf_config(bad)


def test_olmo_hybrid_defaults_and_vllm_head_size():
    config = {
        "model_type": "olmo_hybrid",
        "num_hidden_layers": 8,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "torch_dtype": "bfloat16",
    }
    model = models.from_hf_config(config)
    assert [layer.index for layer in model.attention_layers] == [3, 7]
    gdn = model.state_layers[0].spec
    # transformers' OlmoHybridConfig: key dim 0.75 * hidden / heads, value dim 2x, heads = heads
    assert (gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim) == (8, 8, 48, 96)
    assert model.attention_layers[0].spec.head_dim == 64  # vLLM: hidden_size // heads
    # too few layers for one every 4th: the last becomes attention, as in transformers
    tiny = models.from_hf_config({**config, "num_hidden_layers": 2})
    assert [layer.index for layer in tiny.attention_layers] == [1]


@pytest.mark.parametrize(
    "cls, arch",
    [
        ("GraniteSWAConfig", "GraniteSWAForCausalLM"),
        ("GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM"),
    ],
)
def test_granite_swa_reads_every_size_field(cls, arch):
    """A config saved by transformers' class: layer_types (full and sliding), window, heads,
    KV heads, head_dim when given (LlamaAttention takes it) else hidden // heads; the
    architecture alone names the family; transformers' every-4th rule without layer_types."""
    transformers = pytest.importorskip("transformers")
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    saved = getattr(transformers, cls)(
        hidden_size=1024,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        sliding_window=256,
        layer_types=types,
        dtype="bfloat16",
    ).to_dict()
    model = models.from_hf_config(saved)
    assert model.family == saved["model_type"] and model.dtype == "bfloat16"
    assert [layer.index for layer in model.layers] == [0, 1, 2, 3]
    full = [layer.spec for layer in model.layers if layer.spec.kind == "full_attention"]
    window = [layer.spec for layer in model.layers if layer.spec.kind == "sliding_window"]
    assert [layer.index for layer in model.layers if layer.spec.kind == "sliding_window"] == [1, 2]
    for spec in full + window:
        assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (16, 4, 64)
    assert {spec.sliding_window for spec in window} == {256}
    assert not model.doubts  # every field given
    # a head_dim in the config is what transformers' attention uses
    assert models.from_hf_config({**saved, "head_dim": 128}).layers[0].spec.head_dim == 128
    by_arch = _without(saved, "model_type") | {"architectures": [arch]}
    assert _layers(models.from_hf_config(by_arch)) == _layers(model)
    # no layer_types: transformers' rule, layer i full iff i % 4 == 0
    ruled = models.from_hf_config({**_without(saved, "layer_types"), "num_hidden_layers": 8})
    assert [layer.index for layer in ruled.layers if layer.spec.kind == "full_attention"] == [0, 4]
    # a missing window or KV head count takes the class default, said among the doubts
    bare = models.from_hf_config(_without(saved, "sliding_window", "num_key_value_heads"))
    assert {layer.spec.sliding_window for layer in bare.layers[1:3]} == {128}
    assert "sliding_window missing: 128" in bare.doubts
    assert "num_key_value_heads missing" in bare.doubts
    with pytest.raises(ValueError, match=r"layer_types\[1\] is 'mamba'"):
        models.from_hf_config({**saved, "layer_types": ["full_attention", "mamba", *types[2:]]})


def test_rwkv_reads_every_size_field():
    """RWKV-4 from transformers' RwkvConfig: every layer a state of hidden_size shifts and
    attention_hidden_size WKV channels (default hidden_size); no attention, no position limit
    (context_length is the training length); the architecture alone names the family."""
    transformers = pytest.importorskip("transformers")
    saved = transformers.RwkvConfig(
        hidden_size=1024, attention_hidden_size=1024, num_hidden_layers=24, dtype="float16"
    ).to_dict()
    model = models.from_hf_config(saved)
    assert model.family == "rwkv" and model.dtype == "float16"
    assert model.layer_kinds == {"rwkv4": 24} and not model.attention_layers
    spec = model.state_layers[0].spec
    assert (spec.hidden_size, spec.attention_hidden_size) == (1024, 1024)
    assert (spec.conv_dtype, spec.ssm_dtype) == ("float16", "float32")
    assert model.max_position_embeddings is None and not model.doubts
    by_arch = _without(saved, "model_type") | {"architectures": ["RwkvForCausalLM"]}
    assert _layers(models.from_hf_config(by_arch)) == _layers(model)
    bare = models.from_hf_config(_without(saved, "attention_hidden_size"))
    assert _layers(bare) == _layers(model)
    wide = models.from_hf_config({**saved, "attention_hidden_size": 2048})
    assert wide.state_layers[0].spec.attention_hidden_size == 2048
    assert "transformers sizes its RWKV state by hidden_size" in wide.doubts
    # a hand-written config without a layer count takes RwkvConfig's, said among the doubts
    short = models.from_hf_config({"model_type": "rwkv", "hidden_size": 1024})
    assert short.layer_kinds == {"rwkv4": 32}
    assert "num_hidden_layers missing: 32, the default of transformers' RwkvConfig" in short.doubts


def test_xlstm_reads_every_size_field():
    """xLSTM from transformers' xLSTMConfig: num_blocks mLSTM blocks of num_heads heads, head
    dims as its cache sizes them (hidden * factor rounded up to 64, over the heads); the
    architecture alone names the family; the two layer-count and width spellings."""
    transformers = pytest.importorskip("transformers")
    saved = transformers.xLSTMConfig(
        hidden_size=2048,
        num_hidden_layers=24,
        num_heads=4,
        qk_dim_factor=0.5,
        v_dim_factor=1.0,
        dtype="float32",
    ).to_dict()
    model = models.from_hf_config(saved)
    assert model.family == "xlstm" and model.layer_kinds == {"mlstm": 24}
    spec = model.state_layers[0].spec
    cfg = transformers.xLSTMConfig(**_without(saved, "model_type", "architectures"))
    assert (
        (spec.num_heads, spec.qk_head_dim, spec.v_head_dim)
        == (
            cfg.num_heads,
            cfg.qk_head_dim,
            cfg.v_head_dim,
        )
        == (4, 256, 512)
    )
    assert spec.ssm_dtype == "float32" and not model.doubts
    by_arch = _without(saved, "model_type") | {"architectures": ["xLSTMForCausalLM"]}
    assert _layers(models.from_hf_config(by_arch)) == _layers(model)
    # the released spelling: num_blocks and embedding_dim only
    released = _without(saved, "num_hidden_layers", "hidden_size") | {
        "num_blocks": 24,
        "embedding_dim": 2048,
    }
    assert _layers(models.from_hf_config(released)) == _layers(model)
    # a bf16 model: transformers' cache keeps the states in bf16, computed in float32
    bf16 = models.from_hf_config({**saved, "dtype": "bfloat16"})
    assert bf16.state_layers[0].spec.ssm_dtype == "bfloat16"
    assert "inference_state_dtype (float32)" in bf16.doubts
    odd = models.from_hf_config({**saved, "qk_dim_factor": 0.3})
    assert odd.state_layers[0].spec.qk_head_dim == 640 // 4  # 614.4 rounded up to 640
    assert "not a multiple of 64" in odd.doubts
    with pytest.raises(ValueError, match="num_heads=3 does not divide qk_dim=1024"):
        models.from_hf_config({**saved, "num_heads": 3})
    with pytest.raises(ValueError, match="'v_dim_factor' must be a positive number"):
        models.from_hf_config({**saved, "v_dim_factor": "one"})


_GLM5_TEXT = dict(
    hidden_size=2048,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=256,
    q_lora_rank=512,
    index_head_dim=64,
    index_n_heads=8,
    index_topk=512,
    index_kpool=8,
    linear_num_heads=16,
    linear_head_dim=64,
    linear_conv_kernel_dim=4,
    dtype="bfloat16",
)


def test_glm5_next_reads_every_size_field():
    """GLM-5-Next saved by transformers (the multimodal wrapper, text under text_config):
    layer i indexed iff i % 4 == 3 (NoPE MLA of kv_lora_rank, a DSA indexer row of key + k-pool
    gate + flag), KDA elsewhere; a flat text-only config (GLM-5.3-Flash's form) and the
    architecture alone read the same; ``shared`` indexer layers keep no indexer cache."""
    transformers = pytest.importorskip("transformers")
    saved = transformers.Glm5NextConfig(text_config=_GLM5_TEXT).to_dict()
    model = models.from_hf_config(saved)
    assert model.family == "glm5_next_text" and model.dtype == "bfloat16"
    assert model.layer_kinds == {"kda": 6, "mla": 2, "indexer": 2}
    by_kind = {
        k: [layer for layer in model.layers if layer.spec.kind == k]
        for k in ("mla", "indexer", "kda")
    }
    assert [layer.index for layer in by_kind["mla"]] == [3, 7]
    assert [layer.name for layer in by_kind["indexer"]] == ["layers.3.indexer", "layers.7.indexer"]
    mla, indexer, kda = (by_kind[k][0].spec for k in ("mla", "indexer", "kda"))
    assert (mla.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim) == (16, 256, 0)
    assert (indexer.index_head_dim, indexer.side_channels) == (64, 65)
    assert indexer.kernel_alignment == 64  # a DSA indexer's pages: DeepGEMM's 64 tokens
    # the cost model's: a query attends index_topk tokens plus the open k-pool's tail, the
    # indexer scores one key per k-pool with index_n_heads heads
    assert (mla.sparse_topk, indexer.index_n_heads, indexer.pool_tokens) == (512 + 7, 8, 8)
    no_tail = {**saved, "text_config": {**saved["text_config"]}}
    no_tail["text_config"]["index_kpool_always_select_tail"] = False
    assert {
        layer.spec.sparse_topk
        for layer in models.from_hf_config(no_tail).layers
        if layer.spec.kind == "mla"
    } == {512}
    assert (kda.num_heads, kda.head_dim, kda.conv_kernel, kda.ssm_dtype) == (16, 64, 4, "float32")
    assert "indexer cache read in transformers' layout" in model.doubts
    assert "missing" not in model.doubts  # every size given
    flat = {"model_type": "glm5_next", **saved["text_config"]}
    assert _layers(models.from_hf_config(flat)) == _layers(model)
    by_arch = _without(saved, "model_type") | {
        "architectures": ["Glm5NextForConditionalGeneration"]
    }
    by_arch["text_config"] = _without(saved["text_config"], "model_type")
    assert _layers(models.from_hf_config(by_arch)) == _layers(model)
    # transformers' indexer_types rule: index_topk_freq 8, offset 0 -> only layer 7 runs one
    cfg = transformers.Glm5NextTextConfig(
        **_GLM5_TEXT, index_topk_freq=8, index_skip_topk_offset=0
    )
    ruled = {"model_type": "glm5_next", **_without(_GLM5_TEXT, "dtype")}
    ruled |= {"index_topk_freq": 8, "index_skip_topk_offset": 0}
    indexed = [i for i, t in enumerate(cfg.layer_types) if t == "indexed_attention"]
    full = [i for i in indexed if cfg.indexer_types[i] == "full"]
    read = models.from_hf_config(ruled)
    assert [layer.index for layer in read.layers if layer.spec.kind == "indexer"] == full == [7]
    pattern = models.from_hf_config({**ruled, "index_topk_pattern": "FFFSFFFF"})
    assert [layer.index for layer in pattern.layers if layer.spec.kind == "indexer"] == [7]
    # absent sizes take Glm5NextTextConfig's defaults, said among the doubts
    bare = models.from_hf_config(_without(flat, "kv_lora_rank", "index_head_dim"))
    assert {layer.spec.kv_lora_rank for layer in bare.layers if layer.spec.kind == "mla"} == {512}
    assert (
        "kv_lora_rank missing: 512, the default of transformers' Glm5NextTextConfig" in bare.doubts
    )
    assert "index_head_dim missing: 128" in bare.doubts
    with pytest.raises(ValueError, match=r"'indexer_types\[2\]' must be 'full' or 'shared'"):
        models.from_hf_config({**flat, "indexer_types": ["full", "full", "both", *["full"] * 5]})
    with pytest.raises(ValueError, match="indexer_types has 3 entries but num_hidden_layers is 8"):
        models.from_hf_config({**flat, "indexer_types": ["full"] * 3})


_QWEN4_TEXT = dict(
    hidden_size=2048,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    hc_count=4,
    ple_layer_ids=[1, 2, 6],
    ple_conv_kernel_size=4,
    ngram_size=3,
    indexer_n_heads=16,
    indexer_kv_heads=1,
    indexer_head_dim=128,
    indexer_budget=2048,
    indexer_compress_ratio=16,
    eos_token_id=2,
    dtype="bfloat16",
)


def test_qwen4_exp_reads_every_size_field():
    """Qwen4-Exp saved by transformers: every 4th layer gated GQA with a QSA indexer key of
    indexer_head_dim per token, GDN elsewhere; the GDN layers of ple_layer_ids (1-based) also
    keep a PLE conv over hc_count * hidden channels, kernel ple_conv_kernel_size, dilation
    ngram_size; its SSM dtype follows vLLM's Qwen3.5 rule (mamba_ssm_dtype)."""
    transformers = pytest.importorskip("transformers")
    saved = transformers.Qwen4ExpTextConfig(**_QWEN4_TEXT).to_dict()
    model = models.from_hf_config(saved)
    assert model.family == "qwen4_exp_text"
    assert model.layer_kinds == {
        "gated_deltanet": 6,
        "ple_conv": 3,
        "full_attention": 2,
        "indexer": 2,
    }
    names = [layer.name for layer in model.layers]
    assert names[:4] == ["layers.0.mixer", "layers.0.ple", "layers.1.mixer", "layers.1.ple"]
    assert "layers.3.attn" in names and "layers.3.indexer" in names and "layers.5.ple" in names
    spec = {layer.spec.kind: layer.spec for layer in model.layers}
    attn, indexer, ple = spec["full_attention"], spec["indexer"], spec["ple_conv"]
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (16, 2, 128)
    assert (indexer.index_head_dim, indexer.side_channels) == (128, 0)
    # a query attends indexer_budget tokens of whole blocks plus the open block's tail
    assert (attn.sparse_topk, indexer.index_n_heads, indexer.pool_tokens) == (2048 + 15, 16, 16)
    # QSA's kernels take any page: the GQA's 16-token alignment rules hybridkv's own layouts,
    # not a DSA indexer's 64 (DeepGEMM), which would make per_group's blocks 64 tokens
    assert (indexer.kernel_alignment, model.kernel_alignment) == (16, 16)
    assert make_plan(model, "per_group", memory="8GiB", max_num_seqs=8).block_size == 16
    assert (ple.conv_dim, ple.conv_kernel, ple.dilation) == (4 * 2048, 4, 3)
    assert spec["gated_deltanet"].ssm_dtype == "bfloat16"  # vLLM: auto is the conv dtype
    assert "missing" not in model.doubts
    wrapped = transformers.Qwen4ExpConfig(text_config=_QWEN4_TEXT).to_dict()
    assert _layers(models.from_hf_config(wrapped)) == _layers(model)
    fp32 = models.from_hf_config({**saved, "mamba_ssm_dtype": "float32"})
    assert fp32.ssm_dtype_declared == "float32"
    assert {
        layer.spec.ssm_dtype for layer in fp32.state_layers if layer.spec.kind == "gated_deltanet"
    } == {"float32"}
    # no indexer fields: no indexer cache, said among the doubts
    plain = models.from_hf_config(_without(saved, "indexer_head_dim"))
    assert "indexer" not in plain.layer_kinds and "no indexer_head_dim" in plain.doubts
    assert {layer.spec.sparse_topk for layer in plain.attention_layers} == {0}  # dense
    with pytest.raises(ValueError, match="indexer_budget 2040 is not a multiple of"):
        models.from_hf_config({**saved, "indexer_budget": 2040})
    # absent sizes take Qwen4ExpTextConfig's defaults
    bare = models.from_hf_config(_without(saved, "ple_conv_kernel_size", "hc_count"))
    assert (
        "ple_conv_kernel_size missing: 4" in bare.doubts and "hc_count missing: 4" in bare.doubts
    )
    with pytest.raises(ValueError, match=r"ple_layer_ids \[4\] are not linear_attention layers"):
        models.from_hf_config({**saved, "ple_layer_ids": [1, 4]})
    with pytest.raises(ValueError, match="indexer_kv_heads is 2"):
        models.from_hf_config({**saved, "indexer_kv_heads": 2})


_INKLING_TEXT = dict(
    hidden_size=1024,
    num_hidden_layers=6,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=64,
    swa_num_attention_heads=8,
    swa_num_key_value_heads=4,
    swa_head_dim=128,
    sliding_window_size=256,
    sconv_kernel_size=3,
    dtype="bfloat16",
)


def test_inkling_reads_every_size_field():
    """Inkling saved by transformers (the multimodal wrapper and its text config alike): the
    hybrid layers full GQA, the hybrid_sliding ones windowed with their own swa_* heads, every
    layer's four short convs over its own K/V channels and twice the hidden size, kernel
    sconv_kernel_size (transformers' conv_kernel_size), float32 whatever the model dtype."""
    transformers = pytest.importorskip("transformers")
    text = transformers.InklingTextConfig(**_INKLING_TEXT).to_dict()
    model = models.from_hf_config(text)
    assert model.family == "inkling_text"
    # transformers' rule: layer i slides unless (i + 1) % 6 == 0
    assert [
        layer.index for layer in model.attention_layers if layer.spec.kind == "full_attention"
    ] == [5]
    assert model.layer_kinds == {"sliding_window": 5, "inkling_sconv": 6, "full_attention": 1}
    assert [layer.name for layer in model.layers[:2]] == ["layers.0.attn", "layers.0.mixer"]
    full, swa = model.layer("layers.5.attn").spec, model.layer("layers.0.attn").spec
    assert (full.num_heads, full.num_kv_heads, full.head_dim) == (16, 2, 64)
    assert (swa.num_heads, swa.num_kv_heads, swa.head_dim, swa.sliding_window) == (8, 4, 128, 256)
    for i, kv in ((5, 2 * 64), (0, 4 * 128)):
        conv = model.layer(f"layers.{i}.mixer").spec
        assert {t.name: t.shape for t in conv.state_tensors()} == {
            "k_sconv": (2, kv),
            "v_sconv": (2, kv),
            "attn_sconv": (2, 1024),
            "mlp_sconv": (2, 1024),
        }
        assert {t.dtype for t in conv.state_tensors()} == {"float32"}
        assert conv.state_bytes == 2 * (2 * kv + 2 * 1024) * 4
    assert "short-conv states read in float32" in model.doubts
    # a server keeping them in the model dtype: --mamba-cache-dtype
    half = model.configure(conv_dtype="bfloat16")
    assert {layer.spec.conv_dtype for layer in half.state_layers} == {"bfloat16"}
    wrapped = transformers.InklingConfig(text_config=_INKLING_TEXT).to_dict()
    assert models.from_hf_config(wrapped).family == "inkling_text"
    assert _layers(models.from_hf_config(wrapped)) == _layers(model)
    # the checkpoint's own spellings: sconv_kernel_size, local_layer_ids, no layer_types
    raw = {**_without(text, "layer_types", "conv_kernel_size"), "sconv_kernel_size": 5}
    listed = models.from_hf_config({**raw, "local_layer_ids": [1, 2]})
    assert [layer.spec.kind for layer in listed.attention_layers] == [
        "full_attention",
        "sliding_window",
        "sliding_window",
        *["full_attention"] * 3,
    ]
    assert {layer.spec.conv_kernel for layer in listed.state_layers} == {5}
    both = models.from_hf_config({**raw, "conv_kernel_size": 2})
    assert {layer.spec.conv_kernel for layer in both.state_layers} == {5}
    assert "sconv_kernel_size 5 and conv_kernel_size 2 differ" in both.doubts
    bare = models.from_hf_config(_without(text, "conv_kernel_size", "swa_head_dim"))
    assert (
        "conv_kernel_size missing: 4" in bare.doubts and "swa_head_dim missing: 128" in bare.doubts
    )
    mtp = models.from_hf_config({**text, "num_mtp_layers": 1})
    assert "num_mtp_layers 1" in mtp.doubts and mtp.layers == model.layers
    with pytest.raises(ValueError, match=r"layer_types\[2\] is 'mamba'; expected one of"):
        models.from_hf_config({**text, "layer_types": ["hybrid"] * 2 + ["mamba"] * 4})
    with pytest.raises(ValueError, match=r"local_layer_ids \[9\] reach outside 0..5"):
        models.from_hf_config({**raw, "local_layer_ids": [9]})


def test_zaya_reads_every_size_field():
    """ZAYA saved by transformers: every layer GQA K/V of head_dim (full, or windowed for
    hybrid_sliding) plus the CCA state: the q/k conv window of cca_time0 + cca_time1 - 2 tokens
    over (heads + KV heads) * head_dim channels and the delayed value half, model dtype."""
    transformers = pytest.importorskip("transformers")
    saved = transformers.ZayaConfig(
        hidden_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        cca_time0=2,
        cca_time1=4,
        layer_types=["hybrid", "hybrid_sliding"] * 2,
        sliding_window=512,
        dtype="bfloat16",
    ).to_dict()
    model = models.from_hf_config(saved)
    assert model.family == "zaya"
    assert model.layer_kinds == {"full_attention": 2, "cca": 4, "sliding_window": 2}
    assert model.layer("layers.1.attn").spec.sliding_window == 512
    attn = model.layer("layers.0.attn").spec
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (8, 2, 128)
    cca = model.layer("layers.0.mixer").spec
    assert {t.name: (t.shape, t.dtype) for t in cca.state_tensors()} == {
        "conv": ((4, 10 * 128), "bfloat16"),
        "v_delayed": ((1, 128), "bfloat16"),
    }
    assert "missing" not in model.doubts
    with pytest.raises(ValueError, match="hybrid_sliding layers but no sliding_window"):
        models.from_hf_config(_without(saved, "sliding_window"))
    with pytest.raises(ValueError, match="num_kv_heads \\* head_dim = 3 is odd"):
        models.from_hf_config(
            {**saved, "num_key_value_heads": 1, "num_attention_heads": 1, "head_dim": 3}
        )


def test_bailing_hybrid_reads_both_saved_forms():
    transformers = pytest.importorskip("transformers")
    saved = transformers.BailingHybridConfig().to_dict()  # head_dim overwritten with rope width
    model = models.from_hf_config(saved)
    kda = model.state_layers[0].spec
    assert (kda.num_heads, kda.head_dim, kda.conv_kernel) == (32, 128, 4)
    assert [layer.index for layer in model.attention_layers] == list(range(5, 42, 6))
    # the checkpoint's own format: head_dim 128, no linear_* fields, no layer_types
    raw = {
        k: v
        for k, v in saved.items()
        if not k.startswith("linear_") and k not in ("layer_types", "head_dim")
    }
    raw |= {"head_dim": 128, "short_conv_kernel_size": 4}
    assert _layers(models.from_hf_config(raw)) == _layers(model)


def test_pure_state_families():
    mamba = models.from_hf_config(
        {
            "model_type": "mamba",
            "num_hidden_layers": 64,
            "hidden_size": 2560,
            "intermediate_size": 5120,
            "state_size": 16,
            "conv_kernel": 4,
            "torch_dtype": "float16",
        }
    )
    assert mamba.layer_kinds == {"mamba1": 64} and mamba.dtype == "float16"
    assert mamba.state_layers[0].spec.d_inner == 5120
    mamba2 = models.from_hf_config(
        {
            "architectures": ["Mamba2ForCausalLM"],
            "num_hidden_layers": 64,
            "hidden_size": 2560,
            "expand": 2,
            "num_heads": 80,
            "head_dim": 64,
            "n_groups": 1,
            "state_size": 128,
        }
    )
    assert mamba2.family == "mamba2" and mamba2.layer_kinds == {"mamba2": 64}
    with pytest.raises(ValueError, match="num_heads=80 x head_dim=32 is not expand"):
        models.from_hf_config({"model_type": "mamba2", **_mamba2_fields(head_dim=32)})


def _mamba2_fields(**override):
    fields = {
        "num_hidden_layers": 2,
        "hidden_size": 2560,
        "num_heads": 80,
        "head_dim": 64,
        "state_size": 128,
    }
    return fields | override


@pytest.mark.parametrize(
    "arch, family",
    [
        ("Lfm2MoeForCausalLM", "lfm2_moe"),
        ("ZambaForCausalLM", "zamba"),
        ("OlmoHybridForCausalLM", "olmo_hybrid"),
        ("FalconMambaForCausalLM", "falcon_mamba"),
        ("MambaForCausalLM", "mamba"),
        ("NemotronHPuzzleForCausalLM", "nemotron_h"),
        ("InklingForConditionalGeneration", "inkling_mm_model"),
        ("InklingForCausalLM", "inkling_text"),
        ("ZayaForCausalLM", "zaya"),
    ],
)
def test_new_architectures_dispatch(arch, family):
    assert ARCHITECTURES[arch] == family


# ---- malformed fields: a ValueError naming the field and what it must be -----------------------


@pytest.mark.parametrize(
    "config, message",
    [
        pytest.param(
            {**GRANITE_SMALL, "num_attention_heads": "32"},
            r"field 'num_attention_heads' must be a positive integer, got '32' \(a string\)",
            id="string-for-int",
        ),
        pytest.param(
            {**GRANITE_SMALL, "hidden_size": [4096]},
            r"field 'hidden_size' must be a positive integer, got \[4096\] \(a list\)",
            id="list-for-int",
        ),
        pytest.param(
            {**GRANITE_SMALL, "mamba_n_heads": None},
            r"'mamba_n_heads' is null; expected a positive integer",
            id="null-for-int",
        ),
        pytest.param(
            {**GRANITE_SMALL, "mamba_d_state": True},
            r"field 'mamba_d_state' must be a positive integer, got True \(a boolean\)",
            id="bool-for-int",
        ),
        pytest.param(
            {**JAMBA, "mamba_expand": 1.5},
            r"field 'mamba_expand' must be a positive integer, got 1.5 \(a number\)",
            id="fraction-for-int",
        ),
        pytest.param(
            {**QWEN3_NEXT, "full_attention_interval": "4"},
            r"field 'full_attention_interval' must be a positive integer, got '4'",
            id="interval-string",
        ),
        pytest.param(
            {**QWEN3_NEXT, "layer_types": "full_attention"},
            r"field 'layer_types' must be a list of layer types, got 'full_attention'",
            id="layer_types-string",
        ),
        pytest.param(
            {**QWEN3_NEXT, "layer_types": [{"type": "full"}] * 48},
            r"layer_types\[0\] is \{'type': 'full'\}; expected one of",
            id="layer_types-objects",
        ),
        pytest.param(
            {**NEMOTRON_3_NANO_TF5, "layers_block_type": "mamba"},
            r"unknown characters",
            id="nemotron-list-as-string",
        ),
        pytest.param(
            {**NEMOTRON_H_8B, "hybrid_override_pattern": 52},
            r"field 'hybrid_override_pattern' must be a pattern string",
            id="nemotron-pattern-number",
        ),
        pytest.param(
            {**BAMBA, "attn_layer_indices": "9"},
            r"field 'attn_layer_indices' must be a list of integers >= 0, got '9'",
            id="indices-string",
        ),
        pytest.param(
            {**BAMBA, "attn_layer_indices": [9, -1]},
            r"field 'attn_layer_indices\[1\]' must be an integer >= 0, got -1",
            id="indices-negative",
        ),
        pytest.param(
            {**BAMBA, "attn_layer_indices": [9, 40]},
            r"attn_layer_indices \[9, 40\] reach outside 0..31",
            id="indices-out-of-range",
        ),
        pytest.param(
            {**KIMI, "linear_attn_config": [1, 2]},
            r"field 'linear_attn_config' must be an object, got \[1, 2\] \(a list\)",
            id="nested-config-list",
        ),
        pytest.param(
            {**KIMI, "linear_attn_config": {**KIMI["linear_attn_config"], "kda_layers": [0, 1]}},
            r"field 'linear_attn_config.kda_layers\[0\]' must be an integer >= 1, got 0",
            id="kimi-zero-in-1-based",
        ),
        pytest.param(
            {**KIMI, "linear_attn_config": {**KIMI["linear_attn_config"], "head_dim": "128"}},
            r"field 'linear_attn_config.head_dim' must be a positive integer",
            id="kimi-nested-string",
        ),
        pytest.param(
            {**RG, "block_types": "recurrent"},
            r"field 'block_types' must be a list of 'recurrent' / 'attention'",
            id="block_types-string",
        ),
        pytest.param(
            {**ZAMBA2_27B, "layers_block_type": None, "hybrid_layer_ids": {"6": True}},
            r"field 'hybrid_layer_ids' must be a list of integers",
            id="hybrid_layer_ids-object",
        ),
        pytest.param(
            {**LFM2_12B, "full_attn_idxs": [2.5]},
            r"field 'full_attn_idxs\[0\]' must be an integer >= 0, got 2.5",
            id="lfm2-fractional-index",
        ),
        pytest.param(
            {**JAMBA, "torch_dtype": 16},
            r"field 'torch_dtype' must be a dtype name such as 'bfloat16', got 16",
            id="dtype-number",
        ),
        pytest.param(
            {**JAMBA, "max_position_embeddings": "262144"},
            r"field 'max_position_embeddings' must be a positive integer, got '262144'",
            id="max-position-string",
        ),
        pytest.param(
            {**NEMOTRON_H_8B, "mamba_ssm_cache_dtype": 32},
            r"field 'mamba_ssm_cache_dtype' must be a dtype name",
            id="ssm-dtype-number",
        ),
        pytest.param(
            {**_without(JAMBA, "model_type"), "architectures": "JambaForCausalLM"},
            r"architectures must be a list of class names",
            id="architectures-string",
        ),
    ],
)
def test_wrong_types_name_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        models.from_hf_config(config)


SAMPLES = {
    "qwen3_next": QWEN3_NEXT,
    "qwen3_5": QWEN35_4B["text_config"],
    "nemotron_h": NEMOTRON_H_8B,
    "nemotron_h_tf5": NEMOTRON_3_NANO_TF5,
    "jamba": JAMBA,
    "kimi": KIMI,
    "kimi_tf5": KIMI_TF5,
    "recurrent_gemma": RG,
    "granite": GRANITE_SMALL,
    "bamba": BAMBA,
    "falcon_h1": FALCON_H1_7B,
    "zamba2": ZAMBA2_27B,
    "lfm2": LFM2_12B,
    "minimax": MINIMAX,
    "zamba": json.loads((DATA / "zamba-7b-v1.json").read_text()),
}
BAD_VALUES = ["7", 2.5, -3, 0, True, [], [1], {}, {"a": 1}, "mamba"]


def _reads_or_value_error(config: dict, label: str) -> None:
    try:
        models.from_hf_config(config)
    except ValueError:
        pass
    except Exception as exc:  # pragma: no cover - the failure this test exists for
        raise AssertionError(f"{label} raised {exc!r}, not a ValueError") from exc


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_any_bad_field_is_a_value_error(sample):
    """Replace each field of a real-format config by values of the wrong type: the reader
    either reads the config or raises a ValueError, never another exception."""
    config = SAMPLES[sample]
    for key in config:
        if key == "model_type":
            continue
        for bad in BAD_VALUES:
            _reads_or_value_error({**config, key: copy.deepcopy(bad)}, f"{sample}: {key}={bad!r}")
    nested = config.get("linear_attn_config") or {}
    for key in nested:
        for bad in BAD_VALUES:
            changed = {**config, "linear_attn_config": {**nested, key: copy.deepcopy(bad)}}
            _reads_or_value_error(changed, f"{sample}: linear_attn_config.{key}={bad!r}")
