"""Byte sizes written the way people write them: ``"80GiB"``, ``"512 MiB"``, ``"1.5e9"``."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    # the short forms of Kubernetes and of most tools: K/M/G/T decimal, Ki/Mi/Gi/Ti binary
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
#: the largest budget accepted: far above any GPU, low enough that a typo such as 1e99GiB is caught
MAX_BYTES = 2**50
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: int | float | str) -> int:
    """Bytes in ``value``: an int, or a string with a unit, any case (``KiB``/``MiB``/``GiB``/
    ``TiB`` and ``Ki``/``Mi``/``Gi``/``Ti`` are powers of 2; ``KB``/``MB``/``GB``/``TB`` and
    ``K``/``M``/``G``/``T`` powers of 10, as Kubernetes reads them)."""
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        n = int(value)
    else:
        match = _PATTERN.match(str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"cannot read {value!r} as a byte size; write e.g. '80GiB', '512MiB' or '1e9'"
            )
        n = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if n <= 0:
        raise ValueError(f"a memory size must be positive, got {value!r}")
    if n > MAX_BYTES:
        raise ValueError(
            f"{value!r} is more memory than any GPU rank holds (at most "
            f"{format_bytes(MAX_BYTES)}); did you mean a smaller unit?"
        )
    if isinstance(value, str) and not match.group(2) and n < 2**20:
        raise ValueError(
            f"{value!r} has no unit, so it is {n} bytes; write the unit, e.g. '{value.strip()}GiB'"
        )
    return n


def decimal_unit_note(value: int | float | str) -> str | None:
    """For a size written with a decimal unit (``40G``, ``40GB``: 10**9 bytes a G), how it was
    read, since many mean 2**30 by it; None for binary units and plain numbers."""
    match = _PATTERN.match(str(value)) if isinstance(value, str) else None
    if not match:
        return None
    unit = match.group(2)
    scale = _UNITS.get(unit.lower(), 1)
    if scale < 1000 or unit.lower().endswith(("i", "ib")):
        return None
    n = parse_bytes(value)
    binary = {10**3: "KiB", 10**6: "MiB", 10**9: "GiB", 10**12: "TiB"}[scale]
    return (
        f"{value!r} read as {match.group(1)} x 10^{len(str(scale)) - 1} bytes = "
        f"{format_bytes(n)} (a decimal unit); write {match.group(1)}{binary} for powers of 2"
    )


def format_bytes(n: int | float) -> str:
    """``n`` bytes with a binary unit, e.g. ``1.50 GiB``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
