"""Cache write: scatter the new K and V of a batch of tokens into paged caches of any layout.

The caches are typed strided views ``[num_blocks, block_size, num_kv_heads, head_dim]`` over a
memory plan's raw buffers: the block, token and head strides are arbitrary (vLLM's K-then-V page,
N layers packed per page, head-major pages, layer-outer tensors), only the last dim is
contiguous. Token ``t`` goes to ``slot_mapping[t] = block_id * block_size + offset``; ``-1``
marks a padding token. fp8 caches store ``x / scale`` (one float32 scale per cache, IEEE
division), rounded to nearest even. e4m3 is byte for byte torch's
``(x.float() / scale).to(torch.float8_e4m3fn)``, saturation to +-448 included. e5m2 equals
torch's in range; beyond +-57344 Triton saturates (``satfinite`` on sm_90, the same in its sm_80
emulation) where torch rounds to +-inf, which keeps an outlier from turning attention into NaN.

fp8 e4m3 on GPUs without hardware e4m3 (sm_80, A100): Triton refuses ``fp8e4nv`` below sm_89,
so there the wrapper passes the cache as raw bytes and the kernel encodes e4m3 in software
(``_f32_to_e4m3``, a few integer ops per element on a kernel that is bound by memory). e5m2
converts on sm_80 in Triton's own lowering.

Contract
--------
- ``key`` / ``value``: ``[T, H, D]``, last dim contiguous; ``k_cache`` / ``v_cache``: same dtype,
  same ``num_blocks`` and ``block_size``, last dim contiguous, on the same device.
- ``slot_mapping``: ``[T]`` int32 or int64. Valid slots are ``0 .. num_blocks*block_size - 1``
  and ``-1`` (padding token, nothing written). Live slots must be distinct.
- Always checked on the host (no device sync): shapes, dtypes, devices, strides, the fp8 scales.
- Checked only with ``validate=True`` (or ``HYBRIDKV_VALIDATE=1``; one sync): every slot's range
  and that live slots are distinct. Without it a slot outside ``[-1, num_blocks*block_size)``
  is not reported; the kernel skips it (the token is lost, but nothing outside this cache is
  ever written, e.g. the next layer's page that follows in the buffer).
- ``key`` / ``value`` may be views of the caches themselves (copying a block's first tokens)
  as long as they do not overlap the slots written.

Hopper: no matmul here, so wgmma does not apply. A TMA store could replace the per-thread
stores, but one token's row is only ``H * D`` elements (a few KiB) at an arbitrary page
address, so the vectorised 16-byte stores already move it at full width; no gain expected.

Standalone: imports only torch and triton, so the file can be copied into another project.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _autotune(
    configs: list[triton.Config],
    key: list[str],
    prune_configs_by: dict | None = None,
    **kwargs,
):
    """``triton.autotune`` on a GPU; under the interpreter, pin one config (the first, or the
    one ``HYBRIDKV_INTERPRET_CONFIG`` numbers, so tests can check each), because the autotuner
    needs a GPU driver to benchmark. The pin goes through the same ``early_config_prune`` as on
    a GPU: when it drops the pinned config for a launch, a kept one runs instead, so the CPU
    tests never exercise a config a GPU would not run."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        index = int(os.environ.get("HYBRIDKV_INTERPRET_CONFIG", "0")) % len(configs)
        prune = (prune_configs_by or {}).get("early_config_prune")

        def pick(args: dict | None) -> triton.Config:
            # ``args`` is None when a test reads the pinned values without launching
            if args is None or prune is None:
                return configs[index]
            kept = prune(configs, args)
            return configs[index] if configs[index] in kept else kept[index % len(kept)]

        names = configs[index].kwargs
        return triton.heuristics({k: (lambda args, k=k: pick(args).kwargs[k]) for k in names})
    return triton.autotune(configs, key=key, prune_configs_by=prune_configs_by, **kwargs)


