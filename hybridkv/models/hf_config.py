"""Read a Hugging Face ``config.json`` into a :class:`HybridModel`.

Each family names its layer pattern and state dimensions differently; the table
:data:`FAMILIES` maps ``model_type`` to a reader. Readers take only what the cache needs and fail
with the missing key and the model type rather than guessing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .model import HybridModel

__all__ = ["FAMILIES", "parse_hf_config"]


class _Config:
    """A config dict with errors that name the model type and the missing key."""

    def __init__(self, data: dict[str, Any]):
        self.data = data
        self.model_type = data.get("model_type", "?")

    def get(self, *keys: str, default: Any = ...) -> Any:
        for key in keys:
            if self.data.get(key) is not None:
                return self.data[key]
        if default is not ...:
            return default
        names = " or ".join(repr(k) for k in keys)
        raise ValueError(f"config for model_type {self.model_type!r} has no {names}")

    def head_dim(self) -> int:
        if self.data.get("head_dim") is not None:
            return self.data["head_dim"]
        return self.get("hidden_size") // self.get("num_attention_heads")

    def attention(self, layers: list[int], **extra: Any) -> dict[str, Any]:
        heads = self.get("num_attention_heads")
        return {
            "kind": "full_attention",
            "num_heads": heads,
            "num_kv_heads": self.get("num_key_value_heads", default=heads),
            "head_dim": self.head_dim(),
            "layers": layers,
            **extra,
        }


def _mamba2(c: _Config, layers: list[int], *, prefix: str = "mamba_") -> dict[str, Any]:
    """Mamba-2 dims under NemotronH's names (``mamba_num_heads``, ``ssm_state_size``, ...) or
    Granite/Bamba/Falcon-H1's (``mamba_n_heads``, ``mamba_d_state``, ...)."""
    heads = c.get("mamba_num_heads", "mamba_n_heads")
    return {
        "kind": "mamba2",
        "num_heads": heads,
        "head_dim": c.get("mamba_head_dim", "mamba_d_head"),
        "n_groups": c.get("n_groups", "mamba_n_groups", default=1),
        "d_state": c.get("ssm_state_size", "mamba_d_state"),
        "d_conv": c.get("conv_kernel", "mamba_d_conv"),
        "layers": layers,
    }


def _pattern_from_types(c: _Config, attention: set[str]) -> tuple[list[int], list[int]]:
    types = c.get("layer_types", "layers_block_type")
    n = c.get("num_hidden_layers", default=len(types))
    if len(types) != n:
        raise ValueError(
            f"config for model_type {c.model_type!r}: layer_types has {len(types)} entries but "
            f"num_hidden_layers is {n}"
        )
    attn = [i for i, t in enumerate(types) if t in attention]
    return attn, [i for i, t in enumerate(types) if t not in attention]


def _qwen_gdn(c: _Config) -> list[dict[str, Any]]:
    n = c.get("num_hidden_layers")
    if c.data.get("layer_types"):
        attn, state = _pattern_from_types(c, {"full_attention"})
    else:
        interval = c.get("full_attention_interval")
        attn = [i for i in range(n) if (i + 1) % interval == 0]
        state = [i for i in range(n) if (i + 1) % interval]
    gdn = {
        "kind": "gated_deltanet",
        "num_k_heads": c.get("linear_num_key_heads"),
        "num_v_heads": c.get("linear_num_value_heads"),
        "head_k_dim": c.get("linear_key_head_dim"),
        "head_v_dim": c.get("linear_value_head_dim"),
        "conv_kernel": c.get("linear_conv_kernel_dim"),
        "layers": state,
    }
    return [c.attention(attn), gdn]


def _nemotron_h(c: _Config) -> list[dict[str, Any]]:
    pattern = c.get("hybrid_override_pattern")
    # M: Mamba-2, *: attention, -: MLP, E: MoE (the last two hold no cache)
    attn = [i for i, ch in enumerate(pattern) if ch == "*"]
    mamba = [i for i, ch in enumerate(pattern) if ch == "M"]
    return [c.attention(attn), _mamba2(c, mamba)]


