"""State pool kernels against their torch references: bit-exact, padding rows untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hybridkv_kernels import state_copy
from hybridkv_kernels.state_copy import (
    CONFIGS,
    StateConfig,
    StateShape,
    copy_states,
    copy_states_ref,
    gather_states,
    gather_states_ref,
    plan_copy_states,
    plan_gather_states,
    plan_scatter_states,
    scatter_states,
    scatter_states_ref,
)


def _pool(num_slots: int, shape: tuple[int, ...], slot_pad: int, dtype, offset: int = 3):
    """A pool whose slots sit ``slot_pad`` elements apart beyond their payload, like a state
    component inside a larger page; the gaps are NaN-poisoned so stray writes show."""
    numel = 1
    for s in shape:
        numel *= s
    stride = numel + slot_pad
    backing = torch.full((num_slots * stride + 7 + offset,), float("nan"), dtype=torch.float32)
    backing = backing.to(dtype)
    inner = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        inner[i] = inner[i + 1] * shape[i + 1]
    view = torch.as_strided(backing, (num_slots, *shape), (stride, *inner), offset)
    view.copy_(torch.randn(view.shape).to(dtype))
    return backing, view


def _ref_view(backing: torch.Tensor, pool: torch.Tensor):
    """A clone of ``backing`` and the same view of ``pool`` into it."""
    ref = backing.clone()
    return ref, torch.as_strided(ref, pool.shape, pool.stride(), pool.storage_offset())


CASES = [
    pytest.param((3, 40), 0, torch.float32, id="conv-3x40-contig-fp32"),
    pytest.param((3, 1000), 57, torch.bfloat16, id="conv-3x1000-padded-bf16"),
    pytest.param((4, 16, 33), 5, torch.float32, id="ssm-4x16x33-fp32"),
    pytest.param((7,), 1, torch.float16, id="rglru-7-fp16"),
    pytest.param((2, 64, 48), 128, torch.float16, id="gdn-2x64x48-fp16"),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(state_copy._BITS[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN payloads included)."""
    return torch.equal(_bits(a), _bits(b))


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
    ref_backing, ref_pool = _ref_view(backing, pool)
    slots = torch.tensor([8, -1, 2, 4], dtype=torch.int64)
    src = torch.randn((4, *shape)).to(dtype)
    scatter_states(pool, slots, src)
    scatter_states_ref(ref_pool, slots, src)
    # the whole backing store, gaps included, matches: nothing written outside the slots
    assert _same(backing, ref_backing)


@pytest.mark.parametrize("shape, pad, dtype", CASES)
def test_copy_slot_to_slot(shape, pad, dtype):
    backing, pool = _pool(10, shape, pad, dtype)
    ref_backing, ref_pool = _ref_view(backing, pool)
    src = torch.tensor([1, 4, -1, 7, 0], dtype=torch.int32)
    dst = torch.tensor([2, 9, 3, -1, 5], dtype=torch.int32)
    copy_states(pool, src, dst)
    copy_states_ref(ref_pool, src, dst)
    assert _same(backing, ref_backing)


# ---- every config, the program split, plan reuse -----------------------------------------------

