"""A memory plan as vLLM 0.33's ``KVCacheConfig``: the JSON ``hybridkv plan --format vllm`` prints.

:func:`kv_cache_config` turns a shared-pool plan into a plain, JSON-ready dict shaped like the
dataclasses of ``vllm/v1/kv_cache_interface.py`` in vLLM 0.33.0: ``KVCacheConfig`` holding
``KVCacheTensor`` and ``KVCacheGroupSpec`` entries, each group with a ``FullAttentionSpec``,
``SlidingWindowSpec``, ``MLAAttentionSpec`` or ``MambaSpec``, or (GLM-5-Next, packed) a
``UniformTypeKVCacheSpecs`` holding each layer's ``MLAAttentionSpec``, ``CircularBufferSpec`` or
``MambaSpec``. Every dataclass field is present, filled as vLLM itself fills it for the model
(defaults included); :func:`vllm_objects` builds the real vLLM objects from the dict where vLLM
is installed. The command line prints ``json.dumps(kv_cache_config(plan, model), indent=2)``.

The JSON shape::

    {"num_blocks": int,
     "kv_cache_tensors": [{"size", "layers", "layer_stride", "block_stride", "offset",
                           "host_resident"}, ...],
     "kv_cache_groups": [{"layer_names": [...],
                          "kv_cache_spec": {"kind": "MambaSpec", <every field>,
                                            "page_size_bytes": int},
                          "is_eagle_group", "host_resident", "enable_kv_transfer", "role"}, ...],
     # a UniformTypeKVCacheSpecs group's spec nests its layers' specs:
     #   {"kind": "UniformTypeKVCacheSpecs", <every field>, "kv_cache_specs": {layer name:
     #    {"kind": "MLAAttentionSpec", <every field>, "page_size_bytes": int}, ...},
     #    "page_size_bytes": their sum}
     "prefix_cache_retention_interval", "kv_cache_layout", "hash_block_size",
     "cache_hit_alignment_tokens", "hisparse_host_num_blocks", "hisparse_host_block_stride",
     "hisparse_shared_host_pool", "kv_tp_replicas"}

Conventions (the JSON has to name torch and enum values somehow):

- torch dtypes are written as ``str(dtype)``: ``"torch.bfloat16"``, ``"torch.float32"``; an fp8 KV
  cache is ``"torch.uint8"`` with ``kv_quant_mode`` ``"FP8_PER_TENSOR"``, as vLLM stores it
  (``STR_DTYPE_TO_TORCH_DTYPE``). ``MLAAttentionSpec.cache_dtype_str`` is vLLM's
  ``--kv-cache-dtype`` string: ``"auto"`` when the cache keeps the model dtype, else ``"fp8"`` /
  ``"fp8_e5m2"`` / the dtype name. GLM-5-Next's indexer entries are ``"torch.uint8"`` with
  ``kv_quant_mode`` ``"NONE"`` and no ``cache_dtype_str`` whatever the KV dtype: vLLM stores their
  fp8 keys and float32 scales as bytes. Qwen4-Exp's compressed QSA keys under
  ``indexer_kv_dtype`` fp8 are ``"torch.float8_e4m3fn"`` (``QSAIndexer`` allocates e4m3, no
  scales), ``kv_quant_mode`` ``"NONE"``.
- enums (``KVQuantMode``, ``MambaAttentionBackendEnum``, ``KVCacheGroupRole``,
  ``SparseCacheRole``) are written as member names (``"NONE"``, ``"GDN_ATTN"``, ``"DEFAULT"``).
- ``MultipleOf(n)`` (``vllm/v1/attention/backend.py``) is written ``{"MultipleOf": n}``: it
  occurs as GLM-5-Next's indexer ``block_stride_alignment``. ``Fraction`` values do not occur
  (vLLM leaves ``tokens_per_state`` an int for these models on Hopper).
- two derived keys are added to every spec, neither a dataclass field: ``"kind"``, the vLLM class
  name, and ``"page_size_bytes"``, the spec's ``page_size_bytes`` property (:data:`DERIVED_KEYS`).
- the config is one TP rank's (all ranks are identical).

Where the facts come from. The plan is the one owner of layout facts: the block size, the page,
``num_blocks``, which layers form a group and in which slot each layer sits (hence every tensor's
offset and strides) are read from the plan, never recomputed. vLLM's vocabulary is added on top:
its layer names (:data:`VLLM_FAMILIES`, read from each family's vLLM model file), the per-layer
spec fields vLLM's layer classes fill, and vLLM's group order (vLLM lists the buckets of layers in
the order its layers register; the plan lists attention first, except a packed GLM-5-Next plan,
already in vLLM's order). :func:`vllm_disagreements` says where the plan and vLLM 0.33 part
ways.

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

GLM-5-Next. vLLM 0.33 keeps its sparse-attention indexer in formats of its own (one fp8 entry
per ``index_kpool`` tokens, a per-request bf16 tail ring) and, since ``KpoolTailBackend`` takes
only ``BLHNC``, packs the latent, indexer, ring and KDA pages block-outermost
(``_get_packed_kv_cache_groups``). A plan in vLLM's cache formats
(``VllmTarget(cache_formats="vllm")``; the command line's ``--format vllm`` makes one) is that
packing (:mod:`hybridkv.layouts.vllm_packed`, :attr:`~hybridkv.plan.MemoryPlan.kv_cache_layout`
``"BLHNC"``) and exports as vLLM builds it: the plan's groups in the plan's order (vLLM's), each
a ``UniformTypeKVCacheSpecs`` of its layers' specs (the latents' ``MLAAttentionSpec``, the
indexers' ``MLAAttentionSpec`` with ``tokens_per_state = index_kpool`` and ``cache_role``
``INDEXER``, the rings' ``CircularBufferSpec``, the KDA states' ``MambaSpec``), per group one
tensor per distinct layer spec in the order the specs first appear, at the group's byte offset
inside the block, ``layer_stride`` the spec's page and ``block_stride`` the block
(``get_kv_cache_config_from_groups``); ring layers are named ``...self_attn.indexer.tail_cache``.
A GLM-5-Next plan in transformers' formats (the default: per-token indexer rows riding in the
latent's page, which :mod:`hybridkv.e2e` serves) is refused with that reason.

Qwen4-Exp. vLLM 0.33 keeps its QSA indexer as a per-request ring of raw bf16 keys
(``QSAKeyStateCache``, a ``CircularBufferSpec``) and one compressed key per
``indexer_compress_ratio`` tokens (``QSACompressedKeyCache``, an ``MLAAttentionSpec`` with
``tokens_per_state`` the ratio), beside the gated GQA's ``FullAttentionSpec``, the GDN states and
the PLE conv's ``MambaSpec`` (``SHORT_CONV``, ``tp_replicated``), and packs them block-outermost
in ``BLNHC`` (``QSAStateBackend``'s first layout). A plan in vLLM's cache formats exports the same
way as GLM-5-Next's (ring layers named ``...self_attn.indexer.raw_key_cache``, compressed keys
``...self_attn.indexer.compressed_key_cache``, PLE states ``...ple``); one in transformers'
formats (a raw key per token beside the K/V) is refused with the reason. Without the indexer_*
fields vLLM builds the plain attention and its pages are equal: the ordinary ``inflate`` export.

A ``KVCacheConfig`` fixes where each layer's page is, not what is inside it: vLLM 0.33's
FlashAttention reads an attention page as ``[tokens, heads, K | V]``. A plan in vLLM's cache
formats (``VllmTarget(cache_formats="vllm")``) keeps its pages so, byte for byte; one in
transformers' formats keeps K for all tokens then V (:func:`vllm_disagreements` says so). The
kernels read either through the placements' strides.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .dtypes import canonical_dtype, dtype_bytes
from .layouts.vllm_packed import BLOCK_OUTERMOST_LAYOUTS
from .models.model import MTP_PREFIX
from .plan import KVPlacement, StatePlacement
from .specs import (
    AttentionSpec,
    GatedDeltaNetSpec,
    IndexerSpec,
    KDASpec,
    LinearAttentionSpec,
    Mamba1Spec,
    Mamba2Spec,
    MLASpec,
    PLEConvSpec,
    ShortConvSpec,
    SlidingWindowSpec,
    StateSpec,
)
from .target import GLM5_NEXT_FAMILIES, PAGED_MQA_PAGES
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
    "RequestBlocks",
    "VllmFamily",
    "kv_cache_config",
    "layer_names",
    "logged_capacity",
    "request_blocks",
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
FIELDS["CircularBufferSpec"] = _ATTENTION_SPEC
FIELDS["UniformTypeKVCacheSpecs"] = (*_KV_SPEC_BASE, "kv_cache_specs")
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

# KV cache layouts (``vllm/v1/kv_cache_layout.py``): inflate's, the one pack's sub-pages need,
# and the ones vLLM 0.33 resolves for GLM-5-Next (KpoolTailBackend's only one, BLHNC) and
# Qwen4-Exp (QSAStateBackend's first, BLNHC)
_LAYER_OUTER_LAYOUT = "LBNHC"
_BLOCK_OUTER_LAYOUT = "BLNHC"
_PACKED_LAYOUTS = BLOCK_OUTERMOST_LAYOUTS

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
    PLEConvSpec: "SHORT_CONV",  # Qwen4ExpPLELayer.mamba_type
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
        if layer.name.startswith(MTP_PREFIX):
            template, what = family.mtp_attention, "MTP drafter attention"
        elif isinstance(spec, IndexerSpec):
            template, what = family.indexer, "sparse-attention indexer"
        elif isinstance(spec, PLEConvSpec):
            template, what = family.ple, "Per-Layer Embedding"
        else:
            template = family.attention if is_attn else family.state
            what = "attention" if is_attn else "state"
        if not template:
            raise ValueError(
                f"{model.name}: vLLM's {family.architecture} has no {what} layers, but "
                f"{layer.name} is one"
            )
        j = 0
        if layer.name.startswith(MTP_PREFIX):
            j = layer.index - model.num_hidden_layers  # its position in the drafter
        elif is_attn and family.key == "zamba2":
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
            # Qwen4-Exp's PLE module registers before its layer's GDN
            first = is_attn or isinstance(spec, PLEConvSpec)
            order[layer.name] = (layer.index, 0 if first else 1)
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
    # one layer's page, padding included: the slot stride of equal pages, the page a state takes
    # inside a packed block (whose slot stride is the block)
    page = group.page_bytes
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
    # always declares one prefill checkpoint block at alignment 1; GLM-5-Next's KDA one at 16
    # under FlashKDA; Qwen's GDN one when it exports FlashInfer checkpoints (align mode), on
    # the prefix-cache grid = the Mamba block size (get_mamba_prefill_checkpoint_grid without
    # --prefix-match-unit)
    checkpoint_blocks = rules.num_prefill_checkpoint_blocks
    checkpoint_alignment = None
    if checkpoint_blocks:
        checkpoint_alignment = rules.spec_checkpoint_alignment or block_size
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
        # Qwen4ExpPLELayer.is_kv_cache_tp_replicated: its conv state is whole on every rank
        "tp_replicated": isinstance(spec, PLEConvSpec),
    }
    return {"kind": "MambaSpec", **fields, "page_size_bytes": page}


def _multiple_of(base: int) -> dict[str, int]:
    """vLLM's ``MultipleOf(base)`` (``vllm/v1/attention/backend.py``) in the JSON."""
    return {"MultipleOf": base}


