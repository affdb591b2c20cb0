"""The model zoo: real hybrid models shipped as data, and a Hugging Face config reader.

>>> from hybridkv import models
>>> models.load("qwen3.5-4b", kv_dtype="fp8").kv_bytes_per_token
16384
"""

from __future__ import annotations

import difflib
import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from .model import CacheLayer, HybridModel

__all__ = ["CacheLayer", "HybridModel", "from_hf_config", "list_models", "load"]


@lru_cache(maxsize=1)
def _zoo() -> dict[str, dict[str, Any]]:
    entries = {}
    for item in resources.files(__package__).joinpath("zoo").iterdir():
        if item.name.endswith(".json"):
            data = json.loads(item.read_text())
            entries[data["name"]] = data
    return dict(sorted(entries.items()))


@lru_cache(maxsize=1)
def _aliases() -> dict[str, str]:
    aliases = {}
    for name, data in _zoo().items():
        keys = {name, data.get("display_name", "")}
        keys.update(r.strip() for r in data.get("hf_repo", "").split(","))
        keys.update(r.strip().split(" ")[0] for r in data.get("hf_repo", "").split(","))
        keys.update(k.split("/")[-1] for k in list(keys))
        for key in keys:
            if key:
                aliases.setdefault(key.lower(), name)
    return aliases


def list_models() -> list[str]:
    """Names of the zoo's models, sorted."""
    return list(_zoo())


@lru_cache(maxsize=256)
def _base(name: str) -> HybridModel:
    return HybridModel.from_dict(_zoo()[name])


def resolve_name(name: str) -> str:
    """The zoo name for ``name`` (a zoo name, a display name or a Hugging Face repo id)."""
    key = name.strip().lower()
    aliases = _aliases()
    if key in aliases:
        return aliases[key]
    close = difflib.get_close_matches(key, list(_zoo()), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"unknown model {name!r}{hint} (`hybridkv models` lists them all)")


def load(name: str, **configure: Any) -> HybridModel:
    """A zoo model, configured with :meth:`HybridModel.configure` (``tp_size``, ``kv_dtype``,
    ``conv_dtype``, ``ssm_dtype``, ``num_spec_tokens``)."""
    model = _base(resolve_name(name))
    return model.configure(**configure) if configure else model


def from_hf_config(
    path_or_dict: str | Path | dict[str, Any], name: str | None = None, **configure
):
    """A model from a Hugging Face ``config.json`` (a file, a folder holding one, or a dict)."""
    from .hf_config import parse_hf_config

    model = parse_hf_config(path_or_dict, name=name)
    return model.configure(**configure) if configure else model
