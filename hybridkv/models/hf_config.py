"""Read a Hugging Face ``config.json`` into a :class:`HybridModel`.

Each family names its layer pattern and state dimensions differently; :data:`FAMILIES` maps a
``model_type`` to a reader (and :data:`ARCHITECTURES` maps ``architectures`` entries to a model
type when ``model_type`` is missing or unknown). Readers take only what the cache needs, and only
for the layer kinds the model has: a config whose every layer is attention needs no state
fields, one with no attention layer needs no attention fields. They raise a ``ValueError`` naming
the missing or malformed key and the model type rather than guessing; the few defaults they apply
are the ones ``transformers`` applies to the same field, noted where used. Dimensions follow the
state shapes vLLM allocates (``get_mamba_state_shape_from_config`` of each model file) where vLLM
serves the family, else ``transformers``' cache shapes.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from .model import MTP_FAMILIES, HybridModel

__all__ = ["ARCHITECTURES", "FAMILIES", "parse_hf_config"]

_MISSING: Any = object()

# transformers >= 5 renames the legacy layer types "attention" -> "full_attention" and
# "mamba" -> "linear_attention" when it saves a config; both spellings are read.
_ATTENTION = {"attention", "full_attention"}
_MAMBA = {"mamba", "linear_attention"}


def _transformers_config(model_type: str, data: dict[str, Any]) -> Any:
    """transformers' config object for ``model_type`` built from ``data`` (its ``__init__``
    fills the defaults, derived ones included), or None when transformers is not installed, has
    no class for the type, or refuses the fields."""
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return None
    try:
        cls = CONFIG_MAPPING[model_type]
    except KeyError:
        return None
    try:
        return cls(**{k: v for k, v in data.items() if k not in ("model_type", "architectures")})
    except Exception:  # a config transformers would refuse: keep the reader's own fallbacks
        return None


def _kind_of(value: Any) -> str:
    """How an error message names a value's JSON type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


