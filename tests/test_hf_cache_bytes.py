"""The byte formulas of the families added from transformers (GraniteSWA, GraniteMoeSWA, RWKV,
xLSTM) against what transformers' own cache or state holds after a forward of a tiny
randomly initialised model of the family, in float32 and bfloat16; and every such family
planned through every layout, at its tiny size and at transformers' default size.

The families served end to end are compared token for token in tests/test_e2e_families.py;
these families are refused there (the engine has no kernel for their attention or state), so
this file is where their formulas meet transformers.
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybridkv import models  # noqa: E402
from hybridkv.e2e import build_tiny_model, hybrid_model_for, make_tiny_plan  # noqa: E402
from hybridkv.e2e.families import TINY_CONFIGS  # noqa: E402
from hybridkv.layouts import LAYOUTS, make_plan  # noqa: E402

BATCH, T = 2, 40  # 40 tokens: past the tiny sliding windows (16)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@functools.cache
def _model(name: str, dtype: str) -> torch.nn.Module:
    return build_tiny_model(TINY_CONFIGS[name](), dtype=DTYPES[dtype])


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (BATCH, T), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["granite_swa", "granitemoe_swa"])
def test_granite_swa_kv_bytes_match_transformers_cache(name, dtype):
    """Full layers keep every token, sliding layers the last ``window - 1`` (the current token
    makes ``window``): per token and request exactly :attr:`bytes_per_token`, layer by layer,
    in the layer order the reader gives."""
    cfg = TINY_CONFIGS[name]()
    model = _model(name, dtype)
    cache = transformers.DynamicCache(config=cfg)
    with torch.no_grad():
        model(_ids(), cache=cache, use_cache=True)
    hybrid = hybrid_model_for(cfg, dtype)
    assert len(hybrid.layers) == cfg.num_hidden_layers == len(cache.layers)
    for layer in hybrid.layers:
        held = cache.layers[layer.index]
        spec = layer.spec
        window = getattr(spec, "sliding_window", None)
        assert (window is not None) == (cfg.layer_types[layer.index] == "sliding_attention")
        tokens = T if window is None else min(T, window - 1)
        assert held.keys.shape[2] == tokens, layer.name
        nbytes = held.keys.nbytes + held.values.nbytes
        assert nbytes == BATCH * tokens * spec.bytes_per_token, layer.name
        assert held.keys.dtype == DTYPES[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rwkv_state_bytes_match_transformers_state(dtype):
    """transformers' RWKV state is five ``[batch, hidden, layers]`` tensors: the two token
    shifts in the model dtype, the WKV num / den / max in float32. Layer by layer that is the
    spec's ``shift`` (2 x hidden, conv dtype) and ``wkv`` (channels x 3, float32 by default)."""
    cfg = TINY_CONFIGS["rwkv"]()
    with torch.no_grad():
        state = _model("rwkv", dtype)(_ids(), use_cache=True).state
    assert len(state) == 5
    hybrid = hybrid_model_for(cfg, dtype)
    assert hybrid.layer_kinds == {"rwkv4": cfg.num_hidden_layers}
    for layer in hybrid.layers:
        held = [s[:, :, layer.index] for s in state]
        tensors = {t.name: t for t in layer.spec.state_tensors()}
        shift, wkv = tensors["shift"], tensors["wkv"]
        assert {str(t.dtype) for t in held[:2]} == {f"torch.{shift.dtype}"} == {str(DTYPES[dtype])}
        assert {str(t.dtype) for t in held[2:]} == {f"torch.{wkv.dtype}"} == {"torch.float32"}
        assert sum(t.numel() for t in held[:2]) == BATCH * shift.numel
        assert sum(t.numel() for t in held[2:]) == BATCH * wkv.numel
        assert sum(t.nbytes for t in held) == BATCH * layer.spec.state_bytes


@pytest.mark.parametrize("dtype", DTYPES)
def test_xlstm_state_bytes_match_transformers_cache(dtype):
    """transformers' ``xLSTMCache.rnn_state[layer]`` is ``(C, n, m)`` in the model dtype: the
    spec's ``C``, ``n`` and ``m``, shape for shape (batch aside) and byte for byte, with the
    state dtype auto (the model dtype)."""
    cfg = TINY_CONFIGS["xlstm"]()
    with torch.no_grad():
        cache = _model("xlstm", dtype)(_ids(), use_cache=True).cache
    hybrid = hybrid_model_for(cfg, dtype)
    assert (
        hybrid.layer_kinds == {"mlstm": cfg.num_hidden_layers} == {"mlstm": len(cache.rnn_state)}
    )
    for layer in hybrid.layers:
        held = cache.rnn_state[layer.index]
        tensors = layer.spec.state_tensors()
        assert [t.name for t in tensors] == ["C", "n", "m"]
        for t, h in zip(tensors, held, strict=True):
            assert (BATCH, *t.shape) == tuple(h.shape), t.name
            assert f"torch.{t.dtype}" == str(h.dtype) == str(DTYPES[dtype]), t.name
        assert sum(h.nbytes for h in held) == BATCH * layer.spec.state_bytes


@pytest.mark.parametrize("name", ["granite_swa", "granitemoe_swa", "rwkv", "xlstm"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_new_families_plan_in_every_layout(name, layout):
    """Every layout plans the tiny model and transformers' default one (GraniteSWA: one full
    layer in four; RWKV and xLSTM: 32 layers of state, no attention); sliding groups carry the
    window, and every cache layer is placed."""
    plan = make_tiny_plan(TINY_CONFIGS[name](), layout)
    windows = {g.sliding_window for g in plan.groups if g.kind == "sliding_window"}
    assert windows == ({16} if "granite" in name else set())
    full = models.from_hf_config(transformers.AutoConfig.for_model(name).to_dict())
    big = make_plan(full, layout, memory="8GiB", max_num_seqs=64)
    placed = {p.layer for p in (*big.kv_placements, *big.state_placements)}
    assert placed == {layer.name for layer in full.layers}
    if full.attention_layers:
        assert big.capacity.token_capacity > 0
        windows = {g.sliding_window for g in big.groups if g.kind == "sliding_window"}
        assert windows == {128}
