"""``hybridkv.kernels`` is the package's way to the kernels: the same objects as
``hybridkv_kernels``'."""

from __future__ import annotations

import importlib

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
