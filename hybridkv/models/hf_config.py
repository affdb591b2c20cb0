"""Read a Hugging Face ``config.json`` into a :class:`HybridModel`.

Each family names its layer pattern and state dimensions differently; :data:`FAMILIES` maps a
``model_type`` to a reader (and :data:`ARCHITECTURES` maps ``architectures`` entries to a model
type when ``model_type`` is missing or unknown). Readers take only what the cache needs. They
raise a ``ValueError`` naming the missing key and the model type rather than guessing; the few
defaults they apply are the ones ``transformers`` applies to the same field, noted where used.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from .model import HybridModel

__all__ = ["ARCHITECTURES", "FAMILIES", "parse_hf_config"]

_MISSING: Any = object()

# transformers >= 5 renames the legacy layer types "attention" -> "full_attention" and
# "mamba" -> "linear_attention" when it saves a config; both spellings are read.
_ATTENTION = {"attention", "full_attention"}
_MAMBA = {"mamba", "linear_attention"}


class _Config:
    """A config dict whose lookups fail with the model type and the missing key."""

    def __init__(self, data: dict[str, Any], model_type: str):
        self.data = data
        self.model_type = model_type
        self.n: int | None = None  # decoder layers, set by num_layers()

    def error(self, message: str) -> ValueError:
        return ValueError(f"config for model_type {self.model_type!r}: {message}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, *keys: str, default: Any = _MISSING) -> Any:
        """The first of ``keys`` that is set (not null); ``default`` if given, else raise."""
        for key in keys:
            if self.data.get(key) is not None:
                return self.data[key]
        if default is not _MISSING:
            return default
        names = " or ".join(repr(k) for k in keys)
        raise ValueError(f"config for model_type {self.model_type!r} has no {names}")

    def num_layers(self, types: Sequence[Any] | None = None, what: str = "layer_types") -> int:
        """``num_hidden_layers``, checked against a per-layer list when there is one."""
        if types is None:
            n = self.get("num_hidden_layers")
        else:
            # transformers >= 5 derives NemotronH's layer count from its list alone
            n = self.get("num_hidden_layers", default=len(types))
            if len(types) != n:
                raise self.error(f"{what} has {len(types)} entries but num_hidden_layers is {n}")
        if not isinstance(n, int) or n <= 0:
            raise self.error(f"num_hidden_layers must be a positive integer, got {n!r}")
        self.n = n
        return n

    def head_dim(self, *keys: str) -> int:
        """``head_dim`` (or the family's name for it); like transformers, default to
        ``hidden_size // num_attention_heads`` when the config does not give it."""
        for key in (*keys, "head_dim"):
            if self.has(key):
                return self.data[key]
        return self.get("hidden_size") // self.get("num_attention_heads")

    def attention(self, layers: list[int], *, head_dim: int | None = None, **extra: Any):
        heads = self.get("num_attention_heads")
        return {
            "kind": "full_attention",
            "num_heads": heads,
            # transformers' backward-compatible default: no num_key_value_heads means MHA
            "num_kv_heads": self.get("num_key_value_heads", default=heads),
            "head_dim": head_dim if head_dim is not None else self.head_dim(),
            "layers": layers,
            **extra,
        }


def _split(
    c: _Config,
    types: Iterable[Any],
    *,
    attention: Iterable[Any],
    state: Iterable[Any],
    both: Iterable[Any] = (),
    none: Iterable[Any] = (),
    what: str = "layer_types",
) -> tuple[list[int], list[int]]:
    """Attention and state layer indices from a per-layer type list; unknown types raise."""
    attention, state, both, none = set(attention), set(state), set(both), set(none)
    attn: list[int] = []
    rec: list[int] = []
    for i, t in enumerate(types):
        if t in attention or t in both:
            attn.append(i)
        if t in state or t in both:
            rec.append(i)
        if t not in attention | state | both | none:
            known = ", ".join(repr(k) for k in sorted(attention | state | both | none, key=str))
            raise c.error(f"{what}[{i}] is {t!r}; expected one of {known}")
    return attn, rec


def _check_partition(c: _Config, n: int, *groups: list[int]) -> None:
    seen = sorted(i for g in groups for i in g)
    if seen != list(range(n)):
        raise c.error(
            f"the attention and state layer lists do not cover layers 0..{n - 1} exactly once"
        )


# ---- families ---------------------------------------------------------------------------------


def _qwen_gdn(c: _Config) -> list[dict[str, Any]]:
    """Qwen3-Next and Qwen3.5: ``layer_types`` or ``full_attention_interval``."""
    if c.has("layer_types"):
        types = c.get("layer_types")
        n = c.num_layers(types)
        attn, state = _split(c, types, attention={"full_attention"}, state={"linear_attention"})
    else:
        n = c.num_layers()
        interval = c.get("full_attention_interval")
        if not isinstance(interval, int) or interval <= 0:
            raise c.error(f"full_attention_interval must be a positive integer, got {interval!r}")
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


def _mamba2(
    c: _Config,
    layers: list[int],
    *,
    heads: int,
    head_dim: int,
    groups: Sequence[str],
    groups_default: int,
    d_state: Sequence[str],
    d_conv: Sequence[str],
) -> dict[str, Any]:
    return {
        "kind": "mamba2",
        "num_heads": heads,
        "head_dim": head_dim,
        "n_groups": c.get(*groups, default=groups_default),
        "d_state": c.get(*d_state),
        # every transformers Mamba-2 config defaults the conv kernel to 4
        "d_conv": c.get(*d_conv, default=4),
        "layers": layers,
    }


_NEMOTRON_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def _nemotron_h(c: _Config) -> list[dict[str, Any]]:
    """NemotronH: ``hybrid_override_pattern`` (``M`` Mamba-2, ``*`` attention, ``-`` MLP,
    ``E`` MoE), or the ``layers_block_type`` list that transformers >= 5 writes instead."""
    pattern = c.get("hybrid_override_pattern", "layers_block_type", "layer_types")
    if isinstance(pattern, str):
        bad = sorted(set(pattern) - set(_NEMOTRON_PATTERN))
        if bad:
            raise c.error(
                f"hybrid_override_pattern has unknown characters {bad}; expected M (Mamba-2), "
                "* (attention), - (MLP) or E (MoE)"
            )
        types: list[str] = [_NEMOTRON_PATTERN[ch] for ch in pattern]
        what = "hybrid_override_pattern"
    else:
        types, what = pattern, "layers_block_type"
    c.num_layers(types, what)
    attn, state = _split(
        c,
        types,
        attention=_ATTENTION,
        state=_MAMBA,
        none={"mlp", "moe"},  # MLP / MoE-only layers hold no cache
        what=what,
    )
    mamba = _mamba2(
        c,
        state,
        heads=c.get("mamba_num_heads"),
        head_dim=c.get("mamba_head_dim"),
        groups=("n_groups", "mamba_n_groups"),
        groups_default=8,  # transformers' NemotronHConfig default
        d_state=("ssm_state_size", "mamba_d_state"),
        d_conv=("conv_kernel", "mamba_d_conv"),
    )
    # Nemotron-H-56B names it attention_head_dim; transformers' NemotronHConfig defaults to 128
    # (not hidden_size // heads: Nano-9B-v2 has 40 heads of 128 on a 4480 hidden size)
    head_dim = c.get("head_dim", "attention_head_dim", default=128)
    return [c.attention(attn, head_dim=head_dim), mamba]


def _mamba2_ibm(c: _Config, layers: list[int], d_inner: int) -> dict[str, Any]:
    """Mamba-2 dims under Granite / Bamba / Falcon-H1 names; ``mamba_d_head: "auto"`` (or
    absent) is ``d_inner // mamba_n_heads`` as in transformers."""
    heads = c.get("mamba_n_heads")
    d_head = c.get("mamba_d_head", default="auto")
    if d_head == "auto":
        d_head = d_inner // heads
    if d_head * heads != d_inner:
        raise c.error(
            f"mamba_n_heads={heads} x mamba_d_head={d_head} is not the Mamba intermediate size "
            f"{d_inner}; fix mamba_d_head (or mamba_d_ssm / mamba_expand)"
        )
    return _mamba2(
        c,
        layers,
        heads=heads,
        head_dim=d_head,
        groups=("mamba_n_groups",),
        groups_default=1,  # transformers' default for Granite, Bamba and Falcon-H1
        d_state=("mamba_d_state",),
        d_conv=("mamba_d_conv",),
    )


def _granite_bamba(c: _Config) -> list[dict[str, Any]]:
    """GraniteMoeHybrid (``layer_types``) and Bamba (``attn_layer_indices``); as in
    transformers, a config with neither is all Mamba-2."""
    if c.has("layer_types") or c.has("layers_block_type"):
        types = c.get("layer_types", "layers_block_type")
        n = c.num_layers(types)
        attn, state = _split(c, types, attention=_ATTENTION, state=_MAMBA)
    else:
        n = c.num_layers()
        attn = sorted(c.get("attn_layer_indices", default=[]))
        if any(not 0 <= i < n for i in attn):
            raise c.error(f"attn_layer_indices {attn} reach outside 0..{n - 1}")
        state = [i for i in range(n) if i not in set(attn)]
    # transformers: the Mamba intermediate size is mamba_expand (default 2) * hidden_size
    d_inner = c.get("mamba_expand", default=2) * c.get("hidden_size")
    return [c.attention(attn), _mamba2_ibm(c, state, d_inner)]


def _falcon_h1(c: _Config) -> list[dict[str, Any]]:
    """Falcon-H1: attention and Mamba-2 run in parallel in every decoder layer."""
    layers = list(range(c.num_layers()))
    # transformers: mamba_d_ssm if set, else mamba_expand * hidden_size
    d_inner = c.get("mamba_d_ssm", default=None)
    if d_inner is None:
        d_inner = c.get("mamba_expand", default=2) * c.get("hidden_size")
    return [c.attention(layers), _mamba2_ibm(c, layers, d_inner)]


def _jamba(c: _Config) -> list[dict[str, Any]]:
    """Jamba: attention iff ``i % attn_layer_period == attn_layer_offset``, else Mamba-1."""
    if c.has("layers_block_type"):
        types = c.get("layers_block_type")
        c.num_layers(types, "layers_block_type")
        attn, state = _split(c, types, attention=_ATTENTION, state=_MAMBA)
    else:
        n = c.num_layers()
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
    """Zamba2: Mamba-2 in every layer; the 'hybrid' layers also run a shared attention block
    (with its own KV cache per layer). Also reads the pre-transformers Zyphra format
    (``layers_block_type`` of 'g' / 'm', ``state_size``, ``conv_dimension``,
    ``expansion_factor``) that Zamba2-1.2B shipped with."""
    if c.has("layers_block_type"):
        types = c.get("layers_block_type")
        n = c.num_layers(types, "layers_block_type")
        attn, state = _split(
            c,
            types,
            attention=(),
            both={"hybrid", "g"},
            state=_MAMBA | {"m"},
            what="layers_block_type",
        )
    else:
        n = c.num_layers()
        attn = sorted(c.get("hybrid_layer_ids"))
        state = list(range(n))
    hidden = c.get("hidden_size")
    heads = c.get("num_attention_heads")
    # transformers: the shared block attends over concat(hidden, embeddings), so
    # attention_head_dim = 2 * hidden_size // num_attention_heads (it overrides the config)
    attention = c.attention(attn, head_dim=2 * hidden // heads)
    expand = c.get("mamba_expand", "expansion_factor")
    if c.has("n_mamba_heads"):
        m_heads = c.get("n_mamba_heads")
        m_head_dim = expand * hidden // m_heads  # transformers derives mamba_headdim this way
    else:  # pre-transformers format: heads follow from the head size
        m_head_dim = c.get("mamba_headdim")
        m_heads = expand * hidden // m_head_dim
    if m_heads * m_head_dim != expand * hidden:
        raise c.error(
            f"n_mamba_heads={m_heads} does not divide mamba_expand * hidden_size = "
            f"{expand * hidden}"
        )
    mamba = _mamba2(
        c,
        state,
        heads=m_heads,
        head_dim=m_head_dim,
        groups=("mamba_ngroups",),
        groups_default=1,  # transformers' Zamba2Config default
        d_state=("mamba_d_state", "state_size"),
        d_conv=("mamba_d_conv", "conv_dimension"),
    )
    return [attention, mamba]


def _lfm2(c: _Config) -> list[dict[str, Any]]:
    """LFM2: ``layer_types`` ('full_attention' / 'conv') or ``full_attn_idxs``."""
    if c.has("layer_types"):
        types = c.get("layer_types")
        n = c.num_layers(types)
        attn, state = _split(c, types, attention={"full_attention"}, state={"conv"})
    else:
        n = c.num_layers()
        attn = sorted(c.get("full_attn_idxs"))
        state = [i for i in range(n) if i not in set(attn)]
    conv = {
        "kind": "short_conv",
        # vLLM sizes the depthwise conv state on hidden_size channels
        "conv_dim": c.get("hidden_size"),
        # transformers' Lfm2Config default kernel (L_cache) is 3
        "conv_kernel": c.get("conv_L_cache", default=3),
        "layers": state,
    }
    return [c.attention(attn), conv]


def _minimax(c: _Config) -> list[dict[str, Any]]:
    """MiniMax-Text-01 / M1: ``attn_type_list`` (0 lightning, 1 softmax) in the original
    configs, ``layer_types`` in transformers' ``minimax`` port."""
    if c.has("attn_type_list"):
        types = c.get("attn_type_list")
        c.num_layers(types, "attn_type_list")
        attn, linear = _split(c, types, attention={1}, state={0}, what="attn_type_list")
    else:
        types = c.get("layer_types")
        c.num_layers(types)
        attn, linear = _split(c, types, attention={"full_attention"}, state={"linear_attention"})
    state = {
        "kind": "linear_attention",
        "num_heads": c.get("num_attention_heads"),
        "head_dim": c.head_dim(),
        "layers": linear,
    }
    return [c.attention(attn), state]


def _kimi_linear(c: _Config) -> list[dict[str, Any]]:
    """Kimi-Linear: MLA + KDA. The released config lists ``linear_attn_config.kda_layers`` /
    ``full_attn_layers`` **1-based**; transformers >= 5 re-saves them as ``layer_types`` with
    ``linear_num_heads`` / ``linear_head_dim`` / ``linear_conv_kernel_dim``."""
    lin = c.data.get("linear_attn_config") or {}
    if not isinstance(lin, dict):
        raise c.error("linear_attn_config must be an object")
    sub = _Config(lin, c.model_type)

    def pick(nested: str, flat: str) -> int:
        if sub.has(nested):
            return lin[nested]
        if c.has(flat):
            return c.data[flat]
        raise ValueError(
            f"config for model_type {c.model_type!r} has no 'linear_attn_config.{nested}' "
            f"or {flat!r}"
        )

    if sub.has("kda_layers") or sub.has("full_attn_layers"):
        full = [i - 1 for i in sub.get("full_attn_layers")]
        kda = [i - 1 for i in sub.get("kda_layers")]
        n = c.num_layers()
        _check_partition(c, n, full, kda)
    else:
        types = c.get("layer_types")
        c.num_layers(types)
        full, kda = _split(c, types, attention={"full_attention"}, state={"linear_attention"})
    mla = {
        "kind": "mla",
        "num_heads": c.get("num_attention_heads"),
        "kv_lora_rank": c.get("kv_lora_rank"),
        "qk_rope_head_dim": c.get("qk_rope_head_dim"),
        "layers": sorted(full),
    }
    state = {
        "kind": "kda",
        "num_heads": pick("num_heads", "linear_num_heads"),
        "head_dim": pick("head_dim", "linear_head_dim"),
        "conv_kernel": pick("short_conv_kernel_size", "linear_conv_kernel_dim"),
        "layers": sorted(kda),
    }
    return [mla, state]


def _recurrent_gemma(c: _Config) -> list[dict[str, Any]]:
    """RecurrentGemma: ``block_types`` cycled over the layers; local attention + RG-LRU."""
    n = c.num_layers()
    blocks = c.get("block_types")
    if not blocks:
        raise c.error("block_types is empty")
    types = [blocks[i % len(blocks)] for i in range(n)]
    attn, rec = _split(c, types, attention={"attention"}, state={"recurrent"}, what="block_types")
    attention = c.attention(
        attn,
        kind="sliding_window",
        sliding_window=c.get("attention_window_size", "sliding_window"),
    )
    lru = {
        "kind": "rglru",
        # transformers: lru_width defaults to hidden_size
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
    "minimax_m1": _minimax,
    "minimax": _minimax,
    "kimi_linear": _kimi_linear,
    "recurrent_gemma": _recurrent_gemma,
}

#: ``architectures`` entries -> model type, for configs without a (known) ``model_type``.
ARCHITECTURES: dict[str, str] = {
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "NemotronHForCausalLM": "nemotron_h",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "BambaForCausalLM": "bamba",
    "FalconH1ForCausalLM": "falcon_h1",
    "JambaForCausalLM": "jamba",
    "Zamba2ForCausalLM": "zamba2",
    "Lfm2ForCausalLM": "lfm2",
    "MiniMaxText01ForCausalLM": "minimax_text_01",
    "MiniMaxM1ForCausalLM": "minimax_m1",
    "MiniMaxForCausalLM": "minimax",
    "KimiLinearForCausalLM": "kimi_linear",
    "RecurrentGemmaForCausalLM": "recurrent_gemma",
}


def _read(path_or_dict: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(path_or_dict, dict):
        return path_or_dict
    if not isinstance(path_or_dict, (str, Path)):
        raise ValueError(
            "expected a path to config.json, a folder holding one, or a dict; got "
            f"{type(path_or_dict).__name__}"
        )
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


def _model_type(outer: dict[str, Any], inner: dict[str, Any]) -> str:
    for candidate in (inner.get("model_type"), outer.get("model_type")):
        if isinstance(candidate, str) and candidate.lower() in FAMILIES:
            return candidate.lower()
    for arch in outer.get("architectures") or inner.get("architectures") or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    given = inner.get("model_type") or outer.get("model_type")
    known = ", ".join(sorted(FAMILIES))
    raise ValueError(
        f"model_type {given!r} (architectures {outer.get('architectures')}) is not a "
        f"supported hybrid family; supported model types: {known}"
    )


def parse_hf_config(
    path_or_dict: str | Path | dict[str, Any], *, name: str | None = None
) -> HybridModel:
    """A :class:`HybridModel` from a Hugging Face config (file, folder or dict).

    Multimodal wrappers (Qwen3.5) keep the language model under ``text_config``; it is read
    from there, with the outer config filling in the dtype and model type.
    """
    outer = _read(path_or_dict)
    inner = outer.get("text_config") or outer
    if not isinstance(inner, dict):
        raise ValueError("text_config must be a JSON object")
    model_type = _model_type(outer, inner)
    c = _Config(dict(inner), model_type)
    mixers = [m for m in FAMILIES[model_type](c) if m["layers"]]
    if not mixers:
        raise c.error("no layer holds a KV cache or a recurrent state")

    def first(*keys: str) -> Any:
        for source in (inner, outer):
            for key in keys:
                if source.get(key) is not None:
                    return source[key]
        return None

    doubts = []
    dtype = first("torch_dtype", "dtype")
    if dtype is None:
        dtype = "bfloat16"
        doubts.append("config declares no torch_dtype; bfloat16 assumed")
    declared = first("mamba_ssm_dtype", "mamba_ssm_cache_dtype")
    if declared == "auto":
        declared = None
    label = name or outer.get("_name_or_path") or (outer.get("architectures") or [model_type])[0]
    try:
        return HybridModel.from_dict(
            {
                "name": label,
                "display_name": label,
                "family": model_type,
                "hf_repo": outer.get("_name_or_path") or "",
                "num_hidden_layers": c.n,
                "torch_dtype": dtype,
                "ssm_dtype_declared": declared,
                "max_position_embeddings": first("max_position_embeddings"),
                "mixers": mixers,
                "sources": ["Hugging Face config.json"],
                "doubts": "; ".join(doubts),
            }
        )
    except ValueError as exc:
        raise c.error(str(exc)) from None
