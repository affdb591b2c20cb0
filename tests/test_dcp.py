"""Decode context parallelism (vLLM 0.33's ``--decode-context-parallel-size``): the TP ranks
shard every attention layer's tokens, a rank's page keeps one token in ``dcp``, so an attention
block spans ``dcp`` times its rows; recurrent states are not sharded. vLLM's checks of the size,
the plans' capacity and block spans, the exported ``KVCacheConfig``, the hits the allocator
serves, the roofline, the engine's refusal and the CLI."""

from __future__ import annotations

import json
import random

import pytest
from alloc_serving import serve_prefill

from hybridkv import models
from hybridkv.alloc import AllocatorOptions, HybridAllocator
from hybridkv.alloc.check import check_consistency
from hybridkv.cli import main
from hybridkv.costmodel import H100_SXM, StepCoster
from hybridkv.layouts import make_plan
from hybridkv.vllm_export import kv_cache_config, request_blocks

QWEN = "qwen3-next-80b-a3b"  # 16 query heads, 2 KV heads: TP 8 replicates each 4 times


def _qwen(dcp: int, tp: int = 8):
    return models.load(QWEN, tp_size=tp, dcp_size=dcp)


def _tiny_gqa(heads: int, kv: int) -> dict:
    """A Qwen3-Next config.json with ``heads`` query and ``kv`` KV heads (GDN heads that TP 6
    divides)."""
    return {
        "model_type": "qwen3_next",
        "torch_dtype": "bfloat16",
        "num_hidden_layers": 4,
        "full_attention_interval": 4,
        "hidden_size": 768,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": 128,
        "linear_num_key_heads": 6,
        "linear_num_value_heads": 12,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
    }


@pytest.mark.parametrize(
    ("load", "match"),
    [
        (lambda: _qwen(3), "must divide the tensor-parallel size 8"),
        (lambda: _qwen(2, tp=2), "above the model's 2 KV heads"),
        (lambda: _qwen(8), "exceeds 4, the most for TP 8 and 2 KV heads"),
        (
            lambda: models.from_hf_config(_tiny_gqa(6, 2)).configure(tp_size=6, dcp_size=2),
            "the 3 query heads per KV head must be divisible by the decode context parallel "
            "size 2",
        ),
        (
            lambda: models.load("recurrentgemma-2b", tp_size=2, dcp_size=2),
            "sliding_window layers .*asserts dcp_world_size == 1",
        ),
        (
            lambda: models.from_hf_config("examples/glm5_next-defaults.json").configure(
                tp_size=8, dcp_size=2
            ),
            "give --cp-kv-cache-interleave-size 16",  # the rest: tests/test_dcp_sparse_mla.py
        ),
        (lambda: _qwen(0), "dcp_size must be a positive integer"),
    ],
)
def test_vllms_checks_of_the_size(load, match):
    with pytest.raises(ValueError, match=match):
        load()


def test_mla_takes_any_size_tp_divides():
    """vLLM checks KV heads only without MLA: Kimi-Linear's latent (one per token, on every
    rank) shards over all 8 ranks."""
    model = models.load("kimi-linear-48b-a3b", tp_size=8, dcp_size=8)
    assert model.dcp_size == 8
    plan = make_plan(model, "inflate", memory="20GiB", max_num_seqs=64)
    (mla,) = {g.block_size for g in plan.attention_groups}
    assert mla == 8 * plan.block_size


