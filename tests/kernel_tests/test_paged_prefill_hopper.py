"""The Hopper path of the paged prefill (configs with ``hopper=True``): block ids of multi-page
tiles loaded one tile ahead, page math by shifts on power-of-two pages, TMA descriptors for
one-page tiles. The interpreter runs it here (TMA included); what only a GPU shows (speed,
bf16, the descriptors' encoding by the driver) is in ``paper.gpu_suite``."""

from __future__ import annotations

import math

import pytest
import torch

from hybridkv_kernels import paged_prefill
from hybridkv_kernels.paged_prefill import (
    CONFIGS,
    PrefillConfig,
    PrefillShape,
    config_fits,
    paged_prefill_attention_ref,
    plan_prefill,
)

from .paged import SYNTHETIC, synthetic_caches
from .test_paged_decode import _fill, _fp8_caches

TOL = 2e-3  # fp16


def _H(block_m: int, block_n: int, warps: int, stages: int) -> PrefillConfig:
    return PrefillConfig(block_m, block_n, warps, stages, hopper=True)


def _cu(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)


class _DescriptorSpy:
    """Counts the TMA descriptors ``run`` builds (one per cache and launch)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = paged_prefill.TensorDescriptor.from_tensor

        def spy(tensor, block_shape):
            self.calls += 1
            return real(tensor, block_shape)

        monkeypatch.setattr(paged_prefill.TensorDescriptor, "from_tensor", staticmethod(spy))


def _check(
    k_cache,
    v_cache,
    lens,
    q_lens,
    hq,
    *,
    window=None,
    config,
    tables=None,
    scales=None,
):
    """Plan with ``config`` (a Hopper one), run into a NaN-poisoned ``out``, compare with the
    reference."""
    dtype = torch.float16
    if tables is None:
        tables = _fill(k_cache, v_cache, lens, k_cache.dtype)
    dk, dv = k_cache.shape[3], v_cache.shape[3]
    cu, seq = _cu(q_lens), torch.tensor(lens, dtype=torch.int32)
    total = int(cu[-1])
    plan = plan_prefill(
        tables,
        cu,
        seq,
        num_heads=hq,
        num_kv_heads=k_cache.shape[2],
        head_dim=dk,
        head_dim_v=dv,
        block_size=k_cache.shape[1],
        cache_dtype=k_cache.dtype,
        q_dtype=dtype,
        scale=dk**-0.5,
        total_q=total,
        max_query_len=max(q_lens),
        max_seq_len=max(lens),
        sliding_window=window,
        config=config,
    )
    q = torch.randn(total, hq, dk).to(dtype)
    out = torch.full((total, hq, dv), float("nan"), dtype=dtype)
    ks, vs = scales if scales else (None, None)
    got = plan.run(q, k_cache, v_cache, ks, vs, out=out)
    assert got.data_ptr() == out.data_ptr()
    want = paged_prefill_attention_ref(
        q, k_cache, v_cache, tables, cu, seq, dk**-0.5, window, k_scale=ks, v_scale=vs
    )
    assert not torch.isnan(want).any()
    assert not torch.isnan(out).any()
    err = (out.float() - want.float()).abs().max().item()
    assert err <= (3e-3 if scales else TOL), err
    return plan


@pytest.mark.parametrize("layout", SYNTHETIC)
@pytest.mark.parametrize(
    "block_size, config, tma",
    [
        # 64-token pages, 64-key tiles: one page a tile, TMA boxes
        pytest.param(64, _H(64, 64, 4, 3), True, id="bs64-tile64-tma"),
        # 16-token pages, 64-key tiles: 4 pages a tile, ids ahead, shifts
        pytest.param(16, _H(64, 64, 4, 3), False, id="bs16-tile64-ids-ahead"),
        # 48-token pages: 16-token segments, one division per key (not a power of two)
        pytest.param(48, _H(128, 64, 8, 3), False, id="bs48-tile64-division"),
        # 576-token pages (vLLM's inflated Qwen3-Next block), 32-key tiles: TMA inside a page
        pytest.param(576, _H(128, 32, 8, 3), True, id="bs576-tile32-tma"),
    ],
)
def test_hopper_path_matches_the_reference(layout, block_size, config, tma, monkeypatch):
    """Every cache layout, an extend after a long prefix beside fresh prompts and a request with
    no query token, GQA 4: the output equals the reference, and TMA is taken exactly where the
    tile is one page segment and the layout's strides are whole 16-byte units."""
    spy = _DescriptorSpy(monkeypatch)
    lens, q_lens = [300, 40, 9, 130], [70, 0, 9, 130]
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 4
    _, k_cache, v_cache = synthetic_caches(
        layout, num_blocks, block_size, 2, 32, 32, torch.float16
    )
    plan = _check(k_cache, v_cache, lens, q_lens, 8, config=config)
    assert plan.config == config
    assert spy.calls == (2 if tma else 0)


