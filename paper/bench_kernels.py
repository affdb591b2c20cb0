"""Benchmark the kernels on a GPU: ``python -m paper.bench_kernels [--set suite|full]``.

Every case runs on real pages: a memory plan of a zoo model is made and allocated, and the kernel
reads one layer's views of it (or a flat ``[blocks, block_size, Hkv, D]`` cache for the GQA
sweep), with block tables of shuffled ids. Beside hybridkv's kernels, on the same caches:

- vLLM 0.33's Triton unified attention (``paper.peers.vllm_triton``; its files are fetched
  into a git-ignored folder, never committed), called as vLLM's TritonAttention backend calls
  it; rows are skipped, with the reason in the JSON's ``skipped``, where it is not fetched;
- PyTorch's SDPA on contiguous K/V (FlashAttention / cuDNN: what an unpaged kernel gets);
- with ``--flex``, FlexAttention over PyTorch's own paged cache, where the installed torch has
  it (it compiles once per shape, tens of seconds each; failures are listed in ``flex_errors``).

Timing: ``triton.testing.do_bench`` medians (it flushes the L2 cache before every repetition).
hybridkv's kernels are planned once outside the timed call (``plan_*``), as an engine plans once
per step, so the timed call is what each layer launches; the peers likewise time only what
their forward launches. Decode and the copy kernels report the share of the device's copy
bandwidth (a large ``copy_``, read + write counted, measured first) their bytes take:
``pct_copy = bytes the kernel must read and write / time / copy bandwidth``; prefill reports
TFLOP/s (``4 * Hq * D`` per visible query-key pair).

``--set suite`` is the fixed set ``python -m paper.gpu_suite`` runs (a few minutes); ``full``
sweeps the zoo's models, layouts, batches and contexts. Results go to
``paper/results/kernels-<device>.{json,csv}`` with the device, date, library versions and git
commit. Without a GPU, ``--set quick`` runs tiny shapes under the Triton interpreter (a smoke
test: its timings mean nothing, and it writes only where ``--out`` says).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as dt
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton

from hybridkv import models
from hybridkv.layouts import make_plan
from hybridkv_kernels import (
    cache_write,
    indexer_scores,
    mla_decode,
    paged_decode,
    paged_prefill,
    state_copy,
)

RESULTS = Path(__file__).parent / "results"


# ---- the cases ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Decode:
    """One decode step of one attention layer: ``batch`` requests of ``context`` tokens."""

    model: str
    layout: str  # a plan layout, or "flat" (a [blocks, block_size, Hkv, D] cache)
    batch: int
    context: int
    kv_dtype: str = "bfloat16"
    block_size: int = 16  # flat caches only
    heads: tuple[int, int, int] | None = None  # flat caches: (Hq, Hkv, D); None: the model's
    #: a token list of this many entries a request (0: dense): Qwen4-Exp's QSA pick, the top
    #: ``(sparse - QSA_RATIO + 1) / QSA_RATIO`` groups of ``QSA_RATIO`` tokens of the context
    #: and the open group's ``QSA_RATIO - 1`` newest tokens (``plan_decode(token_indices=)``)
    sparse: int = 0


@dataclasses.dataclass(frozen=True)
class Prefill:
    """One chunked-prefill step: request ``r`` brings ``q_lens[r]`` new tokens after
    ``cached[r]`` cached ones, all causal."""

    model: str
    layout: str
    q_lens: tuple[int, ...]
    cached: tuple[int, ...]
    kv_dtype: str = "bfloat16"
    block_size: int = 16
    heads: tuple[int, int, int] | None = None


@dataclasses.dataclass(frozen=True)
class Mla:
    model: str
    layout: str
    batch: int
    context: int
    kv_dtype: str = "bfloat16"


@dataclasses.dataclass(frozen=True)
class States:
    op: str  # gather | scatter | copy
    batch: int
    row_bytes: int


@dataclasses.dataclass(frozen=True)
class Write:
    model: str
    tokens: int
    kv_dtype: str = "bfloat16"


@dataclasses.dataclass(frozen=True)
class Indexer:
    """One forward's DSA indexer pool scores (``kernels/indexer_scores.py``) at GLM-5-Next's
    sizes (32 index heads, ``index_head_dim`` 128, ``index_kpool`` 16, 64-token pages, bf16
    rows): ``batch`` requests of ``context`` tokens, ``q_tokens`` query tokens each (1: decode),
    the last ``q_tokens`` positions of the context."""

    batch: int
    context: int
    q_tokens: int = 1
    q_dtype: str = "float32"  # the engine's (an IEEE dot); bfloat16 runs on the tensor cores


QWEN, NEMOTRON, KIMI = "qwen3-next-80b-a3b", "nemotron-h-8b", "kimi-linear-48b-a3b"
#: Qwen4-Exp's QSA at transformers' sizes: groups of 16 tokens, a budget of 2,048 tokens, so a
#: list of 2,048 + 15 entries (the open group's tail)
QSA_RATIO, QSA_LIST = 16, 2048 + 15
#: GLM-5-Next's indexer: heads, index_head_dim, index_kpool, page tokens
INDEXER_SIZES = (32, 128, 16, 64)


def suite_cases() -> list:
    """The fixed set of the GPU suite: every page size the plans of Qwen3-Next (16, 64, 192, 576)
    and Nemotron-H (16, 272, 528, 1040) produce, head dims 256 and 128, GQA 1-16, batch 1 at
    long context, fp8 against bf16, MLA, the copy kernels, and the prefill goals of issue 28."""
    cases: list = []
    for model, layouts in (
        (QWEN, ("per_group", "aggregate", "pack", "inflate")),
        (NEMOTRON, ("per_group", "aggregate", "pack", "inflate")),
    ):
        for layout in layouts:
            for batch, ctx in ((8, 32768), (64, 8192)):
                cases.append(Decode(model, layout, batch, ctx))
    cases += [
        Decode(QWEN, "per_group", 1, 32768),
        Decode(QWEN, "per_group", 1, 131072),
        Decode(QWEN, "per_group", 256, 4096),
        Decode(NEMOTRON, "per_group", 1, 32768),
        Decode(QWEN, "flat", 64, 8192, heads=(8, 8, 128)),  # GQA 1
        Decode(QWEN, "flat", 64, 8192, heads=(32, 2, 128)),  # GQA 16
        Decode(QWEN, "per_group", 64, 8192, kv_dtype="float8_e4m3fn"),
        Decode(NEMOTRON, "per_group", 64, 8192, kv_dtype="float8_e4m3fn"),
        # Qwen4-Exp's sparse walk (its GQA has Qwen3-Next's heads: 16 / 2 / 256) on 16-token
        # pages: no config is measured for it yet (swept as an unmeasured kernel)
        Decode(QWEN, "per_group", 8, 32768, sparse=QSA_LIST),
        Decode(QWEN, "per_group", 64, 8192, sparse=QSA_LIST),
    ]
    for model, large in ((QWEN, "inflate"), (NEMOTRON, "aggregate")):
        for layout in ("per_group", large):
            cases += [
                Prefill(model, layout, (8192,), (0,)),
                Prefill(model, layout, (4608, 2048, 1024, 512), (0, 0, 0, 0)),
                Prefill(model, layout, (2048,), (30720,)),
            ]
    cases += [
        Prefill(QWEN, "per_group", (8192,), (0,), kv_dtype="float8_e4m3fn"),
        Prefill(QWEN, "flat", (8192,), (0,), heads=(8, 8, 128)),  # GQA 1
        Prefill(QWEN, "flat", (8192,), (0,), block_size=64, heads=(32, 2, 128)),  # GQA 16
    ]
    for layout in ("per_group", "aggregate"):
        for batch, ctx in ((8, 8192), (8, 32768), (64, 32768)):
            cases.append(Mla(KIMI, layout, batch, ctx))
    for op in ("gather", "scatter", "copy"):
        for batch in (8, 64, 256):
            cases.append(States(op, batch, 1 << 20))
    cases += [Write(QWEN, n) for n in (256, 4096, 32768)]
    cases += [
        Indexer(8, 32768),
        Indexer(64, 8192),
        Indexer(8, 32768, q_dtype="bfloat16"),
        Indexer(1, 32768, q_tokens=2048),
    ]
    return cases


def full_cases() -> list:
    """The zoo sweep: every layout, batches 1-256, contexts 1k-128k."""
    cases: list = []
    for model in (QWEN, NEMOTRON):
        for layout in ("per_group", "two_level", "aggregate", "pack", "inflate"):
            for batch in (1, 8, 32, 128, 256):
                for ctx in (1024, 8192, 32768, 131072):
                    cases.append(Decode(model, layout, batch, ctx))
    for layout in ("per_group", "two_level", "aggregate", "pack", "inflate"):
        for batch, ctx in ((1, 32768), (8, 8192), (8, 32768), (64, 32768)):
            cases.append(Mla(KIMI, layout, batch, ctx))
    return cases + [c for c in suite_cases() if not isinstance(c, Decode | Mla)]


def quick_cases() -> list:
    """Tiny shapes for the CPU smoke test (interpreter)."""
    tiny = "qwen3.5-0.8b"
    return [
        Decode(tiny, "per_group", 2, 70, kv_dtype="float16"),
        Decode(tiny, "inflate", 1, 130, kv_dtype="float16"),
        Decode(tiny, "flat", 2, 64, kv_dtype="float16", heads=(4, 2, 32)),
        Decode(tiny, "per_group", 2, 70, kv_dtype="float16", sparse=2 * QSA_RATIO + 15),
        Prefill(tiny, "per_group", (20, 7), (0, 40), kv_dtype="float16"),
        Mla(KIMI, "per_group", 1, 70, kv_dtype="float16"),
        States("gather", 2, 4096),
        States("scatter", 2, 4096),
        States("copy", 2, 4096),
        Write(tiny, 16, kv_dtype="float16"),
        Indexer(2, 100),
        Indexer(1, 70, q_tokens=5, q_dtype="float16"),
    ]


SETS = {"suite": suite_cases, "full": full_cases, "quick": quick_cases}


# ---- timing ------------------------------------------------------------------------------------


def time_ms(fn: Callable[[], object], device: torch.device, reps: int | None = None) -> float:
    """Median milliseconds of ``fn``: ``triton.testing.do_bench`` on a GPU (L2 flushed before
    each repetition); a host timer under the interpreter (meaningless, for the smoke test)."""
    if device.type == "cuda":
        rep = 100 if reps is None else reps
        return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))
    fn()
    times = []
    for _ in range(reps or 1):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device ``copy_`` (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (time_ms(lambda: dst.copy_(src), device, reps=200) / 1e3)


# ---- building caches ---------------------------------------------------------------------------


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _heads(model_name: str, heads: tuple[int, int, int] | None) -> tuple[int, int, int]:
    if heads is not None:
        return heads
    spec = models.load(model_name).attention_layers[0].spec
    return spec.heads_per_rank, spec.kv_heads_per_rank, spec.head_dim


def _plan_for(model_name: str, kv_dtype: str, layout: str, tokens: int, seqs: int, device):
    """The smallest plan of ``layout`` holding ``seqs`` requests of ``tokens / seqs`` tokens in
    whole blocks, allocated on ``device``."""
    model = models.load(model_name, kv_dtype=kv_dtype)
    plan = make_plan(model, layout, fit_tokens=tokens, max_num_seqs=seqs)
    per_req = math.ceil(tokens / seqs / plan.block_size) * plan.block_size
    if per_req * seqs > tokens:
        plan = make_plan(
            model, layout, fit_tokens=per_req * seqs + plan.block_size, max_num_seqs=seqs
        )
    return model, plan, plan.allocate(device, fill=0)


def _fill_random(*caches: torch.Tensor) -> None:
    """Random values (never zeros: they hide unwritten outputs and can run faster)."""
    for c in caches:
        if c.dtype.itemsize == 1:
            c.view(torch.uint8).copy_(torch.randint(0, 0x78, c.shape, dtype=torch.uint8))
        else:
            c.normal_()


def _kv_caches(case, tokens: int, seqs: int, device):
    """(k_cache, v_cache) for a decode / prefill case."""
    dtype = _dtype(case.kv_dtype)
    if case.layout == "flat":
        _, hkv, d = _heads(case.model, case.heads)
        num_blocks = math.ceil(tokens / case.block_size) + seqs + 1
        pages = torch.empty((num_blocks, 2, case.block_size, hkv, d), dtype=dtype, device=device)
        k, v = pages[:, 0], pages[:, 1]
    else:
        model, plan, buffers = _plan_for(
            case.model, case.kv_dtype, case.layout, tokens, seqs, device
        )
        k, v = plan.kv_views(buffers, model.attention_layers[0].name)
    _fill_random(k, v)
    return k, v


def random_tables(
    num_blocks: int, block_size: int, lens: list[int], device
) -> torch.Tensor | None:
    """Block tables of distinct shuffled ids (never the null block 0); None if too few."""
    per_req = [math.ceil(n / block_size) for n in lens]
    if sum(per_req) > num_blocks - 1:
        return None
    ids = torch.randperm(num_blocks - 1, device=device)[: sum(per_req)] + 1
    tables = torch.zeros((len(lens), max(per_req)), dtype=torch.int32, device=device)
    start = 0
    for r, n in enumerate(per_req):
        tables[r, :n] = ids[start : start + n]
        start += n
    return tables


def _scales(dtype: torch.dtype, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if dtype.itemsize != 1:
        return None, None
    return (torch.full((1,), 0.05, device=device), torch.full((1,), 0.05, device=device))


# ---- the runs ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Prepared:
    """A case's inputs on the device and how to plan, launch and sweep hybridkv's kernel:
    ``plan(**overrides)`` makes a plan (``config=``, ``num_splits=`` ...), ``launch(plan)`` the
    timed call, ``candidates(plan)`` the overrides a sweep tries around the default plan,
    ``info(plan)`` what the plan chose; ``measure`` is ``{"bytes": ...}`` or ``{"flops": ...}``.
    ``peer`` (if any) makes vLLM's call on the same inputs and ``result`` returns our output."""

    measure: dict
    block_size: int | None
    plan: Callable[..., Any]
    launch: Callable[[Any], Callable[[], object]]
    candidates: Callable[[Any], list[dict]]
    info: Callable[[Any], dict]
    peer: Callable[[], Callable[[], torch.Tensor]] | None = None
    result: Callable[[], torch.Tensor] | None = None


