"""Recurrent states between a plan's state slots and transformers: one :class:`StateFormat` per
state kind, and the kinds the engine refuses, with the reason (:data:`REFUSED`).

Every state the engine hands to transformers is an already-started one, a fresh request's
being zeros (which is what transformers' own prefill implies: zero left padding of the conv, zero
initial recurrent state), so one code path serves fresh requests, prefix hits and chunk
continuations alike. Where transformers keeps a state and in which layout:

- ``mamba2`` (Bamba, Falcon-H1, GraniteMoeHybrid, NemotronH, Zamba2), ``gated_deltanet``
  (Qwen3-Next, Qwen3.5), ``mamba1`` (Jamba), ``short_conv`` (LFM2), ``kda`` (Kimi-Linear): the
  ``DynamicCache``'s ``LinearAttentionLayer`` of the layer, written with
  ``Cache.update_conv_state`` / ``update_recurrent_state`` and read back with
  ``get_conv_state`` / ``get_recurrent_state`` (public methods; only a recurrent-only layer
  would need the public ``has_previous_state`` flag set by hand).
- ``linear_attention`` (MiniMax's lightning attention): ``MiniMaxCache.linear_cache[layer]``
  ``[B, heads, head_dim, head_dim]`` (``K^T V``), through its public ``set_linear_cache`` /
  ``get_linear_cache``; MiniMax's forward takes no other cache class (``StateFormat.cache``).
  Given a state, its multi-token forward runs the token-by-token recurrence (from none, the
  block-parallel form; the two agree to rounding).
- ``rglru`` (RecurrentGemma): attributes of the model's own modules, ``temporal_block
  .conv1d_state`` ``[B, lru_width, width - 1]`` and ``temporal_block.rg_lru.recurrent_states``
  ``[B, lru_width]`` (fp32); transformers' cache layer for it stays empty.
- ``rwkv4`` (RWKV-4): no cache object. ``RwkvModel.forward`` takes a ``state=`` list of five
  ``[B, hidden, layers]`` tensors (0 the channel-mix shift, 1 the time-mix shift, in the model
  dtype; 2-4 the WKV num / den / max, fp32), which each ``RwkvBlock`` reads and writes in place
  at its ``layer_id`` and returns; the engine passes that list as the forward's ``state``
  (``StateFormat.argument``), one built per forward (``holder="rwkv_state"``).
- ``mlstm`` (xLSTM): its own ``xLSTMCache``, passed as the forward's ``cache``; ``rnn_state
  [layer]`` is ``(C, n, m)`` ``[B, heads, qk_head_dim, v_head_dim]``, ``[B, heads, qk_head_dim]``,
  ``[B, heads, 1]``. ``xLSTMModel`` hands the tuple to the block and copies the block's new
  state back into it (``holder="xlstm_cache"``).
- ``cca`` (ZAYA's Compressed Convolutional Attention): the ``DynamicCache`` layer of the
  attention layer itself (a ``LinearAttentionAndFullAttentionLayer`` or its sliding-window
  twin, K / V beside the states): ``conv_states[0]`` ``[B, (heads + kv_heads) * head_dim,
  time0 + time1 - 2]``, the q / k window the two convs reach back, and ``recurrent_states[0]``
  ``[B, kv_heads * head_dim / 2]``, the last token's ``v_proj_delayed`` (the next token's value
  is half its own ``v_proj_current``, half that). The module that reads and writes them is the
  attention's ``qkv_proj`` (``ZayaCCAProjection``); its multi-token forward prepends the
  window it is given and takes the delayed value from the state, so it continues a state as
  it is. What it returns (q, k, v, normed and rotated by the attention after it) is plain GQA
  with ``head_dim`` for K and V, cached as such and attended with the usual softmax at
  ``head_dim ** -0.5``: the paged kernels serve it unchanged.
- ``inkling_sconv`` (Inkling's four short convs): the ``DynamicCache`` layer of the attention
  layer itself, ``conv_states[0..3]`` ``[B, channels, kernel]`` float32 (k_sconv and v_sconv on
  the layer's K / V channels, attn_sconv and mlp_sconv on the hidden size), each read and
  written by its own module (``InklingShortConvolution``, ``conv_idx`` 0-3: two inside the
  attention, two in the decoder layer). A format binds one module to its state, so this kind
  is split into one format per conv (:meth:`StateFormat.per_module`), each loading, storing
  and, in a packed forward, running per segment its own ``conv_states[i]``. Their layout is
  the short conv's (below). The attention they feed, with its relative-position bias, runs in
  the paged kernels (:func:`.attn.relative_bias_forward`).
- ``ple_conv`` (Qwen4-Exp's Per-Layer Embedding, on some GDN layers): the GDN layer's own
  ``LinearAttentionLayer`` keeps two more states beside the GDN's ``conv_states[0]``:
  ``conv_states[1]`` ``[B, hc_count * hidden, (kernel - 1) * dilation]``, the dilated short
  conv's window (model dtype), read and written by the layer's ``ple`` module
  (``Qwen4ExpTextPLELayer._short_conv``), and ``conv_states[2]`` ``[B, ngram_size - 1]`` int64,
  the last token ids before the forward, which the n-gram hash (``Qwen4ExpTextNGramEmbedding``)
  prepends (eos where the request has fewer; transformers' own padding). The window is the
  plan's slot ``ple`` ``[(kernel - 1) * dilation, channels]``, transposed, no extra column; the
  token ids are not cache (vLLM rebuilds them from the request's tokens, and so does the
  engine: a *derived* part, ``StateFormat.derived``, computed per forward from each request's
  tokens and loaded, never stored). Nothing else of the module outlives a forward: its
  projections, norms and gate are per token.

Layout conversions (plan = vLLM's layout):

- conv state: the plan slot holds ``[kernel - 1, conv_dim]``, the ``LinearAttentionLayer``
  ``[conv_dim, kernel]``. Transformers' decode (``causal_conv1d_update``) concatenates its
  ``kernel`` columns with the new one and convolves, producing two outputs of which it keeps
  the last; the oldest column only feeds the discarded output. Its chunked path likewise keeps
  only the last ``kernel`` outputs of ``[state, new]`` convolved with ``kernel - 1`` left
  padding, and the first of those already starts at column 1. So ``kernel - 1`` columns are the
  whole state (vLLM stores exactly that); loading puts a zero column in front (it only reaches
  outputs transformers discards; zero keeps them finite) and storing drops it. RecurrentGemma
  keeps exactly ``width - 1`` columns: a transpose.
- Gated DeltaNet recurrent state: plan ``[v_heads, head_v_dim, head_k_dim]`` (vLLM >= 0.18),
  transformers ``[v_heads, head_k_dim, head_v_dim]``: transposed both ways. Mamba-2's ``[heads,
  head_dim, d_state]``, Mamba-1's ``[intermediate, d_state]`` and RG-LRU's ``[lru_width]`` are
  the same in both. KDA's ``[heads, head_dim, head_dim]`` is square, kept in transformers'
  ``[K, V]`` order (a transposed order would serve equally; which one vLLM's KDA kernels
  keep is not checked here); MiniMax's ``[heads, head_dim, head_dim]`` likewise. Fused q/k/v
  convs (GDN, KDA) keep one conv state over the concatenated channels in both.
- RWKV-4: the plan slot holds ``shift`` ``[2, hidden]`` (rows: transformers' state 0 and 1)
  and ``wkv`` ``[channels, 3]`` (columns: states 2, 3, 4, the layout of transformers' CUDA
  kernel state); the layer's column ``[:, :, layer]`` of each of the five tensors. xLSTM: ``C``,
  ``n``, ``m`` as ``rnn_state`` holds them. ZAYA: ``conv`` ``[time0 + time1 - 2, channels]``,
  transformers' window transposed (no extra column: ``conv_pad=0``), and ``v_delayed`` ``[1,
  D]`` (sized as a kernel-2 conv's window), transformers' ``[B, D]`` vector. Inkling: each
  conv ``[kernel - 1, channels]`` as any conv state. All exactly what
  transformers holds, byte for byte (tests/test_hf_cache_bytes.py checks the spec formulas
  against transformers' own state).

Fresh states. A fresh request's state is transformers' initial one: zeros, except RWKV's WKV
running maximum, which ``RwkvModel`` starts at -1e30 (:meth:`StateFormat.fresh`), and ZAYA's
delayed value half, which ``ZayaCCAProjection`` starts as ``v_proj_delayed`` of a zero input:
zero without ``attention_bias``, the bias with it. Zero for RWKV's maximum would be the same
recurrence only up to rounding: the maximum is the scale num and den are kept in, and a first
key far below 0 would underflow ``exp(key - max)`` to 0 / 0.

Stepping. Two modules of transformers cannot continue a multi-token forward from a state:
Jamba's Mamba-1 mixer (its full-sequence scan, ``mamba_selective_scan``, always starts from a
zero state) and RecurrentGemma's recurrent block (its prefill convolves the new tokens with zero
left padding, ignoring the conv state). For those kinds (``StateFormat.stepwise``) the engine
runs a multi-token forward of the module one token at a time through the module's own decode
path, which does continue the state; only in the engine's forwards (see
:func:`install_stepwise`).

Packed (varlen) forwards. The engine prefills several requests' chunks of different lengths in
one forward by packing their tokens into one ``[1, T]`` sequence (no padding; attention reads
each request's pages by ``cu_seqlens``, :mod:`.attn`). Everything token-wise (embeddings, MLPs,
MoE, norms, projections) then runs once over all of them; a recurrent mixer cannot, as its
scan would carry one request's state into the next. transformers' torch mixers take no
``cu_seqlens`` (the CUDA kernels they fall back from do: Mamba-2's ``seq_idx``, fla's
``cu_seqlens``), so :func:`install_varlen` has each mixer run its segments one after the other
inside the packed forward, each from its own request's state (:class:`Packed`). RWKV's state is
used by both halves of its block (time-mix and channel-mix token shifts), so its "mixer" is the
whole ``RwkvBlock`` (norms and projections are token-wise: running them per segment changes
nothing); xLSTM's is the block's ``mlstm_layer``; ZAYA's the attention's ``qkv_proj``, whose
segments' queries, keys and values are concatenated back (``StateFormat.outputs``) for the
attention to run over the packed sequence as any other.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

import torch

from ..models.model import MTP_PREFIX
from . import attn

__all__ = [
    "CACHES",
    "FORMATS",
    "MIXER_PATHS",
    "REFUSED",
    "Packed",
    "StateFormat",
    "Unservable",
    "cache_argument",
    "cache_factory",
    "check_wired",
    "derived_history",
    "derived_parts",
    "has_own_state",
    "install_stepwise",
    "install_varlen",
    "packed",
    "refusal",
]

#: where a decoder layer keeps its recurrent mixer, first match wins (Falcon-H1's layers have
#: ``mamba`` beside ``self_attn``; Zamba2's hybrid layers nest it in ``mamba_decoder``;
#: Kimi-Linear's KDA is its linear layers' ``self_attn``)
MIXER_PATHS = (
    "mamba",
    "mamba_decoder.mamba",
    "mixer",
    "linear_attn",
    "conv",
    "temporal_block",
    "self_attn",
)

#: layer kinds (of the plan's state and KV placements) the engine cannot serve, and why
#: (:func:`refusal` also names kinds with no :class:`StateFormat`)
#: none at present: Qwen4-Exp's indexer beside GQA and its PLE states, the last refused, are
#: served (the QSA pick through the GQA decode kernel's token_indices, .attn.qsa_forward; the
#: PLE conv window and n-gram context by the ``ple_conv`` format)
REFUSED: dict[str, str] = {}


class Unservable(NotImplementedError):
    """A model or plan the engine refuses before anything runs; the message names what the
    engine lacks for it and what it serves. A NotImplementedError: the model is valid, the
    engine has no kernel or state hand-over for part of it."""


@dataclass(frozen=True)
class StateFormat:
    """How one state kind's plan slots map to what transformers keeps.

    ``conv`` / ``recurrent``: whether the kind has that state (plan views ``"conv"`` and
    ``"ssm"``); ``names``: the plan views instead, where the kind's are neither (RWKV's
    ``shift`` / ``wkv``, xLSTM's ``C`` / ``n`` / ``m``); ``transposed``: the recurrent state's
    last two dims are swapped between the plan and transformers; ``conv_pad``: columns
    transformers keeps in front of the plan's ``kernel - 1``; ``holder``: ``"cache"`` (the
    ``DynamicCache`` layer), ``"module"`` (attributes of the model's modules, see
    :meth:`module_of`), ``"linear_cache"`` (MiniMax's), ``"rwkv_state"`` (RWKV's five-tensor
    list) or ``"xlstm_cache"`` (xLSTM's ``rnn_state``); ``stepwise``: the module's multi-token
    forward ignores a previous state, so the engine steps it token by token; ``cache``: the
    model's own cache a forward takes (a key of :data:`CACHES`; None: a ``DynamicCache``);
    ``argument``: the forward's keyword for it; ``layers`` / ``mixer``: where the decoder keeps
    its layers and, in a layer, the module that runs the state (None: the first of
    :data:`MIXER_PATHS`; ``""``: the layer itself); ``batched_decode``: transformers' one-token
    forward of the kind takes a batch of states (else the engine decodes a batch as a packed
    forward of one-token segments, each mixer call with batch 1); ``recurrent_part``: the plan
    view of the state transformers keeps as the cache layer's recurrent state (``"ssm"``;
    ZAYA's ``"v_delayed"``); ``vector``: that state is one row in the plan (``[1, D]``, a
    kernel-2 conv's window) and a ``[B, D]`` vector in transformers; ``outputs``: the mixer
    returns a tuple whose first ``outputs`` entries are per token (ZAYA's CCA projection:
    query, key and value), which a packed forward's segments concatenate. ``conv_names``: the
    parts that are conv windows (plan ``[kernel - 1, C]``, transformers ``[C, kernel - 1 +
    conv_pad]``); ``state_index``: which of the cache layer's ``conv_states[i]`` they are
    (Inkling's four convs share one layer); ``modules``: for a kind whose parts are run by
    modules of their own (Inkling's), the mixer path of each part of ``names`` in order, part
    ``i`` being ``conv_states[i]`` (:meth:`per_module` splits the format into one per module).
    ``derived``: ``(name, state index)`` of parts transformers keeps as ``conv_states[i]`` that
    are a function of the request's tokens, not cache (Qwen4-Exp's n-gram context: the last
    ``ngram_size - 1`` token ids): no plan slot; the engine computes them per forward
    (:func:`derived_parts`) and :meth:`load` hands them over; :meth:`store` drops them."""

    kind: str
    conv: bool = True
    recurrent: bool = True
    names: tuple[str, ...] = ()
    transposed: bool = False
    conv_pad: int = 1
    holder: str = "cache"
    stepwise: bool = False
    cache: str | None = None
    argument: str = "past_key_values"
    layers: str = "layers"
    mixer: str | None = None
    batched_decode: bool = True
    recurrent_part: str = "ssm"
    vector: bool = False
    outputs: int = 1
    conv_names: tuple[str, ...] = ("conv",)
    state_index: int = 0
    modules: tuple[str, ...] = ()
    derived: tuple[tuple[str, int], ...] = ()

    @property
    def parts(self) -> tuple[str, ...]:
        if self.names:
            return self.names
        return tuple(
            n for n, has in (("conv", self.conv), (self.recurrent_part, self.recurrent)) if has
        )

    def per_module(self) -> tuple[StateFormat, ...]:
        """One format per module that runs a part of this kind's state: itself, or for a kind
        with ``modules`` (Inkling's four short convs) one per part, each binding its module to
        its part and ``conv_states[i]``. A packed forward runs each module per segment from
        its own part (:func:`install_varlen`), so one layer's parts need not share a module."""
        if not self.modules:
            return (self,)
        return tuple(
            replace(self, names=(n,), conv_names=(n,), state_index=i, mixer=path, modules=())
            for i, (n, path) in enumerate(zip(self.names, self.modules, strict=True))
        )

    # ---- plan slot tensors <-> transformers' ------------------------------------------------
    def to_hf(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A batch of plan states ``[B, *slot shape]`` of part ``name`` in transformers' layout."""
        if name in self.conv_names:  # [B, K-1, C] -> [B, C, K-1+pad]
            hf = t.new_zeros(t.shape[0], t.shape[2], t.shape[1] + self.conv_pad)
            hf[:, :, self.conv_pad :] = t.transpose(1, 2)
            return hf
        if self.vector and name == self.recurrent_part:  # [B, 1, D] -> [B, D]
            return t[:, 0].clone()
        return t.transpose(-1, -2).contiguous() if self.transposed else t.clone()

    def from_hf(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`to_hf`."""
        if name in self.conv_names:
            return t[:, :, self.conv_pad :].transpose(1, 2).contiguous()
        if self.vector and name == self.recurrent_part:
            return t[:, None].contiguous()
        return t.transpose(-1, -2).contiguous() if self.transposed else t.contiguous()

    def fresh(
        self,
        name: str,
        row_shape: tuple[int, ...],
        dtype: torch.dtype,
        module: torch.nn.Module | None = None,
    ) -> torch.Tensor:
        """A fresh request's state of part ``name``, ``[1, *row_shape]`` in the plan's layout:
        what transformers starts from, zeros except RWKV's WKV maximum (column 2 of ``wkv``),
        which ``RwkvModel.forward`` starts at -1e30, and ZAYA's delayed value half, which
        ``ZayaCCAProjection`` starts as ``v_proj_delayed`` of a zero input (its bias, zero
        without one) and which is computed the same way here from ``module``, the layer's
        mixer (see the module docstring)."""
        t = torch.zeros((1, *row_shape), dtype=dtype)
        if self.holder == "rwkv_state" and name == "wkv":
            t[..., 2] = -1e30
        if self.kind == "cca" and name == "v_delayed":
            if module is None:
                raise ValueError("a fresh CCA state needs its layer's CCA projection module")
            proj = module.v_proj_delayed
            with torch.no_grad():
                start = proj(torch.zeros(1, 1, proj.in_features, dtype=proj.weight.dtype))
            t.copy_(start.reshape(t.shape))
        return t

    # ---- where transformers keeps them -------------------------------------------------------
    def module_of(self, model: torch.nn.Module, idx: int) -> torch.nn.Module:
        """Decoder layer ``idx``'s mixer of this kind: the module that runs the state, and
        holds it where ``holder="module"`` (``mixer``, else the first of :data:`MIXER_PATHS`
        it has)."""
        layer = getattr(model.get_decoder(), self.layers)[idx]
        if self.mixer is not None:
            return layer.get_submodule(self.mixer)
        for path in MIXER_PATHS:
            try:
                return layer.get_submodule(path)
            except AttributeError:
                continue
        raise ValueError(
            f"decoder layer {idx} ({type(layer).__name__}) has no {self.kind} mixer at any of "
            f"{', '.join(MIXER_PATHS)}"
        )

    def load(self, cache: Any, module: torch.nn.Module | None, idx: int, states: dict) -> None:
        """Hand ``states`` (``part -> [B, ...]`` in the plan's layout) to transformers as the
        already-started state of layer ``idx``. ``cache`` must be fresh (the engine builds one
        per forward): a first ``update_conv_state`` takes the tensor as the whole state, a
        later one would append to it. Parts of ``states`` that are not this format's (another
        module's, of the same layer) are left to that module's format."""
        hf = {n: self.to_hf(n, t) for n, t in states.items() if n in self.parts}
        if self.holder == "module":
            module.conv1d_state = hf["conv"]
            module.rg_lru.recurrent_states = hf["ssm"]
            return
        if self.holder == "linear_cache":
            cache.set_linear_cache(idx, hf["ssm"])
            return
        if self.holder == "rwkv_state":
            _load_rwkv(cache, module, idx, hf["shift"], hf["wkv"])
            return
        if self.holder == "xlstm_cache":
            cache.rnn_state[idx] = (hf["C"], hf["n"], hf["m"])
            return
        i = self.state_index
        for n in self.conv_names if self.conv else ():
            # a first update takes the whole tensor as the state and marks it started
            cache.update_conv_state(hf[n], idx, state_idx=i, conv_kernel_size=hf[n].shape[2])
        for n, j in self.derived:  # given as transformers keeps it: [B, width]
            if n not in states:
                raise ValueError(
                    f"layer {idx}'s {self.kind} state needs its derived part {n!r} (computed "
                    f"from the requests' tokens by derived_parts): none was given"
                )
            width = states[n].shape[1]
            cache.update_conv_state(states[n], idx, state_idx=j, conv_kernel_size=width)
        if self.recurrent:
            cache.update_recurrent_state(hf[self.recurrent_part], idx)
        # a recurrent-only layer has no conv update to mark it started (public attribute)
        cache.layers[idx].has_previous_state[i] = True

    def store(self, cache: Any, module: torch.nn.Module | None, idx: int) -> dict:
        """Layer ``idx``'s updated states (``part -> [B, ...]``) in the plan's layout."""
        if self.holder == "module":
            hf = {"conv": module.conv1d_state, "ssm": module.rg_lru.recurrent_states}
            # back to 'no state': the module then starts afresh when run outside the engine
            module.conv1d_state = module.rg_lru.recurrent_states = None
        elif self.holder == "linear_cache":
            hf = {"ssm": cache.get_linear_cache(idx)}
        elif self.holder == "rwkv_state":
            hf = {
                "shift": torch.stack([cache[0][:, :, idx], cache[1][:, :, idx]], dim=1),
                "wkv": torch.stack([s[:, :, idx] for s in cache[2:]], dim=-1),
            }
        elif self.holder == "xlstm_cache":
            hf = dict(zip(("C", "n", "m"), cache.rnn_state[idx], strict=True))
        else:
            hf = {}
            for n in self.conv_names if self.conv else ():
                hf[n] = cache.get_conv_state(idx, state_idx=self.state_index)
            if self.recurrent:
                hf[self.recurrent_part] = cache.get_recurrent_state(idx)
        return {n: self.from_hf(n, t) for n, t in hf.items()}

    # ---- a module called on one segment of a packed forward (install_varlen) ----------------
    def swaps(self, outer: Any, own: Any, idx: int) -> list[tuple[Any, Any]]:
        """``(packed forward's object, segment's object)`` pairs to replace in the mixer's
        arguments: the cache, and where the model hands the mixer its layer's piece of the
        cache rather than the cache (xLSTM: ``cache.rnn_state[layer]``), that piece."""
        pairs = [(outer, own)]
        if self.holder == "xlstm_cache":
            pairs.append((outer.rnn_state[idx], own.rnn_state[idx]))
        return pairs

    def returned(self, own: Any, idx: int, out: Any) -> None:
        """Keep the state a segment's mixer call returned where :meth:`store` reads it: xLSTM's
        mLSTM layer returns its new ``(C, n, m)``, which ``xLSTMModel`` (not the layer) copies
        into the cache; the other holders are written during the call."""
        if self.holder == "xlstm_cache":
            own.rnn_state[idx] = tuple(out[1])


def _load_rwkv(
    state: list[torch.Tensor],
    block: torch.nn.Module,
    idx: int,
    shift: torch.Tensor,
    wkv: torch.Tensor,
) -> None:
    """Write layer ``idx``'s plan states (``shift [B, 2, hidden]``, ``wkv [B, channels, 3]``)
    into RWKV's five-tensor ``state`` list at column ``idx``, building the list (zeros, batch
    ``B``, every layer) on the first layer loaded into it. transformers sizes all five tensors
    by ``hidden_size``, so a config whose ``attention_hidden_size`` differs cannot take its WKV
    state (transformers cannot run it either)."""
    b, hidden = shift.shape[0], shift.shape[2]
    if wkv.shape[1] != hidden:
        raise ValueError(
            f"RWKV layer {idx}: {wkv.shape[1]} WKV channels but hidden_size {hidden}; "
            "transformers' RwkvModel keeps num / den / max at hidden_size channels, so it runs "
            "only configs with attention_hidden_size == hidden_size: use such a config"
        )
    if not state:
        shape = (b, hidden, block.config.num_hidden_layers)
        state.extend(torch.zeros(shape, dtype=t.dtype) for t in (shift, shift, wkv, wkv, wkv))
    for i in range(2):
        state[i][:, :, idx] = shift[:, i]
    for i in range(3):
        state[2 + i][:, :, idx] = wkv[..., i]


def _minimax_cache(config: Any) -> Callable[[], Any]:
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    return MiniMaxCache


def _rwkv_state(config: Any) -> Callable[[], Any]:
    # an empty list, which RwkvModel passes on as it is (it builds its own only for None);
    # StateFormat.load builds the tensors once it knows the batch
    return list


def _xlstm_cache(config: Any) -> Callable[[], Any]:
    from transformers.models.xlstm.modeling_xlstm import xLSTMCache

    # batch 1: load replaces every layer's (C, n, m) with the batch's; in a packed forward
    # the model copies the last segment's new state into this one, which nothing reads
    return functools.partial(xLSTMCache, config, max_batch_size=1)


#: the model-specific caches a forward insists on: name -> (config -> what makes an empty one)
CACHES: dict[str, Callable[[Any], Callable[[], Any]]] = {
    "minimax": _minimax_cache,
    "rwkv": _rwkv_state,
    "xlstm": _xlstm_cache,
}


#: Inkling's short convs, in the order of the attention layer's conv_states (and the plan's)
_INKLING_CONVS = ("k_sconv", "v_sconv", "attn_sconv", "mlp_sconv")

FORMATS: dict[str, StateFormat] = {
    "mamba2": StateFormat("mamba2"),
    "gated_deltanet": StateFormat("gated_deltanet", transposed=True),
    "mamba1": StateFormat("mamba1", stepwise=True),
    "short_conv": StateFormat("short_conv", recurrent=False),
    "rglru": StateFormat("rglru", conv_pad=0, holder="module", stepwise=True),
    "kda": StateFormat("kda"),
    "linear_attention": StateFormat(
        "linear_attention", conv=False, holder="linear_cache", cache="minimax"
    ),
    "rwkv4": StateFormat(
        "rwkv4",
        names=("shift", "wkv"),
        holder="rwkv_state",
        cache="rwkv",
        argument="state",
        layers="blocks",
        mixer="",  # both halves of the block use the state
        # transformers 5.24's one-token path mixes the [B, hidden] shift state into the
        # [B, 1, hidden] input unsqueezed at the wrong dim: [B, B, hidden], right for B = 1 only
        batched_decode=False,
    ),
    "mlstm": StateFormat(
        "mlstm",
        names=("C", "n", "m"),
        holder="xlstm_cache",
        cache="xlstm",
        argument="cache",
        layers="blocks",
        mixer="mlstm_layer",
    ),
    "cca": StateFormat(
        "cca",
        names=("conv", "v_delayed"),
        conv_pad=0,  # transformers keeps exactly the time0 + time1 - 2 columns the plan does
        recurrent_part="v_delayed",
        vector=True,
        mixer="self_attn.qkv_proj",
        outputs=3,  # query, key, value
    ),
    "ple_conv": StateFormat(
        "ple_conv",
        recurrent=False,
        names=("ple",),
        conv_names=("ple",),
        conv_pad=0,  # transformers keeps exactly the (kernel - 1) * dilation columns
        mixer="ple",
        state_index=1,  # conv_states[0] is the layer's GDN conv
        derived=(("ngram", 2),),
    ),
    "inkling_sconv": StateFormat(
        "inkling_sconv",
        recurrent=False,
        names=_INKLING_CONVS,
        conv_names=_INKLING_CONVS,
        # each conv's module, in conv_states order (transformers' conv_idx 0-3)
        modules=("self_attn.k_sconv", "self_attn.v_sconv", "attn_sconv", "mlp_sconv"),
    ),
}


def _own(kinds: Any) -> set[tuple[str | None, str]]:
    """The ``(cache, argument)`` pairs of the formats of ``kinds``, at most one."""
    own = {(FORMATS[k].cache, FORMATS[k].argument) for k in kinds if k in FORMATS}
    if len(own) > 1:
        raise ValueError(
            f"state kinds {sorted(set(kinds))} need different caches or forward arguments: "
            f"{sorted(own, key=str)}; a model's forward takes one"
        )
    return own


def cache_factory(config: Any, kinds: Any) -> Callable[[], Any]:
    """What makes an empty cache for a forward of a model whose state layers have ``kinds``:
    ``DynamicCache(config=config)``, unless their formats name the model's own cache
    (:data:`CACHES`: MiniMax's forward raises on any cache but its ``MiniMaxCache``; RWKV's
    takes a list of tensors, xLSTM's an ``xLSTMCache``)."""
    for name, _ in _own(kinds):
        if name is not None:
            return CACHES[name](config)
    from transformers import DynamicCache

    return functools.partial(DynamicCache, config=config)


def cache_argument(kinds: Any, forward: Callable[..., Any] | None = None) -> str:
    """The keyword a model whose state layers have ``kinds`` takes its cache by: RWKV's
    ``state``, xLSTM's ``cache`` (caches of their own), else ``cache`` where ``forward``'s
    signature has it (transformers 5.24, which this package is tested with, takes it and
    warns on ``past_key_values``, to go in 5.40), else ``past_key_values`` (older releases)."""
    if has_own_state(kinds):
        ((_, argument),) = _own(kinds)
        return argument
    if forward is not None and "cache" in inspect.signature(forward).parameters:
        return "cache"
    return "past_key_values"


def has_own_state(kinds: Any) -> bool:
    """The model builds and returns its state itself (RWKV's ``state`` list, xLSTM's
    ``xLSTMCache``: a format naming its own forward argument) rather than filling the cache it
    is given."""
    return any(argument != "past_key_values" for _, argument in _own(kinds))


def derived_history(fmt: StateFormat, config: Any) -> int:
    """How many of a request's tokens before a forward its derived parts read (0: none):
    Qwen4-Exp's n-gram context, ``ngram_size - 1``."""
    return config.get_text_config().ngram_size - 1 if fmt.derived else 0


def derived_parts(
    fmt: StateFormat, config: Any, tokens: Sequence[Sequence[int]]
) -> dict[str, torch.Tensor]:
    """The derived parts (``StateFormat.derived``) of one forward's requests, from
    ``tokens[r]``: request ``r``'s tokens before the forward (its prompt and outputs up to the
    forward's first position; only the last few are read). Qwen4-Exp's ``ngram``: ``[R,
    ngram_size - 1]`` int64, the last ``ngram_size - 1`` of them, left-padded with the eos id
    where there are fewer (transformers pads a cache-less forward's context with eos)."""
    out: dict[str, torch.Tensor] = {}
    for name, _ in fmt.derived:
        if name != "ngram":
            raise ValueError(f"no rule computes the derived state part {name!r}")
        text = config.get_text_config()
        width = derived_history(fmt, config)
        eos = text.eos_token_id[0] if isinstance(text.eos_token_id, list) else text.eos_token_id
        rows = [[eos] * max(0, width - len(t)) + list(t)[max(0, len(t) - width) :] for t in tokens]
        out[name] = torch.tensor(rows, dtype=torch.int64).reshape(len(tokens), width)
    return out


def refusal(kind: str) -> str | None:
    """Why the engine cannot serve layer kind ``kind`` (None: it can, or it is attention)."""
    if kind in REFUSED:
        return REFUSED[kind]
    if kind in FORMATS or kind in ("full_attention", "sliding_window"):
        return None
    return f"no StateFormat for {kind!r} layers (wired: {', '.join(FORMATS)})"


def _served() -> str:
    return (
        "the engine serves softmax attention (full, sliding-window with or without sinks or "
        "a relative-position bias, MLA; GQA and MLA behind a top-k indexer) and the "
        f"state kinds {', '.join(FORMATS)}"
    )


def check_wired(plan: Any) -> None:
    """:class:`Unservable` naming every refused layer kind of ``plan``, why, and what the
    engine serves."""
    if plan.kv_cache_layout is not None:
        # the allocator serves these plans (their rings too), so nothing else would stop them
        raise Unservable(
            f"{plan.model_name}: this plan keeps vLLM 0.33's cache formats packed block-"
            f"outermost ({plan.kv_cache_layout}: compressed or pooled indexer keys, a ring per "
            "request), which the engine's kernels do not read; it is for export (--format "
            "vllm) and simulation. Serve a plan in transformers' formats "
            "(cache_formats='transformers', the default)"
        )
    sharded = max((g.dcp_size for g in plan.groups), default=1)
    if sharded > 1:
        raise Unservable(
            f"{plan.model_name}: this plan shards its attention tokens over {sharded} decode-"
            "context-parallel ranks (dcp_size), and the engine is one process serving one "
            "rank's whole context; serve a plan of the model at dcp_size 1"
        )
    drafter = [p.layer for p in plan.kv_placements if p.layer.startswith(MTP_PREFIX)]
    if drafter:
        raise Unservable(
            f"{plan.model_name}: this plan holds an MTP drafter's KV cache ({', '.join(drafter)}: "
            "speculative_method='mtp'), and the engine runs no speculative decoding; serve a "
            "plan of the model without it"
        )
    kv = [p.kind for p in plan.kv_placements]
    states = [p.kind for p in plan.state_placements]
    refused = dict.fromkeys(k for k in (*kv, *states) if k in REFUSED)
    refused |= dict.fromkeys(k for k in states if k not in FORMATS)
    if refused:
        reasons = "; ".join(f"{k} layers: {refusal(k)}" for k in refused)
        raise Unservable(
            f"{plan.model_name} cannot be served by the engine: {reasons} ({_served()})"
        )


def _stepping() -> bool:
    """Inside an engine's forward (its paged-attention context is set)."""
    return attn.current_context() is not None


def install_stepwise(module: torch.nn.Module) -> None:
    """Make a multi-token forward of ``module`` run as one forward per token (the module's
    decode path, which continues the state it was given) inside an engine's forward; outside,
    as transformers alone runs it, the module is unchanged. Installing twice is a no-op."""
    if getattr(module, "hybridkv_stepwise", False):
        return
    if getattr(module, "hybridkv_varlen", False):
        raise RuntimeError("install_stepwise must come before install_varlen (which wraps it)")
    orig = module.forward

    def forward(hidden_states, *args, **kwargs):
        t = hidden_states.shape[1]
        if t == 1 or not _stepping():
            return orig(hidden_states, *args, **kwargs)
        outs = []
        for i in range(t):
            a, kw = _cut(hidden_states, args, kwargs, i, i + 1)
            outs.append(orig(*a, **kw))
        return _cat(outs)

    module.forward = forward
    # on the module, not on ``forward``: a later wrapper replaces ``module.forward``
    module.hybridkv_stepwise = True


@dataclass
class Packed:
    """The recurrent side of one packed forward. ``cu_seqlens``: the requests' token offsets in
    the packed sequence ``[R + 1]``; ``cache``: the cache object the model was given (each
    segment's mixer call gets its request's own instead); ``states``: layer index -> part ->
    ``[R, ...]`` in the plan's layout, read before and updated in place after each segment;
    ``new_cache``: makes an empty cache for one request (one per segment, shared by its
    layers, each layer loaded once, as :meth:`StateFormat.load` requires)."""

    cu_seqlens: list[int]
    cache: Any
    states: dict[int, dict[str, torch.Tensor]]
    new_cache: Callable[[], Any]
    caches: dict[int, Any] = field(default_factory=dict)

    def segment_cache(self, i: int) -> Any:
        if i not in self.caches:
            self.caches[i] = self.new_cache()
        return self.caches[i]


_PACKED: Packed | None = None


@contextmanager
def packed(p: Packed) -> Iterator[None]:
    """Run the modules :func:`install_varlen` wrapped segment by segment over ``p``."""
    global _PACKED
    _PACKED = p
    try:
        yield
    finally:
        _PACKED = None


def install_varlen(module: torch.nn.Module, fmt: StateFormat, idx: int) -> None:
    """Inside :func:`packed`, run ``module`` (layer ``idx``'s mixer of kind ``fmt``) on each
    request's segment of the packed ``[1, T, ...]`` input in turn, from that request's state,
    and write the state it ends with back; outside, unchanged. Install after
    :func:`install_stepwise` (a stepped module then steps within each segment). Installing
    twice is a no-op."""
    if getattr(module, "hybridkv_varlen", False):
        return
    orig = module.forward

    def forward(hidden_states, *args, **kwargs):
        p = _PACKED
        if p is None:
            return orig(hidden_states, *args, **kwargs)
        cu = p.cu_seqlens
        if hidden_states.shape[:2] != (1, cu[-1]):
            raise RuntimeError(
                f"layer {idx}'s mixer got input {tuple(hidden_states.shape)} in a packed forward "
                f"of {cu[-1]} tokens (expected [1, {cu[-1]}, ...])"
            )
        states = p.states[idx]
        outs = []
        for i, (a, b) in enumerate(pairwise(cu)):
            own = p.segment_cache(i)
            fmt.load(own, module, idx, {n: s[i : i + 1] for n, s in states.items()})
            swaps = fmt.swaps(p.cache, own, idx)
            c_args, c_kwargs = _cut(hidden_states, args, kwargs, a, b, swaps=swaps)
            out = orig(*c_args, **c_kwargs)
            fmt.returned(own, idx, out)
            # a module that returns the cache it was given (RWKV's block returns its state
            # list) hands the packed forward's on: the next layer's call swaps that one again
            if isinstance(out, tuple):
                out = tuple(p.cache if x is own else x for x in out)
            outs.append(out)
            for n, s in fmt.store(own, module, idx).items():
                states[n][i] = s[0]
        return _cat(outs, fmt.outputs)

    module.forward = forward
    module.hybridkv_varlen = True


def _cut(
    hidden: torch.Tensor,
    args: tuple,
    kwargs: dict,
    a: int,
    b: int,
    swaps: Sequence[tuple[Any, Any]] = (),
) -> tuple[tuple, dict]:
    """A module call's ``(args, kwargs)`` restricted to tokens ``a:b``: every ``[B, T, ...]``
    tensor (also inside tuples, e.g. ``(cos, sin)``) sliced along T, and each ``(old, new)``
    of ``swaps`` replacing the object ``old`` (a cache, or xLSTM's state tuple, whose tensors
    are not per token) by ``new``, before any slicing."""
    t = hidden.shape[1]
    swapped = {id(old): new for old, new in swaps}

    def cut(x: Any) -> Any:
        if id(x) in swapped:
            return swapped[id(x)]
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == t:
            return x[:, a:b]
        if isinstance(x, tuple):
            return tuple(cut(y) for y in x)
        return x

    return (cut(hidden), *(cut(x) for x in args)), {k: cut(v) for k, v in kwargs.items()}


def _cat(outs: list[Any], per_token: int = 1) -> Any:
    """Concatenate per-segment (or per-token) outputs along T; a tuple output concatenates its
    first ``per_token`` entries (ZAYA's CCA projection returns query, key and value) and keeps
    the last call's extras (RecurrentGemma's block returns ``(hidden, extra)``)."""
    if isinstance(outs[0], tuple):
        cat = [torch.cat([o[i] for o in outs], 1) for i in range(per_token)]
        return (*cat, *outs[-1][per_token:])
    return torch.cat(outs, 1)
