"""``hybridkv doctor`` reproduces what vLLM users reported, from the reports' configurations.

Each case gives the doctor what the reporter gave vLLM (the model, its state dtype, the GDN
prefill backend of their vLLM, the prompt statistics) and checks the block size and the hit
rate the report observed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv import models
from hybridkv.cli import main
from hybridkv.doctor import diagnose, prefix_trace
from hybridkv.layouts import make_plan
from hybridkv.target import VllmTarget

GIB = 2**30
# vLLM before FlashInfer's GDN prefill (the reports' 0.19-0.2x): the Triton backend, kernel
# alignment 16; Qwen3.5 configs declare a float32 SSM state (mamba_ssm_dtype)
OLD_QWEN = dict(ssm_dtype="float32")
TRITON = VllmTarget(gdn_prefill_backend="triton")


def _doctor(name, *, runtime=None, target=TRITON, trace=None, memory=40 * GIB, seqs=64):
    return diagnose(
        lambda **o: models.load(name, **o),
        runtime=runtime or {},
        memory=memory,
        max_num_seqs=seqs,
        target=target,
        trace=trace,
    )


def _as_given(d):
    return next(r for r in d.remedies if r.key == "as_given")


@pytest.mark.parametrize(
    "model, runtime, block",
    [
        pytest.param("qwen3.5-4b", OLD_QWEN, 528, id="vllm-40696-qwen3.5-4b"),
        # the real Qwen3.6 configs (NVIDIA's NVFP4 checkpoints' copies; the cache is the BF16
        # releases', bf16 KV as the reported blocks show: the NVFP4 27B's FP8 KV gives 1,568)
        pytest.param("qwen3.6-35b-a3b", OLD_QWEN, 1056, id="vllm-42317-qwen3.6-35b-a3b"),
        pytest.param("qwen3.6-27b", OLD_QWEN, 784, id="vllm-47430-qwen3.6-27b"),
        # #53749 served the BF16 checkpoint on vLLM 0.27.1: bf16 KV, the config's float32 SSM
        pytest.param("nemotron-3.5-lightning-30b-a3b", {}, 2096, id="vllm-53749-nemotron-30b-a3b"),
    ],
)
def test_reported_block_sizes_and_zero_hits_below_one_block(model, runtime, block):
    """The reported block size comes out, the minimum shared prefix is named, and prompts that
    share everything but are one block short hit 0% (as the reports observed)."""
    trace = prefix_trace(block - 16, block - 16, num_requests=16)
    d = _doctor(model, runtime=runtime, trace=trace)
    assert d.block_size == block
    assert d.finding("min_hit").data["min_shared_tokens"] == block
    assert f"shorter than {block} tokens" in d.finding("min_hit").text
    assert _as_given(d).token_hit_rate == 0.0
    assert d.finding("align_checkpoint").severity == "problem"


def test_vllm_40696_a_prompt_just_over_the_block_hits():
    """#40696: 552-token prompts hit ~95% on the 528-token block: every repeat serves one
    block, 528 of 552 tokens (63 of 64 requests repeat the first)."""
    d = _doctor("qwen3.5-4b", runtime=OLD_QWEN, trace=prefix_trace(552, 552, 64))
    assert _as_given(d).token_hit_rate == pytest.approx(63 * 528 / (64 * 552))


def test_vllm_48401_max_model_len_below_the_block():
    """#48401: NemotronH's 8,320-token block (Nemotron-3-Super with an fp8 KV cache) under
    max_model_len 4096: 0 hits, however much the prompts share; the doctor says so and offers a
    max_model_len that lets a request fill a block, where the same prompts hit."""
    target = VllmTarget(max_model_len=4096)
    trace = prefix_trace(4000, 3900, 16)
    d = _doctor("nemotron-3-super-120b-a12b", runtime={"kv_dtype": "fp8"}, target=target,
                trace=trace)  # fmt: skip
    assert d.block_size == 8320
    f = d.finding("max_model_len")
    assert f is not None and f.severity == "problem"
    assert f.data == {"max_model_len": 4096, "block_size": 8320}
    assert _as_given(d).token_hit_rate == 0.0
    fix = next(r for r in d.remedies if r.key == "max_model_len")
    assert fix.flags == ("--max-model-len", str(2 * 8320))
    # the fix alone does not make 4,000-token prompts hit: they are still shorter than a block
    assert fix.token_hit_rate == 0.0
    longer = prefix_trace(9000, 8500, 16)  # prompts that can fill a block once allowed
    d = _doctor("nemotron-3-super-120b-a12b", runtime={"kv_dtype": "fp8"},
                target=VllmTarget(max_model_len=16384), trace=longer)  # fmt: skip
    assert d.finding("max_model_len") is None
    assert _as_given(d).token_hit_rate == pytest.approx(15 * 8320 / (16 * 9000))


def test_vllm_48401_smaller_block_same_finding():
    """The same finding on Nemotron-3-Nano's 2,096-token block (bf16 KV)."""
    target = VllmTarget(max_model_len=2048)
    d = _doctor("nemotron-3-nano-30b-a3b", target=target, trace=prefix_trace(2000, 1900, 16))
    f = d.finding("max_model_len")
    assert f is not None and f.severity == "problem"
    assert f.data == {"max_model_len": 2048, "block_size": 2096}
    assert _as_given(d).token_hit_rate == 0.0


