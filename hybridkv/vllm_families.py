"""vLLM 0.33's model families: the architecture behind each hybridkv family, its layer names, and
the per-family facts vLLM's rules depend on (which GDN layer class a family uses).

One owner for the mapping from a hybridkv model (its zoo ``family`` or Hugging Face
``model_type``) to vLLM: :mod:`hybridkv.target` asks it whether a family's GDN layers export
FlashInfer prefill checkpoints, :mod:`hybridkv.vllm_export` for layer names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .models.model import HybridModel

__all__ = [
    "VLLM_FAMILIES",
    "VLLM_VERSION",
    "VllmFamily",
    "find_vllm_family",
    "not_served_reason",
    "vllm_family",
]

#: the vLLM release whose model files the table follows
VLLM_VERSION = "0.33"


# ---------------------------------------------------------------------------------------------
# Layer names: the prefixes vLLM 0.33 registers in ``static_forward_context``
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmFamily:
    """How vLLM 0.33 names one family's cache layers.

    ``attention`` and ``state`` are format strings over ``i`` (the decoder layer), ``j`` (Zamba2's
    shared-attention index), ``n_plus_i`` (``num_hidden_layers + i``, Falcon-H1's SSM branch) and
    ``h_plus_i`` (``number of hybrid layers + i``, Zamba2's Mamba layers). ``indexer`` and
    ``ring``: a sparse-attention indexer's key cache and its ring of raw keys (GLM-5-Next's
    ``Glm5NextIndexerCache`` / ``Glm5NextTailCache``, Qwen4-Exp's ``QSACompressedKeyCache`` /
    ``QSAKeyStateCache``), empty for families without one. ``ple``: Qwen4-Exp's Per-Layer
    Embedding conv state (``Qwen4ExpPLELayer``), registered before the layer's GDN.
    ``gdn_checkpoints``: the family's GDN layer is Qwen's ``QwenGatedDeltaNetAttention``, the one
    that exports FlashInfer prefill checkpoints (OLMo-Hybrid's and Kimi's do not).
    ``mtp_attention``: the attention of the MTP drafter's layer ``j`` (``Qwen3NextMTP``,
    ``Qwen3_5MTP``, ``NemotronHMTP``, loaded without a prefix under ``mtp``), registered after
    the target model's layers; empty where no MTP drafter is modelled.
    """

    key: str
    architecture: str
    source: str
    attention: str
    state: str
    gdn_checkpoints: bool = False
    indexer: str = ""
    ring: str = ""
    ple: str = ""
    mtp_attention: str = ""


_M = "vllm/model_executor/models/"
_FAMILIES = (
    VllmFamily(
        "qwen3_next",
        "Qwen3NextForCausalLM",
        _M + "qwen3_next.py",
        "model.layers.{i}.self_attn.attn",
        "model.layers.{i}.linear_attn",
        gdn_checkpoints=True,
        mtp_attention="mtp.layers.{j}.self_attn.attn",
    ),
    VllmFamily(
        "qwen3_5",
        "Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration",
        _M + "qwen3_5.py",
        "language_model.model.layers.{i}.self_attn.attn",
        "language_model.model.layers.{i}.linear_attn",
        gdn_checkpoints=True,
        mtp_attention="mtp.layers.{j}.self_attn.attn",
    ),
    VllmFamily(
        "qwen3_5_text",
        "Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM",
        _M + "qwen3_5.py",
        "model.layers.{i}.self_attn.attn",
        "model.layers.{i}.linear_attn",
        gdn_checkpoints=True,
        mtp_attention="mtp.layers.{j}.self_attn.attn",
    ),
    VllmFamily(
        "nemotron_h",
        "NemotronHForCausalLM",
        _M + "nemotron_h.py",
        "model.layers.{i}.mixer.attn",
        "model.layers.{i}.mixer",
        mtp_attention="mtp.layers.{j}.mixer.attn",
    ),
    VllmFamily(
        "granitemoehybrid",
        "GraniteMoeHybridForCausalLM",
        _M + "granitemoehybrid.py",
        "model.layers.{i}.self_attn.attn",
        "model.layers.{i}.mixer",
    ),
    VllmFamily(
        "falcon_h1",
        "FalconH1ForCausalLM",
        _M + "falcon_h1.py",
        "model.layers.{i}.attn",
        "model.{n_plus_i}.mixer",
    ),
    VllmFamily(
        "jamba",
        "JambaForCausalLM",
        _M + "jamba.py",
        "model.layers.{i}.attn",
        "model.layers.{i}.mixer",
    ),
    VllmFamily(
        "kimi_linear",
        "KimiLinearForCausalLM",
        "vllm/models/kimi_k3/nvidia/model.py (+ mla.py)",
        "model.layers.{i}.self_attn",
        "model.layers.{i}.self_attn",
    ),
    VllmFamily(
        "lfm2",
        "Lfm2ForCausalLM",
        _M + "lfm2.py",
        "model.layers.{i}.self_attn.attn",
        "model.layers.{i}.short_conv",
    ),
    VllmFamily(
        "lfm2_moe",
        "Lfm2MoeForCausalLM",
        _M + "lfm2_moe.py",
        "model.layers.{i}.self_attn.attn",
        "model.layers.{i}.short_conv",
    ),
    VllmFamily(
        "zamba2",
        "Zamba2ForCausalLM",
        _M + "zamba2.py",
        "model.attn.{j}",
        "{h_plus_i}.mixer",
    ),
    VllmFamily(
        "olmo_hybrid",
        "OlmoHybridForCausalLM",
        _M + "olmo_hybrid.py",
        "model.layers.{i}.self_attn.attn",
        "model.layers.{i}.linear_attn",
    ),
    VllmFamily(
        "mamba",
        "MambaForCausalLM (FalconMambaForCausalLM)",
        _M + "mamba.py",
        "",
        "backbone.layers.{i}.mixer",
    ),
    VllmFamily("mamba2", "Mamba2ForCausalLM", _M + "mamba2.py", "", "backbone.layers.{i}.mixer"),
    # Glm5NextMLAAttention (prefix layers.{i}.self_attn) builds its Indexer first, whose
    # Glm5NextIndexerCache and Glm5NextTailCache register as indexer.k_cache and
    # indexer.tail_cache, then its MLAAttention as attn; Glm5NextLinearAttention registers the
    # KDA layer under the self_attn prefix itself
    VllmFamily(
        "glm5_next",
        "Glm5NextForConditionalGeneration",
        "vllm/models/glm5next/common/model.py (+ attention.py, kda.py)",
        "language_model.model.layers.{i}.self_attn.attn",
        "language_model.model.layers.{i}.self_attn",
        indexer="language_model.model.layers.{i}.self_attn.indexer.k_cache",
        ring="language_model.model.layers.{i}.self_attn.indexer.tail_cache",
    ),
    VllmFamily(
        "glm5_next_text",
        "Glm5NextForCausalLM",
        "vllm/models/glm5next/common/model.py (+ attention.py, kda.py)",
        "model.layers.{i}.self_attn.attn",
        "model.layers.{i}.self_attn",
        indexer="model.layers.{i}.self_attn.indexer.k_cache",
        ring="model.layers.{i}.self_attn.indexer.tail_cache",
    ),
    # Qwen4ExpDecoderLayer (prefix layers.{i}) builds its PLE module first (Qwen4ExpPLELayer,
    # registered as ple), then its mixer: QwenGatedDeltaNetAttention (linear_attn), or
    # Qwen4ExpQSAAttention (self_attn), whose QSAIndexer registers raw_key_cache and
    # compressed_key_cache before the attention registers self_attn.attn; without the
    # indexer_* fields the mixer is Qwen3NextAttention (self_attn.attn alone)
    VllmFamily(
        "qwen4_exp",
        "Qwen4ExpForConditionalGeneration",
        "vllm/models/qwen4_exp/nvidia/model.py (+ qsa.py, indexer_qsa.py, ple_layer.py, "
        "common/qsa_cache.py)",
        "language_model.model.layers.{i}.self_attn.attn",
        "language_model.model.layers.{i}.linear_attn",
        gdn_checkpoints=True,
        indexer="language_model.model.layers.{i}.self_attn.indexer.compressed_key_cache",
        ring="language_model.model.layers.{i}.self_attn.indexer.raw_key_cache",
        ple="language_model.model.layers.{i}.ple",
    ),
    VllmFamily(
        "qwen4_exp_text",
        "Qwen4ExpForCausalLM",
        "vllm/models/qwen4_exp/nvidia/model.py (+ qsa.py, indexer_qsa.py, ple_layer.py, "
        "common/qsa_cache.py)",
        "model.layers.{i}.self_attn.attn",
        "model.layers.{i}.linear_attn",
        gdn_checkpoints=True,
        indexer="model.layers.{i}.self_attn.indexer.compressed_key_cache",
        ring="model.layers.{i}.self_attn.indexer.raw_key_cache",
        ple="model.layers.{i}.ple",
    ),
)
#: vLLM's naming per family key
VLLM_FAMILIES: dict[str, VllmFamily] = {f.key: f for f in _FAMILIES}

# hybridkv family names (zoo ``family`` fields and Hugging Face model_types) -> family key
_FAMILY_KEYS = {
    "qwen3-next": "qwen3_next",
    "qwen3_next": "qwen3_next",
    "qwen3.5": "qwen3_5",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_5_text": "qwen3_5_text",
    "qwen3_5_moe_text": "qwen3_5_text",
    "nemotron-h": "nemotron_h",
    "nemotron-h (nano v2)": "nemotron_h",
    "nemotron-3 (nemotron-h moe)": "nemotron_h",
    "nemotron-3 (nemotron-h)": "nemotron_h",
    "nemotron_h": "nemotron_h",
    "granite-4.0-h": "granitemoehybrid",
    "granitemoehybrid": "granitemoehybrid",
    "falcon-h1": "falcon_h1",
    "falcon_h1": "falcon_h1",
    "jamba": "jamba",
    "kimi-linear": "kimi_linear",
    "kimi_linear": "kimi_linear",
    "lfm2": "lfm2",
    "lfm2-moe": "lfm2_moe",
    "lfm2_moe": "lfm2_moe",
    "zamba2": "zamba2",
    "olmo-hybrid": "olmo_hybrid",
    "olmo_hybrid": "olmo_hybrid",
    "mamba": "mamba",
    "falcon_mamba": "mamba",
    "mamba2": "mamba2",
    "glm5_next": "glm5_next",
    "glm5_next_text": "glm5_next_text",
    "qwen4_exp": "qwen4_exp",
    "qwen4_exp_text": "qwen4_exp_text",
}
# families vLLM 0.33 does not serve, with the reason
_REMOVED = (
    "vLLM 0.33 no longer serves {arch} (removed in vLLM 0.23.0: _PREVIOUSLY_SUPPORTED_MODELS in "
    "vllm/model_executor/models/registry.py)"
)
_NOT_SERVED = {
    "bamba": _REMOVED.format(arch="BambaForCausalLM"),
    "minimax-01": _REMOVED.format(arch="MiniMaxText01ForCausalLM / MiniMaxM1ForCausalLM"),
    "minimax_text_01": _REMOVED.format(arch="MiniMaxText01ForCausalLM"),
    "minimax_m1": _REMOVED.format(arch="MiniMaxM1ForCausalLM"),
    "minimax": _REMOVED.format(arch="MiniMaxForCausalLM"),
    "zamba": "vLLM 0.33 does not serve Zamba v1 (ZambaForCausalLM is not in its model registry)",
    "recurrentgemma (griffin)": "vLLM 0.33 does not serve RecurrentGemma (Griffin): "
    "RecurrentGemmaForCausalLM is not in its model registry",
    "recurrent_gemma": "vLLM 0.33 does not serve RecurrentGemma (Griffin): "
    "RecurrentGemmaForCausalLM is not in its model registry",
    "lfm3": "vLLM 0.33 does not serve LFM3 (Lfm3ForCausalLM is not in its model registry)",
    "bailing_hybrid": "vLLM 0.33 does not serve BailingHybridForCausalLM (its Ling hybrids are "
    "BailingMoeV2_5ForCausalLM / BailingMoeV3ForCausalLM, not modelled here)",
}
# families vLLM 0.33 serves with caches hybridkv does not model, with the reason (none at
# present: GLM-5-Next's k-pooled indexer and Qwen4-Exp's compressed QSA keys are modelled in
# vLLM's formats, VllmTarget(cache_formats="vllm"), hybridkv.layouts.vllm_packed)
_NOT_MODELLED: dict[str, str] = {}
# Zamba2's vLLM attention names depend on num_mem_blocks, which HybridModel does not record;
# the zoo's sources give it for these checkpoints
_ZAMBA2_MEM_BLOCKS = {"zamba2-1.2b": 1, "zamba2-2.7b": 2}
_TEXT_ONLY_ARCHS = {
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Glm5NextForCausalLM",
    "Qwen4ExpForCausalLM",
}
_WRAPPER_ARCHS = {
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Glm5NextForConditionalGeneration",
    "Qwen4ExpForConditionalGeneration",
}


def _architectures(model: HybridModel) -> set[str]:
    archs = model.extra.get("architectures") or ()
    if isinstance(archs, str):
        archs = (archs,)
    found = set(archs)
    # a config.json without _name_or_path is labelled by its first architecture
    found.update(n for n in (model.name, model.display_name) if n in _TEXT_ONLY_ARCHS)
    found.update(n for n in (model.name, model.display_name) if n in _WRAPPER_ARCHS)
    return found


def vllm_family(model: HybridModel) -> VllmFamily:
    """vLLM 0.33's naming for ``model``, found by ``model.family`` (a zoo family name or a
    Hugging Face ``model_type``); a family vLLM does not serve is a ``ValueError``.

    A Qwen3.5, GLM-5-Next or Qwen4-Exp config read from ``config.json`` carries its text model
    type (``qwen3_5_text``, ``glm5_next_text``, ``qwen4_exp_text``) whether or not the checkpoint
    is the multimodal wrapper; every released checkpoint of the first two is
    (``Qwen3_5ForConditionalGeneration``, ``Glm5NextForConditionalGeneration``: layers under
    ``language_model.``), and vLLM 0.33 registers Qwen4-Exp's as
    ``Qwen4ExpForConditionalGeneration``, so that is assumed unless
    ``model.extra["architectures"]`` (or the model's label) names the causal-LM class
    (``Qwen3_5ForCausalLM``, ``Glm5NextForCausalLM``, ``Qwen4ExpForCausalLM``).
    """
    family = model.family_key
    reason = _NOT_SERVED.get(family) or _NOT_MODELLED.get(family)
    if reason is not None:
        raise ValueError(f"{model.name}: cannot export a vLLM KVCacheConfig: {reason}")
    key = _FAMILY_KEYS.get(family)
    if key is None:
        known = sorted({k for k in _FAMILY_KEYS if "(" not in k})
        raise ValueError(
            f"{model.name}: no vLLM {VLLM_VERSION} layer naming for family {model.family!r}; "
            f"known families: {', '.join(known)}"
        )
    if key in ("qwen3_5_text", "glm5_next_text", "qwen4_exp_text"):
        archs = _architectures(model)
        if not archs & _TEXT_ONLY_ARCHS or archs & _WRAPPER_ARCHS:
            key = key.removesuffix("_text")
    return VLLM_FAMILIES[key]


def not_served_reason(model: HybridModel) -> str | None:
    """Why vLLM 0.33 does not serve ``model``'s family (None where it does, or the family is
    unknown here)."""
    return _NOT_SERVED.get(model.family_key)


def find_vllm_family(model: HybridModel) -> VllmFamily | None:
    """:func:`vllm_family`, or None where vLLM does not serve the family or it is unknown."""
    try:
        return vllm_family(model)
    except ValueError:
        return None
