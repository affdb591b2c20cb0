"""Every notebook is committed without outputs and runs top to bottom at its small size."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from hybridkv import models  # noqa: E402

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
    if not hasattr(models, "list_models"):
        pytest.skip("the model zoo has not landed yet")
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