def test_remedies_predict_what_the_flags_change():
    """A bf16 SSM state halves Qwen3.5-4B's block (528 -> 272), so 450 shared tokens of a
    500-token prompt hit at 272; hybridkv's per_group layout keeps states every 64 tokens and
    serves 448 of them."""
    d = _doctor("qwen3.5-4b", runtime=OLD_QWEN, trace=prefix_trace(500, 450, 64))
    by = {r.key: r for r in d.remedies}
    assert by["as_given"].token_hit_rate == 0.0
    assert by["ssm_dtype"].block_size == 272
    assert by["ssm_dtype"].token_hit_rate == pytest.approx(63 * 272 / (64 * 500))
    assert by["hybridkv"].block_size == 16
    assert by["hybridkv"].token_hit_rate == pytest.approx(63 * 448 / (64 * 500))
    # without a workload, no hit rate is claimed
    bare = _doctor("qwen3.5-4b", runtime=OLD_QWEN)
    assert all(r.token_hit_rate is None for r in bare.remedies)
    assert bare.finding("align_checkpoint") is None


def test_fp8_capacity_is_measured_on_the_plans():
    d = _doctor("qwen3.5-4b", runtime=OLD_QWEN)
    f = d.finding("fp8")
    assert f.data["block_size_bf16"] == 528 and f.data["block_size_fp8"] == 1056
    assert 1.0 <= f.data["capacity_ratio"] <= 2.2
    assert f"{f.data['capacity_ratio']:.2f}x" in f.text


@pytest.mark.parametrize(
    "max_model_len, low, high",
    [
        # a request no longer than one fp8 block takes one attention block either way: 1.00x
        # (the pages differ by a few bytes, so the block counts by a fraction of a percent)
        pytest.param(2048, 1.0, 1.005, id="max-model-len-2048"),
        pytest.param(32768, 1.3, 1.5, id="max-model-len-32k"),
        # the model's own 262,144 tokens: 126 -> 63 attention blocks beside 12 state blocks
        pytest.param(None, 1.8, 1.9, id="max-model-len-default"),
    ],
)
def test_vllm_55196_fp8_logs_less_than_twice_the_capacity(max_model_len, low, high):
    # vLLM #55196: fp8 KV gives 1.00-1.84x the logged capacity on hybrids. The pool's token
    # slots double; the log counts each max_model_len request's state blocks as well
    target = VllmTarget(max_model_len=max_model_len)
    f = _doctor("nemotron-3-nano-30b-a3b", target=target).finding("fp8")
    assert f.data["capacity_ratio"] == pytest.approx(2.0, abs=0.01)
    assert low <= f.data["logged_ratio"] <= high
    assert f"{f.data['logged_ratio']:.2f}x" in f.text and "#55196" in f.text
    assert f.severity == "note"