class _Config:
    """A config dict whose lookups fail with the model type, the field and what was expected.

    :meth:`get` returns a raw value; the typed getters (:meth:`integer`, :meth:`integers`,
    :meth:`sequence`, :meth:`mapping`) also check its type, so a wrongly typed field (a string
    where a number belongs, a list where an integer belongs) is a ``ValueError`` naming the
    field rather than a ``TypeError`` further down.
    """

    def __init__(self, data: dict[str, Any], model_type: str, prefix: str = ""):
        self.data = data
        self.model_type = model_type
        self.prefix = prefix  # "linear_attn_config." for a nested object
        self.n: int | None = None  # decoder layers, set by num_layers()
        self.doubts: list[str] = []  # what the reader had to assume, for the model's doubts
        #: the transformers model type whose config class gives absent sizes their defaults
        #: (a reader sets the text config's type where the outer class wraps it)
        self.defaults_type = model_type

    def error(self, message: str) -> ValueError:
        return ValueError(f"config for model_type {self.model_type!r}: {message}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def _find(self, keys: Sequence[str]) -> tuple[str | None, Any]:
        for key in keys:
            if self.data.get(key) is not None:
                return key, self.data[key]
        for key in keys:  # a hand-written config may leave out what transformers defaults
            value = self._transformers_default(key)
            if value is not None:
                return key, value
        return None, _MISSING

    def _transformers_default(self, key: str) -> Any:
        """What transformers' config class for this model type sets ``key`` to, given the
        fields present (``Qwen3NextConfig`` fills ``head_dim`` 256 and
        ``num_key_value_heads`` 2); None without transformers, for a nested object, or when
        the class does not set it. Noted among the model's doubts."""
        if self.prefix or key in self.data:  # nested, or present but null: not a default
            return None
        if not hasattr(self, "_hf_defaults"):
            self._hf_defaults = _transformers_config(self.defaults_type, self.data)
        cfg = self._hf_defaults
        value = getattr(cfg, key, None) if cfg is not None else None
        # sizes only: a default layer pattern or dtype belongs to another model than this one
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        note = f"{key} missing: {value!r}, the default of transformers' {type(cfg).__name__}"
        if note not in self.doubts:
            self.doubts.append(note)
        return value

    def _absent(self, keys: Sequence[str], expected: str) -> ValueError:
        names = " or ".join(repr(self.prefix + k) for k in keys)
        nulls = [k for k in keys if k in self.data]  # present, but null
        if nulls:
            return ValueError(
                f"config for model_type {self.model_type!r}: {self.prefix + nulls[0]!r} is null; "
                f"expected {expected}"
            )
        return ValueError(
            f"config for model_type {self.model_type!r} has no {names} (expected {expected})"
        )

    def _wrong(self, key: str, value: Any, expected: str) -> ValueError:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        return self.error(
            f"field {self.prefix + key!r} must be {expected}, got {shown} ({_kind_of(value)})"
        )

    def get(self, *keys: str, default: Any = _MISSING, expected: str = "a value") -> Any:
        """The first of ``keys`` that is set (not null); ``default`` if given, else raise."""
        key, value = self._find(keys)
        if key is not None:
            return value
        if default is not _MISSING:
            return default
        raise self._absent(keys, expected)

    def integer(self, *keys: str, default: Any = _MISSING, minimum: int = 1) -> Any:
        """An integer >= ``minimum`` (a float with no fractional part is accepted: JSON writers
        sometimes print ``2.0``); ``default`` when none of ``keys`` is set."""
        expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        key, value = self._find(keys)
        if key is None:
            if default is not _MISSING:
                return default
            raise self._absent(keys, expected)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._wrong(key, value, expected)
        return value

    def sequence(self, *keys: str, default: Any = _MISSING, expected: str = "a list") -> Any:
        """A JSON list (its items are checked by the caller)."""
        key, value = self._find(keys)
        if key is None:
            if default is not _MISSING:
                return default
            raise self._absent(keys, expected)
        if not isinstance(value, (list, tuple)):
            raise self._wrong(key, value, expected)
        return list(value)

    def integers(self, *keys: str, default: Any = _MISSING, minimum: int = 0) -> Any:
        """A list of integers >= ``minimum`` (layer indices)."""
        expected = f"a list of integers >= {minimum}"
        key, _ = self._find(keys)
        values = self.sequence(*keys, default=default, expected=expected)
        if key is None:
            return values
        for i, item in enumerate(values):
            if isinstance(item, bool) or not isinstance(item, int) or item < minimum:
                raise self._wrong(f"{key}[{i}]", item, f"an integer >= {minimum}")
        return values

    def mapping(self, key: str) -> dict[str, Any]:
        """A nested JSON object, ``{}`` when absent."""
        value = self.data.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self._wrong(key, value, "an object")
        return value

    def num_layers(self, types: Sequence[Any] | None = None, what: str = "layer_types") -> int:
        """``num_hidden_layers``, checked against a per-layer list when there is one."""
        if types is None:
            n = self.integer("num_hidden_layers")
        else:
            # transformers >= 5 derives NemotronH's layer count from its list alone
            n = self.integer("num_hidden_layers", default=len(types))
            if len(types) != n:
                raise self.error(f"{what} has {len(types)} entries but num_hidden_layers is {n}")
        self.n = n
        return n

    def head_dim(self, *keys: str) -> int:
        """``head_dim`` (or the family's name for it); like transformers, default to
        ``hidden_size // num_attention_heads`` when the config does not give it."""
        value = self.integer(*keys, "head_dim", default=None)
        return value if value is not None else self.split_head_dim()

    def split_head_dim(self) -> int:
        """``hidden_size // num_attention_heads``, as vLLM sizes the heads of the families whose
        attention ignores any ``head_dim`` field (Jamba, Granite-4.0-H, LFM2, OLMo-Hybrid)."""
        return self.integer("hidden_size") // self.integer("num_attention_heads")

    def attention(self, layers: list[int], *, head_dim: int | None = None, **extra: Any):
        heads = self.integer("num_attention_heads")
        return {
            "kind": "full_attention",
            "num_heads": heads,
            # transformers' backward-compatible default: no num_key_value_heads means MHA
            "num_kv_heads": self.integer("num_key_value_heads", default=heads),
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
    known = attention | state | both | none
    attn: list[int] = []
    rec: list[int] = []
    for i, t in enumerate(types):
        if isinstance(t, bool) or not isinstance(t, (str, int)) or t not in known:
            names = ", ".join(repr(k) for k in sorted(known, key=str))
            raise c.error(f"{what}[{i}] is {t!r}; expected one of {names}")
        if t in attention or t in both:
            attn.append(i)
        if t in state or t in both:
            rec.append(i)
    return attn, rec


def _check_indices(c: _Config, what: str, indices: list[int], n: int) -> None:
    if any(i >= n for i in indices):
        raise c.error(f"{what} {indices} reach outside 0..{n - 1}")


def _check_partition(c: _Config, n: int, *groups: list[int]) -> None:
    seen = sorted(i for g in groups for i in g)
    if seen != list(range(n)):
        raise c.error(
            f"the attention and state layer lists do not cover layers 0..{n - 1} exactly once"
        )


def _types(c: _Config, *keys: str) -> list[Any]:
    return c.sequence(*keys, expected="a list of layer types")


def _layer_types(c: _Config, rule: Callable[[int], list[str]]) -> tuple[list[Any], int]:
    """(``layer_types``, the layer count): the config's list, checked against
    ``num_hidden_layers``; absent, ``rule(n)``, the family's own rule for ``n`` layers (as its
    transformers config derives the list)."""
    if c.has("layer_types"):
        types = _types(c, "layer_types")
        return types, c.num_layers(types)
    n = c.num_layers()
    return rule(n), n


# ---- families ---------------------------------------------------------------------------------
# Every reader returns one mixer dict per kind the model holds (kinds with no layer are left out,
# so their fields are not required).


def _gdn(c: _Config, layers: list[int]) -> dict[str, Any]:
    return {
        "kind": "gated_deltanet",
        "num_k_heads": c.integer("linear_num_key_heads"),
        "num_v_heads": c.integer("linear_num_value_heads"),
        "head_k_dim": c.integer("linear_key_head_dim"),
        "head_v_dim": c.integer("linear_value_head_dim"),
        "conv_kernel": c.integer("linear_conv_kernel_dim"),
        "layers": layers,
    }


def _qwen_gdn(c: _Config) -> list[dict[str, Any]]:
    """Qwen3-Next and Qwen3.5: ``layer_types`` or ``full_attention_interval``."""
    if c.has("layer_types"):
        types = _types(c, "layer_types")
        c.num_layers(types)
        attn, state = _split(c, types, attention={"full_attention"}, state={"linear_attention"})
    else:
        n = c.num_layers()
        interval = c.integer("full_attention_interval")
        attn = [i for i in range(n) if (i + 1) % interval == 0]
        state = [i for i in range(n) if (i + 1) % interval]
    return [
        *([c.attention(attn)] if attn else []),
        *([_gdn(c, state)] if state else []),
    ]


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
        "n_groups": c.integer(*groups, default=groups_default),
        "d_state": c.integer(*d_state),
        # every transformers Mamba-2 config defaults the conv kernel to 4
        "d_conv": c.integer(*d_conv, default=4),
        "layers": layers,
    }


_NEMOTRON_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def _nemotron_h(c: _Config) -> list[dict[str, Any]]:
    """NemotronH: ``hybrid_override_pattern`` (``M`` Mamba-2, ``*`` attention, ``-`` MLP,
    ``E`` MoE), or the ``layers_block_type`` list that transformers >= 5 writes instead."""
    key, pattern = c._find(("hybrid_override_pattern", "layers_block_type", "layer_types"))
    if key is None:
        raise c._absent(
            ("hybrid_override_pattern", "layers_block_type", "layer_types"),
            "a layer pattern string or list",
        )
    if isinstance(pattern, str):
        bad = sorted(set(pattern) - set(_NEMOTRON_PATTERN))
        if bad:
            raise c.error(
                f"hybrid_override_pattern has unknown characters {bad}; expected M (Mamba-2), "
                "* (attention), - (MLP) or E (MoE)"
            )
        types: list[Any] = [_NEMOTRON_PATTERN[ch] for ch in pattern]
        what = "hybrid_override_pattern"
    elif isinstance(pattern, (list, tuple)):
        types, what = list(pattern), key
    else:
        raise c._wrong(key, pattern, "a pattern string such as 'M-M*' or a list of layer types")
    c.num_layers(types, what)
    attn, state = _split(
        c,
        types,
        attention=_ATTENTION,
        state=_MAMBA,
        none={"mlp", "moe"},  # MLP / MoE-only layers hold no cache
        what=what,
    )
    mixers = []
    if attn:
        # vLLM's NemotronHAttention takes config.head_dim (transformers' NemotronHConfig default
        # 128, which Nemotron-H-56B's attention_head_dim spells out); hidden // heads would be
        # wrong for Nano-9B-v2 (40 heads of 128 on a 4480 hidden size)
        head_dim = c.integer("head_dim", "attention_head_dim", default=128)
        mixers.append(c.attention(attn, head_dim=head_dim))
    if state:
        mixers.append(
            _mamba2(
                c,
                state,
                heads=c.integer("mamba_num_heads"),
                head_dim=c.integer("mamba_head_dim"),
                groups=("n_groups", "mamba_n_groups"),
                groups_default=8,  # transformers' NemotronHConfig default
                d_state=("ssm_state_size", "mamba_d_state"),
                d_conv=("conv_kernel", "mamba_d_conv"),
            )
        )
    return mixers


def _mamba2_ibm(c: _Config, layers: list[int], d_inner: int) -> dict[str, Any]:
    """Mamba-2 dims under Granite / Bamba / Falcon-H1 names; ``mamba_d_head: "auto"`` (or
    absent) is ``d_inner // mamba_n_heads`` as in transformers."""
    heads = c.integer("mamba_n_heads")
    if c.get("mamba_d_head", default="auto") == "auto":
        d_head = d_inner // heads
    else:
        d_head = c.integer("mamba_d_head")
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
        types = _types(c, "layer_types", "layers_block_type")
        n = c.num_layers(types)
        attn, state = _split(c, types, attention=_ATTENTION, state=_MAMBA)
    else:
        n = c.num_layers()
        attn = sorted(set(c.integers("attn_layer_indices", default=[])))
        _check_indices(c, "attn_layer_indices", attn, n)
        state = [i for i in range(n) if i not in set(attn)]
    mixers = []
    if attn:
        # vLLM's GraniteMoeHybridAttention: head_dim = hidden_size // num_attention_heads
        head = c.split_head_dim() if c.model_type == "granitemoehybrid" else c.head_dim()
        mixers.append(c.attention(attn, head_dim=head))
    if state:
        # transformers: the Mamba intermediate size is mamba_expand (default 2) * hidden_size
        d_inner = c.integer("mamba_expand", default=2) * c.integer("hidden_size")
        mixers.append(_mamba2_ibm(c, state, d_inner))
    return mixers


def _falcon_h1(c: _Config) -> list[dict[str, Any]]:
    """Falcon-H1: attention and Mamba-2 run in parallel in every decoder layer."""
    layers = list(range(c.num_layers()))
    # transformers: mamba_d_ssm if set, else mamba_expand * hidden_size
    d_inner = c.integer("mamba_d_ssm", default=None)
    if d_inner is None:
        d_inner = c.integer("mamba_expand", default=2) * c.integer("hidden_size")
    return [c.attention(layers), _mamba2_ibm(c, layers, d_inner)]


def _mamba1(
    c: _Config,
    layers: list[int],
    d_inner: int,
    *,
    d_state: tuple[str, ...],
    d_conv: tuple[str, ...],
    d_state_default: Any = _MISSING,
    d_conv_default: Any = _MISSING,
) -> dict[str, Any]:
    return {
        "kind": "mamba1",
        "d_inner": d_inner,
        "d_state": c.integer(*d_state, default=d_state_default),
        "d_conv": c.integer(*d_conv, default=d_conv_default),
        "layers": layers,
    }


def _jamba(c: _Config) -> list[dict[str, Any]]:
    """Jamba: attention iff ``i % attn_layer_period == attn_layer_offset``, else Mamba-1."""
    if c.has("layers_block_type"):
        types = _types(c, "layers_block_type")
        c.num_layers(types, "layers_block_type")
        attn, state = _split(c, types, attention=_ATTENTION, state=_MAMBA)
    else:
        n = c.num_layers()
        period = c.integer("attn_layer_period")
        offset = c.integer("attn_layer_offset", minimum=0)
        attn = [i for i in range(n) if i % period == offset]
        state = [i for i in range(n) if i % period != offset]
    mixers = []
    if attn:  # vLLM's JambaAttentionDecoderLayer: head_dim = hidden_size // heads
        mixers.append(c.attention(attn, head_dim=c.split_head_dim()))
    if state:
        d_inner = c.integer("mamba_expand") * c.integer("hidden_size")
        mixers.append(
            _mamba1(c, state, d_inner, d_state=("mamba_d_state",), d_conv=("mamba_d_conv",))
        )
    return mixers


def _zamba_types(c: _Config, what: str) -> tuple[list[int], list[int]]:
    types = _types(c, what)
    c.num_layers(types, what)
    return _split(c, types, attention=(), both={"hybrid", "g"}, state=_MAMBA | {"m"}, what=what)


def _zamba(c: _Config) -> list[dict[str, Any]]:
    """Zamba (v1): multi-head Mamba-1 in every layer; the 'hybrid' layers also run the shared
    attention block (a KV cache per such layer). vLLM does not serve Zamba v1; the state is
    transformers' (conv ``(d_inner, d_conv)``, SSM ``(n_mamba_heads, d_inner / heads, d_state)``,
    the same elements as a Mamba-1 layer of ``d_inner``), kept with ``d_conv - 1`` conv columns
    as vLLM keeps every conv state."""
    if c.has("layers_block_type") or c.has("layer_types"):
        key = "layers_block_type" if c.has("layers_block_type") else "layer_types"
        attn, state = _zamba_types(c, key)
    else:
        n = c.num_layers()
        if n < 3:
            raise c.error(
                f"num_hidden_layers={n}: without layers_block_type transformers' ZambaConfig "
                "lays out at least 3 layers; give layers_block_type"
            )
        # transformers' ZambaConfig: layers 0 and 1 Mamba, 2 hybrid, then layer 3 + i is hybrid
        # iff i % attn_layer_period == attn_layer_offset (defaults 6 and 4)
        period = c.integer("attn_layer_period", default=6)
        offset = c.integer("attn_layer_offset", default=4, minimum=0)
        attn = [2] + [3 + i for i in range(n - 3) if i % period == offset]
        state = list(range(n))
    hidden = c.integer("hidden_size")
    mixers = []
    if attn:
        heads = c.integer("num_attention_heads")
        # transformers: attention_head_dim, else 2 * hidden_size // heads (the shared block
        # attends over concat(hidden, embeddings))
        head_dim = c.integer("attention_head_dim", default=None) or 2 * hidden // heads
        mixers.append(c.attention(attn, head_dim=head_dim))
    if state:
        d_inner = c.integer("mamba_expand", default=2) * hidden  # transformers' default 2
        m_heads = c.integer("n_mamba_heads", default=2)  # transformers' ZambaConfig default
        if d_inner % m_heads:
            raise c.error(
                f"n_mamba_heads={m_heads} does not divide mamba_expand * hidden_size = {d_inner}"
            )
        mixers.append(
            _mamba1(
                c,
                state,
                d_inner,
                d_state=("mamba_d_state",),
                d_conv=("mamba_d_conv",),
                d_state_default=16,  # transformers' ZambaConfig defaults
                d_conv_default=4,
            )
        )
    return mixers


def _zamba2(c: _Config) -> list[dict[str, Any]]:
    """Zamba2: Mamba-2 in every layer; the 'hybrid' layers also run a shared attention block
    (with its own KV cache per layer). Also reads the pre-transformers Zyphra format
    (``layers_block_type`` of 'g' / 'm', ``state_size``, ``conv_dimension``,
    ``expansion_factor``) that Zamba2-1.2B shipped with."""
    if c.has("layers_block_type"):
        attn, state = _zamba_types(c, "layers_block_type")
    else:
        n = c.num_layers()
        attn = sorted(set(c.integers("hybrid_layer_ids")))
        _check_indices(c, "hybrid_layer_ids", attn, n)
        state = list(range(n))
    hidden = c.integer("hidden_size")
    mixers = []
    if attn:
        heads = c.integer("num_attention_heads")
        # transformers: the shared block attends over concat(hidden, embeddings), so
        # attention_head_dim = 2 * hidden_size // num_attention_heads (it overrides the config)
        mixers.append(c.attention(attn, head_dim=2 * hidden // heads))
    if state:
        expand = c.integer("mamba_expand", "expansion_factor")
        if c.has("n_mamba_heads"):
            m_heads = c.integer("n_mamba_heads")
            m_head_dim = expand * hidden // m_heads  # transformers derives mamba_headdim so
        else:  # pre-transformers format: heads follow from the head size
            m_head_dim = c.integer("mamba_headdim")
            m_heads = expand * hidden // m_head_dim
        if m_heads * m_head_dim != expand * hidden:
            raise c.error(
                f"n_mamba_heads={m_heads} does not divide mamba_expand * hidden_size = "
                f"{expand * hidden}"
            )
        mixers.append(
            _mamba2(
                c,
                state,
                heads=m_heads,
                head_dim=m_head_dim,
                groups=("mamba_ngroups",),
                groups_default=1,  # transformers' Zamba2Config default
                d_state=("mamba_d_state", "state_size"),
                d_conv=("mamba_d_conv", "conv_dimension"),
            )
        )
    return mixers


def _lfm_layers(c: _Config, attention: set[str]) -> tuple[list[int], list[int]]:
    """LFM2 layer pattern: ``layer_types`` (what vLLM reads) or ``full_attn_idxs`` (from which
    transformers' Lfm2Config derives ``layer_types``; absent, every layer is attention)."""
    if c.has("layer_types"):
        types = _types(c, "layer_types")
        c.num_layers(types)
        return _split(c, types, attention=attention, state={"conv"})
    n = c.num_layers()
    if c.has("full_attn_idxs"):
        attn = sorted(set(c.integers("full_attn_idxs")))
        _check_indices(c, "full_attn_idxs", attn, n)
    else:
        attn = list(range(n))
        c.doubts.append(
            "config has neither layer_types nor full_attn_idxs; every layer read as attention, "
            "as transformers' Lfm2Config does"
        )
    return attn, [i for i in range(n) if i not in set(attn)]


def _short_conv(c: _Config, layers: list[int], width: int, kernel_default: int) -> dict:
    return {
        "kind": "short_conv",
        "conv_dim": width,
        "conv_kernel": c.integer("conv_L_cache", default=kernel_default),
        "layers": layers,
    }


def _lfm2(c: _Config) -> list[dict[str, Any]]:
    """LFM2 (dense) and LFM2-MoE: gated short convs and GQA attention."""
    attn, state = _lfm_layers(c, {"full_attention"})
    mixers = []
    if attn:  # vLLM's Lfm2Attention / Lfm2MoeAttention: head_dim = hidden_size // heads
        mixers.append(c.attention(attn, head_dim=c.split_head_dim()))
    if state:
        if c.model_type == "lfm2_moe":
            # vLLM lfm2_moe.py sizes the short-conv state on hidden_size channels
            width = c.integer("hidden_size")
        elif c.has("conv_dim"):
            width = c.integer("conv_dim")  # vLLM lfm2.py: intermediate_size=hf_config.conv_dim
        else:
            # transformers' Lfm2Config has no conv_dim (its conv runs on hidden_size channels);
            # vLLM reads config.conv_dim, which every released LFM2 config.json carries
            width = c.integer("hidden_size")
            c.doubts.append("config has no conv_dim; the short conv width is hidden_size")
        # transformers' Lfm2Config / Lfm2MoeConfig default kernel (L_cache) is 3
        mixers.append(_short_conv(c, state, width, kernel_default=3))
    return mixers


def _lfm3(c: _Config) -> list[dict[str, Any]]:
    """LFM3: short convs, full attention and sliding-window attention (``layer_types``, else
    transformers' Lfm3Config rule). vLLM 0.33 does not serve LFM3: sizes are transformers'
    (conv on hidden_size channels, ``head_dim`` default 128, window default 256)."""
    types, _ = _layer_types(
        c,
        lambda n: [
            "full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i else "conv"
            for i in range(n)
        ],
    )
    full, conv = _split(
        c, types, attention={"full_attention"}, state={"conv"}, none={"sliding_attention"}
    )
    window = [i for i, t in enumerate(types) if t == "sliding_attention"]
    head_dim = c.integer("head_dim", default=128)  # transformers' Lfm3Config default
    mixers = []
    if full:
        mixers.append(c.attention(full, head_dim=head_dim))
    if window:
        mixers.append(
            c.attention(
                window,
                head_dim=head_dim,
                kind="sliding_window",
                sliding_window=c.integer("sliding_window", default=256),
            )
        )
    if conv:
        mixers.append(_short_conv(c, conv, c.integer("hidden_size"), kernel_default=7))
    return mixers


def _granite_swa(c: _Config) -> list[dict[str, Any]]:
    """GraniteSWA and GraniteMoeSWA (Granite-SWASH): every layer attention, full or over a
    sliding window (``layer_types``, else transformers' rule: layer i is full iff
    ``i % 4 == 0``). transformers' attention (``LlamaAttention``) takes ``head_dim`` when the
    config sets it, else ``hidden_size // num_attention_heads``; an absent window or KV head
    count takes the config class's default (window 128; GraniteSWAConfig 4 KV heads,
    GraniteMoeSWAConfig one per query head), said among the doubts. The learnable per-head
    attention sinks are weights, not cache: the KV cache is plain GQA K and V."""
    types, _ = _layer_types(
        c, lambda n: ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n)]
    )
    # _split's second list is the sliding layers here (no layer holds a recurrent state)
    full, window = _split(c, types, attention={"full_attention"}, state={"sliding_attention"})
    mixers = []
    if full:
        mixers.append(c.attention(full))
    if window:
        mixers.append(
            c.attention(window, kind="sliding_window", sliding_window=c.integer("sliding_window"))
        )
    return mixers


def _minimax(c: _Config) -> list[dict[str, Any]]:
    """MiniMax-Text-01 / M1: ``attn_type_list`` (0 lightning, 1 softmax) in the original
    configs, ``layer_types`` in transformers' ``minimax`` port."""
    if c.has("attn_type_list"):
        types = c.sequence("attn_type_list", expected="a list of 0 (linear) / 1 (softmax)")
        c.num_layers(types, "attn_type_list")
        attn, linear = _split(c, types, attention={1}, state={0}, what="attn_type_list")
    else:
        types = _types(c, "layer_types")
        c.num_layers(types)
        attn, linear = _split(c, types, attention={"full_attention"}, state={"linear_attention"})
    mixers = []
    if attn:
        mixers.append(c.attention(attn))
    if linear:
        mixers.append(
            {
                "kind": "linear_attention",
                "num_heads": c.integer("num_attention_heads"),
                "head_dim": c.head_dim(),
                "layers": linear,
            }
        )
    return mixers


def _mla(c: _Config, layers: list[int]) -> dict[str, Any]:
    return {
        "kind": "mla",
        "num_heads": c.integer("num_attention_heads"),
        "kv_lora_rank": c.integer("kv_lora_rank"),
        "qk_rope_head_dim": c.integer("qk_rope_head_dim"),
        "layers": layers,
    }


def _kimi_linear(c: _Config) -> list[dict[str, Any]]:
    """Kimi-Linear: MLA + KDA. The released config lists ``linear_attn_config.kda_layers`` /
    ``full_attn_layers`` **1-based**; transformers >= 5 re-saves them as ``layer_types`` with
    ``linear_num_heads`` / ``linear_head_dim`` / ``linear_conv_kernel_dim``."""
    lin = c.mapping("linear_attn_config")
    sub = _Config(lin, c.model_type, prefix="linear_attn_config.")

    def pick(nested: str, flat: str) -> int:
        if sub.has(nested):
            return sub.integer(nested)
        if c.has(flat):
            return c.integer(flat)
        raise ValueError(
            f"config for model_type {c.model_type!r} has no 'linear_attn_config.{nested}' "
            f"or {flat!r} (expected a positive integer)"
        )

    if sub.has("kda_layers") or sub.has("full_attn_layers"):
        full = [i - 1 for i in sub.integers("full_attn_layers", minimum=1)]
        kda = [i - 1 for i in sub.integers("kda_layers", minimum=1)]
        n = c.num_layers()
        _check_partition(c, n, full, kda)
    else:
        types = _types(c, "layer_types")
        c.num_layers(types)
        full, kda = _split(c, types, attention={"full_attention"}, state={"linear_attention"})
    mixers = []
    if full:
        mixers.append(_mla(c, sorted(full)))
    if kda:
        mixers.append(
            {
                "kind": "kda",
                "num_heads": pick("num_heads", "linear_num_heads"),
                "head_dim": pick("head_dim", "linear_head_dim"),
                "conv_kernel": pick("short_conv_kernel_size", "linear_conv_kernel_dim"),
                "layers": sorted(kda),
            }
        )
    return mixers


def _glm5_next(c: _Config) -> list[dict[str, Any]]:
    """GLM-5-Next (transformers' ``glm5_next``; GLM-5.3-Flash): ``indexed_attention`` layers are
    NoPE MLA (the ``kv_lora_rank`` latent, ``qk_rope_head_dim`` 0) with a DSA indexer, the
    others KDA ``linear_attention`` (``layer_types``, else transformers' rule: layer i is
    indexed iff ``i % 4 == 3``; ``full_attention`` reads as indexed, as transformers renames
    it). An indexed layer whose ``indexer_types`` entry is ``shared`` reuses the previous full
    layer's top-k and keeps no indexer cache; absent, ``indexer_types`` follows transformers'
    ``index_topk_pattern`` / ``index_topk_freq`` / ``index_skip_topk_offset`` rule (every layer
    ``full`` by default). Each full indexer keeps transformers' per-token row: its key
    (``index_head_dim``), the k-pool gate score (``index_head_dim``) and a validity flag.
    Absent sizes take Glm5NextTextConfig's defaults, said among the doubts."""
    c.defaults_type = "glm5_next_text"
    types, n = _layer_types(
        c, lambda n: ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    )
    indexed, kda = _split(
        c,
        types,
        attention={"indexed_attention", "full_attention"},
        state={"linear_attention"},
    )
    modes = _indexer_types(c, n)
    full = [i for i in indexed if modes[i] == "full"]
    mixers: list[dict[str, Any]] = []
    kpool = c.integer("index_kpool", default=1)
    if indexed:
        # a query attends index_topk tokens of whole k-pools, plus the open pool's tail when
        # index_kpool_always_select_tail (transformers' default): index_kpool - 1 at most
        tail = _flag(c, "index_kpool_always_select_tail", default=True)
        mixers.append(
            {
                "kind": "mla",
                "num_heads": c.integer("num_attention_heads"),
                "kv_lora_rank": c.integer("kv_lora_rank"),
                # transformers: 0 (NoPE), and Glm5NextTextConfig refuses any other
                "qk_rope_head_dim": c.integer("qk_rope_head_dim", default=0, minimum=0),
                "sparse_topk": c.integer("index_topk") + (kpool - 1 if tail else 0),
                "layers": indexed,
            }
        )
    if full:
        dim = c.integer("index_head_dim")
        mixers.append(
            {
                "kind": "indexer",
                "index_head_dim": dim,
                "side_channels": dim + 1,
                "index_n_heads": c.integer("index_n_heads"),
                "pool_tokens": kpool,
                "layers": full,
            }
        )
        c.doubts.append(
            "indexer cache read in transformers' layout (per token: key, k-pool gate score and "
            "a validity flag in the model dtype); vLLM 0.33 keeps one fp8 k-pool key "
            "(index_head_dim + 4 B) per index_kpool tokens and a per-request bf16 ring of the "
            "open pool's keys and gate scores, which a plan in vLLM's cache formats lays out "
            "(VllmTarget(cache_formats='vllm'), plan --cache-formats vllm or --format vllm)"
        )
    if kda:
        lin = c.mapping("linear_attn_config")
        sub = _Config(lin, c.model_type, prefix="linear_attn_config.")
        mixers.append(
            {
                "kind": "kda",
                "num_heads": sub.integer("num_heads", default=None)
                or c.integer("linear_num_heads"),
                "head_dim": sub.integer("head_dim", default=None) or c.integer("linear_head_dim"),
                "conv_kernel": sub.integer("short_conv_kernel_size", default=None)
                or c.integer("linear_conv_kernel_dim"),
                "layers": kda,
            }
        )
    return mixers


def _flag(c: _Config, key: str, *, default: bool) -> bool:
    """A boolean field; ``default`` (transformers', said among the doubts) when absent."""
    value = c.data.get(key)
    if value is None:
        c.doubts.append(f"{key} missing: {default!r}, transformers' default")
        return default
    if not isinstance(value, bool):
        raise c._wrong(key, value, "true or false")
    return value


def _indexer_types(c: _Config, n: int) -> list[str]:
    """GLM-5-Next's per-layer indexer mode, ``full`` or ``shared``: ``indexer_types``, else
    ``index_topk_pattern`` (``F`` / ``S`` characters or a list), else transformers' rule from
    ``index_topk_freq`` (default 1) and ``index_skip_topk_offset`` (default 2): layer i is full
    iff ``max(i - offset + 1, 0) % freq == 0``."""
    if c.has("indexer_types") or c.has("index_topk_pattern"):
        key = "indexer_types" if c.has("indexer_types") else "index_topk_pattern"
        value = c.data[key]
        if isinstance(value, str):
            bad = sorted(set(value) - {"F", "S"})
            if bad:
                raise c.error(f"{key} has characters {bad}; expected F (full) or S (shared)")
            modes = ["full" if ch == "F" else "shared" for ch in value]
        else:
            modes = c.sequence(key, expected="a list of 'full' / 'shared'")
            for i, mode in enumerate(modes):
                if mode not in ("full", "shared"):
                    raise c._wrong(f"{key}[{i}]", mode, "'full' or 'shared'")
        if len(modes) != n:
            raise c.error(f"{key} has {len(modes)} entries but num_hidden_layers is {n}")
        return list(modes)
    freq = max(c.integer("index_topk_freq", default=1), 1)
    offset = c.integer("index_skip_topk_offset", default=2, minimum=0)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


def _qwen4_exp(c: _Config) -> list[dict[str, Any]]:
    """Qwen4-Exp (transformers' ``qwen4_exp``): ``indexed_attention`` layers are gated GQA
    (K and V of ``head_dim``) with a QSA indexer keeping one raw key of ``indexer_head_dim`` per
    token; the others Gated DeltaNet (``layer_types``, else every ``full_attention_interval``-th
    layer indexed, default 4). The GDN layers listed (1-based) in ``ple_layer_ids`` also run a
    Per-Layer Embedding module whose dilated conv keeps a second state over
    ``hc_count * hidden_size`` channels (kernel ``ple_conv_kernel_size``, dilation
    ``ngram_size``). Absent sizes take Qwen4ExpTextConfig's defaults, said among the doubts."""
    c.defaults_type = "qwen4_exp_text"

    def rule(n: int) -> list[str]:
        interval = c.integer("full_attention_interval", default=4)
        return [
            "linear_attention" if (i + 1) % interval else "indexed_attention" for i in range(n)
        ]

    types, n = _layer_types(c, rule)
    attn, gdn = _split(
        c, types, attention={"indexed_attention", "full_attention"}, state={"linear_attention"}
    )
    mixers: list[dict[str, Any]] = []
    if attn:
        if c.has("indexer_head_dim"):
            kv_heads = c.integer("indexer_kv_heads", default=1)
            if kv_heads != 1:
                raise c.error(
                    f"indexer_kv_heads is {kv_heads}; Qwen4-Exp's QSA indexer keeps one key head "
                    "(transformers' Qwen4ExpTextConfig requires 1)"
                )
            ratio, budget = c.integer("indexer_compress_ratio"), c.integer("indexer_budget")
            if budget % ratio:
                raise c.error(
                    f"indexer_budget {budget} is not a multiple of indexer_compress_ratio "
                    f"{ratio} (transformers' Qwen4ExpTextConfig requires it)"
                )
            # a query attends the budget's whole compressed blocks plus the open block's tail
            mixers.append(c.attention(attn, sparse_topk=budget + ratio - 1))
            mixers.append(
                {
                    "kind": "indexer",
                    "index_head_dim": c.integer("indexer_head_dim"),
                    "index_n_heads": c.integer("indexer_n_heads"),
                    "pool_tokens": ratio,
                    # QSA kernels take any page (vLLM's QSAStateBackend; indexer_scores): the
                    # gated GQA's 16, not DeepGEMM's 64 of a DSA indexer
                    "alignment": 16,
                    "layers": attn,
                }
            )
            c.doubts.append(
                "indexer cache read in transformers' layout (one raw key per token in the model "
                "dtype); vLLM 0.33 keeps one compressed key per indexer_compress_ratio tokens "
                "and a per-request ring of the open group's raw keys, which plans take with "
                "VllmTarget(cache_formats='vllm') (plan --cache-formats vllm or --format vllm)"
            )
        else:
            mixers.append(c.attention(attn))
            c.doubts.append(
                "no indexer_head_dim: read without a QSA indexer cache (transformers' "
                "Qwen4ExpTextAttention needs the indexer_* fields to build at all)"
            )
    if gdn:
        mixers.append(_gdn(c, gdn))
    ple = sorted(set(c.integers("ple_layer_ids", default=[], minimum=1)))
    if ple:
        _check_indices(c, "ple_layer_ids (1-based)", [i - 1 for i in ple], n)
        not_gdn = [i for i in ple if i - 1 not in set(gdn)]
        if not_gdn:
            raise c.error(
                f"ple_layer_ids {not_gdn} are not linear_attention layers; Qwen4-Exp runs PLE "
                "only on Gated DeltaNet layers"
            )
        mixers.append(
            {
                "kind": "ple_conv",
                "conv_dim": c.integer("hc_count") * c.integer("hidden_size"),
                "conv_kernel": c.integer("ple_conv_kernel_size"),
                "dilation": c.integer("ngram_size"),
                "layers": [i - 1 for i in ple],
            }
        )
    return mixers


def _bailing_hybrid(c: _Config) -> list[dict[str, Any]]:
    """Bailing hybrid (Ling): MLA on the last layer of every ``layer_group_size`` group, KDA
    elsewhere (``layer_types`` when given). As transformers' BailingHybridConfig, KDA heads are
    ``num_attention_heads`` of the checkpoint's ``head_dim`` (which a saved transformers config
    keeps as ``linear_head_dim``, since it then overwrites ``head_dim`` with the rope width)."""

    def rule(n: int) -> list[str]:
        group = c.integer("layer_group_size", default=6)  # transformers' default
        return ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(n)]

    types, _ = _layer_types(c, rule)
    full, kda = _split(c, types, attention={"full_attention"}, state={"linear_attention"})
    mixers = []
    if full:
        mixers.append(_mla(c, full))
    if kda:
        mixers.append(
            {
                "kind": "kda",
                "num_heads": c.integer("linear_num_heads", "num_attention_heads"),
                "head_dim": c.integer("linear_head_dim", "head_dim"),
                "conv_kernel": c.integer(
                    "linear_conv_kernel_dim", "short_conv_kernel_size", default=4
                ),
                "layers": kda,
            }
        )
    return mixers


