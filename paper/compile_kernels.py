"""Compile every kernel launch for sm_80 and sm_90 on a CPU: registers, spills, shared memory.

No GPU is needed. The kernels' *real* launches are captured from the public wrappers
(``paged_decode_attention``, ``paged_prefill_attention``, ``mla_decode_attention``,
``write_kv_cache``, ``gather_states``, ``scatter_states``, ``copy_states``,
``indexer_scores``) instead of writing
their signatures by hand:

1. **Capture.** In a process where ``TRITON_INTERPRET`` is not set, ``Autotuner.run``,
   ``Heuristics.run`` and ``JITFunction.run`` are replaced by recorders, and each wrapper is called
   with ``meta``-device tensors (no memory, any size, so the int64 cases use storages of more than
   2**31 elements). The autotuner recorder hands every config it would benchmark (after its
   ``early_config_prune`` / ``perf_model``, with the launch's named arguments, as
   ``Autotuner.prune_configs`` does) to the next level; the heuristics recorder computes its
   values as Triton does; the JIT recorder specialises the arguments with Triton's own launcher
   binder (``create_function_from_signature`` + ``JITFunction._pack_args``: tensor dtypes to
   pointer types, ints to i32/i64, ints equal to 1 to constexprs, divisibility-by-16 attributes)
   against a ``GPUTarget("cuda", cc, 32)`` backend, so the signature, constexprs, attributes and
   options are the ones a launch on that GPU would compile. A wrapper that still reads a device
   tensor back (``.cpu()``) is called again with its small index tensors on the CPU. Per target,
   each kernel module's ``_fp8e4_in_hardware`` is patched to ``cc >= 89`` and its ``_capability``
   (where a module sizes tiles or prunes configs per GPU) to ``(cc // 10, cc % 10)``.
2. **Compile.** ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32), options=...)``
   for every captured (launch, config, arch), deduplicated, in a pool of worker processes.
3. **Measure.** The PTX goes through the same ``ptxas`` Triton uses for that arch (bundled
   ``ptxas`` below sm_90, ``ptxas-blackwell`` from sm_90) with the same flags plus ``-v``:
   registers, spill stores/loads, stack. Shared memory is ``metadata.shared``; it fits when it is
   at most 166912 B (sm_80) / 232448 B (sm_90). ``nvdisasm -c`` gives SASS: MMA (HMMA, HGMMA,
   QGMMA), global loads (LDG, LDGSTS, UTMALDG) and integer address math (IMAD + LEA + IADD3) per
   kernel and in the hot loop (the innermost loop, found from backward ``BRA``s, that holds the
   kernel's MMAs, or its global loads when it has none). The TTGIR of the hot ``scf.for`` says
   which loads the software pipeliner turned into async copies and how many buffers it allocated.

Outputs: ``paper/results/compile-kernels.csv`` (one row per kernel/launch/config/arch) and
``paper/results/compile-kernels.json`` (the rows, the per kernel x arch summary and provenance:
date, versions, git commit, machine); ``python -m paper.figures`` turns the JSON into the
summary table ``paper/figures/kernels_compiled.md`` (``--out`` trial runs write it beside the
CSV). The names do not start with ``kernels-``: those files are measured GPU results.

    python -m paper.compile_kernels                      # full matrix, committed outputs
    python -m paper.compile_kernels --quick --out /tmp/cc # the CI subset, elsewhere
    python -m paper.compile_kernels --quick --json /tmp/cc.json   # only the JSON report
    python -m paper.compile_kernels --list [--quick]      # the cases

``tests/kernel_tests/test_compile.py`` runs ``--quick`` in a subprocess and fails on any compile
error, spill, or launch for which no config fits the arch's shared memory.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as _dt
import functools
import hashlib
import importlib
import inspect
import io
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "paper" / "results"
FIGURES = ROOT / "paper" / "figures"

#: the architectures checked: A100 (sm_80) and H100 (sm_90)
ARCHS = (80, 90)
#: largest dynamic shared memory one block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin)
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}

#: the kernel modules (hybridkv_kernels.<name>)
MODULES = (
    "paged_decode",
    "paged_prefill",
    "mla_decode",
    "cache_write",
    "state_copy",
    "indexer_scores",
)

# SASS opcodes counted (the opcode's first dot-separated part)
_MMA_OPS = ("HMMA", "HGMMA", "QGMMA", "IMMA", "IGMMA")
_INT_OPS = ("IMAD", "LEA", "IADD3")


# ---- the matrix ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One wrapper call. ``family`` picks the builder; ``params`` are its keyword arguments."""

    family: str
    params: tuple[tuple[str, Any], ...]

    @property
    def p(self) -> dict[str, Any]:
        return dict(self.params)

    @property
    def name(self) -> str:
        return self.family + "/" + "/".join(f"{k}={v}" for k, v in self.params)

    def runs_on(self, arch: int) -> bool:
        """An ``arch=`` parameter pins the case to that arch (the builders ignore it)."""
        return self.p.get("arch", arch) == arch

    def on_every_arch(self) -> Case:
        return Case(self.family, tuple((k, v) for k, v in self.params if k != "arch"))


def _case(family: str, **params: Any) -> Case:
    return Case(family, tuple(params.items()))


DTYPES = ("fp16", "bf16", "e4m3", "e5m2")