@dataclasses.dataclass
class Ctx:
    device: torch.device
    copy_bw: float  # bytes/s
    reps: int | None
    rows: list[dict]
    skipped: list[str]
    flex_errors: list[str]
    peers: bool = True
    # FlexAttention compiles once per shape (tens of seconds each): opt-in
    flex: bool = False

    def row(self, case, impl: str, ms: float, **extra) -> dict:
        r = {"case": type(case).__name__.lower(), **dataclasses.asdict(case), "impl": impl}
        r.update(ms=ms, **extra)
        if "bytes" in extra:
            r["gbps"] = extra["bytes"] / (ms / 1e3) / 1e9
            r["pct_copy"] = 100 * extra["bytes"] / (ms / 1e3) / self.copy_bw
        if "flops" in extra:
            r["tflops"] = extra["flops"] / (ms / 1e3) / 1e12
        self.rows.append(r)
        return r


def _vllm(hq: int, hkv: int, d: int, scale: float, device):
    from paper.peers import vllm_triton

    if not vllm_triton.available():
        raise LookupError(f"vLLM's Triton attention is not fetched ({vllm_triton.FETCH_COMMAND})")
    return vllm_triton.VllmTritonAttention(hq, hkv, d, scale, device=device)


def _q_dtype(device: torch.device) -> torch.dtype:
    # bf16 on a GPU (the models' dtype); fp16 under the interpreter, whose bf16 dots are wrong
    return torch.bfloat16 if device.type == "cuda" else torch.float16


