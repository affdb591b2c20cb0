"""``two_level``: Jenga-style large pages carved into per-type small pages.

Memory is one tensor of equal **large pages**. At run time a large page is given to one page
type and carved into that type's **small pages**:

- an attention small page holds ``block_size`` tokens of *every* attention layer of one kind
  (layer ``i``'s K at ``i * block_size * bytes_per_token``, then its V): a block id is then one
  small page, whatever the number of layers;
- a state small page holds one request's state for *every* state layer of one kind.

The large page is the least common multiple of the two small pages when that is small enough
(no padding at all), otherwise the smallest size ``L`` with ``L = n_s * S' = n_a * A'`` for small
pages padded to ``S' >= S`` and ``A' >= A`` that keeps padding lowest. Small-page ids stay affine
(id ``p`` of a type starts at byte ``p * small_page``), so kernels address pages exactly as in the
other layouts while memory moves between KV and states a large page at a time.
"""

from __future__ import annotations

import math

from ..models.model import HybridModel
from ..plan import KVCacheGroup, MemoryPlan, PlanConfig, PoolPlan, StatePlacement, TensorPlan
from ._common import (
    STATE_ALIGN,
    buckets,
    cdiv,
    kernel_alignment,
    lcm,
    make_capacity,
    own_pool_block_rule,
    requested_block_size,
    round_up,
    state_components,
    state_placement,
    state_reservation,
    too_small,
)
from .shared import _attn1, _kv_placement

#: the exact LCM is used while it is at most this many times the larger small page
MAX_LCM_RATIO = 16
#: small pages per large page tried when the LCM is too large
MAX_STATE_PAGES_PER_LARGE = 16
#: byte alignment of small pages (keeps every view aligned for vector loads)
PAGE_ALIGN = 256