@pytest.mark.parametrize(
    "ctx_len, q_len, window, block_size, config",
    [
        pytest.param(300, 40, 64, 16, _H(64, 64, 4, 3), id="w64-bs16-ids-ahead"),
        pytest.param(1000, 70, 256, 128, _H(64, 64, 4, 3), id="w256-bs128-tma"),
        pytest.param(500, 33, 100, 48, _H(64, 32, 4, 3), id="w100-bs48"),
    ],
)
def test_hopper_window_never_reads_freed_blocks(ctx_len, q_len, window, block_size, config):
    """Blocks below the window are freed to the null block 0; it and they hold NaN. TMA boxes
    and ids loaded a tile ahead must not carry them into ``p @ v``."""
    seq_len = ctx_len + q_len
    num_blocks = math.ceil(seq_len / block_size) + 4
    _, k_cache, v_cache = synthetic_caches(
        "classic", num_blocks, block_size, 2, 32, 32, torch.float16
    )
    tables = _fill(k_cache, v_cache, [seq_len], torch.float16)
    freed = (ctx_len - window + 1) // block_size
    for b in tables[0, :freed].tolist():
        k_cache[b] = float("nan")
        v_cache[b] = float("nan")
    tables[0, :freed] = 0
    k_cache[0] = float("nan")
    v_cache[0] = float("nan")
    _check(k_cache, v_cache, [seq_len], [q_len], 4, window=window, config=config, tables=tables)


@pytest.mark.parametrize(
    "config", [c for c in CONFIGS if c.hopper], ids=lambda c: str(c).replace(",", "-")
)
def test_every_config_on_the_hopper_path(config):
    """Each Hopper config of ``CONFIGS`` on 32-token pages (one page a tile up to 32 keys, two
    and four at 64 and 128): head dims that are not powers of two and differ for K and V,
    which the TMA box zero-fills past (K rows of 40 fp16 = 80 B, V rows of 24 = 48 B: whole
    16-byte units)."""
    lens, q_lens = [133, 40, 70], [35, 1, 70]
    num_blocks = sum(math.ceil(n / 32) for n in lens) + 4
    _, k_cache, v_cache = synthetic_caches("head-major", num_blocks, 32, 2, 40, 24, torch.float16)
    _check(k_cache, v_cache, lens, q_lens, 8, config=config)


def test_tma_falls_back_where_strides_are_not_16_byte_units(monkeypatch):
    """Head dim 36 fp16: rows of 72 bytes, so the head stride (36 elements) is not a whole
    number of 16-byte units; TMA cannot address it and ``run`` takes the pointer path."""
    spy = _DescriptorSpy(monkeypatch)
    lens, q_lens = [200, 64], [100, 64]
    num_blocks = sum(math.ceil(n / 64) for n in lens) + 3
    _, k_cache, v_cache = synthetic_caches("classic", num_blocks, 64, 2, 36, 36, torch.float16)
    assert (k_cache.stride(2) * 2) % 16 != 0
    _check(k_cache, v_cache, lens, q_lens, 4, config=_H(64, 64, 4, 3))
    assert spy.calls == 0


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("block_size", [16, 64], ids=["bs16", "bs64-tma"])
def test_hopper_fp8_caches(dtype, block_size, monkeypatch):
    """fp8 caches converted in hardware (sm_90): TMA boxes of fp8 bytes, the scales folded into
    the scores and the output."""
    spy = _DescriptorSpy(monkeypatch)
    lens, q_lens = [150, 9], [70, 9]
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 3
    k8, v8 = _fp8_caches(num_blocks, block_size, 2, 64, dtype)
    config = _H(64, 64, 4, 3)
    scales = (torch.tensor([0.5]), torch.tensor([0.25]))
    _check(k8, v8, lens, q_lens, 4, config=config, scales=scales)
    assert spy.calls == (2 if block_size == 64 else 0)


def test_hopper_configs_fit_only_sm90_and_their_caches():
    """``config_fits`` admits a Hopper config only on sm_90+ for 16-bit and hardware-fp8 caches,
    so neither the table, the autotuner's pruning nor the fallback picks one elsewhere."""
    hopper = [c for c in CONFIGS if c.hopper]
    assert hopper, "CONFIGS holds Hopper configs"
    for c in hopper:
        for arch, cache in ((80, "16bit"), (89, "fp8"), (90, "fp32"), (90, "fp8-bytes")):
            shape = PrefillShape(arch, 16, 8, 128, cache, 2048, 8192)
            assert not config_fits(c, shape), (c, shape)
    sm90 = PrefillShape(90, 16, 8, 128, "16bit", 2048, 8192)
    assert [c for c in hopper if config_fits(c, sm90)], "some Hopper config fits d 128 on sm_90"


@pytest.mark.parametrize(
    "cache, software, match",
    [
        (torch.float32, False, r"takes the Hopper path, .* not torch.float32 \(fp32\)"),
        (torch.float8_e4m3fn, True, r"takes the Hopper path, .*\(fp8-bytes\)"),
    ],
)
def test_hopper_refuses_caches_it_does_not_read(cache, software, match, monkeypatch):
    if software:  # sm_80: e4m3 arrives as bytes the generic kernel decodes
        monkeypatch.setattr(paged_prefill, "_fp8e4_in_hardware", lambda device: False)
    tables = torch.tensor([[1, 2]], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        plan_prefill(
            tables,
            torch.tensor([0, 20], dtype=torch.int32),
            torch.tensor([20], dtype=torch.int32),
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            block_size=16,
            cache_dtype=cache,
            q_dtype=torch.float16,
            scale=0.125,
            total_q=20,
            config=_H(64, 16, 4, 3),
        )