def _olmo_hybrid(c: _Config) -> list[dict[str, Any]]:
    """OLMo-Hybrid: Gated DeltaNet + full attention (``layer_types``, else transformers' rule:
    every 4th layer attention, the last one at least). Linear-attention dims default as in
    transformers' OlmoHybridConfig; the attention head is hidden_size // heads as in vLLM's
    OlmoHybridAttention."""

    def rule(n: int) -> list[str]:
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
        if "full_attention" not in types:
            types[-1] = "full_attention"
        return types

    types, _ = _layer_types(c, rule)
    attn, state = _split(c, types, attention={"full_attention"}, state={"linear_attention"})
    mixers = []
    if attn:
        mixers.append(c.attention(attn, head_dim=c.split_head_dim()))
    if state:
        heads = c.integer("num_attention_heads")
        k_heads = c.integer("linear_num_key_heads", default=heads)
        k_dim = c.integer("linear_key_head_dim", default=None)
        if k_dim is None:
            k_dim = int(0.75 * c.integer("hidden_size") / k_heads)
        mixers.append(
            {
                "kind": "gated_deltanet",
                "num_k_heads": k_heads,
                "num_v_heads": c.integer("linear_num_value_heads", default=heads),
                "head_k_dim": k_dim,
                "head_v_dim": c.integer("linear_value_head_dim", default=2 * k_dim),
                "conv_kernel": c.integer("linear_conv_kernel_dim", default=4),
                "layers": state,
            }
        )
    return mixers


