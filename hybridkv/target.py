"""The vLLM a plan is held to: its version and the switches that decide its block size.

``inflate`` is vLLM's own layout, so a plan of it must give the block size, state page and group
count vLLM itself would give for the same model, TP size, dtypes and switches. The rules live
here, each with the vLLM 0.33 file and function it follows:

- **Prefix caching** is on by default for generative hybrid models
  (``ModelConfig.is_prefix_caching_supported`` in ``vllm/config/model.py``, used by
  ``EngineArgs._set_default_chunked_prefill_and_prefix_caching_args``), off for attention-free
  ones. With it on, the Mamba cache runs in ``align`` mode, without it in ``none`` mode
  (``MambaModelConfig.verify_and_update_config`` in ``vllm/model_executor/models/config.py``).
- **Block size** (``Platform._align_hybrid_block_size`` in ``vllm/platforms/interface.py``): the
  alignment unit is ``max(smallest kernel block of the attention backend, block_size)``, where
  ``block_size`` is the user's ``--block-size`` or the backend's preferred 16; MLA hybrids raise it
  to 128; in ``align`` mode vLLM 0.33 takes its lcm with the Mamba layers' prefill-checkpoint
  alignment (FlashInfer's GDN prefill on Hopper: 64,
  ``FLASHINFER_GDN_CHECKPOINT_ALIGNMENT`` in ``vllm/v1/attention/backends/gdn_attn.py``;
  0.32 has no such step). The block is then the smallest multiple of the unit whose attention
  page holds one layer's state, unless the block asked for is larger already.
- **State blocks per request** (``MambaSpec.max_memory_usage_bytes`` in
  ``vllm/v1/kv_cache_interface.py``): ``1 + num_speculative_tokens`` in ``none`` mode,
  ``2 + num_speculative_tokens + num_prefill_checkpoint_blocks`` in ``align`` mode, where the
  checkpoint block is 1 for Mamba-2 (``MambaMixer2.get_kv_cache_spec``, 0.32 and 0.33) and for
  Qwen's GDN under FlashInfer's prefill (``QwenGatedDeltaNetAttention.get_kv_cache_spec``, 0.33
  only), 0 otherwise.
- **Mamba block size** (``MambaModelConfig``): the attention block size in ``align`` mode,
  ``max_model_len`` in ``none`` mode.
- **GLM-5-Next's and Kimi-Linear's KDA** (``Glm5NextLinearAttention`` in
  ``vllm/models/glm5next/common/kda.py``, ``KimiK3DeltaAttention`` in
  ``vllm/models/kimi_k3/nvidia/kda.py``): its prefill runs on FlashKDA where the resolver allows
  (SM90 and newer, bfloat16 model, KDA head dim 128, a bounded gate: :func:`kda_prefill_backend`),
  else on Triton. Under FlashKDA its ``get_kv_cache_spec`` declares one prefill checkpoint block
  at an alignment of 16 tokens (``kda_prefill_checkpoint_alignment`` in
  ``vllm/model_executor/layers/mamba/kda_checkpoint.py``) in either Mamba cache mode; it does not
  override ``get_prefill_checkpoint_alignment``, so the platform's block alignment ignores it.
- **Cache formats** (``VllmTarget.cache_formats``): where vLLM keeps a cache in another format
  than transformers (GLM-5-Next's k-pooled indexer keys and their tail ring, Qwen4-Exp's
  compressed QSA keys and their ring of raw keys; in every model, K and V side by side per
  token and head in an attention page), ``"transformers"`` (the default) plans transformers'
  format and ``"vllm"`` vLLM's, the indexer families packed as vLLM 0.33 packs them
  (:mod:`hybridkv.layouts.vllm_packed`). :mod:`hybridkv.e2e` serves both but the packed plans.

GPU families decide backends: on ``hopper`` (SM90) vLLM picks FlashAttention 3 (kernel blocks of
any multiple of 16) and FlashInfer's GDN prefill (``_resolve_gdn_prefill_backend`` in
``vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py``); on ``ampere`` (SM80)
FlashAttention 2 and the Triton GDN prefill, which exports no checkpoints. Blackwell is not
modelled: there vLLM's default attention backend is FlashInfer/FA4 with head-size dependent
pages (128 tokens for head dim 256), which these rules do not cover; pass ``kernel_block_size``
to model a backend whose kernel blocks are larger than 16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .specs import GatedDeltaNetSpec, IndexerSpec, KDASpec, Mamba2Spec, MLASpec, PLEConvSpec
from .vllm_families import find_vllm_family

if TYPE_CHECKING:  # pragma: no cover
    from .models.model import HybridModel

__all__ = [
    "CACHE_FORMATS",
    "FLASHINFER_GDN_CHECKPOINT_ALIGNMENT",
    "FLASHKDA_CHECKPOINT_ALIGNMENT",
    "GLM5_NEXT_FAMILIES",
    "GPU_FAMILIES",
    "INDEXER_KV_DTYPES",
    "MLA_HYBRID_ALIGNMENT",
    "PAGED_MQA_MIN_PAGE",
    "PAGED_MQA_PAGES",
    "QWEN4_EXP_FAMILIES",
    "VLLM_VERSIONS",
    "BlockSizeRule",
    "VllmRules",
    "VllmTarget",
    "indexer_kernel_block",
    "vllm_state_page_floor",
]

#: vLLM releases whose rules are modelled, newest first.
VLLM_VERSIONS = ("0.33", "0.32")
#: GPU family -> compute capability major*10.
GPU_FAMILIES = {"hopper": 90, "ampere": 80}
#: FlashAttention's kernel blocks are any multiple of 16 tokens
#: (``FlashAttentionBackend.get_supported_kernel_block_sizes``); vLLM's default block size is 16.
ATTENTION_KERNEL_BLOCK = 16
#: ``Platform._align_hybrid_block_size``: TRTLLM/FlashInfer MLA decode needs the number of kernel
#: blocks aligned to 128 / kernel block, so MLA hybrids make the manager block a multiple of 128.
MLA_HYBRID_ALIGNMENT = 128
#: DeepGEMM's paged MQA-logits kernels read pages of 32 or 64 cache entries
#: (``get_paged_mqa_page_sizes`` in ``vllm/utils/deep_gemm.py``; only 64 on SM120, which is not
#: modelled). GLM-5-Next's indexer stores one entry per ``index_kpool`` tokens, so its backend
#: (``Glm5NextIndexerBackend`` in ``vllm/v1/attention/backends/mla/indexer.py``) takes kernel
#: blocks of ``index_kpool`` x these, the smallest being ``32 * index_kpool`` tokens.
PAGED_MQA_PAGES = (32, 64)
PAGED_MQA_MIN_PAGE = PAGED_MQA_PAGES[0]
#: Families whose indexer runs on ``Glm5NextIndexerBackend`` (k-pooled entries): HF model types.
GLM5_NEXT_FAMILIES = frozenset({"glm5_next", "glm5_next_text"})
#: Qwen4-Exp: its QSA indexer's caches run on ``QSAStateBackend``
#: (``vllm/models/qwen4_exp/common/qsa_cache.py``), which declares no kernel block sizes
#: (``AttentionBackend``'s ``MultipleOf(1)``), so the indexer adds nothing to the block's
#: alignment; its PLE conv declares a prefill-checkpoint alignment of 1 in align mode.
QWEN4_EXP_FAMILIES = frozenset({"qwen4_exp", "qwen4_exp_text"})
#: ``vllm/v1/attention/backends/gdn_attn.py``: FlashInfer's GDN prefill emits mid-prefill states
#: every 64 tokens.
FLASHINFER_GDN_CHECKPOINT_ALIGNMENT = 64
GDN_PREFILL_BACKENDS = ("auto", "flashinfer", "triton")
MAMBA_CACHE_MODES = ("none", "align")
#: ``kda_prefill_checkpoint_alignment`` (``vllm/model_executor/layers/mamba/kda_checkpoint.py``):
#: FlashKDA's prefill emits states every 16 tokens.
FLASHKDA_CHECKPOINT_ALIGNMENT = 16
#: whose cache formats a plan lays out where transformers and vLLM differ (see the module doc)
CACHE_FORMATS = ("transformers", "vllm")
#: vLLM's ``--attention-config '{"indexer_kv_dtype": ...}'`` values Qwen4-Exp's QSA indexer takes
#: (``QSAIndexer.__init__``: "auto" is bf16; fp8 is e4m3 without scales)
INDEXER_KV_DTYPES = ("auto", "bf16", "fp8")


def indexer_kernel_block(model: HybridModel, spec: IndexerSpec) -> int:
    """The smallest kernel block, in tokens, of the vLLM 0.33 backend that reads ``spec``.

    GLM-5-Next's indexer keeps one k-pooled entry per ``pool_tokens`` (``index_kpool``) tokens
    and its backend takes ``index_kpool`` x DeepGEMM's smallest paged-MQA page
    (``Glm5NextIndexerBackend.get_supported_kernel_block_sizes``): 512 tokens for the default
    ``index_kpool`` of 16. Other indexers keep one key per token (DeepSeek-V3.2's
    ``DeepseekV32IndexerBackend``: 64), which the spec states. Qwen4-Exp's QSA caches run on
    ``QSAStateBackend``, which takes any block (1)."""
    family = model.family_key
    if family in GLM5_NEXT_FAMILIES:
        return spec.pool_tokens * PAGED_MQA_MIN_PAGE
    if family in QWEN4_EXP_FAMILIES:
        return 1
    return spec.kernel_alignment


def _text_config(model: HybridModel) -> dict[str, Any]:
    hf = model.extra.get("hf_config")
    if not isinstance(hf, dict):
        return {}
    text = hf.get("text_config")
    return text if isinstance(text, dict) else hf


def vllm_state_page_floor(model: HybridModel) -> int:
    """Bytes of a state page vLLM 0.33 sizes the block by even where no layer of the model keeps
    it: Qwen4-Exp's ``_align_hybrid_block_size`` takes the largest of
    ``Qwen4ExpForCausalLM.get_mamba_specs_from_config``, the GDN state and the PLE conv state
    (``hc_count * hidden_size`` channels, ``(ple_conv_kernel_size - 1) * ngram_size`` rows plus
    the speculative ones, in the conv dtype, whole on every rank), whether or not any layer is
    in ``ple_layer_ids``; 0 for other models (their states' own pages decide)."""
    if model.family_key not in QWEN4_EXP_FAMILIES:
        return 0
    ple = [layer.spec for layer in model.state_layers if isinstance(layer.spec, PLEConvSpec)]
    if ple:
        return max(spec.state_bytes for spec in ple)
    gdn = [layer.spec for layer in model.state_layers if isinstance(layer.spec, GatedDeltaNetSpec)]
    text = _text_config(model)
    if not gdn or "hidden_size" not in text:
        return 0
    # Qwen4ExpTextConfig's defaults where the config leaves a field out (as the reader does)
    spec = PLEConvSpec(
        conv_dim=int(text.get("hc_count") or 4) * int(text["hidden_size"]),
        conv_kernel=int(text.get("ple_conv_kernel_size") or 4),
        dilation=int(text.get("ngram_size") or 3),
        conv_dtype=gdn[0].conv_dtype,
        num_spec_tokens=gdn[0].num_spec_tokens,
    )
    return spec.state_bytes


def kda_prefill_backend(model: HybridModel, gpu: str) -> str | None:
    """The prefill backend vLLM 0.33 gives a model's KDA layers, ``"flashkda"`` or ``"triton"``
    (None for a model that is neither GLM-5-Next nor Kimi-Linear, or has no KDA layer).

    Both resolvers (``_resolve_kda_prefill_backend`` in ``vllm/models/glm5next/common/kda.py``,
    ``resolve_kda_prefill_backend`` in ``vllm/models/kimi_k3/nvidia/kda.py``, with
    ``kda_prefill_backend`` left at ``auto``) take FlashKDA on CUDA SM90/SM10x/SM12x when the
    model dtype is bfloat16, the KDA head dim is 128 and the gate is bounded. GLM-5-Next's bound
    is ``linear_lower_bound`` (transformers' default -5.0, so a config without the key has
    one); Kimi-Linear's is ``linear_attn_config.gate_lower_bound``, read with ``.get(...,
    None)``, which the released Kimi-Linear-48B-A3B config does not set (its
    ``linear_attn_config`` holds five keys), so a zoo entry without a config runs Triton; Kimi's
    resolver also needs a bf16 or fp32 recurrent state."""
    vllm = find_vllm_family(model)
    kimi = vllm is not None and vllm.key == "kimi_linear"
    if model.family_key not in GLM5_NEXT_FAMILIES and not kimi:
        return None
    kda = [layer.spec for layer in model.state_layers if isinstance(layer.spec, KDASpec)]
    if not kda:
        return None
    hf = model.extra.get("hf_config")
    text = (hf.get("text_config") or hf) if isinstance(hf, dict) else None
    if kimi:
        linear = text.get("linear_attn_config") if isinstance(text, dict) else None
        bounded = isinstance(linear, dict) and linear.get("gate_lower_bound") is not None
        bounded = bounded and model.ssm_dtype in ("bfloat16", "float32")
    else:
        bounded = not isinstance(text, dict) or text.get("linear_lower_bound", -5.0) is not None
    flashkda = (
        GPU_FAMILIES[gpu] >= 90
        and (model.dtype or "").lower() in ("bfloat16", "bf16")
        and all(spec.head_dim == 128 for spec in kda)
        and bounded
    )
    return "flashkda" if flashkda else "triton"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class VllmTarget:
    """Which vLLM a plan is compared with, and the switches of that vLLM that change its layout.

    - ``version``: ``"0.33"`` (default, the newest rules) or ``"0.32"``.
    - ``enable_prefix_caching``: vLLM's ``--enable-prefix-caching``; ``None`` takes vLLM's
      default (on for models with attention layers, off for attention-free ones).
    - ``mamba_cache_mode``: ``"align"`` or ``"none"``; ``None`` derives it from prefix caching, as
      vLLM does. vLLM ties the two (``align`` exactly when prefix caching is on), so ``"none"``
      alone means prefix caching off, and a mode that contradicts ``enable_prefix_caching`` is
      an error rather than silently overridden as vLLM would.
    - ``gpu``: ``"hopper"`` (default) or ``"ampere"``: the family whose default backends decide
      kernel alignments (FlashInfer's GDN prefill runs on Hopper only).
    - ``gdn_prefill_backend``: ``"auto"`` (the GPU's default), ``"flashinfer"`` or ``"triton"``
      (vLLM's ``--additional-config '{"gdn_prefill_backend": ...}'``).
    - ``kernel_block_size``: smallest kernel block of the attention backend (``None``: 16).
    - ``max_model_len``: vLLM's ``--max-model-len`` (``None``: the model's
      ``max_position_embeddings``); it is the Mamba block size in ``none`` mode.
    - ``cache_formats``: ``"transformers"`` (default) or ``"vllm"``: whose format a cache has
      where the two differ (GLM-5-Next's indexer keys: transformers' per-token rows, or vLLM
      0.33's k-pooled fp8 entries and per-request tail ring, which ``inflate`` then packs
      block-outermost as vLLM does; see :mod:`hybridkv.layouts.vllm_packed`). In every model
      vLLM's formats also put K and V side by side per token and head in an attention page
      (:attr:`interleaves_kv`): the same bytes and capacity, another order. Not a vLLM switch:
      vLLM always uses its own.
      Qwen4-Exp's QSA indexer is the other model with formats of its own (one compressed key per
      ``indexer_compress_ratio`` tokens and a per-request ring of raw keys).
    - ``indexer_kv_dtype``: vLLM's ``--attention-config '{"indexer_kv_dtype": ...}'``:
      ``"auto"`` (default), ``"bf16"`` or ``"fp8"``, the dtype of Qwen4-Exp's compressed QSA keys
      in vLLM's formats (``auto`` is bf16, ``fp8`` e4m3 without scales: ``QSAIndexer``).
      GLM-5-Next's indexer ignores it in vLLM 0.33, and so does a plan of it.
    - ``disable_eagle_block_drop``, ``disable_lookahead_block_hashes``: vLLM's
      ``--speculative-config`` switches of the same names (default off), which decide what MTP
      does to prefix hits (:attr:`VllmRules.hash_lookahead_tokens`); nothing without MTP.
    """

    version: str = VLLM_VERSIONS[0]
    enable_prefix_caching: bool | None = None
    mamba_cache_mode: str | None = None
    gpu: str = "hopper"
    gdn_prefill_backend: str = "auto"
    kernel_block_size: int | None = None
    max_model_len: int | None = None
    cache_formats: str = "transformers"
    indexer_kv_dtype: str = "auto"
    disable_eagle_block_drop: bool = False
    disable_lookahead_block_hashes: bool = False

    def __post_init__(self) -> None:
        for name in ("disable_eagle_block_drop", "disable_lookahead_block_hashes"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        version = str(self.version).removeprefix("v")
        if version.count(".") == 2 and version.endswith(".0"):
            version = version[:-2]
        if version not in VLLM_VERSIONS:
            raise ValueError(
                f"vllm_version {self.version!r} is not modelled; use one of "
                f"{', '.join(VLLM_VERSIONS)}"
            )
        object.__setattr__(self, "version", version)
        if self.disable_lookahead_block_hashes and version != "0.33":
            raise ValueError(
                f"disable_lookahead_block_hashes is a vLLM 0.33 switch; vLLM {version} has no "
                "lookahead hashes (it drops the last block of a hit under MTP): leave it out"
            )
        if self.enable_prefix_caching is not None and not isinstance(
            self.enable_prefix_caching, bool
        ):
            raise ValueError(
                f"enable_prefix_caching must be True, False or None (vLLM's default), got "
                f"{self.enable_prefix_caching!r}"
            )
        if self.mamba_cache_mode is not None and self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(
                f"mamba_cache_mode must be one of {', '.join(MAMBA_CACHE_MODES)}, got "
                f"{self.mamba_cache_mode!r}"
            )
        if self.mamba_cache_mode == "align" and self.enable_prefix_caching is False:
            raise ValueError(
                "mamba_cache_mode='align' needs prefix caching (vLLM resets it to 'none' without "
                "it); drop --no-enable-prefix-caching or use mamba_cache_mode='none'"
            )
        if self.gpu not in GPU_FAMILIES:
            raise ValueError(
                f"gpu {self.gpu!r} is not modelled; use one of {', '.join(GPU_FAMILIES)} "
                "(Blackwell's default backends use head-size dependent kernel blocks: pass "
                "kernel_block_size to model one)"
            )
        if self.gdn_prefill_backend not in GDN_PREFILL_BACKENDS:
            raise ValueError(
                f"gdn_prefill_backend must be one of {', '.join(GDN_PREFILL_BACKENDS)}, got "
                f"{self.gdn_prefill_backend!r}"
            )
        if self.gdn_prefill_backend == "flashinfer" and self.gpu != "hopper":
            raise ValueError(
                "FlashInfer's GDN prefill runs on Hopper (or Blackwell) only; use gpu='hopper' "
                "or gdn_prefill_backend='triton'"
            )
        if self.cache_formats not in CACHE_FORMATS:
            raise ValueError(
                f"cache_formats must be one of {', '.join(CACHE_FORMATS)}, got "
                f"{self.cache_formats!r}"
            )
        if self.indexer_kv_dtype not in INDEXER_KV_DTYPES:
            raise ValueError(
                f"indexer_kv_dtype must be one of {', '.join(INDEXER_KV_DTYPES)} (what vLLM "
                f"0.33's Qwen4-Exp QSA indexer takes), got {self.indexer_kv_dtype!r}"
            )
        for name in ("kernel_block_size", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")

    @property
    def interleaves_kv(self) -> bool:
        """An attention page holds K and V side by side per token and head, ``[tokens, heads,
        K | V]``, as vLLM 0.33's FlashAttention and Triton backends read it (logical ``[B, H, N,
        2 * head_size]``, laid out ``LBNHC``), rather than K for every token, then V: part of
        vLLM's cache formats. The bytes per page are the same either way; the kernels read
        either through the placement's strides."""
        return self.cache_formats == "vllm"

    def resolve(self, model: HybridModel) -> VllmRules:
        """The rules this vLLM applies to ``model`` (already configured for TP and dtypes)."""
        has_attention = bool(model.attention_layers)
        if self.enable_prefix_caching is not None:
            prefix_caching = self.enable_prefix_caching
        elif self.mamba_cache_mode is not None:  # "none" asks for vLLM without prefix caching
            prefix_caching = self.mamba_cache_mode == "align"
        else:
            prefix_caching = has_attention
        if prefix_caching and self.mamba_cache_mode == "none" and model.state_layers:
            raise ValueError(
                "vLLM puts the Mamba cache in align mode whenever prefix caching is on "
                "(MambaModelConfig.verify_and_update_config); for mamba_cache_mode='none' turn "
                "prefix caching off (--no-enable-prefix-caching)"
            )
        mode = "align" if prefix_caching and model.state_layers else "none"
        gdn_backend = self.gdn_prefill_backend
        if gdn_backend == "auto":
            gdn_backend = "flashinfer" if self.gpu == "hopper" else "triton"
        state_kinds = {type(layer.spec) for layer in model.state_layers}
        new_rules = self.version == "0.33"
        # get_mamba_prefill_checkpoint_alignment (vllm/model_executor/layers/mamba/abstract.py):
        # the lcm over Mamba layers, or none as soon as one layer declares none; only Qwen's GDN
        # layer class (QwenGatedDeltaNetAttention) under FlashInfer's prefill declares one (64),
        # and only in align mode; OLMo-Hybrid's GDN and Kimi's KDA use classes that do not
        family = find_vllm_family(model)
        qwen_gdn = family is not None and family.gdn_checkpoints
        gdn_exports = mode == "align" and gdn_backend == "flashinfer" and new_rules and qwen_gdn
        # Qwen4-Exp's PLE conv (Qwen4ExpPLELayer) declares 1 in align mode, so the lcm stays 64
        # and it exports its checkpoint like the GDN layers beside it
        checkpoint_alignment = (
            FLASHINFER_GDN_CHECKPOINT_ALIGNMENT
            if gdn_exports
            and GatedDeltaNetSpec in state_kinds
            and state_kinds <= {GatedDeltaNetSpec, PLEConvSpec}
            else None
        )
        # num_prefill_checkpoint_blocks: Mamba-2 layers always set 1 (MambaMixer2.
        # get_kv_cache_spec, in 0.32 and 0.33), Qwen's GDN layers (and Qwen4-Exp's PLE conv
        # beside them) when they export checkpoints (0.33 only)
        checkpoint_blocks = 0
        if Mamba2Spec in state_kinds or (
            GatedDeltaNetSpec in state_kinds and checkpoint_alignment is not None
        ):
            checkpoint_blocks = 1
        # GLM-5-Next's and Kimi-Linear's KDA layers declare one whenever their prefill runs on
        # FlashKDA (0.33)
        kda_backend = kda_prefill_backend(model, self.gpu) if new_rules else None
        if kda_backend == "flashkda":
            checkpoint_blocks = 1
        spec_blocks = model.num_spec_tokens
        # MambaSpec.max_memory_usage_bytes: the running state (and, in align mode, the previous
        # checkpoint and the prefill checkpoint) plus one block per speculative token
        state_blocks = 2 + spec_blocks + checkpoint_blocks if mode == "align" else 1 + spec_blocks
        max_len = self.max_model_len or model.max_position_embeddings
        # a sparse-attention indexer runs on a backend of its own, and vLLM rounds the block to
        # the lcm of every non-SSM backend's smallest kernel block (backend_block_alignment);
        # vLLM's default block is that lcm too (_preferred_block_size_for_backends)
        kernel_block = self.kernel_block_size or ATTENTION_KERNEL_BLOCK
        for layer in model.attention_layers:
            if isinstance(layer.spec, IndexerSpec):
                kernel_block = math.lcm(kernel_block, indexer_kernel_block(model, layer.spec))
        lookahead, block_drop = self._mtp_hit_rule(model, prefix_caching)
        return VllmRules(
            target=self,
            enable_prefix_caching=prefix_caching,
            mamba_cache_mode=mode,
            is_hybrid=model.is_hybrid,
            use_mla=any(isinstance(layer.spec, MLASpec) for layer in model.attention_layers),
            kernel_block_size=kernel_block,
            gdn_prefill_backend=gdn_backend if GatedDeltaNetSpec in state_kinds else None,
            checkpoint_alignment=checkpoint_alignment,
            num_speculative_blocks=spec_blocks,
            num_prefill_checkpoint_blocks=checkpoint_blocks,
            state_blocks_per_request=state_blocks if model.state_layers else 0,
            max_model_len=max_len,
            kda_prefill_backend=kda_backend,
            hash_lookahead_tokens=lookahead,
            eagle_block_drop=block_drop,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "vllm_version": self.version,
            "enable_prefix_caching": self.enable_prefix_caching,
            "mamba_cache_mode": self.mamba_cache_mode,
            "gpu": self.gpu,
            "gdn_prefill_backend": self.gdn_prefill_backend,
            "kernel_block_size": self.kernel_block_size,
            "max_model_len": self.max_model_len,
            "cache_formats": self.cache_formats,
            "indexer_kv_dtype": self.indexer_kv_dtype,
            "disable_eagle_block_drop": self.disable_eagle_block_drop,
            "disable_lookahead_block_hashes": self.disable_lookahead_block_hashes,
        }

    def _mtp_hit_rule(self, model: HybridModel, prefix_caching: bool) -> tuple[int, bool]:
        """``(hash_lookahead_tokens, eagle_block_drop)`` for ``model``'s speculative method.

        An MTP drafter's KV at position ``i`` is built from the target's hidden state at ``i``
        and token ``i + 1``, so a cached block's last position is valid only for a prompt that
        goes on with the same token. vLLM drops the last block of every hit unless
        ``disable_eagle_block_drop`` (``SpeculativeConfig.use_eagle_block_drop``); vLLM 0.33
        proves the token instead with lookahead hashes unless ``disable_lookahead_block_hashes``
        (``VllmConfig.num_hash_lookahead_tokens``, which then clears the drop; a KV connector
        would clear them too, and none is modelled): each hash also covers
        ``num_prefill_lookahead_tokens`` tokens after its block, ``num_speculative_tokens`` for
        multi-module MTP (``use_multi_module_mtp``: more than one MTP module and more than one
        speculative token), else 1. The module count is read as vLLM reads it: Qwen3.5's drafter
        config carries no ``num_nextn_predict_layers``, so vLLM counts 1; Qwen3-Next's and
        Nemotron-H's count is their MTP attention layers (one per module in every released
        config)."""
        if (
            model.speculative_method != "mtp"
            or not prefix_caching
            or self.disable_eagle_block_drop
        ):
            return 0, False
        if self.version != "0.33" or self.disable_lookahead_block_hashes:
            return 0, True
        family = find_vllm_family(model)
        qwen3_5 = family is not None and family.key in ("qwen3_5", "qwen3_5_text")
        modules = 1 if qwen3_5 else len(model.mtp_attention_layers)
        multi_module = min(modules, model.num_spec_tokens) > 1
        return (model.num_spec_tokens if multi_module else 1), False


@dataclass(frozen=True)
class BlockSizeRule:
    """The block size a rule produced, and the rule in words (``str()`` gives the words)."""

    block_size: int
    unit: int
    text: str

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class VllmRules:
    """A :class:`VllmTarget` resolved for one model: every switch has its final value."""

    target: VllmTarget
    enable_prefix_caching: bool
    mamba_cache_mode: str
    is_hybrid: bool
    use_mla: bool
    kernel_block_size: int
    gdn_prefill_backend: str | None
    checkpoint_alignment: int | None
    num_speculative_blocks: int
    num_prefill_checkpoint_blocks: int
    state_blocks_per_request: int
    max_model_len: int | None
    #: GLM-5-Next's KDA prefill backend (``"flashkda"`` / ``"triton"``), None for other models
    kda_prefill_backend: str | None = None
    #: tokens after each hash unit that its hash also covers (vLLM 0.33's lookahead block
    #: hashes, ``VllmConfig.num_hash_lookahead_tokens``): under MTP the drafter's KV at a
    #: unit's last position is built from the next token, so a unit is cached, and hit, only
    #: together with the tokens after it; 0 without MTP or prefix caching
    hash_lookahead_tokens: int = 0
    #: vLLM drops the last block of every prefix hit instead (vLLM 0.32's EAGLE block drop,
    #: with align's checkpoints a block earlier: ``AllocatorOptions.eagle_block_drop``)
    eagle_block_drop: bool = False

    @property
    def spec_checkpoint_alignment(self) -> int | None:
        """``MambaSpec.prefill_checkpoint_alignment`` where it does not depend on the block:
        Mamba-2's 1, GLM-5-Next's FlashKDA 16; None where it is the prefix-cache grid (Qwen's
        GDN, which needs the block) or the layers declare no checkpoint block."""
        if not self.num_prefill_checkpoint_blocks:
            return None
        if self.kda_prefill_backend == "flashkda":
            return FLASHKDA_CHECKPOINT_ALIGNMENT
        if self.checkpoint_alignment is None:  # Mamba-2 (MambaMixer2.get_kv_cache_spec)
            return 1
        return None

    def mtp_hit_rule(self) -> str:
        """What this vLLM does to prefix hits under MTP (asked only for a model that drafts with
        MTP), and whether the predictions model it; "" where there is nothing to say (no
        prefix caching)."""
        version = f"vLLM {self.target.version}"
        if self.eagle_block_drop:
            return (
                f"{version} drops the last block of every prefix hit in the drafter's group "
                "(EAGLE's block drop) and keeps align's checkpoints a block earlier "
                "(get_mamba_prefill_checkpoint_position with drop_eagle_block); modelled in "
                "these predictions (AllocatorOptions.eagle_block_drop)"
            )
        n = self.hash_lookahead_tokens
        if not n:
            if self.target.disable_eagle_block_drop and self.enable_prefix_caching:
                return (
                    f"{version} with disable_eagle_block_drop hashes plainly and reuses the "
                    "drafter's KV up to every hit (speculative acceptance may suffer, hits do not)"
                )
            return ""
        return (
            f"{version} hashes every unit together with the {n} token{'s' * (n > 1)} after it "
            "(lookahead block hashes: the drafter's KV at a unit's last position is built from "
            "the next token), so a prefix shared exactly up to a unit boundary hits one unit "
            "earlier; modelled in these predictions"
        )

    @property
    def default_block_size(self) -> int:
        """vLLM's block size before any hybrid alignment: the backend's preferred 16."""
        return max(ATTENTION_KERNEL_BLOCK, self.kernel_block_size)

    def alignment_unit(self, user_block_size: int | None) -> tuple[int, list[str]]:
        """The token unit the block must be a multiple of, and the steps that produced it
        (``Platform._align_hybrid_block_size``)."""
        block = user_block_size or self.default_block_size
        unit = max(self.kernel_block_size, block)
        why = [
            f"max(kernel block {self.kernel_block_size}, "
            f"{'--block-size' if user_block_size else 'default block'} {block}) = {unit}"
        ]
        if not self.is_hybrid:
            return unit, why
        if self.use_mla:
            unit = max(unit, MLA_HYBRID_ALIGNMENT)
            why.append(f"MLA hybrid: at least {MLA_HYBRID_ALIGNMENT}")
        if self.checkpoint_alignment is not None:
            unit = math.lcm(unit, self.checkpoint_alignment)
            why.append(
                f"align mode: lcm with the {self.gdn_prefill_backend} GDN prefill checkpoint "
                f"alignment {self.checkpoint_alignment} = {unit}"
            )
        return unit, why

    def block_size(
        self, user_block_size: int | None, page_bytes_per_token: int, state_page_bytes: int
    ) -> BlockSizeRule:
        """vLLM's block: the smallest multiple of the unit whose page of
        ``page_bytes_per_token`` bytes per token holds ``state_page_bytes``, or the requested
        block when that is larger."""
        version = f"vLLM {self.target.version}"
        block = user_block_size or self.default_block_size
        hybrid = self.is_hybrid and bool(state_page_bytes) and bool(page_bytes_per_token)
        needed = unit = 0
        why: list[str] = []
        if hybrid:
            unit, why = self.alignment_unit(user_block_size)
            needed = unit * _cdiv(state_page_bytes, unit * page_bytes_per_token)
            # vLLM then rounds to the lcm of the backends' smallest kernel blocks
            # (backend_block_alignment): the attention's and, with a sparse indexer, its own
            needed = self.kernel_block_size * _cdiv(needed, self.kernel_block_size)
        # a block the hybrid alignment raises anyway is not refused: vLLM raises a --block-size
        # that one backend (GLM-5-Next's pooled indexer: 32 x index_kpool) does not take
        if (
            user_block_size is not None
            and user_block_size % self.kernel_block_size
            and needed <= block
        ):
            lower = max(
                self.kernel_block_size,
                user_block_size // self.kernel_block_size * self.kernel_block_size,
            )
            raise ValueError(
                f"block size {user_block_size} is not a multiple of the attention kernel block "
                f"({self.kernel_block_size} tokens); use {lower} or "
                f"{lower + self.kernel_block_size}"
            )
        if not hybrid:
            what = "no recurrent state" if not state_page_bytes else "no attention layer"
            return BlockSizeRule(
                block, block, f"{version}: {block} tokens ({what}, so no hybrid alignment)"
            )
        steps = "; ".join(why)
        if needed > block:
            text = (
                f"{version} _align_hybrid_block_size: unit {unit} ({steps}); "
                f"{unit} x cdiv({state_page_bytes:,} B state, {unit} x "
                f"{page_bytes_per_token:,} B/token) = {needed} tokens"
            )
            return BlockSizeRule(needed, unit, text)
        text = (
            f"{version} _align_hybrid_block_size: the requested {block} tokens already hold "
            f"the {state_page_bytes:,} B state (unit {unit}: {steps})"
        )
        return BlockSizeRule(block, unit, text)

    def prefill_checkpoint_grid(self, block_size: int, hash_unit: int) -> int | None:
        """Token grid on which the state layers export checkpoints from inside a prefill (vLLM's
        ``MambaSpec.prefill_checkpoint_alignment``), or None when they export none and vLLM's
        scheduler splits the prefill instead (``Scheduler._mamba_block_aligned_split``).

        Mamba-2: any token (1). Qwen's GDN under FlashInfer: the prefix-cache grid
        (``get_mamba_prefill_checkpoint_grid``): the block, or ``lcm(prefix_match_unit, 64)`` when
        hits land inside a block (``hash_unit`` smaller than the block)."""
        if self.mamba_cache_mode != "align" or not self.num_prefill_checkpoint_blocks:
            return None
        if self.kda_prefill_backend == "flashkda":
            # the scheduler checks offsets against the spec's 16 (Scheduler.
            # mamba_prefill_checkpoint_alignment) at hash-block-aligned positions
            unit = hash_unit if hash_unit < block_size else block_size
            return math.lcm(unit, FLASHKDA_CHECKPOINT_ALIGNMENT)
        if self.checkpoint_alignment is None:  # Mamba-2 (MambaMixer2.get_kv_cache_spec)
            return 1
        if hash_unit < block_size:
            return math.lcm(hash_unit, self.checkpoint_alignment)
        # vLLM's blocks are multiples of the alignment already; a layout with smaller blocks
        # (per_group) still gets states only where FlashInfer emits them
        return math.lcm(block_size, self.checkpoint_alignment)

    @property
    def mamba_block_size(self) -> int | None:
        """Tokens one state block stands for in vLLM: the block size in ``align`` mode (set by
        the plan), ``max_model_len`` in ``none`` mode."""
        return None if self.mamba_cache_mode == "align" else self.max_model_len

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.target.to_dict(),
            "resolved": {
                "enable_prefix_caching": self.enable_prefix_caching,
                "mamba_cache_mode": self.mamba_cache_mode,
                "kernel_block_size": self.kernel_block_size,
                "gdn_prefill_backend": self.gdn_prefill_backend,
                "prefill_checkpoint_alignment": self.checkpoint_alignment,
                "num_speculative_blocks": self.num_speculative_blocks,
                "num_prefill_checkpoint_blocks": self.num_prefill_checkpoint_blocks,
                "state_blocks_per_request": self.state_blocks_per_request,
                "max_model_len": self.max_model_len,
                "kda_prefill_backend": self.kda_prefill_backend,
            },
        }
