"""Byte formulas of every layer kind against hand-computed values (per TP rank).

Every expected number below is worked out by hand in its comment from the model's config
numbers (vLLM shapes: conv states keep ``kernel - 1`` columns; bf16 = 2 B, fp32 = 4 B,
fp8 = 1 B), so a wrong formula cannot agree with itself.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from hybridkv import models
from hybridkv.specs import (
    SPEC_KINDS,
    CCAStateSpec,
    FullAttentionSpec,
    GatedDeltaNetSpec,
    IndexerSpec,
    InklingConvSpec,
    KDASpec,
    LinearAttentionSpec,
    Mamba1Spec,
    Mamba2Spec,
    MLASpec,
    MLSTMSpec,
    PLEConvSpec,
    RGLRUSpec,
    RWKV4Spec,
    ShortConvSpec,
    SlidingWindowSpec,
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
        # speculative decoding lengthens the conv state: (3 + 2, 8192) * 2 = 81,920
        # + 1,048,576 = 1,130,496
        pytest.param(
            "qwen3-next-80b-a3b", {"num_spec_tokens": 2}, 1_130_496, 2048, id="gdn-spec-tokens"
        ),
        # Qwen3.5-397B TP2, fp8 KV: conv_dim 2*16*128 + 64*128 = 12,288 -> 6,144 per rank,
        # 3*6,144*2 = 36,864; ssm 32*128*128*4 = 2,097,152 -> 2,134,016; 2*1*256*1 = 512
        pytest.param(
            "qwen3.5-397b-a17b",
            {"tp_size": 2, "kv_dtype": "fp8"},
            2_134_016,
            512,
            id="gdn-qwen3.5-397b-tp2-fp8",
        ),
        # Mamba2 Nemotron-Nano-12B-v2: conv_dim 128*80 + 2*8*128 = 12,288; conv 3*12,288*2 =
        # 73,728; ssm 128*80*128*2 = 2,621,440 -> 2,695,168 (fp32 ssm: 73,728 + 5,242,880)
        pytest.param(
            "nemotron-nano-12b-v2", {"ssm_dtype": "bfloat16"}, 2_695_168, 4096, id="mamba2-bf16"
        ),
        pytest.param(
            "nemotron-nano-12b-v2", {"ssm_dtype": "float32"}, 5_316_608, 4096, id="mamba2-fp32"
        ),
        # Granite-4.0-H-Small TP1: conv_dim 128*64 + 2*1*128 = 8,448; conv 3*8,448*2 = 50,688;
        # ssm 128*64*128*2 = 2,097,152 -> 2,147,840; attention 2*8*128*2 = 4,096
        pytest.param("granite-4.0-h-small", {}, 2_147_840, 4096, id="mamba2-granite-tp1"),
        # TP2: n_groups=1 replicated to 2: conv_dim 8192 + 2*2*128 = 8704, /2 = 4352;
        # conv 3*4352*2 = 26,112; ssm 64*64*128*2 = 1,048,576 -> 1,074,688; 2*4*128*2 = 2,048
        pytest.param("granite-4.0-h-small", {"tp_size": 2}, 1_074_688, 2048, id="mamba2-groups"),
        # Nemotron-H-8B TP8, n_groups=8 split one per rank: conv_dim 8192 + 2*8*128 = 10,240,
        # /8 = 1,280; conv 3*1,280*2 = 7,680; ssm (float32, vLLM's NemotronH default)
        # 16*64*128*4 = 524,288 -> 531,968; attention 8 KV heads / 8 = 1: 2*1*128*2 = 512
        pytest.param("nemotron-h-8b", {"tp_size": 8}, 531_968, 512, id="mamba2-tp8-8-groups"),
        # Falcon-H1-34B TP2, n_groups=2 split: conv_dim 32*128 + 2*2*256 = 5,120, /2 = 2,560;
        # conv 3*2,560*2 = 15,360; ssm 16*128*256*2 = 1,048,576 -> 1,063,936; 2*2*128*2 = 1,024
        pytest.param("falcon-h1-34b", {"tp_size": 2}, 1_063_936, 1024, id="mamba2-falcon-tp2"),
        # Zamba2-2.7B: conv_dim 80*64 + 2*1*64 = 5,248; conv 3*5,248*2 = 31,488; ssm
        # 80*64*64*2 = 655,360 -> 686,848; shared attention is MHA: 2*32*160*2 = 20,480
        pytest.param("zamba2-2.7b", {}, 686_848, 20_480, id="mamba2-zamba2"),
        # Mamba1 Jamba: d_inner 2*4096 = 8,192: conv 3*8192*2 = 49,152; ssm 8192*16*2 = 262,144
        # -> 311,296; attention 2*8*128*2 = 4,096
        pytest.param("jamba-1.5-mini", {}, 311_296, 4096, id="mamba1-jamba"),
        # TP2: d_inner 4,096 per rank: 3*4096*2 = 24,576 + 4096*16*2 = 131,072 -> 155,648;
        # 2*4*128*2 = 2,048
        pytest.param("jamba-1.5-mini", {"tp_size": 2}, 155_648, 2048, id="mamba1-jamba-tp2"),
        # KDA Kimi-Linear: conv 3*(3*32*128)*2 = 73,728; ssm 32*128*128*4 (fp32 default) =
        # 2,097,152 -> 2,170,880; MLA latent (512 + 64) * 2 = 1,152 B/token
        pytest.param("kimi-linear-48b-a3b", {}, 2_170_880, 1152, id="kda-mla-kimi"),
        # TP4: conv 3*(12,288/4)*2 = 18,432; ssm 8*128*128*4 = 524,288 -> 542,720; the MLA
        # latent is not split by TP: still 1,152; fp8 KV: 576
        pytest.param(
            "kimi-linear-48b-a3b",
            {"tp_size": 4, "kv_dtype": "fp8"},
            542_720,
            576,
            id="kda-mla-kimi-tp4-fp8",
        ),
        # lightning attention: 64*128*128*2 = 2,097,152, no conv; attention 2*8*128*2 = 4,096
        pytest.param("minimax-text-01", {}, 2_097_152, 4096, id="linear-minimax"),
        # TP8: 8*128*128*2 = 262,144; 8 KV heads / 8: 2*1*128*2 = 512
        pytest.param("minimax-text-01", {"tp_size": 8}, 262_144, 512, id="linear-minimax-tp8"),
        # LFM2 short conv: (3-1)*2048*2 = 8,192; attention 2*8*64*2 = 2,048
        pytest.param("lfm2-1.2b", {}, 8192, 2048, id="shortconv-lfm2"),
        # TP2: 2*1024*2 = 4,096; 2*4*64*2 = 1,024
        pytest.param("lfm2-1.2b", {"tp_size": 2}, 4096, 1024, id="shortconv-lfm2-tp2"),
        # RG-LRU: conv 3*2560*2 = 15,360 + recurrent 2560*4 = 10,240; SWA 2*1*256*2 = 1,024
        pytest.param("recurrentgemma-2b", {}, 25_600, 1024, id="rglru-swa-recurrentgemma"),
        # bf16 recurrent vector: 15,360 + 2560*2 = 20,480
        pytest.param(
            "recurrentgemma-2b", {"ssm_dtype": "bf16"}, 20_480, 1024, id="rglru-bf16-state"
        ),
    ],
)
def test_bytes_match_hand_computation(name, options, state_bytes, per_token):
    assert _state(name, **options)[0] == state_bytes
    assert _attn(name, **options) == per_token


@pytest.mark.parametrize(
    "name, kv_per_token, state_per_seq",
    [
        # 8 attention layers * 4,096 = 32,768; 24 GDN layers * 2,146,304 = 51,511,296
        pytest.param("qwen3.5-4b", 32_768, 51_511_296, id="qwen3.5-4b"),
        # Falcon-H1-7B: all 44 layers hold both. KV 44 * 2*2*128*2 = 45,056; state per layer
        # conv 3*(3072 + 2*256)*2 = 21,504 + ssm 24*128*256*2 = 1,572,864 = 1,594,368; *44 =
        # 70,152,192
        pytest.param("falcon-h1-7b", 45_056, 70_152_192, id="falcon-h1-7b-parallel"),
        # Zamba2-2.7B: 9 shared-attention layers * 20,480 = 184,320; 54 Mamba-2 * 686,848 =
        # 37,089,792
        pytest.param("zamba2-2.7b", 184_320, 37_089_792, id="zamba2-2.7b"),
        # Nemotron-H-8B: 4 attention layers * 4,096 = 16,384; 24 Mamba-2 layers (float32 ssm)
        # * (3*10,240*2 = 61,440 + 128*64*128*4 = 4,194,304) = 24 * 4,255,744 = 102,137,856;
        # the 24 MLP-only layers hold nothing
        pytest.param("nemotron-h-8b", 16_384, 102_137_856, id="nemotron-h-8b-mlp-layers"),
    ],
)
def test_whole_model_totals(name, kv_per_token, state_per_seq):
    model = models.load(name)
    assert model.kv_bytes_per_token == kv_per_token
    assert model.state_bytes_per_seq == state_per_seq


# vllm-hybrid-kv-facts.md §1.7: Pm (one layer's state), attn1 (one token, one layer), the block
# size of vLLM v0.11/v0.18 (kernel_align 16: 16 * cdiv(Pm, 16 * attn1)) and the page padding.
@pytest.mark.parametrize(
    "name, options, pm, attn1, block, padding_pct",
    [
        pytest.param("qwen3-next-80b-a3b", {}, 1_097_728, 2048, 544, 1.49, id="qwen3-next-tp1"),
        pytest.param(
            "qwen3-next-80b-a3b", {"tp_size": 4}, 274_432, 1024, 272, 1.49, id="qwen3-next-tp4"
        ),
        # matches vLLM issue #40696 (only with the fp32 SSM state of mamba_ssm_dtype)
        pytest.param("qwen3.5-4b", {}, 2_146_304, 4096, 528, 0.76, id="qwen3.5-4b"),
        # §1.4: fp8 KV halves attn1 and doubles the block
        pytest.param("qwen3.5-4b", {"kv_dtype": "fp8"}, 2_146_304, 2048, 1056, 0.76, id="fp8"),
        # "Qwen3.6-35B-A3B-like": now its real config; matches the PR #35703 table
        pytest.param("qwen3.6-35b-a3b", {}, 2_146_304, 2048, 1056, None, id="qwen3.6-35b-a3b"),
        pytest.param(
            "nemotron-nano-12b-v2",
            {"ssm_dtype": "bfloat16"},
            2_695_168,
            4096,
            672,
            2.1,
            id="nemotron-nano-12b-v2-bf16",
        ),
        pytest.param(
            "nemotron-nano-12b-v2",
            {"ssm_dtype": "float32"},
            5_316_608,
            4096,
            1312,
            1.1,
            id="nemotron-nano-12b-v2-fp32",
        ),
    ],
)
def test_vllm_facts_worked_examples(name, options, pm, attn1, block, padding_pct):
    model = models.load(name, **options)
    assert {layer.spec.state_bytes for layer in model.state_layers} == {pm}
    assert {layer.spec.page_bytes(1) for layer in model.attention_layers} == {attn1}
    assert 16 * math.ceil(pm / (16 * attn1)) == block
    if padding_pct is not None:  # the table rounds to one or two decimals
        padding = 100 * (block * attn1 - pm) / pm
        assert padding == pytest.approx(padding_pct, abs=0.05)


def test_vllm_state_shapes():
    """Shapes follow vLLM's MambaStateShapeCalculator (conv layout (kernel - 1, dim))."""

    def shapes(name, **options):
        spec = models.load(name, **options).state_layers[0].spec
        return [(t.name, t.shape, t.dtype) for t in spec.state_tensors()]

    # vLLM >= 0.18 keeps the GDN state as (v_heads, head_v_dim, head_k_dim)
    assert shapes("qwen3.5-4b", tp_size=2) == [
        ("conv", (3, 4096), "bfloat16"),
        ("ssm", (16, 128, 128), "float32"),
    ]
    assert shapes("qwen3.5-4b", num_spec_tokens=2)[0][1] == (5, 8192)  # kernel - 1 + spec
    # vLLM's mamba1_state_shape takes no num_spec: Mamba-1 conv states keep kernel - 1 rows
    assert shapes("jamba-1.5-mini", num_spec_tokens=2)[0][1] == (3, 8192)
    assert shapes("nemotron-h-8b", num_spec_tokens=2)[0][1][0] == 3 + 2  # Mamba-2 does grow
    assert shapes("jamba-1.5-mini") == [
        ("conv", (3, 8192), "bfloat16"),
        ("ssm", (8192, 16), "bfloat16"),
    ]
    assert shapes("nemotron-nano-12b-v2") == [
        ("conv", (3, 12288), "bfloat16"),
        ("ssm", (128, 80, 128), "float32"),  # vLLM's NemotronH default
    ]
    # KDA: one fused q/k/v conv state (vLLM >= 0.33), fp32 recurrent state by default
    assert shapes("kimi-linear-48b-a3b") == [
        ("conv", (3, 12288), "bfloat16"),
        ("ssm", (32, 128, 128), "float32"),
    ]
    # linear attention and short conv hold a single tensor in the conv (mamba_cache) dtype
    assert shapes("minimax-text-01", conv_dtype="float16") == [("ssm", (64, 128, 128), "float16")]
    assert shapes("lfm2-350m") == [("conv", (2, 1024), "bfloat16")]
    assert shapes("recurrentgemma-9b") == [
        ("conv", (3, 4096), "bfloat16"),
        ("ssm", (4096,), "float32"),
    ]


