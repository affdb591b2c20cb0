"""Tiny randomly initialised configs of every hybrid family transformers ships with a recurrent
or windowed cache, and of the pure-recurrent RWKV-4 and xLSTM: one layer of each kind (2-3
layers), hidden 64 (xLSTM 128), vocab 128, fp32, so that one end-to-end run takes seconds on a
CPU under the Triton interpreter.

:data:`TINY_CONFIGS` maps a family name to its config factory; :data:`SERVED` lists the families
:class:`~hybridkv.e2e.engine.Engine` serves, :data:`REFUSED` the others (the engine raises
:class:`~hybridkv.e2e.states.Unservable` for them, with the reason of
:data:`hybridkv.e2e.states.REFUSED`).
Every Mamba config keeps its chunk size at 32: transformers' torch scan pads a prefill to a
multiple of it, and the default 256 would make every short prefill a 256-token one. Zamba2,
LFM2, LFM3, RecurrentGemma and ZAYA untie their output embedding: tied and randomly initialised,
their greedy token is the last input token (ZAYA: one token) again and again, which would make
token equality a weak check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import tiny_bamba_config, tiny_qwen3_next_config

__all__ = ["REFUSED", "SERVED", "TINY_CONFIGS"]

# initializer_range 0.1, not 0.02: at 0.02 zeroing the recurrent states 48 tokens in moves
# the logits by as little as 6e-6 (LFM2), 2e-5 (Falcon-H1, Jamba's SSM), under the tests'
# tolerance, so a lost state would go unseen; at 0.1 by 0.02 or more (tests/test_e2e_families)
_COMMON: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, max_position_embeddings=512, initializer_range=0.1
)


def tiny_falcon_h1_config():
    """Falcon-H1: attention and Mamba-2 side by side in both layers."""
    from transformers import FalconH1Config

    return FalconH1Config(
        **_COMMON,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=32,
    )


def tiny_granitemoehybrid_config():
    """GraniteMoeHybrid: Mamba-2, then attention; a 4-expert MoE with a shared MLP."""
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(
        **_COMMON,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["mamba", "attention"],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
    )


def tiny_nemotron_h_config():
    """NemotronH: ``M*-`` (Mamba-2, attention, MLP)."""
    from transformers import NemotronHConfig

    return NemotronHConfig(
        **_COMMON,
        intermediate_size=128,
        num_hidden_layers=3,
        hybrid_override_pattern="M*-",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=4,
        mamba_head_dim=32,
        n_groups=1,
        ssm_state_size=16,
        conv_kernel=4,
        expand=2,
        chunk_size=32,
    )


def tiny_zamba2_config():
    """Zamba2: Mamba-2 in both layers, and both also run the one shared attention block (one
    module, two KV caches)."""
    from transformers import Zamba2Config

    return Zamba2Config(
        **_COMMON,
        intermediate_size=128,
        num_hidden_layers=2,
        layers_block_type=["hybrid", "hybrid"],
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_head_dim=32,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_ngroups=1,
        mamba_headdim=32,
        n_mamba_heads=4,
        chunk_size=32,
        num_mem_blocks=1,
        use_shared_attention_adapter=False,
        use_mem_rope=True,
        tie_word_embeddings=False,
    )


def tiny_qwen3_5_config():
    """Qwen3.5 (text): Gated DeltaNet, then gated attention."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        **_COMMON,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        full_attention_interval=2,
        # as the released Qwen3.5 configs declare (vLLM keeps the state in it): transformers'
        # torch GDN computes the state in fp32 and keeps it so, whatever the model's dtype
        mamba_ssm_dtype="float32",
    )


def tiny_jamba_config():
    """Jamba: Mamba-1, then attention with a 4-expert MoE."""
    from transformers import JambaConfig

    return JambaConfig(
        **_COMMON,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=8,
    )


def tiny_lfm2_config():
    """LFM2: a gated short conv (3 taps), then GQA attention."""
    from transformers import Lfm2Config

    return Lfm2Config(
        **_COMMON,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention"],
        conv_L_cache=3,
        tie_word_embeddings=False,
    )


def tiny_lfm3_config():
    """LFM3: a gated short conv, full attention, then sliding-window attention (window 16)."""
    from transformers import Lfm3Config

    return Lfm3Config(
        **_COMMON,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention", "sliding_attention"],
        sliding_window=16,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_recurrent_gemma_config():
    """RecurrentGemma: RG-LRU, then local attention over a 16-token window."""
    from transformers import RecurrentGemmaConfig

    return RecurrentGemmaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        lru_width=64,
        attention_window_size=16,
        conv1d_width=4,
        block_types=["recurrent", "attention"],
        tie_word_embeddings=False,
    )