#: rows that are aligned (a multiple of 16 elements, 16-aligned strides and bases), rows whose
#: length is aligned but whose view is not (odd slot stride and base), and odd rows
ROWS = [
    pytest.param((3, 2048), 0, 0, torch.float16, id="aligned-3x2048-fp16"),
    pytest.param((3, 2048), 5, 3, torch.float16, id="aligned-length-unaligned-view-fp16"),
    pytest.param((5, 613), 7, 1, torch.bfloat16, id="odd-5x613-bf16"),
    pytest.param((2, 1024), 16, 0, torch.float8_e4m3fn, id="aligned-2x1024-e4m3"),
    pytest.param((3, 333), 1, 1, torch.float64, id="odd-3x333-fp64"),
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("shape, pad, offset, dtype", ROWS)
def test_every_config_matches_the_reference(config, shape, pad, offset, dtype, monkeypatch):
    """Each config of ``CONFIGS`` (what autotuning may pick on a GPU), on a 1-SM grid so that
    programs loop over several tiles (and the 16-programs-an-SM configs also split rows),
    against the references: NaN-poisoned pools and outputs, bit for bit, padding and
    out-of-range ids skipped."""
    monkeypatch.setattr(state_copy, "_num_sms", lambda device: 1)
    num_slots = 9
    if dtype == torch.float8_e4m3fn:
        raw = torch.randint(0, 256, (num_slots * (6144 + pad) + 8,), dtype=torch.uint8)
        backing = raw.view(dtype)
        pool = torch.as_strided(backing, (num_slots, *shape), (2048 + pad, 1024, 1), 0)
    else:
        backing, pool = _pool(num_slots, shape, pad, dtype, offset)
    # gather: padding, an id past the pool; a given out keeps those rows (NaN)
    slots = torch.tensor([4, -1, 0, 8, 9, 2], dtype=torch.int64)
    out = torch.full((len(slots), *shape), float("nan")).to(dtype)
    want = out.clone()
    gather_states_ref(pool, torch.where(slots < num_slots, slots, -1), want)
    gather_states(pool, slots, out, config=config)
    assert _same(out, want)
    # scatter: padding and an id past the pool skipped
    ref_backing, ref_pool = _ref_view(backing, pool)
    src = torch.randn((len(slots), *shape)).to(dtype)
    scatter_states(pool, slots, src, config=config)
    scatter_states_ref(ref_pool, torch.where(slots < num_slots, slots, -1), src)
    assert _same(backing, ref_backing)
    # copy: pairs with -1 or an id past the pool on either side skipped
    src_slots = torch.tensor([1, 3, -1, 6, 12], dtype=torch.int32)
    dst_slots = torch.tensor([5, 7, 0, -1, 2], dtype=torch.int32)
    copy_states(pool, src_slots, dst_slots, config=config)
    copy_states_ref(ref_pool, src_slots[:4], dst_slots[:4])
    assert _same(backing, ref_backing)


def test_programs_loop_over_tiles_in_the_config_test():
    """What ``test_every_config_matches_the_reference`` exercises on its 1-SM grid: for every
    config some rows loop over several tiles a program, and some configs split rows."""
    loops, splits = set(), set()
    for config in CONFIGS:
        for row_numel, elem_bytes, aligned in ((6144, 2, True), (3065, 2, False), (999, 8, False)):
            block = state_copy.tile_elements(config, elem_bytes, aligned)
            split = state_copy.programs_per_row(6, row_numel, block, config.programs_per_sm, 1)
            tiles = -(-row_numel // block)
            if -(-tiles // split) > 1:
                loops.add(config)
            if split > 1:
                splits.add(config)
    assert loops == set(CONFIGS) and splits


def test_programs_split_rows_and_cover_every_tile():
    """The grid targets ``num_sms * programs_per_sm`` programs; every tile of a row belongs to
    exactly one program whatever the split (the kernels divide by the grid they get)."""
    pr = state_copy.programs_per_row
    assert pr(8, 512 * 1024, 4096, 8, 132) == 128  # B=8 x 1 MiB of bf16: one tile a program
    assert pr(64, 512 * 1024, 4096, 8, 132) == 16  # 8 tiles a program
    assert pr(4096, 512 * 1024, 4096, 8, 132) == 1  # more rows than programs: one a row
    assert pr(3, 100, 4096, 8, 132) == 1  # one tile a row
    for tiles in range(1, 60):
        for split in range(1, 70):
            programs = pr(1, tiles * 64, 64, split, 1)
            per = -(-tiles // programs)
            assert 1 <= programs <= tiles and programs * per >= tiles
            assert (programs - 1) * per < tiles  # no program without a tile


def test_plan_reused_over_two_layers():
    """One plan per step, run on every layer's pool view (here two layers of one buffer)."""
    backing = torch.full((2, 10, 3, 40), float("nan")).half()
    backing[:, :8] = torch.randn(2, 8, 3, 40).half()
    layers = [backing[0, :8], backing[1, :8]]
    ids = torch.tensor([3, -1, 7, 0])
    gather = plan_gather_states(ids, row_numel=120, dtype=torch.float16, num_slots=8)
    for pool in layers:
        assert _same(gather.run(pool), gather_states_ref(pool, ids))
    src = torch.randn(4, 3, 40).half()
    scatter = plan_scatter_states(ids, row_numel=120, dtype=torch.float16)
    ref = backing.clone()
    for i, pool in enumerate(layers):
        scatter.run(pool, src)
        scatter_states_ref(ref[i, :8], ids, src)
    copy = plan_copy_states(
        torch.tensor([0, 3]), torch.tensor([5, 6]), row_numel=120, dtype=torch.float16
    )
    for i, pool in enumerate(layers):
        copy.run(pool)
        copy_states_ref(ref[i, :8], torch.tensor([0, 3]), torch.tensor([5, 6]))
    assert _same(backing, ref)  # rows 8, 9 of each layer (the next state) stay NaN


def test_run_rejects_views_of_another_shape_or_dtype():
    ids = torch.tensor([0, 1])
    shaped = plan_gather_states(ids, row_shape=(3, 40), dtype=torch.float16)
    shaped.run(torch.zeros(4, 3, 40, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"with slots of \[3, 40\] elements"):
        shaped.run(torch.zeros(4, 40, 3, dtype=torch.float16))
    plan = plan_gather_states(ids, row_numel=120, dtype=torch.float16)
    plan.run(torch.zeros(4, 40, 3, dtype=torch.float16))  # only the count was planned
    with pytest.raises(ValueError, match=r"pool must be \[num_slots, \*shape\] torch.float16"):
        plan.run(torch.zeros(4, 3, 41, dtype=torch.float16))
    with pytest.raises(ValueError, match="pool must be"):
        plan.run(torch.zeros(4, 3, 40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        plan.run(torch.zeros(4, 3, 40, dtype=torch.float16), torch.zeros(3, 3, 40).half())
    scatter = plan_scatter_states(ids, row_numel=120, dtype=torch.float16)
    with pytest.raises(ValueError, match="src must be"):
        scatter.run(torch.zeros(4, 3, 40, dtype=torch.float16), torch.zeros(2, 3, 40))
    with pytest.raises(ValueError, match="contiguous"):
        scatter.run(torch.zeros(4, 40, 3, dtype=torch.float16).transpose(1, 2), torch.zeros(2))


def test_plan_arguments():
    ids = torch.tensor([0])
    with pytest.raises(ValueError, match="not one of CONFIGS"):
        plan_gather_states(ids, row_numel=8, dtype=torch.float32, config=StateConfig(4, 4, 5))
    with pytest.raises(ValueError, match="autotune=True needs a GPU"):
        plan_gather_states(ids, row_numel=8, dtype=torch.float32, autotune=True)
    with pytest.raises(ValueError, match="autotune=True needs a GPU"):
        gather_states(torch.zeros(2, 8), ids, autotune=True)
    with pytest.raises(ValueError, match="pass num_slots"):
        plan_scatter_states(ids, row_numel=8, dtype=torch.float32, validate=True)
    with pytest.raises(ValueError, match="1, 2, 4 or 8 bytes"):
        plan_copy_states(ids, ids, row_numel=8, dtype=torch.complex128)
    with pytest.raises(ValueError, match=r"row_shape= .* or its element count as row_numel="):
        plan_gather_states(ids, dtype=torch.float32)
    with pytest.raises(ValueError, match="one of them"):
        plan_gather_states(ids, row_shape=(2, 4), row_numel=8, dtype=torch.float32)
    assert state_copy.plan_state_gather is plan_gather_states  # the brief's names
    empty = torch.zeros(4, 3, 0)  # empty rows and an empty batch: nothing to launch
    assert gather_states(empty, torch.tensor([1, 2])).shape == (2, 3, 0)
    scatter_states(empty, torch.tensor([1]), torch.zeros(1, 3, 0))
    copy_states(torch.zeros(4, 8), torch.tensor([], dtype=torch.long), torch.tensor([]).long())
    plan = plan_gather_states(ids, row_numel=8, dtype=torch.float32, config=CONFIGS[3])
    assert plan.config == CONFIGS[3] and plan.config_source == "given"
    plan = plan_gather_states(ids, row_numel=8, dtype=torch.float32)
    assert plan.config_source.startswith("unmeasured")
    assert plan._aligned_launch is None  # 8 elements: no 16-byte vectors
    assert plan_gather_states(ids, row_numel=32, dtype=torch.float32)._aligned_launch is not None


def test_run_picks_the_tile_and_keys_the_direct_launcher(monkeypatch):
    """An aligned view gets the vector tile, an unaligned view of the same plan the scalar
    tile; the direct launcher's key holds what Triton specialises on (the views' alignment
    and strides, the element type), so no compiled kernel is reused for another
    specialisation."""
    seen = []
    for op, launcher in dict(state_copy._LAUNCHERS).items():

        def spy(grid, key, args, meta, launcher=launcher):
            seen.append((key, meta["BLOCK"]))
            launcher(grid, key, args, meta)

        monkeypatch.setitem(state_copy._LAUNCHERS, op, spy)
    ids = torch.tensor([1, 0])
    plan = plan_gather_states(ids, row_shape=(3, 2048), dtype=torch.float16)
    aligned = torch.randn(3, 3, 2048).half()
    unaligned = torch.randn(3 * 6144 + 1).half()[1:].view(3, 3, 2048)
    for pool in (aligned, unaligned, aligned):
        assert _same(plan.run(pool), gather_states_ref(pool, ids))
    (k1, b1), (k2, b2), (k3, b3) = seen
    assert (b1, b2, b3) == (4 * 8 * 128, 8 * 128, 4 * 8 * 128) and k1 == k3 != k2
    bf16 = plan_gather_states(ids, row_shape=(3, 2048), dtype=torch.bfloat16)
    bf16.run(aligned.bfloat16())
    assert seen[-1][0] == k1  # the kernels move bits: bf16 rows are the same int16 kernel
    fp32 = plan_gather_states(ids, row_shape=(3, 2048), dtype=torch.float32)
    fp32.run(aligned.float())
    assert seen[-1][0] != k1  # another element size: another kernel


def test_launcher_calls_the_compiled_kernel_after_the_first_launch(monkeypatch):
    """``_Launcher`` with a stand-in for a compiled kernel (the interpreter has none): the first
    call of a key goes through ``fn[grid]``, later ones call the compiled kernel's launcher with
    every parameter in order (constexprs last); launch hooks force Triton's path."""
    import triton

    calls = []

    class Compiled:
        function, packed_metadata = "function", "metadata"

        def run(self, *a):
            calls.append(("direct", a))

    class Fn:
        arg_names = ("x_ptr", "n", "BLOCK")

        def __getitem__(self, grid):
            return lambda *args, **meta: calls.append(("triton", grid)) or Compiled()

    class Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 99

    monkeypatch.setattr(state_copy, "_DIRECT_LAUNCH", True)
    monkeypatch.setattr(type(triton.runtime.driver), "active", property(lambda self: Driver()))
    launcher = state_copy._Launcher(Fn())
    meta = {"BLOCK": 16, "num_warps": 4}
    launcher((3, 2, 1), ("a",), ("X", 7), meta)
    launcher((3, 2, 1), ("a",), ("Y", 8), meta)
    launcher((3, 2, 1), ("b",), ("Z", 9), meta)
    assert [c[0] for c in calls] == ["triton", "direct", "triton"]
    assert calls[1][1] == (3, 2, 1, 99, "function", "metadata", None, None, None, "Y", 8, 16)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    launcher((3, 2, 1), ("a",), ("W", 1), meta)
    assert calls[-1][0] == "triton"


# ---- the table ---------------------------------------------------------------------------------


def _shapes_of(rule: state_copy.StateRule):
    for arch in (80, 90):
        for elem_bytes in (1, 2, 4, 8):
            for aligned in (True, False):
                shape = StateShape(arch, elem_bytes, aligned, rule.row_bytes[0], rule.rows[0])
                if rule.matches(shape):
                    yield shape


def test_table_invariants():
    """Every table config is in ``CONFIGS`` and fits every shape class its row can match; every
    row says where it comes from; every shape class gets a config from the table."""
    for rule in state_copy._TABLE:
        assert rule.config in CONFIGS
        # measured rows name the run and the measured shapes; the others what they come from
        assert rule.source.startswith(("H200 GPU suite", "unmeasured: inferred from"))
        shapes = list(_shapes_of(rule))
        assert shapes
        for shape in shapes:
            assert state_copy.config_fits(rule.config, shape), (rule.config, shape)
    for arch in (80, 90):
        for elem_bytes in (1, 2, 4, 8):
            for aligned in (True, False):
                for row_bytes in (16, 1 << 20):
                    shape = StateShape(arch, elem_bytes, aligned, row_bytes, 8)
                    assert state_copy.choose_config(shape)[1].startswith("unmeasured")
    # the measured row: aligned rows of >= 512 KiB at batch >= 64 (the suite's 1 MiB rows)
    shape = StateShape(90, 2, True, 1 << 20, 64)
    assert state_copy.choose_config(shape)[0] == StateConfig(2, 4, 16)
    assert len(set(CONFIGS)) == len(CONFIGS)


def test_tiles():
    """Aligned tiles are ``vecs`` 16-byte vectors a thread; unaligned ones at most 8 elements."""
    c = StateConfig(4, 4, 8)
    assert state_copy.tile_elements(c, 2, True) == 4 * 8 * 128
    assert state_copy.tile_elements(c, 8, True) == 4 * 2 * 128
    for elem_bytes in (1, 2, 4, 8):
        for config in CONFIGS:
            block = state_copy.tile_elements(config, elem_bytes, False)
            assert block <= 8 * 32 * config.num_warps
            assert block & (block - 1) == 0
    _, pool = _pool(4, (3, 1000), 0, torch.float16)  # 3000 elements: not a multiple of 16
    assert not state_copy._aligned(3000, (pool, pool.stride(0)))
    aligned = torch.zeros(4, 3, 1024, dtype=torch.float16)
    assert state_copy._aligned(3072, (aligned, aligned.stride(0)))
    assert not state_copy._aligned(3072, (aligned[:, :, 1:], aligned.stride(0)))


# ---- int64, fp8 pools, NaN payloads -------------------------------------------------------------


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
    nans = torch.tensor([0x7FC00001, 0x7F800001, -1], dtype=torch.int32).view(torch.float32)
    pool32 = nans.repeat(4, 32).reshape(4, 96)
    scatter_states(pool32, torch.tensor([3]), pool32[:1].clone())
    copy_states(pool32, torch.tensor([3]), torch.tensor([1]))
    assert torch.equal(pool32.view(torch.int32), nans.repeat(4, 32).view(torch.int32))


# ---- validation (contract in the module docstring) --------------------------------------------


def _next_layer_pool(num_slots: int = 4, shape=(3, 5)):
    """A pool that is the first ``num_slots`` slots of a larger buffer: the rows after it are
    another layer's state, so an id past the pool would land there."""
    backing = torch.randn(num_slots + 3, *shape)
    return backing, backing[:num_slots]


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
    twice, pool2 = _ref_view(backing, pool)
    src = torch.randn(2, 3, 40).half()
    for p, times in ((pool, 1), (pool2, 2)):
        for _ in range(times):
            scatter_states(p, torch.tensor([6, 1]), src)
            copy_states(p, torch.tensor([6, 1, 2]), torch.tensor([0, 3, 7]))
    assert _same(backing, twice)


#: compiles kernels for a GPU in a process without the interpreter; prints one JSON line a case
COMPILE_SCRIPT = r"""
import importlib, json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
for case in json.loads(sys.stdin.read()):
    fn = getattr(importlib.import_module(case["module"]), case["kernel"])
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in case["divisible"]}
    src = ASTSource(fn, case["signature"], case["constexprs"], attrs)
    cc = triton.compile(src, target=GPUTarget("cuda", case["arch"], 32),
                        options=dict(num_warps=case["num_warps"], num_stages=1))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cc.asm["cubin"])
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path],
                             capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", path],
                              capture_output=True, text=True, check=True).stdout
    print(json.dumps(dict(
        case,
        registers=int(re.search(r"REG:(\d+)", res).group(1)),
        local=int(re.search(r"LOCAL:(\d+)", res).group(1)),
        loads=sorted(set(re.findall(r"LDG\.E(?:\.[A-Z0-9]+)*", sass))),
        stores=sorted(set(re.findall(r"STG\.E(?:\.[A-Z0-9]+)*", sass))),
    )))
"""


def compile_cases(cases: list[dict]) -> list[dict]:
    """Compile each case (module, kernel, signature, constexprs, divisible args, arch, warps)
    for its GPU without a GPU and report registers, local memory (spills) and the SASS load
    and store widths."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT],
        input=json.dumps(cases),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


_TYPES = {1: "i8", 2: "i16", 4: "i32", 8: "i64"}


def _copy_case(config: StateConfig, elem_bytes: int, aligned: bool, arch: int) -> dict:
    ints = ["num_slots", "row_numel", "stride_pool_slot", "tune_rows", "tune_row_bytes"]
    signature = {
        "pool_ptr": f"*{_TYPES[elem_bytes]}",
        "src_slot_ptr": "*i32",
        "dst_slot_ptr": "*i32",
        **dict.fromkeys(ints, "i32"),
        "BLOCK": "constexpr",
        "GRID_PER_SM": "constexpr",
    }
    divisible = ["src_slot_ptr", "dst_slot_ptr"]
    if aligned:  # what Triton's specialisation sees for an aligned row
        divisible += ["pool_ptr", "row_numel", "stride_pool_slot"]
    block = state_copy.tile_elements(config, elem_bytes, aligned)
    return dict(
        module="hybridkv_kernels.state_copy",
        kernel="_copy_kernel",
        signature=signature,
        constexprs={"BLOCK": block, "GRID_PER_SM": config.programs_per_sm},
        divisible=divisible,
        arch=arch,
        num_warps=config.num_warps,
        bound=state_copy.registers_estimate(config, elem_bytes, aligned),
        aligned=aligned,
    )


@pytest.mark.slow  # ~1 minute of compiles on 2 cores
def test_compiled_tiles_vectorise_without_spills():
    """Compiled for sm_80 and sm_90 (no GPU, no interpreter): every config's aligned tile moves
    16-byte vectors (LDG.E.128 / STG.E.128), no tile spills (unaligned ones included: 1- and
    8-byte elements, the worst cases), and the registers stay within ``registers_estimate``,
    on which ``config_fits`` sizes the grid."""
    cases, seen = [], set()
    for arch in (80, 90):
        for config in CONFIGS:
            for elem_bytes, aligned in ((2, True), (8, True), (1, False), (8, False)):
                case = _copy_case(config, elem_bytes, aligned, arch)
                key = (arch, elem_bytes, case["constexprs"]["BLOCK"], config.num_warps)
                if key not in seen:
                    seen.add(key)
                    cases.append(case)
    for got in compile_cases(cases):
        where = (got["arch"], got["signature"]["pool_ptr"], got["constexprs"], got["num_warps"])
        assert got["local"] == 0, where
        assert got["registers"] <= got["bound"], (where, got["registers"])
        if got["aligned"]:
            assert "LDG.E.128" in got["loads"] and got["stores"] == ["STG.E.128"], where


def test_gpu_autotuner_keeps_the_pool_and_tries_only_fitting_configs():
    """Built without the interpreter, the autotuned kernels are real Autotuners with no
    ``restore_value`` (which would clone the whole pool on the first call per key), keyed by
    the batch and row buckets, over the configs that fit (deduplicated: unaligned tiles cap the
    elements a thread, so several configs share one)."""
    code = (
        "import triton\n"
        "from hybridkv_kernels import state_copy as m\n"
        "for op in ('gather', 'scatter', 'copy'):\n"
        "    for es, aligned in ((2, True), (2, False), (8, False)):\n"
        "        k = m._autotuned_kernel(op, es, aligned, 90)\n"
        "        assert isinstance(k, triton.runtime.autotuner.Autotuner), type(k)\n"
        "        assert list(k.restore_value) == [], k.restore_value\n"
        "        assert k.keys == ['tune_rows', 'tune_row_bytes'], k.keys\n"
        "        shape = m.StateShape(90, es, aligned, 1, 1)\n"
        "        want = {(m.tile_elements(c, es, aligned), c.num_warps, c.programs_per_sm)\n"
        "                for c in m.CONFIGS if m.config_fits(c, shape)}\n"
        "        got = [(c.kwargs['BLOCK'], c.num_warps, c.kwargs['GRID_PER_SM'])\n"
        "               for c in k.configs]\n"
        "        assert sorted(got) == sorted(want), (op, es, aligned, got, want)\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
