"""End to end for every hybrid family beyond Bamba and Qwen3-Next (tests/test_e2e.py): tiny random
Falcon-H1, GraniteMoeHybrid, NemotronH, Zamba2, Qwen3.5, Jamba, LFM2, LFM3, RecurrentGemma,
Kimi-Linear, Bailing hybrid (MLA with rotary and an output gate), GLM-5-Next (NoPE MLA with a
sparse-attention indexer: DSA), GraniteSWA and GraniteMoeSWA (attention sinks in the paged
kernels) served by :class:`hybridkv.e2e.engine.Engine` out of every layout's plan, against the
same model run by transformers alone, MiniMax included (its own MiniMaxCache), the
pure-recurrent RWKV-4 (its five-tensor ``state`` argument) and xLSTM (its xLSTMCache), ZAYA
(GQA after Compressed Convolutional Attention, whose conv window and delayed value half live in
the attention layer's cache) and Inkling (a relative-position bias on every logit, in the paged
kernels, and four short-conv states in the attention layer's cache, each run by its own
module) and Qwen4-Exp (gated GQA behind a QSA indexer: each query token's list through the
decode kernel's sparse walk; its PLE conv window in the plan's slots and its n-gram context
from the request's tokens; tests/test_e2e_qwen4.py checks its parts one by one).

The serving test runs each family on two of the five layouts (rotating; every layout is served
by several families); ``HYBRIDKV_FULL_E2E=1`` serves every family out of every layout.

Every engine run poisons its cache memory with NaN (the null block included), so a read of
anything nothing wrote (a stale slot, a page past a request's length, a block a sliding window
dropped) shows up in the logits. Tolerance: fp32 everywhere, the runs differ only in summation
order (paged kernels, batched decode, Jamba's and RecurrentGemma's token-by-token prefill),
about 1e-7 to 1e-6; 1e-4 as in tests/test_e2e.py.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

pytest.importorskip("transformers")

from hybridkv.e2e import build_tiny_model, hybrid_model_for, make_tiny_plan, states
from hybridkv.e2e.engine import Engine, hf_greedy
from hybridkv.e2e.families import REFUSED, TINY_CONFIGS
from hybridkv.layouts import LAYOUTS

TOL = 1e-4
N = 3  # tokens generated per request
# bamba and qwen3_next have their own file
FAMILIES = [f for f in TINY_CONFIGS if f not in ("bamba", "qwen3_next", *REFUSED)]
#: those with recurrent states (GraniteSWA's are sliding-window and full attention only)
STATEFUL = [f for f in FAMILIES if hybrid_model_for(TINY_CONFIGS[f]()).state_layers]
#: those with attention pages: a plan of RWKV or xLSTM (states only) holds no tokens, so a
#: running request never needs more memory and nothing is ever preempted
PAGED = [f for f in FAMILIES if hybrid_model_for(TINY_CONFIGS[f]()).attention_layers]


@functools.cache
def _model(name: str) -> torch.nn.Module:
    return build_tiny_model(TINY_CONFIGS[name]())


@functools.cache
def _reference(name: str, prompt: tuple[int, ...], n: int):
    return hf_greedy(_model(name), prompt, n)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_matches(eng: Engine, name: str, rid: str, prompt: list[int]) -> None:
    tokens, logits = _reference(name, tuple(prompt), N)
    r = eng.finished[rid]
    assert r.output == tokens, f"{name} {rid}: engine {r.output} != transformers {tokens}"
    assert len(r.logits) == N
    for step, (got, ref) in enumerate(zip(r.logits, logits)):
        assert torch.isfinite(got).all(), f"{name} {rid} step {step}: NaN read from the cache"
        err = (got - ref).abs().max().item()
        assert err < TOL, f"{name} {rid} step {step}: logits differ by {err}"


def test_tiny_references_are_not_degenerate():
    """Greedy tokens that vary: a tiny model that repeats its last input token would make
    token equality a weak check (why some configs untie their output embedding)."""
    for name in FAMILIES:
        tokens, _ = _reference(name, tuple(_prompt(7, seed=2)), N)
        assert len(set(tokens)) > 1 or tokens[0] != _prompt(7, seed=2)[-1], (name, tokens)


def test_stateful_families_are_the_hybrids():
    assert set(FAMILIES) - set(STATEFUL) == {"granite_swa", "granitemoe_swa"}
    assert set(FAMILIES) - set(PAGED) == {"rwkv", "xlstm"}


def _own_state(out) -> tuple[object, str]:
    """The state an RWKV or xLSTM forward returned and the forward's keyword for it."""
    if getattr(out, "state", None) is not None:
        return out.state, "state"
    return out.cache, "cache"


