"""The model zoo and the Hugging Face config reader."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from hybridkv import models
from hybridkv.models import HybridModel
from hybridkv.models.hf_config import ARCHITECTURES, FAMILIES
from hybridkv.specs import SPEC_KINDS

ZOO = models.list_models()
ATTENTION_KINDS = {"full_attention", "sliding_window", "mla"}


def _entry(name: str) -> dict:
    return models._zoo()[name]


def _layers(model: HybridModel) -> list[tuple[str, object]]:
    return [(layer.name, layer.spec) for layer in model.layers]


# ---- the zoo ------------------------------------------------------------------------------------


# kinds of families whose released config.json the zoo does not have verbatim (no zoo entry is
# written from memory); their formulas are checked against transformers in
# tests/test_hf_cache_bytes.py
NOT_IN_ZOO = {"rwkv4", "mlstm", "indexer", "ple_conv", "inkling_sconv", "cca"}


def test_zoo_is_large_and_covers_every_kind():
    assert len(ZOO) >= 15
    kinds = {layer.spec.kind for name in ZOO for layer in models.load(name).layers}
    assert kinds == set(SPEC_KINDS) - NOT_IN_ZOO


@pytest.mark.parametrize(
    "kind, names",
    [
        (
            "full_attention",
            [
                "qwen3-next-80b-a3b",
                "nemotron-h-8b",
                "minimax-text-01",
                "zamba-7b-v1",
                "olmo-hybrid-7b",
            ],
        ),
        ("sliding_window", ["recurrentgemma-2b", "recurrentgemma-9b"]),
        ("mla", ["kimi-linear-48b-a3b"]),
        ("mamba1", ["jamba-1.5-mini", "jamba-v0.1", "zamba-7b-v1"]),
        (
            "mamba2",
            [
                "nemotron-h-8b",
                "nemotron-nano-12b-v2",
                "nemotron-3-nano-30b-a3b",
                "nemotron-3-nano-4b",
                "bamba-9b",
                "granite-4.0-h-small",
                "falcon-h1-7b",
                "zamba2-2.7b",
            ],
        ),
        (
            "gated_deltanet",
            ["qwen3-next-80b-a3b", "qwen3.5-4b", "qwen3.5-397b-a17b", "olmo-hybrid-7b"],
        ),
        ("kda", ["kimi-linear-48b-a3b"]),
        ("linear_attention", ["minimax-text-01", "minimax-m1"]),
        ("short_conv", ["lfm2-1.2b", "lfm2-8b-a1b"]),
        ("rglru", ["recurrentgemma-2b"]),
    ],
)
def test_named_models_hold_their_kind(kind, names):
    for name in names:
        assert kind in models.load(name).layer_kinds, name


@pytest.mark.parametrize("name", ZOO)
def test_zoo_entry_matches_reference_derived_numbers(name):
    """Each zoo entry carries models.json's derived element counts (computed there from the
    config numbers); the specs must give the same, for every layer of the kind (conv elements
    use kernel - 1 columns as vLLM does)."""
    model = models.load(name, kv_dtype="float32")
    ref = _entry(name)["reference_derived"]
    per_token = {layer.spec.bytes_per_token // 4 for layer in model.attention_layers}
    assert per_token == {ref["kv_elems_per_token_per_attn_layer"]}
    conv_key = next(
        k
        for k in ("conv_state_elems_per_layer", "conv_state_elems_per_layer_vllm", None)
        if k is None or k in ref
    )
    ssm_key = next(
        k
        for k in ("ssm_state_elems_per_layer", "recurrent_state_elems_per_layer", None)
        if k is None or k in ref
    )
    assert conv_key or ssm_key
    for layer in model.state_layers:
        tensors = {t.name: t.numel for t in layer.spec.state_tensors()}
        assert tensors.get("conv") == (ref[conv_key] if conv_key else None), layer.name
        assert tensors.get("ssm") == (ref[ssm_key] if ssm_key else None), layer.name


@pytest.mark.parametrize("name", ZOO)
def test_zoo_entry_is_complete(name):
    data = _entry(name)
    model = models.load(name)
    assert model.name == name and name == name.lower()
    assert data["sources"] and model.sources, "every zoo entry names its sources"
    assert isinstance(data["verified"], bool)
    assert model.display_name and model.family and model.hf_repo
    assert model.is_hybrid
    if not data["verified"]:
        assert model.doubts, "an unverified entry says why"
    # only the layers the file lists hold a cache, each mixer kind at most once per layer
    seen = [(layer.index, layer.spec.is_attention) for layer in model.layers]
    assert len(seen) == len(set(seen))


def test_layer_patterns_follow_each_family_rule():
    def attn(name):
        return [layer.index for layer in models.load(name).attention_layers]

    def state(name):
        return [layer.index for layer in models.load(name).state_layers]

    # Qwen3-Next / Qwen3.5: layer i is full attention iff (i + 1) % 4 == 0
    assert attn("qwen3-next-80b-a3b") == [i for i in range(48) if (i + 1) % 4 == 0]
    assert attn("qwen3.5-397b-a17b") == [i for i in range(60) if (i + 1) % 4 == 0]
    # Jamba: period 8, offset 4
    assert attn("jamba-1.5-mini") == [4, 12, 20, 28] and len(state("jamba-1.5-mini")) == 28
    # Kimi-Linear's 1-based full_attn_layers [4, 8, ..., 24, 27] are 0-based [3, ..., 26]
    assert attn("kimi-linear-48b-a3b") == [3, 7, 11, 15, 19, 23, 26]
    # MiniMax: softmax attention at i % 8 == 7
    assert attn("minimax-text-01") == list(range(7, 80, 8))
    # RecurrentGemma: (recurrent, recurrent, attention) cycled
    assert attn("recurrentgemma-2b") == list(range(2, 26, 3))
    # Falcon-H1: attention and Mamba-2 in every layer
    assert attn("falcon-h1-7b") == state("falcon-h1-7b") == list(range(44))
    # Zamba2: Mamba-2 in every layer; shared attention on the hybrid layers only
    assert state("zamba2-2.7b") == list(range(54))
    assert attn("zamba2-2.7b") == [6, 12, 18, 24, 30, 36, 42, 47, 51]
    # Nemotron-H: MLP-only layers ('-') hold no cache and are not listed
    nano = models.load("nemotron-nano-9b-v2")
    assert nano.num_hidden_layers == 56 and len(nano.layers) == 4 + 27
    assert attn("nemotron-nano-9b-v2") == [14, 21, 30, 39]
    # Nemotron-3-Nano-4B: 21 Mamba-2 + 4 attention of 42 (17 MLP-only layers)
    nano4 = models.load("nemotron-3-nano-4b")
    assert nano4.num_hidden_layers == 42 and nano4.layer_kinds == {
        "mamba2": 21,
        "full_attention": 4,
    }
    assert attn("nemotron-3-nano-4b") == [12, 17, 24, 32]
    # Zamba v1: Mamba-1 everywhere; shared attention on 2, then 3 + i for i % 6 == 4
    assert state("zamba-7b-v1") == list(range(76))
    assert attn("zamba-7b-v1") == [2, *range(7, 76, 6)]
    # OLMo-Hybrid and LFM2-MoE
    assert attn("olmo-hybrid-7b") == list(range(3, 32, 4))
    assert attn("lfm2-8b-a1b") == [2, 6, 10, 14, 18, 21]


def test_declared_ssm_dtypes():
    """Qwen3.5 (and Qwen3.6, its architecture) declares float32 in its config; every NemotronH
    model gets float32 from vLLM's NemotronH hook (the config's mamba_ssm_cache_dtype, else
    float32); no other family has a hook, so nothing else declares a dtype."""
    declared = {name for name in ZOO if _entry(name)["ssm_dtype_declared"]}
    assert declared == {n for n in ZOO if n.startswith(("qwen3.5-", "qwen3.6-", "nemotron"))}
    assert all(_entry(n)["ssm_dtype_declared"] == "float32" for n in declared)
    for name in ("nemotron-h-8b", "nemotron-h-47b", "nemotron-h-56b", "nemotron-nano-9b-v2"):
        assert "update_mamba_ssm_cache_dtype" in _entry(name)["doubts"]
        assert "keeps the SSM state in the model dtype" not in _entry(name)["doubts"]
    # sizes whose own config was not seen say that the dtype comes from their siblings
    for name in ("qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b"):
        assert "inferred from sibling" in _entry(name)["doubts"]
        assert "#40696" in _entry(name)["doubts"]
    for name in ("bamba-9b", "zamba2-2.7b"):  # configs without torch_dtype
        assert _entry(name)["torch_dtype"] == "bfloat16"
        assert "bfloat16 assumed" in _entry(name)["doubts"]
    assert "float32" in _entry("nemotron-h-8b")["doubts"]  # vLLM's NemotronH ssm default


@pytest.mark.parametrize("name", ZOO)
def test_to_dict_round_trip(name):
    model = models.load(name)
    again = HybridModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert _layers(again) == _layers(model)
    assert again == model


@pytest.mark.parametrize("name", ZOO)
def test_zoo_file_is_the_to_dict_schema(name):
    """The zoo files are exactly ``to_dict()`` output plus reference-only keys."""
    data = {k: v for k, v in _entry(name).items() if k not in ("reference_derived", "aliases")}
    out = models.load(name).to_dict()

    def mixers(d):
        return sorted(json.dumps(m, sort_keys=True) for m in d.pop("mixers"))

    assert mixers(data) == mixers(out)
    assert data == out


@pytest.mark.parametrize(
    "alias, name",
    [
        ("qwen3.5-4b", "qwen3.5-4b"),
        ("Qwen/Qwen3.5-4B", "qwen3.5-4b"),
        ("QWEN3.5-4B", "qwen3.5-4b"),
        ("  Qwen3.5-4B ", "qwen3.5-4b"),
        ("Qwen/Qwen3-Next-80B-A3B-Thinking", "qwen3-next-80b-a3b"),
        ("Qwen3-Next-80B-A3B", "qwen3-next-80b-a3b"),
        ("NVIDIA-Nemotron-Nano-12B-v2", "nemotron-nano-12b-v2"),
        ("nvidia/NVIDIA-Nemotron-Nano-12B-v2-Base", "nemotron-nano-12b-v2"),
        ("nvidia/Nemotron-H-8B-Base-8K", "nemotron-h-8b"),
        ("AI21-Jamba-1.5-Mini", "jamba-1.5-mini"),
        ("tiiuae/Falcon-H1-7B-Instruct", "falcon-h1-7b"),
        ("ibm-ai-platform/Bamba-9B", "bamba-9b"),
        ("Zyphra/Zamba2-2.7B-Instruct-v2", "zamba2-2.7b"),
        ("MiniMaxAI/MiniMax-M1-40k", "minimax-m1"),
        ("moonshotai/Kimi-Linear-48B-A3B-Instruct", "kimi-linear-48b-a3b"),
        ("LiquidAI/LFM2-1.2B", "lfm2-1.2b"),
        ("LiquidAI/LFM2-8B-A1B", "lfm2-8b-a1b"),
        ("nvidia/NVIDIA-Nemotron-3-Nano-4B-BF16", "nemotron-3-nano-4b"),
        ("Zyphra/Zamba-7B-v1", "zamba-7b-v1"),
        ("allenai/Olmo-Hybrid-7B", "olmo-hybrid-7b"),
        ("google/recurrentgemma-2b", "recurrentgemma-2b"),
        # the Qwen3.6 / Nemotron-3.5 entries answer to the base release and the NVFP4 checkpoint
        ("Qwen/Qwen3.6-27B", "qwen3.6-27b"),
        ("nvidia/Qwen3.6-35B-A3B-NVFP4", "qwen3.6-35b-a3b"),
        ("nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-BF16", "nemotron-3.5-lightning-30b-a3b"),
        ("NVIDIA-Nemotron-3.5-Lightning-30B-A3B-NVFP4", "nemotron-3.5-lightning-30b-a3b"),
        # Nemotron-3-Ultra: one config for the BF16, FP8 and NVFP4 checkpoints, each an alias
        ("nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16", "nemotron-3-ultra-550b-a55b"),
        ("nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-FP8", "nemotron-3-ultra-550b-a55b"),
        ("NVIDIA-Nemotron-3-Ultra-550B-A55B-NVFP4", "nemotron-3-ultra-550b-a55b"),
        ("NVIDIA-Nemotron-3-Ultra-550B-A55B", "nemotron-3-ultra-550b-a55b"),
    ],
    ids=str,
)
def test_aliases(alias, name):
    assert models.resolve_name(alias) == name
    assert models.load(alias).name == name


def test_every_repo_id_resolves_to_its_model():
    for name in ZOO:
        repo = _entry(name)["hf_repo"].split(",")[0].split(" ")[0]
        assert models.resolve_name(repo) == name
        assert models.resolve_name(_entry(name)["display_name"]) == name


@pytest.mark.parametrize(
    "query, suggestion",
    [("qwen3.5-4", "qwen3.5-4b"), ("nemotron-nano-12b", "nemotron-nano-12b-v2")],
)
def test_unknown_model_suggests_close_names(query, suggestion):
    with pytest.raises(ValueError, match=rf"did you mean .*{suggestion}.*hybridkv models"):
        models.load(query)


def test_unknown_model_without_close_match():
    with pytest.raises(ValueError, match=r"unknown model 'llama-3-8b' \(`hybridkv models`"):
        models.load("llama-3-8b")
    with pytest.raises(ValueError, match="must be a string"):
        models.load(None)


def test_load_rejects_unknown_options():
    with pytest.raises(TypeError, match="use tp_size, kv_dtype"):
        models.load("qwen3.5-4b", tp=2)


def test_configure_resolves_dtypes_like_vllm():
    m = models.load("qwen3.5-9b")  # declares mamba_ssm_dtype float32
    assert (m.kv_dtype, m.conv_dtype, m.ssm_dtype) == ("bfloat16", "bfloat16", "float32")
    m = models.load("qwen3-next-80b-a3b", kv_dtype="fp8")  # declares nothing
    assert (m.kv_dtype, m.conv_dtype, m.ssm_dtype) == ("fp8_e4m3", "bfloat16", "bfloat16")
    m = models.load("qwen3.5-9b", ssm_dtype="bf16")  # an explicit choice beats the config
    assert m.state_layers[0].spec.ssm_dtype == "bfloat16"
    m = models.load("nemotron-3-nano-30b-a3b", conv_dtype="float16")
    assert (m.conv_dtype, m.ssm_dtype) == ("float16", "float32")
    kimi = models.load("kimi-linear-48b-a3b")  # KDA keeps its recurrent state in fp32
    assert kimi.state_layers[0].spec.ssm_dtype == "float32"
    assert models.load("kimi-linear-48b-a3b", ssm_dtype="bf16").state_layers[0].spec.ssm_dtype == (
        "bfloat16"
    )


def test_configure_records_runtime_options_and_is_cached():
    m = models.load("qwen3.5-4b", tp_size=2, kv_dtype="fp8", num_spec_tokens=1)
    assert (m.tp_size, m.kv_dtype, m.num_spec_tokens) == (2, "fp8_e4m3", 1)
    assert {layer.spec.tp_size for layer in m.layers} == {2}
    assert m is models.load("Qwen/Qwen3.5-4B", num_spec_tokens=1, kv_dtype="fp8", tp_size=2)
    assert models.load("qwen3.5-4b") is models.load("qwen3.5-4b")
    # configure() leaves the base model alone
    assert models.load("qwen3.5-4b").tp_size == 1
    assert m.configure().kv_bytes_per_token == models.load("qwen3.5-4b").kv_bytes_per_token


@pytest.mark.parametrize(
    "params, message",
    [
        pytest.param({"total": 1e9}, "total, active and source", id="incomplete"),
        pytest.param({"total": 1e9, "active": 2e9, "source": "x"}, "active <= total", id="moe"),
    ],
)
def test_zoo_params_are_checked(params, message):
    data = {**models.load("qwen3.5-0.8b").to_dict(), "params": params}
    with pytest.raises(ValueError, match=message):
        HybridModel.from_dict(data)


def test_kernel_alignment_comes_from_the_attention_specs():
    assert models.load("qwen3.5-0.8b").kernel_alignment == 16
    kimi = models.load("kimi-linear-48b-a3b")  # MLA: FlashMLA's 64-token block
    assert kimi.kernel_alignment == 64 == kimi.attention_layers[0].spec.kernel_alignment
    no_attention = dataclasses.replace(kimi, layers=kimi.state_layers)
    assert no_attention.kernel_alignment == 16


@pytest.mark.parametrize("name", ZOO)
def test_tensor_parallel_splits_or_says_why(name):
    base = models.load(name)
    for tp in (2, 4, 8):
        try:
            m = models.load(name, tp_size=tp)
        except ValueError as exc:
            assert "tensor-parallel size" in str(exc) and "use a TP size" in str(exc)
            continue
        # a rank holds at least its share (more where heads or groups are replicated)
        assert m.kv_bytes_per_token * tp >= base.kv_bytes_per_token
        assert m.state_bytes_per_seq * tp >= base.state_bytes_per_seq
        assert m.state_bytes_per_seq < base.state_bytes_per_seq


# ---- Hugging Face configs: real-format examples ------------------------------------------------
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
        "max_position_embeddings": 262144,
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
    "max_position_embeddings": 8192,
}
# transformers >= 5 re-saves NemotronH with a layers_block_type list and no layer count
NEMOTRON_3_NANO_TF5 = {
    "model_type": "nemotron_h",
    "layers_block_type": [
        {"M": "mamba", "E": "moe", "*": "attention"}[ch]
        for ch in "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
    ],
    "hidden_size": 2688,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "mamba_ssm_cache_dtype": "float32",
    "dtype": "bfloat16",
    "max_position_embeddings": 262144,
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
    "max_position_embeddings": 262144,
}
KIMI = {
    "model_type": "kimi_linear",
    "num_hidden_layers": 27,
    "hidden_size": 2304,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "linear_attn_config": {
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
    },
    "torch_dtype": "bfloat16",
    "model_max_length": 1048576,
    "max_position_embeddings": 1048576,
}
# transformers >= 5 re-saves Kimi-Linear with 0-based layer_types and flat linear_* fields
KIMI_TF5 = {
    **{k: v for k, v in KIMI.items() if k != "linear_attn_config"},
    "layer_types": [
        "full_attention" if i in (3, 7, 11, 15, 19, 23, 26) else "linear_attention"
        for i in range(27)
    ],
    "linear_num_heads": 32,
    "linear_head_dim": 128,
    "linear_conv_kernel_dim": 4,
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
GRANITE_SMALL = {
    "model_type": "granitemoehybrid",
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "num_hidden_layers": 40,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "layer_types": ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
    "mamba_n_heads": 128,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
BAMBA = {  # the released config has no torch_dtype and no max_position_embeddings
    "model_type": "bamba",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "attn_layer_indices": [9, 18, 27],
    "mamba_n_heads": 128,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
}
FALCON_H1_7B = {
    "model_type": "falcon_h1",
    "num_hidden_layers": 44,
    "hidden_size": 3072,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_d_ssm": 3072,
    "mamba_n_heads": 24,
    "mamba_d_head": 128,
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
}
ZAMBA2_27B = {  # the new-format config declares no torch_dtype
    "model_type": "zamba2",
    "num_hidden_layers": 54,
    "hidden_size": 2560,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "attention_head_dim": 160,
    "layers_block_type": [
        "hybrid" if i in (6, 12, 18, 24, 30, 36, 42, 47, 51) else "mamba" for i in range(54)
    ],
    "n_mamba_heads": 80,
    "mamba_headdim": 64,
    "mamba_ngroups": 1,
    "mamba_d_state": 64,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "max_position_embeddings": 4096,
}
LFM2_12B = {
    "model_type": "lfm2",
    "num_hidden_layers": 16,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "full_attn_idxs": [2, 5, 8, 10, 12, 14],
    "conv_L_cache": 3,
    "max_position_embeddings": 128000,
    "torch_dtype": "bfloat16",
}
MINIMAX = {
    "model_type": "minimax_text_01",
    "architectures": ["MiniMaxText01ForCausalLM"],
    "num_hidden_layers": 80,
    "hidden_size": 6144,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attn_type_list": ([0] * 7 + [1]) * 10,
    "max_position_embeddings": 10240000,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    "config, zoo_name",
    [
        pytest.param(QWEN3_NEXT, "qwen3-next-80b-a3b", id="qwen3-next-interval"),
        pytest.param(QWEN35_4B, "qwen3.5-4b", id="qwen3.5-text_config-layer_types"),
        pytest.param(NEMOTRON_H_8B, "nemotron-h-8b", id="nemotron-h-pattern"),
        pytest.param(NEMOTRON_3_NANO_TF5, "nemotron-3-nano-30b-a3b", id="nemotron-3-tf5-list"),
        pytest.param(JAMBA, "jamba-1.5-mini", id="jamba-period-offset"),
        pytest.param(KIMI, "kimi-linear-48b-a3b", id="kimi-1-based"),
        pytest.param(KIMI_TF5, "kimi-linear-48b-a3b", id="kimi-tf5-layer_types"),
        pytest.param(RG, "recurrentgemma-2b", id="recurrentgemma-block-types"),
        pytest.param(GRANITE_SMALL, "granite-4.0-h-small", id="granite-layer_types"),
        pytest.param(BAMBA, "bamba-9b", id="bamba-attn_layer_indices"),
        pytest.param(FALCON_H1_7B, "falcon-h1-7b", id="falcon-h1-parallel"),
        pytest.param(ZAMBA2_27B, "zamba2-2.7b", id="zamba2-hybrid-layers"),
        pytest.param(LFM2_12B, "lfm2-1.2b", id="lfm2-full_attn_idxs"),
        pytest.param(MINIMAX, "minimax-text-01", id="minimax-attn_type_list"),
    ],
)
def test_hf_config_matches_zoo(config, zoo_name, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    zoo = models.load(zoo_name)
    for source in (path, str(path), tmp_path, copy.deepcopy(config)):
        parsed = models.from_hf_config(source)
        assert _layers(parsed) == _layers(zoo)
        assert parsed.num_hidden_layers == zoo.num_hidden_layers
        assert parsed.kv_bytes_per_token == zoo.kv_bytes_per_token
        assert parsed.state_bytes_per_seq == zoo.state_bytes_per_seq
        assert (parsed.dtype, parsed.ssm_dtype_declared) == (zoo.dtype, zoo.ssm_dtype_declared)
    assert config == json.loads(path.read_text()), "parsing must not modify the config"


# ---- Hugging Face configs: one per zoo model, written the way its family writes them ----------
def _attention_fields(attn: dict) -> dict:
    return {
        "num_attention_heads": attn["num_heads"],
        "num_key_value_heads": attn["num_kv_heads"],
        "head_dim": attn["head_dim"],
    }


def _native_config(name: str) -> dict:
    """A config.json for zoo model ``name`` in its family's own field names."""
    z = _entry(name)
    n = z["num_hidden_layers"]
    mixers = {m["kind"]: m for m in z["mixers"]}
    attn = next(m for m in z["mixers"] if m["kind"] in ATTENTION_KINDS)
    state = next(m for m in z["mixers"] if m["kind"] not in ATTENTION_KINDS)
    a_layers, s_layers = set(attn["layers"]), set(state["layers"])
    cfg: dict = {"num_hidden_layers": n, "max_position_embeddings": z["max_position_embeddings"]}
    if "declares no torch_dtype" not in z["doubts"]:
        cfg["torch_dtype"] = z["torch_dtype"]
    if name.startswith("qwen3-next"):
        g = mixers["gated_deltanet"]
        cfg |= {"model_type": "qwen3_next", "full_attention_interval": 4}
        cfg |= _attention_fields(attn)
        cfg |= {
            "linear_num_key_heads": g["num_k_heads"],
            "linear_num_value_heads": g["num_v_heads"],
            "linear_key_head_dim": g["head_k_dim"],
            "linear_value_head_dim": g["head_v_dim"],
            "linear_conv_kernel_dim": g["conv_kernel"],
        }
    elif name.startswith(("qwen3.5", "qwen3.6")):  # Qwen3.6 is the Qwen3.5 architecture
        g = mixers["gated_deltanet"]
        moe = "-a" in name
        text = {
            "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
            "layer_types": [
                "full_attention" if i in a_layers else "linear_attention" for i in range(n)
            ],
            "linear_num_key_heads": g["num_k_heads"],
            "linear_num_value_heads": g["num_v_heads"],
            "linear_key_head_dim": g["head_k_dim"],
            "linear_value_head_dim": g["head_v_dim"],
            "linear_conv_kernel_dim": g["conv_kernel"],
            "mamba_ssm_dtype": "float32",
            **_attention_fields(attn),
            **cfg,
        }
        return {
            "model_type": "qwen3_5_moe" if moe else "qwen3_5",
            "architectures": [
                "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
            ],
            "text_config": text,
        }
    elif name.startswith("nemotron"):
        m = mixers["mamba2"]
        other = "-" if name == "nemotron-3-nano-4b" or not name.startswith("nemotron-3") else "E"
        cfg["hybrid_override_pattern"] = "".join(
            "*" if i in a_layers else "M" if i in s_layers else other for i in range(n)
        )
        cfg |= {"model_type": "nemotron_h", **_attention_fields(attn)}
        if name == "nemotron-h-56b":  # its config names the attention head size this way
            cfg["attention_head_dim"] = cfg.pop("head_dim")
        cfg |= {
            "mamba_num_heads": m["num_heads"],
            "mamba_head_dim": m["head_dim"],
            "n_groups": m["n_groups"],
            "ssm_state_size": m["d_state"],
            "conv_kernel": m["d_conv"],
        }
        if name in (
            "nemotron-3-nano-30b-a3b",
            "nemotron-3-super-120b-a12b",
            "nemotron-3-ultra-550b-a55b",
            "nemotron-3.5-lightning-30b-a3b",
        ):
            # these configs declare it; the others get float32 from vLLM's NemotronH default
            cfg["mamba_ssm_cache_dtype"] = z["ssm_dtype_declared"]
    elif name.startswith("jamba"):
        m = mixers["mamba1"]
        offsets = {i % 8 for i in a_layers}
        assert len(offsets) == 1
        cfg |= {
            "model_type": "jamba",
            "attn_layer_period": 8,
            "attn_layer_offset": offsets.pop(),
            "hidden_size": m["d_inner"] // 2,
            "mamba_expand": 2,
            "mamba_d_state": m["d_state"],
            "mamba_d_conv": m["d_conv"],
            "num_attention_heads": attn["num_heads"],
            "num_key_value_heads": attn["num_kv_heads"],
        }  # no head_dim: hidden_size // heads
    elif name.startswith(("falcon-h1", "granite", "bamba")):
        m = mixers["mamba2"]
        cfg |= {
            "mamba_n_heads": m["num_heads"],
            "mamba_d_head": m["head_dim"],
            "mamba_n_groups": m["n_groups"],
            "mamba_d_state": m["d_state"],
            "mamba_d_conv": m["d_conv"],
            "num_attention_heads": attn["num_heads"],
            "num_key_value_heads": attn["num_kv_heads"],
        }
        if name.startswith("falcon-h1"):
            cfg |= {
                "model_type": "falcon_h1",
                "head_dim": attn["head_dim"],
                "mamba_d_ssm": m["num_heads"] * m["head_dim"],
            }
        else:  # hidden_size = d_inner / expand; no head_dim: hidden_size // heads
            cfg["hidden_size"] = m["num_heads"] * m["head_dim"] // 2
            cfg["mamba_expand"] = 2
            if name.startswith("granite"):
                cfg["model_type"] = "granitemoehybrid"
                cfg["layer_types"] = ["attention" if i in a_layers else "mamba" for i in range(n)]
            else:
                cfg["model_type"] = "bamba"
                cfg["attn_layer_indices"] = sorted(a_layers)
    elif name.startswith("zamba-"):  # Zamba v1, as Zamba-7B-v1's first config (no layer list)
        m = mixers["mamba1"]
        hidden = m["d_inner"] // 2
        period_offset = {(6, 4): [2, *range(7, n, 6)]}
        assert period_offset[(6, 4)] == sorted(a_layers)
        cfg |= {
            "model_type": "zamba",
            "hidden_size": hidden,
            "num_attention_heads": attn["num_heads"],
            "num_key_value_heads": attn["num_kv_heads"],
            "attn_layer_period": 6,
            "attn_layer_offset": 4,
            "n_mamba_heads": 2,
            "mamba_expand": 2,
            "mamba_d_state": m["d_state"],
            "mamba_d_conv": m["d_conv"],
        }
        assert 2 * hidden // attn["num_heads"] == attn["head_dim"]
    elif name.startswith("olmo-hybrid"):
        g = mixers["gated_deltanet"]
        cfg |= {
            "model_type": "olmo_hybrid",
            "hidden_size": attn["head_dim"] * attn["num_heads"],  # vLLM: head = hidden // heads
            "num_attention_heads": attn["num_heads"],
            "num_key_value_heads": attn["num_kv_heads"],
            "layer_types": [
                "full_attention" if i in a_layers else "linear_attention" for i in range(n)
            ],
            "linear_num_key_heads": g["num_k_heads"],
            "linear_num_value_heads": g["num_v_heads"],
            "linear_key_head_dim": g["head_k_dim"],
            "linear_value_head_dim": g["head_v_dim"],
            "linear_conv_kernel_dim": g["conv_kernel"],
        }
    elif name.startswith("zamba2"):
        m = mixers["mamba2"]
        hidden = attn["head_dim"] * attn["num_heads"] // 2
        cfg |= {
            "model_type": "zamba2",
            "hidden_size": hidden,
            "num_attention_heads": attn["num_heads"],
            "num_key_value_heads": attn["num_kv_heads"],
        }
        if name == "zamba2-1.2b":  # pre-transformers format, as the 1.2B config was read
            cfg |= {
                "layers_block_type": ["g" if i in a_layers else "m" for i in range(n)],
                "mamba_headdim": m["head_dim"],
                "state_size": m["d_state"],
                "conv_dimension": m["d_conv"],
                "expansion_factor": 2,
            }
        else:
            cfg |= {
                "layers_block_type": ["hybrid" if i in a_layers else "mamba" for i in range(n)],
                "n_mamba_heads": m["num_heads"],
                "mamba_headdim": m["head_dim"],
                "mamba_ngroups": m["n_groups"],
                "mamba_d_state": m["d_state"],
                "mamba_d_conv": m["d_conv"],
                "mamba_expand": 2,
            }
    elif name.startswith("minimax"):
        cfg |= {"model_type": "minimax_m1" if "m1" in name else "minimax_text_01"}
        cfg |= _attention_fields(attn)
        cfg["attn_type_list"] = [1 if i in a_layers else 0 for i in range(n)]
    elif name.startswith("kimi"):
        k = mixers["kda"]
        cfg |= {
            "model_type": "kimi_linear",
            "num_attention_heads": attn["num_heads"],
            "kv_lora_rank": attn["kv_lora_rank"],
            "qk_rope_head_dim": attn["qk_rope_head_dim"],
            "linear_attn_config": {
                "num_heads": k["num_heads"],
                "head_dim": k["head_dim"],
                "short_conv_kernel_size": k["conv_kernel"],
                "full_attn_layers": [i + 1 for i in sorted(a_layers)],
                "kda_layers": [i + 1 for i in sorted(s_layers)],
            },
        }
    elif name.startswith("lfm2"):
        c = mixers["short_conv"]
        cfg |= {
            "model_type": "lfm2",
            "hidden_size": c["conv_dim"],
            "conv_L_cache": c["conv_kernel"],
            "num_attention_heads": attn["num_heads"],
            "num_key_value_heads": attn["num_kv_heads"],
        }
        if name == "lfm2-8b-a1b":  # LFM2-MoE: layer_types, conv width = hidden_size
            cfg["model_type"] = "lfm2_moe"
        else:  # released dense LFM2 configs carry conv_dim, which vLLM reads
            cfg["conv_dim"] = c["conv_dim"]
        if name in ("lfm2-2.6b", "lfm2-8b-a1b"):
            cfg["layer_types"] = ["full_attention" if i in a_layers else "conv" for i in range(n)]
        else:
            cfg["full_attn_idxs"] = sorted(a_layers)
    elif name.startswith("recurrentgemma"):
        r = mixers["rglru"]
        cfg |= {
            "model_type": "recurrent_gemma",
            "hidden_size": r["lru_width"],
            "lru_width": r["lru_width"],
            "conv1d_width": r["conv_kernel"],
            "attention_window_size": attn["sliding_window"],
            "block_types": ["recurrent", "recurrent", "attention"],
            **_attention_fields(attn),
        }
    else:  # pragma: no cover - a new family needs a branch here
        raise AssertionError(f"no config writer for {name}")
    return cfg


