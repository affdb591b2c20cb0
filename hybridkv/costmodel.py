"""A roofline cost model for serving a hybrid model on one GPU per tensor-parallel rank.

A step takes ``max(FLOPs / peak FLOP/s, bytes / peak bandwidth)`` on each rank (ranks run in
parallel; communication is not modelled). All cache figures come from the model's layer specs,
which already describe one rank; parameter counts come from :data:`PARAMS` (or an argument) and
are split evenly over the ranks.

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

import numpy as np

from .dtypes import canonical_dtype, dtype_bytes
from .models.model import HybridModel
from .plan import MemoryPlan
from .specs import FullAttentionSpec, MLASpec, SlidingWindowSpec

__all__ = [
    "GPU",
    "GPUS",
    "H100_SXM",
    "H200",
    "PARAMS",
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


# NVIDIA H100 Tensor Core GPU datasheet, SXM5 column: 3.35 TB/s HBM3, 80 GB; BF16 1,979 and FP8
# 3,958 TFLOPS *with 2:4 sparsity*, so dense is half: 989 and 1,979 TFLOPS.
H100_SXM = GPU("H100-SXM", 3.35e12, 989e12, 1979e12, 80 * 10**9)
# NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 141 GB; the same Hopper compute as H100 SXM.
H200 = GPU("H200", 4.8e12, 989e12, 1979e12, 141 * 10**9)
GPUS = {"h100": H100_SXM, "h200": H200}


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


def _dense(n: float) -> ParamCount:
    return ParamCount(n, n, "name")


def _moe(total: float, active: float, source: str = "name") -> ParamCount:
    return ParamCount(total, active, source)


#: parameter counts by model, keyed by the normalised model name (see :func:`param_count`)
PARAMS: dict[str, ParamCount] = {
    "qwen3-next-80b-a3b": _moe(80e9, 3e9, "Qwen3-Next-80B-A3B model card: 80B total, 3B active"),
    "qwen3.5-0.8b": _dense(0.8e9),
    "qwen3.5-2b": _dense(2e9),
    "qwen3.5-4b": _dense(4e9),
    "qwen3.5-9b": _dense(9e9),
    "qwen3.5-27b": _dense(27e9),
    "qwen3.5-35b-a3b": _moe(35e9, 3e9),
    "qwen3.5-122b-a10b": _moe(122e9, 10e9),
    "qwen3.5-397b-a17b": _moe(
        397e9,
        17e9,
        "Qwen3.5-397B-A17B model card: 397B total, ~17B active (512 experts, "
        "10 routed + 1 shared)",
    ),
    "nemotron-h-8b": _dense(8e9),
    "nemotron-h-47b": _dense(47e9),
    "nemotron-h-56b": _dense(56e9),
    "nemotron-nano-9b-v2": _dense(9e9),
    "nemotron-nano-12b-v2": _dense(12e9),
    "nemotron-3-nano-30b-a3b": _moe(
        30e9, 3.5e9, "NVIDIA Megatron-Bridge docs: 3.5B active, 30B total"
    ),
    "nemotron-3-super-120b-a12b": _moe(120e9, 12e9),
    "jamba-v0.1": _moe(52e9, 12e9, "AI21 Jamba model card: 52B total, 12B active"),
    "jamba-1.5-mini": _moe(52e9, 12e9, "AI21 Jamba 1.5 model card: 52B total, 12B active"),
    "falcon-h1-0.5b": _dense(0.5e9),
    "falcon-h1-1.5b": _dense(1.5e9),
    "falcon-h1-1.5b-deep": _dense(1.5e9),
    "falcon-h1-3b": _dense(3e9),
    "falcon-h1-7b": _dense(7e9),
    "falcon-h1-34b": _dense(34e9),
    "granite-4.0-h-small": _moe(32e9, 9e9, "IBM Granite 4.0 release: 32B total, 9B active"),
    "granite-4.0-h-tiny": _moe(7e9, 1e9, "IBM Granite 4.0 release: 7B total, 1B active"),
    "granite-4.0-h-micro": _dense(3e9),
    "bamba-9b": _dense(9e9),
    "zamba2-1.2b": _dense(1.2e9),
    "zamba2-2.7b": _dense(2.7e9),
    "minimax-text-01": _moe(
        456e9, 45.9e9, "MiniMax-Text-01 model card: 456B total, 45.9B active per token"
    ),
    "minimax-m1": _moe(456e9, 45.9e9, "MiniMax-M1 model card: 456B total, 45.9B active"),
    "kimi-linear-48b-a3b": _moe(48e9, 3e9),
    "lfm2-350m": _dense(0.35e9),
    "lfm2-700m": _dense(0.7e9),
    "lfm2-1.2b": _dense(1.2e9),
    "lfm2-2.6b": _dense(2.6e9),
    "lfm2-8b-a1b": _moe(8.3e9, 1.5e9, "LiquidAI LFM2-8B-A1B model card: 8.3B total, 1.5B active"),
    "nemotron-3-nano-4b": _dense(4e9),
    "olmo-hybrid-7b": _dense(7e9),
    "zamba-7b-v1": _dense(7e9),
    "recurrentgemma-2b": _dense(2e9),
    "recurrentgemma-9b": _dense(9e9),
}

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


def param_count(model: HybridModel | str) -> ParamCount:
    """The :data:`PARAMS` entry for a model (matched on its name, then its Hugging Face repos)."""
    names = [model] if isinstance(model, str) else [model.name, *model.hf_repo.split(",")]
    for n in names:
        key = _normalise(n)
        if key in PARAMS:
            return PARAMS[key]
        if key.endswith("-v0.1") and key in PARAMS:  # pragma: no cover - covered by the table
            return PARAMS[key]
    raise KeyError(
        f"no parameter count for {names[0]!r}; pass params=ParamCount(total, active, source) "
        f"(known: {', '.join(sorted(PARAMS))})"
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


def attention_flops(model: HybridModel, new: int, cached: int = 0) -> float:
    """FLOPs on one rank of all attention layers when ``new`` tokens follow ``cached`` ones."""
    total = 0.0
    for layer in model.attention_layers:
        spec = layer.spec
        if isinstance(spec, MLASpec):
            # absorbed MLA: scores over the latent, values over the rank-r part
            per_ctx = 2 * (spec.num_heads // spec.tp_size) * (spec.latent_dim + spec.kv_lora_rank)
            window = None
        else:
            assert isinstance(spec, FullAttentionSpec)
            dv = spec.head_dim_v or spec.head_dim
            per_ctx = 2 * spec.heads_per_rank * (spec.head_dim + dv)
            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        total += per_ctx * _context_sum(new, cached, window)
    return total


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


def _step(
    model: HybridModel,
    gpu: GPU,
    *,
    flops: float,
    bytes_: float,
    weight_dtype: str,
    mfu: float,
    mbu: float,
) -> StepCost:
    if not (0 < mfu <= 1 and 0 < mbu <= 1):
        raise ValueError(f"mfu and mbu must be in (0, 1], got {mfu}, {mbu}")
    return StepCost(
        flops=flops,
        bytes=bytes_,
        compute_s=flops / (gpu.flops(weight_dtype) * mfu),
        memory_s=bytes_ / (gpu.hbm_bandwidth * mbu),
    )


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
    if new_tokens < 1 or cached_tokens < 0:
        raise ValueError(
            f"need new_tokens >= 1 and cached_tokens >= 0, got {new_tokens}, {cached_tokens}"
        )
    p = _resolve(model, params)
    tp = model.tp_size
    wbytes = dtype_bytes(canonical_dtype(weight_dtype))
    flops = (
        2 * p.active / tp * new_tokens
        + attention_flops(model, new_tokens, cached_tokens)
        + state_flops_per_token(model) * new_tokens
    )
    kv = model.kv_bytes_per_token
    bytes_ = (
        _weights(p, new_tokens) / tp * wbytes
        + kv * (cached_tokens + new_tokens)  # read the context
        + kv * new_tokens  # write the new tokens
        + 2 * _state_bytes(model)
    )
    return _step(
        model, gpu, flops=flops, bytes_=bytes_, weight_dtype=weight_dtype, mfu=mfu, mbu=mbu
    )


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
    ctx = np.asarray(contexts, np.int64)
    if ctx.ndim != 1 or ctx.size == 0 or np.any(ctx < 0):
        raise ValueError("contexts must be a non-empty 1-D sequence of token counts >= 0")
    p = _resolve(model, params)
    tp, b = model.tp_size, int(ctx.size)
    wbytes = dtype_bytes(canonical_dtype(weight_dtype))
    # the attention work depends only on the context, so evaluate it once per distinct value
    uniq, counts = np.unique(ctx, return_counts=True)
    attn = float(sum(attention_flops(model, 1, int(c)) * n for c, n in zip(uniq, counts)))
    flops = 2 * p.active / tp * b + attn + state_flops_per_token(model) * b
    kv = model.kv_bytes_per_token
    bytes_ = (
        _weights(p, b) / tp * wbytes + kv * float(ctx.sum()) + kv * b + 2 * _state_bytes(model) * b
    )
    return _step(
        model, gpu, flops=flops, bytes_=bytes_, weight_dtype=weight_dtype, mfu=mfu, mbu=mbu
    )


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
    """:func:`prefill` and :func:`decode_step` times of one model on one GPU, with the per-model
    constants worked out once: the simulator prices hundreds of thousands of steps.

    Gives the same numbers as those functions, bit for bit: the attention FLOPs are a sum of
    integer products, evaluated here as one exact integer and converted once (the functions'
    float sum is exact too while below 2**53; past that this falls back to them). A decode step
    needs only the batch size and the sum of its contexts, unless the model has sliding-window
    layers (then pass ``contexts``)."""

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
        self.kwargs = dict(params=params, weight_dtype=weight_dtype, mfu=mfu, mbu=mbu)
        p = self.params = _resolve(model, params)
        self.tp = model.tp_size
        self.wbytes = dtype_bytes(canonical_dtype(weight_dtype))
        self.per_token = 2 * p.active / self.tp
        self.state_fpt = state_flops_per_token(model)
        self.kv = model.kv_bytes_per_token
        self.state2 = 2 * _state_bytes(model)
        self.peak_flops = gpu.flops(weight_dtype) * mfu
        self.peak_bw = gpu.hbm_bandwidth * mbu
        full = 0
        windows: list[tuple[int, int]] = []
        for layer in model.attention_layers:
            spec = layer.spec
            if isinstance(spec, MLASpec):
                full += (
                    2 * (spec.num_heads // spec.tp_size) * (spec.latent_dim + spec.kv_lora_rank)
                )
                continue
            assert isinstance(spec, FullAttentionSpec)
            dv = spec.head_dim_v or spec.head_dim
            per_ctx = 2 * spec.heads_per_rank * (spec.head_dim + dv)
            w = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            if w is None:
                full += per_ctx
            else:
                windows.append((per_ctx, w))
        self.full_per_ctx = full
        self.windows = tuple(windows)

    def _attention(self, new: int, cached: int) -> float:
        exact = self.full_per_ctx * _context_sum(new, cached, None)
        for per_ctx, w in self.windows:
            exact += per_ctx * _context_sum(new, cached, w)
        if exact < _EXACT:
            return float(exact)
        return attention_flops(self.model, new, cached)  # pragma: no cover - huge contexts

    def prefill_flops(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """The FLOPs of :func:`prefill` (one rank)."""
        return (
            self.per_token * new_tokens
            + self._attention(new_tokens, cached_tokens)
            + self.state_fpt * new_tokens
        )

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """``prefill(...).time_s``."""
        if new_tokens < 1 or cached_tokens < 0:
            raise ValueError(
                f"need new_tokens >= 1 and cached_tokens >= 0, got {new_tokens}, {cached_tokens}"
            )
        flops = self.prefill_flops(new_tokens, cached_tokens)
        bytes_ = (
            _weights(self.params, new_tokens) / self.tp * self.wbytes
            + self.kv * (cached_tokens + new_tokens)
            + self.kv * new_tokens
            + self.state2
        )
        return max(flops / self.peak_flops, bytes_ / self.peak_bw)

    def decode_s(
        self, batch: int, context_sum: int, contexts: Sequence[int] | None = None
    ) -> float:
        """``decode_step(...).time_s`` of ``batch`` requests whose contexts sum to
        ``context_sum`` (``contexts``: the values themselves, needed for sliding windows)."""
        if batch < 1:
            raise ValueError(f"a decode step needs a batch of at least 1, got {batch}")
        attn = self.full_per_ctx * (context_sum + batch)  # sum of (context + 1)
        if self.windows or attn >= _EXACT:
            if contexts is None:
                raise ValueError("this model has sliding-window layers: pass contexts")
            return decode_step(self.model, self.gpu, contexts, **self.kwargs).time_s
        flops = self.per_token * batch + float(attn) + self.state_fpt * batch
        bytes_ = (
            _weights(self.params, batch) / self.tp * self.wbytes
            + self.kv * float(context_sum)
            + self.kv * batch
            + self.state2 * batch
        )
        return max(flops / self.peak_flops, bytes_ / self.peak_bw)


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