def _mamba_only(c: _Config) -> list[dict[str, Any]]:
    """Mamba / Falcon-Mamba: Mamba-1 in every layer (vLLM mamba.py: ``intermediate_size``,
    ``state_size``, ``conv_kernel``; transformers derives intermediate_size = expand * hidden)."""
    n = c.num_layers()
    d_inner = c.integer("intermediate_size", default=None)
    if d_inner is None:
        d_inner = c.integer("expand", default=2) * c.integer("hidden_size")
    return [
        _mamba1(
            c,
            list(range(n)),
            d_inner,
            d_state=("state_size",),
            d_conv=("conv_kernel",),
            d_conv_default=4,  # transformers' MambaConfig / FalconMambaConfig default
        )
    ]


def _mamba2_only(c: _Config) -> list[dict[str, Any]]:
    """Mamba-2: Mamba-2 in every layer (vLLM mamba2.py: ``expand * hidden_size`` intermediate,
    ``num_heads`` x ``head_dim``, ``n_groups``, ``state_size``, ``conv_kernel``)."""
    n = c.num_layers()
    heads, head_dim = c.integer("num_heads"), c.integer("head_dim")
    d_inner = c.integer("expand", default=2) * c.integer("hidden_size")
    if heads * head_dim != d_inner:
        raise c.error(
            f"num_heads={heads} x head_dim={head_dim} is not expand * hidden_size = {d_inner}"
        )
    return [
        _mamba2(
            c,
            list(range(n)),
            heads=heads,
            head_dim=head_dim,
            groups=("n_groups",),
            groups_default=1,  # transformers' Mamba2Config default
            d_state=("state_size",),
            d_conv=("conv_kernel",),
        )
    ]


