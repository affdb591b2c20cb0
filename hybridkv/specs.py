"""Layer state specs: what one layer keeps per token (attention) or per request (recurrent state).

Every spec is a frozen dataclass of plain numbers describing **one tensor-parallel rank**: the
architecture numbers are the model's (from its ``config.json``), ``tp_size`` says how they are
split, and the byte properties give what one rank stores. Shapes follow vLLM's
``MambaStateShapeCalculator`` (conv states keep ``kernel - 1`` columns, laid out as
``(kernel - 1 + num_spec_tokens, conv_dim / tp)``, Mamba-1's without the speculative rows;
GDN's recurrent state is ``(num_v_heads / tp, head_v_dim, head_k_dim)`` as in vLLM >= 0.18).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Any, ClassVar

from .dtypes import STATE_DTYPES, canonical_dtype, dtype_bytes

__all__ = [
    "SPEC_KINDS",
    "AttentionSpec",
    "CCAStateSpec",
    "FullAttentionSpec",
    "GatedDeltaNetSpec",
    "IndexerSpec",
    "InklingConvSpec",
    "KDASpec",
    "LayerSpec",
    "LinearAttentionSpec",
    "MLASpec",
    "MLSTMSpec",
    "Mamba1Spec",
    "Mamba2Spec",
    "PLEConvSpec",
    "RGLRUSpec",
    "RWKV4Spec",
    "ShortConvSpec",
    "SlidingWindowSpec",
    "StateSpec",
    "StateTensor",
    "spec_from_dict",
]


def _divide(total: int, tp: int, what: str, hint: str) -> int:
    if total % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide {what}={total}; {hint}")
    return total // tp


def _positive(spec: Any, *names: str, minimum: int = 1) -> None:
    for name in names:
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise ValueError(f"{type(spec).__name__}.{name} must be {what}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """Base class: one cache-holding layer (or mixer) of a model, on one TP rank."""

    kind: ClassVar[str] = ""
    is_attention: ClassVar[bool] = False
    #: the cache layer's name in a model is ``layers.{i}.{suffix}``: ``attn`` for attention,
    #: ``mixer`` for a state, unless the spec names its own (a second cache of the same decoder
    #: layer: an indexer's keys beside the latent, a PLE conv beside the GDN state)
    suffix: ClassVar[str] = ""

    tp_size: int = 1

    def __post_init__(self) -> None:
        _positive(self, "tp_size")

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (architecture numbers only, runtime options omitted; a field made
        by :func:`_sparse_field` only when it differs from its default)."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in fields(self):
            if f.name in _RUNTIME_FIELDS:
                continue
            value = getattr(self, f.name)
            if f.metadata.get("omit_default") and value == f.default:
                continue
            out[f.name] = value
        return out


_RUNTIME_FIELDS = {"tp_size", "kv_dtype", "conv_dtype", "ssm_dtype", "num_spec_tokens"}


def _sparse_field(default: int) -> Any:
    """A field of the sparse-attention families only: left out of :meth:`LayerSpec.to_dict`
    at its default, so that every other model's JSON form stays as it was."""
    return field(default=default, metadata={"omit_default": True})


