"""The model zoo and the Hugging Face config reader."""

from __future__ import annotations

import json

import pytest

from hybridkv import models
from hybridkv.models import HybridModel
from hybridkv.specs import SPEC_KINDS

ZOO = models.list_models()


def test_zoo_is_large_and_covers_every_kind():
    assert len(ZOO) >= 15
    kinds = {layer.spec.kind for name in ZOO for layer in models.load(name).layers}
    assert kinds == set(SPEC_KINDS)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_entry_matches_reference_derived_numbers(name):
    """Every zoo entry carries the reference table's derived element counts; the specs must
    produce the same numbers (conv elems use kernel - 1 columns as in vLLM)."""
    model = models.load(name, kv_dtype="float32")
    data = models._zoo()[name]
    ref = data["reference_derived"]
    attn = model.attention_layers[0].spec
    assert attn.bytes_per_token // 4 == ref["kv_elems_per_token_per_attn_layer"]
    tensors = {t.name: t for t in model.state_layers[0].spec.state_tensors()}
    conv_key = next((k for k in ref if k.startswith("conv_state_elems")), None)
    if conv_key and "conv" in tensors:
        assert tensors["conv"].numel == ref[conv_key]
    ssm_key = next(
        (k for k in ("ssm_state_elems_per_layer", "recurrent_state_elems_per_layer") if k in ref),
        None,
    )
    if ssm_key and "ssm" in tensors:
        assert tensors["ssm"].numel == ref[ssm_key]
    assert data["sources"], "every zoo entry names its sources"


@pytest.mark.parametrize("name", ZOO)
def test_to_dict_round_trip(name):
    model = models.load(name)
    again = HybridModel.from_dict(model.to_dict())
    assert [(lay.name, lay.spec) for lay in again.layers] == [
        (lay.name, lay.spec) for lay in model.layers
    ]


@pytest.mark.parametrize(
    "alias", ["qwen3.5-4b", "Qwen/Qwen3.5-4B", "QWEN3.5-4B", "Qwen3.5-4B"], ids=str
)
def test_aliases(alias):
    assert models.load(alias).name == "qwen3.5-4b"


def test_unknown_model_suggests_close_names():
    with pytest.raises(ValueError, match=r"did you mean .*qwen3.5-4b.*hybridkv models"):
        models.load("qwen3.5-4")


def test_configure_resolves_dtypes_like_vllm():
    m = models.load("qwen3.5-9b")  # declares mamba_ssm_dtype float32
    assert (m.kv_dtype, m.conv_dtype, m.ssm_dtype) == ("bfloat16", "bfloat16", "float32")
    m = models.load("qwen3-next-80b-a3b", kv_dtype="fp8")  # declares nothing
    assert (m.kv_dtype, m.ssm_dtype) == ("fp8_e4m3", "bfloat16")
    kimi = models.load("kimi-linear-48b-a3b")  # KDA keeps its recurrent state in fp32
    assert kimi.state_layers[0].spec.ssm_dtype == "float32"


# ---- Hugging Face configs ---------------------------------------------------------------------
QWEN3_NEXT = {
    "model_type": "qwen3_next",
    "architectures": ["Qwen3NextForCausalLM"],
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 262144,
}
QWEN35_4B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text",
        "num_hidden_layers": 32,
        "hidden_size": 2560,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "mamba_ssm_dtype": "float32",
        "dtype": "bfloat16",
    },
}
NEMOTRON_H_8B = {
    "model_type": "nemotron_h",
    "num_hidden_layers": 52,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "torch_dtype": "bfloat16",
}
JAMBA = {
    "model_type": "jamba",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "mamba_expand": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "torch_dtype": "bfloat16",
}
KIMI = {
    "model_type": "kimi_linear",
    "num_hidden_layers": 27,
    "hidden_size": 2304,
    "num_attention_heads": 32,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "linear_attn_config": {
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
    },
    "torch_dtype": "bfloat16",
}
RG = {
    "model_type": "recurrent_gemma",
    "num_hidden_layers": 26,
    "hidden_size": 2560,
    "lru_width": 2560,
    "num_attention_heads": 10,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "attention_window_size": 2048,
    "conv1d_width": 4,
    "block_types": ["recurrent", "recurrent", "attention"],
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    "config, zoo_name",
    [
        pytest.param(QWEN3_NEXT, "qwen3-next-80b-a3b", id="qwen3-next-interval"),
        pytest.param(QWEN35_4B, "qwen3.5-4b", id="qwen3.5-text_config-layer_types"),
        pytest.param(NEMOTRON_H_8B, "nemotron-h-8b", id="nemotron-h-pattern"),
        pytest.param(JAMBA, "jamba-1.5-mini", id="jamba-period-offset"),
        pytest.param(KIMI, "kimi-linear-48b-a3b", id="kimi-1-based"),
        pytest.param(RG, "recurrentgemma-2b", id="recurrentgemma-block-types"),
    ],
)
def test_hf_config_matches_zoo(config, zoo_name, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    for source in (path, tmp_path, config):
        parsed = models.from_hf_config(source)
        zoo = models.load(zoo_name)
        assert [(lay.name, lay.spec) for lay in parsed.layers] == [
            (lay.name, lay.spec) for lay in zoo.layers
        ]
        assert parsed.kv_bytes_per_token == zoo.kv_bytes_per_token
        assert parsed.state_bytes_per_seq == zoo.state_bytes_per_seq


@pytest.mark.parametrize(
    "config, message",
    [
        pytest.param({"model_type": "llama"}, "not a supported hybrid family", id="not-hybrid"),
        pytest.param(
            {k: v for k, v in NEMOTRON_H_8B.items() if k != "mamba_num_heads"},
            "model_type 'nemotron_h' has no 'mamba_num_heads'",
            id="missing-key",
        ),
        pytest.param(
            {**QWEN3_NEXT, "layer_types": ["full_attention"] * 3},
            "layer_types has 3 entries but num_hidden_layers is 48",
            id="short-layer-types",
        ),
    ],
)
def test_malformed_configs(config, message):
    with pytest.raises(ValueError, match=message):
        models.from_hf_config(config)


def test_bad_config_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        models.from_hf_config(tmp_path)
    with pytest.raises(ValueError, match=r"no config\.json"):
        models.from_hf_config(tmp_path / "missing")
