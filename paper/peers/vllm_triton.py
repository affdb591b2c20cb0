"""vLLM 0.33's Triton unified attention as a peer of our paged decode / prefill kernels.

vLLM is never committed here and never installed: ``fetch`` takes the two files that hold the
kernel out of the ``vllm==0.33.0`` wheel into ``FOLDER`` (git-ignored) and writes small stand-ins
for the few ``vllm`` modules they import, so the peer needs only torch and triton::

    python -m paper.peers.vllm_triton --fetch [--wheel PATH]

``VllmTritonAttention`` then calls ``unified_attention`` with the arguments vLLM 0.33's
``TritonAttentionImpl.forward`` passes for a plain decoder layer (causal, no ALiBi, softcap,
sinks, sliding window unless asked, unquantized KV), with the split-K ("3D") threshold, segment
count and scratch buffers sized as ``TritonAttentionMetadataBuilder`` sizes them. What that
backend does, read from the 0.33.0 wheel:

- scratch, allocated once per layer group: ``segm_output [T, Hq, 16, next_pow2(D)]``,
  ``segm_max`` and ``segm_expsum [T, Hq, 16]``, all float32, with
  ``T = min(seq_threshold_3D, max_num_seqs) * max_query_len_3d`` (``max_query_len_3d`` is 1, or
  ``min(1 + num_speculative_tokens, 8)`` with speculative decoding); 16 segments, 64 on
  compute capability 12.0 when few requests run;
- ``seq_threshold_3D = 128 // Hkv`` (the 2D grid's minimum size over the KV heads), moved to
  the nearest CUDA-graph capture size when decode CUDA graphs are on (the default);
- per step: ``cu_seqlens_q`` (query_start_loc), ``seqused_k`` = seq_lens, host ints
  ``max_seqlen_q`` / ``max_seqlen_k``, the block table, ``causal=True``,
  ``window_size=(-1, -1)`` (``(w - 1, 0)`` for a window of w), ``softcap=0``,
  ``q_descale=None``, ``k_descale`` / ``v_descale`` = the layer's scalar 1.0 scale expanded to
  ``[B, Hkv]`` (read only by fp8 caches), ``alibi_slopes``, ``sinks``, ``output_scale``,
  ``mm_prefix_range``, R-SWA and per-token-head scale caches all ``None``,
  ``kv_quant_mode=NONE``, ``chunk_lookback=-1``, ``use_td=False`` (on for Intel XPU only);
- inside ``unified_attention``: the split-K path runs when the scratch is given, every query
  is at most 8 tokens long (causal), ``B * cdiv(max_seqlen_q, BLOCK_Q) <= seq_threshold_3D``
  (``BLOCK_Q = 16 // (Hq / Hkv)``), the scratch has a row per query token and
  ``VLLM_BATCH_INVARIANT`` is off (and not for head size 256 prefill on Blackwell); otherwise
  the 2D kernel runs (KV tile 32, vs 16 for the split-K decode tile in 16/32-bit dtypes).

The caches may have any block / token / head strides (runtime int64 arguments of the kernel);
the head-dim stride is a compile-time constant, so any value works but each one compiles its own
kernel. K and V may be laid out differently but must share one head size, and that of ``q``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch

VERSION = "0.33.0"
FOLDER = Path(__file__).parent / f"vllm-{VERSION.rsplit('.', 1)[0]}"
FETCH_COMMAND = "python -m paper.peers.vllm_triton --fetch [--wheel PATH]"
#: the files taken from the wheel, with the sha256 of the 0.33.0 release's copies: a different
#: wheel fails ``fetch`` rather than being called with 0.33's arguments
FILES = {
    "vllm/v1/attention/ops/triton_unified_attention.py": (
        "c1cf2300c99f5dc1fb297d7e556620842ab53c64c5ecda4c6ba89fb8e16215da"
    ),
    "vllm/v1/attention/ops/triton_attention_helpers.py": (
        "ef697fa4fa19c2543d9001c1db6cf6e8c5da22dd36ec5c1bc29f6a9ac8a59da9"
    ),
}
MODULE = "vllm.v1.attention.ops.triton_unified_attention"
#: where the loaded modules live in ``sys.modules`` once ``load`` returns (see ``load``)
ALIAS = "_hybridkv_peer_vllm033"

# The backend's constants (vllm/v1/attention/backends/triton_attn.py, 0.33.0).
MIN_LAUNCH_GRID_SIZE_2D = 128
NUM_PAR_SOFTMAX_SEGMENTS = 16
#: block sizes the backend accepts (``supports_block_size``) and its smallest head size
BLOCK_SIZE_MULTIPLE = 16
MIN_HEAD_SIZE = 32
#: widest KV tile ``unified_attention`` uses for 16/32-bit caches: the kernel reads block-table
#: columns up to the end of the last tile without a mask, so tables are kept this wide
MAX_TILE = 32


def default_capture_sizes(max_num_seqs: int = 1024, max_size: int = 512) -> tuple[int, ...]:
    """vLLM 0.33's default CUDA-graph capture sizes (1, 2, 4, steps of 8 below 256, then of 16)
    for plain decoding; 1024 sequences is its default on H100 / H200, 512 its default largest
    graph off data-centre Blackwell. Only the sizes near ``128 // Hkv`` matter here."""
    top = min(2 * max_num_seqs, max_size)
    sizes = [s for s in (1, 2, 4) if s <= top]
    sizes += list(range(8, min(top + 1, 256), 8)) + list(range(256, top + 1, 16))
    return tuple(sizes)