def _tensors(held) -> list[torch.Tensor]:
    """The tensors of RWKV's state list (the five ``[B, hidden, layers]``) or of an xLSTMCache
    (every layer's C, n, m)."""
    if isinstance(held, list):
        return list(held)
    return [t for layer in held.rnn_state.values() for t in layer]


@pytest.mark.parametrize("name", STATEFUL)
def test_states_matter(name):
    """The comparisons can see a lost state: transformers continuing 48 tokens in from zeroed
    recurrent states (the cache's, MiniMax's linear cache, RecurrentGemma's module
    attributes, RWKV's state list, xLSTM's rnn_state) ends far outside the tolerance."""
    model, p = _model(name), torch.tensor([_prompt(54, seed=1)])
    kinds = hybrid_model_for(model.config).layer_kinds
    if name in ("rwkv", "xlstm"):  # the model's own state, built and returned by its forward
        with torch.no_grad():
            full = model(p).logits[0, -1]
            held, argument = _own_state(model(p[:, :48], use_cache=True))
            for t in _tensors(held):
                t.zero_()
            cont = model(p[:, 48:], use_cache=True, **{argument: held}).logits[0, -1]
        assert (full - cont).abs().max().item() > 100 * TOL
        return
    cache = states.cache_factory(model.config, kinds)()  # MiniMax's forward takes only its own
    with torch.no_grad():
        full = model(p).logits[0, -1]
        model(p[:, :48], cache=cache, use_cache=True)
        for t in getattr(cache, "linear_cache", []):
            if isinstance(t, torch.Tensor):
                t.zero_()
        for layer in cache.layers:
            for held in (
                getattr(layer, "conv_states", {}),
                getattr(layer, "recurrent_states", {}),
            ):
                for t in held.values():
                    if t is not None:
                        t.zero_()
        for m in model.modules():
            if getattr(m, "conv1d_state", None) is not None:
                m.conv1d_state.zero_()
                m.rg_lru.recurrent_states.zero_()
        pos = torch.arange(48, 54)[None]
        cont = model(p[:, 48:], position_ids=pos, cache=cache, use_cache=True).logits[0, -1]
    assert (full - cont).abs().max().item() > 100 * TOL


def serve_cases(full: bool) -> list[tuple[str, str]]:
    """(family, layout) pairs :func:`test_serve_matches_transformers` serves: with ``full``
    every family on every layout; else each family on two layouts, rotating with the family
    (``i + 1`` and ``i + 3``, so that together with the preemption test's ``i`` every family
    with attention pages meets four of the five), every layout served by several families. A
    layout's own code does not depend on the family: ``tests/test_layouts.py`` checks every
    plan's views and ``tests/test_e2e.py`` serves Bamba and Qwen3-Next out of all five."""
    if full:
        return [(name, layout) for name in FAMILIES for layout in LAYOUTS]
    n = len(LAYOUTS)
    return [(name, LAYOUTS[(i + k) % n]) for i, name in enumerate(FAMILIES) for k in (1, 3)]


#: ``HYBRIDKV_FULL_E2E=1``: every family on every layout (about three times as long)
SERVE_CASES = serve_cases(os.environ.get("HYBRIDKV_FULL_E2E") == "1")


def test_every_layout_is_served_by_several_families():
    cases = serve_cases(full=False)
    for layout in LAYOUTS:
        assert sum(lay == layout for _, lay in cases) >= 3, layout
    for name in FAMILIES:
        assert len({lay for n, lay in cases if n == name}) == 2, name
    assert len(serve_cases(full=True)) == len(FAMILIES) * len(LAYOUTS)


@pytest.mark.parametrize(
    ("name", "layout"), SERVE_CASES, ids=[f"{n}-{lay}" for n, lay in SERVE_CASES]
)
def test_serve_matches_transformers(name, layout):
    """Three requests decoded together; "b" shares a prefix of a block and more with "a" and
    joins once a's prefill is done, so it starts from a's cached blocks and state checkpoint."""
    plan = make_tiny_plan(TINY_CONFIGS[name](), layout, state_slots_per_seq=2, cache_state_slots=4)
    shared = _prompt(max(50, plan.block_size + 4), seed=1)
    a, b, short = [*shared, 3, 1, 4], [*shared, 5, 9], _prompt(7, seed=2)
    # a prefill chunk reaches the next checkpoint (Kimi-Linear's MLA pages are 64 or 128)
    eng = Engine(_model(name), plan, prefill_chunk=max(64, plan.block_size))
    eng.add_request("a", a, N)
    eng.add_request("short", short, N)
    eng.step()
    while eng.running[0].computed < len(a):  # the oldest request is "a"
        eng.step()
    eng.add_request("b", b, N)
    eng.run()
    for rid, prompt in (("a", a), ("short", short), ("b", b)):
        _assert_matches(eng, name, rid, prompt)
    hit = eng.finished["b"].hits[0]
    assert hit.num_cached_tokens >= min(32, plan.block_size)  # blocks: 16 to 128 tokens
    if name in STATEFUL:
        assert hit.state_copies, "a prefix hit must restore the recurrent state from a checkpoint"
        assert eng.num_checkpoints > 0
    assert eng.max_decode_batch >= 2


