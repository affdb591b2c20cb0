"""State pool kernels against their torch references: bit-exact, padding rows untouched."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hybridkv_kernels import state_copy
from hybridkv_kernels.state_copy import (
    copy_states,
    copy_states_ref,
    gather_states,
    gather_states_ref,
    scatter_states,
    scatter_states_ref,
)


def _pool(num_slots: int, shape: tuple[int, ...], slot_pad: int, dtype) -> torch.Tensor:
    """A pool whose slots sit ``slot_pad`` elements apart beyond their payload, like a state
    component inside a larger page; the gaps are NaN-poisoned so stray writes show."""
    numel = 1
    for s in shape:
        numel *= s
    stride = numel + slot_pad
    backing = torch.full((num_slots * stride + 7,), float("nan"), dtype=torch.float32)
    backing = backing.to(dtype)
    inner = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        inner[i] = inner[i + 1] * shape[i + 1]
    view = torch.as_strided(backing, (num_slots, *shape), (stride, *inner), 3)
    view.copy_(torch.randn(view.shape).to(dtype))
    return backing, view


CASES = [
    pytest.param((3, 40), 0, torch.float32, id="conv-3x40-contig-fp32"),
    pytest.param((3, 1000), 57, torch.bfloat16, id="conv-3x1000-padded-bf16"),
    pytest.param((4, 16, 33), 5, torch.float32, id="ssm-4x16x33-fp32"),
    pytest.param((7,), 1, torch.float16, id="rglru-7-fp16"),
    pytest.param((2, 64, 48), 128, torch.float16, id="gdn-2x64x48-fp16"),
]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int8) if a.element_size() == 1 else a, b) or torch.equal(
        a.float().nan_to_num(1e9), b.float().nan_to_num(1e9)
    )


@pytest.mark.parametrize("shape, pad, dtype", CASES)
def test_gather(shape, pad, dtype):
    _, pool = _pool(11, shape, pad, dtype)
    slots = torch.tensor([5, -1, 0, 10, 3, -1, 7], dtype=torch.int32)
    out = torch.full((len(slots), *shape), float("nan")).to(dtype)
    expected = out.clone()
    gather_states_ref(pool, slots, expected)
    gather_states(pool, slots, out)
    assert _same(out, expected)
    assert torch.isnan(out[1].float()).all()  # padding rows untouched when `out` is given
    fresh = gather_states(pool, slots.long())
    assert torch.equal(fresh[1], torch.zeros_like(fresh[1]))  # zero-filled when allocated
    assert torch.equal(fresh[0], pool[5])


@pytest.mark.parametrize("shape, pad, dtype", CASES)
def test_scatter_touches_only_its_slots(shape, pad, dtype):
    backing, pool = _pool(9, shape, pad, dtype)
    ref_backing = backing.clone()
    ref_pool = torch.as_strided(ref_backing, pool.shape, pool.stride(), pool.storage_offset())
    slots = torch.tensor([8, -1, 2, 4], dtype=torch.int64)
    src = torch.randn((4, *shape)).to(dtype)
    scatter_states(pool, slots, src)
    scatter_states_ref(ref_pool, slots, src)
    # the whole backing store, gaps included, matches: nothing written outside the slots
    assert _same(backing, ref_backing)


@pytest.mark.parametrize("shape, pad, dtype", CASES)
def test_copy_slot_to_slot(shape, pad, dtype):
    backing, pool = _pool(10, shape, pad, dtype)
    ref_backing = backing.clone()
    ref_pool = torch.as_strided(ref_backing, pool.shape, pool.stride(), pool.storage_offset())
    src = torch.tensor([1, 4, -1, 7, 0], dtype=torch.int32)
    dst = torch.tensor([2, 9, 3, -1, 5], dtype=torch.int32)
    copy_states(pool, src, dst)
    copy_states_ref(ref_pool, src, dst)
    assert _same(backing, ref_backing)


def test_bad_inputs():
    _, pool = _pool(4, (3, 8), 0, torch.float32)
    with pytest.raises(ValueError, match="1-D int32/int64"):
        gather_states(pool, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="differ"):
        copy_states(pool, torch.tensor([0]), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="contiguous"):
        gather_states(pool.transpose(1, 2), torch.tensor([0]))
    with pytest.raises(ValueError, match="src must be"):
        scatter_states(pool, torch.tensor([0]), torch.zeros(2, 3, 8))


def test_int64_addressing_beyond_2_31_elements():
    """Slot 2 of this pool starts past element 2**31: int32 offsets would wrap around."""
    row = 64
    stride = 2**30 + 4096  # elements between slots
    backing = torch.empty(2 * stride + row, dtype=torch.int8)  # ~2 GiB, never zero-filled
    pool = torch.as_strided(backing, (3, row), (stride, 1))
    payload = torch.randint(-100, 100, (3, row), dtype=torch.int8)
    pool.copy_(payload)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    out = gather_states(pool, slots)
    assert torch.equal(out, payload[[2, 0]])
    new = torch.randint(-100, 100, (1, row), dtype=torch.int8)
    scatter_states(pool, torch.tensor([2]), new)
    assert torch.equal(pool[2], new[0]) and torch.equal(pool[1], payload[1])
    copy_states(pool, torch.tensor([2]), torch.tensor([1]))
    assert torch.equal(pool[1], new[0])


# ---- fp8 pools, NaN payloads ------------------------------------------------------------------


def test_fp8_pools_move_bytes():
    """fp8 pools (e4m3 too, which Triton cannot name on sm_80) go through as bytes."""
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raw = torch.randint(0, 256, (6, 3, 37), dtype=torch.uint8)
        pool = raw.clone().view(dtype)
        out = gather_states(pool, torch.tensor([4, -1, 0]))
        assert torch.equal(out[0].view(torch.uint8), raw[4])
        assert torch.equal(out[2].view(torch.uint8), raw[0])
        scatter_states(pool, torch.tensor([1]), out[:1])
        copy_states(pool, torch.tensor([1]), torch.tensor([5]))
        assert torch.equal(pool[5].view(torch.uint8), raw[4])


def test_nan_payloads_survive():
    bits = torch.tensor([0x7C01, 0xFE00 - 0x10000, 0x7FFF, 0x1234], dtype=torch.int16)
    pool = bits.repeat(3, 5).view(torch.float16)  # [3, 20]: signalling and quiet NaNs
    out = gather_states(pool, torch.tensor([2, 0]))
    assert torch.equal(out.view(torch.int16), pool[[2, 0]].view(torch.int16))


# ---- validation (contract in the module docstring) --------------------------------------------


def _next_layer_pool(num_slots: int = 4, shape=(3, 5)):
    """A pool that is the first ``num_slots`` slots of a larger buffer: the rows after it are
    another layer's state, so an id past the pool would land there."""
    backing = torch.randn(num_slots + 3, *shape)
    return backing, backing[:num_slots]


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    "bad, message",
    [
        (
            4,
            r"slot_ids\[1\] = 4 is out of range: valid ids are -1 \(padding\) or 0\.\.3 "
            r"\(num_slots 4\); 4 is past the last slot",
        ),
        (-2, r"slot_ids\[1\] = -2 is out of range.*negative; only -1 means padding"),
    ],
    ids=["num_slots", "minus-2"],
)
@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_validate_rejects_out_of_range_ids(op, ids_dtype, bad, message):
    _, pool = _next_layer_pool()
    ids = torch.tensor([0, bad, -1], dtype=ids_dtype)
    with pytest.raises(ValueError, match=message):
        if op == "gather":
            gather_states(pool, ids, validate=True)
        else:
            scatter_states(pool, ids, torch.zeros(3, 3, 5), validate=True)


