"""GLM-5-Next as vLLM 0.33 lays it out: latent, key, ring and state pages packed block-outermost.

``inflate`` is vLLM's layout; for GLM-5-Next in vLLM's cache formats
(``VllmTarget(cache_formats="vllm")``) vLLM's layout is not equal pages but a packing, which this
module plans. What vLLM 0.33 builds, from its source:

- **Caches** (one decoder layer ``i`` at a time, in the order the layers register in
  ``static_forward_context``): a KDA layer's state (``Glm5NextLinearAttention``, a
  ``MambaSpec``); an MLA layer's indexer key cache (``Glm5NextIndexerCache``: an
  ``MLAAttentionSpec`` of one uint8 head of ``index_head_dim + index_head_dim // 128 * 4`` bytes,
  the fp8 key and its float32 scale, with ``tokens_per_state = index_kpool``: one entry per
  k-pool), its tail ring (``Glm5NextTailCache``: a ``CircularBufferSpec`` of ``ring =
  index_kpool * next_power_of_2(cdiv(index_kpool + num_speculative_tokens, index_kpool))``
  slots, two bf16 heads of ``index_head_dim``, the raw key and the gate score, one block per
  request), then its latent (``MLAAttention``). All in ``vllm/models/glm5next/common/
  attention.py`` and ``kda.py``; the indexer is built on every MLA layer (``Glm5NextMLAAttention``
  ignores transformers' ``indexer_types``).
- **Pages**: latent ``block * (kv_lora_rank + qk_rope_head_dim) * dtype``; indexer ``block /
  index_kpool`` entries; ring ``2 * ring * index_head_dim * 2``; state padded to the latent page
  (``Platform._align_hybrid_block_size``, which also sets the block: :mod:`hybridkv.target`).
- **Layout**: ``KpoolTailBackend.supported_kv_cache_layouts`` is ``(BLHNC,)`` and no other
  backend of the model declares any (``vllm/v1/attention/backends/mla/indexer.py``), so
  ``resolve_kv_cache_layout`` (``vllm/v1/attention/backends/utils.py``) picks ``BLHNC``: the block
  is outermost and one block id is one run of bytes holding every layer's page of a group.
- **Groups** (``_get_packed_kv_cache_groups`` in ``vllm/v1/core/kv_cache_planning.py``, taken
  because the layout is block-outermost and the pages differ): layers go, in registration
  order, into the first bucket they are uniform with (``UniformTypeKVCacheSpecs.is_uniform_type``:
  the same base type, block size and DCP sharding), so the indexer keys and the latents share a
  bucket (both ``FullAttentionSpec``-based), the rings have one and the KDA states one. A bucket
  whose page sizes come in equal numbers is a repeated pattern; the repeats per group are the
  ``_approximate_gcd`` (least padding, ties to the larger) of the balanced buckets' counts, at
  least the largest mixed bucket's; each group of a state bucket (Mamba, ring) holds at most the
  states a block of the widest other group fits (``anchor_bytes``).
- **Bytes per block** (``_get_kv_cache_bytes_per_block``, block-outermost): the largest group's
  pages, rounded up to the lcm of every layer's ``get_block_stride_alignment()``: the latent's
  row (``FlashInferMLASparseSM90Backend.customize_spec`` / ``align_blocks_to_rows``, the backend
  Hopper picks for a 512-wide NoPE latent in ``_get_backend_priorities``), and the indexer's page
  at its kernel block (``customize_attention_spec`` in ``vllm/v1/worker/utils.py`` gives it
  ``MultipleOf(64 * index_kpool)``, and a block that is not one kernel block is split into
  ``gcd(64 * index_kpool, block)``-token ones), 1 for the rest.
- **Placement** (``get_kv_cache_config_from_groups``): every group aliases the same blocks from
  byte 0; inside a block a group's layers sit back to back, the layers of one spec together in
  the group's order, each ``page`` after the last.

The plan: one tensor (vLLM's one backing allocation of ``num_blocks * bytes_per_block``), one
shared pool, the groups in vLLM's order (their kinds ``state``, ``mla`` for the latents with
their indexer keys, ``indexer_ring``), a :class:`~hybridkv.plan.KVPlacement` per latent, per
indexer (``tokens_per_state = index_kpool``, rows of the entry's bytes) and per ring (named
``{indexer layer}.ring``), a :class:`~hybridkv.plan.StatePlacement` per KDA layer, all with
``block_stride`` / ``slot_stride`` the block and ``kv_cache_layout = "BLHNC"``. Capacity: state
and ring groups hold ids per request (``state_slots_per_seq`` per state group, one per ring
group: ``CircularBufferSpec.max_num_blocks_per_req``), the latent group the rest.

Refused, with the reason: vLLM 0.32 (its rules for this family are not modelled), Ampere (no
sparse MLA backend of vLLM 0.33 takes SM80), a layer with
``indexer_types`` ``shared`` (vLLM gives it an indexer cache that the model does not have),
``index_kpool_always_select_tail`` false (``_validate_supported_config`` refuses it), a ring that
does not divide the block (``Glm5NextTailCache.get_kv_cache_spec`` asserts), a
``kernel_alignment`` override (vLLM's backends fix the kernel blocks).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from ..dtypes import dtype_bytes
from ..models.model import CacheLayer, HybridModel
from ..plan import (
    Capacity,
    KVCacheGroup,
    KVPlacement,
    MemoryPlan,
    PlanConfig,
    PoolPlan,
    StatePlacement,
    TensorPlan,
)
from ..specs import INDEXER_FP8_BLOCK, IndexerSpec, KDASpec, MLASpec
from ..target import GLM5_NEXT_FAMILIES, PAGED_MQA_PAGES, VllmRules
from ._common import (
    cdiv,
    round_up,
    state_components,
    state_placement,
    state_reservation,
    too_small,
)

__all__ = ["BLOCK_OUTERMOST_LAYOUT", "plan_vllm_packed", "uses_vllm_packing"]

#: the KV cache layout vLLM 0.33 resolves for GLM-5-Next (``KpoolTailBackend``'s only one)
BLOCK_OUTERMOST_LAYOUT = "BLHNC"
#: the one backing allocation of a packed plan
_TENSOR = "kv_cache"
#: ``Glm5NextTailCache``: two head slots per ring slot, the raw key and the gate score, in bf16
_RING_HEADS = 2
_RING_DTYPE = "bfloat16"
#: the indexer entry is fp8 key bytes and float32 scales, which vLLM views as uint8; hybridkv's
#: one-byte dtype name stands for it
_ENTRY_DTYPE = "fp8_e4m3"


def uses_vllm_packing(model: HybridModel, target_cache_formats: str) -> bool:
    """Whether ``inflate`` plans ``model`` with :func:`plan_vllm_packed`: GLM-5-Next with a
    sparse-attention indexer, in vLLM's cache formats. (Without an indexer, vLLM 0.33 builds
    GLM-5-Next's latent and KDA pages equal, the plain ``inflate``.)"""
    return (
        target_cache_formats == "vllm"
        and (model.family or "").strip().lower() in GLM5_NEXT_FAMILIES
        and any(isinstance(layer.spec, IndexerSpec) for layer in model.layers)
    )


