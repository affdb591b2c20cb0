"""Parameter counts read off a Hugging Face config: the model built by transformers on the
``meta`` device (shapes only: no weights, no memory), its parameters counted.

The roofline (:mod:`hybridkv.costmodel`) needs a model's total and active parameters. The zoo
stores them from model cards; a model read from a user's ``config.json`` that the zoo does not
know has none, and its ``simulate`` / ``advise`` would stop there. Counting the parameters of the
model transformers itself builds from the config covers every family transformers ships:

- **total**: every parameter of the language model and its output head, tied embeddings once;
  a multimodal model's vision or audio tower is left out (a text step never runs it);
- **active**: total minus the routed experts' share a token does not use: every module whose
  class name ends in ``Experts`` (transformers' fused routed experts, ``[num_experts, ...]``
  weights) counts ``top_k / num_experts`` of its parameters (``num_experts_per_tok`` over
  ``num_experts`` / ``n_routed_experts`` / ``num_local_experts``); shared experts and dense MLPs
  count whole.

A model card's "A3B" usually leaves the embeddings out, so these counts run a little above it
(Qwen3-Next-80B-A3B: 79.7B total, 3.9B active here, 80B / 3B on its card).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from .model import ParamCount

__all__ = ["language_model_from_config", "params_from_config"]

#: module-name parts of towers a text-only step never runs
_TOWERS = ("visual", "vision", "audio", "image_encoder", "mm_projector", "multi_modal_projector")
_NUM_EXPERTS_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def language_model_from_config(config: Any) -> Any:
    """transformers' model for ``config`` (a ``PretrainedConfig``) that runs text: its causal LM,
    else, for a multimodal config with no causal-LM class (GLM-5-Next), its image-text-to-text
    model, whose language model runs on text alone. Built where the caller's torch device
    context says (``meta`` for a count, the CPU for a tiny model)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        return AutoModelForCausalLM.from_config(config)
    except ValueError:
        if getattr(config, "text_config", None) is None:
            raise
        return AutoModelForImageTextToText.from_config(config)


def params_from_config(config: dict[str, Any]) -> ParamCount:
    """Total and active parameters of the model ``config`` (a ``config.json``'s dict) describes,
    counted on transformers' own build of it; see the module docstring. Raises ValueError,
    naming what to do instead, when transformers cannot build it."""
    return _count(json.dumps(config, sort_keys=True))


@lru_cache(maxsize=16)
def _count(config_json: str) -> ParamCount:
    """Cached by the config's text: a sweep reads the same config once per layout."""
    import torch
    import transformers
    from transformers import AutoConfig

    data = json.loads(config_json)
    model_type = data.get("model_type")
    fix = (
        "use a zoo model, or pass params=ParamCount(total, active, source) to the cost model "
        "or simulator"
    )
    if not isinstance(model_type, str):
        raise ValueError(f"the config has no model_type, so transformers cannot build it; {fix}")
    try:
        fields = {k: v for k, v in data.items() if k != "model_type"}
        cfg = AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError) as exc:
        raise ValueError(
            f"transformers {transformers.__version__} does not know model_type {model_type!r} "
            f"({exc}); {fix}"
        ) from None
    try:
        with torch.device("meta"):
            model = language_model_from_config(cfg)
    except Exception as exc:  # transformers' own code: any failure means no count
        raise ValueError(
            f"transformers {transformers.__version__} could not build {model_type!r} from this "
            f"config ({type(exc).__name__}: {exc}); {fix}"
        ) from exc
    text = cfg.get_text_config()
    num_experts = next((getattr(text, k) for k in _NUM_EXPERTS_KEYS if getattr(text, k, 0)), 0)
    top_k = getattr(text, "num_experts_per_tok", 0) or 0
    total = routed = 0
    seen: set[int] = set()  # tied weights (embeddings and output head) count once
    for name, module in model.named_modules():
        if any(part in name for part in _TOWERS):
            continue
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
            if type(module).__name__.endswith("Experts") and num_experts:
                routed += p.numel()
    if routed and not 0 < top_k <= num_experts:
        raise ValueError(
            f"{model_type}: routed experts found but num_experts_per_tok = {top_k} of "
            f"{num_experts} experts; {fix}"
        )
    active = total - routed + (routed * top_k // num_experts if routed else 0)
    source = (
        f"counted from the config: transformers {transformers.__version__}'s "
        f"{type(model).__name__} on the meta device"
        + (f", routed experts at {top_k} of {num_experts}" if routed else "")
    )
    return ParamCount(float(total), float(active), source)
