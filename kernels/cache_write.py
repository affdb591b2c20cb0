"""Cache write: scatter the new K and V of a batch of tokens into paged caches of any layout.

The caches are typed strided views ``[num_blocks, block_size, num_kv_heads, head_dim]`` over a
memory plan's raw buffers: the block, token and head strides are arbitrary (K-then-V pages, vLLM
0.33's ``[tokens, heads, K | V]`` pages, N layers packed per page, head-major pages, layer-outer
tensors), only the last dim is contiguous. Token ``t`` goes to ``slot_mapping[t] = block_id *
block_size + offset``; ``-1`` marks a padding token.

Plan once per step, run once per layer (FlashInfer's split): :func:`plan_write_kv_cache` takes
the step's slot mapping and the shapes every layer shares and makes every host decision (config,
tile, grid, the fp8 path, validation); :meth:`WriteKvPlan.run` then writes one layer's K/V and
does no allocation, no environment read and no device sync, so it can be captured in a CUDA
graph; after a specialisation's first launch it skips Triton's argument binding (a direct
launcher, as in ``paged_decode.py``). :func:`write_kv_cache` is plan + run in one call.

Tiling (why it is shaped so). A write is a copy, bound by the bytes each multiprocessor keeps in
flight: at ~4.3 TB/s and ~1 us of loaded DRAM latency (Little's law) ~32 KiB per SM of an
H100/H200. A program writes ``BLOCK_T`` tokens x ``BLOCK_H`` heads (all heads of the usual
tensor-parallel shapes) as one ``[BLOCK_T, BLOCK_H, D]`` tile of K and one of V, 16-byte vectors
along ``D``: both tiles' loads are issued before the first store waits, and they do not wait for
the slot ids either (one ``[BLOCK_T]`` vector load beside them; only the stores need the slots).
Qwen3-Next (2 KV heads x 256, bf16) at the default 8 tokens x 4 warps: 16 KiB read a program,
128 B a thread, 64-68 registers; 8,192 tokens make 1,024 programs, about one wave on 132 SMs
at 7-8 a SM (112-128 KiB in flight a SM). The measurement this replaces (one token a program,
its loads behind its slot id, H200): 54.5% of copy bandwidth at 8,192 tokens, 2.2% at 256.
Fewer tokens take smaller tiles (the table), so that 256 tokens still spread over the SMs.

Aligned views (head dims and every row stride 16-divisible, 16-byte aligned bases: what Triton's
argument specialisation needs to prove 16-byte vectors) use the config's tile. Other views are
written element by element (a 64-bit address and a predicate each), so their tile is cut to at
most ``_MAX_UNALIGNED_PER_THREAD`` elements a thread (more spills). A plan holds both launches
and :meth:`~WriteKvPlan.run` picks by the views it is given (a few integer tests).

fp8 caches store ``x / scale`` (one float32 scale per cache, IEEE division as torch divides),
rounded to nearest even. Saturation contract: **fp8 writes saturate to the largest finite value
(+-448 for e4m3, +-57344 for e5m2), infinities included; NaN stays NaN**. This is what the GPU
does on every path (Triton's ``cvt.rn.satfinite`` on sm_89+ for e4m3 and sm_90 for e5m2, the
``min`` with 57344 of its sm_80 e5m2 emulation, as their PTX shows, and the software encoders
below) and what vLLM's scaled fp8 quantisation does (it clamps before the
cast); it keeps one outlier from turning attention into NaN or inf. torch's own casts differ
between versions (torch 2.11 casts e4m3 inputs >= 464 to NaN on CUDA and CPU, torch 2.13 on the
CPU saturates them; e5m2 rounds to inf in both), so :func:`write_kv_cache_ref` clamps to the
largest finite value before casting: the reference implements the contract whatever the torch.

Where the fp8 bytes come from:

- e4m3 on sm_89+ (Ada, Hopper): Triton's conversion (hardware ``cvt.rn.satfinite``).
- e4m3 on older GPUs (sm_80, A100): Triton refuses ``fp8e4nv`` below sm_89, so the cache is
  passed as raw bytes and the kernel encodes e4m3 in software (``_f32_to_e4m3``, a few integer
  ops per element on a kernel bound by memory).
- e5m2: Triton's conversion on every GPU arch.
- Under the Triton interpreter (``TRITON_INTERPRET=1``, read when the module is imported) both
  formats are encoded in software (``_f32_to_e4m3``, ``_f32_to_e5m2``): the interpreter's own
  narrowing casts round wrongly whenever rounding carries into the exponent (31.5 -> 16,
  500 -> 256, 60000 -> NaN for e4m3; 31.5 -> 16, 30 -> 16 for e5m2).

Contract
--------
- ``key`` / ``value``: ``[T, H, D]``, last dim contiguous; ``k_cache`` / ``v_cache``: same dtype,
  same ``num_blocks`` and ``block_size``, last dim contiguous, on the same device.
- ``slot_mapping``: ``[T]`` int32 or int64. Valid slots are ``0 .. num_blocks*block_size - 1``
  and ``-1`` (padding token, nothing written). Live slots must be distinct.
- Always checked on the host (no device sync): shapes, dtypes, devices, strides, the fp8 scales.
- Checked only with ``validate=True`` (or ``HYBRIDKV_VALIDATE=1``; one sync, at plan time):
  every slot's range and that live slots are distinct. Without it a slot outside
  ``[-1, num_blocks*block_size)`` is not reported; the kernel skips it (the token is lost, but
  nothing outside this cache is ever written, e.g. the next layer's page that follows in the
  buffer).
- ``key`` / ``value`` may be views of the caches themselves (copying a block's first tokens)
  as long as they do not overlap the slots written.

Autotuning (``autotune=True``, a GPU only) runs each candidate several times on the real cache,
with no ``restore_value``: a write is idempotent (the same inputs store the same bytes to the
same slots; the inputs never overlap the slots written, see the contract), so the trials leave
exactly what one launch leaves, without cloning the whole cache (a spike the size of the cache
on the first call per key).

Hopper: no matmul here, so wgmma does not apply. A TMA store could replace the per-thread
stores, but one token's row is only ``H * D`` elements (a few KiB) at an arbitrary page
address, so the vectorised 16-byte stores already move it at full width; no gain expected.

Standalone: imports only torch and triton, so the file can be copied into another project.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

# ---- configs and the default table ------------------------------------------------------------


@dataclass(frozen=True)
class WriteConfig:
    """One compile-time choice of the write kernel."""

    block_t: int  # tokens per program, a power of two
    num_warps: int

    def __str__(self) -> str:
        return f"BLOCK_T={self.block_t},num_warps={self.num_warps}"


#: what autotuning tries (``autotune=True``), the GPU suite sweeps and the compile check
#: compiles; every config of ``_TABLE`` is one of them. Tokens a program from 1 (the most
#: programs, for a few hundred tokens) to 32, at 2, 4 and 8 warps. No loop: ``num_stages`` is 1.
CONFIGS: tuple[WriteConfig, ...] = (
    WriteConfig(1, 4),
    WriteConfig(2, 4),
    WriteConfig(4, 4),
    WriteConfig(8, 4),
    WriteConfig(16, 4),
    WriteConfig(4, 2),
    WriteConfig(8, 8),
    WriteConfig(16, 8),
    WriteConfig(32, 8),
)

#: Elements (of K and V together) a thread when the views are not aligned: each is its own
#: load and store with a 64-bit address and a predicate (see ``state_copy.py``: at 16 ptxas
#: spills, at 8 it does not).
_MAX_UNALIGNED_PER_THREAD = 8


@dataclass(frozen=True)
class WriteShape:
    """The shape class a launch's config is chosen by (and autotuning is keyed by)."""

    arch: int  # compute capability as 80, 90, ...; the interpreter counts as 80
    cache: str  # "16bit" | "fp32" | "fp8" (converted by Triton) | "fp8-bytes" (in software)
    key_bytes: int  # element size of the new K/V
    heads: int  # KV heads, rounded up to a power of two
    head_dim: int  # BLOCK_DK + BLOCK_DV (head dims padded to powers of two)
    min_head_dim: int  # min(BLOCK_DK, BLOCK_DV)
    aligned: bool  # both head dims 16-divisible: 16-byte vectors possible (views checked at run)
    tokens: int  # tokens, rounded up to a power of two

    @property
    def fp8(self) -> bool:
        return self.cache.startswith("fp8")