#: the families whose attention is MLA (a latent page: one row per token, no V)
MLA_FAMILIES = [f for f in FAMILIES if "mla" in hybrid_model_for(TINY_CONFIGS[f]()).layer_kinds]


def test_mla_families():
    assert set(MLA_FAMILIES) == {"kimi_linear", "bailing_hybrid", "glm5_next"}


#: the families whose prefill runs each prompt token as a row of a decode kernel (MLA's
#: absorbed attention; Qwen4-Exp's QSA, each query token with its own token list): slow under
#: the interpreter, so their prompt-per-block tests take the layouts with small pages
ROW_PREFILL_FAMILIES = [
    f
    for f in FAMILIES
    if {"mla", "indexer"} & set(hybrid_model_for(TINY_CONFIGS[f]()).layer_kinds)
]


def test_row_prefill_families():
    assert set(ROW_PREFILL_FAMILIES) == {*MLA_FAMILIES, "qwen4_exp"}


@pytest.mark.parametrize("name", MLA_FAMILIES)
def test_mla_hit_inside_a_latent_page_copies_its_first_rows(name):
    """``last``: the first turn's end state is cached at token 48, inside a 64-token latent
    page, so the second turn's hit copies that page's first 48 latent rows into a page of its
    own (``kv_copies`` of an MLA group: no V to copy; GLM-5-Next's indexer rows likewise, in
    their own group) and still matches transformers."""
    plan = make_tiny_plan(TINY_CONFIGS[name](), "two_level", cache_state_slots=4)
    assert plan.block_size == 64
    first = _prompt(45, seed=7)  # decode ends a step at token 48: the rolling checkpoint
    eng = Engine(_model(name), plan, checkpoint_policy="last")
    eng.generate({"t1": first}, N + 1)
    second = first + eng.finished["t1"].output + _prompt(6, seed=8)
    eng.generate({"t2": second}, N)
    _assert_matches(eng, name, "t2", second)
    hit = eng.finished["t2"].hits[0]
    assert hit.num_cached_tokens == 48 and hit.state_copies
    copied = [(g.group_id, 48) for g in plan.groups if g.kind in ("mla", "indexer")]
    assert [(gid, n) for gid, _, _, n in hit.kv_copies] == copied
    assert eng.num_kv_copies == len(copied) == (2 if name == "glm5_next" else 1)


def _preemption_layout(name: str) -> str:
    """The layout :func:`test_preemption_matches_transformers` preempts ``name`` on: rotating
    with the family; a family of :data:`ROW_PREFILL_FAMILIES` takes the first of its rotation
    with small pages (per_group, two_level: MLA's latent pages are 64 tokens there and 128 on
    the shared-page layouts, and the prompts are a block long)."""
    i, n = FAMILIES.index(name), len(LAYOUTS)
    order = [LAYOUTS[(i + k) % n] for k in range(n)]
    if name in ROW_PREFILL_FAMILIES:
        order = [lay for lay in order if lay in ("per_group", "two_level")]
    return order[0]


def test_every_layout_is_preempted_in_some_family():
    assert {_preemption_layout(name) for name in PAGED} == set(LAYOUTS)


@pytest.mark.parametrize("name", PAGED)
def test_preemption_matches_transformers(name):
    """Three prompts a few tokens short of a block in the smallest plan holding three blocks:
    decoding crosses the block boundary, the newest request is preempted, recomputed with its
    outputs so far, and still ends as transformers does. The layout rotates with the family
    (every layout is preempted in some family)."""
    layout = _preemption_layout(name)
    cfg = TINY_CONFIGS[name]()
    bs = make_tiny_plan(cfg, layout, max_num_seqs=3).block_size
    for _ in range(3):  # pack's block size depends on the memory
        plan = make_tiny_plan(cfg, layout, fit_tokens=3 * bs, max_num_seqs=3)
        if plan.block_size == bs:
            break
        bs = plan.block_size
    assert plan.block_size == bs
    lengths = [bs - 2, bs - 3, bs - 1]
    prompts = {rid: _prompt(k, seed=4 + i) for i, (rid, k) in enumerate(zip("xyz", lengths))}
    eng = Engine(_model(name), plan, prefill_chunk=max(64, plan.block_size))
    eng.generate(prompts, N + 2)
    for rid, prompt in prompts.items():
        tokens, logits = _reference(name, tuple(prompt), N + 2)
        assert eng.finished[rid].output == tokens, (rid, eng.finished[rid].output, tokens)
        err = max((g - r).abs().max().item() for g, r in zip(eng.finished[rid].logits, logits))
        assert err < TOL
    assert eng.num_preemptions > 0