def ring_slots(kpool: int, num_spec_tokens: int) -> int:
    """``Glm5NextTailCache``'s ring: the open k-pool plus the speculative tokens, in whole
    k-pools, rounded up to a power of two of them."""
    pools = cdiv(kpool + num_spec_tokens, kpool)
    return kpool * (1 << (pools - 1).bit_length())


def indexer_entry_bytes(spec: IndexerSpec) -> int:
    """Bytes of one k-pooled indexer entry (``Indexer`` in vLLM's GLM-5-Next attention.py): the
    fp8 key and one float32 scale per 128 elements."""
    return spec.index_head_dim + spec.index_head_dim // INDEXER_FP8_BLOCK * 4


@dataclass(frozen=True)
class _Cache:
    """One cache vLLM allocates: a KDA state, or an MLA layer's indexer keys, ring or latent.

    ``base`` is what ``UniformTypeKVCacheSpecs.is_uniform_type`` groups by (the registered
    uniform-type base class: ``full`` for both MLA specs, ``ring``, ``mamba``); ``alignment`` is
    ``get_block_stride_alignment()``."""

    name: str
    layer: CacheLayer
    part: str  # "state" | "indexer" | "ring" | "latent"
    base: str
    block_size: int
    dcp_sharded: bool
    page: int
    alignment: int


def _approximate_gcd(values: list[int], lower_bound: int) -> int:
    """The chunk ``d >= lower_bound`` that rounds ``values`` up with the least padding, ties to
    the larger ``d`` (vLLM's ``_approximate_gcd``)."""
    best, best_pad = lower_bound, None
    for d in range(max(1, lower_bound), max(values) + 1):
        pad = sum(-x % d for x in values)
        if best_pad is None or pad <= best_pad:
            best, best_pad = d, pad
    return best


