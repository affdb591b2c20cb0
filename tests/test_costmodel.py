"""The roofline cost model against numbers worked out by hand on a toy model."""

from __future__ import annotations

import dataclasses

import pytest

from hybridkv import costmodel as cm
from hybridkv.layouts import make_plan
from hybridkv.models.model import HybridModel
from hybridkv.specs import spec_from_dict

# One attention layer (8 query heads, 2 KV heads of 128) and one Gated DeltaNet layer
# (2 key heads, 4 value heads of 64, conv kernel 4), everything bf16.
TOY = {
    "name": "toy",
    "num_hidden_layers": 2,
    "torch_dtype": "bfloat16",
    "mixers": [
        {
            "kind": "full_attention",
            "num_heads": 8,
            "num_kv_heads": 2,
            "head_dim": 128,
            "layers": [1],
        },
        {
            "kind": "gated_deltanet",
            "num_k_heads": 2,
            "num_v_heads": 4,
            "head_k_dim": 64,
            "head_v_dim": 64,
            "conv_kernel": 4,
            "layers": [0],
        },
    ],
}
KV_PER_TOKEN = 2 * (128 + 128) * 2  # 2 KV heads x (K + V dims) x 2 bytes = 1,024 B
CONV_ELEMS = 3 * (2 * 2 * 64 + 4 * 64)  # (kernel - 1) x conv_dim = 1,536
SSM_ELEMS = 4 * 64 * 64  # 16,384
STATE_BYTES = 2 * (CONV_ELEMS + SSM_ELEMS)  # 35,840 B
ATTN_PER_CTX = 2 * 8 * (128 + 128)  # QK^T + PV: 4,096 FLOPs per context token
STATE_FLOPS = 6 * (CONV_ELEMS + SSM_ELEMS)  # 107,520 per token
DENSE = cm.ParamCount(1e9, 1e9, "test")
MOE = cm.ParamCount(10e9, 1e9, "test")


@pytest.fixture
def toy():
    return HybridModel.from_dict(TOY)


def test_toy_constants_match_the_specs(toy):
    assert toy.kv_bytes_per_token == KV_PER_TOKEN
    assert toy.state_bytes_per_seq == STATE_BYTES
    assert cm.state_flops_per_token(toy) == STATE_FLOPS


def test_gpu_presets():
    assert cm.H100_SXM.hbm_bandwidth == 3.35e12
    assert cm.H200.hbm_bandwidth == 4.8e12
    assert cm.H100_SXM.flops_bf16 == cm.H200.flops_bf16 == 989e12
    assert cm.H100_SXM.flops("fp8") == 1979e12
    # the totals the devices report (vLLM's budget base), not the datasheets' 80 / 141 GB
    assert cm.GPUS["h200"].memory_bytes == 150_109_880_320
    assert cm.GPUS["h100"].memory_bytes == 81_559 * 2**20
    from hybridkv.cli import GPU_PRESETS

    assert GPU_PRESETS["h100"][0] == cm.H100_SXM.memory_bytes
    assert GPU_PRESETS["h200"][0] == cm.H200.memory_bytes


@pytest.mark.parametrize(
    "new, cached, window, expected",
    [
        (4, 0, None, 1 + 2 + 3 + 4),
        (4, 0, 2, 1 + 2 + 2 + 2),
        (2, 3, 4, 4 + 4),
        (3, 1, 3, 2 + 3 + 3),
        (1, 99, None, 100),
        (0, 5, None, 0),
    ],
)
def test_context_sum(new, cached, window, expected):
    assert cm._context_sum(new, cached, window) == expected