def test_sliding_window_drops_blocks_and_kernels_honour_the_window():
    """RecurrentGemma's local attention (window 16) through the kernels' window path: the
    allocator hands the blocks behind the window back (their table entries become the
    NaN-poisoned null block), the output still matches, and without the window the kernels
    read those blocks."""
    name, window = "recurrent_gemma", TINY_CONFIGS["recurrent_gemma"]().attention_window_size
    prompt = _prompt(70, seed=13)
    plan = make_tiny_plan(TINY_CONFIGS[name](), "per_group")
    (group,) = [g for g in plan.groups if g.kind == "sliding_window"]
    assert group.sliding_window == window
    tables = []

    def table(out):
        if eng.running:
            tables.append(eng.alloc.block_tables(["p"])[group.group_id][0].tolist())

    eng = Engine(_model(name), plan, on_step=table)
    eng.generate({"p": prompt}, N)
    _assert_matches(eng, name, "p", prompt)
    dropped = (len(prompt) - window) // plan.block_size
    assert dropped >= 2 and len(set(tables[-1][:dropped])) == 1  # all the null block
    assert len(set(tables[0][:dropped])) == dropped  # they were real blocks once

    eng = Engine(_model(name), plan)
    eng.ctx.windows = dict.fromkeys(eng.ctx.windows)  # full attention over dropped blocks
    eng.generate({"p": prompt}, 1)
    assert not torch.isfinite(eng.finished["p"].logits[0]).all()


def test_stepping_is_what_lets_jamba_continue_a_state(monkeypatch):
    """Jamba's Mamba-1 prefill starts from a zero state whatever it is given; without the
    engine's token-by-token stepping a prefix hit's tail would ignore the restored state."""
    name = "jamba"
    shared = _prompt(50, seed=1)
    a, b = [*shared, 3, 1, 4], [*shared, 5, 9]
    plan = make_tiny_plan(TINY_CONFIGS[name](), "per_group", state_slots_per_seq=2)
    eng = Engine(_model(name), plan)
    monkeypatch.setattr(states, "_stepping", lambda: False)
    eng.generate({"a": a}, N)
    eng.generate({"b": b}, N)
    assert eng.finished["b"].hits[0].num_cached_tokens > 0
    got, ref = eng.finished["b"].logits[0], _reference(name, tuple(b), N)[1][0]
    assert (got - ref).abs().max().item() > TOL


def test_qwen3_5_keeps_its_ssm_state_in_fp32():
    """A bf16 Qwen3.5 (``mamba_ssm_dtype: float32``, as released): the plan keeps the Gated
    DeltaNet state in fp32 and the conv state in bf16, exactly what transformers' cache holds
    after a bf16 forward, so the engine's hand-over loses nothing. (End to end in bf16 is not
    run: the paged attention kernels return garbage for bf16 under the Triton interpreter.)"""
    from transformers import DynamicCache

    from hybridkv.e2e.states import FORMATS

    cfg = TINY_CONFIGS["qwen3_5"]()
    plan = make_tiny_plan(cfg, "per_group", dtype="bfloat16")
    (p,) = plan.state_placements
    views = plan.state_views(plan.allocate("cpu"), p.layer)
    assert views["conv"].dtype == torch.bfloat16 and views["ssm"].dtype == torch.float32
    model = build_tiny_model(cfg, dtype=torch.bfloat16)
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        model(torch.tensor([_prompt(9, seed=3)]), cache=cache, use_cache=True)
    fmt = FORMATS[p.kind]
    for part, held in (("conv", cache.get_conv_state(0)), ("ssm", cache.get_recurrent_state(0))):
        mine = fmt.to_hf(part, views[part][:1])
        assert (mine.dtype, mine.shape) == (held.dtype, held.shape), part
        back = fmt.to_hf(part, fmt.from_hf(part, held))
        if part == "conv":  # the oldest column, which only feeds discarded outputs, is zeroed
            back, held = back[..., 1:], held[..., 1:]
        assert torch.equal(back, held), part


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["rwkv", "xlstm"])
def test_pure_recurrent_states_fill_their_slots_byte_for_byte(name, dtype):
    """The state RWKV (five ``[B, hidden, layers]`` tensors) and xLSTM (``rnn_state``) leave
    after a forward goes to the plan's layout (the engine's ``store``) with each slot's exact
    shape and dtype, the spec's ``state_bytes`` per request and layer (the formula
    tests/test_hf_cache_bytes.py checks against transformers), and comes back (``load`` into a
    fresh state, every layer) bit for bit: the engine keeps all of it, in the plan's bytes."""
    cfg = TINY_CONFIGS[name]()
    plan = make_tiny_plan(cfg, "per_group", dtype=dtype)
    buffers, hybrid = plan.allocate("cpu"), hybrid_model_for(cfg, dtype)
    model = build_tiny_model(cfg, dtype=getattr(torch, dtype))
    batch = torch.tensor([_prompt(9, seed=3), _prompt(9, seed=4)])
    with torch.no_grad():
        held, _ = _own_state(model(batch, use_cache=True))
    fresh = states.cache_factory(cfg, [p.kind for p in plan.state_placements])()
    assert len(plan.state_placements) == cfg.num_hidden_layers
    for p in plan.state_placements:
        fmt, views = states.FORMATS[p.kind], plan.state_views(buffers, p.layer)
        module = fmt.module_of(model, p.layer_index)
        mine = fmt.store(held, module, p.layer_index)
        assert set(mine) == set(views) == set(fmt.parts)
        for part, t in mine.items():
            assert (t.shape[1:], t.dtype) == (views[part].shape[1:], views[part].dtype), part
        assert (
            sum(t.nbytes for t in mine.values())
            == 2 * hybrid.layers[p.layer_index].spec.state_bytes
        )
        fmt.load(fresh, module, p.layer_index, mine)
    for got, ref in zip(_tensors(fresh), _tensors(held), strict=True):
        assert got.dtype == ref.dtype and torch.equal(got, ref)


