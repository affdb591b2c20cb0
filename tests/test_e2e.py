"""End to end: tiny random Bamba (Mamba-2 + attention) and Qwen3-Next (Gated DeltaNet +
attention) served by :class:`hybridkv.e2e.engine.Engine` out of every layout's plan, against the
same model run by transformers alone.

Every engine run poisons its cache memory with NaN, so a read of anything nothing wrote (a
stale slot, a page past a request's length, a block the allocator did not hand out) shows up in
the logits. Tolerance: fp32 everywhere, the two runs differ only in summation order (paged
kernels, chunked prefill, batched decode), about 1e-7; 1e-4 leaves room for longer prompts.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from hybridkv.alloc import HybridAllocator, PoolExhausted
from hybridkv.e2e import (
    build_tiny_model,
    make_tiny_plan,
    tiny_bamba_config,
    tiny_qwen3_next_config,
)
from hybridkv.e2e.engine import Engine, hf_greedy
from hybridkv.layouts import LAYOUTS
from hybridkv.target import VllmTarget

TOL = 1e-4
CONFIGS = {"bamba": tiny_bamba_config, "qwen3_next": tiny_qwen3_next_config}
MODELS = list(CONFIGS)


@functools.cache
def _model(name: str) -> torch.nn.Module:
    return build_tiny_model(CONFIGS[name]())


@functools.cache
def _reference(name: str, prompt: tuple[int, ...], n: int):
    return hf_greedy(_model(name), prompt, n)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _plan(name: str, layout: str, **kwargs):
    # two slots per request and spare checkpoint slots: the allocator's `align` prefix caching
    return make_tiny_plan(
        CONFIGS[name](), layout, state_slots_per_seq=2, cache_state_slots=4, **kwargs
    )


def _assert_matches(eng: Engine, name: str, rid: str, prompt: list[int], n: int) -> None:
    tokens, logits = _reference(name, tuple(prompt), n)
    r = eng.finished[rid]
    assert r.output == tokens, f"{rid}: engine {r.output} != transformers {tokens}"
    assert len(r.logits) == n
    for step, (got, ref) in enumerate(zip(r.logits, logits)):
        assert torch.isfinite(got).all(), f"{rid} step {step}: NaN read from the cache"
        err = (got - ref).abs().max().item()
        assert err < TOL, f"{rid} step {step}: logits differ by {err}"


# ---- the pieces ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_tiny_model_runs(name):
    cfg = CONFIGS[name]()
    with torch.no_grad():
        out = _model(name)(torch.tensor([[1, 2, 3, 4]]))
    assert out.logits.shape == (1, 4, cfg.vocab_size)


@pytest.mark.parametrize("name", MODELS)
def test_reference_is_transformers_generate(name):
    """``hf_greedy`` (the reference below) is transformers' own greedy decoding."""
    model, prompt = _model(name), _prompt(11, seed=9)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=5, do_sample=False, eos_token_id=None
        )
    assert out[0, len(prompt) :].tolist() == _reference(name, tuple(prompt), 5)[0]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", MODELS)
def test_tiny_plan_shapes(name, layout):
    cfg = CONFIGS[name]()
    plan = make_tiny_plan(cfg, layout)
    bufs = plan.allocate("cpu")
    k, v = plan.kv_views(bufs, "layers.1.attn")
    # the plan may enlarge block_size (inflate matches the state page); heads/dim are fixed
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert k.shape[2:] == (cfg.num_key_value_heads, head_dim)
    assert k.shape[1] % 16 == 0 and v.shape == k.shape
    st = plan.state_views(bufs, "layers.0.mixer")
    kernel = cfg.mamba_d_conv if name == "bamba" else cfg.linear_conv_kernel_dim
    assert st["conv"].shape[1] == kernel - 1  # vLLM's layout; the engine adds HF's extra column


# ---- serving ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", MODELS)
def test_serve_matches_transformers(name, layout):
    """Four requests of different lengths, decoded together; the third shares a 50-token prefix
    with the first and joins once the first's prefill is done, so it starts from the first's
    cached blocks and state checkpoint."""
    _serve_four(name, _plan(name, layout))


@pytest.mark.parametrize("layout", ["inflate", "two_level"])
def test_serve_from_vllms_page_contents(layout):
    """A plan in vLLM's cache formats keeps K and V side by side per token and head in every
    attention page ([tokens, heads, K | V], as vLLM 0.33 reads it): the engine's kernels read
    and write it through its strides, and serve the same tokens and logits."""
    plan = _plan("qwen3_next", layout, target=VllmTarget(cache_formats="vllm"))
    assert all(p.interleaves_kv for p in plan.kv_placements)
    _serve_four("qwen3_next", plan)


def _serve_four(name: str, plan) -> None:
    n = 4
    shared = _prompt(50, seed=1)
    a, short = [*shared, 3, 1, 4], _prompt(7, seed=2)
    b, mid = [*shared, 5, 9], _prompt(19, seed=3)
    eng = Engine(_model(name), plan)
    eng.add_request("a", a, n)
    eng.add_request("short", short, n)
    eng.step()
    while eng.running[0].computed < len(a):  # the oldest request is "a"
        eng.step()
    eng.add_request("b", b, n)
    eng.add_request("mid", mid, n)
    eng.run()
    for rid, prompt in (("a", a), ("short", short), ("b", b), ("mid", mid)):
        _assert_matches(eng, name, rid, prompt, n)
    hit = eng.finished["b"].hits[0]
    assert hit.num_cached_tokens >= 32  # every layout's block is 16, 32 or 48 tokens
    assert hit.state_copies, "a prefix hit must restore the recurrent state from a checkpoint"
    assert eng.num_checkpoints > 0 and eng.num_state_copies == len(hit.state_copies)
    assert eng.finished["a"].hits[0].num_cached_tokens == 0
    assert eng.max_decode_batch >= 3