@pytest.mark.parametrize("side", ["src_slots", "dst_slots"])
@pytest.mark.parametrize("bad", [4, -2], ids=["num_slots", "minus-2"])
def test_validate_rejects_out_of_range_copy_ids(side, bad):
    _, pool = _next_layer_pool()
    ids = {"src_slots": torch.tensor([0, 1]), "dst_slots": torch.tensor([2, 3])}
    ids[side][1] = bad
    with pytest.raises(ValueError, match=rf"{side}\[1\] = {bad} is out of range"):
        copy_states(pool, ids["src_slots"], ids["dst_slots"], validate=True)


def test_validate_rejects_duplicate_scatter_slots():
    _, pool = _next_layer_pool()
    with pytest.raises(ValueError, match=r"slot_ids\[0\] and slot_ids\[2\] are both 3"):
        scatter_states(pool, torch.tensor([3, -1, 3]), torch.zeros(3, 3, 5), validate=True)


def test_copy_length_mismatch_says_what_to_pass():
    _, pool = _next_layer_pool()
    with pytest.raises(ValueError, match=r"\(3,\) and dst_slots \(2,\) differ in length"):
        copy_states(pool, torch.tensor([0, 1, 2]), torch.tensor([3, 1]))


def test_validate_rejects_duplicate_copy_destinations():
    _, pool = _next_layer_pool()
    src, dst = torch.tensor([0, 1, 2]), torch.tensor([3, -1, 3])
    copy_states(pool, src, torch.tensor([3, -1, -1]), validate=True)  # a skipped pair is fine
    with pytest.raises(ValueError, match=r"dst_slots\[0\] and dst_slots\[2\] are both 3"):
        copy_states(pool, src, dst, validate=True)