def tiny_minimax_config():
    """MiniMax: lightning (linear) attention, then softmax attention; a 4-expert MoE."""
    from transformers import MiniMaxConfig

    return MiniMaxConfig(
        **_COMMON,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"],
        block_size=16,
    )


def tiny_kimi_linear_config():
    """Kimi-Linear: KDA, then MLA; dense MLPs."""
    from transformers import KimiLinearConfig

    return KimiLinearConfig(
        **_COMMON,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        linear_num_heads=4,
        linear_head_dim=16,
        num_experts=4,
        num_experts_per_token=2,
        layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "dense"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_bailing_hybrid_config():
    """Bailing hybrid (Ling 3): KDA, then MLA whose 16-dim rope part takes DeepSeek's
    interleaved rotary, with a head-wise sigmoid output gate; dense MLPs (``first_k_dense``)."""
    from transformers import BailingHybridConfig

    return BailingHybridConfig(
        **_COMMON,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        head_dim=16,
        linear_num_heads=4,
        linear_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_token=2,
        num_expert_group=1,
        topk_group=1,
        first_k_dense_replace=2,
        layer_group_size=2,
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_granite_swa_config():
    """GraniteSWA: full attention, then two sliding-window layers (window 16), all with
    learnable attention sinks (random in :func:`~hybridkv.e2e.build_tiny_model`)."""
    from transformers import GraniteSWAConfig

    return GraniteSWAConfig(
        **_COMMON,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )


def tiny_granitemoe_swa_config():
    """GraniteMoeSWA: sliding-window attention (window 16), then full attention; a 4-expert
    MoE (top 2); attention sinks as GraniteSWA."""
    from transformers import GraniteMoeSWAConfig

    return GraniteMoeSWAConfig(
        **_COMMON,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_rwkv_config():
    """RWKV-4: two layers of time-mix (WKV) and channel-mix; no attention. Its embedding and
    head are orthogonal at init (its own ``_init_weights``), untied by default."""
    from transformers import RwkvConfig

    return RwkvConfig(
        vocab_size=128,
        hidden_size=64,
        attention_hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        context_length=512,
    )


def tiny_xlstm_config():
    """xLSTM: two mLSTM blocks of 4 heads (qk head 16, v head 32; hidden 128, the smallest
    width whose qk dimension is a multiple of 64, which transformers' cache needs), chunk 16
    (a prefill of 16 tokens or more runs the chunkwise kernel, the rest the step recurrence,
    both from the state given)."""
    from transformers import xLSTMConfig

    return xLSTMConfig(
        vocab_size=128,
        hidden_size=128,
        num_hidden_layers=2,
        num_heads=4,
        chunk_size=16,
        max_inference_chunksize=512,
    )


def tiny_glm5_next_config():
    """GLM-5-Next (GLM-5.3-Flash's architecture): KDA, a NoPE MLA layer with its DSA indexer
    (k-pool 4, top-16: prompts past 16 tokens attend sparsely), an MLA layer sharing that top-k
    (no indexer cache), KDA; two residual streams, dense MLPs, a one-block vision tower (never
    run). transformers passes a top-k on only to the very next layer, so the ``shared`` layer
    follows its ``full`` one."""
    from transformers import Glm5NextConfig

    text = dict(
        **_COMMON,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=0,
        qk_nope_head_dim=16,
        v_head_dim=16,
        linear_num_heads=4,
        linear_head_dim=16,
        linear_conv_kernel_dim=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        layer_types=[
            "linear_attention",
            "indexed_attention",
            "indexed_attention",
            "linear_attention",
        ],
        indexer_types=["full", "full", "shared", "full"],
        mlp_layer_types=["dense"] * 4,
        index_topk=16,
        index_head_dim=16,
        # 16 heads: a pool scores exactly 0 (every head's ReLU zero) once in 65,536, where 4
        # heads tied pools at 0 often enough for the pick at a tie to depend on the row's length
        index_n_heads=16,
        index_kpool=4,
        hc_mult=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=32,
        out_hidden_size=64,
        projection_intermediate_size=32,
        patch_size=2,
        image_size=4,
    )
    return Glm5NextConfig(text_config=text, vision_config=vision)


def tiny_qwen4_exp_config():
    """Qwen4-Exp: GDN with a PLE module, gated GQA with its QSA indexer (compress 4, budget
    16), GDN with PLE, GQA + QSA again; two residual streams, a 4-expert MoE, PLE over 2-
    and 3-grams (dilation 3, kernel 4). Served by the engine (the QSA pick through the GQA decode
    kernel's token list; the PLE conv window in the plan's slots, the n-gram context from the
    tokens); its PLE conv weights are redrawn by :func:`build_tiny_model`, transformers starting
    them at zero."""
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        **_COMMON,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "indexed_attention"] * 2,
        hc_count=2,
        hc_lowrank=8,
        ple_layer_ids=[1, 3],
        ple_embed_dim=32,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=1000,
        split_ngram_parts=1,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=16,
        indexer_compress_ratio=4,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_inkling_config():
    """Inkling: a full-attention layer (4 heads, 2 KV heads of 16) then a sliding-window one
    (window 16) with heads of its own (4 heads, 1 KV head of 32), each with its four short
    convs (kernel 3, not the default 4, so a kernel read from the wrong field shows) and its
    relative-position bias (8 states a head, not a multiple of the kernels' 16; the full
    layer's bank 64 distances wide, so longer prompts reach past it; the sliding layer's its
    window); log scaling of the full layer's query and bias from position 4 on (off by
    default: on here so its ``tau`` is served and checked); logits not divided by 24 (see
    below); a dense MLP, then a 4-expert MoE
    with a shared expert; a one-layer vision tower and a tiny audio embedding (never run)."""
    from transformers import InklingConfig

    text = dict(
        **_COMMON,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=1,
        swa_head_dim=32,
        sliding_window_size=16,
        d_rel=8,
        rel_extent=64,
        log_scaling_n_floor=4,
        # the default 24 divides the final hidden states: logits of at most ~0.14, against
        # which the tests' 1e-4 tolerance would be loose (other families' reach ~3)
        logits_mup_width_multiplier=1.0,
        layer_types=["hybrid", "hybrid_sliding"],
        sconv_kernel_size=3,
        mlp_layer_types=["dense", "sparse"],
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        pad_token_id=0,
    )
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=2)
    audio = dict(n_mel_bins=8, mel_vocab_size=16)
    return InklingConfig(text_config=text, vision_config=vision, audio_config=audio)


def tiny_zaya_config():
    """ZAYA: CCA over full attention, then over sliding-window attention (window 16); 4 heads,
    2 KV heads of 16; conv kernels 2 and 3 (a 3-token q / k window, not the default 2, so the
    two kernels' sum shows); a 4-expert top-1 MoE. Untied output embedding (tied and random,
    its greedy tokens repeat one token)."""
    from transformers import ZayaConfig

    return ZayaConfig(
        **_COMMON,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=1,
        router_hidden_size=16,
        layer_types=["hybrid", "hybrid_sliding"],
        sliding_window=16,
        cca_time0=2,
        cca_time1=3,
        tie_word_embeddings=False,
    )


TINY_CONFIGS: dict[str, Callable[[], Any]] = {
    "bamba": tiny_bamba_config,
    "qwen3_next": tiny_qwen3_next_config,
    "falcon_h1": tiny_falcon_h1_config,
    "granitemoehybrid": tiny_granitemoehybrid_config,
    "nemotron_h": tiny_nemotron_h_config,
    "zamba2": tiny_zamba2_config,
    "qwen3_5": tiny_qwen3_5_config,
    "jamba": tiny_jamba_config,
    "lfm2": tiny_lfm2_config,
    "lfm3": tiny_lfm3_config,
    "recurrent_gemma": tiny_recurrent_gemma_config,
    "minimax": tiny_minimax_config,
    "kimi_linear": tiny_kimi_linear_config,
    "bailing_hybrid": tiny_bailing_hybrid_config,
    "granite_swa": tiny_granite_swa_config,
    "granitemoe_swa": tiny_granitemoe_swa_config,
    "rwkv": tiny_rwkv_config,
    "xlstm": tiny_xlstm_config,
    "glm5_next": tiny_glm5_next_config,
    "qwen4_exp": tiny_qwen4_exp_config,
    "inkling": tiny_inkling_config,
    "zaya": tiny_zaya_config,
}
#: families the engine refuses (:class:`hybridkv.e2e.states.Unservable`): none at present
#: (Qwen4-Exp, the last, is served)
REFUSED: tuple[str, ...] = ()
SERVED = tuple(f for f in TINY_CONFIGS if f not in REFUSED)
