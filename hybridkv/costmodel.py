"""A roofline cost model for serving a hybrid model on one GPU per tensor-parallel rank.

A step takes ``max(FLOPs / peak FLOP/s, bytes / peak bandwidth)`` on each rank (ranks run in
parallel; communication is not modelled). All cache figures come from the model's layer specs,
which already describe one rank; parameter counts come from the zoo (each model's ``params``,
:func:`param_count`) or an argument, and are split evenly over the ranks.

- **FLOPs**: ``2 * active_params`` per token (every active weight is one multiply-add; the
  embedding lookup is counted as a matmul, a small overestimate), plus attention over the context
  (``QK^T`` and ``PV``: ``2 * heads * (head_dim + head_dim_v)`` per token of context per layer),
  plus the recurrent update of every state layer (:data:`STATE_FLOPS_PER_ELEMENT` per state
  element per token; a few percent of the weights' FLOPs for the zoo's models, 5% at most).
- **bytes**: the weights a step touches, read once per step (``min(total, active * tokens)``:
  exact for dense models and for a single token, an upper bound for a mixture of experts, where
  a batch's tokens share some experts), the KV cache read for every request's context and
  written for the new tokens, and every request's recurrent state read and written once.

The layout does not change these per-step costs (kernels read only valid tokens); it changes how
many requests fit (:func:`requests_that_fit`) and how many prompt tokens a prefix cache can
serve, which is how layouts enter TTFT and throughput here. Times are lower bounds: pass
``mfu``/``mbu`` below 1 for achieved fractions of peak.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

from .dtypes import canonical_dtype, dtype_bytes
from .models.model import HybridModel, ParamCount
from .plan import MemoryPlan
from .specs import FullAttentionSpec, IndexerSpec, MLASpec, SlidingWindowSpec

__all__ = [
    "GPU",
    "GPUS",
    "H100_SXM",
    "H200",
    "STATE_FLOPS_PER_ELEMENT",
    "ParamCount",
    "StepCost",
    "StepCoster",
    "attention_flops",
    "decode_step",
    "decode_throughput",
    "param_count",
    "prefill",
    "prefill_flops",
    "requests_that_fit",
    "ttft",
]


@dataclass(frozen=True)
class GPU:
    """Peak rates of one GPU: HBM bandwidth (B/s), dense tensor-core FLOP/s, memory (bytes)."""

    name: str
    hbm_bandwidth: float
    flops_bf16: float
    flops_fp8: float
    memory_bytes: int

    def flops(self, dtype: str) -> float:
        """Dense FLOP/s for matmuls in ``dtype`` (fp8 or 16-bit)."""
        return self.flops_fp8 if dtype_bytes(dtype) == 1 else self.flops_bf16


# NVIDIA H100 Tensor Core GPU datasheet, SXM5 column: 3.35 TB/s HBM3; BF16 1,979 and FP8
# 3,958 TFLOPS *with 2:4 sparsity*, so dense is half: 989 and 1,979 TFLOPS. Memory: the total
# the device reports, which vLLM's --gpu-memory-utilization multiplies, not the datasheet's
# 80 GB: nvidia-smi's 81,559 MiB on an H100 80GB HBM3 (torch reports a little less; not
# measured here).
H100_SXM = GPU("H100-SXM", 3.35e12, 989e12, 1979e12, 81_559 * 2**20)
# NVIDIA H200 datasheet: 4.8 TB/s HBM3e; the same Hopper compute as H100 SXM. Memory: the
# total torch.cuda.get_device_properties(0).total_memory reported on the H200 of the GPU suite
# runs (2026-11-26), 139.80 GiB, not the datasheet's 141 GB.
H200 = GPU("H200", 4.8e12, 989e12, 1979e12, 150_109_880_320)
GPUS = {"h100": H100_SXM, "h200": H200}


#: FLOPs per recurrent-state element per token: decay, rank-1 update and read-out are each a
#: multiply-add over the state (Mamba-2: ``h = a*h + B x``, ``y = C h``; GDN adds the delta-rule
#: correction). An order-of-magnitude figure; next to ``2 * active`` it is 1-5% for the zoo.
STATE_FLOPS_PER_ELEMENT = 6

_SUFFIXES = re.compile(
    r"(-(instruct|thinking|base|bf16|fp8|8k|hf|v0\.1-hf|chat))+$|^(nvidia|ai21|google|ibm)-"
)


def _normalise(name: str) -> str:
    name = name.strip().lower().split("/")[-1].split(" ")[0]
    prev = None
    while prev != name:
        prev, name = name, _SUFFIXES.sub("", name)
    return name


@cache
def _zoo_params() -> dict[str, ParamCount]:
    """Parameter counts of the zoo's models, by zoo name (read from the zoo files)."""
    from . import models

    out = {}
    for name in models.list_models():
        params = models.load(name).params
        if params is not None:
            out[name] = params
    return out