def choose_large_page(small: list[int], memory_bytes: int) -> tuple[int, list[int]]:
    """Large-page bytes and, per small-page type, how many (padded) small pages it holds.

    Candidates: the exact LCM (aligned to :data:`PAGE_ALIGN`, no padding) while it is at most
    :data:`MAX_LCM_RATIO` times the largest small page; and, for ``n`` largest pages per large
    page (``n`` up to :data:`MAX_STATE_PAGES_PER_LARGE`), ``c_i = floor(n * max(small) /
    small_i)`` pages of each type in the smallest multiple of ``lcm(c_i) * PAGE_ALIGN`` not below
    ``n * max(small)``. The winner minimises the worst type's padding fraction plus the expected
    loss at the tail of the budget (half a large page), so huge exact LCMs lose to slightly padded
    pages that tile the budget better.
    """
    ref = max(small)
    candidates: list[tuple[int, list[int]]] = []
    exact = lcm(math.lcm(*small), PAGE_ALIGN)
    if exact <= MAX_LCM_RATIO * ref:
        candidates.append((exact, [exact // s for s in small]))
    for n in range(1, MAX_STATE_PAGES_PER_LARGE + 1):
        base = n * ref
        counts = [base // s for s in small]
        unit = math.lcm(*counts) * PAGE_ALIGN
        candidates.append((cdiv(base, unit) * unit, counts))

    def cost(candidate: tuple[int, list[int]]) -> tuple[float, int]:
        large, counts = candidate
        worst = max((large - c * s) / large for c, s in zip(counts, small))
        return worst + 0.5 * large / memory_bytes, large

    return min(candidates, key=cost)


def plan_two_level(model: HybridModel, config: PlanConfig) -> MemoryPlan:
    attn_buckets, state_buckets = buckets(model)
    block_size = requested_block_size(model, config)
    align = kernel_alignment(model, config)

    # small pages: one per attention kind and one per state kind
    kinds: list[tuple[str, object, int]] = []  # (kind, bucket, unpadded small-page bytes)
    for b in attn_buckets:
        kinds.append((b.kind, b, block_size * sum(_attn1(layer) for layer in b.layers)))
    layer_spans = []
    for b in state_buckets:
        comps, span = state_components(b.spec, align=STATE_ALIGN)  # type: ignore[arg-type]
        slot = round_up(span, STATE_ALIGN)
        layer_spans.append((comps, slot))
        kinds.append(("state", b, slot * len(b.layers)))
    small = [k[2] for k in kinds]
    order = sorted(range(len(small)), key=lambda i: -small[i])
    large, counts_sorted = choose_large_page([small[i] for i in order], config.memory_bytes)
    counts = [0] * len(small)
    for pos, i in enumerate(order):
        counts[i] = counts_sorted[pos]
    padded = [large // c for c in counts]

    num_large = config.memory_bytes // large
    tensor = TensorPlan("pages", num_large * large)
    groups: list[KVCacheGroup] = []
    kv_placements = []
    state_placements: list[StatePlacement] = []
    state_idx = 0
    for (kind, b, _), count, page in zip(kinds, counts, padded):
        gid = len(groups)
        n_ids = num_large * count
        if kind == "state":
            comps, slot = layer_spans[state_idx]
            state_idx += 1
            for i, layer in enumerate(b.layers):  # type: ignore[attr-defined]
                state_placements.append(
                    state_placement(layer, gid, tensor.name, n_ids, i * slot, page, comps)
                )
        else:
            offset = 0
            for j, layer in enumerate(b.layers):  # type: ignore[attr-defined]
                kv_placements.append(
                    _kv_placement(
                        layer,
                        group_id=gid,
                        tensor=tensor.name,
                        block_size=block_size,
                        num_blocks=n_ids,
                        page_offset=offset,
                        block_stride=page,
                        pack_index=j,
                        interleave_kv=config.target.interleaves_kv,
                    )
                )
                offset += block_size * _attn1(layer)
        dcp = 1 if kind == "state" else model.dcp_size  # a small page: one rank's share
        groups.append(
            KVCacheGroup(
                group_id=gid,
                kind=kind,
                layers=tuple(layer.name for layer in b.layers),  # type: ignore[attr-defined]
                pool="pages",
                block_size=block_size * dcp,
                page_bytes=page,
                sliding_window=getattr(b.spec, "sliding_window", None),  # type: ignore[attr-defined]
                dcp_size=dcp,
            )
        )

    # capacity. Id 0 of every type is its null id; all of them fall in large page 0, which
    # starts out owned by the first attention type (its other ids are usable) and whose state
    # null ids are never read or written.
    state_groups = [g for g in groups if g.is_state]
    attn_groups = [g for g in groups if not g.is_state]
    reserved = state_reservation(config)
    state_pages = sum(cdiv(reserved, counts[g.group_id]) for g in state_groups)
    free_pages = num_large - state_pages
    if free_pages < max(1, len(attn_groups)) or (
        attn_groups and free_pages * counts[attn_groups[0].group_id] < 2
    ):
        need = (state_pages + max(1, len(attn_groups))) * large
        raise too_small(model, config, need, "layout 'two_level'")

    # attention kinds share the free large pages so that each holds the same number of tokens
    # (a kind with more bytes a token takes more pages; the first kind's id 0 is the null id)
    def pages_for(blocks: int) -> list[int]:
        return [cdiv(blocks + (i == 0), counts[g.group_id]) for i, g in enumerate(attn_groups)]

    if attn_groups:
        lo, hi = 0, free_pages * max(counts[g.group_id] for g in attn_groups)
        while lo < hi:  # the most blocks of every kind that fit the free pages
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if sum(pages_for(mid)) <= free_pages else (lo, mid - 1)
        kind_pages = pages_for(lo)
        kv_pages = sum(kind_pages)
        token_capacity = lo * block_size * model.dcp_size
    else:
        kind_pages, kv_pages, token_capacity = [], 0, 0
    padding = 0
    for g in state_groups:
        real = sum(
            layer.spec.state_bytes  # type: ignore[attr-defined]
            for layer in model.state_layers
            if layer.name in g.layers
        )
        padding += cdiv(reserved, counts[g.group_id]) * large - reserved * real
    for g, n in zip(attn_groups, kind_pages):
        per_page_real = counts[g.group_id] * small[g.group_id]
        padding += n * (large - per_page_real)
    notes = [
        f"large page {large} B holds "
        + ", ".join(f"{c} {g.kind} page(s) of {p} B" for g, c, p in zip(groups, counts, padded))
    ]
    capacity = make_capacity(
        model=model,
        config=config,
        token_capacity=token_capacity,
        padding_bytes=padding,
        unusable_bytes=config.memory_bytes - (state_pages + kv_pages) * large,
        state_reserved_bytes=state_pages * large,
        kv_reserved_bytes=kv_pages * large,
    )
    pool = PoolPlan(
        name="pages",
        kind="two_level",
        tensors=(tensor.name,),
        num_blocks=num_large,
        block_bytes=large,
        groups=tuple(g.group_id for g in groups),
        large_page_bytes=large,
        ids_per_large_page=tuple((g.group_id, counts[g.group_id]) for g in groups),
    )
    return MemoryPlan(
        layout="two_level",
        model_name=model.name,
        config=config,
        tp_size=model.tp_size,
        kv_dtype=model.kv_dtype,
        block_size=block_size,
        tensors=(tensor,),
        pools=(pool,),
        groups=tuple(groups),
        kv_placements=tuple(kv_placements),
        state_placements=tuple(state_placements),
        capacity=capacity,
        kernel_alignment=align,
        notes=tuple(notes),
        block_size_rule=own_pool_block_rule(model, config, "two_level"),
        vllm=config.target.resolve(model),
        extra={"large_page_bytes": large, "small_page_bytes": tuple(padded)},
    )
