"""Benchmark the kernels on real layouts: ``python -m paper.bench_kernels [--quick] [--out DIR]``.

On a GPU it times, with CUDA events, over shapes from the zoo:

- paged decode attention on every layout's real pages (a plan is made and allocated, and the
  kernel reads one attention layer's views), on a plain unpacked ``[blocks, 16, H, D]`` cache, and
  PyTorch's SDPA on contiguous K/V (the bandwidth a non-paged kernel gets);
- absorbed MLA decode on Kimi-Linear's latent pages in every layout;
- FlexAttention over PyTorch's own paged cache (``torch.nn.attention.experimental``), where the
  installed torch has it (failures are listed in the JSON's ``flex_errors``);
- the state gather / scatter kernels on a GDN or Mamba-2 state pool inside padded pages;
- the cache-write kernel;

and reports achieved GB/s and the fraction of the device's copy bandwidth, measured first with a
large ``copy_``. Results go to ``paper/results/kernels-<device>.{csv,json}`` with the device, date,
library versions and git commit.

Without a GPU it runs the same code under the Triton interpreter at tiny sizes (``--quick``) as a
smoke test, writing only where ``--out`` says: interpreter timings mean nothing.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton

from hybridkv import models
from hybridkv.layouts import make_plan
from hybridkv_kernels.cache_write import write_kv_cache
from hybridkv_kernels.mla_decode import mla_decode_attention
from hybridkv_kernels.paged_decode import paged_decode_attention
from hybridkv_kernels.state_copy import gather_states, scatter_states

RESULTS = Path(__file__).parent / "results"
LAYOUTS = ("inflate", "pack", "aggregate", "per_group", "two_level")
MODELS = {
    # name: (decode batches, contexts)
    "qwen3-next-80b-a3b": ([1, 8, 32, 128, 256], [1024, 8192, 32768, 131072]),
    "nemotron-h-8b": ([1, 8, 32, 128, 256], [1024, 8192, 32768, 131072]),
}
QUICK = {"qwen3.5-0.8b": ([1, 2], [64, 200])}
#: MLA + linear attention (KDA): the latent-cache decode kernel on every layout
MLA_MODEL = "kimi-linear-48b-a3b"
MLA_SHAPES = ([1, 32, 128], [8192, 32768])
MLA_QUICK = ([1], [130])


def _time(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after a warm-up."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> float:
    """Bytes/s of a device-to-device ``copy_`` (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _time(lambda: dst.copy_(src), device, reps)


def _plan_for(model, layout: str, batch: int, ctx: int, device):
    """The smallest plan of ``layout`` for ``batch`` requests of ``ctx`` tokens in whole blocks,
    and its buffers allocated on ``device``."""
    plan = make_plan(model, layout, fit_tokens=batch * ctx, max_num_seqs=batch)
    whole_blocks = batch * math.ceil(ctx / plan.block_size) * plan.block_size
    if whole_blocks > batch * ctx:
        plan = make_plan(model, layout, fit_tokens=whole_blocks, max_num_seqs=batch)
    return plan, plan.allocate(device, fill=0)


def _random_tables(num_blocks: int, block_size: int, batch: int, ctx: int, device):
    """Block tables of distinct shuffled ids (never the null block 0), None if too few."""
    per_req = math.ceil(ctx / block_size)
    usable = num_blocks - 1
    if batch * per_req > usable:
        return None
    ids = torch.randperm(usable, device=device)[: batch * per_req] + 1
    return ids.view(batch, per_req).to(torch.int32)


def _decode_case(model_name, layout, batch, ctx, device, dtype, reps):
    model = models.load(model_name, kv_dtype="bfloat16" if dtype == torch.bfloat16 else "float16")
    spec = model.attention_layers[0].spec
    hq, hkv, d = spec.heads_per_rank, spec.kv_heads_per_rank, spec.head_dim
    if layout == "unpacked":
        block_size = 16
        num_blocks = batch * math.ceil(ctx / block_size) + 1
        k_cache = torch.randn(num_blocks, block_size, hkv, d, device=device).to(dtype)
        v_cache = torch.randn_like(k_cache)
    else:
        plan, buffers = _plan_for(model, layout, batch, ctx, device)
        k_cache, v_cache = plan.kv_views(buffers, model.attention_layers[0].name)
        k_cache.normal_()
        v_cache.normal_()
        block_size = plan.block_size
    tables = _random_tables(k_cache.shape[0], block_size, batch, ctx, device)
    if tables is None:
        return None
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, d, device=device).to(dtype)
    fn = lambda: paged_decode_attention(q, k_cache, v_cache, tables, seq, d**-0.5, max_seq_len=ctx)
    seconds = _time(fn, device, reps)
    # bytes one layer's decode must read: K and V of every request (plus q and out, negligible)
    moved = batch * ctx * hkv * 2 * d * k_cache.element_size()
    return {"block_size": block_size, "seconds": seconds, "bytes": moved, "hq": hq, "hkv": hkv}