def test_mamba2_tp8_with_eight_groups():
    spec = Mamba2Spec(num_heads=128, head_dim=64, n_groups=8, d_state=128, d_conv=4, tp_size=8)
    conv, ssm = spec.state_tensors()
    # (8192 + 2*8*128) / 8 = 1,280 columns; no replication needed
    assert spec.padded_groups == 8
    assert conv.shape == (3, 1280) and ssm.shape == (16, 64, 128)


def test_one_group_is_replicated_to_every_rank():
    spec = Mamba2Spec(num_heads=128, head_dim=64, n_groups=1, d_state=128, d_conv=4, tp_size=4)
    # vLLM's extra_groups_for_head_shards: 1 + (4 - 1) = 4 groups, one per rank:
    # (8192 + 2*4*128) / 4 = 2,304 columns
    assert spec.padded_groups == 4
    assert spec.state_tensors()[0].shape == (3, 2304)


def test_attention_paging_and_alignment():
    gqa = FullAttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128)
    assert gqa.page_bytes(16) == 16 * 2 * 8 * 128 * 2  # 65,536
    assert gqa.kernel_alignment == 16
    mla = MLASpec(num_heads=32, kv_lora_rank=512, qk_rope_head_dim=64)
    assert mla.page_bytes(64) == 64 * 576 * 2 and mla.kernel_alignment == 64
    swa = SlidingWindowSpec(num_heads=10, num_kv_heads=1, head_dim=256, sliding_window=2048)
    assert swa.bytes_per_token == 2 * 256 * 2 and swa.sliding_window == 2048
    # an explicit V head size (MLA-free models with K != V)
    assert (
        FullAttentionSpec(num_heads=8, num_kv_heads=8, head_dim=192, head_dim_v=128).page_bytes(1)
        == 8 * (192 + 128) * 2
    )
    # more ranks than KV heads: one replicated head per rank
    assert (
        FullAttentionSpec(num_heads=16, num_kv_heads=2, head_dim=256, tp_size=8).kv_heads_per_rank
        == 1
    )


