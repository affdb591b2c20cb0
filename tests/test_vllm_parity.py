"""``inflate`` plans against vLLM's own rules, model by model.

The reference below is written from vLLM 0.33.0's source, independently of hybridkv's specs and
layouts: it reads the zoo's raw JSON numbers and applies

- state shapes and dtypes: ``MambaStateShapeCalculator`` / ``MambaStateDtypeCalculator``
  (``vllm/model_executor/layers/mamba/mamba_utils.py``), with NemotronH's SSM dtype defaulting to
  float32 (``NemotronHForCausalLMConfig``) and Qwen3.5's ``mamba_ssm_dtype``
  (``Qwen3_5ForConditionalGenerationConfig``, both in ``vllm/model_executor/models/config.py``);
- the block size: ``Platform._align_hybrid_block_size`` (``vllm/platforms/interface.py``);
- the state blocks a request holds: ``MambaSpec.max_memory_usage_bytes``
  (``vllm/v1/kv_cache_interface.py``);
- the groups: ``_get_kv_cache_groups_uniform_page_size`` (``vllm/v1/core/kv_cache_planning.py``).

Configurations vLLM refuses (a TP size that does not divide the heads) must be refused by
hybridkv too.
"""

from __future__ import annotations

import json
import math
from importlib import resources

import pytest

from hybridkv import models
from hybridkv.layouts import make_plan
from hybridkv.target import VllmTarget

MODELS = [
    "qwen3.5-4b",
    "qwen3.5-35b-a3b",
    "qwen3.5-397b-a17b",
    "qwen3-next-80b-a3b",
    "nemotron-h-8b",
    "nemotron-nano-12b-v2",
    "nemotron-3-nano-30b-a3b",
    "falcon-h1-7b",
    "granite-4.0-h-small",
    "granite-4.0-h-tiny",
    "jamba-1.5-mini",
    "kimi-linear-48b-a3b",
    "lfm2-1.2b",
    "lfm2-8b-a1b",
    "olmo-hybrid-7b",
    "zamba2-2.7b",
]
# Bamba and MiniMax-01 are in the zoo but vLLM 0.33 no longer serves them (removed in 0.23.0),
# so there is no vLLM 0.33 number to hold them to.
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}


def _zoo(name: str) -> dict:
    text = resources.files("hybridkv.models").joinpath("zoo", f"{name}.json").read_text()
    return json.loads(text)


def _div(a: int, b: int) -> int:
    if a % b:
        raise ValueError(f"{a} is not divisible by {b}")  # vLLM's divide() asserts the same
    return a // b


def _state(mixer: dict, tp: int, model_dtype: str, ssm_dtype: str) -> list[tuple[tuple, str]]:
    """One layer's state tensors (shape, dtype) as vLLM's shape/dtype calculators give them."""
    k = mixer["kind"]
    if k == "mamba2":
        groups = mixer["n_groups"] + (0 if mixer["n_groups"] % tp == 0 else tp - mixer["n_groups"])
        inner = mixer["num_heads"] * mixer["head_dim"]
        conv = _div(inner + 2 * groups * mixer["d_state"], tp)
        heads = _div(mixer["num_heads"], tp)
        return [
            ((mixer["d_conv"] - 1, conv), model_dtype),
            ((heads, mixer["head_dim"], mixer["d_state"]), ssm_dtype),
        ]
    if k == "mamba1":
        inner = _div(mixer["d_inner"], tp)
        return [
            ((mixer["d_conv"] - 1, inner), model_dtype),
            ((inner, mixer["d_state"]), ssm_dtype),
        ]
    if k == "gated_deltanet":
        conv = 2 * mixer["num_k_heads"] * mixer["head_k_dim"]
        conv += mixer["num_v_heads"] * mixer["head_v_dim"]
        _div(mixer["num_k_heads"], tp)
        return [
            ((mixer["conv_kernel"] - 1, _div(conv, tp)), model_dtype),
            (
                (_div(mixer["num_v_heads"], tp), mixer["head_v_dim"], mixer["head_k_dim"]),
                ssm_dtype,
            ),
        ]
    if k == "kda":  # KDA's recurrent state: float32 unless asked otherwise
        conv = 3 * mixer["num_heads"] * mixer["head_dim"]
        heads = _div(mixer["num_heads"], tp)
        return [
            ((mixer["conv_kernel"] - 1, _div(conv, tp)), model_dtype),
            ((heads, mixer["head_dim"], mixer["head_dim"]), "float32"),
        ]
    if k == "linear_attention":  # one state in the mamba_cache_dtype
        heads = _div(mixer["num_heads"], tp)
        return [((heads, mixer["head_dim"], mixer["head_dim"]), model_dtype)]
    if k == "short_conv":
        return [((mixer["conv_kernel"] - 1, _div(mixer["conv_dim"], tp)), model_dtype)]
    raise AssertionError(f"no vLLM state for {k}")


