"""``per_group``: a pool per group at its natural page size (vLLM PR #39031, SGLang's split).

- State layers of one kind form a group whose pool has a fixed number of slots:
  ``max_num_seqs * state_slots_per_seq + cache_state_slots`` plus the null slot. A slot is one
  request's state of one layer, padded only to 16 bytes.
- Attention layers of one kind form a group whose pool gets the rest of the memory, with blocks
  of the requested size (16 by default): no inflation, no state padding, and page sizes that
  need not divide each other.

Each pool is one tensor laid out layer-outer, ``[layers, blocks, page]``, so a layer's pages are
contiguous and a block id addresses the same block in every layer of the group. The price is a
static split: memory given to states cannot hold KV even when fewer requests run.
"""

from __future__ import annotations

from ..models.model import HybridModel
from ..plan import KVCacheGroup, MemoryPlan, PlanConfig, PoolPlan, StatePlacement, TensorPlan
from ._common import (
    STATE_ALIGN,
    buckets,
    kernel_alignment,
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


def plan_per_group(model: HybridModel, config: PlanConfig) -> MemoryPlan:
    attn_buckets, state_buckets = buckets(model)
    block_size = requested_block_size(model, config)
    align = kernel_alignment(model, config)
    reserved_slots = state_reservation(config)
    num_slots = reserved_slots + config.cache_state_slots + 1  # + null slot 0

    tensors: list[TensorPlan] = []
    pools: list[PoolPlan] = []
    groups: list[KVCacheGroup] = []
    state_placements: list[StatePlacement] = []
    kv_placements = []
    state_bytes_total = 0
    padding = 0

    for b in state_buckets:
        gid = len(groups)
        comps, span = state_components(b.spec, align=STATE_ALIGN)  # type: ignore[arg-type]
        slot = round_up(span, STATE_ALIGN)
        name = f"state.{gid}"
        nbytes = len(b.layers) * num_slots * slot
        tensors.append(TensorPlan(name, nbytes))
        for i, layer in enumerate(b.layers):
            state_placements.append(
                state_placement(layer, gid, name, num_slots, i * num_slots * slot, slot, comps)
            )
        real = b.spec.state_bytes  # type: ignore[attr-defined]
        padding += (slot - real) * len(b.layers) * reserved_slots
        state_bytes_total += nbytes
        pools.append(PoolPlan(name, "per_group", (name,), num_slots, slot * len(b.layers), (gid,)))
        groups.append(
            KVCacheGroup(
                group_id=gid,
                kind="state",
                layers=tuple(layer.name for layer in b.layers),
                pool=name,
                block_size=block_size,
                page_bytes=slot,
            )
        )

    remaining = config.memory_bytes - state_bytes_total
    # attention pools split the rest so that each holds the same number of tokens
    per_token = [sum(_attn1(layer) for layer in b.layers) for b in attn_buckets]
    total_per_token = sum(per_token)
    if attn_buckets and remaining < 2 * block_size * total_per_token:
        raise too_small(
            model, config, state_bytes_total + 2 * block_size * total_per_token, "the state pool"
        )
    token_capacity = None
    kv_bytes = 0
    for b, ptok in zip(attn_buckets, per_token):
        gid = len(groups)
        page = block_size * _attn1(b.layers[0])
        block_bytes = block_size * ptok
        num_blocks = remaining * ptok // total_per_token // block_bytes
        name = f"kv.{gid}"
        tensors.append(TensorPlan(name, num_blocks * block_bytes))
        for i, layer in enumerate(b.layers):
            kv_placements.append(
                _kv_placement(
                    layer,
                    group_id=gid,
                    tensor=name,
                    block_size=block_size,
                    num_blocks=num_blocks,
                    page_offset=i * num_blocks * page,
                    block_stride=page,
                    pack_index=0,
                    interleave_kv=config.target.interleaves_kv,
                )
            )
        pools.append(PoolPlan(name, "per_group", (name,), num_blocks, block_bytes, (gid,)))
        span = block_size * model.dcp_size  # under DCP one rank's page holds 1/dcp of it
        tokens = (num_blocks - 1) * span
        token_capacity = tokens if token_capacity is None else min(token_capacity, tokens)
        kv_bytes += (num_blocks - 1) * block_bytes
        groups.append(
            KVCacheGroup(
                group_id=gid,
                kind=b.kind,
                layers=tuple(layer.name for layer in b.layers),
                pool=name,
                block_size=span,
                page_bytes=page,
                sliding_window=getattr(b.spec, "sliding_window", None),
                dcp_size=model.dcp_size,
            )
        )

    state_reserved = sum(
        (p.num_blocks - 1 - config.cache_state_slots) * p.block_bytes
        for p in pools
        if p.name.startswith("state.")
    )
    capacity = make_capacity(
        model=model,
        config=config,
        token_capacity=token_capacity or 0,
        padding_bytes=padding,
        unusable_bytes=config.memory_bytes - state_reserved - kv_bytes,
        state_reserved_bytes=state_reserved,
        kv_reserved_bytes=kv_bytes,
    )
    notes = [
        f"state pools hold {num_slots - 1} slots per layer ({reserved_slots} for running "
        f"requests, {config.cache_state_slots} for cached checkpoints) and cannot lend memory "
        f"to KV"
    ]
    if config.cache_state_slots:
        notes.append(
            f"{config.cache_state_slots} checkpoint slots per layer count as unusable for "
            f"running requests in the capacity figures"
        )
    return MemoryPlan(
        layout="per_group",
        model_name=model.name,
        config=config,
        tp_size=model.tp_size,
        kv_dtype=model.kv_dtype,
        block_size=block_size,
        tensors=tuple(tensors),
        pools=tuple(pools),
        groups=tuple(groups),
        kv_placements=tuple(kv_placements),
        state_placements=tuple(state_placements),
        capacity=capacity,
        kernel_alignment=align,
        notes=tuple(notes),
        block_size_rule=own_pool_block_rule(model, config, "per_group"),
        vllm=config.target.resolve(model),
    )