def _packed_attention_spec(plan: MemoryPlan, model: HybridModel, p: KVPlacement) -> dict:
    """One attention-side cache of a vLLM-format (packed) plan as vLLM 0.33 specs it."""
    if model.family_key in GLM5_NEXT_FAMILIES:
        return _glm5_attention_spec(plan, model, p)
    return _qwen4_attention_spec(plan, model, p)


def _spec_base(p: KVPlacement, *, max_tp_shards: int | None) -> dict[str, Any]:
    """The ``AttentionSpec`` fields every attention-side cache of a vLLM-format plan starts
    from, at the values its layers give them (the family's function overrides some)."""
    return {
        "block_size": p.block_size,
        "dcp_sharded": True,
        "block_stride_alignment": None,
        "is_draft": False,
        "max_tp_shards": max_tp_shards,
        "num_kv_heads": p.num_kv_heads,
        "head_size": p.head_dim,
        "dtype": _torch_name(p.dtype),
        "head_size_v": 0,
        "kv_quant_mode": "NONE",
        "page_size_padded": None,
        "num_head_slots": None,
        "state_content_bytes": None,
        "tokens_per_state": p.tokens_per_state,
    }


#: ``MLAAttentionSpec``'s own fields as the indexer and latent caches of both families leave
#: them (GLM-5-Next's latent then sets its cache dtype, top-k buffer and group leader)
_MLA_FIELDS: dict[str, Any] = {
    "sliding_window": None,
    "attention_chunk_size": None,
    "non_causal": False,
    "cache_dtype_str": None,
    "topk_buffer_width": None,
    "alignment": None,
    "model_version": None,
    "cache_role": "SPARSE",
    "is_index_group_leader": False,
    "non_causal_multi_token_decode": False,
}