def param_count(model: HybridModel | str) -> ParamCount:
    """A model's parameter counts: its own (the zoo's ``params``), else the zoo entry matched on
    its name, then its Hugging Face repos, else (a model read from a ``config.json``) counted
    from its config by transformers on the meta device
    (:func:`hybridkv.models.param_count.params_from_config`)."""
    if isinstance(model, HybridModel) and model.params is not None:
        return model.params
    names = [model] if isinstance(model, str) else [model.name, *model.hf_repo.split(",")]
    known = _zoo_params()
    for n in names:
        key = _normalise(n)
        if key in known:
            return known[key]
    config = model.extra.get("hf_config") if isinstance(model, HybridModel) else None
    if config is not None:
        from .models.param_count import params_from_config

        return params_from_config(config)
    raise KeyError(
        f"no parameter count for {names[0]!r}; pass params=ParamCount(total, active, source), "
        f"or read the model from its config.json (its parameters are then counted from it) "
        f"(known: {', '.join(sorted(known))})"
    )


# ---- per-token work of the cache-holding layers -------------------------------------------------
def _context_sum(new: int, cached: int, window: int | None) -> int:
    """``sum(min(j, window) for j in cached+1 .. cached+new)``: context tokens the new tokens
    attend to in total (token ``j`` sees ``j`` tokens, or the last ``window``)."""
    lo, hi = cached + 1, cached + new
    if new <= 0:
        return 0
    if window is None or hi <= window:
        return (lo + hi) * new // 2
    if lo > window:
        return window * new
    below = (lo + window) * (window - lo + 1) // 2
    return below + window * (hi - window)