@dataclass(frozen=True)
class WriteRule:
    """One row of the default table: the first row whose ranges (inclusive) all hold for a
    launch's :class:`WriteShape` gives its config; ``source`` says where the row comes from."""

    config: WriteConfig
    source: str
    tokens: tuple[int, int] = (1, 1 << 40)
    head_dim: tuple[int, int] = (2, 512)  # BLOCK_DK + BLOCK_DV: head dims up to 256

    def matches(self, shape: WriteShape) -> bool:
        return (
            self.tokens[0] <= shape.tokens <= self.tokens[1]
            and self.head_dim[0] <= shape.head_dim <= self.head_dim[1]
        )


_OLD = (
    "the H200 run of 2026-11-26 (hybridkv's paper/results/kernels-before-h200-2026-11-26.md) "
    "measured only the previous kernel (one token a program, its loads behind the slot "
    "id): Qwen3-Next 2x256 bf16, 54.5% of copy bandwidth at 8,192 tokens, 2.2% at 256"
)
#: the default configs, first match wins. No GPU has run this kernel yet: every row is
#: unmeasured and says what it is inferred from (the GPU suite sweeps ``CONFIGS``). The token
#: buckets keep the grid at >= ~2 programs an SM of a 132-SM GPU down to 256 tokens; head dims
#: past 256 fall back to the first config that fits.
_TABLE: tuple[WriteRule, ...] = (
    WriteRule(
        WriteConfig(8, 4),
        f"unmeasured: inferred from {_OLD}; and Little's law: Qwen3-Next 8 tokens x 2 KiB = "
        "16 KiB a program, 64-68 registers (compile check) so 7-8 programs a SM, ~112 KiB in "
        "flight a SM, 3x the ~32 KiB that 4.3 TB/s x ~1 us needs; 4,096 tokens = 512 "
        "programs (~4 a SM), 8,192 one wave of ~8 a SM",
        tokens=(2049, 1 << 40),
    ),
    WriteRule(
        WriteConfig(4, 4),
        f"unmeasured: inferred from {_OLD}; 1,024-2,048 tokens in 256-512 programs of 4 tokens "
        "(~2-4 a SM of 132)",
        tokens=(513, 2048),
    ),
    WriteRule(
        WriteConfig(2, 4),
        f"unmeasured: inferred from {_OLD}; 257-512 tokens in 129-256 programs of 2 tokens",
        tokens=(257, 512),
    ),
    WriteRule(
        WriteConfig(1, 4),
        f"unmeasured: inferred from {_OLD}; <= 256 tokens: one token a program (the most "
        "programs; 2 warps for a 1 KiB token of K), its loads no longer behind its slot id; "
        "launch-bound",
        tokens=(1, 256),
    ),
)