SPECS = [
    FullAttentionSpec(num_heads=16, num_kv_heads=4, head_dim=256),
    SlidingWindowSpec(num_heads=10, num_kv_heads=1, head_dim=256, sliding_window=2048),
    MLASpec(num_heads=32, kv_lora_rank=512, qk_rope_head_dim=64),
    Mamba1Spec(d_inner=8192, d_state=16, d_conv=4),
    Mamba2Spec(num_heads=128, head_dim=64, n_groups=8, d_state=128, d_conv=4),
    GatedDeltaNetSpec(
        num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4
    ),
    KDASpec(num_heads=32, head_dim=128, conv_kernel=4),
    LinearAttentionSpec(num_heads=64, head_dim=128),
    ShortConvSpec(conv_dim=2048, conv_kernel=3),
    RGLRUSpec(lru_width=2560, conv_kernel=4),
    RWKV4Spec(hidden_size=768, attention_hidden_size=768),
    MLSTMSpec(num_heads=8, qk_head_dim=256, v_head_dim=512),
    IndexerSpec(index_head_dim=128, side_channels=129),
    PLEConvSpec(conv_dim=8192, conv_kernel=4, dilation=3),
    InklingConvSpec(num_kv_heads=8, head_dim=128, hidden_size=6144, conv_kernel=4),
    CCAStateSpec(num_heads=8, num_kv_heads=2, head_dim=128, time0=2, time1=2),
]