def _mla_case(layout, batch, ctx, device, dtype, reps):
    """Absorbed MLA decode over one MLA layer's latent view in a real plan of Kimi-Linear."""
    model = models.load(MLA_MODEL, kv_dtype="bfloat16" if dtype == torch.bfloat16 else "float16")
    spec = model.attention_layers[0].spec
    plan, buffers = _plan_for(model, layout, batch, ctx, device)
    cache, _ = plan.kv_views(buffers, model.attention_layers[0].name)
    cache.normal_()
    tables = _random_tables(cache.shape[0], plan.block_size, batch, ctx, device)
    if tables is None:
        return None
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    heads = spec.num_heads // spec.tp_size
    q_nope = torch.randn(batch, heads, spec.kv_lora_rank, device=device).to(dtype)
    q_pe = torch.randn(batch, heads, spec.qk_rope_head_dim, device=device).to(dtype)
    scale = (spec.kv_lora_rank + spec.qk_rope_head_dim) ** -0.5
    fn = lambda: mla_decode_attention(q_nope, q_pe, cache, tables, seq, scale, max_seq_len=ctx)
    seconds = _time(fn, device, reps)
    moved = batch * ctx * spec.latent_dim * cache.element_size()
    return {"block_size": plan.block_size, "seconds": seconds, "bytes": moved, "hq": heads}


