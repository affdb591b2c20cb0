"""Every number the paper reports comes from a committed table.

A *reported number* is a number with a unit or a percent sign in ``paper/paper.md``'s prose
(``76.9%``, ``300 ms``, ``9.2 GiB``, ``26.3 PFLOP``, ``4.92x``, ranges such as ``289-377 ms``).
Exempt, by construction: code spans and blocks (commands, identifiers), headings, link targets,
and numbers that are part of a word (model names such as 80B or A3B, ``sm_90``). Each reported
number must appear, as written (thousands separators aside) or as the rounding of a more precise
value, in a table the same section links to (``figures/*.md``, ``results/*``), or in
``paper/cited.md`` (numbers quoted from others, with sources). A section that links no table is
checked against every committed table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "paper"

_UNIT = r"(%|\s?(?:ms|s|GiB|MiB|KiB|GB|TB/s|PFLOP|TFLOP/s|tokens/s|x)(?![\w/]))"
_NUM = r"(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"
_REPORTED = re.compile(r"(?<![\w.#/-])" + _NUM + r"(?:\s?[-–]\s?" + _NUM + r")?" + _UNIT)
_TOKEN = re.compile(r"\d[\d,]*(?:\.\d+)?")


def _prose(markdown: str) -> str:
    text = re.sub(r"```.*?```", " ", markdown, flags=re.S)
    text = re.sub(r"`[^`\n]*`", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


def reported_numbers(markdown: str) -> list[tuple[str, str]]:
    """``(number, context)`` for every reported number in ``markdown``."""
    text = _prose(markdown)
    out = []
    for m in _REPORTED.finditer(text):
        context = text[max(0, m.start() - 60) : m.end() + 10].replace("\n", " ")
        out.extend((g, context) for g in (m.group(1), m.group(2)) if g)
    return out


def _tokens(texts: list[str]) -> set[str]:
    return {t.replace(",", "").rstrip(".") for text in texts for t in _TOKEN.findall(text)}


def in_tables(number: str, tokens: set[str]) -> bool:
    n = number.replace(",", "")
    if n in tokens:
        return True
    decimals = len(n.split(".")[1]) if "." in n else 0
    v = float(n)
    return any(
        "." in t and len(t.split(".")[1]) > decimals and round(float(t), decimals) == v
        for t in tokens
    )


def _sections(markdown: str) -> list[tuple[str, str]]:
    parts = re.split(r"^(#{2,3} .*)$", markdown, flags=re.M)
    return [(parts[i].strip(), parts[i + 1]) for i in range(1, len(parts) - 1, 2)]


def _linked(section: str) -> list[Path]:
    names = re.findall(r"\((?:\./)?((?:figures|results)/[\w./-]+)\)", section)
    return [PAPER / n for n in names if (PAPER / n).is_file()]


def _all_tables() -> list[Path]:
    return sorted(PAPER.glob("figures/*.md")) + sorted(
        p for p in PAPER.glob("results/*") if p.suffix in (".json", ".csv", ".md")
    )


def _unsourced() -> list[tuple[str, str, str]]:
    cited = (PAPER / "cited.md").read_text()
    out = []
    for title, body in _sections((PAPER / "paper.md").read_text()):
        tables = _linked(body) or _all_tables()
        tokens = _tokens([p.read_text(errors="ignore") for p in tables] + [cited])
        out += [(title, n, ctx) for n, ctx in reported_numbers(body) if not in_tables(n, tokens)]
    return out


def test_extractor_finds_reported_numbers():
    text = (
        "Hits rise from 52.6% to 94.9%, TTFT 289-377 ms, `hybridkv plan --tp 2` "
        "on Qwen3-Next-80B-A3B uses 9.2 GiB; see [t](figures/x.md); 2,000 requests.\n"
        "## 4.1 A heading with 12%\n"
    )
    got = [n for n, _ in reported_numbers(text)]
    assert got == ["52.6", "94.9", "289", "377", "9.2"]


def test_a_number_absent_from_the_tables_is_flagged():
    tokens = _tokens(["| 76.94 | 300.1 | 2,112 |"])
    assert in_tables("76.9", tokens) and in_tables("2,112", tokens) and in_tables("300", tokens)
    assert not in_tables("91.9", tokens)
    assert not in_tables("76.8", tokens)


def test_the_paper_has_sections_that_link_tables():
    sections = _sections((PAPER / "paper.md").read_text())
    assert len(sections) > 5 and sum(bool(_linked(b)) for _, b in sections) > 5


def test_every_paper_number_comes_from_a_committed_table():
    missing = _unsourced()
    if missing:
        lines = "\n".join(f"  {title}: {n!r} in ...{ctx}..." for title, n, ctx in missing)
        pytest.fail(f"{len(missing)} paper numbers appear in no table the section links:\n{lines}")