@pytest.mark.parametrize("name", ZOO)
def test_every_zoo_model_round_trips_through_its_hf_config(name, tmp_path):
    config = _native_config(name)
    (tmp_path / "config.json").write_text(json.dumps(config))
    zoo = models.load(name)
    parsed = models.from_hf_config(tmp_path, name=name)
    assert parsed.name == name
    assert _layers(parsed) == _layers(zoo)
    assert parsed.num_hidden_layers == zoo.num_hidden_layers
    assert parsed.max_position_embeddings == zoo.max_position_embeddings
    assert (parsed.dtype, parsed.ssm_dtype_declared) == (zoo.dtype, zoo.ssm_dtype_declared)
    for options in ({}, {"kv_dtype": "fp8"}, {"tp_size": 2}):
        try:
            want = models.load(name, **options)
        except ValueError:
            continue
        got = models.from_hf_config(config, **options)
        assert (got.kv_bytes_per_token, got.state_bytes_per_seq) == (
            want.kv_bytes_per_token,
            want.state_bytes_per_seq,
        )


# transformers cannot build these from the test configs: the pre-transformers Zamba2 format, and
# Falcon-H1 sizes whose max_position_embeddings is unknown (its strict config wants an int)
_NOT_TRANSFORMERS = {"zamba2-1.2b", "falcon-h1-1.5b", "falcon-h1-1.5b-deep", "falcon-h1-3b"}


