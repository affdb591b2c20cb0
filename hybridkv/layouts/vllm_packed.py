"""GLM-5-Next and Qwen4-Exp as vLLM 0.33 lays them out: pages of different sizes packed
block-outermost.

``inflate`` is vLLM's layout; for a model whose sparse-attention indexer vLLM keeps in formats of
its own (``VllmTarget(cache_formats="vllm")``) vLLM's layout is not equal pages but a packing,
which this module plans. Two families have one; the packing is the same, their caches differ.

**GLM-5-Next** (``vllm/models/glm5next/common/attention.py``, ``kda.py``):

- **Caches** (one decoder layer ``i`` at a time, in the order the layers register in
  ``static_forward_context``): a KDA layer's state (``Glm5NextLinearAttention``, a
  ``MambaSpec``); an MLA layer's indexer key cache (``Glm5NextIndexerCache``: an
  ``MLAAttentionSpec`` of one uint8 head of ``index_head_dim + index_head_dim // 128 * 4``
  bytes, the fp8 key and its float32 scale, with ``tokens_per_state = index_kpool``: one entry
  per k-pool), its tail ring (``Glm5NextTailCache``: a ``CircularBufferSpec`` of ``ring =
  index_kpool * next_power_of_2(cdiv(index_kpool + num_speculative_tokens, index_kpool))``
  slots, two bf16 heads of ``index_head_dim``, the raw key and the gate score, one block per
  request), then its latent (``MLAAttention``). The indexer is built on every MLA layer
  (``Glm5NextMLAAttention`` ignores transformers' ``indexer_types``).
- **Pages**: latent ``block * (kv_lora_rank + qk_rope_head_dim) * dtype``; indexer ``block /
  index_kpool`` entries; ring ``2 * ring * index_head_dim * 2``; state padded to the latent page
  (``Platform._align_hybrid_block_size``, which also sets the block: :mod:`hybridkv.target`).
- **Layout**: ``KpoolTailBackend.supported_kv_cache_layouts`` is ``(BLHNC,)`` and no other
  backend of the model declares any (``vllm/v1/attention/backends/mla/indexer.py``), so
  ``resolve_kv_cache_layout`` (``vllm/v1/attention/backends/utils.py``) picks ``BLHNC``.
- **Alignment**: the latent's row (``FlashInferMLASparseSM90Backend.customize_spec`` /
  ``align_blocks_to_rows``, the backend Hopper picks for a 512-wide NoPE latent), and the
  indexer's page at its kernel block (``customize_attention_spec`` in
  ``vllm/v1/worker/utils.py`` gives it ``MultipleOf(64 * index_kpool)``, and a block that is not
  one kernel block is split into ``gcd(64 * index_kpool, block)``-token ones).

**Qwen4-Exp** (``vllm/models/qwen4_exp/nvidia/model.py``, ``qsa.py``, ``indexer_qsa.py``,
``ple_layer.py``, ``common/qsa_cache.py``):

- **Caches**, per decoder layer ``i``: the PLE conv state when ``i + 1`` is in
  ``ple_layer_ids`` (``Qwen4ExpPLELayer``: a ``MambaSpec`` of one short-conv state,
  ``SHORT_CONV``, ``tp_replicated``), then the mixer: a GDN state
  (``QwenGatedDeltaNetAttention``), or, on an ``indexed_attention`` layer, the QSA indexer's
  ring of raw keys (``QSAKeyStateCache``: a ``CircularBufferSpec`` of ``round_up(
  indexer_compress_ratio + num_speculative_tokens, indexer_compress_ratio)`` slots, one bf16
  head of ``indexer_head_dim``, widened by the three int64 MRoPE positions where the model uses
  MRoPE), its compressed keys (``QSACompressedKeyCache``: an ``MLAAttentionSpec`` of one head
  of ``indexer_head_dim`` with ``tokens_per_state = indexer_compress_ratio``, bf16, or fp8 e4m3
  without scales under ``indexer_kv_dtype`` fp8), then the gated GQA's K and V
  (``Qwen4ExpQSAAttention``: a ``FullAttentionSpec``). The PLE and GDN states are padded to the
  attention page; their specs differ in ``tp_replicated``, so they never share a bucket.
- **Layout**: the QSA caches' ``QSAStateBackend`` declares ``(BLNHC, BLHNC)`` and no other
  backend of the model declares any, so ``resolve_kv_cache_layout`` picks ``BLNHC``.
- **Alignment**: none; no backend of the model declares a fixed kernel block (the attention's
  ``MultipleOf(16)``, the QSA caches' ``MultipleOf(1)``), so every layer's
  ``get_block_stride_alignment()`` is 1.

Both:

- **Groups** (``_get_packed_kv_cache_groups`` in ``vllm/v1/core/kv_cache_planning.py``, taken
  because the layout is block-outermost and the pages differ): layers go, in registration
  order, into the first bucket they are uniform with (``UniformTypeKVCacheSpecs.is_uniform_type``:
  the same base type, block size and DCP sharding, and for Mamba specs the same page,
  speculative and checkpoint blocks and ``tp_replicated``), so the indexer keys share a bucket
  with the latents or K/V (all ``FullAttentionSpec``-based), the rings have one and the states
  one per spec. A bucket whose page sizes come in equal numbers is a repeated pattern; the
  repeats per group are the ``_approximate_gcd`` (least padding, ties to the larger) of the
  balanced buckets' counts, at least the largest mixed bucket's; each group of a state bucket
  (Mamba, ring) holds at most the states a block of the widest other group fits
  (``anchor_bytes``).
- **Bytes per block** (``_get_kv_cache_bytes_per_block``, block-outermost): the largest group's
  pages, rounded up to the lcm of every layer's ``get_block_stride_alignment()``.
- **Placement** (``get_kv_cache_config_from_groups``): every group aliases the same blocks from
  byte 0; inside a block a group's layers sit back to back, the layers of one spec together in
  the group's order, each ``page`` after the last.

The plan: one tensor (vLLM's one backing allocation of ``num_blocks * bytes_per_block``), one
shared pool, the groups in vLLM's order (their kinds ``state``, ``indexer_ring``, and ``mla``
for GLM-5-Next's latents with their indexer keys or ``full_attention`` for Qwen4-Exp's K/V with
its compressed keys), a :class:`~hybridkv.plan.KVPlacement` per latent or K/V, per indexer
(``tokens_per_state`` rows) and per ring (named ``{indexer layer}.ring``), a
:class:`~hybridkv.plan.StatePlacement` per state layer, all with ``block_stride`` /
``slot_stride`` the block and :attr:`~hybridkv.plan.MemoryPlan.kv_cache_layout` vLLM's layout.
Inside a K/V page K and V interleave per token and head, ``[tokens, heads, K | V]``, as vLLM's
``BLNHC`` page holds them (:attr:`~hybridkv.target.VllmTarget.interleaves_kv`). Capacity:
state and ring groups hold ids per request (``state_slots_per_seq`` per state group, one per
ring group: ``CircularBufferSpec.max_num_blocks_per_req``), the token group(s) the rest. The
allocator serves a ring group as vLLM's ``CircularBufferManager`` does
(:mod:`hybridkv.alloc.groups.ring`: one block per request, never cached, no part in hits), so
these plans simulate as well as export.

Refused, with the reason: vLLM 0.32 (its rules for these families are not modelled), a
``kernel_alignment`` override (vLLM's backends fix the kernel blocks). GLM-5-Next: Ampere (no
sparse MLA backend of vLLM 0.33 takes SM80), a layer with ``indexer_types`` ``shared`` (vLLM
gives it an indexer cache that the model does not have), ``index_kpool_always_select_tail``
false (``_validate_supported_config`` refuses it), a ring that does not divide the block
(``Glm5NextTailCache.get_kv_cache_spec`` asserts). Qwen4-Exp: a model dtype other than bf16 or
a KV cache dtype other than bf16 / fp8 e4m3 (``Qwen4ExpQSAAttention`` refuses them), a block
at model construction that ``indexer_compress_ratio`` does not divide (``_QSAStateCache``
raises) and a ring that does not divide the final block (``QSAKeyStateCache.get_kv_cache_spec``
asserts). Not modelled: the caches of an MTP draft model (speculative tokens are planned as
vLLM's n-gram proposer has them, with no draft layers).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from ..dtypes import canonical_dtype, dtype_bytes
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
from ..specs import (
    INDEXER_FP8_BLOCK,
    FullAttentionSpec,
    GatedDeltaNetSpec,
    IndexerSpec,
    KDASpec,
    MLASpec,
    PLEConvSpec,
)
from ..target import (
    GLM5_NEXT_FAMILIES,
    PAGED_MQA_PAGES,
    QWEN4_EXP_FAMILIES,
    BlockSizeRule,
    VllmRules,
    vllm_state_page_floor,
)
from ..vllm_families import find_vllm_family
from ._common import (
    cdiv,
    round_up,
    state_components,
    state_placement,
    state_reservation,
    too_small,
)

__all__ = [
    "BLOCK_OUTERMOST_LAYOUT",
    "BLOCK_OUTERMOST_LAYOUTS",
    "QWEN4_EXP_LAYOUT",
    "plan_vllm_packed",
    "qsa_ring_slots",
    "uses_vllm_packing",
]

#: the KV cache layout vLLM 0.33 resolves for GLM-5-Next (``KpoolTailBackend``'s only one)
BLOCK_OUTERMOST_LAYOUT = "BLHNC"
#: the one it resolves for Qwen4-Exp (``QSAStateBackend``'s first, no other backend declaring)
QWEN4_EXP_LAYOUT = "BLNHC"
#: the layouts a packed plan may have (block outermost, each page one run of bytes)
BLOCK_OUTERMOST_LAYOUTS = (BLOCK_OUTERMOST_LAYOUT, QWEN4_EXP_LAYOUT)
#: the one backing allocation of a packed plan
_TENSOR = "kv_cache"
#: ``Glm5NextTailCache``: two head slots per ring slot, the raw key and the gate score, in bf16
_RING_HEADS = 2
_RING_DTYPE = "bfloat16"
#: the indexer entry is fp8 key bytes and float32 scales, which vLLM views as uint8; hybridkv's
#: one-byte dtype name stands for it
_ENTRY_DTYPE = "fp8_e4m3"
#: ``QSAKeyStateCache``: with MRoPE, three int64 positions follow the key, the key padded to a
#: multiple of four bf16 (one int64)
_BF16_PER_INT64 = 4
_ROPE_AXES = 3


def uses_vllm_packing(model: HybridModel, target_cache_formats: str) -> bool:
    """Whether ``inflate`` plans ``model`` with :func:`plan_vllm_packed`: GLM-5-Next or Qwen4-Exp
    with a sparse-attention indexer, in vLLM's cache formats. (Without an indexer, vLLM 0.33
    builds their attention and state pages equal, the plain ``inflate``.)"""
    return (
        target_cache_formats == "vllm"
        and model.family_key in GLM5_NEXT_FAMILIES | QWEN4_EXP_FAMILIES
        and any(isinstance(layer.spec, IndexerSpec) for layer in model.layers)
    )


def ring_slots(kpool: int, num_spec_tokens: int) -> int:
    """``Glm5NextTailCache``'s ring: the open k-pool plus the speculative tokens, in whole
    k-pools, rounded up to a power of two of them."""
    pools = cdiv(kpool + num_spec_tokens, kpool)
    return kpool * (1 << (pools - 1).bit_length())


def qsa_ring_slots(ratio: int, num_spec_tokens: int) -> int:
    """``QSAKeyStateCache``'s ring: the open group plus the speculative tokens, rounded up to
    whole groups of ``indexer_compress_ratio`` (no power of two)."""
    return round_up(ratio + num_spec_tokens, ratio)


def indexer_entry_bytes(spec: IndexerSpec) -> int:
    """Bytes of one k-pooled indexer entry (``Indexer`` in vLLM's GLM-5-Next attention.py): the
    fp8 key and one float32 scale per 128 elements."""
    return spec.index_head_dim + spec.index_head_dim // INDEXER_FP8_BLOCK * 4


@dataclass(frozen=True)
class _Rows:
    """How an attention-side page is addressed: ``rows`` of ``num_heads`` heads of
    ``head_dim`` (and ``head_dim_v`` for a V beside each head's K, ``None`` for one cache),
    each row standing for ``tokens_per_state`` tokens; ``kind`` is the placement's kind."""

    kind: str
    dtype: str
    num_heads: int
    head_dim: int
    head_dim_v: int | None
    tokens_per_state: int
    token_stride: int
    head_stride: int


@dataclass(frozen=True)
class _Cache:
    """One cache vLLM allocates: a state, or an attention layer's latent / K-V, indexer keys or
    ring.

    ``uniform`` is what ``UniformTypeKVCacheSpecs.is_uniform_type`` groups by besides the block
    size and DCP sharding: the registered base type (``full`` for every ``FullAttentionSpec``,
    ``ring``, ``mamba``) and, for a Mamba spec, what ``MambaSpec.is_uniform_with_collection``
    compares; ``alignment`` is ``get_block_stride_alignment()``; ``rows`` addresses an
    attention-side page (None for a state)."""

    name: str
    layer: CacheLayer
    part: str  # "state" | "indexer" | "ring" | "latent" | "kv"
    uniform: tuple
    block_size: int
    dcp_sharded: bool
    page: int
    alignment: int
    rows: _Rows | None = None


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
            if (c.uniform, c.block_size, c.dcp_sharded) == (
                first.uniform,
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
        return bucket[0].uniform[0] in ("mamba", "ring")

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


def _check_common(model: HybridModel, config: PlanConfig, rules: VllmRules, what: str) -> None:
    if rules.target.version != "0.33":
        raise ValueError(
            f"cache_formats='vllm' lays {model.name} out as vLLM 0.33 packs it; vLLM "
            f"{rules.target.version}'s layout of {what} is not modelled (use vllm_version "
            "0.33, or cache_formats='transformers')"
        )
    if config.kernel_alignment is not None:
        raise ValueError(
            f"kernel_alignment does not apply to {what} in vLLM's cache formats: vLLM 0.33's "
            "backends fix its kernel blocks"
        )


def _check_glm5(model: HybridModel, config: PlanConfig, rules: VllmRules) -> None:
    _check_common(model, config, rules, "GLM-5-Next")
    if rules.target.gpu != "hopper":
        raise ValueError(
            f"vLLM 0.33 does not serve GLM-5-Next on {rules.target.gpu}: none of its sparse "
            "MLA backends takes SM80 (FlashInferMLASparseSM90Backend, FlashAttnMLASparseBackend: "
            "SM90; FlashMLASparseBackend: SM90/SM100; supports_compute_capability in "
            "vllm/v1/attention/backends/mla/), so there is no vLLM layout to plan; use gpu "
            "'hopper', or cache_formats='transformers'"
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
    text = _text_config(model)
    if text.get("index_kpool_always_select_tail") is False:
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


def _text_config(model: HybridModel) -> dict:
    hf = model.extra.get("hf_config")
    text = (hf.get("text_config") or hf) if isinstance(hf, dict) else {}
    return text if isinstance(text, dict) else {}


def _check_qwen4(model: HybridModel, config: PlanConfig, rules: VllmRules) -> None:
    _check_common(model, config, rules, "Qwen4-Exp")
    attn = {layer.index for layer in model.layers if isinstance(layer.spec, FullAttentionSpec)}
    indexed = {layer.index for layer in model.layers if isinstance(layer.spec, IndexerSpec)}
    if attn != indexed:  # pragma: no cover - the reader gives every indexed layer its indexer
        raise ValueError(
            f"{model.name}: attention layers {sorted(attn ^ indexed)} have no QSA indexer, but "
            "vLLM 0.33 builds Qwen4ExpQSAAttention (with its indexer caches) on every "
            "indexed_attention layer once indexer_n_heads is set"
        )
    # exact kinds: a sliding window (a FullAttentionSpec subclass) is not Qwen4-Exp's
    kinds = (FullAttentionSpec, IndexerSpec, GatedDeltaNetSpec, PLEConvSpec)
    if not all(type(layer.spec) in kinds for layer in model.layers):
        raise ValueError(
            f"{model.name}: Qwen4-Exp holds GQA, QSA indexer, GDN and PLE caches only"
        )
    if canonical_dtype(model.dtype or "bfloat16") != "bfloat16":
        raise ValueError(
            f"{model.name}: model dtype {model.dtype}: vLLM 0.33's Qwen4-Exp QSA runs in bf16 "
            "only (Qwen4ExpQSAAttention and QSAIndexer raise NotImplementedError otherwise); plan "
            "with a bfloat16 model, or cache_formats='transformers'"
        )
    attn_dtypes = {
        canonical_dtype(layer.spec.kv_dtype)
        for layer in model.layers
        if isinstance(layer.spec, FullAttentionSpec)
    }
    bad = attn_dtypes - {"bfloat16", "fp8_e4m3"}
    if bad:
        raise ValueError(
            f"{model.name}: KV cache dtype {sorted(bad)[0]}: vLLM 0.33's Qwen4-Exp QSA takes a "
            "bf16 or fp8 e4m3 K/V cache only (Qwen4ExpQSAAttention: 'requires a BF16 or "
            "FP8-e4m3 main KV cache'); use kv_dtype auto, bfloat16 or fp8"
        )
    start_block = config.block_size or 16
    for ratio in {
        layer.spec.pool_tokens for layer in model.layers if isinstance(layer.spec, IndexerSpec)
    }:
        if start_block % ratio:
            raise ValueError(
                f"{model.name}: indexer_compress_ratio {ratio} does not divide the block size "
                f"{start_block} vLLM 0.33 builds the model with (--block-size, default 16), "
                "which _QSAStateCache refuses ('QSA cache block size must be divisible by the "
                "compression ratio', vllm/models/qwen4_exp/common/qsa_cache.py); pass a "
                f"block size that is a multiple of {ratio}"
            )


def _glm5_caches(
    model: HybridModel, rules: VllmRules, config: PlanConfig
) -> tuple[list[_Cache], BlockSizeRule, int, int]:
    """Every cache vLLM 0.33 keeps for GLM-5-Next, in layer order (a layer's indexer before its
    latent, as vLLM registers them): KDA states, k-pooled indexer keys with their tail rings,
    latents, each with its page and the block-stride alignment its backend asks for. Returns
    the caches, the block, the padded state page and the unpadded state bytes."""
    latents = [layer for layer in model.layers if isinstance(layer.spec, MLASpec)]
    states = [layer for layer in model.layers if isinstance(layer.spec, KDASpec)]
    latent_bpt = latents[0].spec.bytes_per_token
    state_bytes = max((layer.spec.state_bytes for layer in states), default=0)
    rule = rules.block_size(config.block_size, latent_bpt, state_bytes)
    block = rule.block_size
    # Platform._align_hybrid_block_size pads the state page to the latent page
    state_page = max(block * latent_bpt, state_bytes) if states else 0
    num_spec = max((layer.spec.num_spec_tokens for layer in states), default=0)
    mamba_block = _mamba_block(model, rules, block)
    state_uniform = ("mamba", state_page, False)
    caches: list[_Cache] = []
    for layer in sorted(model.layers, key=lambda c: (c.index, isinstance(c.spec, MLASpec))):
        spec = layer.spec
        if isinstance(spec, KDASpec):
            caches.append(
                _Cache(
                    layer.name, layer, "state", state_uniform, mamba_block, False, state_page, 1
                )
            )
        elif isinstance(spec, IndexerSpec):
            kpool = spec.pool_tokens
            entry = indexer_entry_bytes(spec)
            # MultipleOf(largest kernel block): a block that is not one kernel block is split
            # into gcd(kernel, block)-token ones, whose page the block stride must be a multiple of
            kernel = math.gcd(kpool * max(PAGED_MQA_PAGES), block)
            align = 1 if kernel == block else kernel // kpool * entry
            rows = _Rows("indexer", _ENTRY_DTYPE, 1, entry, None, kpool, entry, entry)
            caches.append(
                _Cache(
                    layer.name,
                    layer,
                    "indexer",
                    ("full",),
                    block,
                    True,
                    block // kpool * entry,
                    align,
                    rows,
                )
            )
            ring = ring_slots(kpool, num_spec)
            if block % ring:
                raise ValueError(
                    f"{model.name}: the {ring}-slot tail ring does not divide the {block}-token "
                    "block, which vLLM 0.33 asserts (Glm5NextTailCache.get_kv_cache_spec)"
                )
            row = spec.index_head_dim * dtype_bytes(_RING_DTYPE)
            ring_page = _RING_HEADS * ring * row
            # BLHNC: each head slot's ring slots together (the key's, then the gate score's)
            rows = _Rows(
                "indexer_ring",
                _RING_DTYPE,
                _RING_HEADS,
                spec.index_head_dim,
                None,
                1,
                row,
                ring * row,
            )
            caches.append(
                _Cache(
                    f"{layer.name}.ring", layer, "ring", ("ring",), ring, False, ring_page, 1, rows
                )
            )
        else:
            assert isinstance(spec, MLASpec)
            row = spec.latent_dim * dtype_bytes(spec.kv_dtype)
            rows = _Rows(spec.kind, spec.kv_dtype, 1, spec.latent_dim, None, 1, row, row)
            # align_blocks_to_rows: blocks a whole number of latent rows apart
            caches.append(
                _Cache(
                    layer.name,
                    layer,
                    "latent",
                    ("full",),
                    block,
                    True,
                    block * latent_bpt,
                    latent_bpt,
                    rows,
                )
            )
    return caches, rule, state_page, state_bytes


def _mamba_block(model: HybridModel, rules: VllmRules, block: int) -> int:
    """vLLM's Mamba block: the attention block in align mode, ``max_model_len`` otherwise."""
    if rules.mamba_cache_mode == "align":
        return block
    if rules.max_model_len is None:
        raise ValueError(
            f"{model.name}: without prefix caching vLLM's Mamba block size is max_model_len, "
            "which neither the model nor the target gives; plan with "
            "VllmTarget(max_model_len=...) (--max-model-len)"
        )
    return rules.max_model_len


def _uses_mrope(model: HybridModel) -> bool:
    """Whether vLLM 0.33 runs ``model`` with MRoPE, which widens the QSA ring
    (``ModelConfig.uses_mrope``: an ``mrope_section`` in the rope parameters; the causal-LM class
    strips it, ``Qwen4ExpForCausalLMConfig``)."""
    # the wrapper keeps it (Qwen4ExpForConditionalGeneration; a config read from config.json
    # is the wrapper unless its architectures name the causal LM: vllm_families)
    vllm_family = find_vllm_family(model)
    if vllm_family is None or vllm_family.key != "qwen4_exp":
        return False
    text = _text_config(model)
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if isinstance(rope, dict) and rope.get("mrope_section"):
            return True
    return False


def qsa_key_width(model: HybridModel, spec: IndexerSpec) -> int:
    """Elements of one slot of ``QSAKeyStateCache``: the bf16 key, and where the model uses MRoPE
    three int64 positions after the key padded to whole int64s."""
    if not _uses_mrope(model):
        return spec.index_head_dim
    return round_up(spec.index_head_dim, _BF16_PER_INT64) + _ROPE_AXES * _BF16_PER_INT64


def _qwen4_caches(
    model: HybridModel, rules: VllmRules, config: PlanConfig
) -> tuple[list[_Cache], BlockSizeRule, int, int]:
    """Every cache vLLM 0.33 keeps for Qwen4-Exp, in registration order: per decoder layer the
    PLE conv state, then the GDN state, or the QSA ring of raw keys, the compressed keys and
    the GQA K/V. Returns the caches, the block rule, the padded state page (0: unpadded) and the
    largest state."""
    attn = [layer for layer in model.layers if isinstance(layer.spec, FullAttentionSpec)]
    states = [
        layer for layer in model.layers if isinstance(layer.spec, (GatedDeltaNetSpec, PLEConvSpec))
    ]
    attn_bpt = attn[0].spec.bytes_per_token
    # _align_hybrid_block_size sizes by the largest of get_mamba_specs_from_config: the GDN state
    # and the PLE conv state, whether or not a layer keeps the latter
    largest = max(
        max((layer.spec.state_bytes for layer in states), default=0),
        vllm_state_page_floor(model),
    )
    rule = rules.block_size(config.block_size, attn_bpt, largest)
    block = rule.block_size
    attn_page = block * attn_bpt
    # ... and pads every Mamba page to the attention page, unless that page is the largest
    # state already (then no page is padded)
    padded = attn_page if attn_page != largest else 0
    mamba_block = _mamba_block(model, rules, block)
    indexer_fp8 = rules.target.indexer_kv_dtype == "fp8"
    num_spec = max((layer.spec.num_spec_tokens for layer in states), default=0)
    rank = {PLEConvSpec: 0, GatedDeltaNetSpec: 1, IndexerSpec: 2, FullAttentionSpec: 4}
    caches: list[_Cache] = []
    for layer in sorted(model.layers, key=lambda c: (c.index, rank[type(c.spec)])):
        spec = layer.spec
        if isinstance(spec, (GatedDeltaNetSpec, PLEConvSpec)):
            page = padded or spec.state_bytes
            # MambaSpec.is_uniform_with_collection: the page and tp_replicated (the PLE conv is
            # whole on every rank) part the two; the checkpoint fields are alike
            uniform = ("mamba", page, isinstance(spec, PLEConvSpec))
            caches.append(_Cache(layer.name, layer, "state", uniform, mamba_block, False, page, 1))
        elif isinstance(spec, IndexerSpec):
            ratio = spec.pool_tokens
            ring = qsa_ring_slots(ratio, num_spec)
            if block % ring:
                raise ValueError(
                    f"{model.name}: the {ring}-slot QSA ring does not divide the {block}-token "
                    "block, which vLLM 0.33 asserts (QSAKeyStateCache.get_kv_cache_spec)"
                )
            width = qsa_key_width(model, spec)
            row = width * dtype_bytes(_RING_DTYPE)
            rows = _Rows("indexer_ring", _RING_DTYPE, 1, width, None, 1, row, row)
            caches.append(
                _Cache(
                    f"{layer.name}.ring", layer, "ring", ("ring",), ring, True, ring * row, 1, rows
                )
            )
            dtype = "fp8_e4m3" if indexer_fp8 else "bfloat16"
            row = spec.index_head_dim * dtype_bytes(dtype)
            rows = _Rows("indexer", dtype, 1, spec.index_head_dim, None, ratio, row, row)
            caches.append(
                _Cache(
                    layer.name,
                    layer,
                    "indexer",
                    ("full",),
                    block,
                    True,
                    block // ratio * row,
                    1,
                    rows,
                )
            )
        else:
            assert isinstance(spec, FullAttentionSpec)
            size = dtype_bytes(spec.kv_dtype)
            heads = spec.kv_heads_per_rank
            assert spec.head_dim_v is not None
            # vLLM's page: each token's and head's K, then its V (interleaves_kv)
            pair = (spec.head_dim + spec.head_dim_v) * size
            rows = _Rows(
                spec.kind, spec.kv_dtype, heads, spec.head_dim, spec.head_dim_v, 1,
                heads * pair, pair,
            )  # fmt: skip
            caches.append(
                _Cache(layer.name, layer, "kv", ("full",), block, True, attn_page, 1, rows)
            )
    return caches, rule, padded, largest


def _lay_out(
    groups: list[list[_Cache]], block: int, num_blocks: int, block_bytes: int, dcp: int
) -> tuple[list[KVPlacement], list[StatePlacement], list[KVCacheGroup]]:
    """Each group's pages at their offsets inside a block (vLLM's
    ``get_kv_cache_config_from_groups``) and the plan's groups; under a decode context
    parallel size ``dcp`` a sharded group's block spans ``dcp`` times its rows
    (``resolve_dcp_kv_block_size``), a ring's and a state's do not."""
    kv_placements: list[KVPlacement] = []
    state_placements: list[StatePlacement] = []
    plan_groups: list[KVCacheGroup] = []
    for gid, members in enumerate(groups):
        # get_kv_cache_config_from_groups: a group's layers of one spec together, in the order
        # each spec first appears, every page right after the last
        offset = 0
        for part in dict.fromkeys(c.part for c in members):
            for c in (c for c in members if c.part == part):
                _place(c, gid, offset, num_blocks, block_bytes, kv_placements, state_placements)
                offset += c.page
        parts = {c.part for c in members}
        if "state" in parts:
            kind = "state"
        elif "ring" in parts:
            kind = "indexer_ring"
        else:
            kind = "mla" if "latent" in parts else "full_attention"
        span = dcp if members[0].dcp_sharded else 1
        plan_groups.append(
            KVCacheGroup(
                group_id=gid,
                kind=kind,
                layers=tuple(c.name for c in members),
                pool="shared",
                block_size=(members[0].block_size if kind == "indexer_ring" else block) * span,
                page_bytes=max(c.page for c in members),
                dcp_size=span,
            )
        )
    return kv_placements, state_placements, plan_groups


def plan_vllm_packed(model: HybridModel, config: PlanConfig) -> MemoryPlan:
    """``inflate`` for GLM-5-Next or Qwen4-Exp in vLLM's cache formats: vLLM 0.33's packed
    layout (see the module docstring)."""
    rules = config.target.resolve(model)
    glm = model.family_key in GLM5_NEXT_FAMILIES
    if glm:
        _check_glm5(model, config, rules)
        caches, rule, state_page, state_bytes = _glm5_caches(model, rules, config)
        layout = BLOCK_OUTERMOST_LAYOUT
    else:
        _check_qwen4(model, config, rules)
        caches, rule, state_page, state_bytes = _qwen4_caches(model, rules, config)
        layout = QWEN4_EXP_LAYOUT
    block = rule.block_size
    groups = _group_caches(caches)
    widest = max(sum(c.page for c in g) for g in groups)
    alignment = math.lcm(*(c.alignment for c in caches))
    block_bytes = round_up(widest, alignment)
    num_blocks = config.memory_bytes // block_bytes
    tensor = TensorPlan(_TENSOR, num_blocks * block_bytes)

    kv_placements, state_placements, plan_groups = _lay_out(
        groups, block, num_blocks, block_bytes, model.dcp_size
    )

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
    indexer = next(c for c in caches if c.part == "indexer")
    ring = next(c for c in caches if c.part == "ring")
    assert indexer.rows is not None
    tokens = indexer.rows.tokens_per_state
    if glm:
        what = (
            "vLLM 0.33's layout of GLM-5-Next (cache_formats='vllm'): indexer keys k-pooled "
            f"({indexer.rows.token_stride} B per {tokens} tokens) with a per-request tail ring"
        )
    else:
        what = (
            "vLLM 0.33's layout of Qwen4-Exp (cache_formats='vllm'): QSA keys compressed "
            f"({indexer.rows.token_stride} B of {indexer.rows.dtype} per {tokens} tokens) with a "
            f"per-request ring of {ring.block_size} raw keys ({ring.page:,} B)"
        )
    notes = [
        f"{what}, pages of different sizes packed block-outermost ({layout}), every group "
        f"aliasing each block from byte 0: {sizes}",
        f"bytes per block: the widest group's {widest:,} B rounded up to {block_bytes:,} B, the "
        f"lcm {alignment:,} of the layers' block-stride alignments",
    ]
    if state_page and state_page > state_bytes:
        notes.append(
            f"state pages padded from {state_bytes} B to the "
            f"{'latent' if glm else 'attention'} page {state_page} B "
            f"({100 * (state_page - state_bytes) / state_bytes:.2f}%)"
        )
    if not glm and rules.num_speculative_blocks:
        notes.append(
            f"{rules.num_speculative_blocks} speculative tokens planned as vLLM's n-gram "
            "proposer has them: an MTP draft model's own caches (Qwen4ExpMTP) are not modelled"
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
        kv_cache_layout=layout,
        extra={
            "page_bytes": block
            * next(c for c in caches if c.part in ("latent", "kv")).page
            // block,
            "block_bytes": block_bytes,
            "max_state_bytes": state_bytes,
        },
    )


def _place(
    c: _Cache,
    gid: int,
    offset: int,
    num_blocks: int,
    block_bytes: int,
    kv_placements: list[KVPlacement],
    state_placements: list[StatePlacement],
) -> None:
    """The placement of cache ``c`` at ``offset`` bytes into every block."""
    layer = c.layer
    if c.part == "state":
        comps, _ = state_components(layer.spec)  # MambaBase.bind_kv_cache: back to back
        state_placements.append(
            state_placement(layer, gid, _TENSOR, num_blocks, offset, block_bytes, comps)
        )
        return
    rows = c.rows
    assert rows is not None
    # a K/V page: each row's and head's K, then its V (see the module docstring)
    v_at = None if rows.head_dim_v is None else offset + rows.head_dim * dtype_bytes(rows.dtype)
    kv_placements.append(
        KVPlacement(
            layer=c.name,
            layer_index=layer.index,
            kind=rows.kind,
            group_id=gid,
            tensor=_TENSOR,
            dtype=rows.dtype,
            block_size=c.block_size,
            num_blocks=num_blocks,
            num_kv_heads=rows.num_heads,
            head_dim=rows.head_dim,
            head_dim_v=rows.head_dim_v,
            k_offset=offset,
            v_offset=v_at,
            block_stride=block_bytes,
            token_stride=rows.token_stride,
            head_stride=rows.head_stride,
            tokens_per_state=rows.tokens_per_state,
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
    token_groups = [(g, m) for g, m in zip(plan_groups, groups) if not g.is_per_request]
    reserved = state_ids + ring_ids
    remaining = num_blocks - 1 - reserved  # block 0 is the null block
    if remaining < len(token_groups):
        need = (1 + reserved + len(token_groups)) * block_bytes
        raise too_small(model, config, need, "vLLM 0.33's packed layout")
    token_blocks = remaining // len(token_groups)
    for _, members in token_groups:
        padding += token_blocks * (block_bytes - sum(c.page for c in members))
    kv_blocks = token_blocks * len(token_groups)
    # the padding-free ideal in vLLM's formats: the per-token caches' bytes of a block (latents
    # or K/V, and the compressed or k-pooled indexer rows), once the states and rings are held;
    # under DCP a block's rows are one rank's share of dcp_size times the tokens
    state = per_seq * model.state_bytes_per_seq
    rings = config.max_num_seqs * sum(c.page for m in groups for c in m if c.part == "ring")
    per_block = sum(c.page for m in groups for c in m if c.part in ("latent", "kv", "indexer"))
    span = block * model.dcp_size
    ideal = max(0, (config.memory_bytes - state - rings) * span // per_block)
    return Capacity(
        token_capacity=token_blocks * span,
        ideal_token_capacity=int(ideal),
        padding_bytes=int(padding),
        unusable_bytes=int(config.memory_bytes - (reserved + kv_blocks) * block_bytes),
        state_bytes=int(state),
        state_reserved_bytes=int(reserved * block_bytes),
        kv_reserved_bytes=int(kv_blocks * block_bytes),
    )