def test_validate_rejects_a_destination_that_is_another_pairs_source():
    _, pool = _next_layer_pool()
    with pytest.raises(ValueError, match=r"dst_slots\[1\] = 0 is also src_slots\[0\]"):
        copy_states(pool, torch.tensor([0, 2]), torch.tensor([1, 0]), validate=True)
    # a self-copy and a pair skipped by -1 read nothing another pair writes
    copy_states(pool, torch.tensor([0, 2, -1]), torch.tensor([0, 1, 0]), validate=True)


def test_validate_follows_the_environment(monkeypatch):
    _, pool = _next_layer_pool()
    monkeypatch.setenv("HYBRIDKV_VALIDATE", "1")
    with pytest.raises(ValueError, match="out of range"):
        gather_states(pool, torch.tensor([4]))
    gather_states(pool, torch.tensor([4]), validate=False)


def test_unvalidated_bad_ids_stay_inside_the_pool():
    """Without validate, ids outside [-1, num_slots) are skipped: nothing read from or written
    to the next layer's rows that follow the pool in memory."""
    backing, pool = _next_layer_pool()
    before = backing.clone()
    out = torch.full((3, 3, 5), float("nan"))
    gather_states(pool, torch.tensor([4, -2, 1]), out)
    assert out[:2].isnan().all() and torch.equal(out[2], pool[1])
    scatter_states(pool, torch.tensor([4, -2, 5]), torch.zeros(3, 3, 5))
    copy_states(pool, torch.tensor([0, 5, -3]), torch.tensor([4, 1, 2]))
    assert torch.equal(backing, before)


# ---- tuning ------------------------------------------------------------------------------------


def test_scatter_and_copy_twice_equal_once():
    """What lets the autotuner run its trials on the real pool without restoring it."""
    backing, pool = _pool(8, (3, 40), 5, torch.float16)
    twice = backing.clone()
    pool2 = torch.as_strided(twice, pool.shape, pool.stride(), pool.storage_offset())
    src = torch.randn(2, 3, 40).half()
    for p, times in ((pool, 1), (pool2, 2)):
        for _ in range(times):
            scatter_states(p, torch.tensor([6, 1]), src)
            copy_states(p, torch.tensor([6, 1, 2]), torch.tensor([0, 3, 7]))
    assert _same(backing, twice)


