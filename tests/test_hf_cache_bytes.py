"""The byte formulas of the families added from transformers (GraniteSWA, GraniteMoeSWA, RWKV,
xLSTM, GLM-5-Next, Qwen4-Exp, Inkling, ZAYA) against what transformers' own cache or state holds
after a forward of a tiny randomly initialised model of the family, in float32 and bfloat16;
and every such family planned through every layout, at its tiny size and at transformers'
default size.

The families served end to end are compared token for token in tests/test_e2e_families.py
(GraniteSWA, GraniteMoeSWA, RWKV, xLSTM, GLM-5-Next, ZAYA and Inkling among them; there RWKV's,
xLSTM's, ZAYA's CCA and Inkling's short-conv states also go through the plan's slots byte for
byte); Qwen4-Exp is refused there (no kernel for its indexer beside GQA), so this file is where
its formulas meet transformers.
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


#: tiny configs with a sliding-window layer (window 16)
TINY_WINDOWED = ("granite_swa", "granitemoe_swa", "inkling", "zaya")


def _cache_of(name: str, dtype: str):
    """transformers' DynamicCache after a forward of the tiny model of ``name``."""
    cfg = TINY_CONFIGS[name]()
    cache = transformers.DynamicCache(config=cfg.get_text_config())
    with torch.no_grad():
        _model(name, dtype)(input_ids=_ids(), cache=cache, use_cache=True)
    return cfg.get_text_config(), cache