@pytest.mark.parametrize("layout", ["inflate", "pack", "aggregate", "per_group", "two_level"])
def test_a_rank_holds_dcp_times_the_tokens_in_the_same_bytes(layout):
    """Every layout: the same pages, pools and state slots as without DCP; each attention
    group's block spans dcp times its rows (the rows those of the plan without DCP), so the
    token capacity is exactly dcp times; state groups keep their blocks."""
    plain = make_plan(_qwen(1), layout, memory="20GiB", max_num_seqs=64)
    for dcp in (2, 4):
        plan = make_plan(_qwen(dcp), layout, memory="20GiB", max_num_seqs=64)
        assert plan.dcp_size == dcp and plan.block_size == plain.block_size
        assert plan.pools == plain.pools and plan.tensors == plain.tensors
        assert plan.kv_placements == plain.kv_placements
        for g, p in zip(plan.groups, plain.groups, strict=True):
            assert (g.kind, g.layers, g.page_bytes) == (p.kind, p.layers, p.page_bytes)
            assert g.rows_per_block == p.block_size
            assert g.block_size == p.block_size * (1 if g.is_state else dcp)
        assert plan.capacity.token_capacity == dcp * plain.capacity.token_capacity
        assert plan.capacity.state_reserved_bytes == plain.capacity.state_reserved_bytes
        ideal = plan.capacity.ideal_token_capacity
        assert (
            dcp * plain.capacity.ideal_token_capacity
            <= ideal
            < dcp * (plain.capacity.ideal_token_capacity + 1)
        )