def full_matrix() -> list[Case]:
    """Every case the issue lists: ~500 wrapper calls, ~1,400 distinct compiles after
    deduplication (about an hour on 2 cores with a cold Triton cache; ``--jobs`` scales it)."""
    out: list[Case] = []
    for dt in DTYPES:
        for d in (64, 128, 256):
            for g in (1, 4, 8, 16):
                for bs in (16, 544):
                    for win in (0, 1024):
                        out.append(_case("decode", dtype=dt, d=d, gqa=g, bs=bs, win=win, i64=0))
                out.append(_case("decode", dtype=dt, d=d, gqa=g, bs=16, win=0, i64=1))
            for g in (1, 4, 8):
                for bs in (16, 544):
                    for win in (0, 1024):
                        out.append(_case("prefill", dtype=dt, d=d, gqa=g, bs=bs, win=win, i64=0))
                out.append(_case("prefill", dtype=dt, d=d, gqa=g, bs=16, win=0, i64=1))
        # attention sinks (GPT-OSS / GraniteSWA: a learned logit per head, sliding windows)
        for family in ("decode", "prefill"):
            for win in (0, 128):
                out.append(_case(family, dtype=dt, d=64, gqa=8, bs=16, win=win, i64=0, sinks=1))
        # Inkling's relative-position bias (d_rel 16): full layers (GQA 8, 1024 distances)
        # and sliding ones (GQA 4, a 512-token window as wide as their bias)
        for family in ("decode", "prefill"):
            for g, win, rel in ((8, 0, 1024), (4, 512, 512)):
                for bs in (16, 544):
                    out.append(_case(family, dtype=dt, d=128, gqa=g, bs=bs, win=win, i64=0,
                                     rel=rel))  # fmt: skip
            out.append(_case(family, dtype=dt, d=128, gqa=8, bs=16, win=0, i64=1, rel=1024))
        # the GQA decode's sparse walk (Qwen4-Exp's QSA pick: budget 2048 + a ratio-16 tail)
        for g in (4, 8, 16):
            out.append(_case("decode", dtype=dt, d=128, gqa=g, bs=64, win=0, i64=0, topk=2063))
        out.append(_case("decode", dtype=dt, d=128, gqa=8, bs=64, win=0, i64=1, topk=2063))
        for h in (16, 32, 64, 128):
            out.append(_case("mla", dtype=dt, heads=h, bs=64, i64=0))
        out.append(_case("mla", dtype=dt, heads=128, bs=64, i64=1))
        # sparse (top-k index list, DeepSeek-V3.2 / GLM-5-Next's k = 2048)
        for h in (16, 32, 128):
            out.append(_case("mla", dtype=dt, heads=h, bs=64, i64=0, topk=2048))
        out.append(_case("mla", dtype=dt, heads=128, bs=64, i64=1, topk=2048))
        # GLM-5-Next's NoPE MLA (no rope part), dense and sparse
        for topk in (None, 2048):
            extra = {} if topk is None else {"topk": topk}
            out.append(_case("mla", dtype=dt, heads=64, bs=64, i64=0, dr=0, **extra))
        for d in (64, 128, 256):
            for h in (1, 8, 16):
                out.append(_case("cache_write", dtype=dt, d=d, heads=h, i64=0))
        out.append(_case("cache_write", dtype=dt, d=128, heads=8, i64=1))
    # GLM-5-Next's DSA indexer scores: 16-bit rows, bf16 queries (the tensor-core dot) or
    # float32 ones (the engine's: an IEEE float32 dot, for parity with transformers)
    for dt in ("fp16", "bf16"):
        for q in (None, "fp32"):
            for kpool in (4, 16):
                for h in (32, 64):
                    extra = {} if q is None else {"q": q}
                    out.append(
                        _case("indexer", dtype=dt, d=128, heads=h, kpool=kpool, bs=64, i64=0,
                              **extra)
                    )  # fmt: skip
            extra = {} if q is None else {"q": q}
            out.append(_case("indexer", dtype=dt, d=64, heads=16, kpool=4, bs=16, i64=0, **extra))
        out.append(_case("indexer", dtype=dt, d=128, heads=32, kpool=16, bs=64, i64=1))
        # Qwen4-Exp's QSA pooling (mean, RMS norm, rotary on 64 dims) with the engine's
        # float32 queries, ratio 4 and 16
        for kpool in (4, 16):
            for h in (32, 64):
                out.append(_case("indexer", dtype=dt, d=128, heads=h, kpool=kpool, bs=64, i64=0,
                                 q="fp32", pool="qsa", rot=64))  # fmt: skip
        out.append(_case("indexer", dtype=dt, d=128, heads=32, kpool=16, bs=64, i64=1,
                         q="fp32", pool="qsa", rot=64))  # fmt: skip
    for op in ("gather", "scatter", "copy"):
        for row in STATE_ROWS:
            for dt in ("fp16", "bf16", "fp32"):
                out.append(_case("states", op=op, row=row, dtype=dt, i64=0))
            out.append(_case("states", op=op, row=row, dtype="fp32", i64=1))
    # the quick subset too, so that a quick run (CI, or a baseline of older kernels) can be
    # compared case by case with a full one (a quick case pinned to one arch is the full
    # matrix's case on every arch)
    return out + [c for c in quick_matrix() if c.on_every_arch() not in out]


def quick_matrix() -> list[Case]:
    """A representative subset for CI (a few minutes on 2 cores with a cold Triton cache): every
    kernel, every cache dtype, every head dim, both block sizes, the window and int64 paths, GQA
    1..16, MLA 16..128 heads, the three state rows."""
    c = _case
    qsa = dict(q="fp32", pool="qsa", rot=64)  # Qwen4-Exp's QSA pooling, the engine's queries
    return [
        c("decode", dtype="fp16", d=128, gqa=4, bs=16, win=0, i64=0),
        c("decode", dtype="bf16", d=256, gqa=8, bs=544, win=1024, i64=0),
        c("decode", dtype="e4m3", d=128, gqa=16, bs=16, win=0, i64=1),
        c("decode", dtype="e5m2", d=64, gqa=1, bs=544, win=0, i64=0),
        c("prefill", dtype="fp16", d=128, gqa=4, bs=16, win=0, i64=0),
        c("prefill", dtype="bf16", d=256, gqa=8, bs=544, win=1024, i64=0),
        c("prefill", dtype="e4m3", d=256, gqa=1, bs=16, win=0, i64=1),
        # where the full matrix found spills the general rules admit: sm_80 16-bit and fp8 at
        # head dim 128, sm_90 fp8 decode at head dim 64; each compiled for that arch only (on
        # sm_90 the other prefill cases sweep the same Hopper candidates)
        c("prefill", dtype="fp16", d=128, gqa=1, bs=544, win=0, i64=0, arch=80),
        c("prefill", dtype="e5m2", d=128, gqa=8, bs=16, win=0, i64=0, arch=80),
        c("decode", dtype="e5m2", d=64, gqa=4, bs=16, win=0, i64=0, arch=90),
        # attention sinks on a sliding window (GPT-OSS / GraniteSWA's d 64, GQA 8)
        c("decode", dtype="bf16", d=64, gqa=8, bs=16, win=128, i64=0, sinks=1),
        c("prefill", dtype="bf16", d=64, gqa=8, bs=16, win=128, i64=0, sinks=1),
        # Inkling's relative-position bias: full layers (d 128, GQA 8, 1024 distances) and
        # sliding ones (GQA 4, a 512-token window with 512 distances)
        c("decode", dtype="bf16", d=128, gqa=8, bs=16, win=0, i64=0, rel=1024),
        c("decode", dtype="bf16", d=128, gqa=4, bs=16, win=512, i64=0, rel=512),
        c("prefill", dtype="bf16", d=128, gqa=8, bs=16, win=0, i64=0, rel=1024),
        c("prefill", dtype="bf16", d=128, gqa=4, bs=16, win=512, i64=0, rel=512),
        c("mla", dtype="bf16", heads=16, bs=64, i64=0),
        c("mla", dtype="bf16", heads=32, bs=64, i64=0),  # Kimi-Linear at TP1
        # ... its 32 heads padded to a Hopper warpgroup's 64 rows (wgmma), the sweep's candidate
        c("mla", dtype="bf16", heads=32, bs=64, i64=0, hpp=64, arch=90),
        c("mla", dtype="e4m3", heads=128, bs=64, i64=0),
        c("mla", dtype="e5m2", heads=64, bs=64, i64=1),
        # the sparse walk (token-index list, k = 2048): 16-bit at 32 heads, fp8 beyond 2**31
        c("mla", dtype="bf16", heads=32, bs=64, i64=0, topk=2048),
        c("mla", dtype="e4m3", heads=128, bs=64, i64=1, topk=2048),
        # GLM-5-Next's NoPE MLA (latent rows with no rope part) through its top-k list
        c("mla", dtype="bf16", heads=64, bs=64, i64=0, dr=0, topk=2048),
        c("cache_write", dtype="fp16", d=128, heads=8, i64=0),
        c("cache_write", dtype="e4m3", d=256, heads=16, i64=1),
        c("cache_write", dtype="bf16", d=64, heads=1, i64=0),
        c("cache_write", dtype="e5m2", d=40, heads=3, i64=0),  # rows not a multiple of 16
        # Qwen3-Next on vLLM's inflated 576-token pages: 64-token segments
        c("decode", dtype="bf16", d=256, gqa=8, bs=576, win=0, i64=0),
        # GLM-5-Next's DSA indexer scores over bf16 rows: bf16 queries, and the engine's
        # float32 ones (an IEEE float32 dot) at GLM-5.3-Flash's kpool 16
        c("indexer", dtype="bf16", d=128, heads=32, kpool=4, bs=64, i64=0),
        c("indexer", dtype="bf16", d=128, heads=32, kpool=16, bs=64, i64=0, q="fp32"),
        # Qwen4-Exp: the QSA pooling (float32 queries, rotary on 64 of 128 dims) and the GQA
        # decode's sparse walk over its pick (budget 2048 + the ratio-16 tail), 16-bit and fp8
        c("indexer", dtype="bf16", d=128, heads=32, kpool=16, bs=64, i64=0, **qsa),
        c("decode", dtype="bf16", d=128, gqa=8, bs=64, win=0, i64=0, topk=2063),
        c("decode", dtype="e4m3", d=128, gqa=8, bs=64, win=0, i64=1, topk=2063),
        c("states", op="gather", row="mamba2-ssm", dtype="fp32", i64=1),
        c("states", op="scatter", row="conv-odd", dtype="bf16", i64=0),
        c("states", op="copy", row="conv-odd", dtype="fp16", i64=0),
        c("states", op="copy", row="gdn", dtype="bf16", i64=0),
    ]


