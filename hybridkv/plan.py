"""Memory plans: where every byte of a hybrid model's cache lives.

A :class:`MemoryPlan` is what a layout strategy (:mod:`hybridkv.layouts`) produces for a model,
a memory budget and a scheduler limit. It names

- the backing **tensors** (raw byte buffers),
- the **pools** that hand out block ids (one shared pool, one per group, or two levels),
- the **KV cache groups** (layers that share block tables, as in vLLM),
- for every attention layer a :class:`KVPlacement` and for every state layer a
  :class:`StatePlacement`: byte offsets and strides from which the kernels address
  ``(layer, block id, token, head)`` as ``tensor + offset + block_id * block_stride + ...``,
- capacity figures: tokens of KV that fit once ``max_num_seqs`` states are reserved, the bytes
  lost to padding, and the ideal capacity of a layout with no padding at all,
- the answers to what depends on the layout, so that callers do not work them out: each
  placement's decoder ``layer_index`` and spec ``kind``, the bytes one id of a group takes
  (:meth:`MemoryPlan.id_bytes`), the token multiple of state checkpoints
  (:attr:`MemoryPlan.checkpoint_granularity`), how a pool hands out ids
  (:attr:`PoolPlan.shares_ids`, :attr:`PoolPlan.is_two_level`) and the rows of an allocation
  unit (:meth:`MemoryPlan.unit_rows`).

All sizes are bytes on one tensor-parallel rank.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .dtypes import dtype_bytes, torch_dtype
from .models.model import MTP_PREFIX
from .target import VllmRules, VllmTarget

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "Capacity",
    "KVCacheGroup",
    "KVPlacement",
    "MemoryPlan",
    "PlanConfig",
    "PoolPlan",
    "Region",
    "StateComponent",
    "StatePlacement",
    "TensorPlan",
    "UnitRow",
]


@dataclass(frozen=True)
class PlanConfig:
    """What a layout is asked to plan for (one TP rank).

    - ``memory_bytes``: bytes given to the cache on each rank (after weights and activations).
    - ``max_num_seqs``: requests that may run at once; each needs its recurrent states.
    - ``block_size``: requested tokens per attention block (``None``: 16, vLLM's default). Layouts
      that must raise it to fit a state page (``inflate``, ``pack``, ``aggregate``) do so and say
      so in :attr:`MemoryPlan.notes`; it must be a multiple of the kernel alignment.
    - ``state_slots_per_seq``: state pages one running request holds (1 without prefix caching;
      vLLM's ``align`` mode holds 2, the running and the previous step's).
    - ``cache_state_slots``: extra state slots kept for prefix-cache checkpoints in the layouts
      with a dedicated state pool (``per_group``, ``two_level`` reserves them too).
    - ``kernel_alignment``: smallest kernel block of the attention backend (``None``: the
      model's, from its attention specs: 64 for MLA, FlashMLA's block, else 16).
    - ``pack_size``: attention layers per page for ``pack`` (an int or ``"auto"``).
    - ``target``: the vLLM whose rules the shared-pool layouts follow (version, prefix caching,
      Mamba cache mode, GPU family; :class:`~hybridkv.target.VllmTarget`, default vLLM 0.33's
      defaults on Hopper).
    """

    memory_bytes: int
    max_num_seqs: int = 256
    block_size: int | None = None
    state_slots_per_seq: int = 1
    cache_state_slots: int = 0
    kernel_alignment: int | None = None
    pack_size: int | str = "auto"
    target: VllmTarget = field(default_factory=VllmTarget)

    def __post_init__(self) -> None:
        if not isinstance(self.target, VllmTarget):
            raise ValueError(
                f"target must be a hybridkv.target.VllmTarget, got {type(self.target).__name__}"
            )
        if not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be a positive integer, got {self.memory_bytes!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}")
        if self.block_size is not None and (
            not isinstance(self.block_size, int) or self.block_size < 1
        ):
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.state_slots_per_seq < 1:
            raise ValueError("state_slots_per_seq must be >= 1 (a running request needs a state)")
        if self.cache_state_slots < 0:
            raise ValueError("cache_state_slots must be >= 0")
        if self.kernel_alignment is not None and self.kernel_alignment < 1:
            raise ValueError("kernel_alignment must be a positive number of tokens")


@dataclass(frozen=True)
class TensorPlan:
    """One backing allocation: ``nbytes`` raw bytes."""

    name: str
    nbytes: int


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table per request (vLLM's ``KVCacheGroupSpec``).

    ``kind`` is ``full_attention``, ``sliding_window``, ``mla``, ``indexer``, ``state`` or
    ``indexer_ring`` (a vLLM-format plan's GLM-5-Next tail rings or Qwen4-Exp QSA rings of raw
    keys: one block per request, like a state, of ``block_size`` ring slots). ``layers`` lists
    the cache-layer names (a ring's is its indexer layer's name with ``.ring``);
    ``padding_slots`` counts slots of the group that hold no layer (vLLM's "padding layers").
    For a state group ``block_size`` is the token granularity a state checkpoint corresponds to
    (the attention block size in the shared layouts).
    ``page_bytes`` is one layer's page; in a plan whose groups mix pages of different sizes
    (vLLM's block-outermost packing, :attr:`MemoryPlan.kv_cache_layout`), the group's largest.
    ``dcp_size``: the ranks an attention group's tokens are sharded over under decode context
    parallelism (:attr:`~hybridkv.models.HybridModel.dcp_size`; 1 otherwise, and for states):
    a block then spans ``block_size`` tokens of which one rank's page holds
    :attr:`rows_per_block` (vLLM's ``resolve_dcp_kv_block_size``: the manager's block is the
    spec's times the DCP size).
    """

    group_id: int
    kind: str
    layers: tuple[str, ...]
    pool: str
    block_size: int
    page_bytes: int
    padding_slots: int = 0
    sliding_window: int | None = None
    dcp_size: int = 1

    def __post_init__(self) -> None:
        if self.dcp_size < 1 or self.block_size % self.dcp_size:
            raise ValueError(
                f"group {self.group_id}: a block of {self.block_size} tokens cannot be sharded "
                f"over {self.dcp_size} decode-context-parallel ranks"
            )

    @property
    def is_state(self) -> bool:
        return self.kind == "state"

    @property
    def is_per_request(self) -> bool:
        """One block per running request, whatever its length: a state, or an indexer's ring of
        the open pool's keys (``indexer_ring``); the other groups grow with the tokens."""
        return self.kind in ("state", "indexer_ring")

    @property
    def holds_drafter(self) -> bool:
        """The group holds layers of an MTP drafter (``mtp.layers.*``, beside the target's):
        vLLM's ``is_eagle_group``, the group whose hits lose a block under EAGLE's block drop."""
        return any(name.startswith(MTP_PREFIX) for name in self.layers)

    @property
    def rows_per_block(self) -> int:
        """Tokens one rank's page of this group holds (``block_size`` without DCP)."""
        return self.block_size // self.dcp_size


@dataclass(frozen=True)
class PoolPlan:
    """A source of block ids.

    In a ``shared`` pool every group draws ids from ``1..num_blocks-1`` (0 is the null block) and
    one id covers ``block_bytes`` spread over the pool's tensors. A ``two_level`` pool has
    ``num_blocks`` large pages of ``large_page_bytes``; large page ``g`` holds ids
    ``g*k .. g*k+k-1`` of a group, ``k = ids_per_large_page[group]``, and is owned by one group
    kind at a time (large page 0 is reserved for the null ids).
    """

    name: str
    kind: str  # "shared" | "per_group" | "two_level"
    tensors: tuple[str, ...]
    num_blocks: int
    block_bytes: int
    groups: tuple[int, ...]
    large_page_bytes: int | None = None
    ids_per_large_page: tuple[tuple[int, int], ...] = ()

    @property
    def shares_ids(self) -> bool:
        """Whether all the pool's groups draw from one id space (a ``shared`` pool: an id one
        group frees can go to any other). A ``per_group`` pool gives each group its own ids; a
        ``two_level`` pool gives each group its own ids inside large pages they share."""
        return self.kind == "shared"

    @property
    def is_two_level(self) -> bool:
        """Whether ids come in large pages (:attr:`large_page_bytes`) that hold
        :meth:`ids_per_page` ids of the group owning the page."""
        return self.kind == "two_level"

    def ids_per_page(self, group_id: int) -> int:
        """Ids of ``group_id`` in one allocation unit (1 except in a two-level pool)."""
        for gid, k in self.ids_per_large_page:
            if gid == group_id:
                return k
        return 1

    def num_ids(self, group_id: int) -> int:
        """Number of valid block ids (null id included) of ``group_id`` in this pool."""
        return self.num_blocks * self.ids_per_page(group_id)


@dataclass(frozen=True)
class Region:
    """Bytes ``[start, end)`` of ``tensor``."""

    tensor: str
    start: int
    end: int


@dataclass(frozen=True)
class UnitRow:
    """One row of an allocation unit (:meth:`MemoryPlan.unit_rows`): bytes ``[start, end)`` of
    ``tensor``, holding block id ``block_id`` of ``layers`` (and padding around them)."""

    label: str
    tensor: str
    start: int
    end: int
    block_id: int
    layers: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class KVPlacement:
    """Where one attention layer's K and V live.

    For block id ``b`` the K page starts at byte ``k_offset + b * block_stride`` of ``tensor``
    and element ``[t, h, d]`` of it at ``+ t * token_stride + h * head_stride + d * dsize``; the
    same for V with ``v_offset``. MLA layers have one latent (``v_offset`` is None).
    ``layer_index`` is the model's decoder layer (the ``i`` of ``layers.{i}.attn``) and ``kind``
    the layer spec's kind (``full_attention``, ``sliding_window``, ``mla``, ``indexer``), or
    ``indexer_ring`` for a GLM-5-Next tail ring or a Qwen4-Exp QSA ring in a vLLM-format plan.

    ``tokens_per_state``: tokens one row stands for (vLLM's ``AttentionSpec.tokens_per_state``):
    1, or GLM-5-Next's ``index_kpool`` for its k-pooled indexer entries (Qwen4-Exp's
    ``indexer_compress_ratio`` for its compressed QSA keys) in a vLLM-format plan, so
    a block holds ``block_size // tokens_per_state`` rows (:attr:`rows_per_block`) and ``t``
    above counts rows.
    """

    layer: str
    layer_index: int
    kind: str
    group_id: int
    tensor: str
    dtype: str
    block_size: int
    num_blocks: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int | None
    k_offset: int
    v_offset: int | None
    block_stride: int
    token_stride: int
    head_stride: int
    pack_index: int = 0
    tokens_per_state: int = 1

    @property
    def rows_per_block(self) -> int:
        """Rows of one block: a row per token, or per ``tokens_per_state`` tokens."""
        return self.block_size // self.tokens_per_state

    @property
    def k_bytes_per_block(self) -> int:
        return self.rows_per_block * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype)

    @property
    def v_bytes_per_block(self) -> int:
        if self.v_offset is None:
            return 0
        assert self.head_dim_v is not None
        return self.rows_per_block * self.num_kv_heads * self.head_dim_v * dtype_bytes(self.dtype)

    @property
    def id_stride(self) -> int:
        """Bytes from one block id's page to the next (same name on :class:`StatePlacement`)."""
        return self.block_stride

    def byte_offset(self, block_id: int) -> int:
        """First byte of this layer's data for ``block_id`` (its K page)."""
        return self.k_byte_offset(block_id)

    def k_byte_offset(self, block_id: int) -> int:
        return self.k_offset + block_id * self.block_stride

    def v_byte_offset(self, block_id: int) -> int:
        if self.v_offset is None:
            raise ValueError(f"layer {self.layer} has a single latent cache and no V")
        return self.v_offset + block_id * self.block_stride

    @property
    def interleaves_kv(self) -> bool:
        """K and V share each token's and head's row (``[tokens, heads, K | V]``, vLLM's page:
        :attr:`~hybridkv.target.VllmTarget.interleaves_kv`): V starts inside K's span."""
        return self.v_offset is not None and 0 < self.v_offset - self.k_offset < self.token_stride

    def regions(self, block_id: int) -> list[Region]:
        """The byte ranges block ``block_id`` of this layer occupies (K, then V; one range of
        both where they interleave)."""
        k0 = self.k_byte_offset(block_id)
        if self.interleaves_kv:
            return [Region(self.tensor, k0, k0 + self.k_bytes_per_block + self.v_bytes_per_block)]
        out = [Region(self.tensor, k0, k0 + self.k_bytes_per_block)]
        if self.v_offset is not None:
            v0 = self.v_byte_offset(block_id)
            out.append(Region(self.tensor, v0, v0 + self.v_bytes_per_block))
        return out

    def parts(self, block_id: int) -> list[tuple[str, Region]]:
        """:meth:`regions` named: ``K`` and ``V`` (``K|V`` where they interleave), ``latent``
        for MLA, ``indexer`` for a sparse-attention indexer's keys (one row per token, like a
        latent, or per k-pool), ``ring`` for a GLM-5-Next tail ring or a Qwen4-Exp QSA ring."""
        if self.interleaves_kv:
            names: tuple[str, ...] = ("K|V",)
        elif self.v_offset is not None:
            names = ("K", "V")
        else:
            part = {"indexer": "indexer", "indexer_ring": "ring"}.get(self.kind, "latent")
            names = (part,)
        return list(zip(names, self.regions(block_id)))

    def element_strides(self) -> tuple[int, int, int, int]:
        """(block, token, head, dim) strides in elements of :attr:`dtype`."""
        ds = dtype_bytes(self.dtype)
        return (self.block_stride // ds, self.token_stride // ds, self.head_stride // ds, 1)


@dataclass(frozen=True)
class StateComponent:
    """One tensor of a layer's state inside a slot: ``offset`` bytes from the slot start."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class StatePlacement:
    """Where one state layer's per-request state lives: slot ``s`` starts at byte
    ``offset + s * slot_stride`` of ``tensor``; components follow at their own offsets.
    ``layer_index`` is the model's decoder layer and ``kind`` the layer spec's kind
    (``mamba2``, ``gated_deltanet``, ...)."""

    layer: str
    layer_index: int
    kind: str
    group_id: int
    tensor: str
    num_slots: int
    offset: int
    slot_stride: int
    components: tuple[StateComponent, ...]

    @property
    def id_stride(self) -> int:
        """Bytes from one slot to the next (same name on :class:`KVPlacement`)."""
        return self.slot_stride

    def byte_offset(self, slot: int) -> int:
        """First byte of ``slot`` (same name on :class:`KVPlacement`)."""
        return self.slot_byte_offset(slot)

    def slot_byte_offset(self, slot: int) -> int:
        return self.offset + slot * self.slot_stride

    def parts(self, slot: int) -> list[tuple[str, Region]]:
        """:meth:`regions` named by their components (``conv``, ``ssm``, ...)."""
        return [(c.name, r) for c, r in zip(self.components, self.regions(slot))]

    def regions(self, slot: int) -> list[Region]:
        base = self.slot_byte_offset(slot)
        return [
            Region(self.tensor, base + c.offset, base + c.offset + c.nbytes)
            for c in self.components
        ]


@dataclass(frozen=True)
class Capacity:
    """How well a plan uses its budget.

    - ``token_capacity``: tokens of KV (all attention layers) that fit once ``max_num_seqs``
      requests hold their states.
    - ``ideal_token_capacity``: the same with no padding, no block rounding and no null block:
      ``(memory - max_num_seqs * state_slots_per_seq * state_bytes) / kv_bytes_per_token``.
    - ``padding_bytes``: bytes inside used pages that hold nothing (state pages padded to the
      attention page, padding layer slots, unfilled packs, alignment inside slots).
    - ``unusable_bytes``: bytes of the budget no id can use (tail of the budget, null blocks,
      blocks left over when groups need whole sets of blocks).
    - ``state_bytes``: bytes holding real recurrent state for ``max_num_seqs`` requests.
    - ``state_reserved_bytes``: bytes of the ids reserved for those requests' states (padding
      included); ``kv_reserved_bytes``: bytes of the ids left to KV.
    """

    token_capacity: int
    ideal_token_capacity: int
    padding_bytes: int
    unusable_bytes: int
    state_bytes: int
    state_reserved_bytes: int
    kv_reserved_bytes: int

    @property
    def fraction_of_ideal(self) -> float:
        if self.ideal_token_capacity <= 0:
            return 0.0
        return self.token_capacity / self.ideal_token_capacity


@dataclass(frozen=True)
class MemoryPlan:
    """A concrete memory plan; see the module docstring."""

    layout: str
    model_name: str
    config: PlanConfig
    tp_size: int
    kv_dtype: str
    block_size: int
    tensors: tuple[TensorPlan, ...]
    pools: tuple[PoolPlan, ...]
    groups: tuple[KVCacheGroup, ...]
    kv_placements: tuple[KVPlacement, ...]
    state_placements: tuple[StatePlacement, ...]
    capacity: Capacity
    kernel_alignment: int
    pack_size: int = 1
    notes: tuple[str, ...] = ()
    #: how the block size came about (for ``inflate``: vLLM's rule, with its numbers)
    block_size_rule: str = ""
    #: the vLLM rules this plan was made under (``config.target`` resolved for the model)
    vllm: VllmRules | None = None
    #: vLLM's ``KVCacheLayout`` name where the plan fixes it: ``"BLHNC"`` (GLM-5-Next) or
    #: ``"BLNHC"`` (Qwen4-Exp) for a plan packed block-outermost as vLLM 0.33 packs pages of
    #: different sizes (in vLLM's cache formats, :mod:`hybridkv.layouts.vllm_packed`); None
    #: where the export chooses (LBNHC for ``inflate``'s equal pages, BLNHC for ``pack``'s
    #: sub-pages)
    kv_cache_layout: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    # ---- lookups ----------------------------------------------------------------------------
    def tensor(self, name: str) -> TensorPlan:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def pool(self, name: str) -> PoolPlan:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)

    def group(self, group_id: int) -> KVCacheGroup:
        return self.groups[group_id]

    def pool_of(self, group_id: int) -> PoolPlan:
        return self.pool(self.groups[group_id].pool)

    def placement(self, layer: str) -> KVPlacement | StatePlacement:
        for p in self.kv_placements:
            if p.layer == layer:
                return p
        for s in self.state_placements:
            if s.layer == layer:
                return s
        raise KeyError(f"plan has no layer {layer!r}")

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def attention_groups(self) -> tuple[KVCacheGroup, ...]:
        return tuple(g for g in self.groups if not g.is_state)

    @property
    def token_groups(self) -> tuple[KVCacheGroup, ...]:
        """The groups whose blocks grow with a request's tokens (none of those whose
        :attr:`KVCacheGroup.is_per_request`)."""
        return tuple(g for g in self.groups if not g.is_per_request)

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes one rank keeps per token of a :attr:`token_groups` block's rows, over every
        layer (in this plan's cache formats: vLLM's k-pooled indexer keys count a pool's entry
        over its tokens), padding aside."""
        grows = {g.group_id for g in self.token_groups}
        return sum(
            (p.k_bytes_per_block + p.v_bytes_per_block) / p.block_size
            for p in self.kv_placements
            if p.group_id in grows
        )

    @property
    def state_groups(self) -> tuple[KVCacheGroup, ...]:
        return tuple(g for g in self.groups if g.is_state)

    def num_ids(self, group_id: int) -> int:
        """Valid block ids of a group (null id 0 included)."""
        return self.pool_of(group_id).num_ids(group_id)

    def placements_of(self, group_id: int) -> tuple[KVPlacement | StatePlacement, ...]:
        """The placements of the layers of ``group_id``, in group order."""
        members = (*self.kv_placements, *self.state_placements)
        return tuple(p for p in members if p.group_id == group_id)

    @property
    def checkpoint_granularity(self) -> int:
        """Tokens between positions where a state checkpoint can be taken: the lcm of the state
        groups' block sizes (1 without state groups)."""
        return math.lcm(*(g.block_size for g in self.state_groups))

    @property
    def dcp_size(self) -> int:
        """Decode-context-parallel ranks the attention groups shard their tokens over (1
        without DCP)."""
        return max((g.dcp_size for g in self.groups), default=1)

    @property
    def scheduler_block_size(self) -> int:
        """The lcm of every group's block size: the token multiple at which all groups' blocks
        end together (vLLM's scheduler block size)."""
        return math.lcm(*(g.block_size for g in self.groups))

    def id_bytes(self, group_id: int) -> int:
        """Bytes of the budget one block id of ``group_id`` takes: a whole block of its pool
        (every layer slot of a shared pool), or one small page of a two-level pool."""
        pool = self.pool_of(group_id)
        return self.groups[group_id].page_bytes if pool.is_two_level else pool.block_bytes

    def id_data_bytes(self, group_id: int) -> int:
        """Bytes of cache data one id of ``group_id`` holds when full: ``block_size`` tokens of
        K and V of the group's layers, or one request's state of its layers. The rest of
        :meth:`id_bytes` is padding."""
        kv = sum(
            p.k_bytes_per_block + p.v_bytes_per_block
            for p in self.kv_placements
            if p.group_id == group_id
        )
        state = sum(
            c.nbytes for s in self.state_placements if s.group_id == group_id for c in s.components
        )
        return kv + state

    def allocation_unit(self, group_id: int, block_id: int) -> tuple[str, int]:
        """The (pool, unit) that block ``block_id`` of ``group_id`` belongs to.

        Two (layer, block) regions may overlap only when they belong to the same unit: the
        allocator hands a unit to one group at a time, which is how vLLM's groups share tensors.
        """
        pool = self.pool_of(group_id)
        return pool.name, block_id // pool.ids_per_page(group_id)

    def unit_rows(self, group_id: int, unit: int) -> tuple[UnitRow, ...]:
        """Allocation unit ``unit`` of ``group_id`` as rows of equal width (for drawings):

        - a shared pool: block id ``unit``, one page in each of the pool's tensors (a row per
          tensor, with the group's layers that live in it);
        - a two-level pool: large page ``unit`` carved into small pages (a row per id);
        - a per-group pool: block id ``unit``, one page per layer of the group, pages that lie
          far apart in the pool's tensor (a row per layer).
        """
        pool = self.pool_of(group_id)
        members = self.placements_of(group_id)
        if not members:
            raise ValueError(f"group {group_id} of {self.layout} has no layers")
        width = members[0].id_stride
        if pool.shares_ids:
            return tuple(
                UnitRow(
                    t,
                    t,
                    unit * width,
                    (unit + 1) * width,
                    unit,
                    tuple(p.layer for p in members if p.tensor == t),
                )
                for t in pool.tensors
            )
        layers = tuple(p.layer for p in members)
        if pool.is_two_level:
            k = pool.ids_per_page(group_id)
            ids = range(unit * k, unit * k + k)
            t = members[0].tensor
            return tuple(UnitRow(f"id {b}", t, b * width, (b + 1) * width, b, layers) for b in ids)
        return tuple(
            UnitRow(
                p.layer,
                p.tensor,
                p.byte_offset(unit),
                p.byte_offset(unit) + width,
                unit,
                (p.layer,),
            )
            for p in members
        )

    # ---- real memory ------------------------------------------------------------------------
    def allocate(self, device: str | torch.device = "meta", *, fill: int | None = None):
        """Allocate the backing tensors (int8, one per :class:`TensorPlan`).

        Use ``device="meta"`` for large budgets (no memory is touched). ``fill`` sets every byte
        (e.g. 0 as vLLM zeroes state memory before first use).
        """
        import torch

        buffers = {}
        for t in self.tensors:
            buf = torch.empty(t.nbytes, dtype=torch.int8, device=device)
            if fill is not None and buf.device.type != "meta":
                buf.fill_(fill)
            buffers[t.name] = buf
        return buffers

    def kv_views(self, buffers: dict[str, torch.Tensor], layer: str):
        """``(k_cache, v_cache)`` views ``[num_blocks, rows_per_block, num_kv_heads, head_dim]``
        of one attention layer over ``buffers`` (``v_cache`` is None for MLA; rows are tokens
        unless the placement pools them, :attr:`KVPlacement.tokens_per_state`)."""
        import torch

        p = self.placement(layer)
        if not isinstance(p, KVPlacement):
            raise ValueError(f"{layer} is a state layer; use state_views()")
        typed = buffers[p.tensor].view(torch_dtype(p.dtype))
        ds = dtype_bytes(p.dtype)
        sb, st, sh, _ = p.element_strides()

        def view(offset: int, dim: int) -> torch.Tensor:
            if offset % ds:
                raise ValueError(f"{layer}: offset {offset} is not aligned to {p.dtype}")
            return torch.as_strided(
                typed,
                (p.num_blocks, p.rows_per_block, p.num_kv_heads, dim),
                (sb, st, sh, 1),
                offset // ds,
            )

        k = view(p.k_offset, p.head_dim)
        v = None if p.v_offset is None else view(p.v_offset, p.head_dim_v or p.head_dim)
        return k, v

    def state_views(self, buffers: dict[str, torch.Tensor], layer: str) -> dict[str, torch.Tensor]:
        """``{component: view [num_slots, *shape]}`` of one state layer over ``buffers``."""
        import torch

        p = self.placement(layer)
        if not isinstance(p, StatePlacement):
            raise ValueError(f"{layer} is an attention layer; use kv_views()")
        out = {}
        for c in p.components:
            ds = dtype_bytes(c.dtype)
            start = p.offset + c.offset
            if start % ds or p.slot_stride % ds:
                raise ValueError(f"{layer}.{c.name}: offset/stride not aligned to {c.dtype}")
            typed = buffers[p.tensor].view(torch_dtype(c.dtype))
            inner = [math.prod(c.shape[i + 1 :]) for i in range(len(c.shape))]
            out[c.name] = torch.as_strided(
                typed, (p.num_slots, *c.shape), (p.slot_stride // ds, *inner), start // ds
            )
        return out

    # ---- reporting --------------------------------------------------------------------------
    def summary_row(self) -> dict[str, Any]:
        """One row of ``hybridkv compare``."""
        cap = self.capacity
        return {
            "layout": f"pack({self.pack_size})" if self.layout == "pack" else self.layout,
            "block_size": self.block_size,
            "groups": len(self.groups),
            "tensors": len(self.tensors),
            "token_capacity": cap.token_capacity,
            "capacity_fraction": cap.fraction_of_ideal,
            "padding_bytes": cap.padding_bytes,
            "unusable_bytes": cap.unusable_bytes,
            "padding_fraction": cap.padding_bytes / max(1, self.config.memory_bytes),
        }

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra", None)
        # the CLI's vocabulary (README, "JSON output"): vllm_target, capacity_fraction
        d["config"]["vllm_target"] = d["config"].pop("target") and self.config.target.to_dict()
        d["vllm"] = self.vllm.to_dict() if self.vllm is not None else None
        d["capacity"]["capacity_fraction"] = self.capacity.fraction_of_ideal
        return d

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)