def _qwen4_attention_spec(plan: MemoryPlan, model: HybridModel, p: KVPlacement) -> dict:
    """One Qwen4-Exp attention-side cache of a vLLM-format plan as vLLM 0.33 specs it (every
    field not named here is the dataclass default, as these layers leave it; no backend of the
    model customises a spec or declares a fixed kernel block, so ``block_stride_alignment``
    stays None):

    - K/V (``Qwen4ExpQSAAttention.get_kv_cache_spec``): a ``FullAttentionSpec`` of the rank's
      KV heads, ``head_size_v = head_size``; fp8 is uint8 with ``FP8_PER_TENSOR``;
    - compressed keys (``QSACompressedKeyCache.get_kv_cache_spec``): an ``MLAAttentionSpec`` of
      one head of ``indexer_head_dim`` with ``tokens_per_state = indexer_compress_ratio``, in
      bf16 or, under ``indexer_kv_dtype`` fp8, ``torch.float8_e4m3fn`` (no scales, no
      ``cache_dtype_str``), ``cache_role`` the default ``SPARSE``;
    - ring (``QSAKeyStateCache.get_kv_cache_spec``): a ``CircularBufferSpec`` of the ring's
      slots, one bf16 head of the key (and MRoPE positions), ``head_size_v`` 0.
    """
    base = _spec_base(p, max_tp_shards=None)
    if p.kind == "indexer_ring":
        kind = "CircularBufferSpec"
    elif p.kind == "indexer":
        kind = "MLAAttentionSpec"
        if canonical_dtype(p.dtype).startswith("fp8"):
            base["dtype"] = "torch.float8_e4m3fn"  # QSAIndexer: e4m3 bytes, not uint8
        base.update(_MLA_FIELDS)
    else:
        kind = "FullAttentionSpec"
        fp8 = canonical_dtype(p.dtype).startswith("fp8")
        base.update(
            head_size_v=p.head_dim_v,
            kv_quant_mode="FP8_PER_TENSOR" if fp8 else "NONE",
            sliding_window=None,
            attention_chunk_size=None,
            non_causal=False,
        )
    # AttentionSpec.page_size_bytes: heads x states x (head_size + head_size_v) x dtype size
    rows = base["block_size"] // base["tokens_per_state"]
    page = base["num_kv_heads"] * rows * (base["head_size"] + base["head_size_v"])
    page *= dtype_bytes(p.dtype)
    if page != p.k_bytes_per_block + p.v_bytes_per_block:  # pragma: no cover - plan vs spec
        raise AssertionError(
            f"{p.layer}: vLLM's page {page} B, the plan's "
            f"{p.k_bytes_per_block + p.v_bytes_per_block} B"
        )
    return {"kind": kind, **base, "page_size_bytes": page}


