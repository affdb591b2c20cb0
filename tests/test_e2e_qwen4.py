"""Qwen4-Exp's parts, one by one (tests/test_e2e_families.py serves it whole: prefix hits
restoring states, preemption, packed prefill, states matter): the QSA indexer's pick against
transformers' own indexer, token for token, and that the pick matters; the PLE module's two
per-request states (the dilated conv window, in the plan's ``ple`` slots, and the n-gram
context, rebuilt from the request's tokens) against transformers' cache byte for byte, and
that each matters. fp32 tiny model, tolerance as the family tests (1e-4)."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache

from hybridkv.e2e import attn, build_tiny_model, hybrid_model_for, make_tiny_plan, states
from hybridkv.e2e.engine import Engine, hf_greedy
from hybridkv.e2e.families import TINY_CONFIGS

TOL = 1e-4
N = 3
NAME = "qwen4_exp"


@functools.cache
def _model(dtype: str = "float32") -> torch.nn.Module:
    return build_tiny_model(TINY_CONFIGS[NAME](), dtype=getattr(torch, dtype))


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_picks(model: torch.nn.Module, ids: list[int]) -> dict[int, list[set[int]]]:
    """transformers' own pick, one forward over ``ids``: layer index -> per position the set of
    positions its indexer lets the query attend to (``Qwen4ExpTextQSAIndexer``'s mask)."""
    picks: dict[int, list[set[int]]] = {}
    hooks = []
    for layer in model.model.layers:
        if getattr(layer, "self_attn", None) is None:
            continue
        ix = layer.self_attn.indexer

        def keep(module, args, out, i=ix.layer_idx):
            mask = out[0, 0]  # [T, kv]
            picks[i] = [set(row.nonzero().flatten().tolist()) for row in mask]

        hooks.append(ix.register_forward_hook(keep))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]), use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return picks


def test_qsa_pick_is_transformers_pick():
    """The engine's pick (indexer keys written into the plan's pages over two prefill
    chunks and decode steps, groups scored by ``indexer_scores``, ``torch.topk`` per query)
    lists, for every query token of both indexed layers, exactly the positions transformers'
    indexer lets it attend to in one forward over the same tokens: the same groups, the same
    open-group tail. The prompt is long enough that most queries see more complete groups than
    the budget's 4 (the pick is a strict subset of the context), and the case includes queries
    that see fewer groups with a positive score than they pick, so that tied zero scores (a
    group whose every head's dot is negative) are broken, as transformers breaks them."""
    model, prompt = _model(), _prompt(70, seed=21)
    plan = make_tiny_plan(TINY_CONFIGS[NAME](), "per_group")
    seen: dict[int, dict[int, set[int]]] = {}
    ties = []
    pick = attn._qsa_pick

    def spy(scores, query_pos, ratio, budget):
        out = pick(scores, query_pos, ratio, budget)
        layer = spy.layer  # set by the top-k spy below
        for row, p in zip(out.tolist(), query_pos.tolist()):
            seen.setdefault(layer, {})[p] = {x for x in row if x >= 0}
            visible = (p + 1) // ratio
            live = scores[query_pos.tolist().index(p), :visible]
            if 0 < int((live > 0).sum()) < min(budget // ratio, visible) < visible:
                ties.append((layer, p))
        return out

    top_k = attn.qsa_top_k

    def spy_top_k(indexer, *args):
        spy.layer = indexer.layer_idx
        return top_k(indexer, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attn, "_qsa_pick", spy)
        mp.setattr(attn, "qsa_top_k", spy_top_k)
        eng = Engine(model, plan, prefill_chunk=64)  # chunks of 64 and 6 tokens, then decodes
        eng.generate({"r": prompt}, N)
    tokens = prompt + eng.finished["r"].output[:-1]  # every position the engine ran
    want = _hf_picks(model, tokens)
    assert sorted(seen) == sorted(want) == [1, 3]
    for layer, rows in want.items():
        assert sorted(seen[layer]) == list(range(len(tokens)))
        for p, positions in enumerate(rows):
            assert seen[layer][p] == positions, (layer, p)
    sparse = [p for p in range(len(tokens)) if len(want[1][p]) < p + 1]
    assert len(sparse) > 40  # the pick leaves out part of the context for most queries
    assert ties, "no query had to break a tie of zero scores: the case does not test ties"
    assert eng.finished["r"].output == hf_greedy(model, prompt, N)[0]


def test_qsa_pick_matters():
    """The comparisons can see a wrong pick: the same weights attending to the whole context
    (a pick of every position) end far outside the tolerance."""
    model, prompt = _model(), _prompt(60, seed=22)
    ref = hf_greedy(model, prompt, N)[1]
    plan = make_tiny_plan(TINY_CONFIGS[NAME](), "per_group")

    def dense(scores, query_pos, ratio, budget):
        width = int(query_pos.max()) + 1
        rows = torch.arange(width).expand(len(query_pos), -1)
        return torch.where(rows <= query_pos[:, None], rows, -1).to(torch.int32)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attn, "_qsa_pick", dense)
        eng = Engine(model, plan)
        eng.generate({"d": prompt}, N)
    err = max((g - r).abs().max().item() for g, r in zip(eng.finished["d"].logits, ref))
    assert err > 100 * TOL