def _recurrent_gemma(c: _Config) -> list[dict[str, Any]]:
    """RecurrentGemma: ``block_types`` cycled over the layers; local attention + RG-LRU."""
    n = c.num_layers()
    blocks = c.sequence("block_types", expected="a list of 'recurrent' / 'attention'")
    if not blocks:
        raise c.error("block_types is empty")
    types = [blocks[i % len(blocks)] for i in range(n)]
    attn, rec = _split(c, types, attention={"attention"}, state={"recurrent"}, what="block_types")
    mixers = []
    if attn:
        mixers.append(
            c.attention(
                attn,
                kind="sliding_window",
                sliding_window=c.integer("attention_window_size", "sliding_window"),
            )
        )
    if rec:
        mixers.append(
            {
                "kind": "rglru",
                # transformers: lru_width defaults to hidden_size
                "lru_width": c.integer("lru_width", "hidden_size"),
                "conv_kernel": c.integer("conv1d_width"),
                "layers": rec,
            }
        )
    return mixers


def _rwkv(c: _Config) -> list[dict[str, Any]]:
    """RWKV-4 (transformers' ``RwkvForCausalLM``): every layer keeps a recurrent state, no
    attention. ``attention_hidden_size`` (the WKV channels) defaults to ``hidden_size`` as in
    transformers' RwkvConfig; ``context_length`` is only the training length (an RNN has no
    position limit), so it is not read as ``max_position_embeddings``."""
    n = c.num_layers()
    hidden = c.integer("hidden_size")
    channels = c.integer("attention_hidden_size", default=None)
    if channels is None:
        channels = hidden
    elif channels != hidden:
        c.doubts.append(
            f"attention_hidden_size {channels} != hidden_size {hidden}: transformers sizes its "
            "RWKV state by hidden_size and runs only equal ones; the WKV state is read at "
            "attention_hidden_size channels, as the layer's weights have"
        )
    return [
        {
            "kind": "rwkv4",
            "hidden_size": hidden,
            "attention_hidden_size": channels,
            "layers": list(range(n)),
        }
    ]


