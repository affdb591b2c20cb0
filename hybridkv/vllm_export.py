"""A memory plan as vLLM 0.33's ``KVCacheConfig``: the JSON ``hybridkv plan --format vllm`` prints.

:func:`kv_cache_config` turns a shared-pool plan into a plain, JSON-ready dict shaped like the
dataclasses of ``vllm/v1/kv_cache_interface.py`` in vLLM 0.33.0: ``KVCacheConfig`` holding
``KVCacheTensor`` and ``KVCacheGroupSpec`` entries, each group with a ``FullAttentionSpec``,
``SlidingWindowSpec``, ``MLAAttentionSpec`` or ``MambaSpec``. Every dataclass field is present,
filled as vLLM itself fills it for the model (defaults included); :func:`vllm_objects` builds the
real vLLM objects from the dict where vLLM is installed. The command line prints
``json.dumps(kv_cache_config(plan, model), indent=2)``.

The JSON shape::

    {"num_blocks": int,
     "kv_cache_tensors": [{"size", "layers", "layer_stride", "block_stride", "offset",
                           "host_resident"}, ...],
     "kv_cache_groups": [{"layer_names": [...],
                          "kv_cache_spec": {"kind": "MambaSpec", <every field>,
                                            "page_size_bytes": int},
                          "is_eagle_group", "host_resident", "enable_kv_transfer", "role"}, ...],
     "prefix_cache_retention_interval", "kv_cache_layout", "hash_block_size",
     "cache_hit_alignment_tokens", "hisparse_host_num_blocks", "hisparse_host_block_stride",
     "hisparse_shared_host_pool", "kv_tp_replicas"}

Conventions (the JSON has to name torch and enum values somehow):

- torch dtypes are written as ``str(dtype)``: ``"torch.bfloat16"``, ``"torch.float32"``; an fp8 KV
  cache is ``"torch.uint8"`` with ``kv_quant_mode`` ``"FP8_PER_TENSOR"``, as vLLM stores it
  (``STR_DTYPE_TO_TORCH_DTYPE``). ``MLAAttentionSpec.cache_dtype_str`` is vLLM's
  ``--kv-cache-dtype`` string: ``"auto"`` when the cache keeps the model dtype, else ``"fp8"`` /
  ``"fp8_e5m2"`` / the dtype name.
- enums (``KVQuantMode``, ``MambaAttentionBackendEnum``, ``KVCacheGroupRole``,
  ``SparseCacheRole``) are written as member names (``"NONE"``, ``"GDN_ATTN"``, ``"DEFAULT"``).
- ``Fraction`` and ``MultipleOf`` values do not occur (vLLM leaves them at ``1`` / ``None`` for
  these models on Hopper).
- two derived keys are added to every spec, neither a dataclass field: ``"kind"``, the vLLM class
  name, and ``"page_size_bytes"``, the spec's ``page_size_bytes`` property (:data:`DERIVED_KEYS`).
- the config is one TP rank's (all ranks are identical).

Where the facts come from. The plan is the one owner of layout facts: the block size, the page,
``num_blocks``, which layers form a group and in which slot each layer sits (hence every tensor's
offset and strides) are read from the plan, never recomputed. vLLM's vocabulary is added on top:
its layer names (:data:`VLLM_FAMILIES`, read from each family's vLLM model file), the per-layer
spec fields vLLM's layer classes fill, and vLLM's group order (vLLM lists the buckets of layers in
the order its layers register; the plan lists attention first). :func:`vllm_disagreements` says
where the plan and vLLM 0.33 part ways.

Layouts. ``inflate`` is vLLM's own layout and exports exactly as vLLM builds it: one tensor per
group, aliasing from byte 0, ``layer_stride = page * num_blocks``, ``block_stride = page``,
layout ``LBNHC`` (the first block-compact layout of vLLM's default preference, which FlashAttention
and the Mamba backends leave in place). ``pack(N)`` and ``aggregate`` put N attention layers in one
page; vLLM 0.33's ``KVCacheTensor`` expresses that faithfully: the layers at pack position ``j``
form one tensor at ``offset = j * layer_page`` with the same ``layer_stride`` and
``block_stride = page``, so every layer's page starts at the plan's byte. The per-layer pages are
then smaller than the block stride and than the state pages, which vLLM's layout check only admits
under a block-compact layout whose outermost dimension is the block: these plans declare
``BLNHC`` (the same ``N, H, C`` order inside a page as ``LBNHC``; the explicit strides fix where
each page is). ``per_group`` (a pool per group) and ``two_level`` (large pages carved per group)
do not export: vLLM has one pool of equal blocks that every group draws ids from.

A ``KVCacheConfig`` fixes where each layer's page is, not what is inside it: vLLM 0.33's
FlashAttention reads an attention page as ``[tokens, heads, K | V]``, the plan's kernels as K for
all tokens then V (see :func:`vllm_disagreements`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .dtypes import canonical_dtype, dtype_bytes
from .plan import KVPlacement, StatePlacement
from .specs import (
    AttentionSpec,
    GatedDeltaNetSpec,
    KDASpec,
    LinearAttentionSpec,
    Mamba1Spec,
    Mamba2Spec,
    MLASpec,
    ShortConvSpec,
    SlidingWindowSpec,
    StateSpec,
)
from .vllm_families import (
    _ZAMBA2_MEM_BLOCKS,
    VLLM_FAMILIES,
    VLLM_VERSION,
    VllmFamily,
    vllm_family,
)

if TYPE_CHECKING:  # pragma: no cover
    from .models.model import HybridModel
    from .plan import KVCacheGroup, MemoryPlan

__all__ = [
    "DERIVED_KEYS",
    "EXPORTABLE_LAYOUTS",
    "FIELDS",
    "VLLM_FAMILIES",
    "VLLM_VERSION",
    "LoggedCapacity",
    "VllmFamily",
    "kv_cache_config",
    "layer_names",
    "logged_capacity",
    "vllm_disagreements",
    "vllm_family",
    "vllm_objects",
]

#: keys added to every spec dict that are not dataclass fields
DERIVED_KEYS = ("kind", "page_size_bytes")
#: layouts that export (``per_group`` / ``two_level`` do not: vLLM has one block pool)
EXPORTABLE_LAYOUTS = ("inflate", "pack", "aggregate")

#: the dataclass fields of vLLM 0.33.0 (``vllm/v1/kv_cache_interface.py``), in field order
FIELDS: dict[str, tuple[str, ...]] = {
    "KVCacheConfig": (
        "num_blocks",
        "kv_cache_tensors",
        "kv_cache_groups",
        "prefix_cache_retention_interval",
        "kv_cache_layout",
        "hash_block_size",
        "cache_hit_alignment_tokens",
        "hisparse_host_num_blocks",
        "hisparse_host_block_stride",
        "hisparse_shared_host_pool",
        "kv_tp_replicas",
    ),
    "KVCacheTensor": ("size", "layers", "layer_stride", "block_stride", "offset", "host_resident"),
    "KVCacheGroupSpec": (
        "layer_names",
        "kv_cache_spec",
        "is_eagle_group",
        "host_resident",
        "enable_kv_transfer",
        "role",
    ),
}
_KV_SPEC_BASE = ("block_size", "dcp_sharded", "block_stride_alignment", "is_draft")
_ATTENTION_SPEC = (
    *_KV_SPEC_BASE,
    "max_tp_shards",
    "num_kv_heads",
    "head_size",
    "dtype",
    "head_size_v",
    "kv_quant_mode",
    "page_size_padded",
    "num_head_slots",
    "state_content_bytes",
    "tokens_per_state",
)
FIELDS["FullAttentionSpec"] = (
    *_ATTENTION_SPEC,
    "sliding_window",
    "attention_chunk_size",
    "non_causal",
)
FIELDS["MLAAttentionSpec"] = (
    *FIELDS["FullAttentionSpec"],
    "cache_dtype_str",
    "topk_buffer_width",
    "alignment",
    "model_version",
    "cache_role",
    "is_index_group_leader",
    "non_causal_multi_token_decode",
)
FIELDS["SlidingWindowSpec"] = (*_ATTENTION_SPEC, "sliding_window", "extra_retained_tokens")
FIELDS["MambaSpec"] = (
    *_KV_SPEC_BASE,
    "shapes",
    "dtypes",
    "page_size_padded",
    "mamba_type",
    "mamba_cache_mode",
    "num_speculative_blocks",
    "num_prefill_checkpoint_blocks",
    "prefill_checkpoint_alignment",
    "num_heads",
    "tokens_per_state",
    "tp_replicated",
)

# KV cache layouts (``vllm/v1/kv_cache_layout.py``): inflate's, and the one packed pages need
_LAYER_OUTER_LAYOUT = "LBNHC"
_BLOCK_OUTER_LAYOUT = "BLNHC"

# ``vllm/v1/attention/backends/registry.py``: MambaAttentionBackendEnum member per state layer
# class (``mamba_type`` of MambaMixer, MambaMixer2, GatedDeltaNetAttention (also KDA),
# LinearAttention, ShortConv)
_MAMBA_TYPE: dict[type, str] = {
    Mamba1Spec: "MAMBA1",
    Mamba2Spec: "MAMBA2",
    GatedDeltaNetSpec: "GDN_ATTN",
    KDASpec: "GDN_ATTN",
    LinearAttentionSpec: "LINEAR",
    ShortConvSpec: "SHORT_CONV",
}


def _zamba2_mem_blocks(model: HybridModel, hybrid_layers: int) -> int:
    value = model.extra.get("num_mem_blocks")
    if value is None:
        for label in (model.name, model.hf_repo):
            match = re.search(r"zamba2-[\d.]+b", (label or "").lower())
            if match and match.group(0) in _ZAMBA2_MEM_BLOCKS:
                value = _ZAMBA2_MEM_BLOCKS[match.group(0)]
                break
    if value is None:
        if hybrid_layers <= 1:
            return 1
        raise ValueError(
            f"{model.name}: vLLM names Zamba2's attention layers model.attn.{{j}} with j "
            "depending on the config's num_mem_blocks, which this model does not record; "
            "set model.extra['num_mem_blocks']"
        )
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{model.name}: num_mem_blocks must be a positive integer, got {value!r}")
    return value


def _names_and_order(model: HybridModel) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """(hybridkv layer -> vLLM name, hybridkv layer -> vLLM registration key)."""
    family = vllm_family(model)
    attn = [layer for layer in model.layers if isinstance(layer.spec, AttentionSpec)]
    hybrid_rank = {layer.name: k for k, layer in enumerate(attn)}
    n_hybrid = len(attn)
    mem_blocks = _zamba2_mem_blocks(model, n_hybrid) if family.key == "zamba2" else 1
    names: dict[str, str] = {}
    order: dict[str, tuple[int, ...]] = {}
    for layer in model.layers:
        spec = layer.spec
        if not isinstance(spec, (AttentionSpec, StateSpec)):  # pragma: no cover - defensive
            raise ValueError(f"{model.name}: layer {layer.name} holds no cache")
        is_attn = isinstance(spec, AttentionSpec)
        template = family.attention if is_attn else family.state
        if not template:
            raise ValueError(
                f"{model.name}: vLLM's {family.architecture} has no "
                f"{'attention' if is_attn else 'state'} layers, but {layer.name} is one"
            )
        j = 0
        if is_attn and family.key == "zamba2":
            # Zamba2Attention: shared block b = k % num_mem_blocks owns hybrid layers
            # k = b, b + m, ...; its j starts at b * (H + m - 1) // m
            k = hybrid_rank[layer.name]
            b = k % mem_blocks
            j = b * (n_hybrid + mem_blocks - 1) // mem_blocks + k // mem_blocks
        names[layer.name] = template.format(
            i=layer.index,
            j=j,
            n_plus_i=model.num_hidden_layers + layer.index,
            h_plus_i=n_hybrid + layer.index,
        )
        # vLLM registers layers as it builds them: decoder layer by decoder layer, attention
        # before the SSM branch in Falcon-H1; Zamba2 builds its shared attention blocks (all
        # model.attn.j) before any layer
        if family.key == "zamba2":
            order[layer.name] = (0, j) if is_attn else (1, layer.index)
        else:
            order[layer.name] = (layer.index, 0 if is_attn else 1)
    if len(set(names.values())) != len(names):  # pragma: no cover - a table error
        raise AssertionError(f"{model.name}: vLLM layer names collide")
    return names, order


def layer_names(model: HybridModel) -> dict[str, str]:
    """hybridkv cache-layer name -> the name vLLM 0.33 registers for it."""
    return _names_and_order(model)[0]


# ---------------------------------------------------------------------------------------------
# Specs
# ---------------------------------------------------------------------------------------------


def _torch_name(dtype: str) -> str:
    """vLLM's torch dtype for a cache dtype, as ``str(torch_dtype)`` (fp8 caches are uint8)."""
    canon = canonical_dtype(dtype)
    if canon.startswith("fp8"):
        return "torch.uint8"
    return f"torch.{canon}"


