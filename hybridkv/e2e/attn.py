"""Paged attention for transformers' attention registry (``ATTN_NAME``).

Each attention layer writes its new K/V into the plan's pages with ``write_kv_cache`` and reads
the whole context back from the pages: ``paged_decode_attention`` when every request of the
batch brings one token, ``paged_prefill_attention`` (causal over cached prefix + new tokens)
otherwise. The K/V transformers hands over are only the new tokens; whatever HF cache object
the model was given keeps nothing that this function reads.

Per-forward inputs come from a :class:`PagedContext` set with :func:`set_context`: the block
table of every KV cache group (one row per request) and each request's number of tokens already
in the cache. A forward is either a batch (``[B, T]``: request ``b``'s token ``t`` sits at
position ``start[b] + t``) or packed (``[1, T]`` holding every request's tokens back to back,
request ``b``'s from ``cu_seqlens[b]`` to ``cu_seqlens[b + 1]``: varlen, no padding), which is
how the engine batches prefill chunks of different lengths; :meth:`PagedContext.token_positions`
maps either to each token's request and position.

A layer's pages are found by the module's ``layer_idx``. A module shared by several decoder
layers (Zamba2's shared attention blocks carry ``layer_idx = -1`` and are called with the
decoder layer's index as a ``layer_idx`` argument) is resolved by :func:`track_layer_index`,
which records that argument at each call. A sliding-window group's layers pass the group's
window to the kernels (the allocator frees the blocks that fall out of it, so reading them
would read the null block).

MLA layers (Kimi-Linear, Bailing hybrid, GLM-5-Next) bypass the attention interface, which
transformers hands K/V already expanded from the latent: :func:`install_mla` has the module run
:func:`mla_forward` (latent pages, absorbed ``mla_decode_attention``) inside an engine's forward;
GLM-5-Next's sparse-attention layers run :func:`dsa_forward`, whose indexer
(:func:`indexer_top_k`) keeps its per-token rows in the plan's indexer pages and hands the MLA
each query's token list. Inkling's attention (a relative-position bias on every logit, which
transformers builds densely as ``[B, heads, q, kv]``) runs :func:`relative_bias_forward`
(:func:`install_relative_bias`): the kernels compute the bias from the query tokens' relative
states and the layer's bank, so nothing of that size is built. Qwen4-Exp's indexed attention
(gated GQA behind a QSA indexer) runs :func:`qsa_forward` (:func:`install_qsa`): its indexer
(:func:`qsa_top_k`) keeps one raw key a token in the plan's indexer pages, scores the
mean-pooled, normalised and rotated groups with ``indexer_scores`` and hands the GQA each query
token's list, which the decode kernel's sparse walk attends to, one row per query token."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ..plan import MemoryPlan

ATTN_NAME = "hybridkv_paged"


@dataclass
class PagedContext:
    """``block_tables``: one int32 ``[B, max_blocks]`` table per KV cache group (a single
    tensor serves every group); ``start``: ``[B]`` tokens already cached per request (None: 0);
    ``cu_seqlens``: ``[B + 1]`` int64 offsets of a packed forward's requests (None: a batch).
    ``views``: ``layer index -> (k_cache, v_cache, group id)`` of every attention layer of
    ``plan`` over ``buffers`` (the layer index is transformers' ``layer_idx``);
    ``indexer_views``: ``layer index -> (key rows [num_blocks, block_size, 1, row], group id)``
    of every sparse-attention indexer (GLM-5-Next's DSA); ``windows``:
    group id -> the group's sliding window (None: full attention); ``called``: ``id(module) ->
    layer index`` of the shared modules being run (:func:`track_layer_index`)."""

    plan: MemoryPlan
    buffers: dict[str, torch.Tensor]
    block_tables: list[torch.Tensor] | torch.Tensor
    start: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    views: dict[int, tuple[torch.Tensor, torch.Tensor | None, int]] = field(init=False)
    indexer_views: dict[int, tuple[torch.Tensor, int]] = field(init=False)
    windows: dict[int, int | None] = field(init=False)
    called: dict[int, int] = field(init=False, default_factory=dict)
    #: the last :meth:`token_positions` answer with what it was computed from: every attention
    #: layer of a forward asks the same question
    _positions: tuple = field(init=False, default=(), repr=False)
    #: this forward's kernel plans (:meth:`kernel_plan`), made by its first layer of each group
    _plans: dict = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.views = {
            p.layer_index: (*self.plan.kv_views(self.buffers, p.layer), p.group_id)
            for p in self.plan.kv_placements
            if p.kind != "indexer"
        }
        # a sparse-attention indexer's key rows share their layer's index with its MLA
        self.indexer_views = {
            p.layer_index: (self.plan.kv_views(self.buffers, p.layer)[0], p.group_id)
            for p in self.plan.kv_placements
            if p.kind == "indexer"
        }
        self.windows = {g.group_id: g.sliding_window for g in self.plan.groups}

    def begin_forward(
        self,
        block_tables: list[torch.Tensor] | torch.Tensor,
        start: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
    ) -> None:
        """Set one forward's inputs; the previous forward's kernel plans are dropped."""
        self.block_tables, self.start, self.cu_seqlens = block_tables, start, cu_seqlens
        self._plans.clear()

    def kernel_plan(self, key: tuple, make):
        """The kernel plan named ``key`` for this forward: made once by ``make()`` (the first
        layer of a group to ask), then shared by every layer that asks with the same key. Plans
        hold the forward's block tables and lengths, so :meth:`begin_forward` drops them."""
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make()
        return plan

    def layer_of(self, module: torch.nn.Module) -> int:
        return self.called.get(id(module), module.layer_idx)

    def table(self, group_id: int) -> torch.Tensor:
        t = self.block_tables
        return t if isinstance(t, torch.Tensor) else t[group_id]

    def token_positions(self, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a forward whose tokens come as ``[b, t]``: each token's request ``[b * t]``, its
        position in that request ``[b * t]`` and the requests' query offsets ``[R + 1]`` (int64).
        A batch has ``R = b`` requests of ``t`` tokens; a packed forward (``cu_seqlens`` set)
        must come as ``[1, cu_seqlens[-1]]``."""
        memo = self._positions
        if memo and memo[0] == (b, t) and memo[1] is self.start and memo[2] is self.cu_seqlens:
            return memo[3]
        if self.cu_seqlens is None:
            cu = torch.arange(b + 1, dtype=torch.int64) * t
        else:
            cu = self.cu_seqlens.to(torch.int64)
            if b != 1 or t != int(cu[-1]):
                raise ValueError(
                    f"a packed forward's tokens come as [1, {int(cu[-1])}] (cu_seqlens' total); "
                    f"got [{b}, {t}]"
                )
        lens = cu.diff()
        seg = torch.repeat_interleave(torch.arange(len(lens)), lens)
        start = self.start if self.start is not None else torch.zeros(len(lens), dtype=torch.int64)
        pos = start.to(torch.int64)[seg] + torch.arange(b * t) - cu[seg]
        self._positions = ((b, t), self.start, self.cu_seqlens, (seg, pos, cu))
        return seg, pos, cu


_CTX: PagedContext | None = None


def set_context(ctx: PagedContext | None) -> None:
    global _CTX
    _CTX = ctx


def current_context() -> PagedContext | None:
    return _CTX


def _record_layer(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    if _CTX is not None:
        _CTX.called[id(module)] = kwargs["layer_idx"] if "layer_idx" in kwargs else args[1]


def track_layer_index(model: torch.nn.Module) -> None:
    """Have every module of ``model`` that is called with a ``layer_idx`` argument (a module
    shared between decoder layers) record it for :meth:`PagedContext.layer_of`; harmless
    outside a context, and done once per module."""
    for m in model.modules():
        if not hasattr(m, "layer_idx") or getattr(m, "hybridkv_tracked", False):
            continue
        params = list(inspect.signature(m.forward).parameters)
        if "layer_idx" in params and params.index("layer_idx") == 1:
            m.register_forward_pre_hook(_record_layer, with_kwargs=True)
            m.hybridkv_tracked = True


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention signature: ``query [B, Hq, T, D]``, ``key``/``value
    [B, Hkv, T, D]`` (new tokens only); returns ``[B, T, Hq, D]``. The mask is ignored: the
    kernels are causal by position and bounded by each request's length. The first layer of a
    KV cache group plans the forward's cache writes and attention
    (:meth:`PagedContext.kernel_plan`); every layer then only runs the plans on its own views.
    ``s_aux [Hq]`` (GraniteSWA's learnable per-head attention sinks, as transformers passes
    them) joins each head's softmax as one more logit with no value, in the kernels.
    ``rel_states [B * T, Hq, rel_dim]`` with ``rel_proj [rel_dim, rel_extent]`` (Inkling's, from
    :func:`relative_bias_forward`): a relative-position bias added to each logit, in the
    kernels. A dense ``position_bias`` is refused: the kernels take the bias only that way.
    ``token_indices [B * T, K]`` int32 (Qwen4-Exp's QSA pick, from :func:`qsa_forward`): each
    query token attends only to the positions its row lists (-1 padded), every query token a
    row of the decode kernel's sparse walk, prefill included."""
    ctx = _CTX
    if ctx is None:
        raise RuntimeError(f"{ATTN_NAME} attention called outside hybridkv.e2e.attn.set_context")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(
            f"{type(module).__name__} passes a dense position_bias [B, heads, q, kv], which "
            "the paged kernels do not take; its relative-position bias is served as the "
            "query's relative states and the layer's bank (install_relative_bias)"
        )
    layer = ctx.layer_of(module)
    k_cache, v_cache, gid = ctx.views[layer]
    b, hq, t, d = query.shape
    scale = scaling if scaling is not None else d**-0.5
    sinks = kwargs.get("s_aux")
    rel_states, rel_proj = kwargs.get("rel_states"), kwargs.get("rel_proj")
    shapes = (b, t, hq, key.shape[1], d, value.shape[3], query.dtype, float(scale))
    shapes += (sinks is not None, None if rel_states is None else rel_states.shape[-1])
    token_indices = kwargs.get("token_indices")
    width = None if token_indices is None else token_indices.shape[1]
    write, attend = ctx.kernel_plan(
        ("attention", gid, *shapes, width),
        lambda: _attention_plans(ctx, gid, k_cache, *shapes, token_indices=token_indices),
    )
    k = key.transpose(1, 2).reshape(b * t, key.shape[1], d).contiguous()
    v = value.transpose(1, 2).reshape(b * t, value.shape[1], value.shape[3]).contiguous()
    write.run(k, v, k_cache, v_cache)
    q = query.transpose(1, 2).reshape(b * t, hq, d).contiguous()
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).contiguous()
    if token_indices is not None:
        out = attend.run(q, k_cache, v_cache, sinks=sinks, token_indices=token_indices)
    else:
        out = attend.run(
            q, k_cache, v_cache, sinks=sinks, rel_states=rel_states, rel_proj=rel_proj
        )
    return out.reshape(b, t, hq, out.shape[-1]), None


def _attention_plans(
    ctx: PagedContext,
    gid: int,
    k_cache: torch.Tensor,
    b: int,
    t: int,
    hq: int,
    hkv: int,
    d: int,
    dv: int,
    q_dtype: torch.dtype,
    scale: float,
    sinks: bool,
    rel_dim: int | None,
    token_indices: torch.Tensor | None = None,
):
    """A forward's plans for one KV cache group: the cache write of its new tokens, and decode
    (every request brings one token) or varlen prefill over the pages (``sinks``: the layers
    pass per-head attention sinks; ``rel_dim``: a relative-position bias of that many states a
    head). With ``token_indices [B * T, K]`` (a QSA pick; every layer of the group passes its
    own list of that K to the plan's ``run``) every query token is one row of a sparse decode
    plan over its request's table row, its position + 1 the length, prefill or not."""
    from ..kernels import plan_decode, plan_prefill, plan_write_kv_cache

    table = ctx.table(gid).to(torch.int32).contiguous()
    bs = k_cache.shape[1]
    seg, pos, cu = ctx.token_positions(b, t)  # [N], [N], [R + 1]
    slots = table.to(torch.int64)[seg, pos // bs] * bs + pos % bs
    write = plan_write_kv_cache(
        slots, num_heads=hkv, head_dim=d, head_dim_v=dv, block_size=bs,
        num_blocks=k_cache.shape[0], key_dtype=q_dtype, cache_dtype=k_cache.dtype,
    )  # fmt: skip
    if token_indices is not None:
        rows = (pos + 1).to(torch.int32)
        attend = plan_decode(
            table[seg].contiguous(), rows, num_heads=hq, num_kv_heads=hkv, head_dim=d,
            head_dim_v=dv, block_size=bs, cache_dtype=k_cache.dtype, q_dtype=q_dtype,
            scale=scale, sliding_window=ctx.windows[gid], max_seq_len=int(rows.max()),
            sinks=sinks, rel_dim=rel_dim, token_indices=token_indices,
        )  # fmt: skip
        return write, attend
    lens = cu.diff()
    seq_lens = (pos[cu[1:] - 1] + 1).to(torch.int32)  # [R]: each request's last position + 1
    shared = dict(
        num_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, block_size=bs,
        cache_dtype=k_cache.dtype, q_dtype=q_dtype, scale=scale,
        sliding_window=ctx.windows[gid], max_seq_len=int(seq_lens.max()), sinks=sinks,
        rel_dim=rel_dim,
    )  # fmt: skip
    if bool((lens == 1).all()):
        return write, plan_decode(table, seq_lens, **shared)
    attend = plan_prefill(
        table, cu.to(torch.int32), seq_lens, total_q=b * t, max_query_len=int(lens.max()),
        **shared,
    )  # fmt: skip
    return write, attend


def install_relative_bias_layers(model: torch.nn.Module) -> None:
    """:func:`install_relative_bias` on every attention module of ``model`` with a
    hidden-state-conditioned relative-position bias (Inkling's: ``r_proj`` and
    ``rel_logits_proj``)."""
    for m in model.modules():
        if hasattr(m, "rel_logits_proj") and hasattr(m, "r_proj"):
            install_relative_bias(m)


def install_relative_bias(module: torch.nn.Module) -> None:
    """Have an Inkling attention module (transformers' ``InklingAttention``) run
    :func:`relative_bias_forward` inside an engine's forward; outside, it runs unchanged.
    Installing twice is a no-op.

    Why not the attention interface: transformers builds the bias densely (``[B, heads, q,
    kv]``) from positions it reads off its cache (``get_mask_sizes``, ``get_query_offset``),
    which the engine's per-forward cache does not hold, and hands it over as ``position_bias``;
    the kernels take the query tokens' relative states and the layer's bank instead."""

    def forward(hidden_states, *args, **kwargs):
        return relative_bias_forward(
            module, hidden_states, kwargs.get("conv_mask"), kwargs.get("cache")
        )

    _serve_in_engine(module, "hybridkv_relative_bias", forward)


def relative_bias_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    conv_mask: torch.Tensor | None,
    cache: object,
) -> tuple[torch.Tensor, None]:
    """Inkling's attention, ``hidden_states [B, T, hidden]`` -> ``([B, T, hidden], None)``, as
    ``InklingAttention.forward`` computes it: q, k (after its short conv ``k_sconv``), v (after
    ``v_sconv``) and the relative states ``r_proj(hidden)``, q / k RMS-normed per head, then
    attention at ``1 / head_dim`` over the pages (:func:`paged_attention`) with the bias
    ``relative_states @ rel_logits_proj.proj[:, distance]`` added in the kernels (distance
    below the bank's width; a sliding layer's bank is its window wide). On full layers with
    ``log_scaling_n_floor`` the query and the bias are scaled by each query position's
    ``tau``, as transformers does: the bias through the relative states (it is linear in
    them). The convs read and write their states in ``cache`` (:mod:`.states` hands them
    over; a packed forward runs each per segment)."""
    m = module
    b, t, _ = hidden_states.shape
    shape = (b, t, -1, m.head_dim)
    q = m.q_norm(m.q_proj(hidden_states).view(shape))
    k = m.k_sconv(m.k_proj(hidden_states), cache=cache, conv_mask=conv_mask)
    v = m.v_sconv(m.v_proj(hidden_states), cache=cache, conv_mask=conv_mask)
    k = m.k_norm(k.view(shape))
    rel = m.r_proj(hidden_states).view(b * t, m.num_heads, -1)
    floor = m.config.log_scaling_n_floor
    if not m.is_sliding and floor is not None:
        _, pos, _ = _CTX.token_positions(b, t)  # [B * T]
        tau = 1.0 + m.config.log_scaling_alpha * torch.log(
            ((pos + 1).float() / floor).clamp(min=1.0)
        )
        q = (q.float() * tau.view(b, t, 1, 1)).to(q.dtype)
        rel = (rel.float() * tau.view(b * t, 1, 1)).to(rel.dtype)
    out, _ = paged_attention(
        m, q.transpose(1, 2), k.transpose(1, 2), v.view(shape).transpose(1, 2), None,
        scaling=m.scaling, rel_states=rel.contiguous(),
        rel_proj=m.rel_logits_proj.proj.detach().contiguous(),
    )  # fmt: skip
    return m.o_proj(out.reshape(b, t, -1)), None


def install_qsa_layers(model: torch.nn.Module, plan: MemoryPlan) -> None:
    """:func:`install_qsa` on the attention module of every layer of ``plan`` whose indexer sits
    beside GQA (an ``indexer`` placement without an MLA one: Qwen4-Exp's QSA), with the
    model's rotary embedding (the pooled keys' rotation needs positions of past tokens)."""
    mla = {p.layer_index for p in plan.kv_placements if p.kind == "mla"}
    layers = [
        p.layer_index
        for p in plan.kv_placements
        if p.kind == "indexer" and p.layer_index not in mla
    ]
    if not layers:
        return
    decoder = model.get_decoder()
    rotary = getattr(decoder, "rotary_emb", None)
    for i in layers:
        module = decoder.layers[i].self_attn
        if not _is_qsa(module) or rotary is None:
            raise NotImplementedError(
                f"layer {i} has an indexer beside GQA attention, but its attention "
                f"({type(module).__name__}) is not Qwen4-Exp's QSA (an indexer with "
                f"index_qk_proj and compress_ratio, and a rotary_emb on the decoder): the "
                f"engine serves no other GQA indexer"
            )
        install_qsa(module, rotary)


def _is_qsa(module: torch.nn.Module) -> bool:
    """Qwen4-Exp's indexed attention (transformers' ``Qwen4ExpTextAttention``)."""
    ix = getattr(module, "indexer", None)
    return ix is not None and hasattr(ix, "index_qk_proj") and hasattr(ix, "compress_ratio")


def install_qsa(module: torch.nn.Module, rotary: torch.nn.Module) -> None:
    """Have a Qwen4-Exp indexed-attention module run :func:`qsa_forward` inside an engine's
    forward; outside, it runs unchanged. Installing twice is a no-op.

    Why not the attention interface alone: transformers' module runs its indexer first, over
    keys it keeps in its cache (``update_indexer``) and positions it keeps on the first indexed
    layer, and hands the interface a dense ``[B, 1, T, kv]`` mask of the pick; the engine keeps
    the keys in the plan's indexer pages, scores them with ``indexer_scores`` and hands the
    attention a token list instead (:func:`paged_attention`'s ``token_indices``)."""

    def forward(hidden_states, *args, **kwargs):
        rotary_states = kwargs.get("position_embeddings")
        if rotary_states is None:
            rotary_states = args[0]  # transformers passes (cos, sin) after the states
        return qsa_forward(module, rotary, hidden_states, rotary_states)

    _serve_in_engine(module, "hybridkv_qsa", forward)


def qsa_forward(
    module: torch.nn.Module,
    rotary: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, None]:
    """Qwen4-Exp's indexed attention, ``hidden_states [B, T, hidden]``: the layer's QSA indexer
    (:func:`qsa_top_k`) picks each query token's tokens, then the gated GQA (``q_proj`` gives
    query and gate; q / k RMSNorm, rotary) writes its new K / V into the pages and attends to
    those tokens only (:func:`paged_attention` with ``token_indices``). ``position_embeddings``:
    the model's ``(cos, sin)`` of the forward's tokens (the last ``T`` are used, as
    transformers slices them). Returns what transformers' forward does: the output, no
    weights."""
    m = module
    b, t, _ = hidden_states.shape
    cos, sin = (x[:, -t:] for x in position_embeddings)
    topk = qsa_top_k(m.indexer, rotary, hidden_states, (cos, sin))
    input_shape, hidden_shape = hidden_states.shape[:-1], (b, t, -1, m.head_dim)
    q, gate = torch.chunk(m.q_proj(hidden_states).view(b, t, -1, m.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(*input_shape, -1)
    q = m.q_norm(q.reshape(hidden_shape)).transpose(1, 2)
    k = m.k_norm(m.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    v = m.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    rotate = sys.modules[type(m).__module__].apply_rotary_pos_emb
    q, k = rotate(q, k, cos, sin)
    out, _ = paged_attention(m, q, k, v, None, scaling=m.scaling, token_indices=topk)
    out = out.reshape(*input_shape, -1).contiguous() * torch.sigmoid(gate)
    return m.o_proj(out), None


def qsa_top_k(
    indexer: torch.nn.Module,
    rotary: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Qwen4-Exp's QSA indexer over the plan's pages: writes each new token's raw indexer key
    (transformers' ``update_indexer`` row, the ``IndexerSpec`` row) into the layer's indexer
    pages, then scores every query token of the forward against the complete groups of
    ``compress_ratio`` tokens its request's context holds up to it, in one launch of
    ``indexer_scores`` with ``pool="mean_norm_rope"`` (each group's raw keys averaged,
    ``k_layernorm``'d and rotated at the group's first position; the ReLU'd head dots summed
    over the indexer heads, ``/ sqrt(D)``), and picks in torch (:func:`_qsa_pick`). Returns
    ``[B * T, budget + ratio - 1]`` int32 token positions, -1 padded: the tokens of the top
    ``budget // ratio`` groups and the open group's tail.

    The kernel plan (the token tiles, the groups' rotary at their first positions, from
    ``rotary``, the model's rotary embedding) is made once per forward and shared by every QSA
    layer (:meth:`PagedContext.kernel_plan`). Scores equal transformers' up to summation order
    (float32 pooling and dots; the rows' dtype's rounding of each transform step is kept), and
    the pick is ``torch.topk`` on the same scores in the same shape transformers calls it on,
    so ties (a group whose every head's dot is negative scores exactly 0) break the same way;
    only groups whose scores differ in their last bits can swap at the cut."""
    from ..kernels import plan_indexer_scores

    ctx = _CTX
    ix = indexer
    b, t, _ = hidden_states.shape
    n, heads, dim, ratio = b * t, ix.index_n_heads, ix.index_head_dim, ix.compress_ratio
    rows, gid = ctx.indexer_views[ix.layer_idx]  # [num_blocks, block_size, 1, D]
    if rows.shape[-1] != dim:
        raise ValueError(
            f"layer {ix.layer_idx}'s indexer keys have {dim} elements a token but the plan's "
            f"indexer pages {rows.shape[-1]}: the plan was made for another config"
        )
    bs = rows.shape[1]
    q, raw = ix.index_qk_proj(hidden_states).split([heads * dim, dim], dim=-1)
    q = ix.q_layernorm(q.reshape(b, t, heads, dim))
    cos, sin = position_embeddings
    q = sys.modules[type(ix).__module__].apply_rotary_pos_emb(q, cos=cos, sin=sin, unsqueeze_dim=2)
    seg, pos, cu = ctx.token_positions(b, t)

    def make_plan():
        """Where the forward's new rows go, the scores' plan (each request's complete groups
        at the end of the forward), the rotary at each group's first position and the heads'
        weights (the same for every QSA layer of the forward: the first one makes them)."""
        table = ctx.table(gid).to(torch.int32).contiguous()
        write = (table.to(torch.int64)[seg, pos // bs], pos % bs)
        seen = torch.zeros(len(cu) - 1, dtype=torch.int64).scatter_reduce(
            0, seg, pos + 1, "amax"
        )  # [R] context length at the end of the forward
        groups = seen // ratio
        scores = plan_indexer_scores(
            table, seg.to(torch.int32), pos.to(torch.int32), groups.to(torch.int32),
            num_heads=heads, head_dim=dim, kpool=ratio, block_size=bs, rows_dtype=rows.dtype,
            q_dtype=torch.float32, softmax_scale=1.0, pool="mean_norm_rope",
            rotary_dim=cos.shape[-1], norm_eps=ix.k_layernorm.eps,
        )  # fmt: skip
        most = max(int(groups.max()), 1)
        starts = (torch.arange(most) * ratio).view(1, 1, -1).expand(3, 1, -1)  # text: 3 equal
        g_cos, g_sin = rotary(hidden_states, starts)  # [1, most, rot] in the model dtype
        # the heads' ReLU'd dots are summed and divided by sqrt(D): one weight for every head
        weights = torch.full((n, heads), dim**-0.5, dtype=torch.float32)
        return write, scores, g_cos[0].float().contiguous(), g_sin[0].float().contiguous(), weights

    plan_key = ("qsa", gid, b, t, ratio, dim, heads, rows.dtype)
    (blocks, slots), plan, g_cos, g_sin, weights = ctx.kernel_plan(plan_key, make_plan)
    rows[blocks, slots, 0] = raw.reshape(n, dim).to(rows.dtype)
    norm = (1.0 + ix.k_layernorm.weight.float()).contiguous()
    scores = plan.run(
        q.reshape(n, heads, dim).float().contiguous(), weights, rows, norm=norm, cos=g_cos,
        sin=g_sin,
    )  # fmt: skip
    return _qsa_pick(scores, pos, ratio, ix.token_budget)


def _qsa_pick(
    scores: torch.Tensor, query_pos: torch.Tensor, ratio: int, budget: int
) -> torch.Tensor:
    """The pick of transformers' ``Qwen4ExpTextQSAIndexer`` from group scores ``[T, P]`` of
    query tokens at ``query_pos [T]``: the tokens of the top ``budget // ratio`` of the
    ``(pos + 1) // ratio`` complete groups each query sees, then the open group's tokens up to
    the query, -1 padded to ``budget + ratio - 1`` int32 positions a row. ``torch.topk`` runs
    per query on exactly the visible groups' scores, as transformers calls it (a 1-D tensor of
    that length), so that equal scores (exact zeros after the ReLU) break the same way."""
    width = budget + ratio - 1
    out = torch.full((len(query_pos), width), -1, dtype=torch.int64)
    offsets = torch.arange(ratio)
    for i, p in enumerate(query_pos.tolist()):
        visible = (p + 1) // ratio
        picked = torch.empty(0, dtype=torch.int64)
        if visible:
            top = scores[i, :visible].topk(min(budget // ratio, visible), dim=0).indices
            picked = (top[:, None] * ratio + offsets).flatten()
        tail = torch.arange(visible * ratio, p + 1)
        row = torch.cat([picked, tail])
        out[i, : len(row)] = row
    return out.to(torch.int32)


def install_mla_layers(model: torch.nn.Module, plan: MemoryPlan) -> None:
    """:func:`install_mla` on the attention module of every MLA layer of ``plan``."""
    for p in plan.kv_placements:
        if p.kind == "mla":
            install_mla(model.get_decoder().layers[p.layer_index].self_attn)


def install_mla(module: torch.nn.Module) -> None:
    """Have an MLA attention module (transformers' ``KimiLinearMLA``: ``q_proj`` or the
    ``q_a/q_b`` pair, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``)
    run :func:`mla_forward` inside an engine's forward (a context is set); outside, it runs
    unchanged. Installing twice is a no-op.

    Why not the attention interface: transformers' MLA passes the compressed latent only to
    ``Cache.update`` and hands the interface per-head K/V already expanded by ``kv_b_proj``,
    while the plan's MLA pages hold the latent that :func:`mla_decode_attention` reads."""

    def forward(hidden_states, *args, **kwargs):
        if _is_dsa(module):
            return dsa_forward(module, hidden_states, kwargs.get("prev_topk_indices"))
        rotary = kwargs.get("position_embeddings")
        if rotary is None and args and isinstance(args[0], tuple):
            rotary = args[0]  # transformers passes (cos, sin) positionally after the states
        return mla_forward(module, hidden_states, rotary), None

    _serve_in_engine(module, "hybridkv_mla", forward)


def _serve_in_engine(module: torch.nn.Module, flag: str, engine_forward: Callable) -> None:
    """Have ``module`` run ``engine_forward(hidden_states, *args, **kwargs)`` inside an
    engine's forward (a context is set) and its own ``forward`` outside. ``flag``, set on the
    module (a later wrapper would replace ``forward``), makes a second install a no-op."""
    if getattr(module, flag, False):
        return
    orig = module.forward

    def forward(hidden_states, *args, **kwargs):
        if _CTX is None:
            return orig(hidden_states, *args, **kwargs)
        return engine_forward(hidden_states, *args, **kwargs)

    module.forward = forward
    setattr(module, flag, True)


def _is_dsa(module: torch.nn.Module) -> bool:
    """A DeepSeek-sparse-attention MLA (transformers' ``Glm5NextTextAttention``): its own
    indexer (``indexer``) or the previous layer's top-k (``skip_topk``)."""
    return hasattr(module, "skip_topk") and hasattr(module, "indexer")


def dsa_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    prev_topk: torch.Tensor | None,
) -> tuple[torch.Tensor, None, torch.Tensor | None]:
    """GLM-5-Next's MLA with DeepSeek sparse attention, ``hidden_states [B, T, hidden]``: the
    layer's indexer (:func:`indexer_top_k`) picks each query token's tokens, or the layer reuses
    the previous layer's pick (``prev_topk``, ``indexer_types`` "shared"), and the absorbed MLA
    attends to those tokens only (the sparse walk of ``mla_decode_attention``). Returns what
    transformers' forward does: the output, no weights, and the pick when the next layer shares
    it (``[B * T, K]`` int32 token positions, -1 padded; transformers passes it on untouched)."""
    m = module
    q_resid = m.q_a_layernorm(m.q_a_proj(hidden_states))
    if m.indexer is not None:
        topk = indexer_top_k(m.indexer, hidden_states, q_resid)
    elif prev_topk is None:
        raise ValueError(
            f"layer {m.layer_idx} shares the previous layer's top-k (indexer_types 'shared') "
            "but none was passed on: a shared layer must follow a layer with its own indexer"
        )
    else:
        topk = prev_topk
    out = mla_forward(m, hidden_states, None, token_indices=topk, q_resid=q_resid)
    return out, None, topk if m.next_skip_topk else None


def indexer_top_k(
    indexer: torch.nn.Module, hidden_states: torch.Tensor, q_resid: torch.Tensor
) -> torch.Tensor:
    """GLM-5-Next's DSA indexer over the plan's pages: writes each new token's row (its key,
    its k-pool gate scores and a validity flag: transformers' ``packed_states``, the
    ``IndexerSpec`` row) into the indexer's pages, then scores every query token of the forward
    against the complete pools of its request's context that it can see, in one launch of
    ``indexer_scores`` (``hybridkv_kernels.indexer_scores``: each pool's key is its tokens'
    keys weighted by a softmax of the gates, ``index_kpool`` tokens a pool, read back from the
    pages; then the ReLU'd head dots, weighted and summed, as transformers'
    ``Glm5NextTextIndexer`` scores), and picks in torch (:func:`_pick_from_scores`). Returns
    ``[B * T, K]`` int32 token positions (``K = index_topk``, plus ``index_kpool - 1`` with the
    open pool's tail), -1 padded: the tokens of the top ``index_topk // index_kpool`` pools
    and of the open pool.

    The kernel plan (the token tiles, each request's pools) is made once per forward and
    shared by every indexer layer (:meth:`PagedContext.kernel_plan`). The engine's picks equal
    transformers' up to ties, as the torch path this replaces (kept in
    ``tests/kernel_tests/test_indexer.py`` as the reference the kernel's pick is compared
    with): the kernel pools in float32 (transformers in the rows' dtype: the same for float32
    models) and sums in another order, so scores differ in their last bits and only pools whose
    scores agree that closely can swap at the cut."""
    from ..kernels import plan_indexer_scores

    ctx = _CTX
    ix = indexer
    b, t, _ = hidden_states.shape
    n = b * t
    rows, gid = ctx.indexer_views[ix.layer_idx]  # [num_blocks, block_size, 1, row]
    bs, kpool, dim = rows.shape[1], ix.index_kpool, ix.head_dim
    key = ix.k_norm(ix.wk(hidden_states)).reshape(n, dim)
    gate = torch.nn.functional.linear(hidden_states, ix.index_kpool_compress_gate).reshape(n, dim)
    packed_row = torch.cat([key, gate, key.new_ones(n, 1)], dim=-1)
    if packed_row.shape[1] != rows.shape[-1]:
        raise ValueError(
            f"layer {ix.layer_idx}'s indexer rows hold {packed_row.shape[1]} elements a token "
            f"but the plan's indexer pages {rows.shape[-1]}: the plan was made for another config"
        )
    seg, pos, cu = ctx.token_positions(b, t)

    def make_plan():
        """Where the forward's new rows go, and the scores' plan: each query token's request
        and position, each request's complete pools at the end of the forward (the same for
        every indexer layer of the forward: the first one makes it)."""
        table = ctx.table(gid).to(torch.int32).contiguous()
        write = (table.to(torch.int64)[seg, pos // bs], pos % bs)
        seen = torch.zeros(len(cu) - 1, dtype=torch.int64)  # [R] context length at the end
        seen = seen.scatter_reduce(0, seg, pos + 1, "amax")
        scores = plan_indexer_scores(
            table, seg.to(torch.int32), pos.to(torch.int32), (seen // kpool).to(torch.int32),
            num_heads=ix.n_heads, head_dim=dim, kpool=kpool, block_size=bs,
            rows_dtype=rows.dtype, q_dtype=torch.float32, softmax_scale=ix.softmax_scale,
        )  # fmt: skip
        return write, scores

    plan_key = ("indexer", gid, b, t, kpool, dim, ix.n_heads, float(ix.softmax_scale))
    (blocks, slots), plan = ctx.kernel_plan(plan_key, make_plan)
    rows[blocks, slots, 0] = packed_row.to(rows.dtype)

    q = ix.wq_b(q_resid).reshape(n, ix.n_heads, dim).float().contiguous()
    weights = ix.weights_proj(hidden_states.to(ix.weights_proj.weight.dtype)).float()
    weights = (weights.reshape(n, ix.n_heads) * ix.n_heads**-0.5).contiguous()
    ape = ix.index_kpool_compress_ape.detach().float().contiguous()
    scores = plan.run(q, weights, rows, ape)  # [N, max pools of the forward's requests]
    tail = kpool - 1 if ix.index_kpool_always_select_tail else 0
    return _pick_from_scores(scores, pos, kpool, ix.index_topk, tail)


def _pick_from_scores(
    scores: torch.Tensor, query_pos: torch.Tensor, kpool: int, index_topk: int, tail: int
) -> torch.Tensor:
    """The pick of transformers' ``Glm5NextTextIndexer`` from pool scores ``[T, P]`` (pools a
    query token cannot see at -inf or ``finfo.min``) of query tokens at ``query_pos [T]``: the
    tokens of the top ``index_topk // kpool`` pools (``torch.topk``; a pick of a masked pool
    lists -1), then the open pool's first ``tail`` tokens the query sees, -1 padded to
    ``index_topk + tail`` int32 positions a row, on ``scores``' device."""
    device = scores.device
    query_pos = query_pos.to(device)
    width = index_topk + tail
    num_pools = scores.shape[1]
    select = min(index_topk // kpool, num_pools)
    if select:
        floor = torch.finfo(scores.dtype).min
        top = scores.topk(select, dim=-1)
        tokens = top.indices[..., None] * kpool + torch.arange(kpool, device=device)
        tokens = tokens.masked_fill((top.values <= floor)[..., None], -1).flatten(1)
    else:
        tokens = torch.full((len(query_pos), 0), -1, dtype=torch.int64, device=device)
    if tail:
        seen = query_pos + 1  # tokens each query sees
        open_count = seen % kpool
        offsets = torch.arange(tail, device=device)
        tail_tokens = (seen - open_count)[:, None] + offsets
        tail_tokens = tail_tokens.masked_fill(offsets[None, :] >= open_count[:, None], -1)
        tokens = torch.cat([tokens, tail_tokens], dim=1)
    if tokens.shape[1] < width:
        tokens = torch.nn.functional.pad(tokens, (0, width - tokens.shape[1]), value=-1)
    return tokens[:, :width].to(torch.int32)


def mla_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    token_indices: torch.Tensor | None = None,
    q_resid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA over the plan's latent pages, ``hidden_states [B, T, hidden]`` ->
    ``[B, T, hidden]``: the new tokens' latents ``[c_kv, k_pe]`` are written into the pages,
    ``W_UK`` (``kv_b_proj``'s key rows) is folded into the query and ``W_UV`` applied to the
    attention-weighted latent, and every query token is one :func:`mla_decode_attention` row
    over its prefix (causal by construction; T rows per request in a prefill).

    ``rotary`` (``cos, sin [B, T, qk_rope_head_dim]``, the model's position embeddings; None
    for a NoPE MLA such as Kimi-Linear's): ``q_pe`` and ``k_pe`` are rotated by the module's
    own DeepSeek-style interleaved rotary (its module's ``apply_rotary_pos_emb_interleave``) and
    ``k_pe`` is cached rotated, as transformers' cache and vLLM's keep it. A module with a
    head-wise output gate (``g_proj``: Bailing hybrid / Ling 3) multiplies each head's output by
    ``sigmoid(g_proj(hidden))`` before ``o_proj``, as its own forward does.

    ``token_indices [B * T, K]`` int32 (a sparse-attention indexer's pick, -1 padded): each query
    token attends only to the positions its row lists (:func:`dsa_forward`). ``q_resid``: the
    query's ``q_a_layernorm(q_a_proj(hidden))`` when the caller computed it already."""
    from ..kernels import plan_mla_decode

    ctx = _CTX
    m = module
    b, t, _ = hidden_states.shape
    h, d_nope, d_rope, d_v = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    if m.q_lora_rank is None:
        q = m.q_proj(hidden_states)
    else:
        if q_resid is None:
            q_resid = m.q_a_layernorm(m.q_a_proj(hidden_states))
        q = m.q_b_proj(q_resid)
    q_nope, q_pe = q.view(b * t, h, d_nope + d_rope).split([d_nope, d_rope], dim=-1)
    c_kv, k_pe = m.kv_a_proj_with_mqa(hidden_states).split([m.kv_lora_rank, d_rope], dim=-1)
    if rotary is not None:
        q_pe, k_pe = _rotate_mla(m, q_pe, k_pe, rotary, b, t)
    latent = torch.cat([m.kv_a_layernorm(c_kv), k_pe], dim=-1).reshape(b * t, -1)

    layer = ctx.layer_of(m)
    cache, _, gid = ctx.views[layer]
    bs = cache.shape[1]
    seg, pos, _ = ctx.token_positions(b, t)  # [B * T] each

    def make_plan():
        """Every query token is one decode row over its own prefix: its request's table row
        and its position + 1 as the length (the same for every MLA layer of the forward)."""
        table = ctx.table(gid).to(torch.int32).contiguous()
        seq_lens = (pos + 1).to(torch.int32)
        blocks = table.to(torch.int64)[seg, pos // bs]
        plan = plan_mla_decode(
            table[seg], seq_lens, num_heads=h, kv_lora_rank=m.kv_lora_rank,
            qk_rope_head_dim=d_rope, block_size=bs, cache_dtype=cache.dtype,
            q_dtype=q_nope.dtype, scale=m.scaling, max_seq_len=int(seq_lens.max()),
            token_indices=token_indices,
        )  # fmt: skip
        return blocks, plan

    shapes = (b, t, h, m.kv_lora_rank, d_rope, q_nope.dtype, float(m.scaling))
    width = None if token_indices is None else token_indices.shape[1]
    blocks, plan = ctx.kernel_plan(("mla", gid, *shapes, width), make_plan)
    cache.view(cache.shape[0], bs, -1)[blocks, pos % bs] = latent.to(cache.dtype)

    w = m.kv_b_proj.weight.view(h, d_nope + d_v, m.kv_lora_rank)
    q_abs = torch.einsum("xhn,hnc->xhc", q_nope, w[:, :d_nope]).contiguous()
    out = plan.run(q_abs, q_pe.contiguous(), cache, token_indices=token_indices)
    out = torch.einsum("xhc,hvc->xhv", out, w[:, d_nope:])
    gate_proj = getattr(m, "g_proj", None)
    if gate_proj is not None:
        gate = torch.sigmoid(gate_proj(hidden_states).float()).to(out.dtype)  # [B, T, H]
        out = out * gate.reshape(b * t, h, 1)
    return m.o_proj(out.reshape(b, t, h * d_v))


def _rotate_mla(
    module: torch.nn.Module,
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    b: int,
    t: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_pe [B*T, H, R]`` and ``k_pe [B, T, R]`` rotated by ``rotary`` (``cos, sin [B, T,
    R]``) with the rotary function of the module's own transformers module; refused when that
    module has no DeepSeek-style interleaved rotary, or when its config turns it off
    (``rope_interleave=False``: DeepSeek-V3's code then rotates halves, a layout the engine
    would need its own function for)."""
    config = getattr(module, "config", None)
    if getattr(config, "rope_interleave", True) is False:
        raise NotImplementedError(
            f"{type(module).__name__} has rope_interleave=False in its config: its MLA rotates "
            "the rope part by halves, and the engine knows only the interleaved rotary "
            "(apply_rotary_pos_emb_interleave): serving it needs a by-halves rotary in "
            "_rotate_mla (flipping the flag would run another model than its weights)"
        )
    rotate = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb_interleave", None)
    if rotate is None:
        raise NotImplementedError(
            f"{type(module).__name__} applies a rotary embedding to its MLA but its module has "
            "no apply_rotary_pos_emb_interleave (DeepSeek's layout), the only one the engine "
            "knows; serve a NoPE MLA (Kimi-Linear) or one with that rotary (Bailing hybrid)"
        )
    cos, sin = rotary
    h, r = q_pe.shape[1], q_pe.shape[2]
    q_rot, k_rot = rotate(q_pe.reshape(b, t, h, r), k_pe.reshape(b, t, 1, r), cos, sin,
                          unsqueeze_dim=2)  # fmt: skip
    return q_rot.reshape(b * t, h, r), k_rot.reshape(b, t, r)


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