def _xlstm(c: _Config) -> list[dict[str, Any]]:
    """xLSTM (transformers' ``xLSTMForCausalLM``, the xLSTM-7B architecture): an mLSTM cell in
    every block, no attention, no conv state. Blocks: ``num_blocks`` (what the model builds),
    else ``num_hidden_layers``; width: ``hidden_size``, else ``embedding_dim``. Head dims are
    transformers' ``xLSTMConfig.qk_head_dim`` / ``v_head_dim``, which size its cache:
    ``round_up(hidden * factor, 64) // num_heads`` (factors default 0.5 and 1.0)."""
    if c.has("num_blocks"):
        n = c.integer("num_blocks")
        layers = c.integer("num_hidden_layers", default=n)
        if layers != n:
            c.doubts.append(
                f"num_blocks {n} != num_hidden_layers {layers}: the model builds num_blocks "
                "blocks (transformers' xLSTMCache holds num_hidden_layers states)"
            )
        c.n = n
    else:
        n = c.num_layers()
    hidden = c.integer("hidden_size", "embedding_dim")
    heads = c.integer("num_heads")
    dims = []
    for key, default in (("qk_dim_factor", 0.5), ("v_dim_factor", 1.0)):
        factor = c.get(key, default=default, expected="a positive number")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise c._wrong(key, factor, "a positive number")
        dim = int(
            ((hidden * factor + 63) // 64) * 64
        )  # transformers' round_up_to_next_multiple_of
        if dim % heads:
            raise c.error(
                f"num_heads={heads} does not divide {key[:-7]}={dim} (hidden_size * {key} "
                "rounded up to a multiple of 64, as transformers' xLSTMConfig sizes it)"
            )
        if int(hidden * factor) != dim:
            c.doubts.append(
                f"hidden_size * {key} = {hidden * factor} is not a multiple of 64: transformers' "
                f"cache rounds it to {dim} but its mLSTM layer uses {int(hidden * factor)}, so "
                "transformers cannot run this config with a cache; the cache's size is read"
            )
        dims.append(dim // heads)
    # parse_hf_config assumes bfloat16 for a config that declares no dtype
    dtype = c.data.get("torch_dtype") or c.data.get("dtype") or "bfloat16"
    state_dtype = c.data.get("inference_state_dtype") or "float32"
    if isinstance(dtype, str) and dtype != state_dtype:
        c.doubts.append(
            f"the mLSTM kernels compute C, n, m in inference_state_dtype ({state_dtype}) and "
            f"transformers' xLSTMCache keeps them in the model dtype ({dtype}), as read here; "
            f"--ssm-dtype {state_dtype} keeps them as computed"
        )
    return [
        {
            "kind": "mlstm",
            "num_heads": heads,
            "qk_head_dim": dims[0],
            "v_head_dim": dims[1],
            "layers": list(range(n)),
        }
    ]


def _inkling(c: _Config) -> list[dict[str, Any]]:
    """Inkling (transformers' ``inkling_mm_model``, its language model ``inkling_text``): every
    decoder layer is attention plus four short convolutions. ``layer_types`` ``hybrid`` is full
    attention (``num_attention_heads`` / ``num_key_value_heads`` / ``head_dim``),
    ``hybrid_sliding`` sliding-window attention with heads of its own (``swa_num_attention_heads``
    / ``swa_num_key_value_heads`` / ``swa_head_dim``, window ``sliding_window_size``); absent,
    transformers' rule: the layers in ``local_layer_ids`` slide, else every layer i with
    ``(i + 1) % 6`` nonzero. The convs (``inkling_sconv``) are over the layer's own K / V
    channels and twice the hidden size, kernel ``sconv_kernel_size`` (checkpoints) or
    ``conv_kernel_size`` (transformers' name for the same field; ``sconv_kernel_size`` wins
    when both are given, as InklingTextConfig's attribute map makes it). Absent sizes take
    InklingTextConfig's defaults, said among the doubts."""
    c.defaults_type = "inkling_text"

    def rule(n: int) -> list[str]:
        local = c.integers("local_layer_ids", default=None)
        if local is None:
            local = [i for i in range(n) if (i + 1) % 6]
        _check_indices(c, "local_layer_ids", local, n)
        return ["hybrid_sliding" if i in set(local) else "hybrid" for i in range(n)]

    types, _ = _layer_types(c, rule)
    # _split's second list is the sliding layers here; every layer also keeps the convs
    full, sliding = _split(c, types, attention={"hybrid"}, state={"hybrid_sliding"})
    if c.has("sconv_kernel_size"):
        kernel = c.integer("sconv_kernel_size")
        other = c.integer("conv_kernel_size", default=None) if c.has("conv_kernel_size") else None
        if other is not None and other != kernel:
            c.doubts.append(
                f"sconv_kernel_size {kernel} and conv_kernel_size {other} differ: transformers "
                f"builds every short conv with sconv_kernel_size ({kernel}), as read"
            )
    else:
        kernel = c.integer("conv_kernel_size", default=4)  # InklingTextConfig's default
        if not c.has("conv_kernel_size") and not any("conv_kernel_size" in d for d in c.doubts):
            c.doubts.append("conv_kernel_size missing: 4, the default of InklingTextConfig")
    hidden = c.integer("hidden_size")
    mixers: list[dict[str, Any]] = []
    for layers, window in ((full, False), (sliding, True)):
        if not layers:
            continue
        prefix = "swa_" if window else ""
        heads = c.integer(f"{prefix}num_attention_heads")
        kv_heads = c.integer(f"{prefix}num_key_value_heads")
        head_dim = c.integer(f"{prefix}head_dim")
        attention: dict[str, Any] = {
            "kind": "sliding_window" if window else "full_attention",
            "num_heads": heads,
            "num_kv_heads": kv_heads,
            "head_dim": head_dim,
            "layers": layers,
        }
        if window:
            attention["sliding_window"] = c.integer("sliding_window_size", "sliding_window")
        mixers.append(attention)
        mixers.append(
            {
                "kind": "inkling_sconv",
                "num_kv_heads": kv_heads,
                "head_dim": head_dim,
                "hidden_size": hidden,
                "conv_kernel": kernel,
                "layers": layers,
            }
        )
    c.doubts.append(
        "short-conv states read in float32, as transformers computes and keeps them whatever "
        "the model dtype (conv dtype auto); no serving engine's layout is known to compare, "
        "and one keeping them in the model dtype would hold half (--mamba-cache-dtype)"
    )
    mtp = c.integer("num_mtp_layers", default=None, minimum=0)
    if mtp:
        c.doubts.append(
            f"num_mtp_layers {mtp}: the multi-token-prediction layers (attention and four "
            "short convs each) are not read; transformers does not build them"
        )
    return mixers


def _zaya(c: _Config) -> list[dict[str, Any]]:
    """ZAYA (transformers' ``zaya``): every decoder layer is Compressed Convolutional Attention,
    plain GQA K / V (``num_key_value_heads`` of ``head_dim``; full for ``layer_types``
    ``hybrid``, sliding-window ``sliding_window`` for ``hybrid_sliding``; absent, every layer
    full, as ZayaConfig) plus a per-request CCA state (``cca``): the q / k conv window of
    ``cca_time0 + cca_time1 - 2`` tokens and the last token's delayed value half. Absent sizes
    take ZayaConfig's defaults, said among the doubts."""
    if c.has("layer_types"):
        types = _types(c, "layer_types")
        n = c.num_layers(types)
    else:
        n = c.num_layers()
        types = ["hybrid"] * n
    full, sliding = _split(c, types, attention={"hybrid"}, state={"hybrid_sliding"})
    heads = c.integer("num_attention_heads")
    # ZayaConfig always sets head_dim (default 128): no hidden_size // heads fallback
    head_dim = c.integer("head_dim")
    mixers: list[dict[str, Any]] = []
    if full:
        mixers.append(c.attention(full, head_dim=head_dim))
    if sliding:
        window = c.integer("sliding_window", default=None)
        if window is None:
            raise c.error(
                "layer_types has hybrid_sliding layers but no sliding_window; set "
                "sliding_window (ZayaConfig requires it too)"
            )
        mixers.append(
            c.attention(sliding, head_dim=head_dim, kind="sliding_window", sliding_window=window)
        )
    mixers.append(
        {
            "kind": "cca",
            "num_heads": heads,
            "num_kv_heads": c.integer("num_key_value_heads", default=heads),
            "head_dim": head_dim,
            "time0": c.integer("cca_time0"),
            "time1": c.integer("cca_time1"),
            "layers": list(range(n)),
        }
    )
    return mixers


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
    "zamba": _zamba,
    "zamba2": _zamba2,
    "lfm2": _lfm2,
    "lfm2_moe": _lfm2,
    "lfm3": _lfm3,
    "granite_swa": _granite_swa,
    "granitemoe_swa": _granite_swa,
    "minimax_text_01": _minimax,
    "minimax_m1": _minimax,
    "minimax": _minimax,
    "kimi_linear": _kimi_linear,
    "bailing_hybrid": _bailing_hybrid,
    "glm5_next": _glm5_next,
    "glm5_next_text": _glm5_next,
    "qwen4_exp": _qwen4_exp,
    "qwen4_exp_text": _qwen4_exp,
    "olmo_hybrid": _olmo_hybrid,
    "recurrent_gemma": _recurrent_gemma,
    "mamba": _mamba_only,
    "falcon_mamba": _mamba_only,
    "mamba2": _mamba2_only,
    "rwkv": _rwkv,
    "xlstm": _xlstm,
    "inkling_mm_model": _inkling,
    "inkling_text": _inkling,
    "zaya": _zaya,
}

#: ``architectures`` entries -> model type, for configs without a (known) ``model_type``.
ARCHITECTURES: dict[str, str] = {
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "NemotronHForCausalLM": "nemotron_h",
    "NemotronHPuzzleForCausalLM": "nemotron_h",
    # multimodal wrappers: the language model is the text_config
    "NemotronH_Nano_VL_V2": "nemotron_h",
    "NemotronH_Nano_Omni_Reasoning_V3": "nemotron_h",
    "Lfm2VlForConditionalGeneration": "lfm2",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "BambaForCausalLM": "bamba",
    "FalconH1ForCausalLM": "falcon_h1",
    "JambaForCausalLM": "jamba",
    "ZambaForCausalLM": "zamba",
    "Zamba2ForCausalLM": "zamba2",
    "Lfm2ForCausalLM": "lfm2",
    "Lfm2MoeForCausalLM": "lfm2_moe",
    "Lfm3ForCausalLM": "lfm3",
    "GraniteSWAForCausalLM": "granite_swa",
    "GraniteMoeSWAForCausalLM": "granitemoe_swa",
    "MiniMaxText01ForCausalLM": "minimax_text_01",
    "MiniMaxM1ForCausalLM": "minimax_m1",
    "MiniMaxForCausalLM": "minimax",
    "KimiLinearForCausalLM": "kimi_linear",
    "BailingHybridForCausalLM": "bailing_hybrid",
    "Glm5NextForConditionalGeneration": "glm5_next",
    "Glm5NextForCausalLM": "glm5_next",
    "Qwen4ExpForConditionalGeneration": "qwen4_exp",
    "Qwen4ExpForCausalLM": "qwen4_exp_text",
    "OlmoHybridForCausalLM": "olmo_hybrid",
    "RecurrentGemmaForCausalLM": "recurrent_gemma",
    "MambaForCausalLM": "mamba",
    "FalconMambaForCausalLM": "falcon_mamba",
    "Mamba2ForCausalLM": "mamba2",
    "RwkvForCausalLM": "rwkv",
    "xLSTMForCausalLM": "xlstm",
    "InklingForConditionalGeneration": "inkling_mm_model",
    "InklingForCausalLM": "inkling_text",
    "ZayaForCausalLM": "zaya",
}


# ---- the SSM-state dtype a config declares, per vLLM 0.33 --------------------------------------
# vLLM resolves `--mamba-ssm-cache-dtype auto` in per-architecture config hooks
# (vllm/model_executor/models/config.py, MODELS_CONFIG_MAP, keyed by the resolved architecture):
# - NemotronHForCausalLMConfig.update_mamba_ssm_cache_dtype (NemotronHForCausalLM,
#   NemotronHPuzzleForCausalLM, and NemotronHNanoVLV2Config for NemotronH_Nano_VL_V2, which reads
#   the text_config): getattr(hf_config, "mamba_ssm_cache_dtype", "float32"), so the config's
#   value, else float32;
# - Qwen3_5ForConditionalGenerationConfig.verify_and_update_config (and its subclass
#   Qwen3_5ForCausalLMConfig; both MoE variants): the text config's `mamba_ssm_dtype` if set;
# - every other architecture has no hook: `auto` stays `auto`, which MambaStateDtypeCalculator
#   (vllm/model_executor/layers/mamba/mamba_utils.py) resolves to the conv-state dtype. A
#   `mamba_ssm_dtype` on, say, a Bamba or Qwen3-Next config is ignored.
# A value of "auto" in the config leaves vLLM's setting at auto (the conv dtype), declared None.
_NEMOTRON_SSM_ARCHS = {
    "NemotronHForCausalLM",
    "NemotronHPuzzleForCausalLM",
    "NemotronH_Nano_VL_V2",
}
_QWEN35_SSM_ARCHS = {
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",
    # Qwen4ExpForConditionalGenerationConfig subclasses Qwen3.5's ("the Qwen3.5 hybrid-cache
    # contract"), Qwen4ExpForCausalLMConfig that one
    "Qwen4ExpForConditionalGeneration",
    "Qwen4ExpForCausalLM",
}
_QWEN35_TYPES = {
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen4_exp",
    "qwen4_exp_text",
}


def _ssm_dtype_rule(outer: dict[str, Any], model_type: str) -> str | None:
    """Which vLLM hook applies: 'nemotron_h', 'qwen3_5' or None. By the config's first
    architecture when it names one (as vLLM keys its hooks), else by the family."""
    archs = _architectures(outer)
    if archs:
        arch = archs[0]
        if arch in _NEMOTRON_SSM_ARCHS:
            return "nemotron_h"
        if arch in _QWEN35_SSM_ARCHS:
            return "qwen3_5"
        return None
    if model_type == "nemotron_h":
        return "nemotron_h"
    if model_type in _QWEN35_TYPES:
        return "qwen3_5"
    return None


def _declared_ssm_dtype(c: _Config, rule: str | None) -> str | None:
    if rule == "nemotron_h":
        # NemotronHForCausalLMConfig.DEFAULT_MAMBA_SSM_CACHE_DTYPE (transformers' NemotronHConfig
        # default is the same)
        value = c.data.get("mamba_ssm_cache_dtype")
        value = "float32" if value is None else value
        key = "mamba_ssm_cache_dtype"
    elif rule == "qwen3_5":
        value = c.data.get("mamba_ssm_dtype")
        key = "mamba_ssm_dtype"
    else:
        return None
    if value is None:
        return None
    if not isinstance(value, str):
        raise c._wrong(key, value, "a dtype name such as 'float32'")
    return None if value.strip().lower() == "auto" else value


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


def _architectures(config: dict[str, Any]) -> list[str]:
    archs = config.get("architectures")
    if archs is None:
        return []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"architectures must be a list of class names, got {archs!r}")
    return archs