DEFAULT_CAPTURE_SIZES = default_capture_sizes()


# ---------------------------------------------------------------------------------------------
# Stand-ins for the vllm modules the two files import. Each holds only what the files touch when
# imported or called for unquantized KV: vllm.envs.VLLM_BATCH_INVARIANT, vllm.logger.init_logger
# (``debug_once``), vllm.platforms.current_platform (``fp8_dtype``, for the fp8 clamp bounds, and
# ``is_device_capability_family``, for a Blackwell-only tile choice), vllm.triton_utils (triton,
# tl) and vllm.v1.kv_cache_interface.KVQuantMode (integer codes the kernel is specialised on).
# ---------------------------------------------------------------------------------------------

_STANDIN_DOC = '"""Stand-in written by paper.peers.vllm_triton.fetch; not vLLM code."""\n'

_STANDINS = {
    "vllm/__init__.py": _STANDIN_DOC,
    "vllm/v1/__init__.py": _STANDIN_DOC,
    "vllm/v1/attention/__init__.py": _STANDIN_DOC,
    "vllm/v1/attention/ops/__init__.py": _STANDIN_DOC,
    "vllm/envs.py": _STANDIN_DOC
    + """
import os

# read once at import, as the kernel module reads it once at import
VLLM_BATCH_INVARIANT = os.getenv("VLLM_BATCH_INVARIANT", "0").strip() not in ("", "0")
""",
    "vllm/logger.py": _STANDIN_DOC
    + """
import logging


class _OnceLogger(logging.LoggerAdapter):
    _seen: set = set()

    def _once(self, level, msg, *args):
        if (level, msg, args) not in self._seen:
            self._seen.add((level, msg, args))
            self.log(level, msg, *args)

    def debug_once(self, msg, *args, **_):
        self._once(logging.DEBUG, msg, *args)

    def info_once(self, msg, *args, **_):
        self._once(logging.INFO, msg, *args)

    def warning_once(self, msg, *args, **_):
        self._once(logging.WARNING, msg, *args)


def init_logger(name):
    return _OnceLogger(logging.getLogger(name), {})
""",
    "vllm/platforms/__init__.py": _STANDIN_DOC
    + """
import torch


class _Platform:
    @staticmethod
    def fp8_dtype():
        # NVIDIA's e4m3 (ROCm MI300 would take the fnuz variant; only fp8 caches read it)
        return torch.float8_e4m3fn

    @staticmethod
    def is_device_capability_family(capability, device_id=0):
        if not torch.cuda.is_available():
            return False
        major, _ = torch.cuda.get_device_capability(device_id)
        return major == capability // 10


current_platform = _Platform()
""",
    "vllm/triton_utils/__init__.py": _STANDIN_DOC
    + """
import triton
import triton.language as tl

__all__ = ["tl", "triton"]
""",
    "vllm/v1/kv_cache_interface.py": _STANDIN_DOC
    + """
import enum


class KVQuantMode(enum.IntEnum):
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4  # its kernel (another file) is not fetched
""",
}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _download_wheel(into: Path) -> Path:
    pip = [sys.executable, "-m", "pip", "download", f"vllm=={VERSION}", "--no-deps"]
    subprocess.run([*pip, "-d", str(into)], check=True)
    wheels = sorted(into.glob(f"vllm-{VERSION}-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download left no vllm-{VERSION} wheel in {into}")
    return wheels[0]


def fetch(wheel: Path | None = None) -> Path:
    """Fill ``FOLDER`` from the vllm 0.33.0 wheel (downloaded with pip, ~340 MB, unless given):
    the two kernel files at their package paths plus generated stand-ins, ~70 KB in all. The
    folder is rebuilt from scratch so a stale copy never mixes with a new one."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(wheel) if wheel is not None else _download_wheel(Path(tmp))
        with zipfile.ZipFile(path) as zf:
            sources = {}
            for name, digest in FILES.items():
                try:
                    data = zf.read(name)
                except KeyError:
                    msg = f"{path} has no {name}: not a vllm {VERSION} wheel"
                    raise FileNotFoundError(msg) from None
                if _sha256(data) != digest:
                    raise ValueError(f"{name} in {path} is not vllm {VERSION}'s (sha256 differs)")
                sources[name] = data
    if FOLDER.exists():
        shutil.rmtree(FOLDER)
    for name, data in sources.items():
        (FOLDER / name).parent.mkdir(parents=True, exist_ok=True)
        (FOLDER / name).write_bytes(data)
    for name, text in _STANDINS.items():
        (FOLDER / name).parent.mkdir(parents=True, exist_ok=True)
        (FOLDER / name).write_text(text)
    (FOLDER / "SOURCE.txt").write_text(
        f"Taken from {path.name} (Apache-2.0, https://github.com/vllm-project/vllm) by\n"
        f"{FETCH_COMMAND}; the other files are stand-ins. Not committed (.gitignore).\n"
    )
    return FOLDER


def available() -> bool:
    """Whether ``FOLDER`` holds 0.33.0's two kernel files and the stand-ins."""
    try:
        return all(
            _sha256((FOLDER / name).read_bytes()) == digest for name, digest in FILES.items()
        ) and all((FOLDER / name).is_file() for name in _STANDINS)
    except OSError:
        return False


_MODULE: ModuleType | None = None


def load() -> ModuleType:
    """Import vLLM's ``triton_unified_attention`` from ``FOLDER`` and return the module.

    The files import ``vllm.*`` by absolute name, and we do not edit them. So ``FOLDER`` goes at
    the front of ``sys.path`` and any real ``vllm.*`` entries leave ``sys.modules`` only for the
    import; afterwards the loaded modules are re-registered under ``ALIAS`` (``vllm.x`` becomes
    ``_hybridkv_peer_vllm033.x``) and the real entries come back. A real vLLM, imported before or
    after, is thus never shadowed by the stand-ins, and ours never answers ``import vllm``. The
    kernels keep working because every name they use was bound at import (the one later import,
    the INT4 kernel's, is a path we never take)."""
    global _MODULE
    if _MODULE is not None:
        return _MODULE
    if not available():
        raise FileNotFoundError(
            f"vLLM {VERSION}'s Triton attention is not in {FOLDER}: run `{FETCH_COMMAND}`"
        )

    def ours(name: str) -> bool:
        return name == "vllm" or name.startswith("vllm.")

    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if ours(name)}
    sys.path.insert(0, str(FOLDER))
    bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # keep FOLDER small
    try:
        importlib.invalidate_caches()
        module = importlib.import_module(MODULE)
    finally:
        sys.dont_write_bytecode = bytecode
        if sys.path and sys.path[0] == str(FOLDER):
            del sys.path[0]
        for name in [name for name in sys.modules if ours(name)]:
            sys.modules[ALIAS + name[len("vllm") :]] = sys.modules.pop(name)
        sys.modules.update(saved)
    _MODULE = module
    return module


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class VllmTritonAttention:
    """One attention layer as vLLM 0.33's TritonAttention backend runs it.

    The constructor does what ``TritonAttentionMetadataBuilder.__init__`` does once per layer
    group: pick ``seq_threshold_3D`` and the segment count and allocate the split-K scratch.
    ``prepare`` does per step what ``build`` and ``forward`` do before the kernel (query start
    offsets, host maxima, descale views, output buffer) and returns a closure whose only work is
    the ``unified_attention`` call, so timing the closure times what vLLM's forward launches.
    ``cudagraph_capture_sizes=None`` is vLLM's eager mode (the threshold stays ``128 // Hkv``).

    Two differences from a served model remain. Under a full decode CUDA graph vLLM pads the
    batch to the next capture size with empty requests (their programs exit at once; the 2D / 3D
    choice is unchanged because the threshold is itself a capture size), and it has no host
    overhead; time the closure with events over many launches or in a CUDA graph. And float32
    inputs: the kernel's ``tl.dot`` runs in TF32 on NVIDIA GPUs (Triton's default), so float32
    results there are only TF32-accurate.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        *,
        sliding_window: int | None = None,
        device: torch.device | str = "cpu",
        max_num_seqs: int = 1024,
        cudagraph_capture_sizes: Sequence[int] | None = DEFAULT_CAPTURE_SIZES,
        num_speculative_tokens: int = 0,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"Hq={num_heads} is not a multiple of Hkv={num_kv_heads}")
        if head_size < MIN_HEAD_SIZE:
            raise ValueError(f"vLLM's Triton backend takes head sizes >= {MIN_HEAD_SIZE}")
        self.module = load()
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = float(scale)
        self.window_size = (sliding_window - 1, 0) if sliding_window else (-1, -1)
        self.device = torch.device(device)
        self.seq_threshold_3D = MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads
        if cudagraph_capture_sizes:
            target = self.seq_threshold_3D
            self.seq_threshold_3D = min(cudagraph_capture_sizes, key=lambda x: abs(x - target))
        self.num_par_softmax_segments = NUM_PAR_SOFTMAX_SEGMENTS
        self.max_seqs_64_segments = 0
        on_cuda = self.device.type == "cuda"
        if on_cuda and torch.cuda.get_device_capability(self.device) == (12, 0):
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self.max_seqs_64_segments = (sms - 1) // (NUM_PAR_SOFTMAX_SEGMENTS * num_kv_heads)
        max_query_len_3d = 1
        if num_speculative_tokens:
            max_query_len_3d = min(1 + num_speculative_tokens, self.module.MAX_3D_QUERY_LEN)
        max_num_seqs_3d = min(self.seq_threshold_3D, max_num_seqs)
        rows = max_num_seqs_3d * max_query_len_3d
        if self.max_seqs_64_segments > 0:
            self.num_par_softmax_segments = 64
            rows = max(
                min(self.max_seqs_64_segments, max_num_seqs_3d) * max_query_len_3d,
                -(-rows // (64 // NUM_PAR_SOFTMAX_SEGMENTS)),
            )
        pad = _next_power_of_2(head_size)
        segs = self.num_par_softmax_segments
        f32 = {"dtype": torch.float32, "device": self.device}
        self.softmax_segm_output = torch.empty((rows, num_heads, segs, pad), **f32)
        self.softmax_segm_max = torch.empty((rows, num_heads, segs), **f32)
        self.softmax_segm_expsum = torch.empty((rows, num_heads, segs), **f32)
        # the layer's ``_k_scale`` / ``_v_scale`` buffers: scalar 1.0 unless fp8 calibrated
        self.k_scale = torch.tensor(1.0, **f32)
        self.v_scale = torch.tensor(1.0, **f32)

    def _scratch(
        self, num_reqs: int, num_tokens: int
    ) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``build``'s scratch choice: the 64-segment layout falls back to 16 segments over the
        same memory when the batch fills the SMs anyway or has more tokens than rows."""
        out, mx, es = self.softmax_segm_output, self.softmax_segm_max, self.softmax_segm_expsum
        segs = self.num_par_softmax_segments
        if self.max_seqs_64_segments > 0 and (
            self.max_seqs_64_segments < num_reqs or mx.shape[0] < num_tokens
        ):
            segs = NUM_PAR_SOFTMAX_SEGMENTS
            out = out.view(-1, self.num_heads, segs, out.shape[-1])
            mx, es = mx.view(-1, self.num_heads, segs), es.view(-1, self.num_heads, segs)
        return segs, out, mx, es

    def _check(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor
    ) -> None:
        if q.dim() != 3 or q.shape[1:] != (self.num_heads, self.head_size):
            raise ValueError(f"q must be [T, {self.num_heads}, {self.head_size}], got {q.shape}")
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if cache.dim() != 4 or cache.shape[2:] != (self.num_kv_heads, self.head_size):
                raise ValueError(
                    f"{name} must be [blocks, block_size, {self.num_kv_heads}, "
                    f"{self.head_size}] (one head size for q, K and V), got {cache.shape}"
                )
            if cache.dtype != q.dtype:
                raise ValueError(f"{name} is {cache.dtype}, q is {q.dtype}: unquantized only")
        if k_cache.shape[:2] != v_cache.shape[:2]:
            raise ValueError("k_cache and v_cache disagree on blocks or block size")
        if k_cache.shape[1] % BLOCK_SIZE_MULTIPLE:
            raise ValueError(
                f"vLLM's Triton backend takes block sizes that are multiples of "
                f"{BLOCK_SIZE_MULTIPLE}, got {k_cache.shape[1]}"
            )
        if q.stride(2) != 1 or out.stride(2) != 1:
            raise ValueError("the kernel assumes a contiguous head dim in q and out")
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}")

    def prepare(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> Callable[[], torch.Tensor]:
        """Everything before the kernel; returns the call to time (it returns ``out``).

        Decode: ``q [B, Hq, D]`` and no ``cu_seqlens_q`` (one query per request). Prefill /
        extend: ``q [total_q, Hq, D]``, ``cu_seqlens_q [B + 1] int32``, and ``seq_lens`` counts
        the new tokens (their K/V already in the cache). Reads the lengths back once (vLLM has
        them on the host). A block table narrower than the last KV tile reaches is copied wider
        (vLLM's tables span the model's whole context, so the kernel's unmasked reads of the
        columns past a request's last block stay inside the table)."""
        out = torch.empty_like(q) if out is None else out
        self._check(q, k_cache, v_cache, out)
        if q.device != self.softmax_segm_max.device:
            raise ValueError(f"q is on {q.device}, the layer's scratch on {self.device}")
        num_reqs = seq_lens.shape[0]
        if cu_seqlens_q is None:
            if q.shape[0] != num_reqs:
                raise ValueError("decode takes one query token per request")
            cu_seqlens_q = torch.arange(num_reqs + 1, dtype=torch.int32, device=q.device)
            max_seqlen_q = 1
        else:
            if cu_seqlens_q.shape != (num_reqs + 1,) or int(cu_seqlens_q[-1]) != q.shape[0]:
                raise ValueError("cu_seqlens_q must be [B + 1] and end at q.shape[0]")
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).cpu()
        if bool((seq_lens.cpu() < q_lens).any()):
            raise ValueError("every seq_len must count the request's new tokens")
        max_seqlen_k = int(seq_lens.max())
        block_size = k_cache.shape[1]
        last_tile_end = -(-max_seqlen_k // MAX_TILE) * MAX_TILE
        width = -(-last_tile_end // block_size)
        if block_tables.dim() != 2 or block_tables.shape[0] != num_reqs:
            raise ValueError("block_tables must be [B, max_blocks]")
        if block_tables.shape[1] < width or block_tables.stride(1) != 1:
            wide = block_tables.new_zeros(num_reqs, max(width, block_tables.shape[1]))
            wide[:, : block_tables.shape[1]] = block_tables
            block_tables = wide
        segs, segm_output, segm_max, segm_expsum = self._scratch(num_reqs, q.shape[0])
        descale_shape = (num_reqs, self.num_kv_heads)
        kwargs = dict(
            q=q,
            k=k_cache,
            v=v_cache,
            out=out,
            cu_seqlens_q=cu_seqlens_q.to(torch.int32),
            max_seqlen_q=max_seqlen_q,
            seqused_k=seq_lens.to(torch.int32),
            max_seqlen_k=max_seqlen_k,
            softmax_scale=self.scale,
            causal=True,
            alibi_slopes=None,
            use_alibi_sqrt=False,
            window_size=self.window_size,
            block_table=block_tables.to(torch.int32),
            softcap=0,
            q_descale=None,
            k_descale=self.k_scale.expand(descale_shape),
            v_descale=self.v_scale.expand(descale_shape),
            seq_threshold_3D=self.seq_threshold_3D,
            num_par_softmax_segments=segs,
            softmax_segm_output=segm_output,
            softmax_segm_max=segm_max,
            softmax_segm_expsum=segm_expsum,
            sinks=None,
            output_scale=None,
            mm_prefix_range=None,
            rswa_prefix_lens=None,
            rswa_window=None,
            kv_quant_mode=self.module.KVQuantMode.NONE,
            k_scale_cache=None,
            v_scale_cache=None,
            chunk_lookback=-1,
            use_td=False,
            mm_prefix_clamp_sliding_window=False,
        )
        kernel = self.module.unified_attention

        def run() -> torch.Tensor:
            kernel(**kwargs)
            return out

        return run

    def uses_split_k(self, num_reqs: int, max_seqlen_q: int, num_tokens: int) -> bool:
        """Whether ``unified_attention`` takes its split-K (3D) path for this batch: the
        condition it evaluates, for plain causal attention (reported beside timings)."""
        group = self.num_heads // self.num_kv_heads
        block_q = (16 if group <= 16 else _next_power_of_2(group)) // group
        q_blocks = -(-max_seqlen_q // block_q)
        _, _, segm_max, _ = self._scratch(num_reqs, num_tokens)
        tuned_large_head = (  # Blackwell's head-size-256 prefill tiles, always 2D
            self.head_size == 256
            and max_seqlen_q > 1
            and group <= 16
            and self.module.current_platform.is_device_capability_family(100)
        )
        return (
            max_seqlen_q <= self.module.MAX_3D_QUERY_LEN
            and not tuned_large_head
            and num_reqs * q_blocks <= self.seq_threshold_3D
            and not self.module.is_batch_invariant
            and segm_max.shape[0] >= num_tokens
        )


@functools.lru_cache(maxsize=16)
def _layer(
    num_heads: int, num_kv_heads: int, head_size: int, scale: float, window: int | None, dev: str
) -> VllmTritonAttention:
    return VllmTritonAttention(
        num_heads, num_kv_heads, head_size, scale, sliding_window=window, device=dev
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """vLLM's decode on our caches, with ``paged_decode_attention_ref``'s signature."""
    layer = _layer(
        q.shape[1], k_cache.shape[2], q.shape[2], float(scale), sliding_window, str(q.device)
    )
    return layer.prepare(q, k_cache, v_cache, block_tables, seq_lens)()


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """vLLM's causal varlen prefill / extend on our caches, with
    ``paged_prefill_attention_ref``'s signature."""
    layer = _layer(
        q.shape[1], k_cache.shape[2], q.shape[2], float(scale), sliding_window, str(q.device)
    )
    return layer.prepare(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fetch", action="store_true", help=f"fill {FOLDER}")
    parser.add_argument("--wheel", type=Path, help="a downloaded vllm-0.33.0 wheel to use")
    args = parser.parse_args(argv)
    if args.fetch:
        folder = fetch(args.wheel)
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        print(f"{folder}: {size / 1024:.0f} KB")
    print(f"available: {available()}")


if __name__ == "__main__":
    main()