def _tight_plan(name: str, layout: str):
    """The smallest plan (8 KiB steps) that admits three prompts a few tokens short of its
    block size together, and those lengths. One state slot per request: a spare slot would
    become a checkpoint at the block boundary and pay for the new block."""
    for kib in range(64, 2048, 8):
        try:
            plan = make_tiny_plan(
                CONFIGS[name](), layout, memory=kib * 1024, max_num_seqs=3, cache_state_slots=2
            )
        except ValueError:
            continue  # not even the states fit
        lengths = [plan.block_size - 2, plan.block_size - 3, plan.block_size - 1]
        alloc = HybridAllocator(plan, max_model_len=512)
        try:
            for i, n in enumerate(lengths):
                alloc.add_request(i, list(range(100 * i, 100 * i + n)))
                if not alloc.allocate_slots(i, n):
                    break
            else:
                return plan, lengths
        except PoolExhausted:
            continue
    raise AssertionError("no plan fits")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", MODELS)
def test_preemption_matches_transformers(name, layout):
    """Three prompts a few tokens short of a block, in memory for just their blocks: decoding
    crosses the block boundary, the newest request is preempted, re-added with its prompt plus
    what it generated so far, recomputed, and still ends exactly as transformers does."""
    n = 4
    plan, lengths = _tight_plan(name, layout)
    prompts = {rid: _prompt(k, seed=4 + i) for i, (rid, k) in enumerate(zip("xyz", lengths))}
    eng = Engine(_model(name), plan)
    eng.generate(prompts, n)
    for rid, prompt in prompts.items():
        _assert_matches(eng, name, rid, prompt, n)
    assert eng.num_preemptions > 0
    # preempted after it had generated tokens: the recompute covers prompt + outputs
    assert any(k > 0 for r in eng.finished.values() for k in r.preempted_at)


@pytest.mark.parametrize("name", MODELS)
def test_multi_turn_hit_copies_partial_block(name):
    """``last`` policy: the first turn's end state is cached at a hash-unit boundary inside a
    32-token block, so the second turn's hit also copies that block's first tokens
    (``kv_copies``)."""
    n = 4
    first = _prompt(45, seed=7)  # decode ends a step at token 48: the rolling checkpoint
    eng = Engine(_model(name), _plan(name, "pack"), checkpoint_policy="last")
    eng.generate({"t1": first}, n)
    second = first + eng.finished["t1"].output + _prompt(6, seed=8)
    eng.generate({"t2": second}, n)
    _assert_matches(eng, name, "t1", first, n)
    _assert_matches(eng, name, "t2", second, n)
    hit = eng.finished["t2"].hits[0]
    assert hit.num_cached_tokens == 48 and hit.state_copies
    if 48 % eng.plan.block_size:  # the hit ends inside a block
        assert hit.kv_copies


def test_poison_catches_unwritten_state():
    """Without resetting a fresh request's slot its state is the NaN poison: the check works."""
    eng = Engine(_model("bamba"), _plan("bamba", "per_group"))
    eng._fresh_states = lambda r: None  # type: ignore[method-assign]
    eng.generate({"p": _prompt(5, seed=0)}, 1)
    assert torch.isnan(eng.finished["p"].logits[0]).all()


@pytest.mark.parametrize("policy", ["periodic", "hash_boundary"])
@pytest.mark.parametrize("name", MODELS)
def test_hit_on_a_state_kept_inside_the_prompt(name, policy):
    """``periodic`` / ``hash_boundary`` keep states inside a prompt (the engine cannot export
    them from inside a chunk, so its prefill ends there): a second prompt sharing 70 of the
    first's 100 tokens resumes from the state at 64, and both match transformers."""
    n = 3
    first = _prompt(100, seed=11)
    eng = Engine(
        _model(name),
        _plan(name, "pack"),
        checkpoint_policy=policy,
        checkpoint_interval=32,
        prefill_chunk=128,  # no chunk ends at 64 but where the policy cuts
    )
    eng.generate({"a": first}, n)
    second = first[:70] + _prompt(9, seed=12)
    eng.generate({"b": second}, n)
    for rid, prompt in (("a", first), ("b", second)):
        tokens, _ = _reference(name, tuple(prompt), n)
        assert eng.finished[rid].output == tokens
    hit = eng.finished["b"].hits[0]
    # periodic keeps 32 and 64; hash_boundary only the first prompt's last multiple of 32 (96)
    want = 64 if policy == "periodic" else 0
    assert hit.num_cached_tokens == want
    assert bool(hit.state_copies) == bool(want)


def test_engine_refuses_exports():
    with pytest.raises(ValueError, match="cannot export"):
        Engine(_model("bamba"), _plan("bamba", "pack"), prefill_checkpoint_alignment=1)


def test_engine_builds_no_kv_events_and_refuses_a_request_for_them():
    """The engine's scheduler drops KV events, so its allocator builds none (by default), and
    options that ask for them are refused rather than built and thrown away."""
    from hybridkv.alloc import AllocatorOptions

    eng = Engine(_model("bamba"), _plan("bamba", "pack"))
    assert eng.alloc.options.kv_events is False
    with pytest.raises(ValueError, match="publishes no KV events"):
        Engine(_model("bamba"), _plan("bamba", "pack"), kv_events=True)
    with pytest.raises(ValueError, match="publishes no KV events"):
        Engine(_model("bamba"), _plan("bamba", "pack"), options=AllocatorOptions())
    quiet = Engine(_model("bamba"), _plan("bamba", "pack"), AllocatorOptions(kv_events=False))
    assert quiet.alloc.options.kv_events is False