def _model_type(outer: dict[str, Any], inner: dict[str, Any]) -> str:
    archs = _architectures(outer) or _architectures(inner)
    for candidate in (inner.get("model_type"), outer.get("model_type")):
        if isinstance(candidate, str) and candidate.lower() in FAMILIES:
            return candidate.lower()
    given = inner.get("model_type") or outer.get("model_type")
    known = ", ".join(sorted(FAMILIES))
    if isinstance(given, str):  # a misspelt type is an error, even where architectures name one
        close = difflib.get_close_matches(given.lower(), list(FAMILIES), n=3, cutoff=0.75)
        if close:
            raise ValueError(
                f"model_type {given!r} is not a model type hybridkv reads; did you mean "
                f"{' or '.join(repr(c) for c in close)}? (supported: {known})"
            )
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(
        f"model_type {given!r} (architectures {outer.get('architectures')}) is not a "
        f"supported hybrid family; supported model types: {known}"
    )


#: Nemotron-H's MTP block types (``mtp_layers_block_type``; transformers writes the legacy
#: ``attention`` as ``full_attention``) as ``mtp_hybrid_override_pattern`` characters, the form
#: vLLM 0.33's ``NemotronHMTP`` reads
_NEMOTRON_MTP_BLOCKS = {"attention": "*", "full_attention": "*", "moe": "E"}