def vllm_reference(name: str, tp: int, kv: str, prefix_caching: bool) -> dict[str, int] | None:
    """vLLM 0.33 on Hopper (FlashAttention, FlashInfer GDN prefill) for one zoo model; None where
    vLLM refuses the TP size."""
    z = _zoo(name)
    dtype = z["torch_dtype"]
    family = z["family"].lower()
    attn = [m for m in z["mixers"] if m["kind"] in ("full_attention", "mla")]
    states = [m for m in z["mixers"] if m not in attn]
    ssm_dtype = z.get("ssm_dtype_declared") or dtype
    try:
        a = attn[0]
        for m in attn:
            _div(m["num_heads"], tp)
        if a["kind"] == "mla":
            page_1 = (a["kv_lora_rank"] + a["qk_rope_head_dim"]) * BYTES[
                kv if kv != "auto" else dtype
            ]
        else:
            kv_heads = a["num_kv_heads"]
            if tp <= kv_heads:
                _div(kv_heads, tp)
            elif tp % kv_heads:
                raise ValueError("KV heads cannot be replicated")
            heads = max(1, kv_heads // tp)
            page_1 = 2 * heads * a["head_dim"] * BYTES["fp8" if kv == "fp8" else dtype]
        tensors = [_state(m, tp, dtype, ssm_dtype) for m in states]
    except ValueError:
        return None
    state_page = max(sum(math.prod(s) * BYTES[d] for s, d in t) for t in tensors)
    mode = "align" if prefix_caching else "none"
    # only Qwen's GDN layer class exports FlashInfer prefill checkpoints (OLMo-Hybrid's does not)
    gdn_flashinfer = mode == "align" and "qwen" in family
    unit = 16
    if a["kind"] == "mla":
        unit = max(unit, 128)
    if gdn_flashinfer:
        unit = math.lcm(unit, 64)
    block = max(16, unit * -(-state_page // (unit * page_1)))
    mamba2 = any(m["kind"] == "mamba2" for m in states)
    ckpt = 1 if (mamba2 or gdn_flashinfer) else 0
    # groups: one bucket per distinct spec, split to the group size vLLM picks
    counts = [len(m["layers"]) for m in z["mixers"]]
    lo, hi = min(counts), max(counts)
    group_size = hi if hi < 1.5 * lo else lo
    return {
        "block_size": block,
        "page_bytes": block * page_1,
        "state_bytes": state_page,
        "groups": sum(-(-c // group_size) for c in counts),
        "group_size": group_size,
        "state_blocks_per_request": 2 + ckpt if mode == "align" else 1,
    }


CASES = [
    pytest.param(
        name,
        tp,
        kv,
        pc,
        id=f"{name}-tp{tp}-{'fp8' if kv == 'fp8' else 'bf16'}-{'pc' if pc else 'nopc'}",
    )
    for name in MODELS
    for tp in (1, 2, 4)
    for kv in ("auto", "fp8")
    for pc in (True, False)
]


@pytest.mark.parametrize("name, tp, kv, prefix_caching", CASES)
def test_inflate_matches_vllm_033(name, tp, kv, prefix_caching):
    expected = vllm_reference(name, tp, kv, prefix_caching)
    target = VllmTarget(enable_prefix_caching=prefix_caching)
    if expected is None:
        with pytest.raises(ValueError, match="tensor-parallel size"):
            models.load(name, tp_size=tp, kv_dtype=kv)
        return
    model = models.load(name, tp_size=tp, kv_dtype=kv)
    plan = make_plan(model, "inflate", memory="80GiB", max_num_seqs=8, target=target)
    got = {
        "block_size": plan.block_size,
        "page_bytes": plan.extra["page_bytes"],
        "state_bytes": max(layer.spec.state_bytes for layer in model.state_layers),
        "groups": len(plan.groups),
        "group_size": plan.extra["group_size"],
        "state_blocks_per_request": plan.vllm.state_blocks_per_request,
    }
    assert got == expected
    # every group's page is the one page, and each state fits in it
    assert {g.page_bytes for g in plan.groups} == {expected["page_bytes"]}
    assert plan.vllm.mamba_cache_mode == ("align" if prefix_caching else "none")


def test_the_table_covers_what_the_issue_asks():
    """At least 12 models x TP 1/2/4 x bf16/fp8 KV x prefix caching on/off, most of them real
    configurations (not refused)."""
    planned = [c for c in CASES if vllm_reference(*c.values) is not None]
    assert len(MODELS) >= 12
    assert len(planned) >= 12 * 3 * 2 * 2 * 0.75


@pytest.mark.parametrize(
    "name, options, target, block",
    [
        # the issue's numbers: vLLM 0.33 with prefix caching, without it, and 0.32
        pytest.param("qwen3-next-80b-a3b", {}, VllmTarget(), 576, id="qwen3-next-pc-576"),
        pytest.param(
            "qwen3-next-80b-a3b",
            {},
            VllmTarget(enable_prefix_caching=False),
            544,
            id="qwen3-next-nopc-544",
        ),
        pytest.param(
            "qwen3-next-80b-a3b", {}, VllmTarget(version="0.32"), 544, id="qwen3-next-v0.32-544"
        ),
        # Ampere: Triton GDN prefill, no 64-token checkpoint alignment
        pytest.param(
            "qwen3-next-80b-a3b", {}, VllmTarget(gpu="ampere"), 544, id="qwen3-next-ampere-544"
        ),
        # Nemotron-H-8B with vLLM's float32 SSM state: 1040, not 528
        pytest.param("nemotron-h-8b", {}, VllmTarget(), 1040, id="nemotron-h-8b-1040"),
        # MLA hybrid: a multiple of 128
        pytest.param("kimi-linear-48b-a3b", {}, VllmTarget(), 1920, id="kimi-linear-mla-1920"),
    ],
)
def test_the_issues_figures(name, options, target, block):
    plan = make_plan(models.load(name, **options), "inflate", memory="80GiB", target=target)
    assert plan.block_size == block


@pytest.mark.parametrize(
    "user_block, expected",
    [
        # vLLM uses max(16, --block-size) as the unit: Qwen3.5-4B with 64 -> 576 (not 528)
        pytest.param(64, 576, id="block-64-unit-64"),
        # 48 is the unit; with prefix caching its lcm with FlashInfer's 64 is 192
        pytest.param(48, 576, id="block-48-unit-192"),
        # a block larger than the state needs is kept as given
        pytest.param(1024, 1024, id="block-1024-kept"),
    ],
)
def test_user_block_size_is_the_alignment_unit(user_block, expected):
    model = models.load("qwen3.5-4b")
    plan = make_plan(model, "inflate", memory="80GiB", block_size=user_block)
    assert plan.block_size == expected
    off = make_plan(
        model,
        "inflate",
        memory="80GiB",
        block_size=user_block,
        target=VllmTarget(enable_prefix_caching=False),
    )
    state = max(layer.spec.state_bytes for layer in model.state_layers)
    per_token = model.attention_layers[0].spec.bytes_per_token
    unit = max(16, user_block)
    assert off.block_size == max(user_block, unit * -(-state // (unit * per_token)))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param({"version": "0.31"}, "not modelled", id="old-version"),
        pytest.param({"gpu": "blackwell"}, "kernel_block_size", id="blackwell"),
        pytest.param(
            {"enable_prefix_caching": False, "mamba_cache_mode": "align"},
            "needs prefix caching",
            id="align-without-pc",
        ),
        pytest.param({"mamba_cache_mode": "all"}, "mamba_cache_mode", id="bad-mode"),
        pytest.param(
            {"gpu": "ampere", "gdn_prefill_backend": "flashinfer"}, "Hopper", id="fi-ampere"
        ),
        pytest.param({"max_model_len": 0}, "positive", id="zero-len"),
        pytest.param({"enable_prefix_caching": "yes"}, "True, False or None", id="pc-string"),
    ],
)
def test_bad_targets_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VllmTarget(**kwargs)


def test_mamba_cache_mode_follows_prefix_caching():
    model = models.load("nemotron-h-8b")
    rules = VllmTarget(mamba_cache_mode="none").resolve(model)
    assert (rules.enable_prefix_caching, rules.mamba_cache_mode) == (False, "none")
    assert rules.state_blocks_per_request == 1
    with pytest.raises(ValueError, match="align mode whenever prefix caching is on"):
        VllmTarget(enable_prefix_caching=True, mamba_cache_mode="none").resolve(model)
    # a model without recurrent state has no Mamba cache mode to speak of
    attention_only = VllmTarget(enable_prefix_caching=True).resolve(models.load("qwen3.5-4b"))
    assert attention_only.mamba_cache_mode == "align"


def test_olmo_hybrid_gdn_exports_no_checkpoints():
    """OLMo-Hybrid's GDN layer is not Qwen's class: no 64-token alignment, 2 state blocks."""
    rules = VllmTarget().resolve(models.load("olmo-hybrid-7b"))
    assert rules.checkpoint_alignment is None
    assert rules.state_blocks_per_request == 2
    assert VllmTarget().resolve(models.load("qwen3.5-4b")).checkpoint_alignment == 64


def test_version_strings_are_normalised():
    assert VllmTarget(version="v0.33.0").version == "0.33"
    assert VllmTarget(version="0.32.0").version == "0.32"


# ---- GLM-5-Next: the k-pooled indexer's backend decides the alignment ------------------------

_GLM5_KPOOL8 = dict(index_kpool=8, linear_num_heads=32)


@pytest.mark.parametrize(
    "text_config, kv, block",
    [
        pytest.param({}, "auto", 4_608, id="default-bf16-4608"),
        pytest.param({}, "fp8", 8_704, id="default-fp8-8704"),
        pytest.param(_GLM5_KPOOL8, "auto", 2_304, id="kpool8-bf16-2304"),
        pytest.param(_GLM5_KPOOL8, "fp8", 4_352, id="kpool8-fp8-4352"),
    ],
)
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["align", "none"])
def test_glm5_next_inflate_matches_vllm_033(text_config, kv, block, prefix_caching):
    """vLLM 0.33 on Hopper (TP 1), worked by hand from its source:

    - attention bytes per token P (``_align_hybrid_block_size``, vllm/platforms/interface.py):
      an ``MLAAttentionSpec`` of head size ``kv_lora_rank + qk_rope_head_dim`` = 512 + 0, one
      head: 1,024 B in bf16, 512 B in fp8. The indexer's pooled keys and its tail ring do not
      enter it.
    - KDA state S (``MambaStateShapeCalculator.kda_state_shape`` / ``kda_state_dtype``): float32
      recurrent ``H x 128 x 128`` plus a bf16 conv of ``(4 - 1) x 3 * H * 128``;
      ``H = linear_num_heads``: 64 (default) gives 4,194,304 + 147,456 = 4,341,760 B, 32 gives
      2,097,152 + 73,728 = 2,170,880 B.
    - alignment L: the non-SSM backends are the MLA backend (smallest kernel block 64),
      ``Glm5NextIndexerBackend`` (``index_kpool x`` DeepGEMM's paged-MQA pages 32 / 64: smallest
      ``32 * index_kpool``) and ``KpoolTailBackend`` (``MultipleOf(1)``). The default block is
      their lcm (``_preferred_block_size_for_backends``), the MLA floor is 128, the rounding
      ``backend_block_alignment`` is the lcm again, and KDA's FlashKDA checkpoint alignment (16,
      align mode only) divides it: L = lcm(128, 64, 32 * kpool) = 512 for kpool 16, 256 for
      kpool 8, in align and none mode alike.
    - block = L x cdiv(S, L x P):
      default bf16 512 x cdiv(4,341,760, 524,288) = 512 x 9 = 4,608;
      default fp8 512 x cdiv(4,341,760, 262,144) = 512 x 17 = 8,704;
      kpool 8 / 32 KDA heads, bf16: 256 x cdiv(2,170,880, 262,144) = 256 x 9 = 2,304;
      kpool 8 / 32 KDA heads, fp8: 256 x cdiv(2,170,880, 131,072) = 256 x 17 = 4,352.

    (hybridkv's earlier rule rounded only to DeepSeek-V3.2's 64-token indexer pages: 4,352 and
    2,176 for the bf16 cases.) The tail ring (``index_kpool`` slots for no speculative token)
    divides every one of these blocks, as ``Glm5NextTailCache`` asserts."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Glm5NextConfig(text_config=text_config or None).to_dict()
    model = models.from_hf_config(config, kv_dtype=kv)
    target = VllmTarget(enable_prefix_caching=prefix_caching)
    plan = make_plan(model, "inflate", memory="80GiB", max_num_seqs=8, target=target)
    kpool = transformers.Glm5NextConfig(text_config=text_config or None).text_config.index_kpool
    heads = 32 if text_config else 64
    state = heads * 128 * 128 * 4 + 3 * 3 * heads * 128 * 2
    per_token = 512 * BYTES["fp8" if kv == "fp8" else "bfloat16"]
    unit = math.lcm(128, 64, 32 * kpool)
    assert max(layer.spec.state_bytes for layer in model.state_layers) == state
    assert block == unit * -(-state // (unit * per_token))
    assert plan.block_size == block
    assert block % kpool == 0  # the tail ring of index_kpool slots divides the block
    assert plan.vllm.mamba_cache_mode == ("align" if prefix_caching else "none")


def _kimi_linear_config(**linear) -> dict:
    """Kimi-Linear-48B-A3B's released config (its ``linear_attn_config`` holds five keys, no
    ``gate_lower_bound``; 1-based layer lists), with ``linear`` added to that section."""
    return {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "torch_dtype": "bfloat16",
        "hidden_size": 2304,
        "num_hidden_layers": 27,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "max_position_embeddings": 1048576,
        "linear_attn_config": {
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
            "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
            "head_dim": 128,
            "num_heads": 32,
            "short_conv_kernel_size": 4,
            **linear,
        },
    }


@pytest.mark.parametrize(
    ("linear", "runtime", "gpu", "backend"),
    [
        ({}, {}, "hopper", "triton"),  # the released config: no gate bound
        ({"gate_lower_bound": -5.0}, {}, "hopper", "flashkda"),
        ({"gate_lower_bound": -5.0}, {}, "ampere", "triton"),  # FlashKDA needs SM90+
        ({"gate_lower_bound": -5.0}, {"ssm_dtype": "float16"}, "hopper", "triton"),
    ],
)
def test_kimi_linear_kda_checkpoint_block(linear, runtime, gpu, backend):
    """KimiK3DeltaAttention (vllm/models/kimi_k3/nvidia/kda.py), which serves Kimi-Linear:
    resolve_kda_prefill_backend takes FlashKDA on SM90+ for a bf16 model with head dim 128, a
    bf16 or fp32 recurrent state and linear_attn_config.gate_lower_bound set (read with .get(...,
    None)); get_kv_cache_spec then declares one prefill checkpoint block at 16 tokens, so in
    align mode a request holds 3 state blocks rather than 2."""
    model = models.from_hf_config(_kimi_linear_config(**linear), **runtime)
    rules = VllmTarget(gpu=gpu).resolve(model)
    assert rules.kda_prefill_backend == backend
    assert rules.state_blocks_per_request == (3 if backend == "flashkda" else 2)
    assert rules.spec_checkpoint_alignment == (16 if backend == "flashkda" else None)
    zoo = VllmTarget().resolve(models.load("kimi-linear-48b-a3b"))  # no config: the released one
    assert zoo.kda_prefill_backend == "triton" and zoo.state_blocks_per_request == 2


@pytest.mark.parametrize(
    ("dtype", "gpu", "backend", "blocks"),
    [
        ("bfloat16", "hopper", "flashkda", 3),
        ("float32", "hopper", "triton", 2),  # FlashKDA needs a bf16 model
        ("bfloat16", "ampere", "triton", 2),  # ... and SM90 or newer
    ],
)
def test_glm5_next_kda_checkpoint_block(dtype, gpu, backend, blocks):
    """Glm5NextLinearAttention.get_kv_cache_spec (vllm/models/glm5next/common/kda.py): under
    FlashKDA (_resolve_kda_prefill_backend: CUDA SM90/SM10x/SM12x, bf16 model, linear_head_dim
    128, linear_lower_bound set; transformers' default -5.0) the KDA state declares one prefill
    checkpoint block at kda_prefill_checkpoint_alignment's 16 tokens, so in align mode a request
    holds MambaSpec.max_memory_usage_bytes' 2 + 0 + 1 = 3 state blocks; under Triton 2. The
    layer does not override get_prefill_checkpoint_alignment, so the block (a multiple of 128
    here) is not aligned to it; vLLM's scheduler checks checkpoint offsets against the spec's 16
    (Scheduler.mamba_prefill_checkpoint_alignment)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Glm5NextConfig().to_dict()
    config["text_config"]["dtype"] = dtype
    model = models.from_hf_config(config)
    rules = VllmTarget(gpu=gpu).resolve(model)
    assert rules.kda_prefill_backend == backend
    assert rules.state_blocks_per_request == blocks
    assert rules.num_prefill_checkpoint_blocks == blocks - 2
    assert rules.spec_checkpoint_alignment == (16 if backend == "flashkda" else None)
    if backend == "flashkda":
        # checkpoints land on hash blocks (get_mamba_prefill_checkpoint_position) 16 apart
        assert rules.prefill_checkpoint_grid(4_608, 4_608) == 4_608
        assert rules.prefill_checkpoint_grid(4_608, 24) == 48
    unbounded = transformers.Glm5NextConfig().to_dict()
    unbounded["text_config"]["linear_lower_bound"] = None
    assert VllmTarget().resolve(models.from_hf_config(unbounded)).kda_prefill_backend == "triton"