def _granite_bamba(c: _Config) -> list[dict[str, Any]]:
    if c.data.get("layer_types"):
        attn, state = _pattern_from_types(c, {"attention"})
    else:
        n = c.get("num_hidden_layers")
        attn = list(c.get("attn_layer_indices"))
        state = [i for i in range(n) if i not in set(attn)]
    return [c.attention(attn), _mamba2(c, state)]


def _falcon_h1(c: _Config) -> list[dict[str, Any]]:
    # attention and Mamba-2 run in parallel in every decoder layer
    layers = list(range(c.get("num_hidden_layers")))
    mamba = _mamba2(c, layers)
    d_ssm = c.data.get("mamba_d_ssm")
    if d_ssm is not None and d_ssm != mamba["num_heads"] * mamba["head_dim"]:
        raise ValueError(
            f"config for model_type 'falcon_h1': mamba_d_ssm={d_ssm} is not mamba_n_heads * "
            f"mamba_d_head; this reader expects them to agree"
        )
    return [c.attention(layers), mamba]


def _jamba(c: _Config) -> list[dict[str, Any]]:
    n = c.get("num_hidden_layers")
    if c.data.get("layers_block_type"):
        attn, state = _pattern_from_types(c, {"attention"})
    else:
        period, offset = c.get("attn_layer_period"), c.get("attn_layer_offset")
        attn = [i for i in range(n) if i % period == offset]
        state = [i for i in range(n) if i % period != offset]
    mamba = {
        "kind": "mamba1",
        "d_inner": c.get("mamba_expand") * c.get("hidden_size"),
        "d_state": c.get("mamba_d_state"),
        "d_conv": c.get("mamba_d_conv"),
        "layers": state,
    }
    return [c.attention(attn), mamba]