# ---------------------------------------------------------------------------------------------
# Attention: memory grows with every token.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(LayerSpec):
    """A layer whose cache grows by :attr:`bytes_per_token` per token."""

    is_attention: ClassVar[bool] = True
    kv_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "kv_dtype", canonical_dtype(self.kv_dtype, what="kv_dtype"))

    @property
    def bytes_per_token(self) -> int:
        raise NotImplementedError  # pragma: no cover - abstract

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one page holding ``block_size`` tokens of this layer."""
        return block_size * self.bytes_per_token

    @property
    def kernel_alignment(self) -> int:
        """Tokens a kernel block must be a multiple of (FlashAttention / Triton: 16)."""
        return 16


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Multi-head / grouped-query attention with a K and a V cache.

    KV heads are split across TP ranks; when TP exceeds the KV head count each rank keeps one
    replicated head (vLLM's ``max(1, num_kv_heads // tp)``), which needs
    ``tp % num_kv_heads == 0``.

    ``sparse_topk`` (0: dense): the most cached tokens a query attends, when a sparse-attention
    indexer picks them (Qwen4-Exp's QSA: ``indexer_budget`` tokens of whole compressed blocks
    plus the open block's tail, ``indexer_compress_ratio - 1`` at most). Every token is still
    cached; only the work per query is bounded.
    """

    kind: ClassVar[str] = "full_attention"

    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int | None = None
    sparse_topk: int = _sparse_field(0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        _positive(self, "num_heads", "num_kv_heads", "head_dim", "head_dim_v")
        _positive(self, "sparse_topk", minimum=0)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads}; grouped-query attention needs whole groups"
            )
        tp, kv = self.tp_size, self.num_kv_heads
        if tp <= kv:
            _divide(kv, tp, "num_kv_heads", f"use a TP size that divides {kv}")
        elif tp % kv:
            raise ValueError(
                f"tensor-parallel size {tp} exceeds num_kv_heads={kv} but is not a multiple of "
                f"it, so KV heads cannot be replicated evenly; use a TP size that divides {kv} "
                f"or a multiple of {kv}"
            )
        _divide(self.num_heads, tp, "num_heads", "use a TP size that divides the query heads")

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def bytes_per_token(self) -> int:
        assert self.head_dim_v is not None
        return (
            self.kv_heads_per_rank * (self.head_dim + self.head_dim_v) * dtype_bytes(self.kv_dtype)
        )


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Local attention: a token attends to the last ``sliding_window`` tokens (itself incl.)."""

    kind: ClassVar[str] = "sliding_window"

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "sliding_window")


@dataclass(frozen=True, kw_only=True)
class MLASpec(AttentionSpec):
    """Multi-head latent attention: one latent of ``kv_lora_rank + qk_rope_head_dim`` per token.

    The latent is shared by all heads, so every TP rank keeps the whole of it; kernels need
    blocks that are multiples of 64 tokens (vLLM's MLA alignment). ``qk_rope_head_dim`` may be
    0: GLM-5-Next's MLA is NoPE (transformers' Glm5NextTextConfig refuses any rope width), its
    cache the ``kv_lora_rank`` latent alone.

    ``sparse_topk`` (0: dense): the most cached tokens a query attends when a sparse-attention
    indexer picks them (DeepSeek-V3.2's ``index_topk``; GLM-5-Next's ``index_topk`` tokens of
    whole k-pools plus the open pool's tail, ``index_kpool - 1`` at most, on the layers whose
    indexer is ``full`` and the ``shared`` ones that reuse its top-k).
    """

    kind: ClassVar[str] = "mla"

    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    sparse_topk: int = _sparse_field(0)

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "num_heads", "kv_lora_rank")
        _positive(self, "qk_rope_head_dim", "sparse_topk", minimum=0)
        _divide(self.num_heads, self.tp_size, "num_heads", "use a TP size that divides the heads")

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def bytes_per_token(self) -> int:
        return self.latent_dim * dtype_bytes(self.kv_dtype)

    @property
    def kernel_alignment(self) -> int:
        return 64


#: elements of an fp8 indexer key that share one float32 scale (vLLM 0.33's
#: ``DeepseekV32IndexerCache``: ``head_dim + head_dim // quant_block_size * 4`` uint8 per token,
#: ``quant_block_size = 128``)
INDEXER_FP8_BLOCK = 128


@dataclass(frozen=True, kw_only=True)
class IndexerSpec(AttentionSpec):
    """A sparse-attention indexer's key cache (DeepSeek-V3.2's DSA, GLM-5-Next, Qwen4-Exp's QSA):
    one single-head key of ``index_head_dim`` per token, which the indexer scores to pick the
    top-k tokens (or k-pools of tokens) whose latent / K-V the attention then reads. It grows
    with every token like attention, so it is a per-token kind beside the layer's latent or K/V
    (its own cache layer ``layers.{i}.indexer``).

    Per token and TP rank, in ``kv_dtype``:

    - a 2- or 4-byte dtype (the model's; transformers' layout): ``index_head_dim +
      side_channels`` elements. transformers' ``DynamicIndexedLayer.indexer_keys`` is
      ``[batch, tokens, row]`` in the model dtype; Qwen4-Exp's row is the raw key
      (``side_channels = 0``), GLM-5-Next's the key, its k-pool gate score (``index_head_dim``)
      and a validity flag (1), which transformers re-pools at every step
      (``side_channels = index_head_dim + 1``).
    - an fp8 dtype (vLLM's layout): the key as fp8 with one float32 scale per
      :data:`INDEXER_FP8_BLOCK` elements, ``index_head_dim + index_head_dim // 128 * 4`` bytes
      (vLLM 0.33's ``Indexer`` in ``deepseek_v2.py``: a ``DeepseekV32IndexerCache`` of that head
      size in uint8, an ``MLAAttentionSpec``; 132 for a head of 128, the only size its kernels
      take); side channels, if any, in bfloat16 (vLLM keeps GLM-5-Next's gate scores in
      bfloat16).

    Not this spec's layout: vLLM 0.33 stores GLM-5-Next's and Qwen4-Exp's indexer keys
    k-pool-compressed (one entry per ``index_kpool`` / ``indexer_compress_ratio`` tokens,
    ``tokens_per_state``) plus a per-request ring of the open pool's raw keys
    (``CircularBufferSpec``). GLM-5-Next's: an ``MLAAttentionSpec`` of one uint8 head of
    ``index_head_dim + 4`` bytes per ``index_kpool`` tokens (``Glm5NextIndexerCache``), and a
    ring of ``index_kpool * next_power_of_2(cdiv(index_kpool + num_speculative_tokens,
    index_kpool))`` slots, each a bf16 key and a bf16 gate score of ``index_head_dim``
    (``Glm5NextTailCache``), in ``vllm/models/glm5next/common/attention.py``. What these change
    in vLLM's block size, its indexer backend's kernel block (``32 * index_kpool``), is
    :func:`hybridkv.target.indexer_kernel_block`'s; a plan in vLLM's cache formats
    (``VllmTarget(cache_formats="vllm")``) lays GLM-5-Next's out from this spec's
    ``index_head_dim`` and ``pool_tokens`` (:mod:`hybridkv.layouts.vllm_packed`). Qwen4-Exp's
    likewise: a ``CircularBufferSpec`` ring of ``round_up(indexer_compress_ratio +
    num_speculative_tokens, indexer_compress_ratio)`` bf16 raw keys (``QSAKeyStateCache``) and
    an ``MLAAttentionSpec`` of one compressed key of ``indexer_head_dim`` per
    ``indexer_compress_ratio`` tokens, bf16 or fp8 without scales (``QSACompressedKeyCache``,
    ``vllm/models/qwen4_exp/common/qsa_cache.py``).

    TP split rule: none; the key has a single head, every rank keeps it whole (vLLM: "no tensor
    parallel, just replicated", ``max_tp_shards=1``). Kernel alignment (``alignment``): 64
    tokens by default, DeepGEMM's paged MQA-logits kernel reading 64-token pages (vLLM's
    ``DeepseekV32IndexerBackend``; a k-pooled GLM-5-Next indexer's is larger, see above);
    Qwen4-Exp's QSA keys are read by kernels that take any page (vLLM's ``QSAStateBackend``,
    hybridkv's ``indexer_scores``), so its config reader gives 16, the Triton attention's.

    For the cost model only (no byte depends on them): ``index_n_heads``, the indexer's query
    heads, each scoring every scored key (0: not known, no work counted), and ``pool_tokens``,
    the tokens one scored key stands for (GLM-5-Next's ``index_kpool``, Qwen4-Exp's
    ``indexer_compress_ratio``; 1: every token is scored, as DeepSeek-V3.2).
    """

    kind: ClassVar[str] = "indexer"
    suffix: ClassVar[str] = "indexer"

    index_head_dim: int
    side_channels: int = 0
    index_n_heads: int = _sparse_field(0)
    pool_tokens: int = _sparse_field(1)
    #: tokens a page of these keys must be a multiple of, for the kernel that reads them
    alignment: int = _sparse_field(64)

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "index_head_dim", "pool_tokens", "alignment")
        _positive(self, "side_channels", "index_n_heads", minimum=0)

    @property
    def row_elements(self) -> int:
        """Elements of one token's row in a 2- or 4-byte dtype (key and side channels)."""
        return self.index_head_dim + self.side_channels

    @property
    def bytes_per_token(self) -> int:
        size = dtype_bytes(self.kv_dtype)
        if size > 1:
            return self.row_elements * size
        # vLLM's own formula, floor division included (its kernels take only heads of 128)
        scales = 4 * (self.index_head_dim // INDEXER_FP8_BLOCK)
        return self.index_head_dim + scales + 2 * self.side_channels

    @property
    def kernel_alignment(self) -> int:
        return self.alignment


# ---------------------------------------------------------------------------------------------
# Recurrent state: a fixed number of bytes per request.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a layer's recurrent state for one request (one TP rank)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


@dataclass(frozen=True, kw_only=True)
class StateSpec(LayerSpec):
    """A layer whose per-request state has a fixed size, whatever the sequence length.

    ``conv_dtype`` is vLLM's ``mamba_cache_dtype``, ``ssm_dtype`` its ``mamba_ssm_cache_dtype``.
    ``num_spec_tokens`` lengthens conv states for speculative decoding, as vLLM does.
    """

    conv_dtype: str = "bfloat16"
    ssm_dtype: str = "bfloat16"
    num_spec_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("conv_dtype", "ssm_dtype"):
            value = canonical_dtype(getattr(self, name), what=name)
            if value not in STATE_DTYPES:
                raise ValueError(
                    f"{name}={value!r} is not a supported recurrent-state dtype; "
                    f"use one of {', '.join(STATE_DTYPES)}"
                )
            object.__setattr__(self, name, value)
        if self.num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {self.num_spec_tokens}")

    def state_tensors(self) -> tuple[StateTensor, ...]:
        raise NotImplementedError  # pragma: no cover - abstract

    @cached_property  # specs are frozen: compute once (the simulator asks every step)
    def state_bytes(self) -> int:
        """Bytes of one request's state for this layer (all its tensors, unpadded)."""
        return sum(t.nbytes for t in self.state_tensors())

    def _conv(
        self, conv_dim: int, kernel: int, *, name: str = "conv", spec_rows: bool = True
    ) -> StateTensor:
        rows = kernel - 1 + (self.num_spec_tokens if spec_rows else 0)
        return StateTensor(name, (rows, conv_dim), self.conv_dtype)


@dataclass(frozen=True, kw_only=True)
class Mamba1Spec(StateSpec):
    """Mamba-1 selective SSM (Jamba): ``d_inner = expand * hidden_size``.

    Unlike the other conv states, vLLM's Mamba-1 conv state has no rows for speculative tokens
    (``MambaStateShapeCalculator.mamba1_state_shape`` takes no ``num_spec``).
    """

    kind: ClassVar[str] = "mamba1"

    d_inner: int
    d_state: int
    d_conv: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "d_inner", "d_state", "d_conv")
        _divide(self.d_inner, self.tp_size, "d_inner", "use a TP size that divides d_inner")

    def state_tensors(self) -> tuple[StateTensor, ...]:
        inner = self.d_inner // self.tp_size
        return (
            self._conv(inner, self.d_conv, spec_rows=False),
            StateTensor("ssm", (inner, self.d_state), self.ssm_dtype),
        )


@dataclass(frozen=True, kw_only=True)
class Mamba2Spec(StateSpec):
    """Mamba-2 SSD (NemotronH, Bamba, Granite-4.0-H, Falcon-H1, Zamba2).

    When TP does not divide ``n_groups`` the groups are replicated so each rank holds one, as
    vLLM's ``extra_groups_for_head_shards`` does; vLLM's ``MambaMixer2`` allows that only for
    ``n_groups == 1``.
    """

    kind: ClassVar[str] = "mamba2"

    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    d_conv: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "num_heads", "head_dim", "n_groups", "d_state", "d_conv")
        tp = self.tp_size
        _divide(self.num_heads, tp, "mamba num_heads", "use a TP size that divides the heads")
        if self.n_groups % tp and self.n_groups != 1:
            raise ValueError(
                f"tensor-parallel size {tp} does not divide n_groups={self.n_groups}, and only a "
                f"single group can be replicated across ranks (vLLM's MambaMixer2); use a TP "
                f"size that divides {self.n_groups}"
            )

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def padded_groups(self) -> int:
        """Groups after replication so that every rank holds whole groups."""
        extra = 0 if self.n_groups % self.tp_size == 0 else self.tp_size - self.n_groups
        return self.n_groups + extra

    def state_tensors(self) -> tuple[StateTensor, ...]:
        tp = self.tp_size
        conv_dim = self.d_inner + 2 * self.padded_groups * self.d_state
        return (
            self._conv(conv_dim // tp, self.d_conv),
            StateTensor(
                "ssm", (self.num_heads // tp, self.head_dim, self.d_state), self.ssm_dtype
            ),
        )


@dataclass(frozen=True, kw_only=True)
class GatedDeltaNetSpec(StateSpec):
    """Gated DeltaNet (Qwen3-Next, Qwen3.5): conv over q, k, v then a delta-rule state."""

    kind: ClassVar[str] = "gated_deltanet"

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel")
        hint = "use a TP size that divides both the key and value head counts"
        _divide(self.num_k_heads, self.tp_size, "linear_num_key_heads", hint)
        _divide(self.num_v_heads, self.tp_size, "linear_num_value_heads", hint)

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def state_tensors(self) -> tuple[StateTensor, ...]:
        tp = self.tp_size
        return (
            self._conv(self.conv_dim // tp, self.conv_kernel),
            StateTensor(
                "ssm", (self.num_v_heads // tp, self.head_v_dim, self.head_k_dim), self.ssm_dtype
            ),
        )


@dataclass(frozen=True, kw_only=True)
class KDASpec(StateSpec):
    """Kimi Delta Attention (Kimi-Linear): short convs on q, k, v fused into one conv state
    (vLLM >= 0.33 layout), and a ``(heads, head_dim, head_dim)`` recurrent state."""

    kind: ClassVar[str] = "kda"

    num_heads: int
    head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "num_heads", "head_dim", "conv_kernel")
        _divide(self.num_heads, self.tp_size, "KDA num_heads", "use a TP size that divides it")

    def state_tensors(self) -> tuple[StateTensor, ...]:
        tp = self.tp_size
        conv_dim = 3 * self.num_heads * self.head_dim
        return (
            self._conv(conv_dim // tp, self.conv_kernel),
            StateTensor(
                "ssm", (self.num_heads // tp, self.head_dim, self.head_dim), self.ssm_dtype
            ),
        )


@dataclass(frozen=True, kw_only=True)
class LinearAttentionSpec(StateSpec):
    """Lightning / linear attention (MiniMax): a ``(heads, d, d)`` state, no conv.

    vLLM stores it in the ``mamba_cache_dtype`` (here ``conv_dtype``), the one state dtype.
    """

    kind: ClassVar[str] = "linear_attention"

    num_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "num_heads", "head_dim")
        _divide(
            self.num_heads, self.tp_size, "linear-attention heads", "use a TP size dividing it"
        )

    def state_tensors(self) -> tuple[StateTensor, ...]:
        shape = (self.num_heads // self.tp_size, self.head_dim, self.head_dim)
        return (StateTensor("ssm", shape, self.conv_dtype),)


@dataclass(frozen=True, kw_only=True)
class ShortConvSpec(StateSpec):
    """Gated short convolution (LFM2): one conv state of ``L_cache - 1`` columns."""

    kind: ClassVar[str] = "short_conv"

    conv_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "conv_dim", "conv_kernel")
        _divide(self.conv_dim, self.tp_size, "conv_dim", "use a TP size that divides it")

    def state_tensors(self) -> tuple[StateTensor, ...]:
        return (self._conv(self.conv_dim // self.tp_size, self.conv_kernel),)


@dataclass(frozen=True, kw_only=True)
class RGLRUSpec(StateSpec):
    """Real-gated linear recurrent unit (RecurrentGemma / Griffin): a conv1d state and a
    ``lru_width`` recurrent vector. vLLM does not serve this family; the recurrent vector is kept
    in ``ssm_dtype`` (transformers keeps it in float32)."""

    kind: ClassVar[str] = "rglru"

    lru_width: int
    conv_kernel: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "lru_width", "conv_kernel")
        _divide(self.lru_width, self.tp_size, "lru_width", "use a TP size that divides it")

    def state_tensors(self) -> tuple[StateTensor, ...]:
        width = self.lru_width // self.tp_size
        return (self._conv(width, self.conv_kernel), StateTensor("ssm", (width,), self.ssm_dtype))


@dataclass(frozen=True, kw_only=True)
class RWKV4Spec(StateSpec):
    """RWKV-4 (transformers' ``RwkvForCausalLM``): per layer, two token-shift vectors and the
    WKV recurrence's numerator, denominator and running maximum.

    transformers keeps the whole model's state as five ``[batch, hidden_size, num_layers]``
    tensors (``RwkvModel.forward``): 0 the channel-mix (feed-forward) shift and 1 the time-mix
    (attention) shift, in the model dtype; 2-4 the WKV ``num``, ``den`` and ``max`` states, in
    float32 whatever the model dtype (``max`` starts at -1e30, which overflows float16). Per
    layer and request that is:

    - ``shift``: ``(2, hidden_size)`` in ``conv_dtype`` (the previous token's normed hidden
      state before each mixer: a causal conv of kernel 2, so one column; no speculative rows,
      no engine serves RWKV speculatively);
    - ``wkv``: ``(attention_hidden_size / tp, 3)`` in ``ssm_dtype`` (num, den, max per channel,
      the layout of transformers' CUDA kernel state).

    TP split rule (no engine shards RWKV; this is the rule a column-parallel port would follow):
    the WKV recurrence is per channel, so its channels split across ranks with the
    key / value / receptance projections; the shift vectors feed those column-parallel
    projections, whose every rank needs the whole previous hidden state, so each rank keeps
    both shifts whole (replicated). transformers sizes all five tensors by ``hidden_size``, so it
    runs only configs with ``attention_hidden_size == hidden_size``; the spec keeps the two
    apart as the layer's weights do.
    """

    kind: ClassVar[str] = "rwkv4"

    hidden_size: int
    attention_hidden_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "hidden_size", "attention_hidden_size")
        _divide(
            self.attention_hidden_size,
            self.tp_size,
            "attention_hidden_size",
            "use a TP size that divides it",
        )

    def state_tensors(self) -> tuple[StateTensor, ...]:
        return (
            StateTensor("shift", (2, self.hidden_size), self.conv_dtype),
            StateTensor("wkv", (self.attention_hidden_size // self.tp_size, 3), self.ssm_dtype),
        )


@dataclass(frozen=True, kw_only=True)
class MLSTMSpec(StateSpec):
    """xLSTM's mLSTM cell (transformers' ``xLSTMForCausalLM``, the xLSTM-7B architecture): a
    matrix memory per head, its normaliser and its max-state, no conv state.

    transformers' ``xLSTMCache.rnn_state[layer]`` is ``(C, n, m)``, shaped
    ``[batch, num_heads, qk_head_dim, v_head_dim]``, ``[batch, num_heads, qk_head_dim]`` and
    ``[batch, num_heads, 1]``, all three in the cache's dtype (the model's, as
    ``xLSTMModel.forward`` builds it; the kernels compute in the config's
    ``inference_state_dtype`` and the result is copied into the cache). Per layer and request:

    - ``C``: ``(num_heads / tp, qk_head_dim, v_head_dim)``;
    - ``n``: ``(num_heads / tp, qk_head_dim)``;
    - ``m``: ``(num_heads / tp, 1)``;

    all in ``ssm_dtype`` (``auto``: the model dtype, as transformers keeps them).

    TP split rule: the cell is independent per head (q, k, v, the gates and the multi-head norm
    are per head), so heads split across ranks as attention heads do; ``num_heads`` must be
    divisible by the TP size.
    """

    kind: ClassVar[str] = "mlstm"

    num_heads: int
    qk_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "num_heads", "qk_head_dim", "v_head_dim")
        _divide(self.num_heads, self.tp_size, "mLSTM num_heads", "use a TP size that divides it")

    def state_tensors(self) -> tuple[StateTensor, ...]:
        heads = self.num_heads // self.tp_size
        return (
            StateTensor("C", (heads, self.qk_head_dim, self.v_head_dim), self.ssm_dtype),
            StateTensor("n", (heads, self.qk_head_dim), self.ssm_dtype),
            StateTensor("m", (heads, 1), self.ssm_dtype),
        )


@dataclass(frozen=True, kw_only=True)
class PLEConvSpec(StateSpec):
    """Qwen4-Exp's Per-Layer Embedding (PLE) module: a dilated depthwise causal conv over
    ``conv_dim = hc_count * hidden_size`` channels (its hyper-connection streams), kernel
    ``conv_kernel``, dilation ``dilation`` (transformers and vLLM: ``ngram_size``). Its state
    is the last ``(conv_kernel - 1) * dilation`` inputs (the span the dilated kernel reaches
    back), plus speculative rows, in ``conv_dtype``: vLLM 0.33's
    ``get_ple_mamba_state_shape_from_config`` (a short-conv state of kernel
    ``(conv_kernel - 1) * dilation + 1``, ``tp_world_size=1``), transformers'
    ``conv_states[1]`` of ``short_conv_state_len`` columns. A PLE layer is also a GDN layer; the
    PLE state is a second state of it (``layers.{i}.ple``), as vLLM keeps it in its own
    ``MambaSpec``.

    TP split rule: none; vLLM sizes it at ``tp_world_size=1`` (``tp_replicated=True``), every
    rank keeps it whole. Not a state here: transformers' ``conv_states[2]``, the last
    ``ngram_size - 1`` token ids (int64) the n-gram hash reads; vLLM rebuilds them at every step
    from the request's tokens (``Qwen4ExpModelState.ngram_context``), which are not cache, and
    so does hybridkv's engine (:mod:`hybridkv.e2e.states`, ``StateFormat.derived``): they are a
    function of the request's tokens before the forward, which a server holds anyway (a prefix
    hit's tokens are its prompt's), so no slot needs them. These two are all the per-request
    state the PLE module keeps across forwards (``tests/test_e2e_qwen4.py`` checks each byte
    for byte against transformers' cache).
    """

    kind: ClassVar[str] = "ple_conv"
    suffix: ClassVar[str] = "ple"

    conv_dim: int
    conv_kernel: int
    dilation: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "conv_dim", "conv_kernel", "dilation")

    @property
    def span(self) -> int:
        """Inputs the dilated kernel reaches back: ``(conv_kernel - 1) * dilation``."""
        return (self.conv_kernel - 1) * self.dilation

    def state_tensors(self) -> tuple[StateTensor, ...]:
        # named "ple", not "conv": the layer's GDN state has a "conv" of its own, and the
        # engine keeps a layer's parts of every kind in one dict (hybridkv.e2e.states)
        return (self._conv(self.conv_dim, self.span + 1, name="ple"),)


def _kv_heads_per_rank(kv: int, tp: int, what: str) -> int:
    """KV heads one rank keeps, split as :class:`FullAttentionSpec` splits them (one replicated
    head per rank when ``tp`` exceeds ``kv``; ``tp`` must divide ``kv`` or be a multiple of it)."""
    if tp <= kv:
        _divide(kv, tp, what, f"use a TP size that divides {kv}")
    elif tp % kv:
        raise ValueError(
            f"tensor-parallel size {tp} exceeds {what}={kv} but is not a multiple of it, so KV "
            f"heads cannot be replicated evenly; use a TP size that divides {kv} or a multiple "
            f"of {kv}"
        )
    return max(1, kv // tp)


@dataclass(frozen=True, kw_only=True)
class InklingConvSpec(StateSpec):
    """Inkling's four short convolutions, kept by every decoder layer beside its attention
    (transformers' ``InklingShortConvolution``: a depthwise causal conv of kernel
    ``conv_kernel``, no bias, plus a residual). transformers keeps them as the layer's
    ``conv_states[0..3]`` (``cache.update_conv_state(..., state_idx=conv_idx)``):

    - 0 ``k_sconv`` over the K projection, ``num_kv_heads * head_dim`` channels, before the key
      norm and the K cache;
    - 1 ``v_sconv`` over the V projection, the same channels;
    - 2 ``attn_sconv`` over the attention output, ``hidden_size`` channels;
    - 3 ``mlp_sconv`` over the MLP / MoE output, ``hidden_size`` channels.

    The K / V channels are those of the layer's own attention: a ``hybrid_sliding`` layer's
    ``swa_num_key_value_heads * swa_head_dim``, a ``hybrid`` one's ``num_key_value_heads *
    head_dim``. transformers keeps each as ``[batch, channels, conv_kernel]`` (the whole kernel
    window; the next token's conv reads the last ``conv_kernel - 1`` columns, which is what a
    paged state keeps, one column less: ``tests/test_hf_cache_bytes.py``), **in float32
    whatever the model dtype** (``InklingShortConvolution.forward`` casts its input to float32
    before the state is written; the modules are ``_keep_in_fp32_modules_strict``). Per layer
    and request, on one rank, in ``conv_dtype`` (:meth:`HybridModel.configure` resolves
    ``auto`` to float32 for this kind, as transformers keeps them):

    - ``k_sconv``, ``v_sconv``: ``(conv_kernel - 1 + num_spec_tokens, kv_heads_per_rank *
      head_dim)`` each;
    - ``attn_sconv``, ``mlp_sconv``: ``(conv_kernel - 1 + num_spec_tokens, hidden_size)``
      each.

    TP split rule (transformers' plan shards only the MLPs, no engine serves Inkling; this is
    the rule a head-parallel port would follow): the K / V convs are per channel and feed
    per-head attention, so they split with the KV heads exactly as the K / V cache does
    (``max(1, num_kv_heads // tp)`` heads, replicated when TP exceeds them); the two
    hidden-size convs run on the whole residual-stream update after the output projection's
    all-reduce, so every rank keeps them whole (replicated).
    """

    kind: ClassVar[str] = "inkling_sconv"

    num_kv_heads: int
    head_dim: int
    hidden_size: int
    conv_kernel: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "num_kv_heads", "head_dim", "hidden_size", "conv_kernel")
        _kv_heads_per_rank(self.num_kv_heads, self.tp_size, "num_kv_heads")

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    def state_tensors(self) -> tuple[StateTensor, ...]:
        kv = self.kv_heads_per_rank * self.head_dim
        return (
            self._conv(kv, self.conv_kernel, name="k_sconv"),
            self._conv(kv, self.conv_kernel, name="v_sconv"),
            self._conv(self.hidden_size, self.conv_kernel, name="attn_sconv"),
            self._conv(self.hidden_size, self.conv_kernel, name="mlp_sconv"),
        )


@dataclass(frozen=True, kw_only=True)
class CCAStateSpec(StateSpec):
    """ZAYA's Compressed Convolutional Attention (transformers' ``ZayaCCAProjection``): the
    per-request state of the q / k mixing convs and of the delayed value half, kept beside the
    layer's ordinary K / V cache (its attention is plain GQA of ``head_dim``, full or
    sliding-window: a :class:`FullAttentionSpec` / :class:`SlidingWindowSpec` of its own).

    transformers concatenates the q and k projections (``(num_heads + num_kv_heads) *
    head_dim`` channels) and runs a depthwise conv of kernel ``time0`` then a per-head grouped
    conv of kernel ``time1``: together they reach ``time0 + time1 - 2`` inputs back, which is
    what the layer's ``conv_states[0]`` keeps, ``[batch, channels, time0 + time1 - 2]``
    (exactly that; no extra column). The value is half ``v_proj_current`` of this token, half
    ``v_proj_delayed`` of the previous one (``num_kv_heads * head_dim / 2`` channels each), so
    ``recurrent_states[0]`` keeps the last token's delayed projection, ``[batch, num_kv_heads *
    head_dim / 2]``. Both in the model dtype (the projections'). Per layer and request, on one
    rank, in ``conv_dtype``:

    - ``conv``: ``(time0 + time1 - 2 + num_spec_tokens, (num_heads / tp + kv_heads_per_rank) *
      head_dim)``;
    - ``v_delayed``: ``(1 + num_spec_tokens, min(kv_heads_per_rank * head_dim, num_kv_heads *
      head_dim / 2))`` (a token shift: a conv of kernel 2).

    TP split rule (no engine shards ZAYA; the rule a head-parallel port would follow): the
    grouped conv mixes within a head (``groups = num_heads + num_kv_heads``), so the conv
    channels split with the query heads and the KV heads (replicated as the K / V cache when TP
    exceeds them). The value heads are ``cat(current, delayed).view(heads, head_dim)``: the
    delayed channels are the last ``num_kv_heads / 2`` heads' (half of the one head when there
    is one), so a rank keeps the delayed channels of its own heads; the state is sized for the
    rank holding the most of them, ``min(kv_heads_per_rank * head_dim, num_kv_heads *
    head_dim / 2)`` (one pool serves every rank). At TP 1 that is ``num_kv_heads * head_dim /
    2``, transformers' shape.
    """

    kind: ClassVar[str] = "cca"

    num_heads: int
    num_kv_heads: int
    head_dim: int
    time0: int
    time1: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "num_heads", "num_kv_heads", "head_dim", "time0", "time1")
        if (self.num_kv_heads * self.head_dim) % 2:
            raise ValueError(
                f"num_kv_heads * head_dim = {self.num_kv_heads * self.head_dim} is odd; ZAYA's "
                "value is half current, half delayed projection, so it must be even"
            )
        _kv_heads_per_rank(self.num_kv_heads, self.tp_size, "num_kv_heads")
        _divide(self.num_heads, self.tp_size, "num_heads", "use a TP size that divides them")

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def conv_dim(self) -> int:
        """q and k channels one rank convolves."""
        return (self.num_heads // self.tp_size + self.kv_heads_per_rank) * self.head_dim

    @property
    def delayed_dim(self) -> int:
        """Delayed value channels the fullest rank keeps."""
        return min(self.kv_heads_per_rank * self.head_dim, self.num_kv_heads * self.head_dim // 2)

    def state_tensors(self) -> tuple[StateTensor, ...]:
        return (
            self._conv(self.conv_dim, self.time0 + self.time1 - 1),
            self._conv(self.delayed_dim, 2, name="v_delayed"),
        )


SPEC_KINDS: dict[str, type[LayerSpec]] = {
    cls.kind: cls
    for cls in (
        FullAttentionSpec,
        SlidingWindowSpec,
        MLASpec,
        IndexerSpec,
        Mamba1Spec,
        Mamba2Spec,
        GatedDeltaNetSpec,
        KDASpec,
        LinearAttentionSpec,
        ShortConvSpec,
        RGLRUSpec,
        RWKV4Spec,
        MLSTMSpec,
        PLEConvSpec,
        InklingConvSpec,
        CCAStateSpec,
    )
}


def spec_from_dict(data: dict[str, Any], **runtime: Any) -> LayerSpec:
    """Build a spec from its :meth:`LayerSpec.to_dict` form plus runtime fields
    (``tp_size``, ``kv_dtype``, ``conv_dtype``, ``ssm_dtype``, ``num_spec_tokens``); runtime
    fields that do not apply to the spec's class are ignored."""
    data = dict(data)
    kind = data.pop("kind", None)
    if kind not in SPEC_KINDS:
        raise ValueError(f"unknown layer kind {kind!r}; known kinds: {', '.join(SPEC_KINDS)}")
    cls = SPEC_KINDS[kind]
    names = {f.name for f in fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(
            f"{kind} spec has unknown fields {sorted(unknown)}; known: {sorted(names)}"
        )
    kwargs = {**data, **{k: v for k, v in runtime.items() if k in names and v is not None}}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # missing required field
        raise ValueError(f"{kind} spec is incomplete: {exc}") from None


def with_runtime(spec: LayerSpec, **runtime: Any) -> LayerSpec:
    """A copy of ``spec`` with the runtime fields that apply to it replaced."""
    names = {f.name for f in fields(spec)}
    return replace(spec, **{k: v for k, v in runtime.items() if k in names and v is not None})