def test_every_kind_has_a_spec_here():
    assert {s.kind for s in SPECS} == set(SPEC_KINDS)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_spec_dict_round_trip(spec):
    data = spec.to_dict()
    assert data["kind"] == spec.kind
    # runtime options are not architecture: they stay out of the zoo form
    assert not {"tp_size", "kv_dtype", "conv_dtype", "ssm_dtype", "num_spec_tokens"} & set(data)
    assert spec_from_dict(data) == spec
    again = spec_from_dict(data, tp_size=2, kv_dtype="fp8", ssm_dtype="float32")
    assert again.tp_size == 2
    if spec.is_attention:
        assert again.kv_dtype == "fp8_e4m3"
    else:
        assert again.ssm_dtype == "float32"


@pytest.mark.parametrize(
    "build, message",
    [
        pytest.param(
            lambda: FullAttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, tp_size=3),
            "tensor-parallel size 3 does not divide num_kv_heads=8; use a TP size that divides 8",
            id="tp-kv-heads",
        ),
        pytest.param(
            lambda: FullAttentionSpec(num_heads=12, num_kv_heads=4, head_dim=128, tp_size=6),
            "cannot be replicated evenly; use a TP size that divides 4 or a multiple of 4",
            id="tp-not-multiple",
        ),
        pytest.param(
            lambda: FullAttentionSpec(num_heads=12, num_kv_heads=8, head_dim=128),
            "not a multiple of num_kv_heads=8",
            id="gqa-groups",
        ),
        pytest.param(
            lambda: Mamba2Spec(
                num_heads=96, head_dim=64, n_groups=8, d_state=128, d_conv=4, tp_size=3
            ),
            "use a TP size that divides 8",
            id="mamba2-groups-tp3",
        ),
        pytest.param(
            # vLLM's MambaMixer2 replicates only n_groups == 1 (Falcon-H1-34B at TP4)
            lambda: Mamba2Spec(
                num_heads=32, head_dim=128, n_groups=2, d_state=256, d_conv=4, tp_size=4
            ),
            "only a single group can be replicated.*use a TP size that divides 2",
            id="mamba2-two-groups-tp4",
        ),
        pytest.param(
            lambda: Mamba2Spec(
                num_heads=24, head_dim=64, n_groups=1, d_state=128, d_conv=4, tp_size=16
            ),
            "does not divide mamba num_heads=24; use a TP size that divides the heads",
            id="mamba2-heads",
        ),
        pytest.param(
            lambda: GatedDeltaNetSpec(
                num_k_heads=16,
                num_v_heads=32,
                head_k_dim=128,
                head_v_dim=128,
                conv_kernel=4,
                tp_size=32,
            ),
            "linear_num_key_heads=16; use a TP size that divides both",
            id="gdn-k-heads",
        ),
        pytest.param(
            lambda: MLASpec(num_heads=32, kv_lora_rank=512, qk_rope_head_dim=64, tp_size=3),
            "use a TP size that divides the heads",
            id="mla-heads",
        ),
        pytest.param(
            lambda: MLASpec(num_heads=32, kv_lora_rank=512, qk_rope_head_dim=-1),
            r"MLASpec.qk_rope_head_dim must be an integer >= 0, got -1",
            id="mla-rope",
        ),
        pytest.param(
            lambda: IndexerSpec(index_head_dim=0),
            r"IndexerSpec.index_head_dim must be a positive integer, got 0",
            id="indexer-dim",
        ),
        pytest.param(
            lambda: IndexerSpec(index_head_dim=128, side_channels=-1),
            r"IndexerSpec.side_channels must be an integer >= 0, got -1",
            id="indexer-side",
        ),
        pytest.param(
            lambda: PLEConvSpec(conv_dim=8192, conv_kernel=4, dilation=0),
            r"PLEConvSpec.dilation must be a positive integer, got 0",
            id="ple-dilation",
        ),
        pytest.param(
            lambda: KDASpec(num_heads=32, head_dim=128, conv_kernel=4, tp_size=3),
            "KDA num_heads=32; use a TP size that divides it",
            id="kda-heads",
        ),
        pytest.param(
            lambda: Mamba1Spec(d_inner=8192, d_state=16, d_conv=4, tp_size=3),
            "d_inner=8192; use a TP size that divides d_inner",
            id="mamba1-d-inner",
        ),
        pytest.param(
            lambda: ShortConvSpec(conv_dim=1536, conv_kernel=3, tp_size=5),
            "conv_dim=1536; use a TP size that divides it",
            id="short-conv",
        ),
        pytest.param(
            lambda: RGLRUSpec(lru_width=2560, conv_kernel=4, tp_size=3),
            "lru_width=2560; use a TP size that divides it",
            id="rglru-width",
        ),
        pytest.param(
            lambda: RWKV4Spec(hidden_size=768, attention_hidden_size=768, tp_size=5),
            "attention_hidden_size=768; use a TP size that divides it",
            id="rwkv4-channels",
        ),
        pytest.param(
            lambda: MLSTMSpec(num_heads=8, qk_head_dim=256, v_head_dim=512, tp_size=3),
            "mLSTM num_heads=8; use a TP size that divides it",
            id="mlstm-heads",
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
            "'fp8_e4m3' is not a supported recurrent-state dtype; use one of float32, bfloat16",
            id="fp8-state",
        ),
        pytest.param(
            lambda: ShortConvSpec(conv_dim=2048, conv_kernel=3, conv_dtype="fp8_e5m2"),
            "conv_dtype='fp8_e5m2' is not a supported recurrent-state dtype; use one of",
            id="fp8-conv-state",
        ),
        pytest.param(
            lambda: FullAttentionSpec(num_heads=8, num_kv_heads=8, head_dim=64, kv_dtype="int3"),
            "unknown kv_dtype 'int3'; use one of",
            id="unknown-dtype",
        ),
        pytest.param(
            lambda: FullAttentionSpec(num_heads=8, num_kv_heads=8, head_dim=64, kv_dtype="auto"),
            "needs a model dtype",
            id="auto-without-model",
        ),
        pytest.param(
            lambda: FullAttentionSpec(num_heads=8, num_kv_heads=8, head_dim=0),
            "head_dim must be a positive integer, got 0",
            id="zero-dim",
        ),
        pytest.param(
            lambda: Mamba2Spec(num_heads=8, head_dim=64, n_groups=1, d_state=16.0, d_conv=4),
            "d_state must be a positive integer, got 16.0",
            id="float-dim",
        ),
        pytest.param(
            lambda: KDASpec(num_heads=8, head_dim=64, conv_kernel=4, num_spec_tokens=-1),
            "num_spec_tokens must be >= 0",
            id="negative-spec-tokens",
        ),
        pytest.param(lambda: spec_from_dict({"kind": "mamba3"}), "known kinds", id="unknown-kind"),
        pytest.param(
            lambda: spec_from_dict({"kind": "mamba1", "d_inner": 8}), "incomplete", id="missing"
        ),
        pytest.param(
            lambda: spec_from_dict({"kind": "kda", "num_heads": 8, "head_dim": 8, "dk": 1}),
            r"unknown fields \['dk'\]",
            id="unknown-field",
        ),
    ],
)
def test_bad_specs_say_what_to_change(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize(
    "name, options, message",
    [
        pytest.param(
            "qwen3.5-4b",
            {"tp_size": 3},
            r"qwen3.5-4b, layer layers\.\d+\.\w+: tensor-parallel size 3",
            id="layer-named",
        ),
        pytest.param(
            "falcon-h1-34b",
            {"tp_size": 4},
            "n_groups=2, and only a single group can be replicated",
            id="falcon-h1-34b-tp4",
        ),
        pytest.param("qwen3.5-4b", {"tp_size": 0}, "tp_size must be a positive integer", id="tp0"),
        pytest.param("qwen3.5-4b", {"kv_dtype": "int4"}, "unknown kv_dtype 'int4'", id="kv-int4"),
        pytest.param(
            "qwen3.5-4b",
            {"ssm_dtype": "fp8"},
            "ssm_dtype='fp8_e4m3' is not a supported recurrent-state dtype; use one of",
            id="fp8-ssm",
        ),
        pytest.param(
            "nemotron-h-8b",
            {"conv_dtype": "fp8"},
            "conv_dtype='fp8_e4m3' is not a supported recurrent-state dtype",
            id="fp8-conv",
        ),
    ],
)
def test_configure_errors_say_what_to_change(name, options, message):
    with pytest.raises(ValueError, match=message):
        models.load(name, **options)


def test_rwkv4_state_by_hand():
    """RWKV-4 with hidden 768: two token-shift vectors of 768 in bf16 = 2 * 768 * 2 = 3,072 B
    and the WKV num / den / max of 768 channels in fp32 = 768 * 3 * 4 = 9,216 B, 12,288 B per
    layer. TP 2 splits the WKV channels (384 * 3 * 4 = 4,608 B) and replicates the shifts
    (3,072 B): 7,680 B per rank."""
    spec = RWKV4Spec(hidden_size=768, attention_hidden_size=768, ssm_dtype="float32")
    assert [(t.name, t.shape, t.dtype) for t in spec.state_tensors()] == [
        ("shift", (2, 768), "bfloat16"),
        ("wkv", (768, 3), "float32"),
    ]
    assert spec.state_bytes == 12_288
    assert (
        RWKV4Spec(
            hidden_size=768, attention_hidden_size=768, ssm_dtype="float32", tp_size=2
        ).state_bytes
        == 7_680
    )
    # a model read from a config keeps the WKV state in float32 unless told otherwise
    model = models.from_hf_config(
        {
            "model_type": "rwkv",
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "torch_dtype": "bfloat16",
        }
    )
    assert model.layer_kinds == {"rwkv4": 12} and model.state_bytes_per_seq == 12 * 12_288
    assert models.from_hf_config(
        {"model_type": "rwkv", "hidden_size": 768, "num_hidden_layers": 12}, ssm_dtype="bf16"
    ).state_bytes_per_seq == 12 * (3_072 + 768 * 3 * 2)


def test_mlstm_state_by_hand():
    """xLSTM's mLSTM cell with 8 heads, qk head 256, v head 512 (hidden 4096 with transformers'
    default factors 0.5 and 1.0): C 8 * 256 * 512 = 1,048,576, n 8 * 256 = 2,048, m 8 elements,
    1,050,632 in all; 2,101,264 B in bf16, 4,202,528 B in fp32. TP 2 halves the heads:
    525,316 elements, 1,050,632 B in bf16."""
    spec = MLSTMSpec(num_heads=8, qk_head_dim=256, v_head_dim=512)
    assert [(t.name, t.shape, t.dtype) for t in spec.state_tensors()] == [
        ("C", (8, 256, 512), "bfloat16"),
        ("n", (8, 256), "bfloat16"),
        ("m", (8, 1), "bfloat16"),
    ]
    assert spec.state_bytes == 2_101_264
    assert MLSTMSpec(
        num_heads=8, qk_head_dim=256, v_head_dim=512, ssm_dtype="fp32"
    ).state_bytes == (4_202_528)
    assert MLSTMSpec(num_heads=8, qk_head_dim=256, v_head_dim=512, tp_size=2).state_bytes == (
        1_050_632
    )
    model = models.from_hf_config(
        {
            "model_type": "xlstm",
            "num_blocks": 32,
            "embedding_dim": 4096,
            "num_heads": 8,
            "torch_dtype": "bfloat16",
        }
    )
    assert model.layer_kinds == {"mlstm": 32} and model.state_bytes_per_seq == 32 * 2_101_264


def test_nope_mla_latent_by_hand():
    """GLM-5-Next's MLA has no rope part (qk_rope_head_dim 0): the latent is kv_lora_rank 512
    alone, 512 * 2 = 1,024 B per token in bf16, 512 B in fp8, whatever the TP size."""
    spec = MLASpec(num_heads=64, kv_lora_rank=512, qk_rope_head_dim=0)
    assert spec.latent_dim == 512 and spec.bytes_per_token == 1_024
    assert (
        MLASpec(num_heads=64, kv_lora_rank=512, qk_rope_head_dim=0, kv_dtype="fp8").bytes_per_token
        == 512
    )
    assert (
        MLASpec(num_heads=64, kv_lora_rank=512, qk_rope_head_dim=0, tp_size=8).bytes_per_token
        == 1_024
    )


def test_indexer_keys_by_hand():
    """An indexer key of 128: Qwen4-Exp's raw key in bf16 is 128 * 2 = 256 B per token;
    GLM-5-Next's transformers row (key 128, k-pool gate 128, validity flag 1) is
    257 * 2 = 514 B in bf16 and 257 * 4 = 1,028 B in fp32. In fp8 (vLLM's DeepSeek-V3.2 layout)
    the key is 128 fp8 bytes and one fp32 scale per 128 elements, 128 + 4 = 132 B; a head of 256
    takes two (256 + 8 = 264 B), one of 64 none (vLLM's head_dim // 128 * 4 = 0: 64 B; its
    kernels take only 128); GLM-5-Next's side channels stay bf16 (132 + 129 * 2 = 390 B). One
    key head: every TP rank keeps it whole. Kernels read 64-token pages."""
    assert IndexerSpec(index_head_dim=128).bytes_per_token == 256
    glm = IndexerSpec(index_head_dim=128, side_channels=129)
    assert glm.row_elements == 257 and glm.bytes_per_token == 514
    assert (
        IndexerSpec(index_head_dim=128, side_channels=129, kv_dtype="fp32").bytes_per_token
        == 1_028
    )
    assert IndexerSpec(index_head_dim=128, kv_dtype="fp8").bytes_per_token == 132
    assert IndexerSpec(index_head_dim=64, kv_dtype="fp8").bytes_per_token == 64
    assert IndexerSpec(index_head_dim=256, kv_dtype="fp8_e5m2").bytes_per_token == 264
    assert (
        IndexerSpec(index_head_dim=128, side_channels=129, kv_dtype="fp8").bytes_per_token == 390
    )
    assert IndexerSpec(index_head_dim=128, tp_size=8).bytes_per_token == 256
    assert glm.kernel_alignment == 64 and glm.page_bytes(64) == 64 * 514


def test_ple_conv_state_by_hand():
    """Qwen4-Exp's PLE conv over hc_count 4 x hidden 2048 = 8,192 channels, kernel 4, dilation
    3 (ngram_size) reaches (4 - 1) * 3 = 9 inputs back: 9 * 8,192 * 2 = 147,456 B in bf16,
    294,912 B in fp32; 2 speculative tokens add 2 rows (11 * 8,192 * 2 = 180,224 B); TP 4 keeps
    it whole (vLLM sizes it at tp_world_size=1)."""
    spec = PLEConvSpec(conv_dim=8192, conv_kernel=4, dilation=3)
    assert spec.span == 9
    assert [(t.name, t.shape, t.dtype) for t in spec.state_tensors()] == [
        ("ple", (9, 8192), "bfloat16")
    ]
    assert spec.state_bytes == 147_456
    assert (
        PLEConvSpec(conv_dim=8192, conv_kernel=4, dilation=3, conv_dtype="fp32").state_bytes
        == 294_912
    )
    assert (
        PLEConvSpec(conv_dim=8192, conv_kernel=4, dilation=3, num_spec_tokens=2).state_bytes
        == 180_224
    )
    assert PLEConvSpec(conv_dim=8192, conv_kernel=4, dilation=3, tp_size=4).state_bytes == 147_456


def test_inkling_conv_splits_kv_channels_and_replicates_the_hidden_ones():
    """Inkling's k/v convs follow the KV heads across TP ranks (one replicated head past the
    head count), its attn/mlp convs over the hidden size stay whole on every rank."""
    spec = InklingConvSpec(num_kv_heads=8, head_dim=128, hidden_size=6144, conv_kernel=4)
    assert spec.state_bytes == 3 * (2 * 8 * 128 + 2 * 6144) * 2
    for tp, kv in ((2, 4), (8, 1), (16, 1)):
        shapes = {t.name: t.shape for t in replace(spec, tp_size=tp).state_tensors()}
        assert shapes["k_sconv"] == shapes["v_sconv"] == (3, kv * 128)
        assert shapes["attn_sconv"] == shapes["mlp_sconv"] == (3, 6144)
    rows = {t.shape[0] for t in replace(spec, num_spec_tokens=2).state_tensors()}
    assert rows == {5}
    with pytest.raises(ValueError, match="does not divide num_kv_heads=8"):
        replace(spec, tp_size=3)
    with pytest.raises(ValueError, match="exceeds num_kv_heads=8 but is not a multiple"):
        replace(spec, tp_size=12)


def test_cca_state_splits_by_heads_and_sizes_the_delayed_half_for_the_fullest_rank():
    """ZAYA's CCA state: the q/k conv window (time0 + time1 - 2 tokens) over the rank's query
    and KV heads; the delayed value half, which is the last half of the KV heads, sized for the
    rank holding most of it."""
    spec = CCAStateSpec(num_heads=8, num_kv_heads=2, head_dim=128, time0=2, time1=3)
    assert {t.name: t.shape for t in spec.state_tensors()} == {
        "conv": (3, 10 * 128),
        "v_delayed": (1, 128),
    }
    assert spec.state_bytes == (3 * 1280 + 128) * 2
    # TP 2: one KV head a rank; the second rank's head is all delayed channels
    assert (
        replace(spec, tp_size=2).delayed_dim == 128
        and replace(spec, tp_size=2).conv_dim == 5 * 128
    )
    # TP 8: a replicated KV head, one query head a rank
    assert replace(spec, tp_size=8).conv_dim == 2 * 128
    one = CCAStateSpec(num_heads=4, num_kv_heads=1, head_dim=64, time0=2, time1=2, tp_size=4)
    assert one.delayed_dim == 32  # half of the one head, on every rank
    assert {t.shape[0] for t in replace(spec, num_spec_tokens=1).state_tensors()} == {4, 2}
    with pytest.raises(ValueError, match="does not divide num_heads=8"):
        replace(spec, tp_size=16)
    with pytest.raises(ValueError, match="num_kv_heads \\* head_dim = 3 is odd"):
        CCAStateSpec(num_heads=1, num_kv_heads=1, head_dim=3, time0=2, time1=2)