def _cache(model: torch.nn.Module, ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ple_states_fill_their_slots_byte_for_byte(dtype):
    """The PLE conv window transformers keeps after a forward (``conv_states[1]`` ``[B,
    hc_count * hidden, (kernel - 1) * dilation]``) goes to the plan's ``ple`` slots (the
    engine's ``store``) with each slot's exact shape and dtype, the spec's ``state_bytes`` per
    request and layer, and comes back (``load`` into a fresh cache) bit for bit; the n-gram
    context the engine rebuilds from the tokens (``derived_parts``) is transformers'
    ``conv_states[2]`` value for value, eos-padded for a one-token prompt too. Nothing else of
    the PLE module survives a forward."""
    cfg = TINY_CONFIGS[NAME]()
    plan = make_tiny_plan(cfg, "per_group", dtype=dtype)
    buffers, hybrid = plan.allocate("cpu"), hybrid_model_for(cfg, dtype)
    model = _model(dtype)
    specs = {layer.name: layer.spec for layer in hybrid.state_layers}
    fmt = states.FORMATS["ple_conv"]
    for length in (9, 1):
        prompts = [_prompt(length, seed=3), _prompt(length, seed=4)]
        held = _cache(model, torch.tensor(prompts))
        fresh = states.cache_factory(cfg, [p.kind for p in plan.state_placements])()
        ple = [p for p in plan.state_placements if p.kind == "ple_conv"]
        assert [p.layer_index for p in ple] == [i - 1 for i in cfg.ple_layer_ids]
        derived = states.derived_parts(fmt, cfg, prompts)
        for p in ple:
            views, module = plan.state_views(buffers, p.layer), fmt.module_of(model, p.layer_index)
            mine = fmt.store(held, module, p.layer_index)
            assert set(mine) == set(views) == {"ple"}
            t = mine["ple"]
            assert (t.shape[1:], t.dtype) == (views["ple"].shape[1:], views["ple"].dtype)
            assert t.nbytes == 2 * specs[p.layer].state_bytes
            views["ple"][1:3] = t  # two slots of the plan's memory
            fmt.load(fresh, module, p.layer_index, {"ple": views["ple"][1:3], **derived})
            i = p.layer_index
            for j in (1, 2):
                got, ref = (
                    fresh.get_conv_state(i, state_idx=j),
                    held.get_conv_state(i, state_idx=j),
                )
                assert got.dtype == ref.dtype and torch.equal(got, ref), (i, j, length)
        assert int(derived["ngram"].min()) >= 0
        if length == 1:  # transformers pads the context with eos
            assert (derived["ngram"][:, 0] == cfg.eos_token_id).all()


def test_each_ple_state_matters():
    """The comparisons can see either PLE state lost: transformers continuing 48 tokens in with
    only the PLE conv window zeroed, or only the n-gram context replaced by eos (what a request
    with no history would hand over), ends far outside the tolerance (``test_states_matter``
    of the family tests zeroes every state at once)."""
    model, p = _model(), torch.tensor([_prompt(54, seed=1)])
    eos = model.config.eos_token_id
    with torch.no_grad():
        full = model(p).logits[0, -1]
        for state_idx, lost in ((1, 0), (2, eos)):
            cache = _cache(model, p[:, :48])
            for i in (i - 1 for i in model.config.ple_layer_ids):
                cache.layers[i].conv_states[state_idx].fill_(lost)
            pos = torch.arange(48, 54)[None]
            cont = model(p[:, 48:], position_ids=pos, cache=cache, use_cache=True).logits[0, -1]
            assert (full - cont).abs().max().item() > 100 * TOL, state_idx


def test_ple_conv_and_indexer_groups_in_the_plan():
    """Where the plan keeps Qwen4-Exp's parts: the indexer's raw keys in a KV cache group of
    their own (one row of ``indexer_head_dim`` a token), the PLE window in a state group beside
    the GDN's, its slot ``[(kernel - 1) * dilation, hc_count * hidden]`` and no more."""
    cfg = TINY_CONFIGS[NAME]()
    plan = make_tiny_plan(cfg, "per_group")
    buffers = plan.allocate("meta")
    kinds = {p.kind for p in plan.kv_placements}
    assert kinds == {"full_attention", "indexer"}
    for p in plan.kv_placements:
        if p.kind == "indexer":
            rows = plan.kv_views(buffers, p.layer)[0]
            assert rows.shape[1:] == (plan.block_size, 1, cfg.indexer_head_dim)
    for p in plan.state_placements:
        if p.kind == "ple_conv":
            view = plan.state_views(buffers, p.layer)["ple"]
            span = (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size
            assert view.shape[1:] == (span, cfg.hc_count * cfg.hidden_size)
