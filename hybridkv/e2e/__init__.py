"""End to end: tiny randomly initialised hybrid models from transformers served out of hybridkv
memory plans.

- :func:`tiny_bamba_config` (Mamba-2 + attention) and :func:`tiny_qwen3_next_config` (Gated
  DeltaNet + attention, small MoE): a few layers, small widths, fp32, built with a fixed seed by
  :func:`build_tiny_model` (no downloads).
- :func:`make_tiny_plan`: the model's :class:`~hybridkv.plan.MemoryPlan`, read from the HF config
  by :func:`hybridkv.models.from_hf_config`.
- :mod:`.attn`: attention through transformers' ``AttentionInterface``: K/V written into the
  plan's pages by ``write_kv_cache``, read by ``paged_prefill_attention`` or
  ``paged_decode_attention``.
- :mod:`.engine`: :class:`~.engine.Engine`, a small continuous-batching server over
  :class:`~hybridkv.alloc.HybridAllocator` (block ids, prefix hits, state checkpoints,
  preemption), with the recurrent states living in the plan's state slots; and
  :func:`~.engine.hf_greedy`, the same model run by transformers alone, as the reference.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "build_tiny_model",
    "hybrid_model_for",
    "make_tiny_plan",
    "tiny_bamba_config",
    "tiny_qwen3_next_config",
]


def tiny_bamba_config(num_layers: int = 4):
    """A shrunk Bamba config: Mamba-2 on even layers, attention on odd ones; hidden 64,
    head_dim 16, vocab 128."""
    from transformers import BambaConfig

    return BambaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=list(range(1, num_layers, 2)),
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=32,  # the default 256 pads every short prefill to 256 in the torch scan
        max_position_embeddings=512,
    )


def tiny_qwen3_next_config(num_layers: int = 4):
    """A shrunk Qwen3-Next config: Gated DeltaNet on even layers, gated attention on odd ones,
    a 4-expert MoE (top 2) with a shared expert; hidden 64, head_dim 16, vocab 128."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        full_attention_interval=2,
        max_position_embeddings=512,
    )


def build_tiny_model(config, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Randomly initialised CPU causal LM for `config` (no downloads), fp32 unless ``dtype``;
    a multimodal config with no causal-LM class (GLM-5-Next) builds its image-text-to-text
    model, whose language model runs on text alone."""
    from ..models.param_count import language_model_from_config

    torch.manual_seed(seed)
    model = language_model_from_config(config)
    with torch.no_grad():
        # transformers starts learnable attention sinks (GraniteSWA) at zero; random ones make
        # a run that ignored or misapplied them differ from transformers'. ZAYA's per-KV-head
        # key scale (qk_norm.temp) starts at zero too, which zeroes every key: attention would
        # then be a plain mean of the values, blind to the keys and queries (and so to the CCA
        # conv window that makes them). Inkling's short convs start at N(0, initializer_range)
        # beside a residual: zeroing k_sconv's state 48 tokens in then moves the logits by
        # 0.0065, under 100x the tests' tolerance; at N(0, 0.3) each of the four by 0.02+
        # Qwen4-Exp starts its PLE conv at zero, which makes the PLE conv window (a state the
        # engine hands over) change nothing: drawn at N(0, 0.3) it matters
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1] == "sinks":
                p.normal_(0.0, 2.0)
            elif name.endswith("qk_norm.temp"):
                p.normal_(0.0, 1.0)
            elif name.endswith(("sconv.conv1d.weight", "ple.conv1d.weight")):
                p.normal_(0.0, 0.3)
    return model.float().to(dtype).eval()


def hybrid_model_for(config, dtype: str = "float32"):
    """The :class:`~hybridkv.models.HybridModel` of an HF config, with ``dtype`` caches (the
    states' dtype as the config declares it: e.g. Qwen3.5's ``mamba_ssm_dtype``)."""
    from hybridkv.models import from_hf_config

    d = config.to_dict()
    d["torch_dtype"] = d["dtype"] = dtype  # else the plan assumes the config's (bf16) pages
    return from_hf_config(d)


def make_tiny_plan(
    config,
    layout: str,
    *,
    memory: int | str | None = None,
    max_num_seqs: int = 4,
    dtype: str = "float32",
    **kwargs: Any,
):
    """hybridkv memory plan for the tiny model's config (``kwargs`` go to ``make_plan``, e.g.
    ``state_slots_per_seq=2`` for prefix caching, or ``fit_tokens=N`` for the smallest plan
    that holds N tokens); 4 MiB unless ``memory`` or ``fit_tokens`` says otherwise. Block size
    16 unless the model's kernels need more (64 for MLA)."""
    from hybridkv.layouts import make_plan

    if memory is None and kwargs.get("fit_tokens") is None:
        memory = "4MiB"
    model = hybrid_model_for(config, dtype)
    kwargs.setdefault("block_size", max(16, model.kernel_alignment))  # MLA: 64
    return make_plan(model, layout, memory=memory, max_num_seqs=max_num_seqs, **kwargs)
