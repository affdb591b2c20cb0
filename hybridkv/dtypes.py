"""Cache dtype names, their sizes, and how ``"auto"`` resolves.

Names follow vLLM's cache-dtype strings so that a plan made here can be compared with a vLLM log.
The fp8 names all store one byte per element (vLLM keeps them as ``uint8``).
"""

from __future__ import annotations

_CANONICAL = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}

#: dtypes a recurrent state may use (vLLM's ``MambaDType``); fp8 states are not supported there.
STATE_DTYPES = ("float32", "bfloat16", "float16")


def canonical_dtype(name: str, *, auto: str | None = None, what: str = "dtype") -> str:
    """Return the canonical dtype name for ``name``.

    ``"auto"`` resolves to ``auto`` (the model dtype); it is an error when ``auto`` is None.
    """
    if not isinstance(name, str):
        raise ValueError(f"{what} must be a string such as 'bfloat16' or 'fp8', got {name!r}")
    key = name.strip().lower().removeprefix("torch.")
    if key == "auto":
        if auto is None:
            raise ValueError(f"{what}='auto' needs a model dtype to resolve against")
        return canonical_dtype(auto, what=what)
    if key not in _CANONICAL:
        allowed = ", ".join(sorted(set(_CANONICAL) | {"auto"}))
        raise ValueError(f"unknown {what} {name!r}; use one of: {allowed}")
    return _CANONICAL[key]


def dtype_bytes(name: str) -> int:
    """Bytes per element of a (canonical or alias) dtype name."""
    return DTYPE_BYTES[canonical_dtype(name)]


def torch_dtype(name: str):
    """The torch dtype used to view cache memory of dtype ``name``."""
    import torch

    return {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2,
    }[canonical_dtype(name)]