def _cache_dtype_str(kv_dtype: str, model_dtype: str) -> str:
    canon = canonical_dtype(kv_dtype)
    if canon == canonical_dtype(model_dtype):
        return "auto"
    return {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8_e5m2"}.get(canon, canon)


def _attention_spec(plan: MemoryPlan, model: HybridModel, group: KVCacheGroup) -> dict:
    placements = [plan.placement(name) for name in group.layers]
    assert all(isinstance(p, KVPlacement) for p in placements)
    first = placements[0]
    spec = model.layer(group.layers[0]).spec
    fp8 = canonical_dtype(first.dtype).startswith("fp8")
    base: dict[str, Any] = {
        "block_size": first.block_size,
        "dcp_sharded": True,
        "block_stride_alignment": None,
        "is_draft": False,
        "max_tp_shards": None,
        "num_kv_heads": first.num_kv_heads,
        "head_size": first.head_dim,
        "dtype": _torch_name(first.dtype),
        "head_size_v": first.head_dim_v,
        "kv_quant_mode": "FP8_PER_TENSOR" if fp8 else "NONE",
        "page_size_padded": None,
        "num_head_slots": None,
        "state_content_bytes": None,
        "tokens_per_state": 1,
    }
    if isinstance(spec, MLASpec):
        kind = "MLAAttentionSpec"
        # Kimi-Linear's MultiHeadLatentAttention.get_kv_cache_spec (vllm/models/kimi_k3)
        base.update(
            max_tp_shards=1,
            head_size_v=0,
            sliding_window=None,
            attention_chunk_size=None,
            non_causal=False,
            cache_dtype_str=_cache_dtype_str(first.dtype, model.dtype),
            topk_buffer_width=None,
            alignment=None,
            model_version=None,
            cache_role="SPARSE",
            is_index_group_leader=False,
            non_causal_multi_token_decode=False,
        )
    elif isinstance(spec, SlidingWindowSpec):
        kind = "SlidingWindowSpec"
        base.update(sliding_window=spec.sliding_window, extra_retained_tokens=0)
    else:
        kind = "FullAttentionSpec"
        base.update(sliding_window=None, attention_chunk_size=None, non_causal=False)
    # AttentionSpec.page_size_bytes: heads * tokens * (head_size + head_size_v) * dtype size
    page = (
        base["num_kv_heads"]
        * base["block_size"]
        * (base["head_size"] + base["head_size_v"])
        * dtype_bytes(first.dtype)
    )
    for p in placements:
        if (p.block_size, p.num_kv_heads, p.head_dim, p.dtype) != (
            first.block_size,
            first.num_kv_heads,
            first.head_dim,
            first.dtype,
        ) or p.k_bytes_per_block + p.v_bytes_per_block != page:
            raise ValueError(
                f"{plan.model_name}: layers of group {group.group_id} do not share one "
                "attention spec; vLLM's KVCacheGroupSpec needs one"
            )
    return {"kind": kind, **base, "page_size_bytes": page}


def _mamba_spec(plan: MemoryPlan, model: HybridModel, group: KVCacheGroup):
    rules = plan.vllm
    assert rules is not None
    placements = [plan.placement(name) for name in group.layers]
    assert all(isinstance(p, StatePlacement) for p in placements)
    first = placements[0]
    spec = model.layer(group.layers[0]).spec
    mamba_type = _MAMBA_TYPE.get(type(spec))
    if mamba_type is None:
        raise ValueError(f"{plan.model_name}: vLLM has no Mamba backend for {spec.kind} layers")
    shapes = [list(c.shape) for c in first.components]
    dtypes = [_torch_name(c.dtype) for c in first.components]
    # MambaBase.bind_kv_cache reads the states back to back from the page start
    offset = 0
    for c in first.components:
        if c.offset != offset:
            raise ValueError(
                f"{plan.model_name}: {first.layer}'s {c.name} state sits at byte {c.offset} of "
                f"its page, vLLM reads it at {offset} (states back to back)"
            )
        offset += c.nbytes
    unpadded = offset
    for p in placements:
        if [list(c.shape) for c in p.components] != shapes or p.slot_stride != first.slot_stride:
            raise ValueError(
                f"{plan.model_name}: layers of group {group.group_id} do not share one state "
                "spec; vLLM's KVCacheGroupSpec needs one"
            )
    page = first.slot_stride
    if page < unpadded:  # pragma: no cover - the plan would overlap its own states
        raise ValueError(f"{plan.model_name}: state page {page} B < state {unpadded} B")
    align = rules.mamba_cache_mode == "align"
    if align:
        block_size = plan.block_size
    else:
        if rules.max_model_len is None:
            raise ValueError(
                f"{plan.model_name}: without prefix caching vLLM's Mamba block size is "
                "max_model_len, which neither the model nor the target gives; plan with "
                "VllmTarget(max_model_len=...) (--max-model-len)"
            )
        block_size = rules.max_model_len
    # per-layer overrides of MambaBase.get_kv_cache_spec, resolved by the target: MambaMixer2
    # always declares one prefill checkpoint block at alignment 1; Qwen's GDN does when it
    # exports FlashInfer checkpoints (align mode), on the prefix-cache grid = the Mamba block
    # size (get_mamba_prefill_checkpoint_grid without --prefix-match-unit)
    checkpoint_blocks = rules.num_prefill_checkpoint_blocks
    checkpoint_alignment = None
    if checkpoint_blocks:
        checkpoint_alignment = 1 if rules.checkpoint_alignment is None else block_size
    fields = {
        "block_size": block_size,
        "dcp_sharded": False,
        "block_stride_alignment": None,
        "is_draft": False,
        "shapes": shapes,
        "dtypes": dtypes,
        # Platform._align_hybrid_block_size leaves it unset when the pages are already equal
        "page_size_padded": None if page == unpadded else page,
        "mamba_type": mamba_type,
        "mamba_cache_mode": rules.mamba_cache_mode,
        "num_speculative_blocks": rules.num_speculative_blocks,
        "num_prefill_checkpoint_blocks": checkpoint_blocks,
        "prefill_checkpoint_alignment": checkpoint_alignment,
        "num_heads": 1,
        "tokens_per_state": -1,
        "tp_replicated": False,
    }
    return {"kind": "MambaSpec", **fields, "page_size_bytes": page}


# ---------------------------------------------------------------------------------------------
# The config
# ---------------------------------------------------------------------------------------------


def _check_exportable(plan: MemoryPlan) -> None:
    if plan.layout not in EXPORTABLE_LAYOUTS or len(plan.pools) != 1:
        raise ValueError(
            f"layout {plan.layout!r} does not export to vLLM: vLLM's KVCacheConfig has one shared "
            f"block pool (one num_blocks, every group drawing ids from it), and this plan has "
            f"{len(plan.pools)} pool(s) of kind(s) {sorted({p.kind for p in plan.pools})}; "
            "use --layout inflate (vLLM's own layout), pack or aggregate"
        )
    pool = plan.pools[0]
    if pool.kind != "shared":  # pragma: no cover - shared layouts always have a shared pool
        raise ValueError(f"pool {pool.name!r} is {pool.kind}, not shared; use --layout inflate")
    if plan.vllm is None:  # pragma: no cover - shared layouts always record their rules
        raise ValueError("the plan records no vLLM rules; re-plan it with a VllmTarget")
    if plan.vllm.target.version != VLLM_VERSION:
        raise ValueError(
            f"the plan follows vLLM {plan.vllm.target.version}'s rules, but the export writes "
            f"vLLM {VLLM_VERSION}'s KVCacheConfig; plan with --vllm-version {VLLM_VERSION}"
        )


def _ordered_groups(plan: MemoryPlan, model: HybridModel, order: dict[str, tuple[int, ...]]):
    """The plan's groups in vLLM's order: buckets (one spec each) by their first layer in vLLM's
    registration order, a bucket's groups in the plan's order."""
    buckets: dict[Any, list[KVCacheGroup]] = {}
    for group in plan.groups:
        buckets.setdefault(model.layer(group.layers[0]).spec, []).append(group)
    ranked = sorted(
        buckets.values(),
        key=lambda gs: min(order[name] for g in gs for name in g.layers),
    )
    return [g for gs in ranked for g in gs]


def _tensors(plan: MemoryPlan, groups, names: dict[str, str]) -> tuple[list[dict], bool]:
    """KVCacheTensors from the plan's placements, and whether any page is packed.

    vLLM 0.33 has one backing allocation; the plan's tensors, laid end to end in pool order, are
    that allocation. Within a group, the layers whose pages start at the same byte of their
    tensor (one pack position) and sit in consecutive tensors form one KVCacheTensor."""
    pool = plan.pools[0]
    sizes = {plan.tensor(t).nbytes for t in pool.tensors}
    if len(sizes) != 1:
        raise ValueError(
            f"{plan.model_name}: the plan's tensors differ in size ({sorted(sizes)}); vLLM's "
            "tensors are equal slices of one allocation"
        )
    tensor_bytes = sizes.pop()
    total = tensor_bytes * len(pool.tensors)
    if total != pool.num_blocks * pool.block_bytes:
        raise ValueError(
            f"{plan.model_name}: tensors hold {total} B, num_blocks x block bytes is "
            f"{pool.num_blocks * pool.block_bytes} B"
        )
    index = {t: i for i, t in enumerate(pool.tensors)}
    out: list[dict] = []
    packed = False
    for group in groups:
        runs: dict[tuple[int, int], list[tuple[int, str]]] = {}
        for name in group.layers:
            p = plan.placement(name)
            if isinstance(p, KVPlacement):
                offset, stride = p.k_offset, p.block_stride
                packed |= p.k_bytes_per_block + p.v_bytes_per_block != stride
            else:
                offset, stride = p.offset, p.slot_stride
            runs.setdefault((offset, stride), []).append((index[p.tensor], name))
        for (offset, stride), members in runs.items():
            members.sort()
            start = 0
            for k in range(1, len(members) + 1):
                if k < len(members) and members[k][0] == members[k - 1][0] + 1:
                    continue
                run = members[start:k]
                out.append(
                    {
                        "size": total,
                        "layers": [names[name] for _, name in run],
                        "layer_stride": tensor_bytes,
                        "block_stride": stride,
                        "offset": run[0][0] * tensor_bytes + offset,
                        "host_resident": False,
                    }
                )
                start = k
    return out, packed


def _block_sizes(groups: list[dict], rules) -> tuple[int, int]:
    """(hash_block_size, cache_hit_alignment_tokens) as the engine core resolves them
    (``resolve_kv_cache_block_sizes`` / ``resolve_cache_hit_alignment_tokens`` in
    ``vllm/v1/core/kv_cache_utils.py``, no ``--prefix-match-unit``, no DCP)."""
    sizes = [g["kv_cache_spec"]["block_size"] for g in groups]
    if len(sizes) <= 1:
        return sizes[0], sizes[0]
    scheduler = math.lcm(*sizes)
    if not rules.enable_prefix_caching:
        return scheduler, scheduler
    mamba = [g["kv_cache_spec"] for g in groups if g["kv_cache_spec"]["kind"] == "MambaSpec"]
    if any(s["mamba_cache_mode"] != "align" for s in mamba):
        return scheduler, scheduler
    hash_block = math.gcd(*sizes)
    # partial (sub-block) hits need a Mamba block larger than the hash block
    partial = any(s["block_size"] > hash_block for s in mamba)
    return hash_block, hash_block if partial else scheduler


def kv_cache_config(plan: MemoryPlan, model: HybridModel) -> dict[str, Any]:
    """``plan`` as vLLM 0.33's ``KVCacheConfig``, a JSON-ready dict (see the module docstring).

    ``model`` is the model the plan was made for (configured for the same TP size and dtypes).
    Raises ``ValueError`` for a layout with more than one block pool (``per_group``,
    ``two_level``), a plan made under another vLLM version's rules, and a family vLLM 0.33 does
    not serve (RecurrentGemma, Zamba v1, and Bamba and MiniMax-01, which vLLM removed in 0.23).
    """
    _check_exportable(plan)
    if model.name != plan.model_name or model.tp_size != plan.tp_size:
        raise ValueError(
            f"the plan is for {plan.model_name} at TP {plan.tp_size}, the model given is "
            f"{model.name} at TP {model.tp_size}"
        )
    names, order = _names_and_order(model)  # a family vLLM does not serve raises here
    covered = [name for g in plan.groups for name in g.layers]
    if sorted(covered) != sorted(layer.name for layer in model.layers):
        raise ValueError(f"{plan.model_name}: the plan's groups do not cover the model's layers")
    rules = plan.vllm
    assert rules is not None
    groups = _ordered_groups(plan, model, order)
    tensors, packed = _tensors(plan, groups, names)
    group_dicts = []
    for group in groups:
        if group.is_state:
            spec = _mamba_spec(plan, model, group)
        else:
            spec = _attention_spec(plan, model, group)
        group_dicts.append(
            {
                "layer_names": [names[name] for name in group.layers],
                "kv_cache_spec": spec,
                "is_eagle_group": False,
                "host_resident": False,
                "enable_kv_transfer": True,
                "role": "DEFAULT",
            }
        )
    hash_block, hit_alignment = _block_sizes(group_dicts, rules)
    # kv_cache_groups_tp_replicas: gcd over layers of tp // max_tp_shards (1 for unset, Mamba)
    replicas = model.tp_size
    for g in group_dicts:
        shards = g["kv_cache_spec"].get("max_tp_shards")
        replicas = math.gcd(replicas, max(1, model.tp_size // shards) if shards else 1)
    return {
        "num_blocks": plan.pools[0].num_blocks,
        "kv_cache_tensors": tensors,
        "kv_cache_groups": group_dicts,
        "prefix_cache_retention_interval": 0,
        "kv_cache_layout": _BLOCK_OUTER_LAYOUT if packed else _LAYER_OUTER_LAYOUT,
        "hash_block_size": hash_block,
        "cache_hit_alignment_tokens": hit_alignment,
        "hisparse_host_num_blocks": None,
        "hisparse_host_block_stride": None,
        "hisparse_shared_host_pool": False,
        "kv_tp_replicas": replicas,
    }


@dataclass(frozen=True)
class LoggedCapacity:
    """What vLLM 0.33 logs at start-up for a plan: ``GPU KV cache size: {tokens} tokens,
    Maximum concurrency for {max_model_len} tokens per request: {max_concurrency}x``
    (``update_kv_cache_capacity`` in ``vllm/v1/core/kv_cache_utils.py``).

    ``blocks_per_request``: the blocks one request at ``max_model_len`` takes from the shared
    pool, summed over the groups (``get_max_concurrency_for_kv_cache_config``): every attention
    group ``cdiv(max_model_len, block_size)``, every Mamba group its state blocks (``2 +
    speculative + prefill-checkpoint`` in ``align`` mode, ``1 + speculative`` otherwise:
    ``MambaSpec.max_memory_usage_bytes``). So the logged tokens are not the pool's token slots:
    a model with many state groups and a short ``max_model_len`` logs far fewer."""

    tokens: int
    max_concurrency: float
    blocks_per_request: int
    attention_blocks_per_request: int
    state_blocks_per_request: int
    max_model_len: int
    num_blocks: int


def logged_capacity(plan: MemoryPlan, model: HybridModel) -> LoggedCapacity:
    """:class:`LoggedCapacity` of ``plan`` (exportable: see :func:`kv_cache_config`) at the
    ``max_model_len`` its vLLM rules resolved. Raises ``ValueError`` for a sliding-window group:
    vLLM sizes those by its in-flight tokens (``max_in_flight_tokens``: the scheduler's batch
    times the steps in flight), which a plan does not know."""
    config = kv_cache_config(plan, model)
    rules = plan.vllm
    assert rules is not None  # kv_cache_config refuses a plan without vLLM rules
    max_len = rules.max_model_len
    if not max_len:
        raise ValueError(
            f"{plan.model_name}: no max_model_len (neither --max-model-len nor the model's "
            "max_position_embeddings): vLLM's logged capacity is per max_model_len request"
        )
    attention = state = 0
    for group in config["kv_cache_groups"]:
        spec = group["kv_cache_spec"]
        if spec["kind"] == "MambaSpec":
            state += rules.state_blocks_per_request
        elif spec["kind"] in ("FullAttentionSpec", "MLAAttentionSpec"):
            attention += -(-max_len // spec["block_size"])
        else:
            raise ValueError(
                f"{plan.model_name}: a {spec['kind']} group's blocks per request depend on "
                "vLLM's in-flight tokens, which the plan does not model"
            )
    per_request = attention + state
    concurrency = config["num_blocks"] / per_request
    return LoggedCapacity(
        tokens=int(concurrency * max_len),
        max_concurrency=concurrency,
        blocks_per_request=per_request,
        attention_blocks_per_request=attention,
        state_blocks_per_request=state,
        max_model_len=max_len,
        num_blocks=config["num_blocks"],
    )


# ---------------------------------------------------------------------------------------------
# Where the plan and vLLM 0.33 differ
# ---------------------------------------------------------------------------------------------


def _vllm_grouping(model: HybridModel, names, order) -> list[list[str]]:
    """vLLM's ``_get_kv_cache_groups_uniform_page_size`` on vLLM-named layers: buckets by spec in
    registration order, the smallest bucket (or the largest, under 1.5x) as the group size,
    ``layers[i::num_groups]`` per group. A group of one spec only is vLLM's uniform case."""
    layers = sorted(model.layers, key=lambda layer: order[layer.name])
    buckets: dict[Any, list[str]] = {}
    for layer in layers:
        buckets.setdefault(layer.spec, []).append(names[layer.name])
    counts = [len(b) for b in buckets.values()]
    lo, hi = min(counts), max(counts)
    size = hi if hi < 1.5 * lo else lo
    out = []
    for bucket in buckets.values():
        n = -(-len(bucket) // size)
        out.extend(bucket[i::n] for i in range(n))
    return out


def vllm_disagreements(plan: MemoryPlan, model: HybridModel) -> list[str]:
    """Where the exported plan differs from what vLLM 0.33 itself builds for the model (one
    sentence each; empty when they agree). Checks the grouping (members and slot order), the
    group order and the K/V order inside an attention page. (Block sizes, state blocks and the
    Mamba cache mode are vLLM's by construction: :mod:`hybridkv.target`.)"""
    config = kv_cache_config(plan, model)
    names, order = _names_and_order(model)
    notes = []
    exported = [g["layer_names"] for g in config["kv_cache_groups"]]
    expected = _vllm_grouping(model, names, order)
    if sorted(map(tuple, exported)) != sorted(map(tuple, expected)):
        notes.append(
            f"groups: the plan's {[len(g) for g in exported]} layers per group (slot order "
            f"{exported}) differ from vLLM's {expected}"
        )
    plan_order = [[names[n] for n in g.layers] for g in plan.groups]
    if plan_order != exported:
        notes.append(
            "group order: the plan lists attention groups first; vLLM numbers its groups by "
            "bucket in layer-registration order (exported in vLLM's order)"
        )
    has_v = any(p.v_offset is not None for p in plan.kv_placements)
    if has_v:
        notes.append(
            "page contents: the plan keeps a layer's K as [tokens, heads, dim] then V likewise; "
            "vLLM 0.33's FlashAttention page is [tokens, heads, K dim | V dim] (logical "
            "[B, H, N, 2*D], split on the last dim), so K and V interleave per token and head"
        )
    return notes


# ---------------------------------------------------------------------------------------------
# Real vLLM objects
# ---------------------------------------------------------------------------------------------


def vllm_objects(plan: MemoryPlan, model: HybridModel):
    """The export as real vLLM objects (``vllm.v1.kv_cache_interface.KVCacheConfig``); needs vLLM
    installed (``ImportError`` otherwise). Each spec's ``page_size_bytes`` is checked against the
    exported one."""
    try:
        import torch
        from vllm.v1 import kv_cache_interface as kvi
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    except ImportError as exc:
        raise ImportError(
            "vllm_objects() needs vLLM 0.33 installed (pip install vllm==0.33.0); "
            "kv_cache_config() gives the same config as a plain dict without it"
        ) from exc
    data = kv_cache_config(plan, model)

    def dtype(name: str):
        return getattr(torch, name.removeprefix("torch."))

    enums: dict[str, Callable[[Any], Any]] = {
        "kv_quant_mode": lambda v: kvi.KVQuantMode[v],
        "cache_role": lambda v: kvi.SparseCacheRole[v],
        "mamba_type": lambda v: MambaAttentionBackendEnum[v],
        "dtype": dtype,
        "dtypes": lambda v: tuple(dtype(x) for x in v),
        "shapes": lambda v: tuple(tuple(s) for s in v),
    }
    groups = []
    for g in data["kv_cache_groups"]:
        raw = dict(g["kv_cache_spec"])
        kind = raw.pop("kind")
        page = raw.pop("page_size_bytes")
        kwargs = {k: enums[k](v) if k in enums and v is not None else v for k, v in raw.items()}
        spec = getattr(kvi, kind)(**kwargs)
        if spec.page_size_bytes != page:
            raise AssertionError(
                f"{kind} of {g['layer_names'][0]}: vLLM computes page_size_bytes "
                f"{spec.page_size_bytes}, the export says {page}"
            )
        groups.append(
            kvi.KVCacheGroupSpec(
                layer_names=list(g["layer_names"]),
                kv_cache_spec=spec,
                is_eagle_group=g["is_eagle_group"],
                host_resident=g["host_resident"],
                enable_kv_transfer=g["enable_kv_transfer"],
                role=kvi.KVCacheGroupRole[g["role"]],
            )
        )
    tensors = [kvi.KVCacheTensor(**t) for t in data["kv_cache_tensors"]]
    top = {k: v for k, v in data.items() if k not in ("kv_cache_tensors", "kv_cache_groups")}
    return kvi.KVCacheConfig(kv_cache_tensors=tensors, kv_cache_groups=groups, **top)