def _fp8e4_in_hardware(device: torch.device) -> bool:
    """sm_89+ (Ada, Hopper) convert e4m3 in hardware; older GPUs get the raw bytes and a
    software conversion in the kernel. Tests and the compile check monkeypatch this."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _validate_enabled(validate: bool | None) -> bool:
    if validate is None:
        return os.environ.get("HYBRIDKV_VALIDATE", "") not in ("", "0")
    return validate


# One program per token writes all its heads; the tile covers every head at once for the usual
# sizes. No ``restore_value``: tuning runs the kernel several times on the real cache, and a
# write is idempotent (the same inputs store the same bytes to the same slots; the inputs never
# overlap the slots written, see the contract), so the trials leave exactly what one launch
# leaves, without cloning the whole cache (a spike the size of the cache on the first call).
_CONFIGS = [
    triton.Config({"BLOCK_H": 1}, num_warps=1),
    triton.Config({"BLOCK_H": 2}, num_warps=2),
    triton.Config({"BLOCK_H": 4}, num_warps=4),
    triton.Config({"BLOCK_H": 8}, num_warps=4),
]


@triton.jit
def _f32_to_e4m3(x):  # x: float32 tensor -> uint8 tensor of e4m3fn bytes
    """Round to nearest even like torch: saturate to +-448 (infinities too), NaN -> 0x7F with
    the sign, subnormals in steps of 2**-9, signed zeros kept."""
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


def _prune_configs(
    configs: list[triton.Config], named_args: dict, **kwargs
) -> list[triton.Config]:
    """Drop tiles with more heads than the cache has: with one or two KV heads per rank (GQA
    under tensor parallelism) they would only add masked-off lanes and tuning time."""
    heads = triton.next_power_of_2({**named_args, **kwargs}["num_heads"])
    return [c for c in configs if c.kwargs["BLOCK_H"] <= heads]


@_autotune(
    _CONFIGS,
    key=["num_heads", "HEAD_DIM_K", "HEAD_DIM_V"],
    prune_configs_by={"early_config_prune": _prune_configs},
)
@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, H, Dk]
    value_ptr,  # [T, H, Dv]
    k_cache_ptr,  # [num_blocks, block_size, H, Dk], strided (uint8 bytes when E4M3_SOFT)
    v_cache_ptr,  # [num_blocks, block_size, H, Dv], strided
    slot_ptr,  # [T] int32/int64, -1 = padding token
    k_scale_ptr,  # [1] float32 (read only when QUANT)
    v_scale_ptr,  # [1] float32
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
    HEAD_DIM_K: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    QUANT: tl.constexpr,  # fp8 cache: store x / scale
    E4M3_SOFT: tl.constexpr,  # e4m3 cache seen as bytes: encode in software (sm_80)
    BLOCK_H: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_hb = tl.program_id(1)
    slot = tl.load(slot_ptr + i_t).to(tl.int64)
    # -1 is padding; anything else outside the cache is a caller bug that validate mode reports.
    # Skipping it here costs one compare and keeps a bad slot from landing in another layer.
    if (slot < 0) | (slot >= num_slots):
        return
    block = slot // block_size
    offset = slot % block_size
    offs_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = offs_h < num_heads
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_k = m_h[:, None] & (offs_dk[None, :] < HEAD_DIM_K)
    m_v = m_h[:, None] & (offs_dv[None, :] < HEAD_DIM_V)

    k = tl.load(
        key_ptr + i_t * stride_key_t + offs_h[:, None] * stride_key_h + offs_dk[None, :], mask=m_k
    )
    v = tl.load(
        value_ptr + i_t * stride_value_t + offs_h[:, None] * stride_value_h + offs_dv[None, :],
        mask=m_v,
    )
    if QUANT:
        # IEEE division, as torch divides: the approximate one is off by an ulp at times,
        # which moves values that sit on an fp8 rounding boundary
        k = tl.div_rn(k.to(tl.float32), tl.load(k_scale_ptr))
        v = tl.div_rn(v.to(tl.float32), tl.load(v_scale_ptr))
        if E4M3_SOFT:
            k = _f32_to_e4m3(k)
            v = _f32_to_e4m3(v)
    p_k = (
        k_cache_ptr
        + block * stride_kc_block
        + offset * stride_kc_token
        + offs_h[:, None].to(tl.int64) * stride_kc_head
        + offs_dk[None, :]
    )
    p_v = (
        v_cache_ptr
        + block * stride_vc_block
        + offset * stride_vc_token
        + offs_h[:, None].to(tl.int64) * stride_vc_head
        + offs_dv[None, :]
    )
    tl.store(p_k, k.to(k_cache_ptr.dtype.element_ty), mask=m_k)
    tl.store(p_v, v.to(v_cache_ptr.dtype.element_ty), mask=m_v)


_FP8 = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
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
) -> None:
    """Write ``key[t]`` / ``value[t]`` (``[T, H, D]``) into the caches at ``slot_mapping[t]``.

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
    num_blocks, block_size = k_cache.shape[:2]
    quant = k_cache.dtype in _FP8
    soft_e4m3 = False
    if quant:
        if k_scale is None or v_scale is None:
            raise ValueError("fp8 caches need k_scale and v_scale (float32 scalars)")
        if k_scale.numel() != 1 or v_scale.numel() != 1:
            raise ValueError("k_scale and v_scale must hold one value each")
        k_scale = k_scale.reshape(1).to(torch.float32)
        v_scale = v_scale.reshape(1).to(torch.float32)
        if k_cache.dtype == torch.float8_e4m3fn and not _fp8e4_in_hardware(k_cache.device):
            soft_e4m3 = True
            k_cache = k_cache.view(torch.uint8)
            v_cache = v_cache.view(torch.uint8)
    else:
        k_scale = v_scale = slot_mapping  # never read
    if _validate_enabled(validate):
        _check_slots(slot_mapping, num_blocks, block_size)
    if num_tokens == 0:
        return
    grid = lambda meta: (num_tokens, triton.cdiv(num_heads, meta["BLOCK_H"]))
    _write_kv_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        num_heads,
        block_size,
        num_blocks * block_size,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        HEAD_DIM_K=dk,
        HEAD_DIM_V=dv,
        BLOCK_DK=triton.next_power_of_2(dk),
        BLOCK_DV=triton.next_power_of_2(dv),
        QUANT=quant,
        E4M3_SOFT=soft_e4m3,
    )


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    block_size = k_cache.shape[1]
    live = slot_mapping >= 0
    slots = slot_mapping[live].long()
    blocks, offsets = slots // block_size, slots % block_size
    k, v = key[live], value[live]
    if k_cache.dtype in _FP8:
        k = k.float() / k_scale.float()
        v = v.float() / v_scale.float()
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)
