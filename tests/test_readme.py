"""Every command in README.md's bash blocks runs as written: ``hybridkv ...`` commands are run
(in-process, from the repository root, as a reader would from a checkout) and must exit 0;
``pip install`` and the test command itself are what CI runs; anything else must at least name
a file or module that exists."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from hybridkv.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _commands(markdown: str) -> list[str]:
    out = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.S):
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                out.extend(part.strip() for part in line.split("&&"))
    return out


COMMANDS = _commands((ROOT / "README.md").read_text())


def test_the_readme_has_commands():
    assert any(c.startswith("hybridkv ") for c in COMMANDS)
    assert any(c.startswith("hybridkv simulate --trace mooncake") for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command(command, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    argv = shlex.split(command)
    if argv[0] == "hybridkv":
        assert main(argv[1:]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.strip()
    elif argv[:2] == ["pip", "install"] or argv[:3] == ["python", "-m", "pytest"]:
        pytest.skip("what .ci/run does")
    elif argv[:2] == ["python", "-m"]:
        assert importlib.util.find_spec(argv[2]) is not None, command
    elif argv[0] == "python":
        assert (ROOT / argv[1]).is_file(), command
    else:
        pytest.fail(f"README command of an unknown kind: {command}")


PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_the_readme_has_python_examples():
    assert any("Engine(" in block and "assert" in block for block in PYTHON_BLOCKS)


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.splitlines()[0][:40])
def test_readme_python_example(block):
    """Every python block of the README runs as written (its asserts included)."""
    if "hybridkv.e2e" in block:
        pytest.importorskip("transformers")
    exec(compile(block, "README.md", "exec"), {"__name__": "__readme__"})