def per_thread_limit(shape: WriteShape, aligned: bool) -> int:
    """Most elements (K and V together) a thread holds, from the compile check (sm_80 and
    sm_90, no spills): 128 bytes of input, 8 16-byte vectors (~64 registers); 64 elements when
    each becomes a float32 divided by the scale (fp8 caches, ~90 registers with Triton's
    conversion) and 32 when it is also encoded in software (~60);
    ``_MAX_UNALIGNED_PER_THREAD`` for unaligned views (scalar accesses)."""
    if not aligned:
        return _MAX_UNALIGNED_PER_THREAD
    if shape.cache == "fp8-bytes":
        return 32
    if shape.fp8:
        return 64
    return 128 // shape.key_bytes


def tile(config: WriteConfig, shape: WriteShape, aligned: bool) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_H, num_warps)`` that ``config`` runs with for ``shape``.

    - Heads: all of them when they fit the thread's budget (:func:`per_thread_limit`), else the
      most that do (halving); for unaligned views also fewer tokens, down to one.
    - Aligned views: at least one 16-byte vector of K (and of V) a thread, or Triton spreads
      the tile over the threads in narrower accesses (a token of one 64-wide head is 128 B: 8
      threads' worth). Small tiles take fewer warps first (down to 1, keeping the programs
      many), then more tokens.
    """
    warps = config.num_warps
    budget = per_thread_limit(shape, aligned) * 32 * warps
    block_t, block_h = config.block_t, shape.heads
    while block_h > 1 and block_t * block_h * shape.head_dim > budget:
        block_h //= 2
    if not aligned:
        while block_t > 1 and block_t * block_h * shape.head_dim > budget:
            block_t //= 2
        return block_t, block_h, warps
    row_bytes = block_h * shape.min_head_dim * shape.key_bytes  # one token of the smaller tile
    while warps > 1 and block_t * row_bytes < 16 * 32 * warps:
        warps //= 2
    while block_t * row_bytes < 16 * 32 * warps:
        block_t *= 2
    return block_t, block_h, warps


def config_fits(config: WriteConfig, shape: WriteShape) -> bool:
    """Whether ``config`` compiles for ``shape`` without spills: its tile (:func:`tile`) holds
    at most :func:`per_thread_limit` elements a thread (checked by ``python -m
    paper.compile_kernels``)."""
    block_t, block_h, warps = tile(config, shape, shape.aligned)
    limit = per_thread_limit(shape, shape.aligned) * 32 * warps
    return block_t * block_h * shape.head_dim <= limit


def choose_config(shape: WriteShape) -> tuple[WriteConfig, str]:
    """The default config of a shape class and where it comes from (a ``_TABLE`` row, or the
    first config of ``CONFIGS`` that fits when a row's config does not fit this shape)."""
    for rule in _TABLE:
        if rule.matches(shape) and config_fits(rule.config, shape):
            return rule.config, rule.source
    for config in CONFIGS:
        if config_fits(config, shape):
            return config, "no table row: the first config that fits"
    raise ValueError(f"no cache-write config fits {shape}")


# ---- kernels ----------------------------------------------------------------------------------


@triton.jit
def _f32_to_e4m3(x):  # x: float32 tensor -> uint8 tensor of e4m3fn bytes
    """Round to nearest even: saturate to +-448 (infinities too), NaN -> 0x7F with the sign,
    subnormals in steps of 2**-9, signed zeros kept."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # Normal range: round the 23-bit mantissa to 3 bits at bit 20 (add half an ulp minus one,
    # plus the kept lsb for ties to even), then rebias the exponent from 127 to 7. Clamping to
    # 480 first keeps the sum inside int32; everything above 464 saturates to 448 (0x7E) anyway.
    a_c = tl.minimum(a, 0x43F00000)
    normal = ((a_c + 0x7FFFF + ((a_c >> 20) & 1)) >> 20) - (120 << 3)
    # Below 2**-6 (e4m3 subnormals): in |x| + 2**14 the fp32 ulp is 2**-9, the e4m3 subnormal
    # step, so the adder itself rounds to nearest even; the low bits are the code (8 = 2**-6).
    subnormal = (tl.abs(x) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    code = tl.where(a < 0x3C800000, subnormal, tl.minimum(normal, 0x7E))
    code = tl.where(a > 0x7F800000, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _f32_to_e5m2(x):  # x: float32 tensor -> uint8 tensor of e5m2 bytes
    """Round to nearest even directly from the float32 bits (not via float16, which would
    round twice): saturate to +-57344 (0x7B; infinities too, like the GPU's satfinite), NaN ->
    0x7F with the sign, subnormals in steps of 2**-16, signed zeros kept."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # Normal range: round the 23-bit mantissa to 2 bits at bit 21 (half an ulp minus one, plus
    # the kept lsb for ties to even), then rebias the exponent from 127 to 15. Clamping to
    # 65536 first keeps the sum inside int32; everything from 61440 (the midpoint past 57344)
    # up saturates to 0x7B anyway.
    a_c = tl.minimum(a, 0x47800000)
    normal = ((a_c + 0xFFFFF + ((a_c >> 21) & 1)) >> 21) - (112 << 2)
    # Below 2**-14 (e5m2 subnormals): in |x| + 128 the fp32 ulp is 2**-16, the e5m2 subnormal
    # step, so the adder itself rounds to nearest even; the low bits are the code (4 = 2**-14).
    subnormal = (tl.abs(x) + 128.0).to(tl.int32, bitcast=True) - 0x43000000
    code = tl.where(a < 0x38800000, subnormal, tl.minimum(normal, 0x7B))
    code = tl.where(a > 0x7F800000, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _quantize(x, scale, FP8: tl.constexpr):
    """``x / scale`` as the cache stores it: IEEE division, as torch divides (the approximate
    one is off by an ulp at times, which moves values that sit on an fp8 rounding boundary),
    then the software encoders for the byte paths; the caller's store converts the rest."""
    x = tl.div_rn(x.to(tl.float32), scale)
    if FP8 == 2:
        x = _f32_to_e4m3(x)
    elif FP8 == 3:
        x = _f32_to_e5m2(x)
    return x


@triton.jit(do_not_specialize=["tune_tokens"])
def _write_kv_kernel(
    key_ptr,  # [T, H, Dk]
    value_ptr,  # [T, H, Dv]
    k_cache_ptr,  # [num_blocks, block_size, H, Dk], strided (uint8 bytes when FP8 >= 2)
    v_cache_ptr,  # [num_blocks, block_size, H, Dv], strided
    slot_ptr,  # [T] int32/int64, -1 = padding token
    k_scale_ptr,  # [1] float32 (read only when FP8)
    v_scale_ptr,  # [1] float32
    num_tokens,  # T
    num_heads,  # H
    block_size,  # tokens per block
    num_slots,  # num_blocks * block_size: slots at or past it are skipped
    stride_key_t,  # key strides (elements), head_dim contiguous
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kc_block,  # k_cache strides (elements) of block, token, head
    stride_kc_token,
    stride_kc_head,
    stride_vc_block,  # v_cache strides
    stride_vc_token,
    stride_vc_head,
    tune_tokens,  # token bucket: read only by autotuning's key
    HEAD_DIM_K: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    FP8: tl.constexpr,  # 0: none; 1: fp8 converted by Triton; 2: e4m3 bytes; 3: e5m2 bytes
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,  # heads per program
):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_t = offs_t < num_tokens
    m_h = offs_h < num_heads
    # the slot ids load beside the rows, not before them: only the stores need the slots
    slot = tl.load(slot_ptr + offs_t, mask=m_t, other=-1).to(tl.int64)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_dk = offs_dk < HEAD_DIM_K
    m_dv = offs_dv < HEAD_DIM_V
    heads = offs_h.to(tl.int64)
    m_in = (m_t[:, None] & m_h[None, :])[:, :, None]
    k = tl.load(
        key_ptr
        + (offs_t * stride_key_t)[:, None, None]
        + (heads * stride_key_h)[None, :, None]
        + offs_dk[None, None, :],
        mask=m_in & m_dk[None, None, :],
    )
    v = tl.load(
        value_ptr
        + (offs_t * stride_value_t)[:, None, None]
        + (heads * stride_value_h)[None, :, None]
        + offs_dv[None, None, :],
        mask=m_in & m_dv[None, None, :],
    )
    if FP8 > 0:
        k = _quantize(k, tl.load(k_scale_ptr), FP8)
        v = _quantize(v, tl.load(v_scale_ptr), FP8)
    # -1 is padding; anything else outside the cache is a caller bug that validate mode reports.
    # Skipping it here costs one compare and keeps a bad slot from landing in another layer.
    live = (slot >= 0) & (slot < num_slots)
    block = slot // block_size
    offset = slot % block_size
    m_out = (live[:, None] & m_h[None, :])[:, :, None]
    p_k = (
        k_cache_ptr
        + (block * stride_kc_block + offset * stride_kc_token)[:, None, None]
        + (heads * stride_kc_head)[None, :, None]
        + offs_dk[None, None, :]
    )
    p_v = (
        v_cache_ptr
        + (block * stride_vc_block + offset * stride_vc_token)[:, None, None]
        + (heads * stride_vc_head)[None, :, None]
        + offs_dv[None, None, :]
    )
    tl.store(p_k, k.to(k_cache_ptr.dtype.element_ty), mask=m_out & m_dk[None, None, :])
    tl.store(p_v, v.to(v_cache_ptr.dtype.element_ty), mask=m_out & m_dv[None, None, :])


# ---- host side --------------------------------------------------------------------------------

_FP8 = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)
#: the largest finite value of each fp8 format: what an fp8 write saturates to (the contract)
FP8_MAX = {dtype: torch.finfo(dtype).max for dtype in _FP8}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# ---- launching ----------------------------------------------------------------------------------

#: Triton versions whose compiled-kernel launch API ``_Launcher`` calls directly (the same check
#: as ``paged_decode.py``)
_DIRECT_LAUNCH = not _INTERPRETED and (3, 6) <= tuple(
    int(x) for x in triton.__version__.split(".")[:2]
) <= (3, 9)


class _Launcher:
    """Launch a ``@triton.jit`` kernel without Triton's per-call argument binding once its
    specialisation has been compiled (as in ``paged_decode.py``): ``JITFunction.run`` binds and
    specialises every argument on every call (tens of microseconds), while an engine launches
    the same specialisation for every layer of every step. The caller names the
    specialisation by a ``key`` holding whatever in its arguments may change between calls and
    matters to Triton (dtypes, pointer alignment, integer classes, constexprs); the first call
    of a key goes through Triton and keeps the compiled kernel, later ones call its launcher
    directly. Triton's path is always taken under the interpreter, while launch hooks are set
    (profilers), or with a Triton whose compiled-kernel API was not checked."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.compiled: dict[tuple, tuple] = {}

    def __call__(self, grid: tuple[int, int, int], key: tuple, args: tuple, meta: dict) -> None:
        hit = self.compiled.get(key)
        if hit is None or _hooks_set():
            kernel = self.fn[grid](*args, **meta)
            if _DIRECT_LAUNCH and hit is None and hasattr(kernel, "packed_metadata"):
                # the launcher takes every parameter in order, constexprs included
                tail = tuple(meta[name] for name in self.fn.arg_names[len(args) :])
                self.compiled[key] = (kernel, tail)
            return
        kernel, tail = hit
        device = triton.runtime.driver.active.get_current_device()
        stream = triton.runtime.driver.active.get_current_stream(device)
        kernel.run(
            grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata,
            None, None, None, *args, *tail,
        )  # fmt: skip


def _hooks_set() -> bool:
    """Whether a profiler (or anyone) hooks Triton's launches: then every launch takes
    Triton's path, which calls the hooks with the launch's metadata."""
    runtime = triton.knobs.runtime
    hooks = (runtime.launch_enter_hook, runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def _int_class(v: int) -> tuple[bool, bool, bool]:
    """What Triton specialises an integer argument on: equal to 1, divisible by 16, 32-bit."""
    return (v == 1, v % 16 == 0, -(2**31) <= v < 2**31)


_write_launcher = _Launcher(_write_kv_kernel)


def _capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability; the CPU (the interpreter) counts as sm_80. The compile
    check monkeypatches this per target."""
    if device.type != "cuda":
        return (8, 0)
    return torch.cuda.get_device_capability(device)


def _fp8e4_in_hardware(device: torch.device) -> bool:
    """sm_89+ (Ada, Hopper) convert e4m3 in hardware; older GPUs get the raw bytes and a
    software conversion in the kernel (e5m2 is converted by Triton on every arch). Under the
    interpreter the kernel encodes both formats in software whatever this says. Tests and the
    compile check monkeypatch this."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Multiprocessors of the GPU (the grid's scale); on the CPU an H100's 132."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _validate_enabled(validate: bool | None) -> bool:
    if validate is None:
        return os.environ.get("HYBRIDKV_VALIDATE", "") not in ("", "0")
    return validate


def _bucket(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _fp8_mode(cache_dtype: torch.dtype, device: torch.device) -> int:
    """The kernel's ``FP8``: 0 no fp8; 1 Triton converts; 2 / 3 e4m3 / e5m2 bytes encoded in
    software (e4m3 below sm_89; both under the interpreter, whose narrowing casts are wrong)."""
    if cache_dtype not in _FP8:
        return 0
    if cache_dtype == torch.float8_e4m3fn:
        return 2 if _INTERPRETED or not _fp8e4_in_hardware(device) else 1
    return 3 if _INTERPRETED else 1


def write_shape(
    *,
    device: torch.device,
    cache_dtype: torch.dtype,
    key_dtype: torch.dtype,
    num_heads: int,
    head_dim: int,
    head_dim_v: int,
    num_tokens: int,
) -> WriteShape:
    """The :class:`WriteShape` of a launch."""
    major, minor = _capability(device)
    mode = _fp8_mode(cache_dtype, device)
    cache = {0: "fp32" if cache_dtype == torch.float32 else "16bit", 1: "fp8"}.get(
        mode, "fp8-bytes"
    )
    return WriteShape(
        arch=10 * major + minor,
        cache=cache,
        key_bytes=torch.empty((), dtype=key_dtype).element_size(),
        heads=_bucket(num_heads),
        head_dim=triton.next_power_of_2(head_dim) + triton.next_power_of_2(head_dim_v),
        min_head_dim=min(triton.next_power_of_2(head_dim), triton.next_power_of_2(head_dim_v)),
        aligned=head_dim % 16 == 0 and head_dim_v % 16 == 0,
        tokens=_bucket(num_tokens),
    )


def _check_slots(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Validate mode: every slot in range, live slots distinct (one device sync)."""
    num_slots = num_blocks * block_size
    slots = slot_mapping.detach().to("cpu", torch.int64)
    bad = ((slots < -1) | (slots >= num_slots)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        value = int(slots[i])
        where = (
            "past the end of the cache (it would land in the memory after it, e.g. the next "
            "layer's page)"
            if value >= num_slots
            else "negative; only -1 means a padding token"
        )
        raise ValueError(
            f"slot_mapping[{i}] = {value} is out of range: valid slots are -1 (padding) or "
            f"0..{num_slots - 1} (num_blocks {num_blocks} * block_size {block_size}); {value} "
            f"is {where}. Pass block_id * block_size + offset with block_id < {num_blocks}, "
            "or -1 to skip the token"
        )
    live = slots[slots >= 0]
    uniq, counts = live.unique(return_counts=True)
    if (counts > 1).any():
        value = int(uniq[counts > 1][0])
        first, second = (slots == value).nonzero().flatten()[:2].tolist()
        raise ValueError(
            f"slot_mapping[{first}] and slot_mapping[{second}] are both {value}: live slots "
            "must be distinct (which token lands there would be unspecified); give each token "
            "its own slot or -1"
        )


def _check_scale(scale: torch.Tensor | None, name: str) -> None:
    if scale is None or scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError(
            f"an fp8 cache needs {name}: a float32 tensor holding one value, got "
            f"{None if scale is None else (scale.dtype, tuple(scale.shape))}"
        )


@functools.cache
def _autotuned_kernel(shape: WriteShape, aligned: bool):
    """The kernel under ``triton.autotune`` over the ``CONFIGS`` that fit ``shape`` (their
    tiles depend on it; ``shape.tokens`` is left out, 1), keyed by the token bucket. Built on
    first use: the interpreter cannot autotune. No ``restore_value``: see the module docstring
    (a write is idempotent)."""
    configs: dict[tuple, triton.Config] = {}
    for c in CONFIGS:
        if aligned and not config_fits(c, shape):
            continue
        block_t, block_h, warps = tile(c, shape, aligned)
        configs.setdefault(
            (block_t, block_h, warps),
            triton.Config({"BLOCK_T": block_t, "BLOCK_H": block_h}, num_warps=warps, num_stages=1),
        )
    return triton.autotune(list(configs.values()), key=["tune_tokens"])(_write_kv_kernel)


@dataclass(frozen=True)
class _Launch:
    """One way to launch the plan's kernel: its grid, its constexprs and options, the plan's part
    of the direct launcher's key, or the autotuner that launches instead."""

    grid: tuple[int, int, int] | Callable
    meta: dict
    key: tuple = ()
    autotuned: Callable | None = None


@dataclass(frozen=True, eq=False)
class WriteKvPlan:
    """Everything :meth:`run` needs that does not change between the layers of one step.

    Made by :func:`plan_write_kv_cache`; holds the step's slot mapping by reference (a CUDA
    graph that captured :meth:`run` replays on whatever it holds then)."""

    num_tokens: int
    num_heads: int
    head_dim: int
    head_dim_v: int
    block_size: int
    num_blocks: int
    key_dtype: torch.dtype
    cache_dtype: torch.dtype
    shape: WriteShape
    config: WriteConfig
    config_source: str  # the table row, "autotune" or "given"
    autotune: bool
    fp8: int  # the kernel's FP8 mode (see _fp8_mode)
    slot_mapping: torch.Tensor = field(repr=False)
    _aligned_launch: _Launch | None = field(repr=False)  # None: a head dim not 16-divisible
    _unaligned_launch: _Launch = field(repr=False)
    # derived once, for run's checks: the shapes of key, value, k_cache and v_cache
    _shapes: tuple[tuple[int, ...], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        t, h, nb, bs = self.num_tokens, self.num_heads, self.num_blocks, self.block_size
        shapes = (
            (t, h, self.head_dim),
            (t, h, self.head_dim_v),
            (nb, bs, h, self.head_dim),
            (nb, bs, h, self.head_dim_v),
        )
        object.__setattr__(self, "_shapes", shapes)  # a frozen dataclass's derived field

    def run(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """Write one layer: ``key [T, H, Dk]`` / ``value [T, H, Dv]`` (the plan's dtype, last
        dim contiguous) into ``k_cache`` / ``v_cache`` ``[num_blocks, block_size, H, D]`` views
        of the plan's shape and dtype (any strides but the last); fp8 caches need ``k_scale`` /
        ``v_scale`` (float32, one value each)."""
        t, h, dk, dv = self.num_tokens, self.num_heads, self.head_dim, self.head_dim_v
        k_shape, v_shape, kc_shape, vc_shape = self._shapes
        if (
            key.shape != k_shape
            or value.shape != v_shape
            or key.dtype != self.key_dtype
            or value.dtype != self.key_dtype
        ):
            raise ValueError(
                f"key/value must be [{t}, {h}, {dk}/{dv}] {self.key_dtype} with a contiguous "
                f"last dim (the plan's), got {tuple(key.shape)} {key.dtype} and "
                f"{tuple(value.shape)} {value.dtype}"
            )
        if (
            k_cache.shape != kc_shape
            or v_cache.shape != vc_shape
            or k_cache.dtype != self.cache_dtype
            or v_cache.dtype != self.cache_dtype
        ):
            raise ValueError(
                f"k_cache/v_cache must be [{self.num_blocks}, {self.block_size}, {h}, "
                f"{dk}/{dv}] {self.cache_dtype} views with a contiguous last dim (the plan's), "
                f"got {tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} "
                f"{v_cache.dtype}"
            )
        ks, vs = key.stride(), value.stride()
        kcs, vcs = k_cache.stride(), v_cache.stride()
        if ks[2] != 1 or vs[2] != 1 or kcs[3] != 1 or vcs[3] != 1:
            raise ValueError(
                "the last dim (head_dim) of key, value, k_cache and v_cache must be contiguous, "
                f"got strides {ks}, {vs}, {kcs}, {vcs}"
            )
        if self.fp8:
            _check_scale(k_scale, "k_scale")
            _check_scale(v_scale, "v_scale")
            if self.fp8 >= 2:  # the kernel writes bytes it encodes itself
                k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        else:
            k_scale = v_scale = self.slot_mapping  # never read
        if t == 0:
            return
        ptrs = tuple(x.data_ptr() % 16 for x in (key, value, k_cache, v_cache, k_scale, v_scale))
        # what Triton's specialisation needs to prove 16-byte vectors: every row stride
        # 16-divisible (their low bits or-ed) and the four bases 16-byte aligned
        low_bits = ks[0] | ks[1] | vs[0] | vs[1] | kcs[0] | kcs[1] | kcs[2] | vcs[0] | vcs[1]
        aligned = (
            self._aligned_launch is not None
            and (low_bits | vcs[2]) % 16 == 0
            and ptrs[0] == ptrs[1] == ptrs[2] == ptrs[3] == 0
        )
        launch = self._aligned_launch if aligned else self._unaligned_launch
        args = (
            key, value, k_cache, v_cache, self.slot_mapping, k_scale, v_scale, t, h,
            self.block_size, self.num_blocks * self.block_size, ks[0], ks[1], vs[0], vs[1],
            kcs[0], kcs[1], kcs[2], vcs[0], vcs[1], vcs[2], self.shape.tokens,
        )  # fmt: skip
        if launch.autotuned is not None:
            launch.autotuned[launch.grid](*args, **launch.meta)
            return
        # what may differ between the layers of a step and matters to Triton's
        # specialisation: the tensors' alignment and the strides (their values: equal strides
        # specialise equally, and the layers of a step share them)
        _write_launcher(launch.grid, (launch.key, ptrs, ks, vs, kcs, vcs), args, launch.meta)


def plan_write_kv_cache(
    slot_mapping: torch.Tensor,
    *,
    num_heads: int,
    head_dim: int,
    head_dim_v: int | None = None,
    block_size: int,
    num_blocks: int,
    key_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    config: WriteConfig | None = None,
    autotune: bool = False,
    validate: bool | None = None,
) -> WriteKvPlan:
    """Plan one step's cache writes: ``slot_mapping [T]`` (int32/int64, -1 = padding) on the
    device the layers' tensors live on, and the shapes every layer of the step shares. Returns
    a :class:`WriteKvPlan` whose :meth:`~WriteKvPlan.run` serves every layer.

    ``config`` overrides the table (:func:`choose_config`); ``autotune=True`` tunes over
    ``CONFIGS`` on the GPU instead, keyed by the token bucket. ``validate`` (default: the
    ``HYBRIDKV_VALIDATE`` switch) checks every slot (one sync; see the module's contract).
    """
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be a [T] int32/int64 tensor, got {tuple(slot_mapping.shape)} "
            f"{slot_mapping.dtype}"
        )
    if min(num_heads, head_dim, head_dim_v, block_size) < 1 or num_blocks < 0:
        raise ValueError(
            f"num_heads {num_heads}, head dims {head_dim}/{head_dim_v} and block_size "
            f"{block_size} must be >= 1, num_blocks {num_blocks} >= 0"
        )
    if key_dtype in _FP8:
        raise ValueError(f"key/value must be fp16/bf16/fp32, got {key_dtype}")
    if autotune and _INTERPRETED:
        raise ValueError(
            "autotune=True needs a GPU: the Triton interpreter cannot time configs; leave it "
            "off (the table's config) or pass config="
        )
    if autotune and config is not None:
        raise ValueError("pass config= or autotune=True, not both")
    if _validate_enabled(validate):
        _check_slots(slot_mapping, num_blocks, block_size)
    device = slot_mapping.device
    num_tokens = slot_mapping.shape[0]
    shape = write_shape(
        device=device,
        cache_dtype=cache_dtype,
        key_dtype=key_dtype,
        num_heads=num_heads,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        num_tokens=num_tokens,
    )
    if autotune:
        source = "autotune"
        config = choose_config(shape)[0]  # recorded only; the autotuner picks per launch
    elif config is None:
        config, source = choose_config(shape)
    else:
        if config not in CONFIGS:
            raise ValueError(f"{config} is not one of CONFIGS: {', '.join(map(str, CONFIGS))}")
        source = "given"
    fp8 = _fp8_mode(cache_dtype, device)
    constexprs = dict(
        HEAD_DIM_K=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_DK=triton.next_power_of_2(head_dim),
        BLOCK_DV=triton.next_power_of_2(head_dim_v),
        FP8=fp8,
    )
    num_slots = num_blocks * block_size
    cache_bits = torch.uint8 if fp8 >= 2 else cache_dtype  # what the kernel is handed
    # the plan's part of the direct launcher's key: every dtype, the slot ids' alignment, the
    # integers' classes (the layers' parts are added per run)
    plan_key = (
        device, key_dtype, cache_bits, slot_mapping.dtype, slot_mapping.data_ptr() % 16,
        tuple(_int_class(v) for v in (num_tokens, num_heads, block_size, num_slots)),
        _int_class(shape.tokens),
    )  # fmt: skip

    def launch(aligned: bool) -> _Launch:
        if autotune:
            return _Launch(
                lambda meta: (
                    triton.cdiv(num_tokens, meta["BLOCK_T"]),
                    triton.cdiv(num_heads, meta["BLOCK_H"]),
                    1,
                ),
                constexprs,
                autotuned=_autotuned_kernel(dataclasses.replace(shape, tokens=1), aligned),
            )
        block_t, block_h, warps = tile(config, shape, aligned)
        meta = dict(constexprs, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=warps, num_stages=1)
        grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_heads, block_h), 1)
        return _Launch(grid, meta, (plan_key, tuple(sorted(meta.items()))))

    return WriteKvPlan(
        num_tokens=num_tokens,
        num_heads=num_heads,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        block_size=block_size,
        num_blocks=num_blocks,
        key_dtype=key_dtype,
        cache_dtype=cache_dtype,
        shape=shape,
        config=config,
        config_source=source,
        autotune=autotune,
        fp8=fp8,
        slot_mapping=slot_mapping,
        _aligned_launch=launch(True) if shape.aligned else None,
        _unaligned_launch=launch(False),
    )


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    validate: bool | None = None,
    config: WriteConfig | None = None,
    autotune: bool = False,
) -> None:
    """Write ``key[t]`` / ``value[t]`` (``[T, H, D]``) into the caches at ``slot_mapping[t]``:
    :func:`plan_write_kv_cache` and :meth:`WriteKvPlan.run` in one call (plan once and run per
    layer to save the host work).

    ``k_scale`` / ``v_scale`` (float32 scalars) are required for fp8 caches and ignored
    otherwise. Slots must be distinct apart from ``-1``. ``validate`` (default: the
    ``HYBRIDKV_VALIDATE`` environment variable) checks every slot, see the module's contract.
    """
    if key.dim() != 3 or value.dim() != 3 or key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"key/value must be [T, H, D], got {tuple(key.shape)}, {tuple(value.shape)}"
        )
    num_tokens, num_heads, dk = key.shape
    dv = value.shape[2]
    for name, cache, d in (("k_cache", k_cache, dk), ("v_cache", v_cache, dv)):
        if cache.dim() != 4 or cache.shape[2] != num_heads or cache.shape[3] != d:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, {num_heads}, {d}], got "
                f"{tuple(cache.shape)}"
            )
        if cache.stride(3) != 1:
            raise ValueError(f"{name}'s head_dim must be contiguous (stride 1)")
    if k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError("k_cache and v_cache must have the same number of blocks and block size")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    if key.dtype != value.dtype:
        raise ValueError(f"key is {key.dtype} but value is {value.dtype}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be [{num_tokens}] int32/int64, got {tuple(slot_mapping.shape)} "
            f"{slot_mapping.dtype}"
        )
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(
            f"key, value, k_cache, v_cache and slot_mapping must be on one device, got {devices}"
        )
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key/value head_dim must be contiguous")
    if k_cache.dtype in _FP8:
        if k_scale is None or v_scale is None:
            raise ValueError("fp8 caches need k_scale and v_scale (float32 scalars)")
        if k_scale.numel() != 1 or v_scale.numel() != 1:
            raise ValueError("k_scale and v_scale must hold one value each")
        k_scale = k_scale.reshape(1).to(torch.float32)
        v_scale = v_scale.reshape(1).to(torch.float32)
    plan = plan_write_kv_cache(
        slot_mapping,
        num_heads=num_heads,
        head_dim=dk,
        head_dim_v=dv,
        block_size=k_cache.shape[1],
        num_blocks=k_cache.shape[0],
        key_dtype=key.dtype,
        cache_dtype=k_cache.dtype,
        config=config,
        autotune=autotune,
        validate=validate,
    )
    plan.run(key, value, k_cache, v_cache, k_scale, v_scale)


# ---- reference --------------------------------------------------------------------------------


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Plain torch, the module's contract: fp8 caches get ``x / scale`` clamped to the format's
    largest finite value (NaN passes through the clamp) and cast with round to nearest even,
    so the bytes do not depend on how this torch version casts values out of range."""
    block_size = k_cache.shape[1]
    live = slot_mapping >= 0
    slots = slot_mapping[live].long()
    blocks, offsets = slots // block_size, slots % block_size
    k, v = key[live], value[live]
    if k_cache.dtype in _FP8:
        top = FP8_MAX[k_cache.dtype]
        k = (k.float() / k_scale.float()).clamp(-top, top)
        v = (v.float() / v_scale.float()).clamp(-top, top)
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)