def _zamba2(c: _Config) -> list[dict[str, Any]]:
    n = c.get("num_hidden_layers")
    if c.data.get("hybrid_layer_ids") is not None:
        attn = list(c.get("hybrid_layer_ids"))
    else:
        attn, _ = _pattern_from_types(c, {"hybrid"})
    heads = c.get("num_attention_heads")
    attention = {
        "kind": "full_attention",
        "num_heads": heads,
        "num_kv_heads": c.get("num_key_value_heads", default=heads),
        # Zamba2's shared block attends over the concatenated (2 * hidden) input
        "head_dim": c.get("attention_head_dim", default=2 * c.get("hidden_size") // heads),
        "layers": attn,
    }
    mamba = {
        "kind": "mamba2",
        "num_heads": c.get("n_mamba_heads"),
        "head_dim": c.get("mamba_headdim"),
        "n_groups": c.get("mamba_ngroups", default=1),
        "d_state": c.get("mamba_d_state"),
        "d_conv": c.get("mamba_d_conv"),
        "layers": list(range(n)),
    }
    return [attention, mamba]


def _lfm2(c: _Config) -> list[dict[str, Any]]:
    n = c.get("num_hidden_layers")
    if c.data.get("layer_types"):
        attn, state = _pattern_from_types(c, {"full_attention"})
    else:
        attn = list(c.get("full_attn_idxs"))
        state = [i for i in range(n) if i not in set(attn)]
    conv = {
        "kind": "short_conv",
        "conv_dim": c.get("conv_dim", "hidden_size"),
        "conv_kernel": c.get("conv_L_cache"),
        "layers": state,
    }
    return [c.attention(attn), conv]


def _minimax(c: _Config) -> list[dict[str, Any]]:
    types = c.get("attn_type_list")  # 0: lightning (linear) attention, 1: softmax attention
    attn = [i for i, t in enumerate(types) if t == 1]
    linear = [i for i, t in enumerate(types) if t == 0]
    state = {
        "kind": "linear_attention",
        "num_heads": c.get("num_attention_heads"),
        "head_dim": c.head_dim(),
        "layers": linear,
    }
    return [c.attention(attn), state]


def _kimi_linear(c: _Config) -> list[dict[str, Any]]:
    lin = _Config({**c.get("linear_attn_config"), "model_type": c.model_type})
    # the config lists layers 1-based
    kda = [i - 1 for i in lin.get("kda_layers")]
    full = [i - 1 for i in lin.get("full_attn_layers")]
    mla = {
        "kind": "mla",
        "num_heads": c.get("num_attention_heads"),
        "kv_lora_rank": c.get("kv_lora_rank"),
        "qk_rope_head_dim": c.get("qk_rope_head_dim"),
        "layers": full,
    }
    state = {
        "kind": "kda",
        "num_heads": lin.get("num_heads"),
        "head_dim": lin.get("head_dim"),
        "conv_kernel": lin.get("short_conv_kernel_size"),
        "layers": kda,
    }
    return [mla, state]


def _recurrent_gemma(c: _Config) -> list[dict[str, Any]]:
    n = c.get("num_hidden_layers")
    blocks = c.get("block_types")
    types = [blocks[i % len(blocks)] for i in range(n)]
    attn = [i for i, t in enumerate(types) if t == "attention"]
    rec = [i for i, t in enumerate(types) if t == "recurrent"]
    window = c.get("attention_window_size", "sliding_window")
    attention = c.attention(attn, kind="sliding_window", sliding_window=window)
    lru = {
        "kind": "rglru",
        "lru_width": c.get("lru_width", "hidden_size"),
        "conv_kernel": c.get("conv1d_width"),
        "layers": rec,
    }
    return [attention, lru]


FAMILIES: dict[str, Callable[[_Config], list[dict[str, Any]]]] = {
    "qwen3_next": _qwen_gdn,
    "qwen3_5": _qwen_gdn,
    "qwen3_5_text": _qwen_gdn,
    "qwen3_5_moe": _qwen_gdn,
    "qwen3_5_moe_text": _qwen_gdn,
    "nemotron_h": _nemotron_h,
    "granitemoehybrid": _granite_bamba,
    "bamba": _granite_bamba,
    "falcon_h1": _falcon_h1,
    "jamba": _jamba,
    "zamba2": _zamba2,
    "lfm2": _lfm2,
    "minimax_text_01": _minimax,
    "minimax": _minimax,
    "minimax_m1": _minimax,
    "kimi_linear": _kimi_linear,
    "recurrent_gemma": _recurrent_gemma,
}


def _read(path_or_dict: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(path_or_dict, dict):
        return path_or_dict
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json at {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def parse_hf_config(
    path_or_dict: str | Path | dict[str, Any], *, name: str | None = None
) -> HybridModel:
    """A :class:`HybridModel` from a Hugging Face config (file, folder or dict)."""
    outer = _read(path_or_dict)
    data = dict(outer.get("text_config") or outer)
    # multimodal wrappers keep the dtype and the model type on the outer config
    data.setdefault("torch_dtype", outer.get("torch_dtype") or outer.get("dtype"))
    model_type = data.get("model_type") or outer.get("model_type")
    if model_type not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise ValueError(
            f"model_type {model_type!r} is not a supported hybrid family; supported: {known}"
        )
    data["model_type"] = model_type
    c = _Config(data)
    mixers = [m for m in FAMILIES[model_type](c) if m["layers"]]
    declared = data.get("mamba_ssm_dtype") or data.get("mamba_ssm_cache_dtype")
    dtype = data.get("torch_dtype") or "bfloat16"
    archs = outer.get("architectures") or [model_type]
    return HybridModel.from_dict(
        {
            "name": name or outer.get("_name_or_path") or archs[0],
            "family": model_type,
            "num_hidden_layers": c.get("num_hidden_layers"),
            "torch_dtype": dtype,
            "ssm_dtype_declared": declared if declared not in (None, "auto") else None,
            "max_position_embeddings": data.get("max_position_embeddings"),
            "mixers": mixers,
            "sources": ["Hugging Face config.json"],
        }
    )
