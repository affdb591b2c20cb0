"""Layout strategies: turn a model, a memory budget and scheduler limits into a memory plan.

>>> from hybridkv import models, layouts
>>> plan = layouts.make_plan(models.load("qwen3.5-4b"), "inflate", memory="40GiB")
>>> plan.block_size  # vLLM 0.33 on Hopper, prefix caching on: a multiple of lcm(16, 64)
576
>>> no_pc = layouts.VllmTarget(enable_prefix_caching=False)
>>> model = models.load("qwen3.5-4b")
>>> layouts.make_plan(model, "inflate", memory="40GiB", target=no_pc).block_size
528

GLM-5-Next and Qwen4-Exp in vLLM's cache formats (``VllmTarget(cache_formats="vllm")``) have a
vLLM layout of their own, pages of different sizes packed block-outermost, which ``inflate`` then
plans (:mod:`.vllm_packed`); the other layouts refuse those formats.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..models.model import HybridModel
from ..plan import MemoryPlan, PlanConfig
from ..specs import IndexerSpec
from ..target import QWEN4_EXP_FAMILIES, VllmTarget
from ..units import parse_bytes
from ._common import PlanTooSmall
from .per_group import plan_per_group
from .shared import auto_pack_size, plan_shared
from .two_level import plan_two_level
from .vllm_packed import plan_vllm_packed, uses_vllm_packing

LAYOUTS = ("inflate", "pack", "aggregate", "per_group", "two_level")

__all__ = ["LAYOUTS", "PlanTooSmall", "VllmTarget", "make_plan", "plan_all"]


def make_plan(
    model: HybridModel,
    layout: str,
    *,
    memory: int | str | None = None,
    fit_tokens: int | None = None,
    max_num_seqs: int = 256,
    block_size: int | None = None,
    pack_size: int | str = "auto",
    state_slots_per_seq: int = 1,
    cache_state_slots: int = 0,
    kernel_alignment: int | None = None,
    target: VllmTarget | None = None,
) -> MemoryPlan:
    """Plan ``model`` (already :meth:`~HybridModel.configure`-d for TP and dtypes) with
    ``layout`` in ``memory`` bytes per rank (an int or a string such as ``"40GiB"``).

    ``target`` is the vLLM whose rules decide the shared-pool block size (default: vLLM 0.33 with
    its defaults on Hopper, i.e. prefix caching on and the Mamba cache in ``align`` mode); e.g.
    ``VllmTarget(enable_prefix_caching=False)`` or ``VllmTarget(version="0.32")``.

    ``fit_tokens=N`` instead of ``memory``: the smallest plan of ``layout`` whose
    :attr:`~hybridkv.plan.Capacity.token_capacity` is at least ``N`` once ``max_num_seqs``
    requests hold their states (found by bisection over the budget, to the byte).
    """
    if (memory is None) == (fit_tokens is None):
        raise ValueError("give make_plan either memory or fit_tokens, not both or neither")
    config = PlanConfig(
        memory_bytes=1 if memory is None else parse_bytes(memory),
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        state_slots_per_seq=state_slots_per_seq,
        cache_state_slots=cache_state_slots,
        kernel_alignment=kernel_alignment,
        pack_size=pack_size,
        target=target if target is not None else VllmTarget(),
    )
    if fit_tokens is not None:
        return _smallest_fit(model, layout, config, fit_tokens)
    return plan_with_config(model, layout, config)


#: the largest budget :func:`make_plan` tries for ``fit_tokens`` (an exbibyte)
_MAX_FIT_BYTES = 1 << 60


def _smallest_fit(model: HybridModel, layout: str, config: PlanConfig, tokens: int) -> MemoryPlan:
    """The plan of the smallest budget whose token capacity reaches ``tokens``: a budget that
    fits, found by doubling, then bisection down to the byte where one less does not fit."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise ValueError(f"fit_tokens must be a positive number of tokens, got {tokens!r}")

    def plan_at(memory: int) -> MemoryPlan | None:
        try:
            plan = plan_with_config(model, layout, replace(config, memory_bytes=memory))
        except ValueError:
            return None
        return plan if plan.capacity.token_capacity >= tokens else None

    # errors that are not about the budget (a bad block size, an unknown layout) surface here
    largest = plan_with_config(model, layout, replace(config, memory_bytes=_MAX_FIT_BYTES))
    if largest.capacity.token_capacity < tokens:
        raise ValueError(
            f"{model.name} with {layout} cannot hold {tokens} tokens in any budget up to "
            f"{_MAX_FIT_BYTES} B (it holds {largest.capacity.token_capacity})"
        )
    lo, hi = 0, max(1, tokens * model.kv_bytes_per_token)  # lo never fits
    best = plan_at(hi)
    while best is None:
        lo, hi = hi, min(2 * hi, _MAX_FIT_BYTES)
        best = largest if hi == _MAX_FIT_BYTES else plan_at(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        plan = plan_at(mid)
        if plan is None:
            lo = mid
        else:
            hi, best = mid, plan
    return best


def plan_with_config(model: HybridModel, layout: str, config: PlanConfig) -> MemoryPlan:
    return _check_interleave(model, _plan_layout(model, layout, config))


def _check_interleave(model: HybridModel, plan: MemoryPlan) -> MemoryPlan:
    """vLLM's ``VllmConfig.validate_block_size`` under DCP: the interleave (the tokens a rank
    keeps in a row) at most a block's rows, and dividing them, in every sharded group."""
    interleave = model.cp_kv_cache_interleave_size
    for g in plan.groups:
        if g.dcp_size > 1 and g.rows_per_block % interleave:
            raise ValueError(
                f"{model.name} with layout {plan.layout!r}: group {g.group_id}'s blocks hold "
                f"{g.rows_per_block} rows a rank, which --cp-kv-cache-interleave-size "
                f"{interleave} does not divide; vLLM 0.33 asserts that the block size is at "
                "least the interleave and a multiple of it (VllmConfig.validate_block_size); "
                f"give a --block-size that is a multiple of {interleave}, or a smaller interleave"
            )
    return plan


def _plan_layout(model: HybridModel, layout: str, config: PlanConfig) -> MemoryPlan:
    target = config.target
    # decode context parallelism: vLLM 0.32 and 0.33 shard the same groups beside Mamba and
    # resolve the same spans, hash block and hit alignment (resolve_dcp_kv_block_size,
    # partial_hash_hits_enabled, resolve_kv_cache_block_sizes, the hybrid coordinator's check
    # and ModelConfig's are equal in both), so the plans follow one rule for both
    if (
        target.indexer_kv_dtype != "auto"
        and model.family_key in QWEN4_EXP_FAMILIES
        and not uses_vllm_packing(model, target.cache_formats)
        and any(isinstance(layer.spec, IndexerSpec) for layer in model.layers)
    ):
        # transformers' per-token indexer rows keep the model dtype: the option would change
        # nothing here, while it changes vLLM's compressed keys
        raise ValueError(
            f"indexer_kv_dtype {target.indexer_kv_dtype!r} is the dtype of Qwen4-Exp's compressed "
            "QSA keys in vLLM's cache formats; this plan keeps transformers' per-token rows in "
            "the model dtype; plan with cache_formats='vllm' (--cache-formats vllm), or leave "
            "indexer_kv_dtype at 'auto'"
        )
    if uses_vllm_packing(model, config.target.cache_formats):
        # vLLM's formats of GLM-5-Next's and Qwen4-Exp's indexers exist in vLLM's own layout
        # only; the other layouts would silently plan transformers' formats instead
        if layout != "inflate":
            raise ValueError(
                f"cache_formats='vllm' lays {model.name} out as vLLM 0.33 does, which is layout "
                f"'inflate', not {layout!r}; use --layout inflate, or cache_formats='transformers'"
            )
        return plan_vllm_packed(model, config)
    if layout == "inflate":
        return plan_shared(model, config, layout="inflate", pack_size=1)
    if layout == "pack":
        n = config.pack_size
        if n == "auto":
            n = auto_pack_size(model, config)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"pack_size must be a positive integer or 'auto', got {n!r}")
        return plan_shared(model, config, layout="pack", pack_size=n)
    if layout == "aggregate":
        return plan_shared(model, config, layout="aggregate", pack_size=None)
    if layout == "per_group":
        return plan_per_group(model, config)
    if layout == "two_level":
        return plan_two_level(model, config)
    raise ValueError(f"unknown layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")


def plan_all(model: HybridModel, **kwargs: Any) -> dict[str, MemoryPlan]:
    """Every layout for the same model and budget (``hybridkv compare``)."""
    return {layout: make_plan(model, layout, **kwargs) for layout in LAYOUTS}
