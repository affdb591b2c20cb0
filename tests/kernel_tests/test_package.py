"""``hybridkv.kernels`` is the package's way to the kernels: the same objects as
``hybridkv_kernels``'."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import hybridkv.kernels as hk

MODULES = (
    "cache_write",
    "indexer_scores",
    "mla_decode",
    "paged_decode",
    "paged_prefill",
    "state_copy",
)


@pytest.mark.parametrize("name", sorted(hk.__all__))
def test_reexport_is_the_kernel_modules_object(name):
    (owner,) = [
        m for m in MODULES if hasattr(importlib.import_module(f"hybridkv_kernels.{m}"), name)
    ]
    # by module and name, not identity: a test that reloads a kernel module (to pin another
    # autotune config) replaces its functions after hybridkv.kernels imported them
    got = getattr(hk, name)
    assert (got.__module__, got.__qualname__) == (f"hybridkv_kernels.{owner}", name)


def test_every_wrapper_has_its_reference_and_every_kernel_a_planner():
    assert len(hk.WRAPPERS) == 8 and len(hk.PLANNERS) == 8
    refs = [n for n in hk.__all__ if n.endswith("_ref")]
    assert sorted(refs) == sorted(f"{n}_ref" for n in hk.WRAPPERS)
    planners = [n for n in hk.__all__ if n.startswith("plan_")]
    assert sorted(planners) == sorted(hk.PLANNERS)
    for name in hk.PLANNERS:  # a planner returns a plan with run()
        plan_cls = getattr(hk, name).__annotations__["return"]
        assert "Plan" in str(plan_cls), name


ROOT = Path(__file__).resolve().parents[2]


def test_the_kernels_folder_never_shadows_an_installed_kernels_package(tmp_path):
    """Run from the checkout's root (``python -m pytest``, ``python -m paper...``: the root is
    on ``sys.path``), ``kernels/`` must not be what ``import kernels`` finds, or transformers,
    which imports the Hugging Face ``kernels`` package, fails to import: the folder stays a
    namespace portion, and a regular package of that name anywhere on the path wins over it."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    # a stand-in for the Hugging Face package, on the path just after the checkout
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("CUDAProperties = 'hub'\n")
    code = (
        "import sys; sys.path[:0] = sys.argv[1:]; "
        "from kernels import CUDAProperties; import hybridkv_kernels.paged_decode as pd; "
        "print(CUDAProperties, pd.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(ROOT), str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["hub", "hybridkv_kernels.paged_decode"]