def _mtp_attention_layers(c: _Config, model_type: str) -> list[int]:
    """Positions of the MTP drafter's decoder layers with attention, as vLLM 0.33 builds them
    (:data:`~hybridkv.models.model.MTP_FAMILIES`; other families: none). ``Qwen3NextMTP`` builds
    ``num_nextn_predict_layers`` full-attention layers (1 when the config says nothing, as its
    ``getattr`` default: Qwen3-Next's configs leave it out), ``Qwen3_5MTP``
    ``mtp_num_hidden_layers`` (default 1 likewise); ``NemotronHMTP`` repeats its pattern
    ``num_nextn_predict_layers`` times, an attention layer per ``*`` (a config without
    ``num_nextn_predict_layers`` has no MTP layers)."""
    if model_type not in MTP_FAMILIES:
        return []
    if model_type == "qwen3_next":
        return list(range(c.integer("num_nextn_predict_layers", default=1, minimum=0)))
    if model_type != "nemotron_h":  # the Qwen3.5 types
        return list(range(c.integer("mtp_num_hidden_layers", default=1, minimum=0)))
    if not c.has("num_nextn_predict_layers"):
        return []
    steps = c.integer("num_nextn_predict_layers", minimum=0)
    if c.has("mtp_hybrid_override_pattern"):
        pattern = c.get("mtp_hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern or set(pattern) - {"*", "E"}:
            raise c._wrong("mtp_hybrid_override_pattern", pattern, "a string of '*' and 'E'")
    else:
        blocks = c.sequence("mtp_layers_block_type", default=[])
        if not blocks and steps:
            raise c.error(
                f"num_nextn_predict_layers is {steps} but neither mtp_hybrid_override_pattern "
                "nor mtp_layers_block_type says what the MTP layers are"
            )
        unknown = [b for b in blocks if b not in _NEMOTRON_MTP_BLOCKS]
        if unknown:
            raise c._wrong(
                "mtp_layers_block_type", blocks, f"a list of {', '.join(_NEMOTRON_MTP_BLOCKS)}"
            )
        pattern = "".join(_NEMOTRON_MTP_BLOCKS[b] for b in blocks)
    return [i for i in range(steps * len(pattern)) if pattern[i % len(pattern)] == "*"]


def parse_hf_config(
    path_or_dict: str | Path | dict[str, Any], *, name: str | None = None
) -> HybridModel:
    """A :class:`HybridModel` from a Hugging Face config (file, folder or dict).

    Multimodal wrappers (Qwen3.5, Nemotron-H VL, LFM2-VL) keep the language model under
    ``text_config``; it is read from there, with the outer config filling in the dtype and model
    type. A model that is all attention or all recurrent state is read like a hybrid one; only a
    config with no cache-holding layer at all is refused.
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
    mtp = _mtp_attention_layers(c, model_type)

    def first(*keys: str) -> Any:
        for source in (inner, outer):
            for key in keys:
                if source.get(key) is not None:
                    return source[key]
        return None

    doubts = list(c.doubts)
    dtype = first("torch_dtype", "dtype")
    if dtype is None:
        dtype = "bfloat16"
        doubts.append("config declares no torch_dtype; bfloat16 assumed")
    elif not isinstance(dtype, str):
        raise c._wrong("torch_dtype", dtype, "a dtype name such as 'bfloat16'")
    max_pos = first("max_position_embeddings")
    if isinstance(max_pos, float) and max_pos.is_integer():
        max_pos = int(max_pos)
    if max_pos is not None and (
        isinstance(max_pos, bool) or not isinstance(max_pos, int) or max_pos <= 0
    ):
        raise c._wrong("max_position_embeddings", max_pos, "a positive integer")
    declared = _declared_ssm_dtype(c, _ssm_dtype_rule(outer, model_type))
    repo = outer.get("_name_or_path")
    repo = repo if isinstance(repo, str) else ""
    label = name or repo or (_architectures(outer) or [model_type])[0]
    # facts the model keeps for vLLM's naming (hybridkv.vllm_families): the architecture class
    # and, for Zamba2, how many shared attention blocks its layers cycle through
    extra: dict[str, Any] = {"architectures": _architectures(outer) or _architectures(inner)}
    # the config itself, for what only transformers' build of it says (parameter counts:
    # hybridkv.models.param_count); a reference, never serialised
    extra["hf_config"] = outer
    if model_type == "zamba2" and isinstance(inner.get("num_mem_blocks"), int):
        extra["num_mem_blocks"] = inner["num_mem_blocks"]
    try:
        model = HybridModel.from_dict(
            {
                "name": label,
                "display_name": label,
                "family": model_type,
                "hf_repo": repo,
                "num_hidden_layers": c.n,
                "torch_dtype": dtype,
                "ssm_dtype_declared": declared,
                "max_position_embeddings": max_pos,
                "mixers": mixers,
                "mtp_attention_layers": mtp,
                "sources": ["Hugging Face config.json"],
                "doubts": "; ".join(doubts),
            }
        )
    except ValueError as exc:
        raise c.error(str(exc)) from None
    model.extra.update(extra)
    return model