#: per-slot state shapes: a Mamba-2 SSM state (Nemotron-H 8B: 128 heads x 64 x 128 state), a conv
#: state whose row (3 x 1033 = 3099 elements) is not a multiple of 16, a GDN recurrent state
#: (Qwen3.5: 16 value heads x 128 x 128)
STATE_ROWS: dict[str, tuple[int, ...]] = {
    "mamba2-ssm": (128, 64, 128),
    "conv-odd": (3, 1033),
    "gdn": (16, 128, 128),
}


# ---- wrapper calls on meta tensors --------------------------------------------------------------


def _torch_dtype(name: str):
    import torch

    return {
        "fp16": torch.float16,
        "bf16": torch.bfloat16,
        "fp32": torch.float32,
        "e4m3": torch.float8_e4m3fn,
        "e5m2": torch.float8_e5m2,
    }[name]


def _q_dtype(cache_dtype: str):
    """Queries and new K/V: fp16 next to an fp16 cache, else bf16 (the usual model dtype)."""
    return _torch_dtype("fp16" if cache_dtype == "fp16" else "bf16")


def _kv_caches(num_blocks: int, bs: int, heads: int, d: int, dtype, device):
    """K and V views of one paged buffer whose page is K then V (vLLM's hybrid layout before
    0.33; 0.33's ``[tokens, heads, K | V]`` page has other stride values of the same
    divisibility by 16 at these head dims, which is what Triton specializes on)."""
    import torch

    pages = torch.empty((num_blocks, 2, bs, heads, d), dtype=dtype, device=device)
    return pages[:, 0], pages[:, 1]


def _blocks_for(elements_per_block: int, i64: int, default: int) -> int:
    """Enough blocks for the case; for int64 cases a storage of more than 2**31 elements."""
    return (2**31 // elements_per_block + 64) if i64 else default


def _index(values: list[int], dtype, device):
    """A small index tensor: real values on the CPU, shape only on meta."""
    import torch

    if device.type == "meta":
        return torch.empty(len(values), dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, device=device)


def _table(rows: int, cols: int, device):
    import torch

    if device.type == "meta":
        return torch.empty((rows, cols), dtype=torch.int32, device=device)
    return torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols) % 97