def test_unaligned_rows_prune_the_wide_tiles():
    """Rows Triton cannot prove 16-byte aligned keep at most 8 elements per thread."""
    kept = state_copy._prune_configs(state_copy._CONFIGS, {"ALIGNED": False})
    assert kept and all(c.kwargs["BLOCK"] <= 8 * 32 * c.num_warps for c in kept)
    assert state_copy._prune_configs(state_copy._CONFIGS, {"ALIGNED": True}) == state_copy._CONFIGS
    _, pool = _pool(4, (3, 1000), 0, torch.float16)  # 3000 elements: not a multiple of 16
    assert not state_copy._aligned(3000, (pool, pool.stride(0)))
    aligned = torch.zeros(4, 3, 1024, dtype=torch.float16)
    assert state_copy._aligned(3072, (aligned, aligned.stride(0)))
    assert not state_copy._aligned(3072, (aligned[:, :, 1:], aligned.stride(0)))


def test_interpreter_pin_respects_the_pruning(monkeypatch):
    """The CPU shim pins a config; a pruned one is swapped for a kept one, as on a GPU."""
    monkeypatch.setenv("HYBRIDKV_INTERPRET_CONFIG", "3")  # BLOCK 8192 / 16 warps
    tune = {"early_config_prune": state_copy._prune_configs}
    pinned = state_copy._autotune(state_copy._CONFIGS, key=[], prune_configs_by=tune)(
        state_copy._gather_kernel.fn
    )
    assert pinned.values["BLOCK"]({"ALIGNED": True}) == 8192
    kept = state_copy._prune_configs(state_copy._CONFIGS, {"ALIGNED": False})
    assert pinned.values["BLOCK"]({"ALIGNED": False}) in [c.kwargs["BLOCK"] for c in kept]


_GPU_CHECK = """
import os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridkv_kernels import state_copy as m

for name in ("_gather_kernel", "_scatter_kernel", "_copy_kernel"):
    k = getattr(m, name)
    assert isinstance(k, triton.runtime.autotuner.Autotuner), type(k)
    assert list(k.restore_value) == [], (name, k.restore_value)
    assert k.early_config_prune is m._prune_configs

# the copy of an unaligned uint8 row (e.g. an fp8 conv state of 3 * 1000 elements) spilled at
# BLOCK 4096 / 8 warps before the pruning; every kept config must compile without spills
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas-blackwell")
fn = m._copy_kernel.fn
sig = {"pool_ptr": "*u8", "src_slot_ptr": "*i64", "dst_slot_ptr": "*i64", "num_slots": "i32",
       "row_numel": "i32", "stride_pool_slot": "i32", "ALIGNED": "constexpr",
       "BLOCK": "constexpr"}
ids = ("src_slot_ptr", "dst_slot_ptr")
attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ids}
for config in m._prune_configs(m._CONFIGS, {"ALIGNED": False}):
    for arch in (80, 90):
        src = ASTSource(fn, sig, {"ALIGNED": False, **config.kwargs}, attrs)
        cc = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=config.num_warps))
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(cc.asm["ptx"])
            f.flush()
            gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
            log = subprocess.run([ptxas, "-v", f"-arch={gpu}", f.name, "-o", os.devnull],
                                 capture_output=True, text=True, check=True).stderr
        spills = re.search(r"(\\d+) bytes spill stores, (\\d+) bytes spill loads", log)
        assert spills.groups() == ("0", "0"), (config, arch, log)
print("ok")
"""


def test_gpu_autotuners_do_not_clone_the_pool_and_unaligned_rows_do_not_spill():
    """Compiled for a GPU (no interpreter): real Autotuners with no ``restore_value`` (which
    would clone the whole pool on the first call per key), and the kept configs for an
    unaligned row compile for sm_80 and sm_90 without spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _GPU_CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
