"""Every autotune config of every kernel gives the reference's answer, not only the first one
the interpreter pins by default: on a GPU the autotuner may pick any of them.

Each kernel module is reloaded with ``HYBRIDKV_INTERPRET_CONFIG=i`` and a few of its tests are
run again; the module is reloaded with the default afterwards.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from hybridkv_kernels import cache_write, mla_decode, paged_decode, paged_prefill, state_copy

from . import (
    test_cache_write,
    test_mla_decode,
    test_paged_decode,
    test_paged_prefill,
    test_state_copy,
)


def _decode():
    test_paged_decode.test_decode_synthetic(
        "packed3-layer1", [97, 3, 330], 8, 2, 40, 40, 16, torch.float16, None, 2
    )


def _prefill():
    test_paged_prefill.test_prefill_synthetic(
        "head-major", [150, 40], [64, 40], 4, 2, 32, 32, 16, torch.float16, 37
    )


def _write():
    test_cache_write.test_write_synthetic_layouts(
        "packed3-layer1", 37, 3, 40, 24, 16, torch.float16
    )


def _states():
    test_state_copy.test_gather((4, 16, 33), 5, torch.float32)
    test_state_copy.test_scatter_touches_only_its_slots((3, 1000), 57, torch.float16)
    test_state_copy.test_copy_slot_to_slot((2, 64, 48), 128, torch.float16)


def _mla():
    # 12 heads: one 16-head program, where no config (64-token tiles included) is pruned
    test_mla_decode.test_mla_decode_synthetic([65, 3, 130], 12, 64, 16, 64, torch.float16, 2)


CASES = [
    (paged_decode, _decode),
    (paged_prefill, _prefill),
    (cache_write, _write),
    (state_copy, _states),
    (mla_decode, _mla),
]


@pytest.mark.parametrize(
    "module, run", CASES, ids=[m.__name__.rsplit(".", 1)[1] for m, _ in CASES]
)
def test_every_config_matches_the_reference(module, run, monkeypatch):
    n = len(module._CONFIGS)
    assert n > 1, "a single config needs no autotuning"
    try:
        for i in range(1, n):  # config 0 is what every other test runs
            monkeypatch.setenv("HYBRIDKV_INTERPRET_CONFIG", str(i))
            importlib.reload(module)
            pinned = [
                {k: f(None) for k, f in obj.values.items()}
                for obj in vars(module).values()
                if type(obj).__name__ == "Heuristics"
            ]
            assert module._CONFIGS[i].kwargs in pinned, "the config was not pinned"
            run()
    finally:
        monkeypatch.delenv("HYBRIDKV_INTERPRET_CONFIG", raising=False)
        importlib.reload(module)
