"""End-to-end scaffolding: tiny randomly initialised hybrid models from transformers and their
hybridkv memory plans. Prefill attention through paged pages is in `attn.py`; decode and
state slots are not wired yet."""

from __future__ import annotations

import torch


def tiny_bamba_config():
    """A shrunk Bamba config: 2 layers (mamba, attention), hidden 64, head_dim 16, vocab 128."""
    from transformers import BambaConfig

    return BambaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        max_position_embeddings=256,
    )


def build_tiny_model(config, seed: int = 0):
    """Randomly initialised fp32 CPU causal LM for `config` (no downloads)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).float().eval()


def make_tiny_plan(config, layout: str, *, memory="4MiB", max_num_seqs: int = 4):
    """hybridkv memory plan for the tiny model's config."""
    from hybridkv.layouts import make_plan
    from hybridkv.models import from_hf_config

    d = config.to_dict()
    d["torch_dtype"] = d["dtype"] = "float32"  # else the plan assumes bf16 pages
    model = from_hf_config(d)
    return make_plan(model, layout, memory=memory, max_num_seqs=max_num_seqs, block_size=16)
