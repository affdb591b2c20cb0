"""Pieces shared by the layout strategies: buckets of layers, page contents, capacity."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..dtypes import dtype_bytes
from ..models.model import CacheLayer, HybridModel
from ..plan import Capacity, PlanConfig, StateComponent, StatePlacement
from ..specs import AttentionSpec, IndexerSpec, MLASpec, SlidingWindowSpec, StateSpec
from ..units import format_bytes

DEFAULT_BLOCK_SIZE = 16
#: byte alignment of a state component or a state slot inside a dedicated state pool
STATE_ALIGN = 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def attention_kind(spec: AttentionSpec) -> str:
    """The group kind of an attention spec. A sparse-attention indexer's keys are a per-token
    kind of their own (``indexer``), a bucket of their own: ``per_group`` and ``two_level`` give
    them groups of their own at their natural page size; the shared-pool layouts put them in
    their attention layer's page instead (:mod:`.shared`)."""
    if isinstance(spec, IndexerSpec):
        return "indexer"
    if isinstance(spec, MLASpec):
        return "mla"
    if isinstance(spec, SlidingWindowSpec):
        return "sliding_window"
    return "full_attention"


@dataclass(frozen=True)
class Bucket:
    """Layers with identical specs; they can share a group."""

    kind: str  # attention kind or "state"
    layers: tuple[CacheLayer, ...]

    @property
    def spec(self):
        return self.layers[0].spec


def buckets(model: HybridModel) -> tuple[list[Bucket], list[Bucket]]:
    """(attention buckets, state buckets), each a list of layers with one spec, in layer order."""
    attn: dict[object, list[CacheLayer]] = {}
    state: dict[object, list[CacheLayer]] = {}
    for layer in model.layers:
        target = attn if isinstance(layer.spec, AttentionSpec) else state
        target.setdefault(layer.spec, []).append(layer)
    return (
        [Bucket(attention_kind(ls[0].spec), tuple(ls)) for ls in attn.values()],
        [Bucket("state", tuple(ls)) for ls in state.values()],
    )


def kernel_alignment(model: HybridModel, config: PlanConfig) -> int:
    """The config's override, else the model's (from its attention specs)."""
    if config.kernel_alignment is not None:
        return config.kernel_alignment
    return model.kernel_alignment


def own_pool_block_rule(model: HybridModel, config: PlanConfig, layout: str) -> str:
    """Why a layout that keeps states in their own pool has the block it has."""
    block = requested_block_size(model, config)
    src = "--block-size" if config.block_size is not None else "the default block"
    return (
        f"{block} tokens: {src}, a multiple of the attention kernel block "
        f"({kernel_alignment(model, config)}); {layout} keeps states out of attention pages, so "
        "no state inflates it"
    )


def requested_block_size(model: HybridModel, config: PlanConfig) -> int:
    """The user's block size (default 16), checked against the kernel alignment."""
    align = kernel_alignment(model, config)
    if config.block_size is None:
        return round_up(DEFAULT_BLOCK_SIZE, align)
    if config.block_size % align:
        lower = max(align, config.block_size // align * align)
        raise ValueError(
            f"block size {config.block_size} is not a multiple of the kernel alignment "
            f"({align} tokens for {model.name}); use {lower} or {lower + align}"
        )
    return config.block_size


def group_size_vllm(counts: list[int]) -> int:
    """vLLM's group size for buckets of ``counts`` layers: the smallest bucket, unless the
    largest is under 1.5x the smallest, in which case the largest (fewer padding layers)."""
    lo, hi = min(counts), max(counts)
    return hi if hi < 1.5 * lo else lo


def split_bucket(items: list, group_size: int) -> list[list]:
    """vLLM's split of a bucket into ``cdiv(len, group_size)`` groups, assigned with stride so
    that pipeline stages stay balanced: group ``i`` gets ``items[i::num_groups]``."""
    num_groups = cdiv(len(items), group_size)
    return [items[i::num_groups] for i in range(num_groups)]


def state_components(spec: StateSpec, *, align: int = 1) -> tuple[tuple[StateComponent, ...], int]:
    """The state tensors of one layer laid out back to back in a slot (conv first, as vLLM).

    Each component starts at a multiple of ``max(align, its dtype size)``; returns the
    components and the bytes they span.
    """
    comps = []
    offset = 0
    for t in spec.state_tensors():
        offset = round_up(offset, max(align, dtype_bytes(t.dtype)))
        comps.append(StateComponent(t.name, offset, t.shape, t.dtype))
        offset += t.nbytes
    return tuple(comps), offset


def state_placement(
    layer: CacheLayer,
    group_id: int,
    tensor: str,
    num_slots: int,
    offset: int,
    slot_stride: int,
    components: tuple[StateComponent, ...],
) -> StatePlacement:
    """Placement of state layer ``layer``: slot ``s`` at ``offset + s * slot_stride``."""
    return StatePlacement(
        layer=layer.name,
        layer_index=layer.index,
        kind=layer.spec.kind,
        group_id=group_id,
        tensor=tensor,
        num_slots=num_slots,
        offset=offset,
        slot_stride=slot_stride,
        components=components,
    )


def state_reservation(config: PlanConfig) -> int:
    """Requests' state slots to reserve: ``max_num_seqs * state_slots_per_seq``."""
    return config.max_num_seqs * config.state_slots_per_seq


def ideal_capacity(model: HybridModel, config: PlanConfig) -> tuple[int, int]:
    """(ideal token capacity, bytes of real state for the reserved slots)."""
    state = state_reservation(config) * model.state_bytes_per_seq
    kv = model.kv_bytes_per_token
    if kv == 0:
        return 0, state
    # under DCP a rank keeps one token in dcp_size (kv is per token a rank keeps)
    return max(0, (config.memory_bytes - state) * model.dcp_size // kv), state


class PlanTooSmall(ValueError):
    """The memory cannot hold ``max_num_seqs`` requests' state slots (and any cached-state
    slots) plus one KV block: ``needed_bytes`` would. A ``ValueError``, so callers that only
    report it need not know the class; the doctor catches it to plan the requests that fit."""

    def __init__(self, message: str, *, needed_bytes: int, memory_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.memory_bytes = memory_bytes


def too_small(model: HybridModel, config: PlanConfig, need: int, what: str) -> PlanTooSmall:
    cached = config.cache_state_slots
    extra = f" plus {cached} slots for cached states" if cached else ""
    fix = " or --cache-state-slots" if cached else ""
    return PlanTooSmall(
        f"{format_bytes(config.memory_bytes)} is too small for {model.name}: {what} needs "
        f"{format_bytes(need)} for max_num_seqs={config.max_num_seqs} "
        f"(x{config.state_slots_per_seq} state slots each){extra} plus one KV block; give the "
        f"cache more memory (--gpu-memory) or lower --max-num-seqs{fix}",
        needed_bytes=int(need),
        memory_bytes=int(config.memory_bytes),
    )


def make_capacity(
    *,
    model: HybridModel,
    config: PlanConfig,
    token_capacity: int,
    padding_bytes: int,
    unusable_bytes: int,
    state_reserved_bytes: int,
    kv_reserved_bytes: int,
) -> Capacity:
    ideal, state = ideal_capacity(model, config)
    return Capacity(
        token_capacity=int(token_capacity),
        ideal_token_capacity=int(ideal),
        padding_bytes=int(padding_bytes),
        unusable_bytes=int(unusable_bytes),
        state_bytes=int(state),
        state_reserved_bytes=int(state_reserved_bytes),
        kv_reserved_bytes=int(kv_reserved_bytes),
    )


def lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)