def _glm5_attention_spec(plan: MemoryPlan, model: HybridModel, p: KVPlacement) -> dict:
    """One GLM-5-Next attention-side cache of a vLLM-format plan as vLLM 0.33 specs it.

    - latent (``MLAAttention.get_kv_cache_spec`` in
      ``vllm/model_executor/layers/attention/mla_attention.py``, then
      ``FlashInferMLASparseSM90Backend.customize_spec``): one head of the latent,
      ``topk_buffer_width`` the model's top-k buffer (``get_sparse_topk_buffer_width``:
      ``index_topk + index_kpool - 1`` rounded up to 128), ``is_index_group_leader`` (its layer
      has an indexer), ``block_stride_alignment`` one latent row (``align_blocks_to_rows``);
    - indexer keys (``DeepseekV32IndexerCache.get_kv_cache_spec`` with ``Glm5NextIndexerCache``'s
      ``tokens_per_state``): one uint8 head of the entry's bytes, ``cache_role`` ``INDEXER``,
      ``block_stride_alignment`` ``MultipleOf`` of ``Glm5NextIndexerBackend``'s largest kernel
      block (``customize_attention_spec`` in ``vllm/v1/worker/utils.py``);
    - tail ring (``Glm5NextTailCache.get_kv_cache_spec``): a ``CircularBufferSpec`` of the ring's
      slots, two bf16 heads (key, gate score), not DCP-sharded.
    """
    spec = model.layer(p.layer.removesuffix(".ring")).spec
    base = _spec_base(p, max_tp_shards=1)
    if p.kind == "indexer_ring":
        kind = "CircularBufferSpec"
        base.update(dcp_sharded=False, max_tp_shards=None)
    elif p.kind == "indexer":
        assert isinstance(spec, IndexerSpec)
        kind = "MLAAttentionSpec"
        base.update(
            block_stride_alignment=_multiple_of(spec.pool_tokens * max(PAGED_MQA_PAGES)),
            dtype="torch.uint8",  # the Indexer's k_cache dtype, whatever --kv-cache-dtype says
            **_MLA_FIELDS,
        )
        base["cache_role"] = "INDEXER"
    else:
        assert isinstance(spec, MLASpec)
        kind = "MLAAttentionSpec"
        fp8 = canonical_dtype(p.dtype).startswith("fp8")
        base.update(
            block_stride_alignment=p.token_stride,
            kv_quant_mode="FP8_PER_TENSOR" if fp8 else "NONE",
            **_MLA_FIELDS,
        )
        base.update(
            cache_dtype_str=_cache_dtype_str(p.dtype, model.dtype),
            topk_buffer_width=-(-spec.sparse_topk // 128) * 128,
            is_index_group_leader=True,
        )
    # AttentionSpec.page_size_bytes: heads x states x (head_size + head_size_v) x dtype size
    rows = base["block_size"] // base["tokens_per_state"]
    size = 1 if base["dtype"] == "torch.uint8" else dtype_bytes(p.dtype)
    page = base["num_kv_heads"] * rows * (base["head_size"] + base["head_size_v"]) * size
    if page != p.k_bytes_per_block:  # pragma: no cover - the plan and the spec disagree
        raise AssertionError(
            f"{p.layer}: vLLM's page {page} B, the plan's {p.k_bytes_per_block} B"
        )
    return {"kind": kind, **base, "page_size_bytes": page}


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


def _layer_specs(spec: dict) -> list[dict]:
    """The per-layer specs a group's spec covers (``iter_layer_specs``)."""
    if spec["kind"] == "UniformTypeKVCacheSpecs":
        return list(spec["kv_cache_specs"].values())
    return [spec]


def _span(spec: dict, dcp: int) -> int:
    """Tokens a block of ``spec`` spans: its block size, times the DCP size where DCP shards it
    (``resolve_dcp_kv_block_size``)."""
    return spec["block_size"] * (dcp if spec["dcp_sharded"] else 1)


def _block_sizes(groups: list[dict], rules, dcp: int = 1) -> tuple[int, int]:
    """(hash_block_size, cache_hit_alignment_tokens) as the engine core resolves them
    (``resolve_kv_cache_block_sizes`` / ``resolve_cache_hit_alignment_tokens`` in
    ``vllm/v1/core/kv_cache_utils.py``, no ``--prefix-match-unit``), over the blocks' token spans
    under a decode context parallel size of ``dcp``. The hash block is the gcd of the
    prefix-cacheable groups' blocks: a ``CircularBufferSpec`` ring is not (``prefix_cacheable``
    is False), so GLM-5-Next's 16-slot rings do not shrink it."""
    sizes = [_span(g["kv_cache_spec"], dcp) for g in groups]
    if len(sizes) <= 1:
        return sizes[0], sizes[0]
    scheduler = math.lcm(*sizes)
    if not rules.enable_prefix_caching:
        return scheduler, scheduler
    mamba = [
        s for g in groups for s in _layer_specs(g["kv_cache_spec"]) if s["kind"] == "MambaSpec"
    ]
    if any(s["mamba_cache_mode"] != "align" for s in mamba):
        return scheduler, scheduler
    cacheable = [
        _span(g["kv_cache_spec"], dcp)
        for g in groups
        if all(s["kind"] != "CircularBufferSpec" for s in _layer_specs(g["kv_cache_spec"]))
    ]
    hash_block = math.gcd(*(cacheable or sizes))
    # partial (sub-block) hits need a Mamba block larger than the hash block, or as large under
    # DCP (which scales the attention blocks instead: partial_hash_hits_enabled)
    partial = any(
        s["block_size"] > hash_block or (dcp > 1 and s["block_size"] == hash_block) for s in mamba
    )
    return hash_block, hash_block if partial else scheduler


def kv_cache_config(plan: MemoryPlan, model: HybridModel) -> dict[str, Any]:
    """``plan`` as vLLM 0.33's ``KVCacheConfig``, a JSON-ready dict (see the module docstring).

    ``model`` is the model the plan was made for (configured for the same TP size and dtypes).
    Raises ``ValueError`` for a layout with more than one block pool (``per_group``,
    ``two_level``), a plan made under another vLLM version's rules, a family vLLM 0.33 does not
    serve (RecurrentGemma, Zamba v1, and Bamba and MiniMax-01, which vLLM removed in 0.23), and
    a GLM-5-Next or Qwen4-Exp plan in transformers' cache formats (plan it with
    ``VllmTarget(cache_formats="vllm")``).
    """
    _check_exportable(plan)
    if (model.name, model.tp_size, model.dcp_size) != (
        plan.model_name,
        plan.tp_size,
        plan.dcp_size,
    ):
        raise ValueError(
            f"the plan is for {plan.model_name} at TP {plan.tp_size} and DCP {plan.dcp_size}, "
            f"the model given is {model.name} at TP {model.tp_size} and DCP {model.dcp_size}"
        )
    names, order = _names_and_order(model)  # a family vLLM does not serve raises here
    if plan.kv_cache_layout is not None:
        return _packed_config(plan, model, names)
    if any(isinstance(layer.spec, IndexerSpec) for layer in model.layers):
        glm = model.family_key in GLM5_NEXT_FAMILIES
        reason = _TRANSFORMERS_INDEXER if glm else _TRANSFORMERS_QSA
        raise ValueError(reason.format(name=model.name))
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
            _group([names[name] for name in group.layers], spec, _is_eagle_group(plan, group))
        )
    layout = _BLOCK_OUTER_LAYOUT if packed else _LAYER_OUTER_LAYOUT
    return _config(plan, model, tensors, group_dicts, layout)