def _group_caches(caches: list[_Cache]) -> list[list[_Cache]]:
    """vLLM's ``_get_packed_kv_cache_groups`` on the caches (in registration order)."""
    buckets: list[list[_Cache]] = []
    for c in caches:
        for bucket in buckets:
            first = bucket[0]
            if (c.base, c.block_size, c.dcp_sharded) == (
                first.base,
                first.block_size,
                first.dcp_sharded,
            ):
                bucket.append(c)
                break
        else:
            buckets.append([c])

    def by_page(bucket: list[_Cache]) -> dict[int, list[_Cache]]:
        out: dict[int, list[_Cache]] = {}
        for c in bucket:
            out.setdefault(c.page, []).append(c)
        return out

    pages = [by_page(b) for b in buckets]
    balanced = [len({len(v) for v in p.values()}) == 1 for p in pages]
    most = [Counter(c.page for c in b).most_common(1)[0][1] for b in buckets]
    # a mixed, balanced bucket stays whole: its repeats are the floor for every group
    floor = max((m for m, p, ok in zip(most, pages, balanced) if ok and len(p) > 1), default=0)
    repeats = (
        _approximate_gcd([m for m, ok in zip(most, balanced) if ok], floor) if floor else None
    )

    def num_groups(i: int) -> int:
        return cdiv(most[i], repeats) if balanced[i] and repeats is not None else 1

    def is_state(bucket: list[_Cache]) -> bool:
        return bucket[0].base in ("mamba", "ring")

    def widest(i: int, n: int) -> int:
        return sum(cdiv(len(v), n) * page for page, v in pages[i].items())

    anchor = max(
        (widest(i, len(b) if is_state(b) else num_groups(i)) for i, b in enumerate(buckets)),
        default=0,
    )
    groups: list[list[_Cache]] = []
    for i, bucket in enumerate(buckets):
        n = num_groups(i)
        if anchor and is_state(bucket):
            per_block = max(anchor // bucket[0].page, 1)
            n = max(n, cdiv(len(bucket), per_block))
        if n == 1:
            groups.append(list(bucket))
            continue
        pattern = list(zip(*pages[i].values()))  # one repeat: a layer of each page size
        for k in range(n):
            groups.append([c for repeat in pattern[k::n] for c in repeat])
    return groups


def _check(model: HybridModel, config: PlanConfig, rules: VllmRules) -> None:
    if rules.target.version != "0.33":
        raise ValueError(
            f"cache_formats='vllm' lays {model.name} out as vLLM 0.33 packs it; vLLM "
            f"{rules.target.version}'s layout of GLM-5-Next is not modelled (use vllm_version "
            "0.33, or cache_formats='transformers')"
        )
    if rules.target.gpu != "hopper":
        raise ValueError(
            f"vLLM 0.33 does not serve GLM-5-Next on {rules.target.gpu}: none of its sparse "
            "MLA backends takes SM80 (FlashInferMLASparseSM90Backend, FlashAttnMLASparseBackend: "
            "SM90; FlashMLASparseBackend: SM90/SM100; supports_compute_capability in "
            "vllm/v1/attention/backends/mla/), so there is no vLLM layout to plan; use gpu "
            "'hopper', or cache_formats='transformers'"
        )
    if config.kernel_alignment is not None:
        raise ValueError(
            "kernel_alignment does not apply to GLM-5-Next in vLLM's cache formats: vLLM 0.33's "
            "backends fix its kernel blocks (FlashInfer's SM90 sparse MLA, Glm5NextIndexerBackend)"
        )
    mla = {layer.index for layer in model.layers if isinstance(layer.spec, MLASpec)}
    indexed = {layer.index for layer in model.layers if isinstance(layer.spec, IndexerSpec)}
    if mla != indexed:
        raise ValueError(
            f"{model.name}: MLA layers {sorted(mla - indexed)} keep no indexer cache here "
            "(indexer_types 'shared'), but vLLM 0.33 builds an Indexer with its key cache and "
            "tail ring on every MLA layer whenever index_topk is set (Glm5NextMLAAttention in "
            "vllm/models/glm5next/common/attention.py ignores indexer_types), so its layout has "
            "caches this model lacks; plan with cache_formats='transformers'"
        )
    if not all(isinstance(layer.spec, (MLASpec, IndexerSpec, KDASpec)) for layer in model.layers):
        raise ValueError(f"{model.name}: GLM-5-Next holds MLA, indexer and KDA caches only")
    hf = model.extra.get("hf_config")
    text = (hf.get("text_config") or hf) if isinstance(hf, dict) else {}
    if isinstance(text, dict) and text.get("index_kpool_always_select_tail") is False:
        raise ValueError(
            f"{model.name}: index_kpool_always_select_tail is false, which vLLM 0.33 refuses to "
            "serve (_validate_supported_config in vllm/models/glm5next/common/model.py: its "
            "kernels always keep the open pool)"
        )
    kpools = {
        layer.spec.pool_tokens for layer in model.layers if isinstance(layer.spec, IndexerSpec)
    }
    if min(kpools) < 2:
        raise ValueError(
            f"{model.name}: index_kpool {min(kpools)}: vLLM 0.33's Glm5NextIndexerCache asserts "
            "index_kpool > 1"
        )


def _caches(
    model: HybridModel,
    block: int,
    latent_bpt: int,
    state_page: int,
    mamba_block: int,
    num_spec: int,
) -> list[_Cache]:
    """Every cache vLLM 0.33 keeps for GLM-5-Next, in layer order (a layer's indexer before its
    latent, as vLLM registers them): KDA states, k-pooled indexer keys with their tail rings,
    latents, each with its page and the block-stride alignment its backend asks for."""
    caches: list[_Cache] = []
    for layer in sorted(model.layers, key=lambda c: (c.index, isinstance(c.spec, MLASpec))):
        spec = layer.spec
        if isinstance(spec, KDASpec):
            caches.append(
                _Cache(layer.name, layer, "state", "mamba", mamba_block, False, state_page, 1)
            )
        elif isinstance(spec, IndexerSpec):
            kpool = spec.pool_tokens
            entry = indexer_entry_bytes(spec)
            # MultipleOf(largest kernel block): a block that is not one kernel block is split
            # into gcd(kernel, block)-token ones, whose page the block stride must be a multiple of
            kernel = math.gcd(kpool * max(PAGED_MQA_PAGES), block)
            align = 1 if kernel == block else kernel // kpool * entry
            caches.append(
                _Cache(
                    layer.name,
                    layer,
                    "indexer",
                    "full",
                    block,
                    True,
                    block // kpool * entry,
                    align,
                )
            )
            ring = ring_slots(kpool, num_spec)
            if block % ring:
                raise ValueError(
                    f"{model.name}: the {ring}-slot tail ring does not divide the {block}-token "
                    "block, which vLLM 0.33 asserts (Glm5NextTailCache.get_kv_cache_spec)"
                )
            ring_page = _RING_HEADS * ring * spec.index_head_dim * dtype_bytes(_RING_DTYPE)
            caches.append(
                _Cache(f"{layer.name}.ring", layer, "ring", "ring", ring, False, ring_page, 1)
            )
        else:
            assert isinstance(spec, MLASpec)
            # align_blocks_to_rows: blocks a whole number of latent rows apart
            caches.append(
                _Cache(
                    layer.name,
                    layer,
                    "latent",
                    "full",
                    block,
                    True,
                    block * latent_bpt,
                    latent_bpt,
                )
            )
    return caches


def _lay_out(
    groups: list[list[_Cache]], block: int, num_blocks: int, block_bytes: int
) -> tuple[list[KVPlacement], list[StatePlacement], list[KVCacheGroup]]:
    """Each group's pages at their offsets inside a block (vLLM's
    ``get_kv_cache_config_from_groups``) and the plan's groups."""
    kv_placements: list[KVPlacement] = []
    state_placements: list[StatePlacement] = []
    plan_groups: list[KVCacheGroup] = []
    for gid, members in enumerate(groups):
        # get_kv_cache_config_from_groups: a group's layers of one spec together, in the order
        # each spec first appears, every page right after the last
        offset = 0
        for part in dict.fromkeys(c.part for c in members):
            for c in (c for c in members if c.part == part):
                _place(
                    c, gid, offset, block, num_blocks, block_bytes, kv_placements, state_placements
                )
                offset += c.page
        kind = {"state": "state", "ring": "indexer_ring"}.get(members[0].part, "mla")
        plan_groups.append(
            KVCacheGroup(
                group_id=gid,
                kind=kind,
                layers=tuple(c.name for c in members),
                pool="shared",
                block_size=members[0].block_size if kind == "indexer_ring" else block,
                page_bytes=max(c.page for c in members),
            )
        )
    return kv_placements, state_placements, plan_groups


def plan_vllm_packed(model: HybridModel, config: PlanConfig) -> MemoryPlan:
    """``inflate`` for GLM-5-Next in vLLM's cache formats: vLLM 0.33's packed layout (see the
    module docstring)."""
    rules = config.target.resolve(model)
    _check(model, config, rules)
    latents = [layer for layer in model.layers if isinstance(layer.spec, MLASpec)]
    indexers = {
        layer.index: layer for layer in model.layers if isinstance(layer.spec, IndexerSpec)
    }
    states = [layer for layer in model.layers if isinstance(layer.spec, KDASpec)]
    latent_bpt = latents[0].spec.bytes_per_token
    state_bytes = max((layer.spec.state_bytes for layer in states), default=0)
    rule = rules.block_size(config.block_size, latent_bpt, state_bytes)
    block = rule.block_size
    attn_page = block * latent_bpt
    # Platform._align_hybrid_block_size pads the state page to the latent page
    state_page = max(attn_page, state_bytes) if states else 0
    num_spec = max((layer.spec.num_spec_tokens for layer in states), default=0)
    mamba_block = block
    if rules.mamba_cache_mode != "align":
        if rules.max_model_len is None:
            raise ValueError(
                f"{model.name}: without prefix caching vLLM's Mamba block size is max_model_len, "
                "which neither the model nor the target gives; plan with "
                "VllmTarget(max_model_len=...) (--max-model-len)"
            )
        mamba_block = rules.max_model_len

    caches = _caches(model, block, latent_bpt, state_page, mamba_block, num_spec)
    groups = _group_caches(caches)
    widest = max(sum(c.page for c in g) for g in groups)
    alignment = math.lcm(*(c.alignment for c in caches))
    block_bytes = round_up(widest, alignment)
    num_blocks = config.memory_bytes // block_bytes
    tensor = TensorPlan(_TENSOR, num_blocks * block_bytes)

    kv_placements, state_placements, plan_groups = _lay_out(groups, block, num_blocks, block_bytes)

    capacity = _capacity(model, config, plan_groups, groups, num_blocks, block_bytes, block)
    pool = PoolPlan(
        name="shared",
        kind="shared",
        tensors=(_TENSOR,),
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        groups=tuple(g.group_id for g in plan_groups),
    )
    sizes = ", ".join(
        f"{g.kind} x{len(g.layers)} ({sum(c.page for c in m):,} B)"
        for g, m in zip(plan_groups, groups)
    )
    notes = [
        "vLLM 0.33's layout of GLM-5-Next (cache_formats='vllm'): indexer keys k-pooled "
        f"({indexer_entry_bytes(indexers[latents[0].index].spec)} B per "
        f"{indexers[latents[0].index].spec.pool_tokens} tokens) with a per-request tail ring, "
        "pages of different sizes packed block-outermost (BLHNC), every group aliasing each "
        f"block from byte 0: {sizes}",
        f"bytes per block: the widest group's {widest:,} B rounded up to {block_bytes:,} B, the "
        f"lcm {alignment:,} of the layers' block-stride alignments",
    ]
    if states and state_page > state_bytes:
        notes.append(
            f"state pages padded from {state_bytes} B to the latent page {state_page} B "
            f"({100 * (state_page - state_bytes) / state_bytes:.2f}%)"
        )
    return MemoryPlan(
        layout="inflate",
        model_name=model.name,
        config=config,
        tp_size=model.tp_size,
        kv_dtype=model.kv_dtype,
        block_size=block,
        tensors=(tensor,),
        pools=(pool,),
        groups=tuple(plan_groups),
        kv_placements=tuple(kv_placements),
        state_placements=tuple(state_placements),
        capacity=capacity,
        kernel_alignment=rule.unit,
        pack_size=1,
        notes=tuple(notes),
        block_size_rule=rule.text,
        vllm=rules,
        kv_cache_layout=BLOCK_OUTERMOST_LAYOUT,
        extra={
            "page_bytes": attn_page,
            "block_bytes": block_bytes,
            "max_state_bytes": state_bytes,
        },
    )


def _place(
    c: _Cache,
    gid: int,
    offset: int,
    block: int,
    num_blocks: int,
    block_bytes: int,
    kv_placements: list[KVPlacement],
    state_placements: list[StatePlacement],
) -> None:
    """The placement of cache ``c`` at ``offset`` bytes into every block."""
    layer, spec = c.layer, c.layer.spec
    if c.part == "state":
        comps, _ = state_components(spec)  # MambaBase.bind_kv_cache: back to back
        state_placements.append(
            state_placement(layer, gid, _TENSOR, num_blocks, offset, block_bytes, comps)
        )
        return
    common = dict(
        layer_index=layer.index,
        group_id=gid,
        tensor=_TENSOR,
        num_blocks=num_blocks,
        k_offset=offset,
        v_offset=None,
        head_dim_v=None,
        block_stride=block_bytes,
    )
    if c.part == "latent":
        row = spec.latent_dim * dtype_bytes(spec.kv_dtype)
        kv_placements.append(
            KVPlacement(
                layer=c.name,
                kind=spec.kind,
                dtype=spec.kv_dtype,
                block_size=block,
                num_kv_heads=1,
                head_dim=spec.latent_dim,
                token_stride=row,
                head_stride=row,
                **common,
            )
        )
    elif c.part == "indexer":
        entry = indexer_entry_bytes(spec)
        kv_placements.append(
            KVPlacement(
                layer=c.name,
                kind=spec.kind,
                dtype=_ENTRY_DTYPE,
                block_size=block,
                num_kv_heads=1,
                head_dim=entry,
                token_stride=entry,
                head_stride=entry,
                tokens_per_state=spec.pool_tokens,
                **common,
            )
        )
    else:
        # BLHNC: each head slot's ring slots together (the key's, then the gate score's)
        row = spec.index_head_dim * dtype_bytes(_RING_DTYPE)
        kv_placements.append(
            KVPlacement(
                layer=c.name,
                kind="indexer_ring",
                dtype=_RING_DTYPE,
                block_size=c.block_size,
                num_kv_heads=_RING_HEADS,
                head_dim=spec.index_head_dim,
                token_stride=row,
                head_stride=c.block_size * row,
                **common,
            )
        )


def _capacity(
    model: HybridModel,
    config: PlanConfig,
    plan_groups: list[KVCacheGroup],
    groups: list[list[_Cache]],
    num_blocks: int,
    block_bytes: int,
    block: int,
) -> Capacity:
    """Token capacity once ``max_num_seqs`` requests hold their ids: ``state_slots_per_seq``
    in every state group, one in every ring group; the token group(s) get the rest."""
    per_seq = state_reservation(config)
    state_ids = ring_ids = 0
    padding = 0
    for g, members in zip(plan_groups, groups):
        data = sum(
            sum(comp.nbytes for comp in state_components(c.layer.spec)[0])
            if c.part == "state"
            else c.page
            for c in members
        )
        if g.kind == "state":
            state_ids += per_seq
            padding += per_seq * (block_bytes - data)
        elif g.kind == "indexer_ring":
            ring_ids += config.max_num_seqs
            padding += config.max_num_seqs * (block_bytes - data)
    token_groups = [(g, m) for g, m in zip(plan_groups, groups) if g.kind == "mla"]
    reserved = state_ids + ring_ids
    remaining = num_blocks - 1 - reserved  # block 0 is the null block
    if remaining < len(token_groups):
        need = (1 + reserved + len(token_groups)) * block_bytes
        raise too_small(model, config, need, "vLLM 0.33's packed layout")
    token_blocks = remaining // len(token_groups)
    for _, members in token_groups:
        padding += token_blocks * (block_bytes - sum(c.page for c in members))
    kv_blocks = token_blocks * len(token_groups)
    # the padding-free ideal in vLLM's formats: the latents and k-pooled entries per token, once
    # the requests' states and rings are held
    state = per_seq * model.state_bytes_per_seq
    rings = config.max_num_seqs * sum(c.page for m in groups for c in m if c.part == "ring")
    kpool = max(c.layer.spec.pool_tokens for m in groups for c in m if c.part == "indexer")
    per_kpool_tokens = sum(
        c.page // block * kpool if c.part == "latent" else c.page * kpool // block
        for m in groups
        for c in m
        if c.part in ("latent", "indexer")
    )
    ideal = max(0, (config.memory_bytes - state - rings) * kpool // per_kpool_tokens)
    return Capacity(
        token_capacity=token_blocks * block,
        ideal_token_capacity=int(ideal),
        padding_bytes=int(padding),
        unusable_bytes=int(config.memory_bytes - (reserved + kv_blocks) * block_bytes),
        state_bytes=int(state),
        state_reserved_bytes=int(reserved * block_bytes),
        kv_reserved_bytes=int(kv_blocks * block_bytes),
    )