def test_rwkv_decodes_one_sequence_per_mixer_call():
    """transformers' RWKV one-token forward is right for one sequence only (it adds the
    ``[B, hidden]`` shift state to the ``[B, 1, hidden]`` input: ``[B, B, hidden]``); the engine
    runs RWKV's decoders as one packed forward of one-token segments. Batched as the other
    families' are, two requests decoding together leave transformers' tokens."""
    name, prompts = "rwkv", {"x": _prompt(7, seed=2), "y": _prompt(9, seed=3)}
    plan = make_tiny_plan(TINY_CONFIGS[name](), "per_group")
    eng = Engine(_model(name), plan)
    assert not eng.batched_decode
    eng.generate(prompts, N)
    for rid, prompt in prompts.items():
        _assert_matches(eng, name, rid, prompt)
    assert eng.max_decode_batch == 2
    eng = Engine(_model(name), plan)
    eng.batched_decode = True
    eng.generate(prompts, N)
    assert any(
        eng.finished[r].output != _reference(name, tuple(p), N)[0] for r, p in prompts.items()
    )


def _zaya_cache(model: torch.nn.Module, ids: torch.Tensor):
    """transformers' DynamicCache after a ZAYA forward of ``ids``: every layer's K / V and its
    CCA state (``conv_states[0]``, ``recurrent_states[0]``)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cca_state_fills_its_slots_byte_for_byte(dtype):
    """ZAYA's CCA state after a forward (each layer's q / k conv window ``[B, (heads + KV heads)
    * head_dim, time0 + time1 - 2]`` and delayed value half ``[B, KV heads * head_dim / 2]``)
    goes to the plan's layout (the engine's ``store``) with each slot's exact shape and dtype,
    the spec's ``state_bytes`` per request and layer (the formula tests/test_hf_cache_bytes.py
    checks against transformers), through the plan's own slots, and comes back (``load`` into
    a fresh cache) bit for bit: the engine keeps all of it, in the plan's bytes."""
    cfg = TINY_CONFIGS["zaya"]()
    plan = make_tiny_plan(cfg, "per_group", dtype=dtype)
    buffers, hybrid = plan.allocate("cpu"), hybrid_model_for(cfg, dtype)
    model = build_tiny_model(cfg, dtype=getattr(torch, dtype))
    held = _zaya_cache(model, torch.tensor([_prompt(9, seed=3), _prompt(9, seed=4)]))
    fresh = states.cache_factory(cfg, [p.kind for p in plan.state_placements])()
    specs = {layer.name: layer.spec for layer in hybrid.state_layers}  # an attention layer's
    assert [p.layer for p in plan.state_placements] == list(specs)  # CCA state: its own spec
    for p in plan.state_placements:
        fmt, views = states.FORMATS[p.kind], plan.state_views(buffers, p.layer)
        module = fmt.module_of(model, p.layer_index)
        mine = fmt.store(held, module, p.layer_index)
        assert set(mine) == set(views) == set(fmt.parts) == {"conv", "v_delayed"}
        for part, t in mine.items():
            assert (t.shape[1:], t.dtype) == (views[part].shape[1:], views[part].dtype), part
            views[part][1:3] = t  # two slots of the plan's memory
        assert sum(t.nbytes for t in mine.values()) == 2 * specs[p.layer].state_bytes
        fmt.load(fresh, module, p.layer_index, {n: v[1:3] for n, v in views.items()})
        i = p.layer_index
        for got, ref in (
            (fresh.get_conv_state(i), held.get_conv_state(i)),
            (fresh.get_recurrent_state(i), held.get_recurrent_state(i)),
        ):
            assert got.dtype == ref.dtype and torch.equal(got, ref)