def _is_eagle_group(plan: MemoryPlan, group: KVCacheGroup) -> bool:
    """vLLM tags a group holding the drafter's layers only where it drops a block of every
    hit for them (``SpeculativeConfig.use_eagle_block_drop``: MTP with lookahead hashes
    disabled); with 0.33's lookahead hashes no group is tagged."""
    rules = plan.vllm
    return bool(rules is not None and rules.eagle_block_drop) and any(
        name.startswith(MTP_PREFIX) for name in group.layers
    )


def _group(names: list[str], spec: dict, eagle: bool = False) -> dict:
    return {
        "layer_names": names,
        "kv_cache_spec": spec,
        "is_eagle_group": eagle,
        "host_resident": False,
        "enable_kv_transfer": True,
        "role": "DEFAULT",
    }


def _config(
    plan: MemoryPlan, model: HybridModel, tensors: list[dict], groups: list[dict], layout: str
) -> dict[str, Any]:
    rules = plan.vllm
    assert rules is not None
    hash_block, hit_alignment = _block_sizes(groups, rules, plan.dcp_size)
    # kv_cache_groups_tp_replicas: gcd over layers of tp // max_tp_shards (1 for unset, Mamba,
    # and a layer DCP shards: its ranks then hold different tokens)
    replicas = model.tp_size
    for g in groups:
        for spec in _layer_specs(g["kv_cache_spec"]):
            shards = spec.get("max_tp_shards")
            if spec.get("dcp_sharded") and plan.dcp_size > 1:
                shards = None
            replicas = math.gcd(replicas, max(1, model.tp_size // shards) if shards else 1)
    return {
        "num_blocks": plan.pools[0].num_blocks,
        "kv_cache_tensors": tensors,
        "kv_cache_groups": groups,
        "prefix_cache_retention_interval": 0,
        "kv_cache_layout": layout,
        "hash_block_size": hash_block,
        "cache_hit_alignment_tokens": hit_alignment,
        "hisparse_host_num_blocks": None,
        "hisparse_host_block_stride": None,
        "hisparse_shared_host_pool": False,
        "kv_tp_replicas": replicas,
    }


#: why a GLM-5-Next plan in transformers' cache formats does not export
_TRANSFORMERS_INDEXER = (
    "{name}: this plan keeps GLM-5-Next's indexer in transformers' format (per-token key, gate "
    "score and flag rows riding in the latent's page: VllmTarget.cache_formats 'transformers', "
    "the default, which the e2e engine serves), but vLLM 0.33 keeps one fp8 entry of "
    "index_head_dim + 4 bytes per index_kpool tokens (Glm5NextIndexerCache) and a per-request "
    "bf16 tail ring (Glm5NextTailCache, vllm/models/glm5next/common/attention.py), packed with "
    "the latents and KDA states block-outermost (_get_packed_kv_cache_groups in "
    "vllm/v1/core/kv_cache_planning.py); plan with VllmTarget(cache_formats='vllm') (the "
    "command line's --cache-formats vllm, which --format vllm implies)"
)

#: why a Qwen4-Exp plan in transformers' cache formats does not export
_TRANSFORMERS_QSA = (
    "{name}: this plan keeps Qwen4-Exp's QSA indexer in transformers' format (one raw key per "
    "token riding in the attention's page: VllmTarget.cache_formats 'transformers', the "
    "default), but vLLM 0.33 keeps one compressed key per indexer_compress_ratio tokens "
    "(QSACompressedKeyCache, an MLAAttentionSpec with tokens_per_state > 1) and a per-request "
    "CircularBufferSpec ring of the open group's raw keys (QSAKeyStateCache, "
    "vllm/models/qwen4_exp/common/qsa_cache.py), packed with the K/V and the GDN and PLE states "
    "block-outermost (_get_packed_kv_cache_groups in vllm/v1/core/kv_cache_planning.py); plan "
    "with VllmTarget(cache_formats='vllm') (the command line's --cache-formats vllm, which "
    "--format vllm implies)"
)


def _packed_config(plan: MemoryPlan, model: HybridModel, names: dict[str, str]) -> dict[str, Any]:
    """A plan packed block-outermost (:attr:`MemoryPlan.kv_cache_layout`; GLM-5-Next in vLLM's
    cache formats, :mod:`hybridkv.layouts.vllm_packed`) as vLLM 0.33's ``KVCacheConfig``.

    Groups are the plan's, in the plan's order, which is vLLM's (``_get_packed_kv_cache_groups``
    emits its buckets in registration order); each is a ``UniformTypeKVCacheSpecs`` of its
    layers' specs, as that function builds every group. Tensors follow
    ``get_kv_cache_config_from_groups`` for a block-outermost layout: per group, one tensor per
    distinct layer spec in the order the specs first appear, ``layer_stride`` the spec's page,
    ``block_stride`` the block, ``offset`` where the plan put the spec's first page; each layer's
    page is checked to sit where the plan put it."""
    family = vllm_family(model)
    rules = plan.vllm
    assert rules is not None
    if plan.kv_cache_layout not in _PACKED_LAYOUTS:
        raise ValueError(
            f"{plan.model_name}: layout {plan.kv_cache_layout!r} is not one vLLM 0.33 packs "
            f"in ({', '.join(_PACKED_LAYOUTS)})"
        )
    placements = {p.layer: p for p in (*plan.kv_placements, *plan.state_placements)}
    model_layers = {layer.name for layer in model.layers}
    rings = {p.layer: p for p in plan.kv_placements if p.kind == "indexer_ring"}
    if set(placements) != model_layers | set(rings):
        raise ValueError(
            f"{plan.model_name}: the plan's placements do not cover the model's layers"
        )
    vllm_names = dict(names)
    for name, p in rings.items():
        vllm_names[name] = family.ring.format(i=p.layer_index)
    pool = plan.pools[0]
    size = pool.num_blocks * pool.block_bytes
    groups: list[dict] = []
    tensors: list[dict] = []
    for group in plan.groups:
        specs: dict[str, dict] = {}
        for name in group.layers:
            p = placements[name]
            if isinstance(p, StatePlacement):
                specs[name] = _mamba_spec(plan, model, replace(group, layers=(name,)))
            else:
                specs[name] = _packed_attention_spec(plan, model, p)
        first = specs[group.layers[0]]
        inner = {vllm_names[n]: s for n, s in specs.items()}
        groups.append(
            _group(
                [vllm_names[n] for n in group.layers],
                {
                    "kind": "UniformTypeKVCacheSpecs",
                    "block_size": first["block_size"],
                    "dcp_sharded": first["dcp_sharded"],
                    "block_stride_alignment": None,
                    "is_draft": False,
                    "kv_cache_specs": inner,
                    "page_size_bytes": sum(s["page_size_bytes"] for s in specs.values()),
                },
                _is_eagle_group(plan, group),
            )
        )
        # layers_by_spec: equal specs (the same dataclass values) share a tensor
        runs: dict[str, list[str]] = {}
        for name in group.layers:
            runs.setdefault(json.dumps(specs[name], sort_keys=True), []).append(name)
        offset = 0
        for members in runs.values():
            page = specs[members[0]]["page_size_bytes"]
            for k, name in enumerate(members):
                p = placements[name]
                start, stride = (
                    (p.offset, p.slot_stride)
                    if isinstance(p, StatePlacement)
                    else (p.k_offset, p.block_stride)
                )
                if (start, stride) != (offset + k * page, pool.block_bytes):
                    raise ValueError(
                        f"{plan.model_name}: {name} sits at byte {start} of a {stride}-byte "
                        f"block; vLLM puts it at {offset + k * page} of {pool.block_bytes}"
                    )
            tensors.append(
                {
                    "size": size,
                    "layers": [vllm_names[n] for n in members],
                    "layer_stride": page,
                    "block_stride": pool.block_bytes,
                    "offset": offset,
                    "host_resident": False,
                }
            )
            offset += len(members) * page
    return _config(plan, model, tensors, groups, plan.kv_cache_layout)


@dataclass(frozen=True)
class LoggedCapacity:
    """What vLLM 0.33 logs at start-up for a plan: ``GPU KV cache size: {tokens} tokens,
    Maximum concurrency for {max_model_len} tokens per request: {max_concurrency}x``
    (``update_kv_cache_capacity`` in ``vllm/v1/core/kv_cache_utils.py``).

    ``blocks_per_request``: the blocks one request at ``max_model_len`` takes from the shared
    pool, summed over the groups (``get_max_concurrency_for_kv_cache_config``): every attention
    group ``cdiv(max_model_len, block_size)``, every Mamba group its state blocks (``2 +
    speculative + prefill-checkpoint`` in ``align`` mode, ``1 + speculative`` otherwise:
    ``MambaSpec.max_memory_usage_bytes``), every ring group (GLM-5-Next's tail rings) one
    (``CircularBufferSpec.max_memory_usage_bytes``; a ``UniformTypeKVCacheSpecs`` group counts
    its layers' largest: ``max_memory_usage_pages``). So the logged tokens are not the pool's
    token slots: a model with many state groups and a short ``max_model_len`` logs far fewer."""

    tokens: int
    max_concurrency: float
    blocks_per_request: int
    attention_blocks_per_request: int
    state_blocks_per_request: int
    max_model_len: int
    num_blocks: int
    ring_blocks_per_request: int = 0


@dataclass(frozen=True)
class RequestBlocks:
    """The blocks one request of ``tokens`` tokens takes from vLLM 0.33's shared pool of
    ``num_blocks`` (the null block among them), per kind of group and in all (``total``)."""

    tokens: int
    num_blocks: int
    #: the block size of each attention group, one entry per group (they differ where
    #: --kv-cache-dtype-skip-layers made vLLM unify pages of two dtypes)
    attention_block_sizes: tuple[int, ...]
    state: int
    ring: int

    @property
    def attention(self) -> int:
        """The attention blocks of this request (``tokens`` tokens)."""
        return self.attention_blocks(self.tokens)

    @property
    def total(self) -> int:
        return self.attention + self.state + self.ring

    def attention_blocks(self, tokens: int) -> int:
        """The attention blocks a request of ``tokens`` tokens takes, by the same count."""
        return sum(-(-tokens // block) for block in self.attention_block_sizes)


def request_blocks(plan: MemoryPlan, model: HybridModel, tokens: int) -> RequestBlocks:
    """:class:`RequestBlocks` of a request of ``tokens`` tokens on ``plan`` (exportable: see
    :func:`kv_cache_config`), counted as ``get_max_concurrency_for_kv_cache_config`` counts a
    max_model_len request: every attention group ``cdiv(tokens, block_size)``, every Mamba
    group its state blocks, every ring group one. Raises ``ValueError`` for a sliding-window
    group: vLLM sizes those by its in-flight tokens (``max_in_flight_tokens``: the scheduler's
    batch times the steps in flight), which a plan does not know."""
    config = kv_cache_config(plan, model)
    rules = plan.vllm
    assert rules is not None  # kv_cache_config refuses a plan without vLLM rules
    state = ring = 0
    block_sizes: list[int] = []
    for group in config["kv_cache_groups"]:
        spec = group["kv_cache_spec"]
        kinds = {s["kind"] for s in _layer_specs(spec)}
        if kinds == {"MambaSpec"}:
            state += rules.state_blocks_per_request
        elif kinds == {"CircularBufferSpec"}:
            ring += 1
        elif kinds <= {"FullAttentionSpec", "MLAAttentionSpec"}:
            # under DCP a block spans dcp times its rows: cdiv(cdiv(n, dcp), rows) blocks, as
            # FullAttentionSpec.max_memory_usage_bytes counts them
            block_sizes.append(_span(spec, plan.dcp_size))
        else:
            raise ValueError(
                f"{plan.model_name}: a {'/'.join(sorted(kinds))} group's blocks per request "
                "depend on vLLM's in-flight tokens, which the plan does not model"
            )
    return RequestBlocks(tokens, config["num_blocks"], tuple(block_sizes), state, ring)


def logged_capacity(plan: MemoryPlan, model: HybridModel) -> LoggedCapacity:
    """:class:`LoggedCapacity` of ``plan`` (exportable: see :func:`kv_cache_config`) at the
    ``max_model_len`` its vLLM rules resolved. Raises ``ValueError`` where
    :func:`request_blocks` does, and without a max_model_len."""
    rules = plan.vllm
    max_len = rules.max_model_len if rules is not None else None
    if not max_len:
        raise ValueError(
            f"{plan.model_name}: no max_model_len (neither --max-model-len nor the model's "
            "max_position_embeddings): vLLM's logged capacity is per max_model_len request"
        )
    blocks = request_blocks(plan, model, max_len)
    concurrency = blocks.num_blocks / blocks.total
    return LoggedCapacity(
        tokens=int(concurrency * max_len),
        max_concurrency=concurrency,
        blocks_per_request=blocks.total,
        attention_blocks_per_request=blocks.attention,
        state_blocks_per_request=blocks.state,
        max_model_len=max_len,
        num_blocks=blocks.num_blocks,
        ring_blocks_per_request=blocks.ring,
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
    group order and the K/V order inside an attention page (vLLM's in a plan in vLLM's cache
    formats). (Block sizes, state blocks and the Mamba cache mode are vLLM's by construction:
    :mod:`hybridkv.target`.) A plan packed block-outermost (GLM-5-Next or Qwen4-Exp in vLLM's
    cache formats) is grouped, ordered and placed by :mod:`hybridkv.layouts.vllm_packed`'s port
    of vLLM's own packing, K/V order included: nothing is reported for it."""
    config = kv_cache_config(plan, model)
    # K then V inside a page (transformers' cache formats), where vLLM interleaves them
    planes = any(p.v_offset is not None and not p.interleaves_kv for p in plan.kv_placements)
    if plan.kv_cache_layout is not None:
        # grouped, ordered and placed by vllm_packed's port of vLLM's packing, which
        # interleaves K and V as vLLM does: nothing can differ
        return [_KV_ORDER_NOTE] if planes else []
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
    if planes:
        notes.append(_KV_ORDER_NOTE)
    return notes


#: the one way a K/V page's contents differ from vLLM's (in transformers' cache formats)
_KV_ORDER_NOTE = (
    "page contents: the plan keeps a layer's K as [tokens, heads, dim] then V likewise; "
    "vLLM 0.33's FlashAttention page is [tokens, heads, K dim | V dim] (logical "
    "[B, H, N, 2*D], split on the last dim), so K and V interleave per token and head "
    "(a plan in vLLM's cache formats, cache_formats='vllm', lays them out so)"
)


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
        from vllm.v1.attention.backend import MultipleOf
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
        # an int, or {"MultipleOf": base}
        "block_stride_alignment": lambda v: (
            MultipleOf(v["MultipleOf"]) if isinstance(v, dict) else v
        ),
    }

    def build(raw: dict, where: str):
        raw = dict(raw)
        kind = raw.pop("kind")
        page = raw.pop("page_size_bytes")
        kwargs = {k: enums[k](v) if k in enums and v is not None else v for k, v in raw.items()}
        if kind == "UniformTypeKVCacheSpecs":
            kwargs["kv_cache_specs"] = {
                name: build(inner, name) for name, inner in raw["kv_cache_specs"].items()
            }
        spec = getattr(kvi, kind)(**kwargs)
        if spec.page_size_bytes != page:
            raise AssertionError(
                f"{kind} of {where}: vLLM computes page_size_bytes {spec.page_size_bytes}, the "
                f"export says {page}"
            )
        return spec

    groups = []
    for g in data["kv_cache_groups"]:
        spec = build(g["kv_cache_spec"], g["layer_names"][0])
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
