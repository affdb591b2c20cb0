"""Every notebook is committed without outputs and runs top to bottom at its small size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 120


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 2


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name}: clear outputs before committing"
            )
    # the first cell holds the parameters, including the small-run switch
    assert "HYBRIDKV_NB_SMALL" in nb.cells[0].source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_at_small_size(path, monkeypatch):
    from jupyter_client.kernelspec import KernelSpecManager

    # ipykernel's own spec counts (jupyter_client adds it when ipykernel is importable)
    assert "python3" in KernelSpecManager().find_kernel_specs(), "install ipykernel"
    monkeypatch.setenv("HYBRIDKV_NB_SMALL", "1")  # the kernel inherits the environment
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors


def test_readme_commands_are_installed_by_the_extras():
    """Each tool notebooks/README.md tells a reader to run comes with the extra it names."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    readme = (root / "notebooks" / "README.md").read_text()
    assert '".[notebooks]"' in readme
    names = {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in extras["notebooks"]}
    needs = {"jupyter lab": "jupyterlab", "jupyter nbconvert": "nbconvert", "nbclient": "nbclient"}
    named = [cmd for cmd in needs if cmd in readme]
    assert named, "the README names no command to run the notebooks"
    for cmd in named:
        assert needs[cmd] in names, f"notebooks/README.md runs `{cmd}`; add {needs[cmd]}"


def test_notebook_03_names_the_readme_benchmark_command():
    root = Path(__file__).resolve().parents[1]
    nb = (root / "notebooks" / "03_kernels.ipynb").read_text()
    assert "python -m paper.bench_kernels" in (root / "README.md").read_text()
    assert "python -m paper.bench_kernels" in nb and "python paper/bench_kernels.py" not in nb


def test_no_widget_warnings(tmp_path, monkeypatch):
    """Progress bars in notebooks are plain text: no 'IProgress not found' warning from tqdm."""
    monkeypatch.setenv("HYBRIDKV_NB_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    path = next(p for p in NOTEBOOKS if p.stem.startswith("04"))
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    text = json.dumps([o for c in nb.cells if c.cell_type == "code" for o in c.outputs])
    assert "IProgress" not in text and "ipywidgets" not in text
    assert "simulate" in text  # the bar did run