@pytest.mark.parametrize("name", [n for n in ZOO if n not in _NOT_TRANSFORMERS])
def test_configs_as_transformers_saves_them(name):
    """Build each family's transformers config class from the test config and parse what its
    ``to_dict()`` gives (transformers >= 5 renames layer types and adds derived fields)."""
    auto_config = pytest.importorskip("transformers").AutoConfig
    cfg = _native_config(name)
    fields = dict(cfg.get("text_config") or cfg)
    model_type = fields.pop("model_type")
    if "attn_type_list" in fields:  # MiniMax's remote-code format -> transformers' port
        fields["layer_types"] = [
            "full_attention" if t else "linear_attention" for t in fields.pop("attn_type_list")
        ]
        model_type = "minimax"
    saved = auto_config.for_model(model_type, **fields).to_dict()
    options = {"kv_dtype": "bf16", "conv_dtype": "bf16", "ssm_dtype": "fp32"}
    parsed = models.from_hf_config(saved, **options)
    zoo = models.load(name, **options)
    assert _layers(parsed) == _layers(zoo)
    assert parsed.num_hidden_layers == zoo.num_hidden_layers


def test_hf_config_details():
    # a config without torch_dtype is read as bf16, and says so
    bamba = models.from_hf_config(BAMBA)
    assert bamba.dtype == "bfloat16" and "no torch_dtype" in bamba.doubts
    # the name comes from the argument, else _name_or_path, else the architecture
    assert models.from_hf_config(QWEN3_NEXT).name == "Qwen3NextForCausalLM"
    named = {**QWEN3_NEXT, "_name_or_path": "Qwen/Qwen3-Next-80B-A3B-Instruct"}
    assert models.from_hf_config(named).hf_repo == "Qwen/Qwen3-Next-80B-A3B-Instruct"
    assert models.from_hf_config(named, name="mine").name == "mine"
    # configure options pass through
    fp8 = models.from_hf_config(QWEN35_4B, tp_size=2, kv_dtype="fp8")
    assert fp8.kv_bytes_per_token == 8 * 2 * 2 * 256 * 1  # 8 layers, 2 KV heads per rank
    # dispatch by architectures when model_type is absent; model_type is case-insensitive
    no_type = {k: v for k, v in JAMBA.items() if k != "model_type"}
    assert models.from_hf_config({**no_type, "architectures": ["JambaForCausalLM"]}).family == (
        "jamba"
    )
    assert models.from_hf_config({**JAMBA, "model_type": "Jamba"}).family == "jamba"
    # "auto" declares nothing
    auto = {**NEMOTRON_H_8B, "mamba_ssm_cache_dtype": "auto"}
    assert models.from_hf_config(auto).ssm_dtype_declared is None
    # Bamba / Granite "auto" head size is d_inner // heads (transformers)
    assert _layers(models.from_hf_config({**BAMBA, "mamba_d_head": "auto"})) == _layers(bamba)
    # Zamba2 with only hybrid_layer_ids
    zamba = {k: v for k, v in ZAMBA2_27B.items() if k != "layers_block_type"}
    zamba["hybrid_layer_ids"] = [6, 12, 18, 24, 30, 36, 42, 47, 51]
    assert _layers(models.from_hf_config(zamba)) == _layers(models.load("zamba2-2.7b"))
    # LFM2 in layer_types form; MiniMax in transformers' layer_types form
    lfm2 = {k: v for k, v in LFM2_12B.items() if k != "full_attn_idxs"}
    lfm2["layer_types"] = [
        "full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)
    ]
    assert _layers(models.from_hf_config(lfm2)) == _layers(models.load("lfm2-1.2b"))
    minimax = {k: v for k, v in MINIMAX.items() if k != "attn_type_list"}
    minimax |= {
        "model_type": "minimax",
        "layer_types": ["linear_attention"] * 7 + ["full_attention"],
    }
    minimax["layer_types"] *= 10
    assert _layers(models.from_hf_config(minimax)) == _layers(models.load("minimax-text-01"))