def test_cca_window_and_delayed_value_each_matter():
    """The comparisons can see either half of a lost CCA state: transformers continuing 48
    tokens in with only the q / k conv window zeroed, or only the delayed value half, ends far
    outside the tolerance (``test_states_matter`` zeroes both at once)."""
    model, p = _model("zaya"), torch.tensor([_prompt(54, seed=1)])
    with torch.no_grad():
        full = model(p).logits[0, -1]
        for lost in ("conv_states", "recurrent_states"):
            cache = _zaya_cache(model, p[:, :48])
            for layer in cache.layers:
                getattr(layer, lost)[0].zero_()
            pos = torch.arange(48, 54)[None]
            cont = model(p[:, 48:], position_ids=pos, cache=cache, use_cache=True).logits[0, -1]
            assert (full - cont).abs().max().item() > 100 * TOL, lost


def test_cca_fresh_state_is_where_transformers_starts():
    """A fresh request's CCA state is the one transformers starts from without a cache: a zero
    conv window and ``v_proj_delayed`` of a zero input (its bias: not zero with
    ``attention_bias``, drawn at random here), so loading it changes nothing."""
    cfg = TINY_CONFIGS["zaya"]()
    cfg.attention_bias = True
    model = build_tiny_model(cfg)
    fmt, hidden = states.FORMATS["cca"], torch.randn(1, 5, cfg.hidden_size)
    plan = make_tiny_plan(cfg, "per_group")
    for p in plan.state_placements:
        module = fmt.module_of(model, p.layer_index)
        with torch.no_grad():
            module.v_proj_delayed.bias.normal_()
            ref = module(hidden, None)
            views = plan.state_views(plan.allocate("cpu"), p.layer)
            start = {
                n: fmt.fresh(n, tuple(v.shape[1:]), v.dtype, module) for n, v in views.items()
            }
            assert start["v_delayed"].abs().min() > 0 and not start["conv"].any()
            cache = states.cache_factory(cfg, ["cca"])()
            fmt.load(cache, module, p.layer_index, start)
            got = module(hidden, cache)
        for g, r in zip(got, ref, strict=True):
            assert torch.equal(g, r)


#: Inkling's short convs in conv_states order (transformers' conv_idx), as the plan names them
INKLING_CONVS = ("k_sconv", "v_sconv", "attn_sconv", "mlp_sconv")