def _attention_terms(model: HybridModel) -> tuple[tuple[float, int | None], ...]:
    """(FLOPs per context token, window or None) of every attention layer on one rank, in layer
    order: ``QK^T`` and ``PV`` are ``2 * heads * (head_dim + head_dim_v)``; absorbed MLA scores
    over the latent and takes values over its rank-r part. A layer whose queries attend at most
    ``sparse_topk`` tokens (an indexer picks them) counts as a window of that many: each query
    reads ``min(context, k)`` tokens, the same sum as a sliding window's. A sparse-attention
    indexer scores every pool of ``pool_tokens`` tokens with ``index_n_heads`` query heads of
    ``index_head_dim``: ``2 * heads * dim / pool`` per context token, over the whole context
    (none counted when the spec does not know its heads); under decode context parallelism a
    rank scores only the keys it keeps, one pool in ``dcp_size``, and the ranks merge their
    top-k (vLLM's ``_merge_dcp_topk_global``, not priced), while the attention's queries are
    gathered and keep their FLOPs. The top-k selection itself and the pools' compression are
    not counted."""
    terms: list[tuple[float, int | None]] = []
    for layer in model.attention_layers:
        spec = layer.spec
        if isinstance(spec, IndexerSpec):
            if spec.index_n_heads:
                work = 2 * spec.index_n_heads * spec.index_head_dim
                pool = spec.pool_tokens * model.dcp_size
                terms.append((work // pool if work % pool == 0 else work / pool, None))
            continue
        if isinstance(spec, MLASpec):
            heads = spec.num_heads // spec.tp_size
            terms.append(
                (2 * heads * (spec.latent_dim + spec.kv_lora_rank), spec.sparse_topk or None)
            )
            continue
        assert isinstance(spec, FullAttentionSpec)
        dv = spec.head_dim_v or spec.head_dim
        limits = [spec.sliding_window] if isinstance(spec, SlidingWindowSpec) else []
        if spec.sparse_topk:
            limits.append(spec.sparse_topk)
        terms.append((2 * spec.heads_per_rank * (spec.head_dim + dv), min(limits, default=None)))
    return tuple(terms)


def _attention(terms: Sequence[tuple[float, int | None]], new: int, cached: int) -> float:
    """Attention FLOPs of ``new`` tokens after ``cached`` ones over ``terms``: one exact integer
    converted once while below 2**53, else the float sum layer by layer."""
    exact = sum(per_ctx * _context_sum(new, cached, w) for per_ctx, w in terms)
    if exact < _EXACT:
        return float(exact)
    total = 0.0
    for per_ctx, w in terms:
        total += per_ctx * _context_sum(new, cached, w)
    return total


def attention_flops(model: HybridModel, new: int, cached: int = 0) -> float:
    """FLOPs on one rank of all attention layers when ``new`` tokens follow ``cached`` ones."""
    return _attention(_attention_terms(model), new, cached)


def state_flops_per_token(model: HybridModel) -> float:
    """FLOPs on one rank of the recurrent updates of all state layers for one token."""
    elements = sum(
        t.numel
        for layer in model.state_layers
        for t in layer.spec.state_tensors()  # type: ignore[attr-defined]
    )
    return float(STATE_FLOPS_PER_ELEMENT * elements)


def _state_bytes(model: HybridModel) -> int:
    return sum(layer.spec.state_bytes for layer in model.state_layers)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class StepCost:
    """One step on one rank: work, the two roofline times and the binding one."""

    flops: float
    bytes: float
    compute_s: float
    memory_s: float

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def _weights(params: ParamCount, tokens: int) -> float:
    """Parameters a step over ``tokens`` tokens reads (once each)."""
    return min(params.total, params.active * max(1, tokens))


def _resolve(model: HybridModel, params: ParamCount | None) -> ParamCount:
    return params if params is not None else param_count(model)


def prefill(
    model: HybridModel,
    gpu: GPU,
    new_tokens: int,
    cached_tokens: int = 0,
    *,
    params: ParamCount | None = None,
    weight_dtype: str = "bfloat16",
    mfu: float = 1.0,
    mbu: float = 1.0,
) -> StepCost:
    """One request's prefill of ``new_tokens`` after ``cached_tokens`` served from the cache.

    FLOPs: ``2 * active / tp`` per new token, attention over the context, state updates. Bytes:
    the weights once, the KV of the whole context read once and of the new tokens written, and
    the recurrent state read and written once.
    """
    coster = StepCoster(model, gpu, params=params, weight_dtype=weight_dtype, mfu=mfu, mbu=mbu)
    return coster.prefill_cost(new_tokens, cached_tokens)


def decode_step(
    model: HybridModel,
    gpu: GPU,
    contexts: Sequence[int] | np.ndarray,
    *,
    params: ParamCount | None = None,
    weight_dtype: str = "bfloat16",
    mfu: float = 1.0,
    mbu: float = 1.0,
) -> StepCost:
    """One decode step of a batch whose requests hold ``contexts`` tokens each (one new token
    per request; its KV is written, the context's KV read, every state read and written)."""
    coster = StepCoster(model, gpu, params=params, weight_dtype=weight_dtype, mfu=mfu, mbu=mbu)
    return coster.decode_cost(contexts)


def prefill_flops(
    model: HybridModel,
    new_tokens: int,
    cached_tokens: int = 0,
    *,
    params: ParamCount | None = None,
) -> float:
    """FLOPs on one rank of prefilling ``new_tokens`` after ``cached_tokens`` (0 for none).

    The work a prefix hit of ``n`` tokens saves is ``prefill_flops(model, n)``: the weights'
    ``2 * active / tp`` per token, attention over each token's position (token ``j`` attends to
    ``j`` tokens, or a sliding window), and the recurrent update of every state layer per token.
    """
    if new_tokens <= 0:
        return 0.0
    return StepCoster(model, H100_SXM, params=params).prefill_flops(new_tokens, cached_tokens)


class StepCoster:
    """The roofline of one model on one GPU: every formula of :func:`prefill` and
    :func:`decode_step` (which call it), with the per-model constants worked out once: the
    simulator prices hundreds of thousands of steps.

    The attention FLOPs are a sum of integer products, evaluated as one exact integer and
    converted once (past 2**53, where a float loses integers, as a float sum layer by layer). A
    decode step needs only the batch size and the sum of its contexts, unless the model has
    sliding-window or top-k sparse layers (then pass ``contexts``). Bytes count every layer's
    whole context read, windowed and sparse ones too: an upper bound for them."""

    def __init__(
        self,
        model: HybridModel,
        gpu: GPU,
        *,
        params: ParamCount | None = None,
        weight_dtype: str = "bfloat16",
        mfu: float = 1.0,
        mbu: float = 1.0,
    ) -> None:
        if not (0 < mfu <= 1 and 0 < mbu <= 1):
            raise ValueError(f"mfu and mbu must be in (0, 1], got {mfu}, {mbu}")
        self.model, self.gpu = model, gpu
        p = self.params = _resolve(model, params)
        self.tp = model.tp_size
        self.wbytes = dtype_bytes(canonical_dtype(weight_dtype))
        self.per_token = 2 * p.active / self.tp
        self.state_fpt = state_flops_per_token(model)
        self.kv = model.kv_bytes_per_token
        #: KV bytes of one cached token on a rank: one token in dcp_size under decode context
        #: parallelism, whose ranks read only their own share of a context (the queries are
        #: gathered, so the FLOPs stay; the all-gather and the LSE merge are not priced)
        self.kv_cached = self.kv if model.dcp_size == 1 else self.kv / model.dcp_size
        self.state2 = 2 * _state_bytes(model)
        self.peak_flops = gpu.flops(weight_dtype) * mfu
        self.peak_bw = gpu.hbm_bandwidth * mbu
        self.attention = _attention_terms(model)
        #: FLOPs per context token of the layers without a window, summed
        self.full_per_ctx = sum(per_ctx for per_ctx, w in self.attention if w is None)
        #: (FLOPs per context token, window) of each sliding-window layer
        self.windows = tuple((per_ctx, w) for per_ctx, w in self.attention if w is not None)

    def _cost(self, flops: float, bytes_: float) -> StepCost:
        return StepCost(flops, bytes_, flops / self.peak_flops, bytes_ / self.peak_bw)

    # ---- prefill ----------------------------------------------------------------------------
    def prefill_flops(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """FLOPs of one request's prefill on one rank: the weights' ``2 * active / tp`` per new
        token, attention over the context, the recurrent update of every state layer."""
        return (
            self.per_token * new_tokens
            + _attention(self.attention, new_tokens, cached_tokens)
            + self.state_fpt * new_tokens
        )

    def prefill_bytes(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Bytes of one request's prefill on one rank: the weights once, the KV of the whole
        context read and of the new tokens written, the recurrent state read and written."""
        return (
            _weights(self.params, new_tokens) / self.tp * self.wbytes
            # read the context: the cached part a rank's share of it, the new tokens' own K/V
            + (self.kv_cached * cached_tokens + self.kv * new_tokens)
            + self.kv_cached * new_tokens  # write the new tokens (a rank its share)
            + self.state2
        )

    def prefill_cost(self, new_tokens: int, cached_tokens: int = 0) -> StepCost:
        """:func:`prefill`."""
        _check_prefill(new_tokens, cached_tokens)
        return self._cost(
            self.prefill_flops(new_tokens, cached_tokens),
            self.prefill_bytes(new_tokens, cached_tokens),
        )

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """``prefill(...).time_s``."""
        _check_prefill(new_tokens, cached_tokens)
        flops = self.prefill_flops(new_tokens, cached_tokens)
        bytes_ = self.prefill_bytes(new_tokens, cached_tokens)
        return max(flops / self.peak_flops, bytes_ / self.peak_bw)

    # ---- decode -----------------------------------------------------------------------------
    def decode_flops(
        self, batch: int, context_sum: int, contexts: Sequence[int] | np.ndarray | None = None
    ) -> float:
        """FLOPs on one rank of a decode step of ``batch`` requests whose contexts sum to
        ``context_sum`` (``contexts``: the values themselves, needed for sliding windows)."""
        attn = self.full_per_ctx * (context_sum + batch)  # sum of (context + 1)
        if self.windows or attn >= _EXACT:
            if contexts is None:
                raise ValueError(
                    "this model has sliding-window or top-k sparse layers: pass contexts"
                )
            # the attention work depends only on the context: once per distinct value
            uniq, counts = np.unique(np.asarray(contexts, np.int64), return_counts=True)
            attn = float(
                sum(_attention(self.attention, 1, int(c)) * n for c, n in zip(uniq, counts))
            )
        return self.per_token * batch + float(attn) + self.state_fpt * batch

    def decode_bytes(self, batch: int, context_sum: int) -> float:
        """Bytes on one rank of that step: the weights once, every context's KV read and the
        new tokens' written (the rank's share of them under DCP), every request's state read
        and written."""
        return (
            _weights(self.params, batch) / self.tp * self.wbytes
            + self.kv_cached * float(context_sum)
            + self.kv_cached * batch
            + self.state2 * batch
        )

    def decode_cost(self, contexts: Sequence[int] | np.ndarray) -> StepCost:
        """:func:`decode_step`."""
        ctx = np.asarray(contexts, np.int64)
        if ctx.ndim != 1 or ctx.size == 0 or np.any(ctx < 0):
            raise ValueError("contexts must be a non-empty 1-D sequence of token counts >= 0")
        b, total = int(ctx.size), int(ctx.sum())
        return self._cost(self.decode_flops(b, total, ctx), self.decode_bytes(b, total))

    def decode_s(
        self, batch: int, context_sum: int, contexts: Sequence[int] | None = None
    ) -> float:
        """``decode_step(...).time_s`` of ``batch`` requests whose contexts sum to
        ``context_sum`` (``contexts``: the values themselves, needed for sliding windows)."""
        if batch < 1:
            raise ValueError(f"a decode step needs a batch of at least 1, got {batch}")
        flops = self.decode_flops(batch, context_sum, contexts)
        bytes_ = self.decode_bytes(batch, context_sum)
        return max(flops / self.peak_flops, bytes_ / self.peak_bw)


def _check_prefill(new_tokens: int, cached_tokens: int) -> None:
    if new_tokens < 1 or cached_tokens < 0:
        raise ValueError(
            f"need new_tokens >= 1 and cached_tokens >= 0, got {new_tokens}, {cached_tokens}"
        )


_EXACT = 1 << 53  # integers below this are exact in a float


def ttft(
    model: HybridModel,
    gpu: GPU,
    prompt_tokens: int,
    cached_tokens: int = 0,
    **kwargs,
) -> float:
    """Time to first token (s) of one request alone on the GPU: the prefill of the prompt's
    uncached part (queueing and other requests' work not included). A fully cached prompt still
    recomputes its last token, as servers do to produce logits."""
    if not 0 <= cached_tokens <= prompt_tokens:
        raise ValueError(f"cached_tokens must be in 0..{prompt_tokens}, got {cached_tokens}")
    new = max(1, prompt_tokens - cached_tokens)
    return prefill(model, gpu, new, prompt_tokens - new, **kwargs).time_s


def decode_throughput(model: HybridModel, gpu: GPU, batch: int, context: int, **kwargs) -> float:
    """Output tokens per second of ``batch`` requests decoding at ``context`` tokens each."""
    if batch < 1:
        return 0.0
    step = decode_step(model, gpu, np.full(batch, context), **kwargs)
    return batch / step.time_s


def requests_that_fit(plan: MemoryPlan, context: int) -> int:
    """Requests of ``context`` tokens that a plan can hold at once: whole blocks of KV each
    (``cdiv(context, block_size)`` blocks, so large blocks waste their unfilled tail), at most
    ``max_num_seqs`` (whose states the plan reserved)."""
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    b = plan.block_size
    per_request = -(-context // b) * b
    return int(min(plan.config.max_num_seqs, plan.capacity.token_capacity // per_request))