def _flex_paged_case(model_name, batch, ctx, device, dtype, reps):
    """PyTorch FlexAttention over its own paged cache (``torch.nn.attention.experimental``),
    compiled; None where this torch or device lacks it."""
    try:
        from torch.nn.attention.experimental._paged_attention import PagedAttention
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    model = models.load(model_name)
    spec = model.attention_layers[0].spec
    hq, hkv, d = spec.heads_per_rank, spec.kv_heads_per_rank, spec.head_dim
    page = 128  # flex's KV block: one page per KV block
    per_req = math.ceil(ctx / page)
    n_pages = batch * per_req
    paged = PagedAttention(n_pages, page, batch, device=str(device))
    for b in range(batch):  # shuffled pages, as an allocator hands them out
        paged.reserve(torch.tensor(b, device=device), torch.tensor(ctx, device=device))
    k_cache = torch.randn(1, hkv, n_pages * page, d, device=device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    logical = create_block_mask(
        lambda b, h, q_idx, kv_idx: kv_idx < ctx,
        batch,
        None,
        1,
        per_req * page,
        device=str(device),
        BLOCK_SIZE=page,
    )
    mask = paged.convert_logical_block_mask(logical)
    score_mod = paged.get_score_mod(None)
    flex = torch.compile(flex_attention)
    q = torch.randn(batch, hq, 1, d, device=device).to(dtype)
    fn = lambda: flex(q, k_cache, v_cache, score_mod=score_mod, block_mask=mask, enable_gqa=True)
    fn()
    seconds = _time(fn, device, reps)
    return {"block_size": page, "seconds": seconds, "bytes": batch * ctx * hkv * 2 * d * 2}


def _sdpa_case(model_name, batch, ctx, device, dtype, reps):
    model = models.load(model_name)
    spec = model.attention_layers[0].spec
    hq, hkv, d = spec.heads_per_rank, spec.kv_heads_per_rank, spec.head_dim
    k = torch.randn(batch, hkv, ctx, d, device=device).to(dtype)
    v = torch.randn_like(k)
    q = torch.randn(batch, hq, 1, d, device=device).to(dtype)
    group = hq // hkv
    try:
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        fn()
    except TypeError:  # torch < 2.5: expand the KV heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)
    seconds = _time(fn, device, reps)
    return {"block_size": 0, "seconds": seconds, "bytes": batch * ctx * hkv * 2 * d * 2}


def _state_cases(device, reps, quick):
    """Gather and scatter a GDN recurrent state pool whose slots sit in padded pages."""
    model = models.load("qwen3.5-0.8b" if quick else "qwen3-next-80b-a3b")
    batches = [1, 2] if quick else [1, 8, 32, 128, 256]
    rows = []
    for batch in batches:
        # the smallest plan with ``batch`` states (and one block of KV)
        plan = make_plan(model, "inflate", fit_tokens=1, max_num_seqs=batch)
        buffers = plan.allocate(device, fill=0)
        pool = plan.state_views(buffers, model.state_layers[0].name)["ssm"]
        slots = (torch.randperm(pool.shape[0] - 1, device=device)[:batch] + 1).to(torch.int32)
        out = torch.empty((batch, *pool.shape[1:]), dtype=pool.dtype, device=device)
        moved = 2 * batch * pool[0].numel() * pool.element_size()
        t = _time(lambda p=pool, s=slots, o=out: gather_states(p, s, o), device, reps)
        rows.append(
            {
                "kernel": "gather_states",
                "layout": "inflate",
                "batch": batch,
                "context": 0,
                "seconds": t,
                "bytes": moved,
            }
        )
        t = _time(lambda p=pool, s=slots, o=out: scatter_states(p, s, o), device, reps)
        rows.append(
            {
                "kernel": "scatter_states",
                "layout": "inflate",
                "batch": batch,
                "context": 0,
                "seconds": t,
                "bytes": moved,
            }
        )
    return rows


def _write_case(device, dtype, reps, quick):
    model = models.load("qwen3.5-0.8b" if quick else "qwen3-next-80b-a3b")
    spec = model.attention_layers[0].spec
    tokens = 64 if quick else 8192
    plan = make_plan(model, "pack", fit_tokens=2 * tokens, max_num_seqs=1)
    buffers = plan.allocate(device, fill=0)
    k_cache, v_cache = plan.kv_views(buffers, model.attention_layers[0].name)
    key = torch.randn(tokens, spec.kv_heads_per_rank, spec.head_dim, device=device).to(dtype)
    value = torch.randn_like(key)
    slots = torch.randperm(k_cache.shape[0] * k_cache.shape[1] - plan.block_size, device=device)
    slots = slots[:tokens] + plan.block_size
    t = _time(lambda: write_kv_cache(key, value, k_cache, v_cache, slots), device, reps)
    moved = 2 * 2 * key.numel() * key.element_size()
    return {
        "kernel": "write_kv_cache",
        "layout": f"pack({plan.pack_size})",
        "batch": 1,
        "context": tokens,
        "seconds": t,
        "bytes": moved,
    }


def _git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    parser.add_argument("--out", type=Path, default=None, help="output folder")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--max-bytes", type=float, default=0.3, help="fraction of GPU memory")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and args.out is None:
        parser.error("without a GPU the timings mean nothing: pass --out to a scratch folder")
    quick = args.quick or device.type == "cpu"
    reps = args.reps or (3 if quick else 20)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    out_dir = args.out or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    copy_bw = copy_bandwidth(device, (1 << 20) if quick else (2 << 30), reps)
    limit = (
        args.max_bytes * torch.cuda.get_device_properties(0).total_memory
        if device.type == "cuda"
        else 1 << 28
    )
    rows = []
    flex_errors: list[str] = []
    for model_name, (batches, contexts) in (QUICK if quick else MODELS).items():
        kv_per_token = models.load(model_name).kv_bytes_per_token
        for batch in batches:
            for ctx in contexts:
                if batch * ctx * kv_per_token > limit:
                    continue
                for layout in ("unpacked", *LAYOUTS):
                    r = _decode_case(model_name, layout, batch, ctx, device, dtype, reps)
                    if r is not None:
                        rows.append(
                            {
                                "kernel": "paged_decode",
                                "model": model_name,
                                "layout": layout,
                                "batch": batch,
                                "context": ctx,
                                **r,
                            }
                        )
                if device.type == "cuda":  # compiling flex on the CPU takes minutes
                    try:
                        r = _flex_paged_case(model_name, batch, ctx, device, dtype, reps)
                    except Exception as e:  # experimental API: record why, keep benchmarking
                        flex_errors.append(f"{model_name} B={batch} ctx={ctx}: {e!r}"[:300])
                        r = None
                    if r is not None:
                        rows.append(
                            {
                                "kernel": "flex_paged",
                                "model": model_name,
                                "layout": "flex",
                                "batch": batch,
                                "context": ctx,
                                **r,
                            }
                        )
                r = _sdpa_case(model_name, batch, ctx, device, dtype, reps)
                rows.append(
                    {
                        "kernel": "sdpa_contiguous",
                        "model": model_name,
                        "layout": "-",
                        "batch": batch,
                        "context": ctx,
                        **r,
                    }
                )
                print(f"{model_name} B={batch} ctx={ctx} done", file=sys.stderr)
    mla_kv = models.load(MLA_MODEL).kv_bytes_per_token
    for batch in (MLA_QUICK if quick else MLA_SHAPES)[0]:
        for ctx in (MLA_QUICK if quick else MLA_SHAPES)[1]:
            if batch * ctx * mla_kv > limit:
                continue
            for layout in LAYOUTS:
                r = _mla_case(layout, batch, ctx, device, dtype, reps)
                if r is not None:
                    rows.append(
                        {
                            "kernel": "mla_decode",
                            "model": MLA_MODEL,
                            "layout": layout,
                            "batch": batch,
                            "context": ctx,
                            **r,
                        }
                    )
    rows.extend(_state_cases(device, reps, quick))
    rows.append(_write_case(device, dtype, reps, quick))
    for r in rows:
        r["gbps"] = r["bytes"] / r["seconds"] / 1e9
        r["pct_of_copy_bw"] = 100 * r["bytes"] / r["seconds"] / copy_bw
    meta = {
        "device": name,
        "device_type": device.type,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "commit": _git_commit(),
        "copy_bandwidth_gbps": copy_bw / 1e9,
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "dtype": str(dtype),
        "flex_errors": flex_errors,
    }
    tag = "cpu-interpreter" if device.type == "cpu" else name.replace(" ", "-")
    (out_dir / f"kernels-{tag}.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1)
    )
    fields = sorted({k for r in rows for k in r})
    with open(out_dir / f"kernels-{tag}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print(json.dumps(meta, indent=1))
    print(f"{len(rows)} rows -> {out_dir}/kernels-{tag}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