def test_prefill_by_hand(toy):
    s = cm.prefill(toy, cm.H100_SXM, 100, params=DENSE)
    flops = 2e9 * 100 + ATTN_PER_CTX * (100 * 101 // 2) + STATE_FLOPS * 100
    bytes_ = 1e9 * 2 + KV_PER_TOKEN * 100 + KV_PER_TOKEN * 100 + 2 * STATE_BYTES
    assert s.flops == pytest.approx(flops)
    assert s.bytes == pytest.approx(bytes_)
    assert s.compute_s == pytest.approx(flops / 989e12)
    assert s.memory_s == pytest.approx(bytes_ / 3.35e12)
    assert s.time_s == s.memory_s and s.bound == "memory"


def test_prefill_after_a_cache_hit(toy):
    s = cm.prefill(toy, cm.H100_SXM, 10, 90, params=DENSE)
    # tokens 91..100 attend to 91..100 context tokens; the whole context is read once
    assert s.flops == pytest.approx(
        2e9 * 10 + ATTN_PER_CTX * sum(range(91, 101)) + STATE_FLOPS * 10
    )
    assert s.bytes == pytest.approx(2e9 + KV_PER_TOKEN * 100 + KV_PER_TOKEN * 10 + 2 * STATE_BYTES)


def test_long_prefill_is_compute_bound(toy):
    s = cm.prefill(toy, cm.H100_SXM, 32_768, params=DENSE)
    assert s.bound == "compute"


def test_decode_by_hand(toy):
    s = cm.decode_step(toy, cm.H200, [10, 30], params=DENSE)
    flops = 2e9 * 2 + ATTN_PER_CTX * (11 + 31) + STATE_FLOPS * 2
    bytes_ = 1e9 * 2 + KV_PER_TOKEN * 40 + KV_PER_TOKEN * 2 + 2 * STATE_BYTES * 2
    assert s.flops == pytest.approx(flops)
    assert s.bytes == pytest.approx(bytes_)
    assert s.time_s == pytest.approx(max(flops / 989e12, bytes_ / 4.8e12))
    assert cm.decode_throughput(toy, cm.H200, 2, 20, params=DENSE) == pytest.approx(
        2 / cm.decode_step(toy, cm.H200, [20, 20], params=DENSE).time_s
    )


def test_moe_weights_read_grow_with_tokens_up_to_the_total(toy):
    rest = lambda n, ctx: KV_PER_TOKEN * (ctx + n) + 2 * STATE_BYTES * n
    one = cm.decode_step(toy, cm.H100_SXM, [0], params=MOE)
    four = cm.decode_step(toy, cm.H100_SXM, [0] * 4, params=MOE)
    many = cm.prefill(toy, cm.H100_SXM, 100, params=MOE)
    assert one.bytes == pytest.approx(2e9 + rest(1, 0))  # 1e9 active parameters x 2 bytes
    assert four.bytes == pytest.approx(8e9 + rest(4, 0))
    # prefill: min(total, active x 100) = all 10e9 parameters, read once
    assert many.bytes == pytest.approx(20e9 + 2 * KV_PER_TOKEN * 100 + 2 * STATE_BYTES)


def test_tensor_parallel_splits_parameters(toy):
    tp2 = HybridModel.from_dict(TOY).configure(tp_size=2)
    s1 = cm.prefill(toy, cm.H100_SXM, 1, params=DENSE)
    s2 = cm.prefill(tp2, cm.H100_SXM, 1, params=DENSE)
    # weights: 2e9 -> 1e9 bytes per rank; KV heads and GDN heads halve too
    assert s2.bytes == pytest.approx(1e9 + KV_PER_TOKEN + STATE_BYTES)
    assert s1.bytes == pytest.approx(2e9 + 2 * KV_PER_TOKEN + 2 * STATE_BYTES)


def test_weight_dtype_and_efficiency(toy):
    bf16 = cm.prefill(toy, cm.H100_SXM, 4096, params=DENSE)
    fp8 = cm.prefill(toy, cm.H100_SXM, 4096, params=DENSE, weight_dtype="fp8")
    assert fp8.compute_s == pytest.approx(bf16.flops / 1979e12)
    assert fp8.bytes == pytest.approx(bf16.bytes - 1e9)
    half = cm.prefill(toy, cm.H100_SXM, 4096, params=DENSE, mfu=0.5, mbu=0.5)
    assert half.compute_s == pytest.approx(2 * bf16.compute_s)
    with pytest.raises(ValueError, match="mfu"):
        cm.prefill(toy, cm.H100_SXM, 1, params=DENSE, mfu=0)


def test_ttft_is_the_prefill_of_the_uncached_part(toy):
    t = cm.ttft(toy, cm.H100_SXM, 1000, 600, params=DENSE)
    assert t == cm.prefill(toy, cm.H100_SXM, 400, 600, params=DENSE).time_s
    # a fully cached prompt still computes its last token
    assert cm.ttft(toy, cm.H100_SXM, 1000, 1000, params=DENSE) == (
        cm.prefill(toy, cm.H100_SXM, 1, 999, params=DENSE).time_s
    )
    with pytest.raises(ValueError, match="cached_tokens"):
        cm.ttft(toy, cm.H100_SXM, 10, 11, params=DENSE)


def test_sliding_window_caps_the_context():
    swa = dict(TOY)
    swa["mixers"] = [
        {**TOY["mixers"][0], "kind": "sliding_window", "sliding_window": 64},
        TOY["mixers"][1],
    ]
    model = HybridModel.from_dict(swa)
    assert cm.attention_flops(model, 1, 1000) == ATTN_PER_CTX * 64


def test_requests_that_fit_uses_whole_blocks(toy):
    plan = make_plan(toy, "inflate", memory="1GiB", max_num_seqs=4)
    b = plan.block_size
    cap = plan.capacity.token_capacity
    assert cm.requests_that_fit(plan, 1) == min(4, cap // b)
    assert cm.requests_that_fit(plan, b + 1) == min(4, cap // (2 * b))
    plan = make_plan(toy, "per_group", memory="64MiB", max_num_seqs=1000)
    assert cm.requests_that_fit(plan, 17) == min(1000, plan.capacity.token_capacity // 32)


@pytest.mark.parametrize(
    "name, active",
    [
        ("qwen3-next-80b-a3b", 3e9),
        ("Qwen/Qwen3-Next-80B-A3B-Instruct", 3e9),
        ("nvidia/NVIDIA-Nemotron-Nano-12B-v2", 12e9),
        ("qwen3.5-397b-a17b", 17e9),
        ("ai21labs/AI21-Jamba-1.5-Mini", 12e9),
    ],
)
def test_param_count_lookup(name, active):
    assert cm.param_count(name).active == active


def test_param_count_unknown_model():
    with pytest.raises(KeyError, match="pass params=ParamCount"):
        cm.param_count("llama-3-8b")
    with pytest.raises(ValueError, match="active"):
        cm.ParamCount(1e9, 2e9, "bad")


def test_every_zoo_model_has_a_parameter_count():
    from hybridkv import models

    missing = [name for name in models.list_models() if models.load(name).params is None]
    assert not missing, f"add params to these zoo files: {missing}"


# ---- one code path: the module functions are StepCoster's costs ---------------------------------
def _swa_toy() -> HybridModel:
    swa = dict(TOY)
    swa["mixers"] = [
        {**TOY["mixers"][0], "kind": "sliding_window", "sliding_window": 64},
        TOY["mixers"][1],
    ]
    return HybridModel.from_dict(swa)


@pytest.mark.parametrize("window", [False, True], ids=["full", "sliding-window"])
def test_step_coster_parts_are_the_functions_costs(toy, window):
    model = _swa_toy() if window else toy
    coster = cm.StepCoster(model, cm.H200, params=MOE, mfu=0.5)
    s = cm.prefill(model, cm.H200, 300, 700, params=MOE, mfu=0.5)
    assert coster.prefill_cost(300, 700) == s
    assert (coster.prefill_flops(300, 700), coster.prefill_bytes(300, 700)) == (s.flops, s.bytes)
    assert coster.prefill_s(300, 700) == s.time_s
    contexts = [10, 30, 30, 500]
    d = cm.decode_step(model, cm.H200, contexts, params=MOE, mfu=0.5)
    assert coster.decode_cost(contexts) == d
    assert coster.decode_flops(4, 570, contexts) == d.flops
    assert coster.decode_bytes(4, 570) == d.bytes
    assert coster.decode_s(4, 570, contexts) == d.time_s


def test_decode_without_contexts_needs_a_model_without_windows(toy):
    assert cm.StepCoster(toy, cm.H200, params=DENSE).windows == ()
    assert cm.StepCoster(toy, cm.H200, params=DENSE).decode_s(2, 40) > 0
    coster = cm.StepCoster(_swa_toy(), cm.H200, params=DENSE)
    assert coster.windows == ((ATTN_PER_CTX, 64),)
    with pytest.raises(ValueError, match="pass contexts"):
        coster.decode_s(2, 40)


def test_attention_past_2_53_flops_is_summed_layer_by_layer(toy):
    """Past 2**53 a float loses integers: the sum is then the float sum of the layers."""
    new, cached = 10**8, 10**9
    want = float(ATTN_PER_CTX * cm._context_sum(new, cached, None))
    assert ATTN_PER_CTX * cm._context_sum(new, cached, None) >= 2**53
    assert cm.attention_flops(toy, new, cached) == want
    coster = cm.StepCoster(toy, cm.H100_SXM, params=DENSE)
    assert (
        coster.prefill_flops(new, cached)
        == cm.prefill(toy, cm.H100_SXM, new, cached, params=DENSE).flops
    )


# ---- parameter counts are model facts: they live in the zoo files ------------------------------
def test_parameter_counts_come_from_the_zoo_files():
    from hybridkv import models

    model = models.load("qwen3-next-80b-a3b", tp_size=2)
    assert model.params == cm.ParamCount(
        80e9, 3e9, "Qwen3-Next-80B-A3B model card: 80B total, 3B active"
    )
    assert cm.param_count(model) is model.params
    assert cm.param_count("Qwen/Qwen3-Next-80B-A3B-Instruct") == model.params
    # a model's own count wins over the zoo's entry of the same name
    mine = cm.ParamCount(2e9, 1e9, "mine")
    assert cm.param_count(dataclasses.replace(model, params=mine)) is mine
    # a model read from a config alone is matched on its name
    assert cm.param_count(dataclasses.replace(model, params=None)) == model.params


# ---- top-k sparse attention (GLM-5-Next, Qwen4-Exp) ---------------------------------------------
def _sparse_toy(topk: int, index_heads: int, pool: int) -> HybridModel:
    """The toy with its attention layer reading at most ``topk`` tokens a query, picked by an
    indexer of ``index_heads`` query heads of 64 scoring one key per ``pool`` tokens."""
    sparse = dict(TOY)
    sparse["mixers"] = [
        {**TOY["mixers"][0], "sparse_topk": topk},
        {
            "kind": "indexer",
            "index_head_dim": 64,
            "index_n_heads": index_heads,
            "pool_tokens": pool,
            "layers": [1],
        },
        TOY["mixers"][1],
    ]
    return HybridModel.from_dict(sparse)


@pytest.mark.parametrize("pool", [1, 16, 48], ids=["per-token", "kpool-16", "pool-48"])
def test_sparse_attention_reads_topk_and_the_indexer_scores_the_whole_context(pool):
    model = _sparse_toy(topk=256, index_heads=8, pool=pool)
    score = 2 * 8 * 64 / pool  # FLOPs per context token of the indexer's scoring
    # short contexts: the top-k holds them all, attention is dense
    assert cm.attention_flops(model, 1, 99) == pytest.approx((ATTN_PER_CTX + score) * 100)
    # long ones: attention reads 256 tokens a query, the indexer scores every pool
    assert cm.attention_flops(model, 1, 9_999) == pytest.approx(
        ATTN_PER_CTX * 256 + score * 10_000
    )
    prefill = cm.attention_flops(model, 1000, 0)  # query i sees min(i + 1, 256) tokens
    attended = sum(min(i + 1, 256) for i in range(1000))
    assert prefill == pytest.approx(ATTN_PER_CTX * attended + score * 1000 * 1001 / 2)
    # the decode needs the contexts, as with a sliding window, and follows the same sums
    coster = cm.StepCoster(model, cm.H200, params=DENSE)
    assert coster.windows == ((ATTN_PER_CTX, 256),)
    with pytest.raises(ValueError, match="top-k sparse layers: pass contexts"):
        coster.decode_s(2, 40)
    contexts = [10, 5000]
    expected = sum(cm.attention_flops(model, 1, c) for c in contexts)
    assert coster.decode_flops(2, 5010, contexts) == pytest.approx(
        expected + coster.per_token * 2 + coster.state_fpt * 2
    )


def test_an_indexer_with_unknown_heads_adds_no_work_and_dense_specs_keep_their_json(toy):
    # index_n_heads 0: the spec keeps the bytes only; attention alone is still capped at top-k
    model = _sparse_toy(topk=64, index_heads=0, pool=1)
    assert cm.attention_flops(model, 1, 999) == ATTN_PER_CTX * 64
    # the sparse fields appear in a spec's JSON form only where set: dense models read as before
    attn = toy.attention_layers[0].spec.to_dict()
    assert "sparse_topk" not in attn
    sparse = {layer.spec.kind: layer.spec.to_dict() for layer in model.attention_layers}
    assert sparse["full_attention"]["sparse_topk"] == 64
    assert not {"pool_tokens", "index_n_heads"} & set(sparse["indexer"])  # both at defaults
    for layer in model.attention_layers:
        assert spec_from_dict(layer.spec.to_dict()) == layer.spec
    with pytest.raises(ValueError, match="sparse_topk must be an integer >= 0"):
        _sparse_toy(topk=-1, index_heads=8, pool=1)
    with pytest.raises(ValueError, match="pool_tokens must be a positive integer"):
        _sparse_toy(topk=64, index_heads=8, pool=0)