def _conv_columns(held: torch.Tensor, spec) -> None:
    """transformers keeps a conv state as ``[batch, channels, kernel]``: the whole kernel
    window, one column more than the ``kernel - 1`` the spec (and vLLM) keeps, which the next
    token's conv never reads; the rest is the spec's conv, channel for channel."""
    (conv,) = [t for t in spec.state_tensors() if t.name == "conv"]
    rows, channels = conv.shape
    assert tuple(held.shape) == (BATCH, channels, rows + 1)
    assert f"torch.{conv.dtype}" == str(held.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_glm5_next_cache_bytes_match_transformers_cache(dtype):
    """GLM-5-Next: an indexed layer's DynamicIndexedLayer keeps the NoPE latent
    (``keys`` [batch, 1, tokens, kv_lora_rank], ``values`` of width 0: the rope part) and, on a
    ``full`` indexer layer, ``indexer_keys`` [batch, tokens, key + gate + flag]: per token and
    request exactly the MLA and indexer specs' bytes; the ``shared`` layer keeps no indexer
    keys. A KDA layer keeps the fp32 recurrent state whole and its conv state with one extra
    column (:func:`_conv_columns`)."""
    cfg, cache = _cache_of("glm5_next", dtype)
    hybrid = hybrid_model_for(TINY_CONFIGS["glm5_next"](), dtype)
    assert hybrid.layer_kinds == {"kda": 2, "mla": 2, "indexer": 1}
    for layer in hybrid.layers:
        held, spec = cache.layers[layer.index], layer.spec
        if spec.kind == "mla":
            assert (
                held.keys.shape == (BATCH, 1, T, cfg.kv_lora_rank) and held.values.shape[-1] == 0
            )
            nbytes = held.keys.nbytes + held.values.nbytes
            assert nbytes == BATCH * T * spec.bytes_per_token, layer.name
            assert held.keys.dtype == DTYPES[dtype]
        elif spec.kind == "indexer":
            keys = held.indexer_keys
            assert keys.shape == (BATCH, T, spec.row_elements) and keys.dtype == DTYPES[dtype]
            assert keys.nbytes == BATCH * T * spec.bytes_per_token, layer.name
        else:
            assert spec.kind == "kda"
            (ssm,) = [t for t in spec.state_tensors() if t.name == "ssm"]
            state = held.recurrent_states[0]
            assert (BATCH, *ssm.shape) == tuple(state.shape) and state.dtype == torch.float32
            assert ssm.dtype == "float32" and state.nbytes == BATCH * ssm.nbytes
            _conv_columns(held.conv_states[0], spec)
    # the shared layer (2) runs no indexer: its cache has no indexer keys
    assert cfg.indexer_types[2] == "shared" and cache.layers[2].indexer_keys is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_qwen4_exp_cache_bytes_match_transformers_cache(dtype):
    """Qwen4-Exp: an indexed layer keeps plain GQA K and V and ``indexer_keys`` [batch, tokens,
    indexer_head_dim], per token exactly the attention and indexer specs' bytes. A GDN layer
    with PLE keeps three conv states: 0 the GDN conv (one extra column, as every transformers
    conv state), 1 the PLE conv, exactly the PLE spec ((kernel - 1) * dilation columns of
    hc_count * hidden channels, model dtype), 2 the last ngram_size - 1 token ids (int64), which
    vLLM reads from the request's tokens, the engine rebuilds from them too
    (``hybridkv.e2e.states.derived_parts``), and the spec does not count. The GDN recurrent
    state is float32 whatever the model dtype: the spec's with ``--ssm-dtype float32``. The
    first indexed layer also keeps the positions of every token ([3, batch, tokens] int64, for
    the indexer's RoPE), transformers' bookkeeping that a server computes, not cache."""
    cfg, cache = _cache_of("qwen4_exp", dtype)
    hybrid = hybrid_model_for(cfg, dtype)
    fp32 = {layer.name: layer.spec for layer in hybrid.configure(ssm_dtype="float32").layers}
    assert hybrid.layer_kinds == {
        "gated_deltanet": 2,
        "ple_conv": 2,
        "full_attention": 2,
        "indexer": 2,
    }
    for layer in hybrid.layers:
        held, spec = cache.layers[layer.index], layer.spec
        if spec.kind == "full_attention":
            nbytes = held.keys.nbytes + held.values.nbytes
            assert held.keys.shape[2] == T and nbytes == BATCH * T * spec.bytes_per_token
        elif spec.kind == "indexer":
            keys = held.indexer_keys
            assert keys.shape == (BATCH, T, spec.index_head_dim) and keys.dtype == DTYPES[dtype]
            assert keys.nbytes == BATCH * T * spec.bytes_per_token, layer.name
        elif spec.kind == "ple_conv":
            (conv,) = spec.state_tensors()
            ple = held.conv_states[1]
            assert tuple(ple.shape) == (BATCH, conv.shape[1], conv.shape[0])
            assert ple.dtype == DTYPES[dtype] and ple.nbytes == BATCH * spec.state_bytes
            ids = held.conv_states[2]
            assert ids.shape == (BATCH, cfg.ngram_size - 1) and ids.dtype == torch.int64
        else:
            assert spec.kind == "gated_deltanet"
            _conv_columns(held.conv_states[0], spec)
            (ssm,) = [t for t in fp32[layer.name].state_tensors() if t.name == "ssm"]
            state = held.recurrent_states[0]
            assert (BATCH, *ssm.shape) == tuple(state.shape) and state.dtype == torch.float32
            assert state.nbytes == BATCH * ssm.nbytes
    positions = cache.layers[1].indexer_position_ids
    assert positions.shape == (3, BATCH, T) and positions.dtype == torch.int64


def _attention_bytes(held, spec, layer_name: str, dtype: str) -> None:
    """A full layer keeps every token, a sliding one the last ``window - 1``: per token and
    request exactly :attr:`bytes_per_token`, in the model dtype."""
    window = getattr(spec, "sliding_window", None)
    tokens = T if window is None else min(T, window - 1)
    assert held.keys.shape[2] == held.values.shape[2] == tokens, layer_name
    assert held.keys.nbytes + held.values.nbytes == BATCH * tokens * spec.bytes_per_token
    assert held.keys.dtype == held.values.dtype == DTYPES[dtype], layer_name


def _decode_one(name: str, dtype: str, cache) -> None:
    """One more token through the cache: a per-request state keeps its shape."""
    with torch.no_grad():
        _model(name, dtype)(input_ids=_ids()[:, :1], cache=cache, use_cache=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inkling_cache_bytes_match_transformers_cache(dtype):
    """Inkling: every layer keeps K and V (full, or the last ``window - 1`` tokens of a
    hybrid_sliding layer, whose heads are swa_*), exactly the attention specs' bytes in the
    model dtype, and four short-conv states, conv_states[0..3] = k_sconv, v_sconv, attn_sconv,
    mlp_sconv: each [batch, channels, kernel] in float32 whatever the model dtype, the spec's
    tensor of the same name (``kernel - 1`` columns, float32 by default) plus the one column
    the next token's conv never reads; after a decode step, the same shapes (per request)."""
    cfg, cache = _cache_of("inkling", dtype)
    hybrid = hybrid_model_for(TINY_CONFIGS["inkling"](), dtype)
    assert hybrid.layer_kinds == {"full_attention": 1, "sliding_window": 1, "inkling_sconv": 2}
    assert cfg.sconv_kernel_size == 3  # the tiny config's, not the default 4
    shapes = {}
    for layer in hybrid.layers:
        held, spec = cache.layers[layer.index], layer.spec
        if spec.is_attention:
            assert (spec.kind == "sliding_window") == (
                cfg.layer_types[layer.index] == "hybrid_sliding"
            )
            _attention_bytes(held, spec, layer.name, dtype)
            continue
        assert spec.kind == "inkling_sconv"
        tensors = spec.state_tensors()
        assert [t.name for t in tensors] == ["k_sconv", "v_sconv", "attn_sconv", "mlp_sconv"]
        for idx, t in enumerate(tensors):
            conv = held.conv_states[idx]
            rows, channels = t.shape
            assert tuple(conv.shape) == (BATCH, channels, rows + 1), (layer.name, t.name)
            assert conv.dtype == torch.float32 and t.dtype == "float32"
            assert conv[..., 1:].nbytes == BATCH * t.nbytes
            shapes[layer.name, idx] = tuple(conv.shape)
        assert all(held.recurrent_states[i] is None for i in range(4))
        assert (
            sum(c[..., 1:].nbytes for c in held.conv_states.values()) == BATCH * spec.state_bytes
        )
    _decode_one("inkling", dtype, cache)
    for (name, idx), shape in shapes.items():
        assert tuple(cache.layers[int(name.split(".")[1])].conv_states[idx].shape) == shape


@pytest.mark.parametrize("dtype", DTYPES)
def test_zaya_cache_bytes_match_transformers_cache(dtype):
    """ZAYA: every layer keeps plain GQA K and V (full, or the last ``window - 1`` tokens of a
    hybrid_sliding layer), exactly the attention specs' bytes, and its CCA state:
    conv_states[0] [batch, (heads + KV heads) * head_dim, cca_time0 + cca_time1 - 2] (the q/k
    conv window, exactly the spec's ``conv``, no extra column) and recurrent_states[0]
    [batch, KV heads * head_dim / 2] (the last token's delayed value half, the spec's
    ``v_delayed``), both in the model dtype; after a decode step, the same shapes."""
    cfg, cache = _cache_of("zaya", dtype)
    hybrid = hybrid_model_for(cfg, dtype)
    assert hybrid.layer_kinds == {"full_attention": 1, "sliding_window": 1, "cca": 2}
    for layer in hybrid.layers:
        held, spec = cache.layers[layer.index], layer.spec
        if spec.is_attention:
            assert (spec.kind == "sliding_window") == (
                cfg.layer_types[layer.index] == "hybrid_sliding"
            )
            _attention_bytes(held, spec, layer.name, dtype)
            continue
        assert spec.kind == "cca"
        conv, delayed = spec.state_tensors()
        assert (conv.name, delayed.name) == ("conv", "v_delayed")
        held_conv, held_v = held.conv_states[0], held.recurrent_states[0]
        rows, channels = conv.shape
        assert rows == cfg.cca_time0 + cfg.cca_time1 - 2 == 3
        assert tuple(held_conv.shape) == (BATCH, channels, rows)
        assert tuple(held_v.shape) == (BATCH, delayed.shape[1]) and delayed.shape[0] == 1
        for h, t in ((held_conv, conv), (held_v, delayed)):
            assert h.dtype == DTYPES[dtype] and f"torch.{t.dtype}" == str(h.dtype)
            assert h.nbytes == BATCH * t.nbytes
        assert held_conv.nbytes + held_v.nbytes == BATCH * spec.state_bytes
    _decode_one("zaya", dtype, cache)
    for layer in hybrid.state_layers:
        held, (conv, delayed) = cache.layers[layer.index], layer.spec.state_tensors()
        assert held.conv_states[0].shape[-1] == conv.shape[0]
        assert held.recurrent_states[0].shape[-1] == delayed.shape[1]


@pytest.mark.parametrize(
    "name",
    [
        "granite_swa",
        "granitemoe_swa",
        "rwkv",
        "xlstm",
        "glm5_next",
        "qwen4_exp",
        "inkling",
        "zaya",
    ],
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_new_families_plan_in_every_layout(name, layout):
    """Every layout plans the tiny model and transformers' default one (GraniteSWA: one full
    layer in four; RWKV and xLSTM: 32 layers of state, no attention; GLM-5-Next: 11 MLA layers
    with their indexers among 34 KDA ones; Inkling: 66 layers of attention, 55 sliding, each
    with its four short convs; ZAYA: 40 full-attention layers, each with its CCA state);
    sliding groups carry the window, and every cache layer is placed."""
    plan = make_tiny_plan(TINY_CONFIGS[name](), layout)
    windows = {g.sliding_window for g in plan.groups if g.kind == "sliding_window"}
    assert windows == ({16} if name in TINY_WINDOWED else set())
    placed = {p.layer for p in (*plan.kv_placements, *plan.state_placements)}
    assert placed == {layer.name for layer in hybrid_model_for(TINY_CONFIGS[name]()).layers}
    # an indexer's keys are a per-token kind of their own: in the shared pool they ride in their
    # attention layer's page, right after its latent / K and V (one block table for both); in
    # their own pool (per_group, two_level) they are groups of their own, natural size
    hybrid = hybrid_model_for(TINY_CONFIGS[name]())
    indexers = [p for p in plan.kv_placements if p.kind == "indexer"]
    assert bool(indexers) == (name in ("glm5_next", "qwen4_exp"))
    for p in indexers:
        spec = hybrid.layer(p.layer).spec
        assert p.k_bytes_per_block == p.block_size * spec.bytes_per_token and p.v_offset is None
        (group,) = [g for g in plan.groups if p.layer in g.layers]
        if layout in ("inflate", "pack", "aggregate"):
            host = plan.placement(p.layer.replace(".indexer", ".attn"))
            assert group.kind in ("mla", "full_attention") and host.group_id == group.group_id
            assert (host.tensor, p.k_offset) == (
                p.tensor,
                host.k_offset + host.k_bytes_per_block + host.v_bytes_per_block,
            )
        else:
            assert group.kind == "indexer"
    full_type = {"inkling": "inkling_mm_model"}.get(name, name)
    full = models.from_hf_config(transformers.AutoConfig.for_model(full_type).to_dict())
    big = make_plan(full, layout, memory="40GiB", max_num_seqs=64)  # GLM-5-Next: 148 MB a request
    placed = {p.layer for p in (*big.kv_placements, *big.state_placements)}
    assert placed == {layer.name for layer in full.layers}
    if full.attention_layers:
        assert big.capacity.token_capacity > 0
        windows = {g.sliding_window for g in big.groups if g.kind == "sliding_window"}
        assert windows == ({128} if "granite" in name else {512} if name == "inkling" else set())


def test_inflate_sizes_glm5_next_blocks_by_the_latent_alone():
    """vLLM's block rule reads the attention's bytes per token alone (the NoPE latent: 512 x 2
    = 1,024 B), not the indexer's: GLM-5-Next at transformers' default sizes (KDA state 64 x 128
    x 128 x 4 + 3 x 24,576 x 2 = 4,341,760 B) gets 512 x cdiv(4,341,760, 512 x 1,024) = 4,608
    tokens, 512 being the smallest kernel block of vLLM's k-pooled indexer backend (32 x
    index_kpool 16; tests/test_vllm_parity.py derives it); the indexer's rows (514 B/token, in
    transformers' per-token layout) ride in the latent's page, which grows to 4,608 x (1,024 +
    514) B, and the plan says so."""
    full = models.from_hf_config(transformers.AutoConfig.for_model("glm5_next").to_dict())
    plan = make_plan(full, "inflate", memory="40GiB", max_num_seqs=64)
    assert plan.block_size == 4_608 and plan.block_size % 512 == 0
    assert plan.extra["page_bytes"] == 4_608 * (1_024 + 514)
    assert any("indexer keys (514 B/token) ride in their attention" in n for n in plan.notes)
    assert plan.pack_size == 1  # one attention layer a page (its indexer beside it)
    # Qwen4-Exp's QSA caches run on a backend that takes any block (QSAStateBackend), so the
    # 64 comes from the GDN's FlashInfer checkpoint alignment, which its PLE conv (alignment 1)
    # leaves in place
    tiny = make_tiny_plan(TINY_CONFIGS["qwen4_exp"](), "inflate", block_size=None)
    assert tiny.block_size % 64 == 0
    assert "max(kernel block 16" in tiny.block_size_rule
    assert "GDN prefill checkpoint alignment 64" in tiny.block_size_rule


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model_type", ["inkling_mm_model", "zaya"])
def test_inkling_and_zaya_plan_at_tp8_in_every_layout(model_type, layout):
    """transformers' default Inkling and ZAYA on one rank of TP 8 (Inkling: one KV head a
    rank, its hidden-size convs whole on every rank; ZAYA: one query head and a replicated KV
    head a rank) plan in every layout, every cache layer placed, with the per-rank state."""
    full = models.from_hf_config(transformers.AutoConfig.for_model(model_type).to_dict())
    ranked = full.configure(tp_size=8)
    assert ranked.state_bytes_per_seq < full.state_bytes_per_seq
    plan = make_plan(ranked, layout, memory="40GiB", max_num_seqs=64)
    placed = {p.layer for p in (*plan.kv_placements, *plan.state_placements)}
    assert placed == {layer.name for layer in ranked.layers}
    assert plan.capacity.token_capacity > 0