def test_the_export_resolves_vllms_block_sizes_under_dcp():
    """vLLM 0.33's KVCacheConfig at TP 8 and DCP 4: specs keep a rank's rows (192), attention
    is dcp_sharded and Mamba is not; the hash block is the gcd of the spans (768 and 192: 192),
    and hits land on it (partial_hash_hits_enabled takes a Mamba block equal to the hash block
    under DCP), not on the 768-token scheduler block; the ranks hold different KV (1 replica);
    a request's attention blocks are cdiv(n, 768)."""
    model = _qwen(4)
    plan = make_plan(model, "inflate", memory="20GiB", max_num_seqs=64)
    config = kv_cache_config(plan, model)
    specs = [g["kv_cache_spec"] for g in config["kv_cache_groups"]]
    assert {s["block_size"] for s in specs} == {192}
    assert {s["kind"]: s["dcp_sharded"] for s in specs} == {
        "FullAttentionSpec": True,
        "MambaSpec": False,
    }
    assert plan.scheduler_block_size == 768
    assert (config["hash_block_size"], config["cache_hit_alignment_tokens"]) == (192, 192)
    assert config["kv_tp_replicas"] == 1
    assert request_blocks(plan, model, 10_000).attention == -(-10_000 // 768)
    assert request_blocks(make_plan(_qwen(1), "inflate", memory="20GiB", max_num_seqs=64),
                          _qwen(1), 10_000).attention == -(-10_000 // 192)  # fmt: skip


def test_a_resend_hits_its_tail_inside_sharded_attention_blocks():
    """vLLM's align mode with its own hash unit (the 192-token state block) and its keys at
    DCP 4: attention blocks span 768 tokens, and a resend of a 9-block prompt still hits 9
    blocks (1,728 tokens, not 1,536, the last multiple of 768: vLLM keys the prompt's tail), as
    at DCP 1; a 3-block prompt, which fills no attention block, hits its tail too."""
    rng = random.Random(7)
    for dcp in (1, 4):
        plan = make_plan(_qwen(dcp), "inflate", memory="4GiB", max_num_seqs=16)
        B = plan.block_size
        a = HybridAllocator(
            plan,
            AllocatorOptions(
                hash_block_size=B,
                max_model_len=1 << 16,
                prefill_checkpoint_alignment=None,
                partial_hit_points="keys",
            ),
        )
        for blocks in (9, 3):
            tokens = [rng.randrange(1, 50_000) for _ in range(blocks * B + 10)]
            serve_prefill(a, f"r{blocks}", tokens)
            assert a.find_longest_cache_hit([*tokens, 7]) == blocks * B
            assert a.find_longest_cache_hit([*tokens[: B + 5], 50_001]) == 0  # no state there


def test_the_roofline_reads_a_ranks_share_of_the_context():
    """Decode reads (and prefill writes) one token in dcp of the KV on a rank; the weights,
    the states and the FLOPs are the same."""
    one, four = StepCoster(_qwen(1), H100_SXM), StepCoster(_qwen(4), H100_SXM)
    kv = _qwen(1).kv_bytes_per_token
    batch, context = 8, 80_000
    assert one.decode_bytes(batch, context) - four.decode_bytes(batch, context) == pytest.approx(
        kv * (context + batch) * (1 - 1 / 4)
    )
    assert one.decode_flops(batch, context) == four.decode_flops(batch, context)
    new, cached = 512, 4096
    assert one.prefill_bytes(new, cached) - four.prefill_bytes(new, cached) == pytest.approx(
        kv * (cached + new) * (1 - 1 / 4)
    )


def test_the_engine_refuses_a_sharded_plan():
    pytest.importorskip("transformers")
    from hybridkv.e2e.states import Unservable, check_wired

    plan = make_plan(_qwen(2), "inflate", memory="4GiB", max_num_seqs=4)
    with pytest.raises(Unservable, match="decode-context-parallel ranks"):
        check_wired(plan)


def test_cli(capsys):
    argv = ["plan", "--model", QWEN, "-tp", "8", "--gpu-memory", "20GiB"]
    assert main([*argv, "-dcp", "4"]) == 0
    out = capsys.readouterr().out
    assert "TP=8  DCP=4" in out and "block 768 (192 a rank, dcp 4)" in out
    assert main([*argv, "--decode-context-parallel-size", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert {g["kind"]: (g["block_size"], g["dcp_size"]) for g in plan["groups"]} == {
        "full_attention": (768, 4),
        "state": (192, 1),
    }
    assert main([*argv, "-dcp", "3"]) == 2
    assert "must divide the tensor-parallel size 8" in capsys.readouterr().err
    sim = ["simulate", "--model", QWEN, "-tp", "8", "--gpu-memory", "20GiB", "--trace",
           "multi_turn_chat", "--requests", "8", "--json"]  # fmt: skip
    assert main([*sim, "-dcp", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["dcp_size"] == 4 and out["result"]["finished"] == 8


def test_the_doctor_says_where_hits_land(capsys):
    """Under DCP a resend or an extension of an earlier prompt can hit from the state block
    (192 tokens) on, while a prefix that different prompts share needs a whole 768-token
    attention block (vLLM keys blocks at their ends); the dcp finding gives the spans, the rows
    and the capacity against DCP 1."""
    argv = ["doctor", "--model", QWEN, "-tp", "8", "--gpu-memory", "20GiB", "--json"]
    assert main([*argv, "-dcp", "4"]) == 0
    findings = {f["key"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    data = findings["min_hit"]["data"]
    assert (data["min_shared_tokens"], data["min_shared_tokens_across_prompts"]) == (192, 768)
    assert "768-token attention blocks (sharded over 4" in findings["min_hit"]["text"]
    assert (
        "different prompts share (a system prompt) needs 768 tokens"
        in (findings["min_hit"]["text"])
    )
    dcp = findings["dcp"]["data"]
    assert (dcp["attention_block_sizes"], dcp["rows_per_block"]) == ([768], 192)
    assert dcp["token_capacity"] == 4 * dcp["token_capacity_without_dcp"]


def test_the_doctor_offers_the_largest_size_vllm_accepts(capsys):
    """Where TP replicates the KV, the doctor's remedies include DCP at the largest size vLLM's
    checks pass (Qwen3-Next at TP 8: 4, TP // its 2 KV heads; Kimi-Linear's MLA: all 8), at
    that many times the tokens; none at TP 1, none where DCP is set, none where no size passes
    (Qwen3-Next at TP 2: no more ranks than KV heads)."""

    def remedies(*argv: str) -> dict:
        assert main(["doctor", "--gpu-memory", "20GiB", "--json", *argv]) == 0
        return {r["key"]: r for r in json.loads(capsys.readouterr().out)["remedies"]}

    for model, size in ((QWEN, 4), ("kimi-linear-48b-a3b", 8)):
        got = remedies("--model", model, "-tp", "8")
        assert got["dcp"]["flags"] == ["--decode-context-parallel-size", str(size)]
        assert got["dcp"]["token_capacity"] == size * got["as_given"]["token_capacity"]
    assert "dcp" not in remedies("--model", QWEN, "-tp", "8", "-dcp", "2")
    assert "dcp" not in remedies("--model", QWEN)
    assert "dcp" not in remedies("--model", QWEN, "-tp", "2")


def test_vllm_032_shards_alike():
    """vLLM 0.32 resolves DCP as 0.33 does (the same spans, hash block and checks): under its
    rules too each attention group spans dcp times its rows, states keep theirs, and a rank
    holds dcp times the tokens."""
    from hybridkv.layouts import VllmTarget

    old = VllmTarget(version="0.32")
    plain = make_plan(_qwen(1), "inflate", memory="20GiB", max_num_seqs=64, target=old)
    plan = make_plan(_qwen(4), "inflate", memory="20GiB", max_num_seqs=64, target=old)
    for g, p in zip(plan.groups, plain.groups, strict=True):
        assert (g.rows_per_block, g.block_size) == (p.block_size, p.block_size * g.dcp_size)
        assert g.dcp_size == (1 if g.is_state else 4)
    assert plan.capacity.token_capacity == 4 * plain.capacity.token_capacity


def _shared_prefix_hits(dcp: int, points: str, shared: int) -> list[int]:
    """Four prompts sharing their first ``shared`` tokens (then 300 of their own), served in
    turn under vLLM's align rules at vLLM's own hash unit (the 192-token state block): the
    tokens each one found cached."""
    plan = make_plan(_qwen(dcp), "inflate", memory="4GiB", max_num_seqs=16)
    options = AllocatorOptions(
        hash_block_size=plan.block_size, max_model_len=1 << 16,
        prefill_checkpoint_alignment=None, partial_hit_points=points, evict_unreachable=False,
    )  # fmt: skip
    a = HybridAllocator(plan, options)
    rng = random.Random(shared)
    prefix = [rng.randrange(1, 50_000) for _ in range(shared)]
    hits = []
    for i in range(4):
        tokens = [*prefix, *(rng.randrange(50_001, 90_000) for _ in range(300))]
        a.add_request(i, tokens)
        hits.append(a.num_tokens(i))
        while a.num_tokens(i) < len(tokens):
            assert a.allocate_slots(i, a.split_prefill(i, len(tokens) - a.num_tokens(i)))
            a.take_state_copies()
        check_consistency(a)
        a.free(i)
    return hits


@pytest.mark.parametrize(
    ("shared", "vllm", "units"),
    [(500, 0, 384), (1000, 768, 960), (1900, 1536, 1728)],
)
def test_different_prompts_hit_whole_sharded_blocks_as_vllm_keys_them(shared, vllm, units):
    """vLLM keys a full attention block at its end and a prompt at its tail only (BlockPool),
    so under DCP 4 a prefix that different prompts share hits on whole 768-token blocks: the
    third and fourth prompts hit 0, 768, 1,536 tokens of a 500, 1,000, 1,900-token shared
    prefix (vLLM 0.33's KVCacheManager, run on a CPU with the same prompts, gives these), though
    the states lie every 192 tokens; hybridkv's own cache (any unit a block holds) hits on the
    192 grid. Without DCP the blocks are 192 tokens and both agree."""
    assert _shared_prefix_hits(4, "keys", shared) == [0, 0, vllm, vllm]
    assert _shared_prefix_hits(4, "units", shared) == [0, 0, units, units]
    assert _shared_prefix_hits(1, "keys", shared) == _shared_prefix_hits(1, "units", shared)


def test_the_export_refuses_a_model_at_another_dcp_size():
    plan = make_plan(_qwen(4), "inflate", memory="20GiB", max_num_seqs=64)
    with pytest.raises(ValueError, match=r"at TP 8 and DCP 4, the model given is .* DCP 1"):
        kv_cache_config(plan, _qwen(1))
