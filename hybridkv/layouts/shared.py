"""One shared pool of equal pages: ``inflate`` (vLLM), ``pack(N)`` (vLLM PR #35703) and
``aggregate`` (the layout proposed in vLLM PR #21123).

All three keep vLLM's hybrid design: every KV cache group draws block ids from one pool, a block
id is one page in each of ``group_size`` tensors, and attention and state pages have the same size
so that a freed attention block can hold a state and vice versa. They differ in how many
attention layers share a page:

- ``inflate``: one attention layer per page. The page must hold one layer's state, so the
  attention block is raised to ``align * cdiv(state_bytes, align * bytes_per_token)`` tokens
  (Qwen3.5-4B: 528 tokens) and the state page is padded up to the attention page.
- ``pack(N)``: N attention layers per page, each on ``1/N`` of it: layer ``j`` of a pack has its K
  at ``2*j*sub`` and V at ``(2j+1)*sub`` of the page, so the block size drops about N-fold while
  every page still fits a state.
- ``aggregate``: all attention layers of a kind in one page (``N`` = their count), so the attention
  group has a single tensor slot and every state layer becomes its own group.

A sparse-attention indexer's keys (GLM-5-Next, Qwen4-Exp) ride in the page of their decoder
layer's attention: right after its latent (or its K and V), ``block_size`` rows of the indexer,
so both have one block table, as vLLM gives them ("the indexer shares one block with the
co-located MLA"). Three per-token kinds of one layer (an SWA layer's K and V, a latent, indexer
keys) would be packed the same way, one after another. The block size still follows vLLM's
rule, which reads the attention's bytes per token alone; the page then grows by the indexer's
rows, and states are padded up to it.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..dtypes import dtype_bytes
from ..models.model import CacheLayer, HybridModel
from ..plan import (
    KVCacheGroup,
    KVPlacement,
    MemoryPlan,
    PlanConfig,
    PoolPlan,
    StatePlacement,
    TensorPlan,
)
from ..specs import FullAttentionSpec, IndexerSpec, MLASpec
from ..target import vllm_state_page_floor
from ._common import (
    Bucket,
    buckets,
    cdiv,
    group_size_vllm,
    make_capacity,
    split_bucket,
    state_components,
    state_placement,
    state_reservation,
    too_small,
)


def _attn1(layer: CacheLayer, dtype: str | None = None) -> int:
    """Bytes one token of ``layer`` takes, in its own dtype or in ``dtype``."""
    spec = layer.spec
    if dtype is not None and spec.kv_dtype != dtype:  # type: ignore[attr-defined]
        spec = replace(spec, kv_dtype=dtype)
    return spec.bytes_per_token  # type: ignore[attr-defined]


def _layer_list(bucket: Bucket) -> str:
    indices = [layer.index for layer in bucket.layers]
    return ", ".join(map(str, indices)) if len(indices) <= 4 else f"{indices[0]}..{indices[-1]}"


def _check_skip_layers(model: HybridModel, attn_buckets: list[Bucket], layout: str) -> None:
    """Refuse the skip-layer cases a shared pool here does not lay out as vLLM would."""
    why = {
        "sliding_window": "vLLM 0.33 fits a skipped sliding-window layer's page by its own "
        "rule (skip_page_size_padded)",
        "indexer": "vLLM 0.33's indexer caches do not read the flag, and their pages beside "
        "unified ones are not modelled",
    }
    # an MLA page unifies like a full-attention one where it divides the widest page (checked
    # once the pages are known: _check_mla_pages)
    other = sorted({b.kind for b in attn_buckets} - {"full_attention", "mla"})
    if other:
        raise ValueError(
            f"{model.name}: --kv-cache-dtype-skip-layers beside {', '.join(other)} layers is "
            f"not modelled in {layout!r}: {'; '.join(why.get(k, k) for k in other)}; plan "
            "per_group or two_level, which keep each dtype in pages of its own, or leave the "
            "flag out"
        )


def _check_mla_pages(
    model: HybridModel,
    attn_buckets: list[Bucket],
    packs_per_bucket: list[list[tuple[CacheLayer, ...]]],
    blocks: list[int],
    page: int,
    layout: str,
) -> None:
    """vLLM 0.33's ``unify_kv_cache_spec_page_size`` scales an MLA page whose size divides the
    widest page (fp8 under a skipped bf16 latent: 2x) but cannot pad one that does not; it then
    raises and falls back to another allocation, which is not modelled."""
    for bucket, packs, block in zip(attn_buckets, packs_per_bucket, blocks):
        if bucket.kind == "mla" and block * sum(_attn1(layer) for layer in packs[0]) != page:
            raise ValueError(
                f"{model.name}: --kv-cache-dtype-skip-layers leaves the {bucket.spec.kv_dtype} "
                f"MLA layers a page that does not divide the widest ({page:,} B): vLLM 0.33 "
                "cannot pad an MLA page (unify_kv_cache_spec_page_size) and falls back to an "
                f"allocation not modelled in {layout!r}; plan per_group or two_level, or leave "
                "the flag out"
            )


def _skip_layer_block(
    block: int,
    kernel_block: int,
    primary_packs: list[list[tuple[CacheLayer, ...]]],
    skipped_packs: list[list[tuple[CacheLayer, ...]]],
    primary: str,
    has_states: bool,
) -> tuple[int, str]:
    """vLLM's ``Platform._align_heterogeneous_kv_block_size``: raise the block (a multiple of
    ``max(kernel block, block)``) until the quantized primary's page covers the widest skipped
    layer's page at the smallest kernel block, and the state page padded to the primary's.

    The layers skipped keep the block, so their pages are the largest, and
    :func:`plan_shared`'s unification doubles (for fp8 under bf16) the primary's block and
    pads the state page to them."""
    primary_bpt = max(sum(_attn1(layer, primary) for layer in packs[0]) for packs in primary_packs)
    widest = max(sum(_attn1(layer) for layer in packs[0]) for packs in skipped_packs)
    if widest <= primary_bpt:
        return block, "the skipped layers' pages are no wider than the primary's"
    alignment = max(kernel_block, block)
    required = max(widest * kernel_block, block * primary_bpt if has_states else 0)
    raised = alignment * cdiv(required, alignment * primary_bpt)
    if raised > block:
        return raised, (
            f"_align_heterogeneous_kv_block_size: raised to {raised} so that the {primary} page "
            f"covers the skipped layers' {widest:,} B/token at {kernel_block} tokens"
        )
    return block, (
        f"_align_heterogeneous_kv_block_size keeps {block}: the {primary} page already covers "
        f"the skipped layers' {widest:,} B/token at {kernel_block} tokens"
    )


def _tokens_within(blocks: int, block_sizes: list[int]) -> int:
    """The most tokens every group can hold when a group of block size ``b`` needs
    ``cdiv(tokens, b)`` of ``blocks`` ids shared by all (0 without groups)."""
    if not block_sizes:
        return 0
    period = math.lcm(*block_sizes)
    per_period = sum(period // b for b in block_sizes)
    tokens = blocks // per_period * period
    left = blocks % per_period
    step = math.gcd(*block_sizes)
    extra = 0
    while extra + step < period and sum(cdiv(extra + step, b) for b in block_sizes) <= left:
        extra += step
    return tokens + extra


def _kv_placement(
    layer: CacheLayer,
    *,
    group_id: int,
    tensor: str,
    block_size: int,
    num_blocks: int,
    page_offset: int,
    block_stride: int,
    pack_index: int,
    interleave_kv: bool = False,
) -> KVPlacement:
    """Placement of one layer whose K+V region starts ``page_offset`` bytes into each page.

    Inside that region: K as ``[block_size, heads, head_dim]``, then V likewise, or, with
    ``interleave_kv`` (vLLM's cache formats: :attr:`~hybridkv.target.VllmTarget.interleaves_kv`),
    ``[block_size, heads, head_dim + head_dim_v]``, each token's and head's K then its V, as
    vLLM 0.33's attention backends keep a page; MLA: one latent.
    """
    spec = layer.spec
    ds = dtype_bytes(spec.kv_dtype)  # type: ignore[attr-defined]
    if isinstance(spec, (IndexerSpec, MLASpec)):
        # one row per token. A latent is latent_dim elements; an indexer row holds the key and
        # its side channels (elements of kv_dtype), in fp8 bytes (fp8 key, fp32 scales, bf16
        # side channels), as vLLM views its indexer cache as uint8
        if isinstance(spec, IndexerSpec):
            row, row_bytes = spec.bytes_per_token // ds, spec.bytes_per_token
        else:
            row, row_bytes = spec.latent_dim, spec.latent_dim * ds
        return KVPlacement(
            layer=layer.name,
            layer_index=layer.index,
            kind=spec.kind,
            group_id=group_id,
            tensor=tensor,
            dtype=spec.kv_dtype,
            block_size=block_size,
            num_blocks=num_blocks,
            num_kv_heads=1,
            head_dim=row,
            head_dim_v=None,
            k_offset=page_offset,
            v_offset=None,
            block_stride=block_stride,
            token_stride=row_bytes,
            head_stride=row_bytes,
            pack_index=pack_index,
        )
    assert isinstance(spec, FullAttentionSpec)
    heads, d, dv = spec.kv_heads_per_rank, spec.head_dim, spec.head_dim_v
    assert dv is not None
    if interleave_kv:
        v_offset, head_stride = page_offset + d * ds, (d + dv) * ds
    else:
        v_offset, head_stride = page_offset + block_size * heads * d * ds, d * ds
    return KVPlacement(
        layer=layer.name,
        layer_index=layer.index,
        kind=spec.kind,
        group_id=group_id,
        tensor=tensor,
        dtype=spec.kv_dtype,
        block_size=block_size,
        num_blocks=num_blocks,
        num_kv_heads=heads,
        head_dim=d,
        head_dim_v=dv,
        k_offset=page_offset,
        v_offset=v_offset,
        block_stride=block_stride,
        token_stride=heads * head_stride,
        head_stride=head_stride,
        pack_index=pack_index,
    )


def _packs(bucket: Bucket, n: int) -> list[tuple[CacheLayer, ...]]:
    layers = bucket.layers
    return [layers[i : i + n] for i in range(0, len(layers), n)]


def _host_indexers(
    attn_buckets: list[Bucket],
) -> tuple[list[Bucket], dict[str, tuple[CacheLayer, ...]]]:
    """The attention buckets without the indexer buckets whose every layer shares its decoder
    layer with an attention layer, and those indexer layers by the name of the attention layer
    whose page they ride in (an indexer with no attention beside it keeps a bucket of its own)."""
    hosts: dict[int, str] = {}
    for b in attn_buckets:
        if b.kind != "indexer":
            for layer in b.layers:
                hosts.setdefault(layer.index, layer.name)
    kept: list[Bucket] = []
    riders: dict[str, list[CacheLayer]] = {}
    for b in attn_buckets:
        if b.kind == "indexer" and all(layer.index in hosts for layer in b.layers):
            for layer in b.layers:
                riders.setdefault(hosts[layer.index], []).append(layer)
        else:
            kept.append(b)
    return kept, {name: tuple(layers) for name, layers in riders.items()}


def _is_indexer(layer: CacheLayer) -> bool:
    return isinstance(layer.spec, IndexerSpec)


def plan_shared(
    model: HybridModel, config: PlanConfig, *, layout: str, pack_size: int | None
) -> MemoryPlan:
    """Plan a shared-pool layout; ``pack_size=None`` packs every attention layer of a kind."""
    attn_buckets, state_buckets = buckets(model)
    attn_buckets, riders = _host_indexers(attn_buckets)
    rules = config.target.resolve(model)
    if config.kernel_alignment is not None:  # a backend with larger kernel blocks
        rules = replace(rules, kernel_block_size=config.kernel_alignment)
    notes: list[str] = []

    # attention layers per page, per bucket
    packs_per_bucket: list[list[tuple[CacheLayer, ...]]] = []
    if pack_size is not None and attn_buckets:
        most = max(len(b.layers) for b in attn_buckets)
        if pack_size > most:
            raise ValueError(
                f"pack_size {pack_size} is more than the {most} attention layers of a kind in "
                f"{model.name}; use at most {most} (or 'auto')"
            )
    for b in attn_buckets:
        n = len(b.layers) if pack_size is None else min(pack_size, len(b.layers))
        # each attention layer followed by the indexer keys that ride in its page
        packs_per_bucket.append(
            [
                tuple(x for layer in pack for x in (layer, *riders.get(layer.name, ())))
                for pack in _packs(b, n)
            ]
        )
        if pack_size is not None and len(b.layers) % n:
            notes.append(
                f"{len(b.layers)} {b.kind} layers do not divide into packs of {n}: the last pack "
                f"holds {len(b.layers) % n} layers and its other sub-pages are padding"
            )

    # the largest state of a single layer decides the page: vLLM sizes it as the sum of the
    # state tensors (MambaSpec.page_size_bytes); the slot lays them out back to back
    state_span = {
        layer.name: state_components(layer.spec)[1]  # type: ignore[arg-type]
        for b in state_buckets
        for layer in b.layers
    }
    max_state = max(state_span.values(), default=0)
    vllm_state = max(
        (layer.spec.state_bytes for b in state_buckets for layer in b.layers), default=0
    )  # type: ignore[attr-defined]
    # Qwen4-Exp: vLLM sizes the block by its PLE conv state too, PLE layers or none
    vllm_state = max(vllm_state, vllm_state_page_floor(model))

    # block size: vLLM's rule (hybridkv.target), with a pack's bytes per token for pack/aggregate.
    # An indexer's keys do not enter it: vLLM's _align_hybrid_block_size sizes the block by the
    # model's attention (its latent, or K and V) alone, at --kv-cache-dtype (layers that
    # --kv-cache-dtype-skip-layers keeps wider are fitted after: _skip_layer_block)
    # a bucket's layers share one spec, so one layer says whether the flag kept them wide
    wide = {layer.name for layer in model.kv_dtype_skipped_layers}
    skipped = [b for b in attn_buckets if b.layers[0].name in wide]
    if skipped:
        _check_skip_layers(model, attn_buckets, layout)
    attention = [
        (b, packs) for b, packs in zip(attn_buckets, packs_per_bucket) if b.kind != "indexer"
    ]
    # the quantized layers size the block; with every layer skipped, vLLM still sizes it by
    # --kv-cache-dtype's page
    sizing = (
        [packs for b, packs in attention if b not in skipped]
        or [packs for _, packs in attention]
        or packs_per_bucket
    )
    primary = model.kv_dtype
    choices = [
        rules.block_size(
            config.block_size,
            sum(_attn1(layer, primary) for layer in packs[0] if not _is_indexer(layer))
            or sum(_attn1(layer, primary) for layer in packs[0]),
            vllm_state,
        )
        for packs in sizing
    ] or [rules.block_size(config.block_size, 0, vllm_state)]
    chosen = max(choices, key=lambda r: r.block_size)
    block_size, align = chosen.block_size, chosen.unit
    rule_text = chosen.text
    if skipped:
        block_size, why = _skip_layer_block(
            block_size,
            rules.kernel_block_size,
            sizing,
            [packs for b, packs in attention if b in skipped],
            primary,
            bool(state_buckets),
        )
        rule_text += f"; {why}"

    def blocks_at(block: int) -> tuple[list[int], int]:
        """Each attention bucket's block and the common page (vLLM's
        unify_kv_cache_spec_page_size): a bucket whose page divides the largest one takes a
        block that many times larger; any other is padded to it."""
        pages = [block * sum(_attn1(layer) for layer in packs[0]) for packs in packs_per_bucket]
        top = max(pages, default=0)
        return [block * (top // p) if p and top % p == 0 else block for p in pages], top

    bucket_blocks, page = blocks_at(block_size)
    if skipped:
        _check_mla_pages(model, attn_buckets, packs_per_bucket, bucket_blocks, page, layout)
    if packs_per_bucket and max_state > page:
        # the slot's dtype alignment between state tensors can need a few bytes more than vLLM's
        # unpadded sum; take the next multiple of the unit and say so
        while blocks_at(block_size)[1] < max_state:
            block_size += align
        bucket_blocks, page = blocks_at(block_size)
        rule_text += (
            f"; raised to {block_size} so that the aligned state slot ({max_state} B) fits"
        )
    if len(set(bucket_blocks)) > 1:
        notes.append(
            "attention pages unified as vLLM's unify_kv_cache_spec_page_size does: "
            + ", ".join(
                f"{b.kind} {b.spec.kv_dtype} layers {_layer_list(b)} at {blk} tokens a block"
                for b, blk in zip(attn_buckets, bucket_blocks)
            )
            + f"; every page {page:,} B"
        )
    requested = config.block_size or rules.default_block_size
    if block_size != requested:
        notes.append(
            f"block size raised from {requested} to {block_size} tokens so that one page "
            f"holds the largest layer state ({vllm_state} B)"
        )
    if (
        rules.enable_prefix_caching
        and rules.max_model_len is not None
        and rules.max_model_len < block_size
    ):
        notes.append(
            f"max_model_len {rules.max_model_len} is below the {block_size}-token block: no "
            "request ever fills a block, so prefix caching can never hit (vLLM #48401)"
        )
    if max_state > page:  # only possible for a model without attention layers
        page = max_state
    indexer_rows = {_attn1(layer) for layers in riders.values() for layer in layers}
    if indexer_rows:
        notes.append(
            f"indexer keys ({', '.join(str(r) for r in sorted(indexer_rows))} B/token) ride in "
            "their attention layer's page, after its latent or K and V (one block table for "
            "both, as in vLLM); the block size follows the attention's bytes per token alone, "
            "as vLLM's rule does, and the page grows by the indexer's rows"
        )
    if any(b.kind == "indexer" for b in attn_buckets):
        notes.append(
            "indexer keys with no attention layer beside them in groups of their own, their "
            "pages padded to the page"
        )
    if max_state and page > max_state:
        notes.append(
            f"state pages padded from {max_state} B to {page} B "
            f"({100 * (page - max_state) / max_state:.2f}%)"
        )

    # grouping (vLLM's uniform-page-size rule)
    items_per_bucket: list[tuple[str, list, int]] = [
        (b.kind, packs, blk)
        for b, packs, blk in zip(attn_buckets, packs_per_bucket, bucket_blocks)
    ] + [("state", [(layer,) for layer in b.layers], block_size) for b in state_buckets]
    group_size = group_size_vllm([len(items) for _, items, _ in items_per_bucket])
    group_items: list[tuple[str, list[tuple[CacheLayer, ...]], int]] = []
    for kind, items, blk in items_per_bucket:
        for members in split_bucket(items, group_size):
            group_items.append((kind, members, blk))

    block_bytes = page * group_size
    num_blocks = config.memory_bytes // block_bytes
    tensors = tuple(TensorPlan(f"kv_cache.{i}", page * num_blocks) for i in range(group_size))

    groups: list[KVCacheGroup] = []
    kv_placements: list[KVPlacement] = []
    state_placements: list[StatePlacement] = []
    attn_padding: list[tuple[int, int]] = []  # (group block size, padding in one of its blocks)
    state_padding_per_block = 0
    for gid, (kind, members, group_block) in enumerate(group_items):
        group_padding = 0
        names: list[str] = []
        window = None
        for slot, pack in enumerate(members):
            tensor = tensors[slot].name
            if kind == "state":
                (layer,) = pack
                comps, span = state_components(layer.spec)  # type: ignore[arg-type]
                state_placements.append(
                    state_placement(layer, gid, tensor, num_blocks, 0, page, comps)
                )
                state_padding_per_block += page - span
                names.append(layer.name)
                continue
            offset = 0
            for j, layer in enumerate(pack):
                kv_placements.append(
                    _kv_placement(
                        layer,
                        group_id=gid,
                        tensor=tensor,
                        block_size=group_block,
                        num_blocks=num_blocks,
                        page_offset=offset,
                        block_stride=page,
                        pack_index=j,
                        interleave_kv=config.target.interleaves_kv,
                    )
                )
                offset += group_block * _attn1(layer)
                names.append(layer.name)
                if not _is_indexer(layer):
                    window = getattr(layer.spec, "sliding_window", None)
            group_padding += page - offset
        pad_slots = group_size - len(members)
        # under DCP an attention block's rows are one rank's share of dcp times the tokens
        dcp = 1 if kind == "state" else model.dcp_size
        if kind == "state":
            state_padding_per_block += pad_slots * page
        else:
            attn_padding.append((group_block * dcp, group_padding + pad_slots * page))
        groups.append(
            KVCacheGroup(
                group_id=gid,
                kind=kind,
                layers=tuple(names),
                pool="shared",
                block_size=group_block * dcp,
                page_bytes=page,
                padding_slots=pad_slots,
                sliding_window=window,
                dcp_size=dcp,
            )
        )
    if any(g.padding_slots for g in groups):
        pad = sum(g.padding_slots for g in groups)
        notes.append(f"{pad} padding layer slot(s) added so that every group has {group_size}")

    # capacity once max_num_seqs requests hold their states
    n_state = sum(g.is_state for g in groups)
    n_attn = len(groups) - n_state
    reserved_state_blocks = state_reservation(config) * n_state
    usable = num_blocks - 1  # block 0 is the null block
    remaining = usable - reserved_state_blocks
    if remaining < max(1, n_attn):
        need = (1 + reserved_state_blocks + max(1, n_attn)) * block_bytes
        raise too_small(model, config, need, f"layout {layout!r}")
    tokens = _tokens_within(remaining, [blk for blk, _ in attn_padding])
    group_blocks = [cdiv(tokens, blk) for blk, _ in attn_padding]
    kv_blocks = sum(group_blocks)
    padding = reserved_state_blocks // max(1, n_state) * state_padding_per_block + sum(
        n * pad for n, (_, pad) in zip(group_blocks, attn_padding)
    )
    unusable = config.memory_bytes - (reserved_state_blocks + kv_blocks) * block_bytes
    capacity = make_capacity(
        model=model,
        config=config,
        token_capacity=tokens,
        padding_bytes=padding,
        unusable_bytes=unusable,
        state_reserved_bytes=reserved_state_blocks * block_bytes,
        kv_reserved_bytes=kv_blocks * block_bytes,
    )
    pool = PoolPlan(
        name="shared",
        kind="shared",
        tensors=tuple(t.name for t in tensors),
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        groups=tuple(g.group_id for g in groups),
    )
    pack_report = max(
        (sum(not _is_indexer(layer) for layer in p[0]) for p in packs_per_bucket), default=1
    )
    return MemoryPlan(
        layout=layout,
        model_name=model.name,
        config=config,
        tp_size=model.tp_size,
        kv_dtype=model.kv_dtype,
        block_size=block_size,
        tensors=tensors,
        pools=(pool,),
        groups=tuple(groups),
        kv_placements=tuple(kv_placements),
        state_placements=tuple(state_placements),
        capacity=capacity,
        kernel_alignment=align,
        pack_size=pack_report,
        notes=tuple(notes),
        block_size_rule=rule_text,
        vllm=rules,
        extra={"page_bytes": page, "group_size": group_size, "max_state_bytes": max_state},
    )


def auto_pack_size(model: HybridModel, config: PlanConfig) -> int:
    """The pack size ``pack("auto")`` uses.

    Candidates are the divisors of the attention-layer count (so no pack is left half empty).
    Among those whose token capacity is within 2% of the best candidate's, take the one with the
    smallest block size (finer prefix caching), ties to the smaller pack.
    """
    attn_buckets, _ = _host_indexers(buckets(model)[0])
    if not attn_buckets:
        return 1
    n_min = min(len(b.layers) for b in attn_buckets)
    candidates = [
        n for n in range(1, n_min + 1) if all(len(b.layers) % n == 0 for b in attn_buckets)
    ]
    plans = []
    for n in candidates:
        try:
            plans.append((n, plan_shared(model, config, layout="pack", pack_size=n)))
        except ValueError:
            continue
    if not plans:
        return 1
    best = max(p.capacity.token_capacity for _, p in plans)
    ok = [(p.block_size, n) for n, p in plans if p.capacity.token_capacity >= 0.98 * best]
    return min(ok)[1]
