"""A hybrid model as the cache sees it: an ordered list of cache-holding layers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from ..dtypes import canonical_dtype, dtype_bytes
from ..specs import (
    AttentionSpec,
    FullAttentionSpec,
    IndexerSpec,
    InklingConvSpec,
    KDASpec,
    LayerSpec,
    MLASpec,
    RGLRUSpec,
    RWKV4Spec,
    SlidingWindowSpec,
    StateSpec,
    spec_from_dict,
    with_runtime,
)

__all__ = [
    "MTP_FAMILIES",
    "SKIP_SLIDING_WINDOW",
    "SPECULATIVE_METHODS",
    "CacheLayer",
    "HybridModel",
    "ParamCount",
]

#: name prefix of an MTP drafter's cache layers (``mtp.layers.{j}.attn``)
MTP_PREFIX = "mtp.layers."

#: ``speculative_method`` values: ``none`` (or a drafter that holds no KV cache of its own:
#: vLLM's ``ngram``, ``suffix``), ``mtp`` (the model's own MTP layers draft)
SPECULATIVE_METHODS = ("none", "mtp")

#: families whose vLLM 0.33 MTP drafter is modelled: each MTP decoder layer with attention
#: builds it as a full-attention layer of the model's own shape (``Qwen3NextMTP``:
#: ``Qwen3NextDecoderLayer(layer_type="full_attention")``; ``Qwen3_5MTP`` likewise;
#: ``NemotronHMTP``: a ``NemotronHMTPAttentionDecoderLayer`` per ``*`` of its pattern)
MTP_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text",
                "nemotron_h")  # fmt: skip


@dataclass(frozen=True)
class ParamCount:
    """Parameters of a model: ``total`` stored, ``active`` used per token (equal for dense
    models), and where the numbers come from (``"name"`` when the model's name is all we know:
    ``35B-A3B`` reads as 35e9 total, 3e9 active)."""

    total: float
    active: float
    source: str

    def __post_init__(self) -> None:
        if not 0 < self.active <= self.total:
            raise ValueError(f"need 0 < active <= total, got {self.active} / {self.total}")

    def to_dict(self) -> dict[str, Any]:
        """Zoo JSON form (whole numbers of parameters)."""
        return {"total": int(self.total), "active": int(self.active), "source": self.source}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParamCount:
        try:
            return cls(float(data["total"]), float(data["active"]), str(data["source"]))
        except (KeyError, TypeError):
            raise ValueError(
                f"params must be an object with total, active and source, got {data!r}"
            ) from None


@dataclass(frozen=True)
class CacheLayer:
    """One cache-holding mixer: ``name`` is unique in the model, ``index`` is the decoder layer.

    A decoder layer may hold two mixers (Falcon-H1 runs attention and Mamba-2 in parallel; Zamba2
    adds a shared attention block to some Mamba layers), or two caches of one mixer (GLM-5-Next's
    latent and its indexer's keys, ``layers.{i}.attn`` and ``layers.{i}.indexer``; Qwen4-Exp's GDN
    state and its PLE conv, ``layers.{i}.mixer`` and ``layers.{i}.ple``), hence names rather
    than indices.
    """

    name: str
    index: int
    spec: LayerSpec


@dataclass(frozen=True)
class HybridModel:
    """A model's cache-holding layers, with the runtime options they were resolved for.

    Build one with :func:`hybridkv.models.load` or :func:`hybridkv.models.from_hf_config`, then
    :meth:`configure` it for a TP size and cache dtypes.
    """

    name: str
    layers: tuple[CacheLayer, ...]
    num_hidden_layers: int
    dtype: str = "bfloat16"
    ssm_dtype_declared: str | None = None
    max_position_embeddings: int | None = None
    #: parameter counts (the zoo's ``params``; None for a model read from a config alone)
    params: ParamCount | None = None
    display_name: str = ""
    family: str = ""
    hf_repo: str = ""
    sources: tuple[str, ...] = ()
    verified: bool = False
    doubts: str = ""
    # runtime options the layer specs were built with
    tp_size: int = 1
    kv_dtype: str = "bfloat16"
    conv_dtype: str = "bfloat16"
    ssm_dtype: str = "bfloat16"
    num_spec_tokens: int = 0
    #: vLLM's ``--kv-cache-dtype-skip-layers`` as :meth:`configure` resolved it: the layer
    #: indices (and ``"sliding_window"``) whose attention keeps the model dtype under a
    #: quantized ``kv_dtype``; empty when every attention layer takes ``kv_dtype``
    kv_dtype_skip_layers: tuple[str, ...] = ()
    #: vLLM's ``--decode-context-parallel-size``: the TP ranks over which each attention
    #: layer's tokens are sharded (:meth:`configure`); a block of an attention group then spans
    #: ``dcp_size`` times the tokens one rank's page holds, states are not sharded
    dcp_size: int = 1
    #: vLLM's ``--cp-kv-cache-interleave-size`` under DCP: the consecutive tokens one rank keeps
    #: before the next rank takes its turn (1: token ``i`` on rank ``i % dcp_size``). It moves no
    #: byte of the plan; vLLM requires it to divide the block's rows and, for a k-pooled indexer,
    #: to cover whole pools (:meth:`configure`)
    cp_kv_cache_interleave_size: int = 1
    #: positions, in the model's MTP drafter, of its decoder layers that hold attention (and so a
    #: KV cache, of the model's full-attention shape), from the config (Qwen3-Next's
    #: ``num_nextn_predict_layers``, Qwen3.5's ``mtp_num_hidden_layers``, Nemotron-H's pattern);
    #: empty when the model has no MTP drafter hybridkv models. They hold a cache only with
    #: ``speculative_method="mtp"`` (:meth:`configure`): layers ``mtp.layers.{j}.attn``, decoder
    #: index ``num_hidden_layers + j``.
    mtp_attention_layers: tuple[int, ...] = ()
    speculative_method: str = "none"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError(f"model {self.name!r} has duplicate cache-layer names")
        if not self.layers:
            raise ValueError(f"model {self.name!r} has no cache-holding layers")

    # ---- views ------------------------------------------------------------------------------
    @cached_property
    def attention_layers(self) -> tuple[CacheLayer, ...]:
        return tuple(layer for layer in self.layers if isinstance(layer.spec, AttentionSpec))

    @cached_property
    def state_layers(self) -> tuple[CacheLayer, ...]:
        return tuple(layer for layer in self.layers if isinstance(layer.spec, StateSpec))

    @cached_property
    def kv_dtype_skipped_layers(self) -> tuple[CacheLayer, ...]:
        """The attention layers :attr:`kv_dtype_skip_layers` keeps at the model dtype (their KV
        is wider than ``kv_dtype``); empty without the flag."""
        skip = self.kv_dtype_skip_layers
        return tuple(layer for layer in self.attention_layers if _skipped(layer, skip))

    @property
    def is_hybrid(self) -> bool:
        return bool(self.attention_layers) and bool(self.state_layers)

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token adds to the KV cache of the TP rank that keeps it, over all
        attention layers (under DCP a rank keeps one token in :attr:`dcp_size`)."""
        return sum(layer.spec.bytes_per_token for layer in self.attention_layers)  # type: ignore[attr-defined]

    @cached_property
    def state_bytes_per_seq(self) -> int:
        """Bytes of one request's recurrent state on one TP rank, over all state layers."""
        return sum(layer.spec.state_bytes for layer in self.state_layers)  # type: ignore[attr-defined]

    @property
    def family_key(self) -> str:
        """``family`` as the family tables key it (HF ``model_type``: stripped, lower case;
        "" when not known)."""
        return (self.family or "").strip().lower()

    @cached_property
    def kernel_alignment(self) -> int:
        """Tokens an attention block must be a multiple of: the largest
        :attr:`~hybridkv.specs.AttentionSpec.kernel_alignment` of the attention layers (FlashMLA's
        64 for MLA, 16 otherwise and without attention layers)."""
        aligns = [layer.spec.kernel_alignment for layer in self.attention_layers]  # type: ignore[attr-defined]
        return max(aligns, default=16)

    @property
    def layer_kinds(self) -> dict[str, int]:
        kinds: dict[str, int] = {}
        for layer in self.layers:
            kinds[layer.spec.kind] = kinds.get(layer.spec.kind, 0) + 1
        return kinds

    def layer(self, name: str) -> CacheLayer:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"model {self.name!r} has no cache layer {name!r}")

    # ---- runtime options --------------------------------------------------------------------
    def configure(
        self,
        *,
        tp_size: int = 1,
        kv_dtype: str = "auto",
        conv_dtype: str = "auto",
        ssm_dtype: str = "auto",
        num_spec_tokens: int = 0,
        speculative_method: str = "none",
        kv_dtype_skip_layers: Sequence[str | int] = (),
        dcp_size: int = 1,
        cp_kv_cache_interleave_size: int = 1,
    ) -> HybridModel:
        """The same model on one rank of ``tp_size``, with cache dtypes resolved like vLLM.

        - ``num_spec_tokens`` (``--speculative-config``'s ``num_speculative_tokens``): tokens
          drafted per step, which lengthen the conv state (and add Mamba blocks in vLLM).
        - ``speculative_method``: ``none``, or ``mtp`` (vLLM's ``--speculative-config
          '{"method": "mtp", ...}'``): the drafter's MTP layers with attention
          (:attr:`mtp_attention_layers`) join the model's cache layers, as vLLM registers their
          KV caches beside the target model's (``is_draft`` specs, grouped with the equal
          target specs: ``get_kv_cache_spec`` in ``vllm/v1/worker/gpu_model_runner.py``).

        - ``kv_dtype`` (``--kv-cache-dtype``): ``auto`` is the model dtype; ``fp8`` is 1 byte.
        - ``kv_dtype_skip_layers`` (``--kv-cache-dtype-skip-layers``): decoder layer indices,
          and ``"sliding_window"`` for every sliding-window layer, whose attention (K and V, or
          an MLA latent) keeps the model dtype while the rest take ``kv_dtype``, as vLLM 0.33's
          ``Attention`` and ``MLAAttention`` read the flag. A sparse-attention indexer's keys
          keep ``kv_dtype`` (vLLM's indexer caches do not read it). An entry that names no
          attention layer, or a ``kv_dtype`` that quantizes nothing, is an error: the flag
          would not act.
        - ``conv_dtype`` (``--mamba-cache-dtype``): ``auto`` is the model dtype.
        - ``ssm_dtype`` (``--mamba-ssm-cache-dtype``): ``auto`` is the dtype the config declares
          (Qwen3.5's ``mamba_ssm_dtype``, Nemotron's ``mamba_ssm_cache_dtype``), else the conv
          dtype; KDA, RG-LRU and RWKV-4 WKV recurrent states default to float32, as their
          engines keep them (transformers' RWKV keeps num / den / max in float32).

        - ``dcp_size`` (``--decode-context-parallel-size``): decode context parallelism, which
          reuses the TP ranks to shard every attention layer's tokens instead of replicating
          its KV: a rank keeps one token in ``dcp_size`` (vLLM 0.33's ``dcp_sharded`` specs),
          its page the same bytes as without DCP, so a block spans ``dcp_size`` times the
          tokens; recurrent states are not sharded. vLLM's rules are checked: TP divisible by
          it; for grouped-query attention TP above the KV heads, ``dcp_size`` at most TP // KV
          heads and dividing the query heads per KV head (``ModelConfig``); full attention and
          MLA only beside the states (the hybrid coordinator's assertion; sliding windows and
          chunked local attention assert ``dcp_world_size == 1``). Sparse MLA with its
          indexer (GLM-5-Next's) is sharded like MLA: the latent and the k-pooled indexer keys
          (``dcp_sharded``), the indexer's per-request tail ring not (``CircularBufferSpec``,
          ``dcp_sharded=False``: every rank keeps the open pool), and vLLM's checks apply: its
          sparse-MLA backend under DCP is FlashMLA's (FlashInfer's SM90 sparse MLA has no DCP),
          which keeps a 512-wide latent in bfloat16 only, and the indexer's backend asks for an
          interleave covering whole k-pools. Qwen4-Exp's QSA is refused, as vLLM refuses it.
        - ``cp_kv_cache_interleave_size`` (``--cp-kv-cache-interleave-size``): the tokens a rank
          keeps in a row under DCP; any value other than 1 without DCP is an error (it would
          not act). A k-pooled indexer needs a multiple of its pool
          (``DeepseekV32IndexerMetadataBuilder``); the layouts check that it divides a block's
          rows (``VllmConfig.validate_block_size``).

        Inkling's short-conv states (``inkling_sconv``) resolve a conv ``auto`` to float32, not
        the model dtype: transformers, their only implementation, computes and keeps them in
        float32 whatever the model dtype.
        """
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
        kv = canonical_dtype(kv_dtype, auto=self.dtype, what="kv_dtype")
        conv = canonical_dtype(conv_dtype, auto=self.dtype, what="conv_dtype")
        ssm_auto = ssm_dtype.strip().lower() == "auto" if isinstance(ssm_dtype, str) else False
        conv_auto = conv_dtype.strip().lower() == "auto" if isinstance(conv_dtype, str) else False
        ssm = canonical_dtype(ssm_dtype, auto=self.ssm_dtype_declared or conv, what="ssm_dtype")
        cache_layers = self._with_drafter(speculative_method, num_spec_tokens)
        skip = _skip_layers(self, cache_layers, kv, kv_dtype_skip_layers)
        layers = []
        for layer in cache_layers:
            spec = layer.spec
            layer_ssm = ssm
            if ssm_auto and isinstance(spec, (KDASpec, RGLRUSpec, RWKV4Spec)):
                layer_ssm = "float32"
            layer_conv = "float32" if conv_auto and isinstance(spec, InklingConvSpec) else conv
            try:
                new_spec = with_runtime(
                    spec,
                    tp_size=tp_size,
                    kv_dtype=self.dtype if _skipped(layer, skip) else kv,
                    conv_dtype=layer_conv,
                    ssm_dtype=layer_ssm,
                    num_spec_tokens=num_spec_tokens,
                )
            except ValueError as exc:
                raise ValueError(f"{self.name}, layer {layer.name}: {exc}") from None
            layers.append(replace(layer, spec=new_spec))
        _check_dcp(self.name, layers, tp_size, dcp_size, cp_kv_cache_interleave_size)
        return replace(
            self,
            layers=tuple(layers),
            tp_size=tp_size,
            kv_dtype=kv,
            conv_dtype=conv,
            ssm_dtype=ssm,
            num_spec_tokens=num_spec_tokens,
            speculative_method=speculative_method,
            kv_dtype_skip_layers=skip,
            dcp_size=dcp_size,
            cp_kv_cache_interleave_size=cp_kv_cache_interleave_size,
        )

    @property
    def dcp_interleave_unit(self) -> int:
        """The tokens ``cp_kv_cache_interleave_size`` must be a multiple of under DCP: a k-pooled
        indexer's pool (each pooled key lives on one rank), 1 otherwise."""
        return _interleave_unit(self.layers)

    def largest_dcp_size(self) -> int:
        """The largest ``dcp_size`` vLLM 0.33's checks accept at this model's TP size (1 where
        none above 1 does): the ranks that keep copies of a KV head, or of MLA's latent; with
        an interleave of :attr:`dcp_interleave_unit` (the least a k-pooled indexer accepts)."""
        for size in range(self.tp_size, 1, -1):
            if self.tp_size % size == 0:
                try:
                    _check_dcp(
                        self.name, self.layers, self.tp_size, size, self.dcp_interleave_unit
                    )
                except ValueError:
                    continue
                return size
        return 1

    def _with_drafter(self, method: str, num_spec_tokens: int) -> list[CacheLayer]:
        """The target model's cache layers, and the MTP drafter's attention layers under
        ``method="mtp"`` (built from the target's full-attention spec, as vLLM builds them)."""
        target = [layer for layer in self.layers if not layer.name.startswith(MTP_PREFIX)]
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, got "
                f"{method!r} (a drafter with caches of its own, e.g. EAGLE's, is not modelled)"
            )
        if method == "none":
            return target
        if not self.mtp_attention_layers:
            raise ValueError(
                f"{self.name}: no MTP drafter is modelled for this model (family "
                f"{self.family or 'unknown'}; modelled: vLLM 0.33's MTP drafters of "
                f"{', '.join(MTP_FAMILIES)}, from the config's MTP layer count)"
            )
        if num_spec_tokens < 1:
            raise ValueError(
                f"{self.name}: speculative_method='mtp' drafts num_spec_tokens tokens a step; "
                "give at least 1 (vLLM's num_speculative_tokens)"
            )
        full = {layer.spec for layer in target if type(layer.spec) is FullAttentionSpec}
        if len(full) != 1:
            raise ValueError(
                f"{self.name}: the MTP layers take the model's full-attention shape, but it has "
                f"{len(full)} distinct full-attention specs"
            )
        (spec,) = full
        n = self.num_hidden_layers
        drafter = [
            CacheLayer(f"{MTP_PREFIX}{j}.attn", n + j, spec) for j in self.mtp_attention_layers
        ]
        return [*target, *drafter]

    # ---- (de)serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Zoo JSON form: mixers grouped by identical spec, with the layers that use them."""
        mixers: list[dict[str, Any]] = []
        for layer in self.layers:
            if layer.name.startswith(MTP_PREFIX):
                continue  # the drafter's, a runtime option (mtp_attention_layers says where)
            entry = layer.spec.to_dict()
            for mixer in mixers:
                if {k: v for k, v in mixer.items() if k != "layers"} == entry:
                    mixer["layers"].append(layer.index)
                    break
            else:
                mixers.append({**entry, "layers": [layer.index]})
        return {
            "name": self.name,
            "display_name": self.display_name,
            "family": self.family,
            "hf_repo": self.hf_repo,
            "num_hidden_layers": self.num_hidden_layers,
            "torch_dtype": self.dtype,
            "ssm_dtype_declared": self.ssm_dtype_declared,
            "max_position_embeddings": self.max_position_embeddings,
            **({"params": self.params.to_dict()} if self.params is not None else {}),
            **(
                {"mtp_attention_layers": list(self.mtp_attention_layers)}
                if self.mtp_attention_layers
                else {}
            ),
            "mixers": mixers,
            "sources": list(self.sources),
            "verified": self.verified,
            "doubts": self.doubts,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HybridModel:
        """Inverse of :meth:`to_dict`; errors name the missing or malformed field."""
        if not isinstance(data, dict):
            raise ValueError(
                f"a model description must be a JSON object, got {type(data).__name__}"
            )
        for key in ("name", "num_hidden_layers", "mixers"):
            if key not in data:
                raise ValueError(f"model description is missing {key!r}")
        name = data["name"]
        dtype = canonical_dtype(data.get("torch_dtype") or "bfloat16", what="torch_dtype")
        declared = data.get("ssm_dtype_declared")
        declared = canonical_dtype(declared, what="ssm_dtype_declared") if declared else None
        layers: list[CacheLayer] = []
        n = data["num_hidden_layers"]
        for mixer in data["mixers"]:
            mixer = dict(mixer)
            indices: Sequence[int] = mixer.pop("layers", None) or []
            if not indices:
                raise ValueError(f"model {name!r}: mixer {mixer.get('kind')!r} lists no layers")
            spec = spec_from_dict(
                mixer, kv_dtype=dtype, conv_dtype=dtype, ssm_dtype=declared or dtype
            )
            suffix = spec.suffix or ("attn" if isinstance(spec, AttentionSpec) else "mixer")
            for i in indices:
                if not 0 <= i < n:
                    raise ValueError(
                        f"model {name!r}: layer index {i} is outside 0..{n - 1} "
                        "(num_hidden_layers)"
                    )
                layers.append(CacheLayer(f"layers.{i}.{suffix}", i, spec))
        layers.sort(key=lambda layer: (layer.index, not isinstance(layer.spec, AttentionSpec)))
        model = cls(
            name=name,
            layers=tuple(layers),
            num_hidden_layers=n,
            dtype=dtype,
            ssm_dtype_declared=declared,
            max_position_embeddings=data.get("max_position_embeddings"),
            params=ParamCount.from_dict(data["params"]) if data.get("params") else None,
            display_name=data.get("display_name", name),
            family=data.get("family", ""),
            hf_repo=data.get("hf_repo", ""),
            sources=tuple(data.get("sources", ())),
            verified=bool(data.get("verified", False)),
            doubts=data.get("doubts", ""),
            mtp_attention_layers=_mtp_positions(name, data.get("mtp_attention_layers", [])),
        )
        return model.configure()

    def summary(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in self.layer_kinds.items())
        return f"{self.name}: {self.num_hidden_layers} layers ({kinds})"


#: the ``--kv-cache-dtype-skip-layers`` entry that names every sliding-window layer
SKIP_SLIDING_WINDOW = "sliding_window"


def _skippable(layer: CacheLayer) -> bool:
    """Whether vLLM's ``--kv-cache-dtype-skip-layers`` can keep ``layer``'s cache at the model
    dtype: an ``Attention`` (full or sliding window) or ``MLAAttention`` layer's."""
    return isinstance(layer.spec, (FullAttentionSpec, MLASpec))


def _check_dcp(
    name: str, layers: Sequence[CacheLayer], tp: int, dcp: int, interleave: int = 1
) -> None:
    """vLLM 0.33's checks of ``--decode-context-parallel-size`` against TP and the model's
    attention (``ParallelConfig``, ``ModelConfig.verify_with_parallel_config``, the hybrid
    coordinator, the sparse-attention backends) and of ``--cp-kv-cache-interleave-size``, and
    what hybridkv does not model under it."""
    if not isinstance(dcp, int) or isinstance(dcp, bool) or dcp < 1:
        raise ValueError(f"dcp_size must be a positive integer, got {dcp!r}")
    if not isinstance(interleave, int) or isinstance(interleave, bool) or interleave < 1:
        raise ValueError(
            f"cp_kv_cache_interleave_size must be a positive integer, got {interleave!r}"
        )
    if dcp == 1:
        if interleave != 1:
            raise ValueError(
                f"cp_kv_cache_interleave_size {interleave} spreads a context's tokens over decode "
                "context parallel ranks, and there are none (dcp_size 1): give "
                "--decode-context-parallel-size above 1, or leave the interleave at 1"
            )
        return
    if tp % dcp:
        raise ValueError(
            f"decode context parallel size {dcp} must divide the tensor-parallel size {tp}: "
            "DCP reuses the TP ranks (vLLM's ParallelConfig); use a TP size that is a multiple "
            f"of {dcp}"
        )
    attention = [layer for layer in layers if isinstance(layer.spec, AttentionSpec)]
    if not attention:
        raise ValueError(
            f"{name} has no attention layers: decode context parallelism shards attention KV, "
            f"so a decode context parallel size of {dcp} would shard nothing; use 1"
        )
    qsa = [
        layer
        for layer in attention
        if isinstance(layer.spec, FullAttentionSpec) and layer.spec.sparse_topk
    ]
    if qsa:
        raise ValueError(
            f"{name}: its sparse full attention (Qwen4-Exp's QSA, layer {qsa[0].name}) is not "
            'served under decode context parallelism: vLLM 0.33 raises "Qwen4Exp QSA does not '
            'support context parallelism" (vllm/models/qwen4_exp/nvidia/qsa.py); use a decode '
            "context parallel size of 1"
        )
    unsharded = sorted(
        {
            layer.spec.kind
            for layer in attention
            if type(layer.spec) not in (FullAttentionSpec, MLASpec, IndexerSpec)
        }
    )
    if unsharded:
        why = []
        if "sliding_window" in unsharded:
            why.append("vLLM 0.33's sliding-window manager asserts dcp_world_size == 1")
        if not why:
            why.append(
                "vLLM 0.33's hybrid coordinator allows only full attention, Mamba and replicated "
                "draft groups under DCP"
            )
        raise ValueError(
            f"{name}: decode context parallelism is modelled for full attention, MLA and sparse "
            f"MLA beside recurrent states, and this model has {', '.join(unsharded)} layers "
            f"({'; '.join(why)}); use a decode context parallel size of 1"
        )
    _check_sparse_mla_dcp(name, attention, interleave)
    gqa = [layer.spec for layer in attention if isinstance(layer.spec, FullAttentionSpec)]
    if any(isinstance(layer.spec, MLASpec) for layer in attention):
        return  # vLLM checks heads only where the model does not use MLA
    for heads, kv in {(s.num_heads, s.num_kv_heads) for s in gqa}:
        if tp <= kv:
            raise ValueError(
                f"{name}: decode context parallelism for grouped-query attention needs a "
                f"tensor-parallel size above the model's {kv} KV heads (TP {tp}): it shards the "
                "tokens of the KV heads TP would replicate (vLLM's ModelConfig); raise the TP "
                "size or use a decode context parallel size of 1"
            )
        if dcp > tp // kv:
            raise ValueError(
                f"{name}: decode context parallel size {dcp} exceeds {tp // kv}, the most for "
                f"TP {tp} and {kv} KV heads (TP // KV heads: vLLM's ModelConfig)"
            )
        if (heads // kv) % dcp:
            raise ValueError(
                f"{name}: the {heads // kv} query heads per KV head must be divisible by the "
                f"decode context parallel size {dcp} (vLLM's ModelConfig, for GQA/MQA)"
            )


def _interleave_unit(layers: Sequence[CacheLayer]) -> int:
    """The lcm of the k-pools of the k-pooled indexers among ``layers`` (1: none)."""
    pools = {
        layer.spec.pool_tokens
        for layer in layers
        if isinstance(layer.spec, IndexerSpec) and layer.spec.pool_tokens > 1
    }
    return math.lcm(*pools) if pools else 1


def _check_sparse_mla_dcp(name: str, attention: Sequence[CacheLayer], interleave: int) -> None:
    """vLLM 0.33's conditions for sparse MLA and its indexer under DCP. The backend: FlashInfer's
    SM90 sparse MLA has no DCP (``supports_dcp`` False), so vLLM's selector falls to
    ``FLASHMLA_SPARSE``, which takes a 512-wide NoPE latent only as bfloat16 or its own
    ``fp8_ds_mla`` (``FlashMLASparseBackend.supports_combination``). The indexer: each k-pooled
    key lives on one rank, so the interleave covers whole pools
    (``DeepseekV32IndexerMetadataBuilder``)."""
    sparse = [
        layer for layer in attention if isinstance(layer.spec, MLASpec) and layer.spec.sparse_topk
    ]
    quantized = [layer for layer in sparse if dtype_bytes(layer.spec.kv_dtype) == 1]
    if quantized:
        first = quantized[0]
        raise ValueError(
            f"{name}: under decode context parallelism vLLM 0.33 serves sparse MLA with "
            "FLASHMLA_SPARSE (FlashInfer's SM90 sparse MLA does not support DCP), which keeps a "
            f"512-wide latent in bfloat16 or its fp8_ds_mla layout only, not "
            f"{first.spec.kv_dtype} (layer {first.name}); use --kv-cache-dtype auto, or a "
            "decode context "
            "parallel size of 1"
        )
    unit = _interleave_unit(attention)
    if interleave % unit:
        raise ValueError(
            f"{name}: under decode context parallelism each k-pooled indexer key lives on one "
            f"rank, so vLLM 0.33 requires --cp-kv-cache-interleave-size to be a multiple of the "
            f"pool ({unit} tokens; DeepseekV32IndexerMetadataBuilder), got {interleave}; give "
            f"--cp-kv-cache-interleave-size {unit}"
        )


def _skipped(layer: CacheLayer, skip: tuple[str, ...]) -> bool:
    if not skip or not _skippable(layer):
        return False
    window = isinstance(layer.spec, SlidingWindowSpec) and SKIP_SLIDING_WINDOW in skip
    return window or str(layer.index) in skip


def _skip_layers(
    model: HybridModel, layers: Sequence[CacheLayer], kv: str, given: Sequence[str | int]
) -> tuple[str, ...]:
    """``kv_dtype_skip_layers`` checked against the cache layers, as sorted unique strings."""
    if isinstance(given, (str, int)):
        given = [given]
    entries: list[str] = []
    for entry in given:
        text = str(entry).strip() if not isinstance(entry, bool) else ""
        if text != SKIP_SLIDING_WINDOW and not text.isdigit():
            raise ValueError(
                f"kv_dtype_skip_layers entries are decoder layer indices or "
                f"{SKIP_SLIDING_WINDOW!r} (vLLM's --kv-cache-dtype-skip-layers), got {entry!r}"
            )
        entries.append(text if text == SKIP_SLIDING_WINDOW else str(int(text)))
    if not entries:
        return ()
    if kv == model.dtype:
        raise ValueError(
            f"{model.name}: --kv-cache-dtype-skip-layers keeps layers at the model dtype "
            f"({model.dtype}), which every layer already has with kv_dtype {kv}; give a "
            "quantized --kv-cache-dtype (e.g. fp8) or leave the flag out"
        )
    skippable = [layer for layer in layers if _skippable(layer)]
    indices = sorted({layer.index for layer in skippable})
    for text in dict.fromkeys(entries):
        if text == SKIP_SLIDING_WINDOW:
            if not any(isinstance(layer.spec, SlidingWindowSpec) for layer in skippable):
                raise ValueError(
                    f"{model.name}: --kv-cache-dtype-skip-layers {SKIP_SLIDING_WINDOW} names "
                    "the sliding-window layers, and this model has none"
                )
        elif int(text) not in indices:
            raise ValueError(
                f"{model.name}: --kv-cache-dtype-skip-layers {text}: layer {text} holds no "
                f"attention KV cache to keep unquantized; its attention layers are "
                f"{_ranges(indices)}"
            )
    numbers = sorted({int(t) for t in entries if t != SKIP_SLIDING_WINDOW})
    window = (SKIP_SLIDING_WINDOW,) if SKIP_SLIDING_WINDOW in entries else ()
    return (*(str(i) for i in numbers), *window)


def _ranges(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    out: list[str] = []
    for i in indices:
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def _mtp_positions(name: str, value: Any) -> tuple[int, ...]:
    """``mtp_attention_layers`` of a model description: distinct non-negative ints."""
    if not isinstance(value, list) or not all(
        isinstance(j, int) and not isinstance(j, bool) and j >= 0 for j in value
    ):
        raise ValueError(
            f"model {name!r}: mtp_attention_layers must be a list of non-negative layer "
            f"positions in the MTP drafter, got {value!r}"
        )
    if len(set(value)) != len(value):
        raise ValueError(f"model {name!r}: mtp_attention_layers repeats a position: {value}")
    return tuple(value)