def _call(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call a wrapper with the optional keywords it accepts (``max_seq_len``, ``validate``...)."""
    accepted = inspect.signature(fn).parameters
    return fn(*args, **{k: v for k, v in kwargs.items() if k in accepted})


def _fp8_scales(dtype: str, device):
    import torch

    if dtype in ("e4m3", "e5m2"):
        return torch.empty(1, dtype=torch.float32, device=device)
    return None


def _sinks(p: dict, q_heads: int, meta):
    """``[Hq]`` float32 sink logits for a case with ``sinks=1``, else None."""
    import torch

    if not p.get("sinks"):
        return None
    return torch.empty(q_heads, dtype=torch.float32, device=meta)


#: relative states per head in the relative-bias cases (Inkling's d_rel)
_REL_DIM = 16


def _rel(p: dict, tokens: int, q_heads: int, dtype, meta) -> dict:
    """``rel_states [tokens, Hq, 16]`` and ``rel_proj [16, rel]`` in the queries' dtype for a
    case with ``rel=<extent>``, else nothing."""
    import torch

    if not p.get("rel"):
        return {}
    return {
        "rel_states": torch.empty((tokens, q_heads, _REL_DIM), dtype=dtype, device=meta),
        "rel_proj": torch.empty((_REL_DIM, p["rel"]), dtype=dtype, device=meta),
    }


def _run_decode(p: dict, meta, index, autotune: bool) -> None:
    import torch

    from hybridkv_kernels import paged_decode

    batch, kv_heads, max_len = 4, 8, 4096
    d, bs = p["d"], p["bs"]
    cdt = _torch_dtype(p["dtype"])
    nblocks = _blocks_for(2 * bs * kv_heads * d, p["i64"], 4096)
    k, v = _kv_caches(nblocks, bs, kv_heads, d, cdt, meta)
    q = torch.empty((batch, kv_heads * p["gqa"], d), dtype=_q_dtype(p["dtype"]), device=meta)
    cols = -(-max_len // bs)
    sinks = _sinks(p, kv_heads * p["gqa"], meta)
    scale = _fp8_scales(p["dtype"], meta)
    _call(
        paged_decode.paged_decode_attention,
        q,
        k,
        v,
        _table(batch, cols, index),
        _index([max_len, 1000, 17, max_len - 1][:batch], torch.int32, index),
        d**-0.5,
        sliding_window=p["win"] or None,
        k_scale=scale,
        v_scale=scale,
        max_seq_len=max_len,
        validate=False,
        autotune=autotune,
        sinks=sinks,
        token_indices=None if p.get("topk") is None else _table(batch, p["topk"], index),
        **_rel(p, batch, kv_heads * p["gqa"], q.dtype, meta),
    )


def _run_prefill(p: dict, meta, index, autotune: bool) -> None:
    import torch

    from hybridkv_kernels import paged_prefill

    kv_heads = 8
    d, bs = p["d"], p["bs"]
    cdt = _torch_dtype(p["dtype"])
    nblocks = _blocks_for(2 * bs * kv_heads * d, p["i64"], 4096)
    k, v = _kv_caches(nblocks, bs, kv_heads, d, cdt, meta)
    scale = _fp8_scales(p["dtype"], meta)
    sinks = _sinks(p, kv_heads * p["gqa"], meta)
    # one step per query-length class of the table: an extend (16 new tokens after a
    # 4080-token cached prefix) beside a fresh 512-token prefill (< 1k query tokens), and one
    # fresh 2048-token prefill (the class the GPU sweeps measured)
    for q_lens, seq_lens in (([16, 512], [4096, 512]), ([2048], [2048])):
        q = torch.empty(
            (sum(q_lens), kv_heads * p["gqa"], d), dtype=_q_dtype(p["dtype"]), device=meta
        )
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        _call(
            paged_prefill.paged_prefill_attention,
            q,
            k,
            v,
            _table(len(q_lens), -(-max(seq_lens) // bs), index),
            _index(cu, torch.int32, index),
            _index(seq_lens, torch.int32, index),
            d**-0.5,
            sliding_window=p["win"] or None,
            k_scale=scale,
            v_scale=scale,
            max_seq_len=max(seq_lens),
            max_query_len=max(q_lens),
            validate=False,
            autotune=autotune,
            sinks=sinks,
            **_rel(p, q.shape[0], q.shape[1], q.dtype, meta),
        )


def _run_mla(p: dict, meta, index, autotune: bool) -> None:
    import torch

    from hybridkv_kernels import mla_decode

    # dr 0: a NoPE MLA (GLM-5-Next), whose latent rows hold no rope part
    batch, max_len, dc, dr, bs = 4, 4096, 512, p.get("dr", 64), p["bs"]
    nblocks = _blocks_for(bs * (dc + dr), p["i64"], 4096)
    cache = torch.empty((nblocks, bs, dc + dr), dtype=_torch_dtype(p["dtype"]), device=meta)
    qdt = _q_dtype(p["dtype"])
    topk = p.get("topk")  # a sparse launch: a [batch, topk] token-index list
    _call(
        mla_decode.mla_decode_attention,
        torch.empty((batch, p["heads"], dc), dtype=qdt, device=meta),
        torch.empty((batch, p["heads"], dr), dtype=qdt, device=meta),
        cache,
        _table(batch, -(-max_len // bs), index),
        _index([max_len, 1000, 17, max_len - 1], torch.int32, index),
        (dc + dr) ** -0.5,
        k_scale=_fp8_scales(p["dtype"], meta),
        max_seq_len=max_len,
        validate=False,
        autotune=autotune,
        token_indices=None if topk is None else _table(batch, topk, index),
        heads_per_program=p.get("hpp"),
    )


def _run_cache_write(p: dict, meta, index, autotune: bool) -> None:
    import torch

    from hybridkv_kernels import cache_write

    tokens, bs, d, heads = 256, 16, p["d"], p["heads"]
    nblocks = _blocks_for(2 * bs * heads * d, p["i64"], 1024)
    k, v = _kv_caches(nblocks, bs, heads, d, _torch_dtype(p["dtype"]), meta)
    qdt = _q_dtype(p["dtype"])
    scale = _fp8_scales(p["dtype"], meta)
    _call(
        cache_write.write_kv_cache,
        torch.empty((tokens, heads, d), dtype=qdt, device=meta),
        torch.empty((tokens, heads, d), dtype=qdt, device=meta),
        k,
        v,
        _index(list(range(tokens)), torch.int64, index),
        k_scale=scale,
        v_scale=scale,
        validate=False,
        autotune=autotune,
    )


def _run_states(p: dict, meta, index, autotune: bool) -> None:
    import math

    import torch

    from hybridkv_kernels import state_copy

    shape = STATE_ROWS[p["row"]]
    row = math.prod(shape)
    slots = (2**31 // row + 64) if p["i64"] else 512
    pool = torch.empty((slots, *shape), dtype=_torch_dtype(p["dtype"]), device=meta)
    batch = 64
    # slot ids live with the pool (the wrappers check it); they are never read back
    ids = torch.empty(batch, dtype=torch.int32, device=meta)
    if p["op"] == "gather":
        _call(state_copy.gather_states, pool, ids, validate=False, autotune=autotune)
    elif p["op"] == "scatter":
        src = torch.empty((batch, *shape), dtype=pool.dtype, device=meta)
        _call(state_copy.scatter_states, pool, ids, src, validate=False, autotune=autotune)
    else:
        dst = torch.empty(batch, dtype=torch.int32, device=meta)
        _call(state_copy.copy_states, pool, ids, dst, validate=False, autotune=autotune)


def _run_indexer(p: dict, meta, index, autotune: bool) -> None:
    import torch

    from hybridkv_kernels import indexer_scores

    # a prefill's 64 query tokens at the end of a 4,096-token context beside three decodes
    d, heads, kpool, bs = p["d"], p["heads"], p["kpool"], p["bs"]
    ctx = [4096, 1000, 17, 4096]
    queries = [list(range(4032, 4096)), [999], [16], [4095]]
    if p.get("pool") == "qsa":  # Qwen4-Exp: rows of raw keys, the planner's pool transform
        _run_qsa_indexer(p, meta, index, autotune, ctx, queries)
        return
    width = 2 * d + 1
    nblocks = _blocks_for(bs * width, p["i64"], 4096)
    rows = torch.empty((nblocks, bs, 1, width), dtype=_torch_dtype(p["dtype"]), device=meta)
    qdt = _torch_dtype(p["q"]) if "q" in p else _q_dtype(p["dtype"])
    n = sum(len(x) for x in queries)
    _call(
        indexer_scores.indexer_scores,
        torch.empty((n, heads, d), dtype=qdt, device=meta),
        torch.empty((n, heads), dtype=torch.float32, device=meta),
        rows,
        torch.empty((kpool, d), dtype=torch.float32, device=meta),
        _table(len(ctx), -(-max(ctx) // bs), index),
        _index([r for r, x in enumerate(queries) for _ in x], torch.int32, index),
        _index([t for x in queries for t in x], torch.int32, index),
        _index([c // kpool for c in ctx], torch.int32, index),
        d**-0.5,
        validate=False,
        autotune=autotune,
    )


def _run_qsa_indexer(p: dict, meta, index, autotune: bool, ctx, queries) -> None:
    """Qwen4-Exp's QSA pool scores (``pool="mean_norm_rope"``): rows of raw keys ``[D]``, the
    pooled key normalised and rotated on ``rot`` dims; planned and run (the one-call wrapper is
    the gated pool's)."""
    import torch

    from hybridkv_kernels import indexer_scores

    d, heads, kpool, bs, rot = p["d"], p["heads"], p["kpool"], p["bs"], p["rot"]
    nblocks = _blocks_for(bs * d, p["i64"], 4096)
    rows = torch.empty((nblocks, bs, 1, d), dtype=_torch_dtype(p["dtype"]), device=meta)
    qdt = _torch_dtype(p["q"]) if "q" in p else _q_dtype(p["dtype"])
    n, pools = sum(len(x) for x in queries), max(ctx) // kpool
    plan = indexer_scores.plan_indexer_scores(
        _table(len(ctx), -(-max(ctx) // bs), index),
        _index([r for r, x in enumerate(queries) for _ in x], torch.int32, index),
        _index([t for x in queries for t in x], torch.int32, index),
        _index([c // kpool for c in ctx], torch.int32, index),
        num_heads=heads, head_dim=d, kpool=kpool, block_size=bs, rows_dtype=rows.dtype,
        q_dtype=qdt, softmax_scale=1.0, pool="mean_norm_rope", rotary_dim=rot,
        autotune=autotune, validate=False,
    )  # fmt: skip
    f32 = dict(dtype=torch.float32, device=meta)
    plan.run(
        torch.empty((n, heads, d), dtype=qdt, device=meta),
        torch.empty((n, heads), **f32),
        rows,
        norm=torch.empty(d, **f32),
        cos=torch.empty((pools, rot), **f32),
        sin=torch.empty((pools, rot), **f32),
    )


_BUILDERS: dict[str, Callable] = {
    "decode": _run_decode,
    "prefill": _run_prefill,
    "mla": _run_mla,
    "cache_write": _run_cache_write,
    "states": _run_states,
    "indexer": _run_indexer,
}


# ---- capture -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Launch:
    """One kernel launch of a wrapper call, with every config its autotuner would try."""

    kernel: str  # module:qualname, the key of triton's JIT function registry
    index: int  # launch number within the wrapper call
    grid: tuple[int, ...] | None = None
    configs: list[dict] = dataclasses.field(default_factory=list)  # one job spec per config
    heuristics: list[str] = dataclasses.field(default_factory=list)
    autotuned: bool = False


class _Recorder:
    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend

        self.arch = arch
        self.target = GPUTarget("cuda", arch, 32)
        self.backend = make_backend(self.target)
        self.launches: list[Launch] = []
        self.current: Launch | None = None  # set while an autotuner hands out its configs
        self.config_label: str | None = None
        self.heuristics: list[str] = []
        self._binders: dict[int, Callable] = {}

    def binder(self, fn) -> Callable:
        from triton.runtime.jit import create_function_from_signature

        b = self._binders.get(id(fn))
        if b is None:
            b = create_function_from_signature(fn.signature, fn.params, self.backend)
            self._binders[id(fn)] = b
        return b

    def record(self, fn, args: tuple, kwargs: dict, grid: Any) -> None:
        """What ``JITFunction.run`` does up to ``_do_compile``, against this target."""
        from triton import knobs

        kwargs = dict(kwargs)
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):  # newer Triton only
            kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
        bound, specialization, options = self.binder(fn)(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(
            self.backend, kwargs, bound, specialization, options
        )
        if callable(grid):
            grid = grid(bound)
        grid = tuple(int(g) for g in grid)
        kernel = f"{fn.module}:{fn.fn.__qualname__}"
        named = {fn.arg_names[path[0]]: _plain(v) for path, v in constexprs.items()}
        if self.config_label:
            label = self.config_label
        else:  # the table's choice, passed as constexprs: name its tile like a config's label
            tile = [f"{k}={named[k]}" for k in _TILE_CONSTEXPRS if k in named]
            label = ",".join(
                [*tile, f"num_warps={options.num_warps}", f"num_stages={options.num_stages}"]
            )
        launch = self.current
        if launch is None:
            launch = Launch(kernel=kernel, index=len(self.launches))
            self.launches.append(launch)
        launch.grid = grid
        launch.heuristics = sorted(set(launch.heuristics) | set(self.heuristics))
        launch.configs.append(
            {
                "kernel": kernel,
                "arch": self.arch,
                "config": label,
                "constexprs": named,
                "signature": dict(signature),
                "constexpr_paths": {path: _plain(v) for path, v in constexprs.items()},
                "attrs": dict(attrs),
                "options": dict(options.__dict__),
            }
        )


def _plain(v: Any) -> Any:
    """Constexpr values as plain Python (they are ints, bools, floats, None or dtypes here)."""
    if type(v).__name__ == "constexpr":
        v = v.value
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return str(v)


#: the constexprs a kernel's config sets (tile sizes), named in a launch's label
_TILE_CONSTEXPRS = ("BLOCK_M", "BLOCK_N", "BLOCK_P", "BLOCK_T", "BLOCK_H", "BLOCK", "GRID_PER_SM")


def _config_label(cfg) -> str:
    parts = [f"{k}={v}" for k, v in cfg.kwargs.items()]
    parts += [f"num_warps={cfg.num_warps}", f"num_stages={cfg.num_stages}"]
    if cfg.num_ctas != 1:
        parts.append(f"num_ctas={cfg.num_ctas}")
    if cfg.maxnreg is not None:
        parts.append(f"maxnreg={cfg.maxnreg}")
    return ",".join(parts)


def _require_compiled_mode() -> None:
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        raise RuntimeError(
            "the compile check must run where TRITON_INTERPRET is not set (under the interpreter "
            "the kernels are not JIT functions); run `python -m paper.compile_kernels`"
        )


def _kernel_modules() -> list:
    return [importlib.import_module(f"hybridkv_kernels.{m}") for m in MODULES]


@contextmanager
def _capturing(arch: int) -> Iterator[_Recorder]:
    """Replace the launch path by recorders and fp8 detection by ``arch >= 89``."""
    from triton.runtime import autotuner, jit

    rec = _Recorder(arch)

    def autotuner_run(self, *args, **kwargs):
        # Autotuner.run: one config needs no pruning; otherwise the pruned list is benchmarked
        self.nargs = dict(zip(self.arg_names, args))
        configs = self.prune_configs(kwargs) if len(self.configs) > 1 else self.configs[:1]
        jit_fn = self.fn
        while not isinstance(jit_fn, jit.JITFunction):
            jit_fn = jit_fn.fn
        launch = Launch(
            kernel=f"{jit_fn.module}:{jit_fn.fn.__qualname__}",
            index=len(rec.launches),
            autotuned=True,
        )
        rec.launches.append(launch)
        rec.current = launch
        try:
            for cfg in configs:
                rec.config_label = _config_label(cfg)
                rec.heuristics = []
                self.fn.run(*args, **kwargs, **cfg.all_kwargs())
        finally:
            rec.current, rec.config_label, self.nargs = None, None, None

    def heuristics_run(self, *args, **kwargs):
        for name, heur in self.values.items():
            kwargs[name] = heur({**dict(zip(self.arg_names, args)), **kwargs})
            rec.heuristics.append(name)
        return self.fn.run(*args, **kwargs)

    def jit_run(self, *args, grid, warmup, **kwargs):
        rec.record(self, args, kwargs, grid)
        rec.heuristics = []

    saved = [
        (autotuner.Autotuner, "run", autotuner_run),
        (autotuner.Heuristics, "run", heuristics_run),
        (jit.JITFunction, "run", jit_run),
    ]
    for mod in _kernel_modules():
        if hasattr(mod, "_fp8e4_in_hardware"):
            saved.append((mod, "_fp8e4_in_hardware", lambda device, a=arch: a >= 89))
        if hasattr(mod, "_capability"):  # modules that size tiles or prune configs per GPU
            saved.append((mod, "_capability", lambda device, a=arch: (a // 10, a % 10)))
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in saved]
    try:
        for obj, name, new in saved:
            setattr(obj, name, new)
        yield rec
    finally:
        for obj, name, old in originals:
            setattr(obj, name, old)


def _reads_device(exc: BaseException) -> bool:
    """A wrapper that copied a meta tensor to the host (a device sync on a GPU)."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return "meta" in text or "item()" in text or "data-dependent" in text


def capture(case: Case, arch: int, autotune: bool = True) -> tuple[list[Launch], str]:
    """The launches of one wrapper call for one arch, and how the index tensors were passed.
    With ``autotune`` the wrappers launch through their autotuners, so every candidate config
    is captured; without, the one config the default table picks."""
    import torch

    _require_compiled_mode()
    meta, cpu = torch.device("meta"), torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _capturing(arch) as rec:
            try:
                _BUILDERS[case.family](case.p, meta, meta, autotune)
                return rec.launches, "meta"
            except (NotImplementedError, RuntimeError, ValueError) as exc:
                if not _reads_device(exc):
                    raise
            rec.launches.clear()
            _BUILDERS[case.family](case.p, meta, cpu, autotune)
            return rec.launches, "cpu-index (the wrapper reads device tensors back)"


# ---- compile and measure (worker processes) -----------------------------------------------------


def _job_key(job: dict) -> str:
    blob = json.dumps(
        [
            job["kernel"],
            job["arch"],
            sorted(job["signature"].items()),
            sorted((list(k), v) for k, v in job["constexpr_paths"].items()),
            sorted((list(k), v) for k, v in job["attrs"].items()),
            sorted((k, repr(v)) for k, v in job["options"].items()),
        ],
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _worker_init() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    _kernel_modules()  # registers every JIT function under module:qualname


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _ptxas_path(arch: int) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch)
    return ptxas[0] if isinstance(ptxas, tuple) else ptxas.path  # Triton 3.3: (path, version)


@functools.lru_cache
def _tool_versions() -> dict[str, str]:

    def version(path: str) -> str:
        out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"release ([\d.]+), (V[\d.]+)", out)
        return m.group(2) if m else out.strip().splitlines()[-1]

    out = {f"ptxas_sm{a}": version(_ptxas_path(a)) for a in ARCHS}
    out["nvdisasm"] = version(_tool("nvdisasm"))
    return out


def _analysis_dir() -> Path:
    from triton import knobs

    d = Path(knobs.cache.dir) / "hybridkv-compile-analysis"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _ptxas_verbose(ptx: str, arch: int, options: dict) -> dict:
    """Run the ptxas Triton used for this arch with Triton's flags and ``-v``."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    ptxas = _ptxas_path(arch)
    flags = ["-lineinfo", "-v", "--regAllocOptLevel=2"]
    if not options.get("enable_fp_fusion", True):
        flags.append("--fmad=false")
    if options.get("ptx_options"):
        flags += options["ptx_options"].split()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run(
            [
                ptxas,
                *flags,
                f"--gpu-name={sm_arch_from_capability(arch)}",
                str(src),
                "-o",
                str(Path(tmp) / "k.cubin"),
            ],
            capture_output=True,
            text=True,
        )
    log = proc.stdout + proc.stderr
    out = {
        "ptxas": Path(ptxas).name,
        "registers": None,
        "spill_stores": None,
        "spill_loads": None,
        "stack": None,
    }
    if m := re.search(r"Used (\d+) registers", log):
        out["registers"] = int(m.group(1))
    if m := re.search(
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log
    ):
        out["stack"], out["spill_stores"], out["spill_loads"] = map(int, m.groups())
    if proc.returncode:
        out["ptxas_error"] = log.strip()[-2000:]
    return out


#: bump when the measurements change, so cached analyses are redone
_ANALYSIS_VERSION = 3

_SASS_INSN = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)[.\w]*")
_SASS_LABEL = re.compile(r"^(\.L_x_\d+):")
_SASS_BRA = re.compile(r"\bBRA(?:\.[A-Z.]+)?\s+`?\(?(\.L_x_\d+)")


def sass_counts(sass: str) -> dict:
    """Opcode counts of the whole kernel and of its hot loop.

    A loop is a backward ``BRA`` (to a label earlier in the code). The hot loop is the innermost
    loop holding MMAs (no loop nested in it holds any), the one with the most; for kernels without
    MMAs, the same with global loads. Nested wait loops (mbarrier polling) stay inside the count.
    """
    insns: list[str] = []
    labels: dict[str, int] = {}
    loops: list[tuple[int, int]] = []
    for line in sass.splitlines():
        if m := _SASS_LABEL.match(line.strip()):
            labels[m.group(1)] = len(insns)
            continue
        m = _SASS_INSN.match(line)
        if not m:
            continue
        op = m.group(1)
        insns.append("WARPGROUP.DEPBAR" if op == "WARPGROUP" and ".DEPBAR" in line else op)
        if op == "BRA" and (b := _SASS_BRA.search(line)) and b.group(1) in labels:
            start = labels[b.group(1)]
            if start < len(insns) - 1:
                loops.append((start, len(insns)))

    def count(ops: list[str]) -> dict:
        return {
            "mma": sum(op in _MMA_OPS for op in ops),
            "hmma": ops.count("HMMA"),
            "hgmma": ops.count("HGMMA") + ops.count("QGMMA"),
            "ldg": ops.count("LDG"),
            "ldgsts": ops.count("LDGSTS"),
            "tma": ops.count("UTMALDG"),
            # wgmma.wait_group: where a warpgroup stops until its asynchronous MMAs land
            "mma_waits": ops.count("WARPGROUP.DEPBAR"),  # the one opcode kept with its suffix
            "int_ops": sum(op in _INT_OPS for op in ops),
            "insns": len(ops),
        }

    total = count(insns)
    metric = "mma" if total["mma"] else "loads"

    def score(lo: int, hi: int) -> int:
        c = count(insns[lo:hi])
        return c["mma"] if metric == "mma" else c["ldg"] + c["ldgsts"] + c["tma"]

    hot = None
    for lo, hi in loops:
        s = score(lo, hi)
        if s == 0:
            continue
        nested = [(a, b) for a, b in loops if lo <= a and b <= hi and (a, b) != (lo, hi)]
        if any(score(a, b) for a, b in nested):
            continue
        if hot is None or s > score(*hot):
            hot = (lo, hi)
    loop = count(insns[hot[0] : hot[1]]) if hot else None
    out = {f"sass_{k}": v for k, v in total.items()}
    out["sass_loops"] = len(loops)
    for k in ("insns", "mma", "ldg", "ldgsts", "tma", "mma_waits", "int_ops"):
        out[f"loop_{k}"] = loop[k] if loop else None
    return out


_MEMDESC = re.compile(r"!ttg\.memdesc<([0-9x]+)x(\w+),[^>]*mutable>")
_LOAD_TYPE = re.compile(r"tt\.load [^:]*: (tensor<([0-9x]+)x!tt\.ptr<(\w+)>|!tt\.ptr<(\w+)>)")


def ttgir_loop(ttgir: str) -> dict:
    """What the software pipeliner did with the hot ``scf.for`` (the innermost holding a dot,
    else the innermost): loads left synchronous (``tt.load``, with their shapes), async copies
    (cp.async / TMA), and the multi-buffered shared tiles (``<stages>x<tile>``)."""
    lines = ttgir.splitlines()
    loops = []
    for i, line in enumerate(lines):
        if "scf.for" in line and "=" in line:
            indent = len(line) - len(line.lstrip())
            for j in range(i + 1, len(lines)):
                s = lines[j]
                if s.strip().startswith("}") and len(s) - len(s.lstrip()) == indent:
                    loops.append((i, j))
                    break
    inner = [(a, b) for a, b in loops if not any(a < c and d < b for c, d in loops)]
    with_dot = [(a, b) for a, b in inner if any(_is_dot(x) for x in lines[a:b])]
    pick = max(with_dot or inner, key=lambda ab: ab[1] - ab[0], default=None)
    buffers = sorted({f"{m.group(1)}x{m.group(2)}" for m in _MEMDESC.finditer(ttgir)})
    out = {"ttgir_buffers": " ".join(buffers)}
    if pick is None:
        out.update(ttgir_loop_sync_loads="", ttgir_loop_async_copies=None)
        return out
    body = lines[pick[0] : pick[1]]
    sync = []
    for x in body:
        if " tt.load " in x and (m := _LOAD_TYPE.search(x)):
            sync.append(f"{m.group(2)}x{m.group(3)}" if m.group(2) else f"{m.group(4)}")
    out["ttgir_loop_sync_loads"] = " ".join(sync)
    out["ttgir_loop_async_copies"] = sum(
        "async_copy_global_to_local" in x or "async_tma_copy" in x or "descriptor_load" in x
        for x in body
    )
    return out


def _is_dot(line: str) -> bool:
    return " tt.dot " in line or "warp_group_dot" in line or "tc_gen5_mma" in line


def _jit_function(kernel: str):
    """The JITFunction named ``module:qualname`` (under its autotuner/heuristics wrappers)."""
    import importlib

    from triton.runtime.jit import JITFunction

    module, qualname = kernel.split(":")
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn


def compile_job(job: dict) -> dict:
    """Compile one (kernel, specialisation, config, arch) and measure it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _jit_function(job["kernel"])
    arch = job["arch"]
    src = ASTSource(fn, job["signature"], job["constexpr_paths"], job["attrs"])
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cc = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=job["options"])
    except Exception as exc:  # a compile error is a result, not a crash of the check
        msg = str(exc).strip()
        lines = [x for x in msg.splitlines() if x.strip()]
        short = next((x for x in lines if "error" in x.lower()), lines[-1] if lines else "")
        return {"status": "compile_error", "error": f"{type(exc).__name__}: {short}"[:500]}
    compile_s = time.perf_counter() - t0
    ptx, cubin = cc.asm["ptx"], cc.asm["cubin"]
    key = f"{_ANALYSIS_VERSION}|{arch}|{job['options']}|{_tool_versions()}"
    key = hashlib.sha256(ptx.encode() + key.encode()).hexdigest()
    cached = _analysis_dir() / f"{key}.json"
    if cached.exists():
        res = json.loads(cached.read_text())
    else:
        res = _ptxas_verbose(ptx, arch, job["options"])
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "k.cubin"
            path.write_bytes(cubin)
            sass = subprocess.run(
                [_tool("nvdisasm"), "-c", str(path)], capture_output=True, text=True
            ).stdout
            usage = subprocess.run(
                [_tool("cuobjdump"), "--dump-resource-usage", str(path)],
                capture_output=True,
                text=True,
            ).stdout
        # static shared memory (sm_90 kernels reserve 1 KiB) counts against the opt-in limit
        # too: the driver allows at most limit - static bytes of dynamic shared memory
        m = re.search(r"SHARED:(\d+)", usage)
        res["static_shared"] = int(m.group(1)) if m else 0
        m = re.search(r"LOCAL:(\d+)", usage)
        res["local"] = int(m.group(1)) if m else None
        res.update(sass_counts(sass))
        res.update(ttgir_loop(cc.asm["ttgir"]))
        cached.write_text(json.dumps(res))
    shared = int(cc.metadata.shared)
    res.update(
        status="ok" if not res.get("ptxas_error") else "ptxas_error",
        error=res.pop("ptxas_error", ""),
        shared=shared,
        fits=shared + res["static_shared"] <= SHARED_LIMIT[arch],
        num_warps=cc.metadata.num_warps,
        num_stages=cc.metadata.num_stages,
        compile_s=round(compile_s, 2),
    )
    if job.get("asm_dir"):
        d = Path(job["asm_dir"]) / f"{job['kernel'].split(':')[1]}-sm{arch}-{job['key']}"
        d.mkdir(parents=True, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            (d / f"k.{ext}").write_text(cc.asm[ext])
        (d / "k.cubin").write_bytes(cubin)
    return res


# ---- the run ---------------------------------------------------------------------------------

CSV_COLUMNS = [
    "kernel", "arch", "case", "launch", "config", "status", "error", "registers", "spill_stores",
    "spill_loads", "stack", "local", "shared", "static_shared", "fits", "sass_mma", "sass_hmma",
    "sass_hgmma", "sass_ldg", "sass_ldgsts", "sass_tma", "sass_int_ops", "sass_insns",
    "sass_loops", "loop_insns", "loop_mma", "loop_ldg", "loop_ldgsts", "loop_tma", "loop_int_ops",
    "ttgir_buffers", "ttgir_loop_async_copies", "ttgir_loop_sync_loads", "grid", "index_tensors",
    "constexprs", "heuristics", "default", "compile_s", "job",
]  # fmt: skip


def _kernel_label(job: dict) -> str:
    """A row's kernel: the JIT function's name, with " (sparse)" for the MLA and GQA decode
    kernels' token-index walk and " (mean_norm_rope)" for the indexer's QSA pooling (constexpr
    branches of the same functions), so that the summary reports their registers and spills
    apart from the other branch's."""
    name = job["kernel"].split(":")[1]
    if job["constexprs"].get("POOL") == 1:  # the indexer's QSA pool transform
        return f"{name} (mean_norm_rope)"
    return f"{name} (sparse)" if job["constexprs"].get("SPARSE") else name


def run_matrix(
    cases: list[Case],
    archs: tuple[int, ...] = ARCHS,
    jobs: int = 2,
    asm_dir: str | None = None,
    progress: Callable[[str], None] | None = None,
    defaults_only: bool = False,
    sweep_first_launch_only: bool = False,
) -> list[dict]:
    """Capture, compile and measure every case for every arch; one row per launch config
    (``defaults_only``: only the config each launch's table picks, not every candidate the
    autotuner would try; ``sweep_first_launch_only``: every candidate for a wrapper call's
    first launch, the table's config for its later ones, which the quick matrix uses: the
    paged prefill's second launch, one request alone, differs from the first only by an
    argument of value 1 that Triton specialises, and sweeping it too was a third of the CI
    check's compile time)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    _require_compiled_mode()
    say = progress or (lambda _: None)
    rows: list[dict] = []
    unique: dict[str, dict] = {}
    for arch in archs:
        for case in cases:
            if not case.runs_on(arch):
                continue
            try:
                launches, how = capture(case, arch, autotune=not defaults_only)
                defaults = {
                    _job_key(job)
                    for launch in capture(case, arch, autotune=False)[0]
                    for job in launch.configs
                }
            except Exception as exc:  # the wrapper refused the case: a failure to report
                rows.append(
                    {
                        "kernel": case.family,
                        "arch": arch,
                        "case": case.name,
                        "launch": "",
                        "config": "",
                        "status": "capture_error",
                        "error": f"{type(exc).__name__}: {exc}"[:500],
                    }
                )
                continue
            for launch in launches:
                jobs_of_launch = launch.configs
                if sweep_first_launch_only and launch.index > 0:
                    table = [job for job in jobs_of_launch if _job_key(job) in defaults]
                    jobs_of_launch = table or jobs_of_launch  # no table config: sweep it
                for job in jobs_of_launch:
                    key = _job_key(job)
                    unique.setdefault(key, {**job, "key": key, "asm_dir": asm_dir})
                    rows.append(
                        {
                            "kernel": _kernel_label(job),
                            "arch": arch,
                            "case": case.name,
                            "launch": launch.index,
                            "config": job["config"],
                            "grid": "x".join(map(str, launch.grid or ())),
                            "index_tensors": how,
                            "constexprs": " ".join(
                                f"{k}={v}" for k, v in job["constexprs"].items()
                            ),
                            "heuristics": " ".join(launch.heuristics),
                            "default": key in defaults,
                            "job": key,
                        }
                    )
    say(f"{len(rows)} launch configs, {len(unique)} distinct compiles, {jobs} workers")
    results: dict[str, dict] = {}
    t0 = time.time()
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init) as pool:
        # the big kernels first, so the pool does not end on one long compile
        order = sorted(
            unique,
            key=lambda k: (
                not unique[k]["kernel"].endswith(
                    ("_prefill_kernel", "_mla_partial_kernel", "_decode_partial_kernel")
                )
            ),
        )
        futures = {key: pool.submit(compile_job, unique[key]) for key in order}
        for i, (key, fut) in enumerate(futures.items(), 1):
            results[key] = fut.result()
            if i % 20 == 0 or i == len(futures):
                say(f"  compiled {i}/{len(futures)} ({time.time() - t0:.0f} s)")
    for row in rows:
        if row.get("job"):
            row.update(results[row["job"]])
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per kernel x arch: configs compiled, max registers, spill bytes, max shared, misfits."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["arch"]), []).append(r)
    out = []
    for (kernel, arch), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        distinct = {r.get("job") or r["case"]: r for r in rs}.values()
        ok = [r for r in distinct if r.get("status") == "ok"]
        launches: dict[tuple, list[dict]] = {}
        for r in rs:
            launches.setdefault((r["case"], r["launch"]), []).append(r)
        no_fit = sum(
            not any(r.get("status") == "ok" and r.get("fits") for r in group)
            for group in launches.values()
        )
        loop_ratio = [
            r["loop_int_ops"] / r["loop_mma"]
            for r in ok
            if r.get("loop_mma") and r["loop_int_ops"]
        ]
        out.append(
            {
                "kernel": kernel,
                "arch": f"sm_{arch}",
                "launches": len(launches),
                "configs_compiled": len(ok),
                "errors": sum(r.get("status") != "ok" for r in distinct),
                "max_registers": max((r["registers"] or 0 for r in ok), default=0),
                "spill_bytes": sum((r["spill_stores"] or 0) + (r["spill_loads"] or 0) for r in ok),
                "configs_spilling": sum(
                    bool((r["spill_stores"] or 0) + (r["spill_loads"] or 0)) for r in ok
                ),
                "max_shared": max((r["shared"] for r in ok), default=0),
                "configs_not_fitting": sum(not r["fits"] for r in ok),
                "launches_no_fit": no_fit,
                "loop_int_per_mma": round(max(loop_ratio), 1) if loop_ratio else None,
                # the configs the default tables pick (what runs without autotuning)
                "default_max_registers": max(
                    (r["registers"] or 0 for r in ok if r.get("default")), default=0
                ),
                "default_spill_bytes": sum(
                    (r["spill_stores"] or 0) + (r["spill_loads"] or 0)
                    for r in ok
                    if r.get("default")
                ),
                "default_max_shared": max(
                    (r["shared"] for r in ok if r.get("default")), default=0
                ),
                # loads the software pipeliner left synchronous in the hot loop (tensor shapes)
                "loop_sync_loads": _shapes(r.get("ttgir_loop_sync_loads") for r in ok),
            }
        )
    return out


def _shapes(values) -> str:
    """Distinct load shapes over configs with the token dim as N ("64xi32" -> "Nxi32",
    "32x512xi8" -> "Nx512xi8"), so the cell stays short."""
    seen = set()
    for v in values:
        for shape in (v or "").split():
            dims = shape.split("x")
            seen.add("x".join(["N", *dims[1:]]) if len(dims) > 1 else shape)
    return " ".join(sorted(seen))


def failures(rows: list[dict]) -> list[dict]:
    """What the test fails on: compile/capture errors, spills, launches no config fits."""
    out = []
    launches: dict[tuple, list[dict]] = {}
    for r in rows:
        where = {
            "kernel": r["kernel"],
            "arch": f"sm_{r['arch']}",
            "case": r["case"],
            "config": r.get("config", ""),
        }
        if r.get("status") != "ok":
            out.append({**where, "reason": f"{r.get('status')}: {r.get('error', '')}"})
            continue
        spill = (r["spill_stores"] or 0) + (r["spill_loads"] or 0)
        if spill:
            out.append(
                {
                    **where,
                    "reason": f"spills {r['spill_stores']} B stored / {r['spill_loads']} B "
                    f"loaded ({r['registers']} registers)",
                }
            )
        launches.setdefault((r["kernel"], r["arch"], r["case"], r["launch"]), []).append(r)
    for (kernel, arch, case, _), group in launches.items():
        if not any(r["fits"] for r in group):
            out.append(
                {
                    "kernel": kernel,
                    "arch": f"sm_{arch}",
                    "case": case,
                    "config": "(every config)",
                    "reason": f"no config fits {SHARED_LIMIT[arch]} B of shared memory (smallest "
                    f"{min(r['shared'] for r in group)} B)",
                }
            )
    return out


def provenance(quick: bool, elapsed: float, archs: tuple[int, ...]) -> dict:
    import torch
    import triton

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "?"

    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "matrix": "quick" if quick else "full",
        "archs": [f"sm_{a}" for a in archs],
        "shared_limits": {f"sm_{a}": SHARED_LIMIT[a] for a in archs},
        "triton": triton.__version__,
        "torch": torch.__version__,
        **_tool_versions(),
        "python": platform.python_version(),
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--", "kernels")),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": os.cpu_count(),
        "elapsed_s": round(elapsed, 1),
    }


def markdown(summary: list[dict], prov: dict, fails: list[dict]) -> str:
    cols = [
        ("kernel", "kernel"), ("arch", "arch"), ("launches", "launches"),
        ("configs_compiled", "configs compiled"), ("errors", "compile errors"),
        ("max_registers", "max registers"), ("spill_bytes", "spill bytes"),
        ("configs_spilling", "configs spilling"), ("max_shared", "max shared (B)"),
        ("configs_not_fitting", "configs not fitting"),
        ("launches_no_fit", "launches no config fits"),
        ("loop_int_per_mma", "loop IMAD+LEA+IADD3 per MMA (max)"),
        ("loop_sync_loads", "loop loads not pipelined (TTGIR)"),
        ("default_max_registers", "default config: max registers"),
        ("default_spill_bytes", "default config: spill bytes"),
        ("default_max_shared", "default config: max shared (B)"),
    ]  # fmt: skip
    from paper.data import markdown_table

    table = markdown_table(
        [{k: "-" if r.get(k) is None else r[k] for k, _ in cols} for r in summary], cols
    )
    text = [
        "Compiled resources of every kernel launch (Triton "
        f"{prov['triton']}, ptxas {prov.get('ptxas_sm80', '?')} for sm_80 / "
        f"{prov.get('ptxas_sm90', '?')} for sm_90, {prov['matrix']} matrix, commit "
        f"`{prov['commit'][:10]}`{' (kernels modified)' if prov['dirty'] else ''}, "
        f"{prov['date'][:10]}). Shared memory limits: sm_80 {SHARED_LIMIT[80]} B, "
        f"sm_90 {SHARED_LIMIT[90]} B. Made by `python -m paper.compile_kernels`.",
        "",
        table,
        "",
        f"{len(fails)} failing rows (compile errors, spills, launches no config fits).",
    ]
    return "\n".join(text) + "\n"


def write_outputs(
    rows: list[dict],
    prov: dict,
    csv_path: Path | None,
    json_path: Path | None,
    md_path: Path | None,
) -> dict:
    summary = summarize(rows)
    fails = failures(rows)
    report = {"provenance": prov, "summary": summary, "failures": fails, "rows": rows}
    if csv_path:
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        buf = io.StringIO()
        w = csv.DictWriter(buf, CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_COLUMNS})
        csv_path.write_text(buf.getvalue())
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        # with a CSV beside it the rows live there only (they are most of the bytes)
        slim = {k: v for k, v in report.items() if k != "rows"} if csv_path else report
        json_path.write_text(json.dumps(slim, indent=1, default=str) + "\n")
    if md_path:
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(markdown(summary, prov, fails))
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m paper.compile_kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the CI subset: fewer cases, a call's later launches at the table's config only",
    )
    ap.add_argument(
        "--out",
        type=Path,
        help="write the csv, json and md into this folder "
        "instead of paper/results and paper/figures",
    )
    ap.add_argument("--json", type=Path, help="write only the JSON report, to this file")
    ap.add_argument("--jobs", type=int, default=2, help="compile processes (default 2)")
    ap.add_argument(
        "--arch", type=int, nargs="+", default=list(ARCHS), choices=sorted(SHARED_LIMIT)
    )
    ap.add_argument("--only", nargs="+", choices=sorted(_BUILDERS), help="kernel families")
    ap.add_argument("--asm-dir", help="also keep each compile's TTGIR, PTX and cubin here")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--strict", action="store_true", help="exit 1 when anything fails")
    ap.add_argument(
        "--defaults-only",
        action="store_true",
        help="compile only the table's config of each launch (a fraction of the full matrix)",
    )
    args = ap.parse_args(argv)

    if "triton" not in sys.modules:
        os.environ.pop("TRITON_INTERPRET", None)
    _require_compiled_mode()
    cases = quick_matrix() if args.quick else full_matrix()
    if args.only:
        cases = [c for c in cases if c.family in args.only]
    if args.list:
        print("\n".join(c.name for c in cases))
        return 0
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    t0 = time.time()
    rows = run_matrix(
        cases,
        tuple(args.arch),
        args.jobs,
        args.asm_dir,
        print,
        args.defaults_only,
        sweep_first_launch_only=args.quick,
    )
    prov = provenance(args.quick, time.time() - t0, tuple(args.arch))
    if args.quick:
        prov["matrix"] += " (a call's later launches at the table's config)"
    if args.defaults_only:
        prov["matrix"] += ", table defaults only"
    if args.json and not args.out:
        paths = (None, args.json, None)
    elif args.out:
        paths = (
            args.out / "compile-kernels.csv",
            args.json or args.out / "compile-kernels.json",
            args.out / "kernels_compiled.md",
        )
    else:
        paths = (
            RESULTS / "compile-kernels.csv",
            RESULTS / "compile-kernels.json",
            None,  # python -m paper.figures renders it from the JSON
        )
    report = write_outputs(rows, prov, *paths)
    print(markdown(report["summary"], prov, report["failures"]))
    for f in report["failures"]:
        print(f"FAIL {f['kernel']} {f['arch']} [{f['config']}] {f['case']}: {f['reason']}")
    print("wrote", ", ".join(str(p) for p in paths if p))
    return 1 if args.strict and report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