def _splits_around(default: int) -> list[int]:
    return sorted({1, max(1, default // 2), default, 2 * default, 4 * default} - {default})


def prepare_decode(case: Decode, device) -> Prepared | None:
    hq, hkv, d = _heads(case.model, case.heads)
    lens = [case.context] * case.batch
    k, v = _kv_caches(case, case.batch * case.context, case.batch, device)
    tables = random_tables(k.shape[0], k.shape[1], lens, device)
    if tables is None:
        return None
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    q_dtype = _q_dtype(device)
    q = torch.randn(case.batch, hq, d, device=device).to(q_dtype)
    k_scale, v_scale = _scales(k.dtype, device)
    out = torch.empty(case.batch, hq, d, dtype=q_dtype, device=device)
    indices = qsa_token_lists(case.batch, case.context, case.sparse, device)
    sparse = {} if indices is None else {"token_indices": indices}

    def plan(**overrides):
        return paged_decode.plan_decode(
            tables, seq, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=k.shape[1],
            cache_dtype=k.dtype, q_dtype=q_dtype, scale=d**-0.5, max_seq_len=case.context,
            **sparse, **overrides,
        )  # fmt: skip

    def candidates(default) -> list[dict]:
        # every config, those the fit rule drops too (a measured spill may still be fastest)
        splits = [default.num_splits, *_splits_around(default.num_splits)]
        configs = [default.config, *(c for c in paged_decode.CONFIGS if c != default.config)]
        return [{"config": c, "num_splits": n} for c in configs for n in splits][1:]

    def peer():
        return _vllm(hq, hkv, d, d**-0.5, device).prepare(q, k, v, tables, seq)

    read = case.sparse or case.context  # tokens whose K and V a request reads
    return Prepared(
        measure={"bytes": case.batch * read * hkv * 2 * d * k.element_size()},
        block_size=k.shape[1],
        plan=plan,
        launch=lambda p: lambda: p.run(q, k, v, k_scale, v_scale, out=out, **sparse),
        candidates=candidates,
        info=lambda p: {
            "config": str(p.config),
            "config_source": p.config_source,
            "num_splits": p.num_splits,
        },
        # vLLM's Triton attention has no token-list walk
        peer=peer if k.dtype == q_dtype and indices is None else None,
        result=lambda: out,
    )


def qsa_token_lists(batch: int, context: int, width: int, device) -> torch.Tensor | None:
    """``[batch, width]`` int32 token lists as Qwen4-Exp's QSA picks them for a query at the
    context's last position: ``(width - QSA_RATIO + 1) / QSA_RATIO`` random complete groups of
    ``QSA_RATIO`` tokens (in score order, so unsorted), then the open group's tokens, -1
    padded; None for ``width`` 0 (dense)."""
    if not width:
        return None
    groups = (width - QSA_RATIO + 1) // QSA_RATIO
    complete, tail = divmod(context, QSA_RATIO)
    if groups * QSA_RATIO + QSA_RATIO - 1 != width or groups > complete:
        raise ValueError(
            f"a QSA list of {width} entries is {QSA_RATIO}-token groups plus a tail of "
            f"{QSA_RATIO - 1} in a context of {context} tokens ({complete} complete groups)"
        )
    out = torch.full((batch, width), -1, dtype=torch.int64)
    offsets = torch.arange(QSA_RATIO)
    for b in range(batch):
        picked = torch.randperm(complete)[:groups]
        out[b, : groups * QSA_RATIO] = (picked[:, None] * QSA_RATIO + offsets).flatten()
        out[b, groups * QSA_RATIO : groups * QSA_RATIO + tail] = (
            complete * QSA_RATIO + offsets[:tail]
        )
    return out.to(torch.int32).to(device)


def _causal_pairs(q_lens, cached) -> int:
    """Query-key pairs a causal prefill computes: each new token sees the cached ones and the
    new ones up to itself."""
    return sum(n * c + n * (n + 1) // 2 for n, c in zip(q_lens, cached))


def prepare_prefill(case: Prefill, device) -> Prepared | None:
    hq, hkv, d = _heads(case.model, case.heads)
    lens = [n + c for n, c in zip(case.q_lens, case.cached)]
    k, v = _kv_caches(case, sum(lens), len(lens), device)
    tables = random_tables(k.shape[0], k.shape[1], lens, device)
    if tables is None:
        return None
    q_dtype = _q_dtype(device)
    total = sum(case.q_lens)
    q = torch.randn(total, hq, d, device=device).to(q_dtype)
    cu = torch.tensor([0, *torch.tensor(case.q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu, seq = cu.to(device), torch.tensor(lens, dtype=torch.int32, device=device)
    k_scale, v_scale = _scales(k.dtype, device)
    out = torch.empty(total, hq, d, dtype=q_dtype, device=device)

    def plan(**overrides):
        return paged_prefill.plan_prefill(
            tables, cu, seq, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=k.shape[1],
            cache_dtype=k.dtype, q_dtype=q_dtype, scale=d**-0.5, total_q=total,
            max_query_len=max(case.q_lens), max_seq_len=max(lens), **overrides,
        )  # fmt: skip

    def candidates(default) -> list[dict]:
        # the Hopper path first where it can run (sm_90+; unmeasured until a sweep times it),
        # so that a sweep cut short by its budget has timed it
        hopper = [c for c in paged_prefill.CONFIGS if c.hopper]
        fits = [c for c in hopper if paged_prefill.config_fits(c, default.shape)]
        rest = [c for c in paged_prefill.CONFIGS if c not in fits]
        return [{"config": c} for c in (*fits, *rest) if c != default.config]

    def peer():
        return _vllm(hq, hkv, d, d**-0.5, device).prepare(q, k, v, tables, seq, cu)

    return Prepared(
        measure={"flops": 4 * hq * d * _causal_pairs(case.q_lens, case.cached)},
        block_size=k.shape[1],
        plan=plan,
        launch=lambda p: lambda: p.run(q, k, v, k_scale, v_scale, out=out),
        candidates=candidates,
        info=lambda p: {"config": str(p.config), "config_source": p.config_source},
        peer=peer if k.dtype == q_dtype else None,
        result=lambda: out,
    )


def prepare_mla(case: Mla, device) -> Prepared | None:
    model, plan_, buffers = _plan_for(
        case.model, case.kv_dtype, case.layout, case.batch * case.context, case.batch, device
    )
    spec = model.attention_layers[0].spec
    cache, _ = plan_.kv_views(buffers, model.attention_layers[0].name)
    _fill_random(cache)
    lens = [case.context] * case.batch
    tables = random_tables(cache.shape[0], plan_.block_size, lens, device)
    if tables is None:
        return None
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    heads = spec.num_heads // spec.tp_size
    q_dtype = _q_dtype(device)
    q_nope = torch.randn(case.batch, heads, spec.kv_lora_rank, device=device).to(q_dtype)
    q_pe = torch.randn(case.batch, heads, spec.qk_rope_head_dim, device=device).to(q_dtype)
    scale = (spec.kv_lora_rank + spec.qk_rope_head_dim) ** -0.5
    out = torch.empty_like(q_nope)
    k_scale = _scales(cache.dtype, device)[0]

    def plan(**overrides):
        return mla_decode.plan_mla_decode(
            tables, seq, num_heads=heads, kv_lora_rank=spec.kv_lora_rank,
            qk_rope_head_dim=spec.qk_rope_head_dim, block_size=plan_.block_size,
            cache_dtype=cache.dtype, q_dtype=q_dtype, scale=scale, max_seq_len=case.context,
            **overrides,
        )  # fmt: skip

    def candidates(default) -> list[dict]:
        # every config: the measured-fastest 64/4/2 spills, and the fit rule drops it
        splits = [default.num_splits, *_splits_around(default.num_splits)]
        configs = [default.config, *(c for c in mla_decode.CONFIGS if c != default.config)]
        out = [{"config": c, "num_splits": n} for c in configs for n in splits][1:]
        return _padded_heads(default, plan) + out  # the untried hypothesis first (deadline)

    return Prepared(
        measure={"bytes": case.batch * case.context * spec.latent_dim * cache.element_size()},
        block_size=plan_.block_size,
        plan=plan,
        launch=lambda p: lambda: p.run(q_nope, q_pe, cache, k_scale, out=out),
        candidates=candidates,
        info=lambda p: {
            "config": str(p.config),
            "config_source": p.config_source,
            "num_splits": p.num_splits,
            "heads_per_program": p.shape.block_h,
        },
    )


def _padded_heads(default, plan) -> list[dict]:
    """Where a program's rows could be padded to the 64 of a Hopper warpgroup (wgmma; sm_90,
    16-bit caches, fewer than 64 heads), that padding with every config that fits it, at the
    padded plan's split count and those around it; none elsewhere."""
    if default.shape.block_h >= 64:
        return []
    try:
        padded = plan(heads_per_program=64)
    except ValueError:  # not an arch / cache where 64 rows compile without spills
        return []
    splits = [padded.num_splits, *_splits_around(padded.num_splits)]
    configs = [c for c in mla_decode.CONFIGS if mla_decode.config_fits(c, padded.shape)]
    return [
        {"heads_per_program": 64, "config": c, "num_splits": n} for c in configs for n in splits
    ]


def prepare_states(case: States, device) -> Prepared:
    """A pool of 2-byte elements whose slots are ``row_bytes`` apart, shuffled slot ids."""
    row = case.row_bytes // 2
    slots = 2 * case.batch + 1
    pool = torch.randn(slots, row, device=device).to(torch.bfloat16)
    ids = (torch.randperm(slots - 1, device=device)[: 2 * case.batch] + 1).to(torch.int32)
    src, dst = ids[: case.batch], ids[case.batch :]
    rows = torch.randn(case.batch, row, device=device).to(torch.bfloat16)
    kw = dict(row_shape=(row,), num_slots=slots, dtype=pool.dtype)
    maker = getattr(state_copy, f"plan_{case.op}_states")
    slot_args = (src, dst) if case.op == "copy" else ((dst,) if case.op == "scatter" else (src,))

    def launch(p):
        return (lambda: p.run(pool)) if case.op == "copy" else (lambda: p.run(pool, rows))

    def candidates(default) -> list[dict]:
        return [{"config": c} for c in state_copy.CONFIGS if c != default.config]

    return Prepared(
        measure={"bytes": 2 * case.batch * case.row_bytes},
        block_size=None,
        plan=lambda **o: maker(*slot_args, **kw, **o),
        launch=launch,
        candidates=candidates,
        info=lambda p: {"config": str(p.config), "config_source": p.config_source},
    )


def prepare_write(case: Write, device) -> Prepared:
    model, plan_, buffers = _plan_for(
        case.model, case.kv_dtype, "pack", 2 * case.tokens, 1, device
    )
    spec = model.attention_layers[0].spec
    k_cache, v_cache = plan_.kv_views(buffers, model.attention_layers[0].name)
    dtype = _q_dtype(device)
    key = torch.randn(case.tokens, spec.kv_heads_per_rank, spec.head_dim, device=device).to(dtype)
    value = torch.randn_like(key)
    slots = torch.randperm(k_cache.shape[0] * k_cache.shape[1] - plan_.block_size, device=device)
    slots = slots[: case.tokens] + plan_.block_size
    k_scale, v_scale = _scales(k_cache.dtype, device)
    kw = dict(
        num_heads=spec.kv_heads_per_rank, head_dim=spec.head_dim, block_size=plan_.block_size,
        num_blocks=k_cache.shape[0], key_dtype=dtype, cache_dtype=k_cache.dtype,
    )  # fmt: skip

    def candidates(default) -> list[dict]:
        return [{"config": c} for c in cache_write.CONFIGS if c != default.config]

    return Prepared(
        measure={"bytes": key.numel() * (2 * key.element_size() + 2 * k_cache.element_size())},
        block_size=plan_.block_size,
        plan=lambda **o: cache_write.plan_write_kv_cache(slots, **kw, **o),
        launch=lambda p: lambda: p.run(key, value, k_cache, v_cache, k_scale, v_scale),
        candidates=candidates,
        info=lambda p: {"config": str(p.config), "config_source": p.config_source},
    )


def prepare_indexer(case: Indexer, device) -> Prepared:
    """Rows of random keys and gates on shuffled 64-token pages; ``bytes`` counts the key and
    gate columns of every complete pool once (what a step must read; the valid column is not
    read), so a prefill's tiles re-reading rows from L2 can pass 100%."""
    heads, d, kpool, bs = INDEXER_SIZES
    if device.type != "cuda":  # the interpreter's smoke test: tiny heads and rows
        heads, d, kpool, bs = 4, 32, 4, 16
    rows_dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    q_dtype = _dtype(case.q_dtype)
    pages = math.ceil(case.context / bs)
    num_blocks = case.batch * pages + 1
    rows = torch.randn(num_blocks, bs, 1, 2 * d + 1, device=device).to(rows_dtype)
    tables = (torch.randperm(num_blocks - 1, device=device) + 1).to(torch.int32)
    tables = tables[: case.batch * pages].reshape(case.batch, pages).contiguous()
    n = case.batch * case.q_tokens
    seg = torch.arange(case.batch, device=device).repeat_interleave(case.q_tokens)
    pos = (case.context - case.q_tokens + torch.arange(case.q_tokens, device=device)).repeat(
        case.batch
    )
    num_pools = torch.full((case.batch,), case.context // kpool, device=device)
    q = torch.randn(n, heads, d, device=device).to(q_dtype)
    weights = torch.randn(n, heads, device=device) * heads**-0.5
    ape = torch.randn(kpool, d, device=device)
    out = torch.empty(n, case.context // kpool, device=device)
    kw = dict(
        num_heads=heads, head_dim=d, kpool=kpool, block_size=bs, rows_dtype=rows_dtype,
        q_dtype=q_dtype, softmax_scale=d**-0.5,
    )  # fmt: skip

    def candidates(default) -> list[dict]:
        return [{"config": c} for c in indexer_scores.CONFIGS if c != default.config]

    pooled = case.batch * (case.context // kpool) * kpool
    plan_indexer = indexer_scores.plan_indexer_scores
    measure = {"bytes": pooled * 2 * d * rows.element_size()}
    if case.q_tokens > 1:  # a prefill chunk: the head dots of every visible pool
        first = case.context - case.q_tokens
        seen = sum(
            min(case.context // kpool, (p + 1) // kpool) for p in range(first, case.context)
        )
        measure["flops"] = 2 * heads * d * case.batch * seen
    return Prepared(
        measure=measure,
        block_size=bs,
        plan=lambda **o: plan_indexer(tables, seg, pos, num_pools, **kw, **o),
        launch=lambda p: lambda: p.run(q, weights, rows, ape, out=out),
        candidates=candidates,
        info=lambda p: {"config": str(p.config), "config_source": p.config_source},
    )


PREPARE = {
    Decode: prepare_decode,
    Prefill: prepare_prefill,
    Mla: prepare_mla,
    States: prepare_states,
    Write: prepare_write,
    Indexer: prepare_indexer,
}


def run_prepared(case, ctx: Ctx) -> None:
    """hybridkv's kernel on its default plan, then vLLM's on the same inputs (where it has the
    kernel), with the largest difference between the two outputs."""
    prep = PREPARE[type(case)](case, ctx.device)
    if prep is None:
        ctx.skipped.append(f"{case}: the plan has too few blocks")
        return
    plan = prep.plan()
    ms = time_ms(prep.launch(plan), ctx.device, ctx.reps)
    ctx.row(case, "hybridkv", ms, block_size=prep.block_size, **prep.measure, **prep.info(plan))
    if isinstance(case, States) and case.op != "copy":
        run_torch_states(case, ctx)
    if not (ctx.peers and prep.peer):
        return
    try:
        peer = prep.peer()
    except LookupError as e:
        ctx.skipped.append(f"vllm_triton: {e}")
        return
    theirs = peer().float()
    diff = (theirs - prep.result().float()).abs().max().item()
    ms = time_ms(peer, ctx.device, ctx.reps)
    ctx.row(
        case, "vllm_triton", ms, block_size=prep.block_size, max_abs_diff_vs_hybridkv=diff,
        **prep.measure,
    )  # fmt: skip


def run_torch_states(case: States, ctx: Ctx) -> None:
    """``index_select`` / ``index_copy_`` on the same pool and batch: torch's own copies."""
    device = ctx.device
    row = case.row_bytes // 2
    slots = 2 * case.batch + 1
    pool = torch.randn(slots, row, device=device).to(torch.bfloat16)
    ids = torch.randperm(slots - 1, device=device)[: case.batch] + 1
    rows = torch.randn(case.batch, row, device=device).to(torch.bfloat16)
    if case.op == "gather":
        fn = lambda: torch.index_select(pool, 0, ids, out=rows)
    else:
        fn = lambda: pool.index_copy_(0, ids, rows)
    ms = time_ms(fn, device, ctx.reps)
    ctx.row(case, "torch", ms, bytes=2 * case.batch * case.row_bytes)


def sweep_case(row: dict, device, deadline: float) -> list[dict]:
    """Every candidate plan (configs, split counts) of the case of a benchmark row, until
    ``deadline``; one result per candidate, the best one flagged, with the default's value."""
    cls = {"decode": Decode, "prefill": Prefill, "mla": Mla, "states": States, "write": Write,
           "indexer": Indexer}  # fmt: skip
    cls = cls[row["case"]]
    fields = {f.name for f in dataclasses.fields(cls)}
    case = cls(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in row.items() if k in fields}
    )
    prep = PREPARE[cls](case, device)
    default = prep.plan()
    metric, unit = ("tflops", "TFLOP/s") if "flops" in prep.measure else ("pct_copy", "% copy")

    def value(ms: float) -> float:
        if "flops" in prep.measure:
            return prep.measure["flops"] / (ms / 1e3) / 1e12
        return row["pct_copy"] * row["ms"] / ms  # same bytes, same copy bandwidth

    base = value(time_ms(prep.launch(default), device))
    label = " ".join(f"{k}={v}" for k, v in dataclasses.asdict(case).items() if v is not None)
    out = []
    for overrides in prep.candidates(default):
        if time.time() > deadline:
            out.append({"case": label, "status": "stopped: out of time"})
            break
        tried = {k: str(v) for k, v in overrides.items()}
        try:
            plan = prep.plan(**overrides)
            v = value(time_ms(prep.launch(plan), device))
        except Exception as e:  # a config out of shared memory fails to launch: a result
            out.append({"case": label, **tried, "status": f"error: {e!r}"[:300]})
            continue
        out.append(
            {"case": label, **prep.info(plan), "value": v, "unit": unit, "metric": metric,
             "default_config": prep.info(default).get("config"), "default_value": base}
        )  # fmt: skip
    measured = [r for r in out if "value" in r]
    if measured:
        best = max(measured, key=lambda r: r["value"])
        if best["value"] > base:
            best["best"] = True
    return out


def run_case(case, ctx: Ctx, seen_sdpa: set) -> None:
    run_prepared(case, ctx)
    if not ctx.peers or getattr(case, "kv_dtype", "") not in ("bfloat16", "float16"):
        return
    if isinstance(case, Decode) and not case.sparse:  # SDPA's dense decode is no peer of a list
        key = (case.model, case.heads, case.batch, case.context)
        if key not in seen_sdpa:
            seen_sdpa.add(key)
            run_sdpa_decode(case, ctx)
            if ctx.flex and ctx.device.type == "cuda":
                run_flex_decode(case, ctx)
    elif isinstance(case, Prefill):
        key = (case.model, case.heads, case.q_lens, case.cached)
        if key not in seen_sdpa:
            seen_sdpa.add(key)
            run_sdpa_prefill(case, ctx)


def run_sdpa_decode(case: Decode, ctx: Ctx) -> None:
    """SDPA on contiguous K/V of the same batch, heads and context (no paging)."""
    device = ctx.device
    hq, hkv, d = _heads(case.model, case.heads)
    dtype = _q_dtype(device)
    k = torch.randn(case.batch, hkv, case.context, d, device=device).to(dtype)
    v = torch.randn_like(k)
    q = torch.randn(case.batch, hq, 1, d, device=device).to(dtype)
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    ms = time_ms(fn, device, ctx.reps)
    moved = case.batch * case.context * hkv * 2 * d * 2
    ctx.row(dataclasses.replace(case, layout="contiguous"), "torch_sdpa", ms, bytes=moved)


def run_flex_decode(case: Decode, ctx: Ctx) -> None:
    """FlexAttention over PyTorch's own paged cache (128-token pages), compiled."""
    device = ctx.device
    try:
        from torch.nn.attention.experimental._paged_attention import PagedAttention
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        ctx.flex_errors.append(f"{case}: {e!r}"[:300])
        return
    hq, hkv, d = _heads(case.model, case.heads)
    batch, length, page = case.batch, case.context, 128
    per_req = math.ceil(length / page)
    try:
        paged = PagedAttention(batch * per_req, page, batch, device=str(device))
        for b in range(batch):
            paged.reserve(torch.tensor(b, device=device), torch.tensor(length, device=device))
        k = torch.randn(1, hkv, batch * per_req * page, d, device=device).to(torch.bfloat16)
        v = torch.randn_like(k)
        logical = create_block_mask(
            lambda b, h, q_idx, kv_idx: kv_idx < length, batch, None, 1, per_req * page,
            device=str(device), BLOCK_SIZE=page,
        )  # fmt: skip
        mask = paged.convert_logical_block_mask(logical)
        score_mod = paged.get_score_mod(None)
        flex = torch.compile(flex_attention)
        q = torch.randn(batch, hq, 1, d, device=device).to(torch.bfloat16)
        fn = lambda: flex(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=True)
        fn()
    except Exception as e:  # an experimental API: record why, keep benchmarking
        ctx.flex_errors.append(f"{case}: {e!r}"[:300])
        return
    ms = time_ms(fn, device, ctx.reps)
    ctx.row(
        dataclasses.replace(case, layout="flex128"), "torch_flex_paged", ms,
        bytes=batch * length * hkv * 2 * d * 2, block_size=page,
    )  # fmt: skip


def run_sdpa_prefill(case: Prefill, ctx: Ctx) -> None:
    """SDPA (FlashAttention) on contiguous K/V, one request at a time for a varlen batch."""
    from torch.nn.attention.bias import causal_lower_right

    device = ctx.device
    hq, hkv, d = _heads(case.model, case.heads)
    dtype = _q_dtype(device)
    calls = []
    for n, c in zip(case.q_lens, case.cached):
        q = torch.randn(1, hq, n, d, device=device).to(dtype)
        k = torch.randn(1, hkv, n + c, d, device=device).to(dtype)
        v = torch.randn_like(k)
        # queries at the end of their context: a bottom-right aligned causal mask
        calls.append((q, k, v, None if c == 0 else causal_lower_right(n, n + c)))

    def fn():
        for q, k, v, mask in calls:
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
            )

    ms = time_ms(fn, device, ctx.reps)
    flops = 4 * hq * d * _causal_pairs(case.q_lens, case.cached)
    ctx.row(dataclasses.replace(case, layout="contiguous"), "torch_sdpa", ms, flops=flops)


# ---- provenance and output ---------------------------------------------------------------------


def git_commit() -> tuple[str, bool]:
    """HEAD and whether the checkout has uncommitted changes to tracked files."""
    try:
        head = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
        dirty = bool(subprocess.check_output(["git", "status", "--porcelain", "-uno"], text=True))
        return head, dirty
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False


def kernels_digest() -> str:
    """SHA-256 over ``kernels/*.py`` (name and bytes, sorted by name): which kernel sources
    ran, even where the checkout's git metadata is missing or stale (a copied working tree)."""
    digest = hashlib.sha256()
    for path in sorted((Path(__file__).resolve().parents[1] / "kernels").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def device_meta(device: torch.device, copy_bw: float) -> dict:
    commit, dirty = git_commit()
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "device_type": device.type,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "host": platform.machine(),
        "commit": commit,
        "dirty": dirty,
        "kernels_sha256": kernels_digest(),
        "copy_bandwidth_gbps": copy_bw / 1e9,
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        # what vLLM sizes --gpu-memory-utilization against (hybridkv's --gpu presets use it)
        meta.update(
            sms=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            total_memory_bytes=props.total_memory,
            mem_get_info_total_bytes=total,
            mem_get_info_free_bytes=free,
        )
    return meta


def device_tag(meta: dict) -> str:
    return "cpu-interpreter" if meta["device_type"] == "cpu" else meta["device"].replace(" ", "-")


def write_results(out_dir: Path, meta: dict, rows: list[dict], **extra) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = device_tag(meta)
    path = out_dir / f"kernels-{tag}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows, **extra}, indent=1, default=str))
    fields = sorted({k for r in rows for k in r})
    with open(out_dir / f"kernels-{tag}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def _summary(row: dict) -> str:
    measure = [f"{row['ms']:.4g} ms"]
    if "pct_copy" in row:
        measure.append(f"{row['pct_copy']:.1f}% copy")
    if "tflops" in row:
        measure.append(f"{row['tflops']:.1f} TFLOP/s")
    return f"{row['impl']} {', '.join(measure)}"


def run_set(
    cases: list,
    device: torch.device,
    reps: int | None,
    peers: bool,
    progress=print,
    flex: bool = False,
) -> tuple[dict, list[dict], dict]:
    """Run ``cases``; returns (meta, rows, extras). Each case's numbers go to ``progress``
    as they come, so a run cut short still leaves them in its log."""
    copy_bw = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (1 << 20))
    ctx = Ctx(device, copy_bw, reps, [], [], [], peers=peers, flex=flex)
    seen: set = set()
    for i, case in enumerate(cases, 1):
        t0 = time.time()
        first = len(ctx.rows)
        try:
            run_case(case, ctx, seen)
        except Exception as e:  # one case's failure must not lose the others' numbers
            ctx.skipped.append(f"{case}: error: {e!r}"[:400])
            progress(f"[{i}/{len(cases)}] {case}: error: {e!r}"[:400])
            continue
        if device.type == "cuda":
            torch.cuda.empty_cache()
        numbers = "; ".join(_summary(r) for r in ctx.rows[first:])
        progress(f"[{i}/{len(cases)}] {case} ({time.time() - t0:.1f} s): {numbers}")
    return (
        device_meta(device, copy_bw),
        ctx.rows,
        {"skipped": ctx.skipped, "flex_errors": ctx.flex_errors},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=sorted(SETS), default="suite")
    parser.add_argument("--out", type=Path, default=None, help="output folder")
    parser.add_argument("--reps", type=int, default=None, help="do_bench's rep (ms) / CPU reps")
    parser.add_argument("--no-peers", action="store_true", help="hybridkv's kernels only")
    parser.add_argument(
        "--flex", action="store_true", help="add FlexAttention decode (compiles per shape)"
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if args.out is None:
            parser.error("without a GPU the timings mean nothing: pass --out to a scratch folder")
        if args.set != "quick":
            parser.error("without a GPU only --set quick runs (tiny shapes, interpreter)")
    meta, rows, extra = run_set(
        SETS[args.set](), device, args.reps, not args.no_peers, print, flex=args.flex
    )
    meta["set"] = args.set
    path = write_results(args.out or RESULTS, meta, rows, **extra)
    print(json.dumps(meta, indent=1))
    print(f"{len(rows)} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
