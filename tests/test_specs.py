"""Byte formulas of every layer kind against hand-computed values (per TP rank)."""

from __future__ import annotations

import pytest

from hybridkv import models
from hybridkv.specs import (
    FullAttentionSpec,
    GatedDeltaNetSpec,
    Mamba2Spec,
    StateTensor,
    spec_from_dict,
)


def _state(name: str, **options) -> tuple[int, tuple[StateTensor, ...]]:
    spec = models.load(name, **options).state_layers[0].spec
    return spec.state_bytes, spec.state_tensors()


def _attn(name: str, **options) -> int:
    return models.load(name, **options).attention_layers[0].spec.bytes_per_token


@pytest.mark.parametrize(
    "name, options, state_bytes, per_token",
    [
        # GDN: conv (3, 2*16*128 + 32*128 = 8192) bf16 = 49,152; ssm (32, 128, 128) fp32 =
        # 2,097,152 -> 2,146,304. Attention 2 * 4 heads * 256 * 2 B = 4,096 B/token.
        pytest.param("qwen3.5-4b", {}, 2_146_304, 4096, id="gdn-qwen3.5-4b"),
        pytest.param("qwen3.5-4b", {"kv_dtype": "fp8"}, 2_146_304, 2048, id="gdn-qwen3.5-4b-fp8"),
        # Qwen3-Next, bf16 state: 49,152 + 32*128*128*2 = 1,097,728; 2*2*256*2 = 2,048 B/token
        pytest.param("qwen3-next-80b-a3b", {}, 1_097_728, 2048, id="gdn-qwen3-next-tp1"),
        # TP4: conv 3*8192/4*2 = 12,288 + 8*128*128*2 = 262,144 -> 274,432; 2 KV heads
        # replicated to one per rank: 2*1*256*2 = 1,024
        pytest.param("qwen3-next-80b-a3b", {"tp_size": 4}, 274_432, 1024, id="gdn-qwen3-next-tp4"),
        # Mamba2 Nemotron-Nano-12B-v2: conv_dim 128*80 + 2*8*128 = 12,288; conv 3*12,288*2 =
        # 73,728; ssm 128*80*128*2 = 2,621,440 -> 2,695,168 (fp32 ssm: 73,728 + 5,242,880)
        pytest.param(
            "nemotron-nano-12b-v2", {"ssm_dtype": "bfloat16"}, 2_695_168, 4096, id="mamba2-bf16"
        ),
        pytest.param(
            "nemotron-nano-12b-v2", {"ssm_dtype": "float32"}, 5_316_608, 4096, id="mamba2-fp32"
        ),
        # Granite-4.0-H-Small TP2: n_groups=1 replicated to 2: conv_dim 8192 + 2*2*128 = 8704,
        # /2 = 4352; conv 3*4352*2 = 26,112; ssm 64*64*128*2 = 1,048,576 -> 1,074,688;
        # attention 2*4*128*2 = 2,048
        pytest.param("granite-4.0-h-small", {"tp_size": 2}, 1_074_688, 2048, id="mamba2-groups"),
        # Mamba1 Jamba: d_inner 8192: conv 3*8192*2 = 49,152; ssm 8192*16*2 = 262,144
        pytest.param("jamba-1.5-mini", {}, 311_296, 2 * 8 * 128 * 2, id="mamba1-jamba"),
        # KDA Kimi-Linear: conv 3*(3*32*128)*2 = 73,728; ssm 32*128*128*4 (fp32 default) =
        # 2,097,152; MLA latent (512 + 64) * 2 = 1,152 B/token
        pytest.param("kimi-linear-48b-a3b", {}, 2_170_880, 1152, id="kda-mla-kimi"),
        # lightning attention: 64*128*128*2 = 2,097,152, no conv
        pytest.param("minimax-text-01", {}, 2_097_152, 2 * 8 * 128 * 2, id="linear-minimax"),
        # LFM2 short conv: (3-1)*2048*2 = 8,192; attention 2*8*64*2 = 2,048
        pytest.param("lfm2-1.2b", {}, 8192, 2048, id="shortconv-lfm2"),
        # RG-LRU: conv 3*2560*2 = 15,360 + recurrent 2560*4 = 10,240; SWA 2*1*256*2 = 1,024
        pytest.param("recurrentgemma-2b", {}, 25_600, 1024, id="rglru-swa-recurrentgemma"),
    ],
)
def test_bytes_match_hand_computation(name, options, state_bytes, per_token):
    assert _state(name, **options)[0] == state_bytes
    assert _attn(name, **options) == per_token


def test_vllm_state_shapes():
    _, (conv, ssm) = _state("qwen3.5-4b", tp_size=2)
    assert (conv.shape, conv.dtype) == ((3, 4096), "bfloat16")
    # vLLM >= 0.18 keeps the GDN state as (v_heads, head_v_dim, head_k_dim)
    assert (ssm.shape, ssm.dtype) == ((16, 128, 128), "float32")
    _, (conv, _) = _state("qwen3.5-4b", num_spec_tokens=2)
    assert conv.shape == (5, 8192)  # kernel - 1 + speculative tokens


def test_mamba2_tp8_with_eight_groups():
    spec = Mamba2Spec(num_heads=128, head_dim=64, n_groups=8, d_state=128, d_conv=4, tp_size=8)
    conv, ssm = spec.state_tensors()
    assert conv.shape == (3, (8192 + 2 * 8 * 128) // 8) and ssm.shape == (16, 64, 128)


@pytest.mark.parametrize(
    "build, message",
    [
        pytest.param(
            lambda: FullAttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, tp_size=3),
            "use a TP size that divides 8",
            id="tp-kv-heads",
        ),
        pytest.param(
            lambda: FullAttentionSpec(num_heads=12, num_kv_heads=4, head_dim=128, tp_size=6),
            "cannot be replicated evenly",
            id="tp-not-multiple",
        ),
        pytest.param(
            lambda: Mamba2Spec(
                num_heads=96, head_dim=64, n_groups=8, d_state=128, d_conv=4, tp_size=3
            ),
            "divides 8",
            id="mamba2-groups",
        ),
        pytest.param(
            lambda: GatedDeltaNetSpec(
                num_k_heads=16,
                num_v_heads=32,
                head_k_dim=128,
                head_v_dim=128,
                conv_kernel=4,
                ssm_dtype="fp8",
            ),
            "not a supported recurrent-state dtype",
            id="fp8-state",
        ),
        pytest.param(
            lambda: FullAttentionSpec(num_heads=8, num_kv_heads=8, head_dim=64, kv_dtype="int3"),
            "unknown kv_dtype 'int3'; use one of",
            id="unknown-dtype",
        ),
        pytest.param(lambda: spec_from_dict({"kind": "mamba3"}), "known kinds", id="unknown-kind"),
        pytest.param(
            lambda: spec_from_dict({"kind": "mamba1", "d_inner": 8}), "incomplete", id="missing"
        ),
    ],
)
def test_bad_specs_say_what_to_change(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_configure_reports_the_layer_on_tp_errors():
    with pytest.raises(ValueError, match=r"qwen3.5-4b, layer layers\.\d+\.\w+: tensor-parallel"):
        models.load("qwen3.5-4b", tp_size=3)