def test_fp8_above_twice_says_the_reserved_states_decide():
    """Qwen3.5-27B at 40 GiB: 256 requests' states take 98% of the cache, so the blocks left
    beside them (18 of 832 tokens in bf16, 50 of 1,600 in fp8: fp8's page is a little smaller)
    give 5.34x; the finding says why rather than calling it about 2x."""
    target = VllmTarget(max_model_len=32768)
    d = _doctor("qwen3.5-27b", runtime={"kv_dtype": "fp8"}, target=target, seqs=256)
    f = d.finding("fp8")
    model = models.load("qwen3.5-27b")
    plans = {
        kv: make_plan(
            model.configure(kv_dtype=kv), "inflate", memory=40 * GIB, max_num_seqs=256,
            target=target,
        )
        for kv in ("auto", "fp8")
    }  # fmt: skip
    blocks = {kv: p.capacity.token_capacity // p.block_size for kv, p in plans.items()}
    assert f.data["capacity_ratio"] > 2.05
    share = plans["auto"].capacity.state_reserved_bytes / (40 * GIB)
    assert share > 0.9
    assert f"take {100 * share:.0f}% of the cache" in f.text
    assert f"{blocks['auto']:,} of 832 tokens in bfloat16" in f.text
    assert f"{blocks['fp8']:,} of 1600 in fp8_e4m3" in f.text
    assert "about what attention-only" not in f.text


@pytest.mark.parametrize("name", ["bamba-9b", "recurrentgemma-2b", "zamba-7b-v1", "minimax-m1"])
def test_a_model_vllm_does_not_serve_is_refused(name):
    """The doctor once diagnosed these as if vLLM 0.33 served them (RecurrentGemma: 'no hit
    below 1 token')."""
    with pytest.raises(ValueError, match=r"serve.*no vLLM prefix cache for the doctor"):
        _doctor(name, target=VllmTarget())


def test_hit_block_without_full_attention_groups_is_the_block():
    """Sliding-window groups alone need no whole-prefix hit: the block, not lcm() = 1."""
    from hybridkv.doctor import _hit_block

    plan = make_plan(models.load("recurrentgemma-2b"), "inflate", memory=4 * GIB)
    assert {g.kind for g in plan.groups} == {"sliding_window", "state"}
    assert _hit_block(plan) == plan.block_size > 1


def test_logged_capacity_follows_vllms_formula():
    # get_kv_cache_capacity in vLLM 0.33, by hand: num_blocks / (attention groups x
    # cdiv(max_model_len, block) + state groups x state blocks) x max_model_len
    from hybridkv.layouts import make_plan
    from hybridkv.vllm_export import kv_cache_config, logged_capacity

    model = models.load("qwen3-next-80b-a3b")
    plan = make_plan(
        model, "inflate", memory=40 * GIB, max_num_seqs=64,
        target=VllmTarget(max_model_len=10_000),
    )  # fmt: skip
    got = logged_capacity(plan, model)
    config = kv_cache_config(plan, model)
    kinds = [g["kv_cache_spec"]["kind"] for g in config["kv_cache_groups"]]
    # 12 attention layers and 36 Gated DeltaNet layers: one attention group, three state
    # groups; align mode on Hopper keeps 2 + 1 prefill-checkpoint state blocks per group
    assert sorted(kinds) == ["FullAttentionSpec"] + ["MambaSpec"] * 3
    per_request = -(-10_000 // plan.block_size) + 3 * 3
    assert got.blocks_per_request == per_request
    assert got.tokens == int(config["num_blocks"] / per_request * 10_000)
    assert got.max_concurrency == pytest.approx(config["num_blocks"] / per_request)


def test_cli_doctor_json_and_text(capsys):
    args = [
        "doctor", "--model", "qwen3.5-4b", "--mamba-ssm-cache-dtype", "float32",
        "--gdn-prefill-backend", "triton", "--prompt-len", "500", "--shared-prefix", "450",
        "--requests", "8", "--max-num-seqs", "64",
    ]  # fmt: skip
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == 1 and out["block_size"] == 528
    assert {f["key"] for f in out["findings"]} >= {"block_size", "min_hit", "fp8"}
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "528-token attention blocks" in text and "--mamba-ssm-cache-dtype bfloat16" in text


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt-len", "500"], "--prompt-len and --shared-prefix go together"),
        (
            ["--trace", "shared_prefix", "--prompt-len", "5", "--shared-prefix", "1"],
            "not both",
        ),
        (["--prompt-len", "500", "--shared-prefix", "600"], "--shared-prefix must be in"),
    ],
)
def test_cli_doctor_refuses_contradictory_workloads(extra, message, capsys):
    assert main(["doctor", "--model", "qwen3.5-4b", *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_large_state_gets_fewer_cached_state_slots_not_an_abort():
    """Nemotron-3-Ultra's state is 0.4 GiB a request: at 120 GiB and 256 requests vLLM's
    flags plan, but per_group with as many cached-state slots as requests (194.9 GiB) does
    not. The doctor halves those slots until the plan fits and says how many it kept, rather
    than stopping on that one remedy."""
    d = _doctor(
        "nemotron-3-ultra-550b-a55b", memory=120 * GIB, seqs=256, trace=prefix_trace(900, 800)
    )
    hybrid = next(r for r in d.remedies if r.key == "hybridkv")
    assert hybrid.block_size == 16 and hybrid.token_hit_rate is not None
    slots = int(hybrid.why.split(" slots for cached states")[0].rsplit(" ", 1)[-1])
    assert 0 < slots < 256 and slots & (slots - 1) == 0  # halved from 256, a power of two
    with pytest.raises(ValueError, match=r"plus 256 slots for cached states.*--cache-state-slots"):
        make_plan(
            models.load("nemotron-3-ultra-550b-a55b"),
            "per_group",
            memory=120 * GIB,
            max_num_seqs=256,
            cache_state_slots=256,
        )


def test_doctor_plans_vllms_cache_formats(capsys):
    """The doctor describes what vLLM runs: Qwen4-Exp's QSA indexer in vLLM 0.33's formats
    (compressed keys, a per-request ring), whose capacity differs from transformers' per-token
    rows; with a workload it simulates that plan (the ring served as vLLM serves it), and its
    hybridkv remedy plans hybridkv's own layout in transformers' formats."""
    example = Path(__file__).resolve().parent.parent / "examples" / "qwen4_exp-qsa.json"
    args = ["doctor", "--model", str(example), "--prompt-len", "1200", "--shared-prefix", "1100"]
    assert main([*args, "--requests", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = models.from_hf_config(example)
    memory, seqs = 40 * 2**30, 256
    vllm = make_plan(
        model, "inflate", memory=memory, max_num_seqs=seqs, target=VllmTarget(cache_formats="vllm")
    )
    ours = make_plan(model, "inflate", memory=memory, max_num_seqs=seqs)
    assert vllm.capacity.token_capacity != ours.capacity.token_capacity
    as_given = next(r for r in out["remedies"] if r["key"] == "as_given")
    assert as_given["token_capacity"] == vllm.capacity.token_capacity
    assert as_given["token_hit_rate"] is not None  # simulated
    ours_remedy = next(r for r in out["remedies"] if r["key"] == "hybridkv")
    assert ours_remedy["flags"][0] == "hybridkv layout per_group"
    per_group = make_plan(
        model, "per_group", memory=memory, max_num_seqs=seqs, cache_state_slots=seqs
    )
    assert ours_remedy["token_capacity"] == per_group.capacity.token_capacity


def _pages(plan, model, tokens):
    """vLLM 0.33's pages for a request of ``tokens`` (get_max_concurrency_for_kv_cache_config by
    hand, from the exported groups): an attention group cdiv(tokens, block), a Mamba group its
    state blocks, a ring one; and the pool's pages less the null block."""
    from hybridkv.vllm_export import kv_cache_config

    config = kv_cache_config(plan, model)
    per_request = 0
    for group in config["kv_cache_groups"]:
        spec = group["kv_cache_spec"]
        kinds = {s["kind"] for s in spec.get("kv_cache_specs", {}).values()} or {spec["kind"]}
        if kinds == {"MambaSpec"}:
            per_request += plan.vllm.state_blocks_per_request
        elif kinds == {"CircularBufferSpec"}:
            per_request += 1
        else:
            per_request += -(-tokens // spec["block_size"])
    return per_request, config["num_blocks"] - 1


def test_states_that_do_not_fit_limit_concurrency_not_the_start():
    """GLM-5-Next at 40 GiB and 256 sequences: 256 requests' states need more pages than the
    pool has, but vLLM reserves none up front; it starts and runs as many requests as their
    pages allow. The doctor says so (it used to refuse), plans that many requests' states and
    still predicts hit rates (0% below one 4,608-token block, as vLLM serves it)."""
    example = Path(__file__).resolve().parent.parent / "examples" / "glm5_next-defaults.json"
    target = VllmTarget(cache_formats="vllm")
    model = models.from_hf_config(example)
    with pytest.raises(ValueError, match="too small"):
        make_plan(model, "inflate", memory=40 * GIB, max_num_seqs=256, target=target)
    trace = prefix_trace(2000, 1500, num_requests=8)
    d = diagnose(
        lambda **o: models.from_hf_config(example, **o),
        runtime={}, memory=40 * GIB, max_num_seqs=256, target=target, trace=trace,
    )  # fmt: skip
    f = d.finding("concurrency")
    assert f.severity == "problem" and "vLLM reserves none up front, so it starts" in f.text
    one = make_plan(model, "inflate", memory=40 * GIB, max_num_seqs=1, target=target)
    per_request, pool = _pages(one, model, 2000)
    n = f.data["concurrent_requests"]
    assert n == pool // per_request and 1 < n < 256
    assert f.data["pages_per_request"] == per_request == 12 + 1 + 1  # states, ring, latents
    as_given = _as_given(d)
    planned = make_plan(model, "inflate", memory=40 * GIB, max_num_seqs=n, target=target)
    assert as_given.token_capacity == planned.capacity.token_capacity
    assert as_given.token_hit_rate == 0.0  # a 1,500-token shared prefix, 4,608-token blocks


def test_concurrency_counts_vllms_pages():
    """Qwen3-Next at 40 GiB: the plan's states fit, and the concurrency is vLLM's page count
    for the workload's mean request (each takes 9 state pages beside its attention blocks)."""
    trace = prefix_trace(3000, 100, num_requests=8)
    d = _doctor("qwen3-next-80b-a3b", target=VllmTarget(), seqs=256, trace=trace)
    model = models.load("qwen3-next-80b-a3b")
    plan = make_plan(model, "inflate", memory=40 * GIB, max_num_seqs=256)
    mean = round(d.workload["mean_request"])
    per_request, pool = _pages(plan, model, mean)
    f = d.finding("concurrency")
    assert f.data["concurrent_requests"] == min(256, pool // per_request)
    assert f.data["pages_per_request"] == per_request == 9 + -(-mean // plan.block_size)


def test_a_max_model_len_request_that_does_not_fit_stops_vllm():
    """vLLM raises at start-up when one max_model_len request does not fit: the doctor says so,
    with the longest max_model_len that would fit, and that length does start (one block more
    does not)."""
    small = 2 * GIB
    with pytest.raises(ValueError, match="would not start") as refused:
        _doctor("qwen3-next-80b-a3b", target=VllmTarget(), memory=small)
    longest = int(refused.value.args[0].rsplit("(to ", 1)[1].split(" ")[0].replace(",", ""))
    d = _doctor("qwen3-next-80b-a3b", target=VllmTarget(max_model_len=longest), memory=small)
    assert d.finding("concurrency").data["concurrent_requests"] >= 1
    with pytest.raises(ValueError, match="would not start"):
        _doctor(
            "qwen3-next-80b-a3b",
            target=VllmTarget(max_model_len=longest + d.block_size),
            memory=small,
        )