def _inkling_cache(model: torch.nn.Module, ids: torch.Tensor, **kwargs):
    """transformers' DynamicCache after an Inkling forward of ``ids``: every layer's K / V and
    its four short-conv states (``conv_states[0..3]``, ``[B, channels, kernel]`` float32)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True, **kwargs)
    return cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_inkling_conv_states_fill_their_slots_byte_for_byte(dtype):
    """Inkling's four short-conv states after a forward go to the plan's layout, each through
    the module that runs it (``StateFormat.per_module``: k_sconv, v_sconv, attn_sconv, mlp_sconv
    as conv_states[0..3]), float32 whatever the model dtype, in the spec's ``state_bytes`` per
    request and layer, through the plan's own slots, and come back (``load`` into a fresh
    cache, all four parts handed to each module's format) bit for bit but the oldest column,
    which only feeds outputs transformers discards (zero, as the other conv formats)."""
    cfg = TINY_CONFIGS["inkling"]()
    plan = make_tiny_plan(cfg, "per_group", dtype=dtype)
    buffers, hybrid = plan.allocate("cpu"), hybrid_model_for(cfg, dtype)
    model = build_tiny_model(cfg, dtype=getattr(torch, dtype))
    held = _inkling_cache(model, torch.tensor([_prompt(9, seed=3), _prompt(9, seed=4)]))
    fresh = states.cache_factory(cfg, ["inkling_sconv"])()
    specs = {layer.name: layer.spec for layer in hybrid.state_layers}  # the convs' own spec
    for p in plan.state_placements:
        views, i = plan.state_views(buffers, p.layer), p.layer_index
        fmts = states.FORMATS[p.kind].per_module()
        assert [f.parts for f in fmts] == [(n,) for n in INKLING_CONVS] == [(n,) for n in views]
        mine = {}
        for k, fmt in enumerate(fmts):
            module = fmt.module_of(model, i)
            assert module.conv_idx == fmt.state_index == k  # the module reading conv_states[k]
            mine.update(fmt.store(held, module, i))
        for part, t in mine.items():
            assert (t.shape[1:], t.dtype) == (views[part].shape[1:], torch.float32), part
            views[part][1:3] = t  # two slots of the plan's memory
        assert sum(t.nbytes for t in mine.values()) == 2 * specs[p.layer].state_bytes
        for fmt in fmts:
            fmt.load(fresh, fmt.module_of(model, i), i, {n: v[1:3] for n, v in views.items()})
        for k in range(len(INKLING_CONVS)):
            got, ref = fresh.get_conv_state(i, state_idx=k), held.get_conv_state(i, state_idx=k)
            assert got.dtype == ref.dtype == torch.float32 and got.shape == ref.shape
            assert torch.equal(got[..., 1:], ref[..., 1:]) and not got[..., 0].any()


def test_inkling_bias_log_scaling_and_each_conv_state_matter():
    """The comparisons can see each part of Inkling's attention the engine serves: transformers
    with the relative-position banks zeroed, or without the full layer's log scaling (tau), on
    a 70-token prompt (past the full layer's 64 distances), and continuing 48 tokens in with
    only one of the four short-conv states zeroed, ends far outside the tolerance
    (``test_states_matter`` zeroes all four at once)."""
    model, p = _model("inkling"), torch.tensor([_prompt(70, seed=1)])
    text = model.config.get_text_config()
    banks = [m.rel_logits_proj.proj for m in model.modules() if hasattr(m, "rel_logits_proj")]
    with torch.no_grad():
        full = model(p).logits[0, -1]
        saved = [b.clone() for b in banks]
        for b in banks:
            b.zero_()
        unbiased = model(p).logits[0, -1]
        for b, old in zip(banks, saved, strict=True):
            b.copy_(old)
        floor, text.log_scaling_n_floor = text.log_scaling_n_floor, None
        try:
            unscaled = model(p).logits[0, -1]
        finally:
            text.log_scaling_n_floor = floor
        assert (full - unbiased).abs().max().item() > 100 * TOL
        assert (full - unscaled).abs().max().item() > 100 * TOL
        full = model(p[:, :54]).logits[0, -1]
        for k, name in enumerate(INKLING_CONVS):
            cache = _inkling_cache(model, p[:, :48])
            for layer in cache.layers:
                layer.conv_states[k].zero_()
            pos = torch.arange(48, 54)[None]
            cont = model(p[:, 48:54], position_ids=pos, cache=cache, use_cache=True).logits[0, -1]
            assert (full - cont).abs().max().item() > 100 * TOL, name


def test_inkling_engine_adds_the_bias_in_the_kernels(monkeypatch):
    """The engine's Inkling attention hands every layer's relative states and bank to the paged
    kernels (prefill and decode, full and sliding layers), and that is what keeps it at
    transformers' logits: the same run with the banks zeroed on their way into the kernels
    leaves the tolerance. The prompt (70 tokens) reaches past the full layer's 64 distances."""
    from hybridkv.e2e import attn

    name, prompt = "inkling", _prompt(70, seed=5)
    calls: list[tuple[int, int]] = []
    real = attn.paged_attention

    def spy(module, query, *args, **kwargs):
        calls.append((query.shape[2], kwargs["rel_proj"].shape[1]))
        return real(module, query, *args, **kwargs)

    monkeypatch.setattr(attn, "paged_attention", spy)
    eng = Engine(_model(name), make_tiny_plan(TINY_CONFIGS[name](), "per_group"))
    eng.generate({"p": prompt}, N)
    _assert_matches(eng, name, "p", prompt)
    cfg = TINY_CONFIGS[name]().get_text_config()
    widths = {cfg.rel_extent, cfg.sliding_window_size}  # the full layer's bank, the sliding's
    assert {w for _, w in calls} == widths
    assert {t for t, _ in calls} >= {1, 64}  # decode steps and a 64-token prefill chunk

    def without_bias(module, query, *args, **kwargs):
        kwargs["rel_proj"] = torch.zeros_like(kwargs["rel_proj"])
        return real(module, query, *args, **kwargs)

    monkeypatch.setattr(attn, "paged_attention", without_bias)
    eng = Engine(_model(name), make_tiny_plan(TINY_CONFIGS[name](), "per_group"))
    eng.generate({"p": prompt}, N)
    ref = _reference(name, tuple(prompt), N)[1]
    assert max((g - r).abs().max().item() for g, r in zip(eng.finished["p"].logits, ref)) > TOL


def test_no_family_is_refused():
    """Every tiny family is served (Qwen4-Exp, the last refused, since its QSA pick and PLE
    states were wired): the serving, preemption and states-matter tests run them all, and
    neither the families' nor the engine's refusal list names one."""
    assert REFUSED == () and states.REFUSED == {}
    assert "qwen4_exp" in FAMILIES and "qwen4_exp" in STATEFUL and "qwen4_exp" in PAGED


@pytest.mark.parametrize("name", ["granite_swa", "granitemoe_swa"])
def test_attention_sinks_matter(name):
    """The comparisons can see the sinks: the tiny model's random sinks set to zero (where
    transformers starts them) move its logits far outside the tolerance."""
    model, p = _model(name), torch.tensor([_prompt(20, seed=3)])
    sinks = [m for n, m in model.named_parameters() if n.endswith(".sinks")]
    assert sinks and all(s.abs().max() > 0.5 for s in sinks)
    with torch.no_grad():
        before = model(p).logits[0, -1]
        saved = [s.clone() for s in sinks]
        for s in sinks:
            s.zero_()
        after = model(p).logits[0, -1]
        for s, old in zip(sinks, saved, strict=True):
            s.copy_(old)
    assert (before - after).abs().max() > 100 * TOL


def test_an_unwired_state_kind_is_refused_with_its_name(monkeypatch):
    """A plan with a state kind no StateFormat wires (Mamba-2's, taken away here) is refused
    before anything runs, with an error that names the kind and what is wired."""
    monkeypatch.delitem(states.FORMATS, "mamba2")
    cfg = TINY_CONFIGS["falcon_h1"]()
    model = torch.nn.Module()
    model.config = cfg
    with pytest.raises(states.Unservable, match="cannot be served") as err:
        Engine(model, make_tiny_plan(cfg, "per_group"))
    assert "no StateFormat for 'mamba2' layers (wired: " in str(err.value)


def test_mla_rotary_by_halves_is_refused_not_served_interleaved():
    """An MLA whose config sets ``rope_interleave=False`` (DeepSeek-V3's code then rotates the
    rope part by halves) is refused by name: the engine's one rotary is the interleaved one,
    and serving it that way would give wrong logits without an error."""
    from types import SimpleNamespace

    from hybridkv.e2e.attn import _rotate_mla

    class HalvesMLA(torch.nn.Module):
        config = SimpleNamespace(rope_interleave=False)

    q_pe, k_pe = torch.randn(6, 2, 4), torch.randn(1, 6, 4)
    rotary = (torch.randn(1, 6, 4), torch.randn(1, 6, 4))
    with pytest.raises(NotImplementedError, match="rope_interleave=False") as err:
        _rotate_mla(HalvesMLA(), q_pe, k_pe, rotary, 1, 6)
    assert "HalvesMLA" in str(err.value)


def test_glm5_next_attends_sparsely_and_the_pick_matters():
    """GLM-5-Next's DSA served: the indexer's pick (over the indexer rows in the plan's pages)
    lists fewer tokens than the context once the context passes ``index_topk`` plus the open
    pool, the layer sharing the pick (``indexer_types`` "shared") gets the same tensor, and the
    tokens match transformers'. The comparison can see a wrong pick: the same weights
    attending densely (a top-k as long as the context) end far outside the tolerance."""
    from hybridkv.e2e import attn

    name, prompt = "glm5_next", _prompt(70, seed=11)
    model, plan = _model(name), make_tiny_plan(TINY_CONFIGS[name](), "per_group")
    picks, shared = [], []
    pick, forward = attn.indexer_top_k, attn.mla_forward

    def spy_pick(*args):
        out = pick(*args)
        picks.append(out)
        return out

    def spy_forward(module, *args, token_indices=None, **kwargs):
        if module.skip_topk:
            shared.append(token_indices)
        return forward(module, *args, token_indices=token_indices, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attn, "indexer_top_k", spy_pick)
        mp.setattr(attn, "mla_forward", spy_forward)
        eng = Engine(model, plan)
        eng.generate({"r": prompt}, N)
    _assert_matches(eng, name, "r", prompt)
    text = model.config.get_text_config()
    assert picks and len(shared) == len(picks)  # one shared layer after the indexer's
    assert all(s is p for s, p in zip(shared, picks))
    width = text.index_topk + text.index_kpool - 1
    rows = torch.cat(picks)  # a row per query token: the prompt's, then the decodes'
    assert rows.shape == (len(prompt) + N - 1, width)
    prefill = rows[: len(prompt)]
    listed = (prefill >= 0).sum(dim=1)
    assert int(listed[-1]) < len(prompt) and int(listed.max()) <= width
    assert torch.equal(listed[:8], torch.arange(1, 9))  # a short context: every token

    dense_cfg = TINY_CONFIGS[name]()
    dense_cfg.text_config.index_topk = 128  # every pool of these lengths
    dense = build_tiny_model(dense_cfg)
    dense.load_state_dict(model.state_dict())
    with torch.no_grad():
        ids = torch.tensor([prompt])
        gap = (model(ids).logits[0, -1] - dense(ids).logits[0, -1]).abs().max().item()
    assert gap > 100 * TOL
