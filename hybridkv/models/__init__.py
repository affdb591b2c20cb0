"""The model zoo: real hybrid models shipped as data, and a Hugging Face config reader.

>>> from hybridkv import models
>>> models.load("qwen3.5-4b", kv_dtype="fp8").kv_bytes_per_token
16384

A model is found by its zoo name (``qwen3.5-4b``), its display name (``Qwen3.5-4B``) or a
Hugging Face repository id (``Qwen/Qwen3.5-4B``), in any case.
"""

from __future__ import annotations

import difflib
import inspect
import json
import re
from functools import cache, lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from .model import CacheLayer, HybridModel, ParamCount

__all__ = [
    "CacheLayer",
    "HybridModel",
    "ParamCount",
    "from_hf_config",
    "list_models",
    "load",
    "resolve_name",
]

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@lru_cache(maxsize=1)
def _zoo() -> dict[str, dict[str, Any]]:
    """Zoo name -> parsed JSON entry (read once from the package data)."""
    entries: dict[str, dict[str, Any]] = {}
    for item in resources.files(__package__).joinpath("zoo").iterdir():
        if not item.name.endswith(".json"):
            continue
        data = json.loads(item.read_text(encoding="utf-8"))
        name = data.get("name")
        if name != item.name.removesuffix(".json"):
            raise ValueError(f"zoo file {item.name} holds model {name!r}; the names must match")
        entries[name] = data
    return dict(sorted(entries.items()))


def _alias_keys(data: dict[str, Any]) -> set[str]:
    """Names a zoo entry answers to besides its own: display names (with and without their
    parenthesised variants), every Hugging Face repository id in ``hf_repo`` and ``aliases``,
    and each id's part after the organisation."""
    keys = {data["name"]}
    display = data.get("display_name", "")
    keys.add(display)
    keys.add(re.sub(r"\s*\(.*?\)\s*", "", display))
    repos = _REPO_ID.findall(data.get("hf_repo", ""))
    for alias in data.get("aliases", ()):
        keys.add(alias)
        repos.extend(_REPO_ID.findall(alias))
    for repo in repos:
        keys.update({repo, repo.split("/", 1)[1]})
    return {k.strip().lower() for k in keys if k and k.strip()}


@lru_cache(maxsize=1)
def _aliases() -> dict[str, str]:
    """Lower-cased alias -> zoo name. An alias claimed by two models is an error."""
    aliases: dict[str, str] = {}
    for name, data in _zoo().items():
        for key in _alias_keys(data):
            other = aliases.setdefault(key, name)
            if other != name:
                raise ValueError(f"zoo alias {key!r} names both {other!r} and {name!r}")
    return aliases


def list_models() -> list[str]:
    """Names of the zoo's models, sorted."""
    return list(_zoo())


def resolve_name(name: str) -> str:
    """The zoo name for ``name`` (a zoo name, a display name or a Hugging Face repo id)."""
    if not isinstance(name, str):
        raise ValueError(f"a model name must be a string, got {type(name).__name__}")
    key = name.strip().lower()
    aliases = _aliases()
    if key in aliases:
        return aliases[key]
    close = difflib.get_close_matches(key, list(aliases), n=6, cutoff=0.6)
    suggestions = list(dict.fromkeys(aliases[c] for c in close))[:3]
    hint = f"; did you mean {', '.join(suggestions)}?" if suggestions else ""
    raise ValueError(f"unknown model {name!r}{hint} (`hybridkv models` lists them all)")


@cache
def _base(name: str) -> HybridModel:
    return HybridModel.from_dict(_zoo()[name])


@lru_cache(maxsize=1024)
def _configured(name: str, options: tuple[tuple[str, Any], ...]) -> HybridModel:
    return _base(name).configure(**dict(options))


def load(name: str, **configure: Any) -> HybridModel:
    """A zoo model, configured with :meth:`HybridModel.configure` (``tp_size``, ``kv_dtype``,
    ``conv_dtype``, ``ssm_dtype``, ``num_spec_tokens``, ``speculative_method``,
    ``kv_dtype_skip_layers``, ``dcp_size``, ``cp_kv_cache_interleave_size``); without options,
    the model at TP 1 with its own dtypes. Models are immutable and cached, so loading one
    often is cheap."""
    zoo_name = resolve_name(name)
    if not configure:
        return _base(zoo_name)
    options = tuple(sorted(configure.items()))
    try:
        return _configured(zoo_name, options)
    except TypeError as exc:
        if "unexpected keyword" in str(exc):
            known = [p for p in inspect.signature(HybridModel.configure).parameters][1:]
            raise TypeError(
                f"load() got an unknown option ({exc}); use {', '.join(known[:-1])} or {known[-1]}"
            ) from None
        if "unhashable" not in str(exc):
            raise
        return _base(zoo_name).configure(**configure)


def from_hf_config(
    path_or_dict: str | Path | dict[str, Any], name: str | None = None, **configure: Any
) -> HybridModel:
    """A model from a Hugging Face ``config.json`` (a file, a folder holding one, or a dict),
    configured like :func:`load`."""
    from .hf_config import parse_hf_config

    model = parse_hf_config(path_or_dict, name=name)
    return model.configure(**configure) if configure else model