def test_supported_families_are_dispatchable():
    assert set(ARCHITECTURES.values()) <= set(FAMILIES)


@pytest.mark.parametrize(
    "config, message",
    [
        pytest.param(
            {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
            "model_type 'llama' .* is not a supported hybrid family; supported model types: "
            ".*nemotron_h",
            id="not-hybrid",
        ),
        pytest.param(
            {k: v for k, v in QWEN3_NEXT.items() if k != "full_attention_interval"},
            "has no 'full_attention_interval'",
            id="no-layer-pattern",
        ),
        pytest.param(
            {**QWEN3_NEXT, "layer_types": ["full_attention"] * 3},
            "layer_types has 3 entries but num_hidden_layers is 48",
            id="short-layer-types",
        ),
        pytest.param(
            {**QWEN3_NEXT, "layer_types": ["full_attention", "sliding_attention"] * 24},
            r"layer_types\[1\] is 'sliding_attention'; expected one of",
            id="unknown-layer-type",
        ),
        pytest.param(
            {k: v for k, v in NEMOTRON_H_8B.items() if k != "hybrid_override_pattern"},
            "has no 'hybrid_override_pattern' or 'layers_block_type'",
            id="no-pattern",
        ),
        pytest.param(
            {**NEMOTRON_H_8B, "hybrid_override_pattern": "M*X" + "M" * 49},
            r"unknown characters \['X'\]",
            id="bad-pattern",
        ),
        pytest.param(
            {**NEMOTRON_H_8B, "hybrid_override_pattern": "M*M"},
            "hybrid_override_pattern has 3 entries but num_hidden_layers is 52",
            id="short-pattern",
        ),
        pytest.param(
            {**KIMI, "linear_attn_config": {**KIMI["linear_attn_config"], "kda_layers": [1, 2]}},
            "do not cover layers 0..26 exactly once",
            id="kimi-uncovered",
        ),
        pytest.param(
            {**KIMI, "linear_attn_config": {**KIMI["linear_attn_config"], "head_dim": None}},
            "has no 'linear_attn_config.head_dim' or 'linear_head_dim'",
            id="kimi-no-head-dim",
        ),
        pytest.param(
            {**FALCON_H1_7B, "mamba_d_head": 64},
            "mamba_n_heads=24 x mamba_d_head=64 is not the Mamba intermediate size 3072",
            id="falcon-d-head",
        ),
        pytest.param(
            {**MINIMAX, "attn_type_list": [2] * 80},
            r"attn_type_list\[0\] is 2",
            id="minimax-type",
        ),
        pytest.param(
            {**RG, "block_types": ["recurrent", "mlp"]},
            r"block_types\[1\] is 'mlp'",
            id="rg-block",
        ),
        pytest.param(
            {**JAMBA, "mamba_d_state": 0},
            "model_type 'jamba': field 'mamba_d_state' must be a positive integer, got 0",
            id="bad-value",
        ),
        pytest.param(
            {**QWEN35_4B, "text_config": ["not", "an", "object"]},
            "text_config must be a JSON object",
            id="text-config-list",
        ),
    ],
)
def test_malformed_configs(config, message):
    with pytest.raises(ValueError, match=message):
        models.from_hf_config(config)


@pytest.mark.parametrize(
    "config, field, cls",
    [
        pytest.param(NEMOTRON_H_8B, "mamba_num_heads", "NemotronHConfig", id="nemotron-h"),
        pytest.param(
            QWEN35_4B["text_config"], "linear_num_value_heads", "Qwen3_5TextConfig", id="qwen3.5"
        ),
    ],
)
def test_missing_sizes_take_transformers_defaults(config, field, cls):
    """A field left out of a hand-written config takes what transformers' config class for the
    model type sets it to (as transformers and vLLM load it), said among the model's doubts."""
    transformers = pytest.importorskip("transformers")
    stripped = {k: v for k, v in config.items() if k != field}
    want = getattr(transformers.CONFIG_MAPPING[config["model_type"]](), field)
    model = models.from_hf_config(stripped)
    assert f"{field} missing: {want!r}, the default of transformers' {cls}" in model.doubts


def test_misspelt_model_type_names_the_closest():
    bad = {**NEMOTRON_H_8B, "model_type": "nemotronh"}
    with pytest.raises(ValueError, match="did you mean 'nemotron_h'"):
        models.from_hf_config(bad)


def test_bad_config_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        models.from_hf_config(tmp_path)
    with pytest.raises(ValueError, match=r"no config\.json"):
        models.from_hf_config(tmp_path / "missing")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="does not hold a JSON object"):
        models.from_hf_config(tmp_path / "list.json")
    with pytest.raises(ValueError, match=r"a path to config\.json"):
        models.from_hf_config(42)


def test_hand_written_qwen3_next_config_plans_like_the_full_one():
    """Issue: a Qwen3-Next config.json without ``head_dim`` planned at 1,088 tokens where the full
    config gives 576, and without ``num_key_value_heads`` padded states 91%. transformers'
    Qwen3NextConfig fills them (256, 2), and so does the reader now."""
    pytest.importorskip("transformers")
    from pathlib import Path

    from hybridkv.layouts import make_plan

    path = Path(__file__).parent / "data" / "hf_configs" / "qwen3-next-80b-a3b.json"
    full = json.loads(path.read_text())
    hand = {k: v for k, v in full.items() if k not in ("head_dim", "num_key_value_heads")}
    want = make_plan(models.from_hf_config(full), "inflate", memory="40GiB")
    model = models.from_hf_config(hand)
    got = make_plan(model, "inflate", memory="40GiB")
    assert got.block_size == want.block_size == 576
    assert got.capacity.token_capacity == want.capacity.token_capacity
    assert "head_dim missing: 256" in model.doubts
    assert "num_key_value_heads missing: 2" in model.doubts
