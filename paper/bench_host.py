"""Host time of every kernel call: ``python -m paper.bench_host [--out DIR]``.

An engine calls each attention kernel once per layer per step, so the host work of a call adds
up (the H200 run of 2026-11-26 measured 106 us for a decode wrapper call against 23 us for
SDPA). For every kernel this times, on tiny shapes, without device syncs:

- ``wrapper``: the one-call function (plan and run);
- ``plan``: ``plan_*`` once per step;
- ``run``: ``plan.run`` per layer, the call whose host time the kernel issue bounds (30 us).

On a GPU the launches are real (500 calls, no sync in the loop), and each ``plan.run`` is also
captured in a CUDA graph whose replay must give the eager result (``graph_ok``). On the CPU the
launch itself is replaced by what Triton's ``JITFunction.run`` does before the driver's launch
(argument binding and specialisation against an sm_90 target, the compile-cache lookup) for a
key's first launch, and by the kernel modules' direct launchers after it (as on a GPU), so the
figure is the Python host work of a call without the driver's C launch (a few microseconds on a
GPU); ``run-binding`` rows time ``run`` with Triton's binding on every call instead. Comparable
between versions of the wrappers, not a GPU measurement (this CPU is not a GPU host's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridkv_kernels import cache_write, mla_decode, paged_decode, paged_prefill, state_copy

CALLS = 500


class _CompiledStandIn:
    """What a compiled kernel offers the direct launcher, launching nothing."""

    function, packed_metadata = 0, (4, 1, 0)

    def run(self, *args) -> None:
        return None


class _DriverStandIn:
    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0


@contextmanager
def _launches_stubbed(direct: bool) -> Iterator[None]:
    """Under the interpreter: a launch does Triton's pre-launch host work for an sm_90 target
    (binding, specialisation, cache key and lookup) and returns a stand-in compiled kernel
    without running anything. With ``direct``, the kernel modules' direct launchers are on (as
    on a GPU with a checked Triton): after a key's first launch they call the stand-in's
    launcher, so what is timed is the wrappers' own host work, as a GPU would run it, less the
    driver's C launch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    jits: dict[int, tuple[JITFunction, Callable, dict]] = {}

    def run(self, *args, grid, warmup, **kwargs):
        entry = jits.get(id(self))
        if entry is None:
            jit = JITFunction(self.fn, **self.kwargs)
            binder = create_function_from_signature(jit.signature, jit.params, backend)
            entry = jits[id(self)] = (jit, binder, {})
        jit, binder, keys = entry
        kwargs["debug"] = kwargs.get("debug", jit.debug)
        bound, specialization, options = binder(*args, **kwargs)
        keys.get(compute_cache_key(keys, specialization, options))
        if callable(grid):
            grid = grid(bound)
        return _CompiledStandIn()

    modules = (cache_write, mla_decode, paged_decode, paged_prefill, state_copy)
    saved = [(interpreter.InterpretedFunction, "run", interpreter.InterpretedFunction.run)]
    interpreter.InterpretedFunction.run = run
    if direct:
        driver = type(triton.runtime.driver)
        saved.append((driver, "active", driver.active))
        driver.active = property(lambda self: _DriverStandIn())
        for module in modules:
            saved.append((module, "_DIRECT_LAUNCH", module._DIRECT_LAUNCH))
            module._DIRECT_LAUNCH = True
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
        for module in modules:  # keys compiled for stand-ins must not outlive the stub
            for launcher in vars(module).values():
                if isinstance(getattr(launcher, "compiled", None), dict):
                    launcher.compiled.clear()


def _us(fn: Callable[[], object], device: torch.device, calls: int = CALLS) -> float:
    fn()  # compile / warm caches
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN where NaN was counts as equal)."""
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _graph_ok(run: Callable[[], torch.Tensor | None], result: Callable[[], torch.Tensor]) -> bool:
    """Fill ``run``'s result with fresh random values, call it eagerly, capture it in a CUDA
    graph, put the random values back, replay: the eager result again? (In-place kernels
    write only some rows of their result, and a copy's source may live in it too, so the
    result is refilled with what it held rather than poisoned; the fresh values make sure the
    eager call changes it even where earlier calls already wrote the same rows.)"""
    target = result()
    if target.is_floating_point():
        target.copy_(torch.randn(target.shape, device=target.device).to(target.dtype))
    else:
        target.copy_(torch.randint_like(target, 0, 100))
    before = target.clone()
    run()
    torch.cuda.synchronize()
    want = result().clone()
    if _same_bits(before, want):
        raise ValueError("the eager call changed nothing: the replay check would prove nothing")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm up on the capture stream, as torch's docs ask
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    result().copy_(before)
    graph.replay()
    torch.cuda.synchronize()
    return _same_bits(result(), want)


def _cases(device: torch.device) -> Iterator[tuple[str, Callable, Callable, Callable, Callable]]:
    """(kernel, wrapper call, plan call, run call, run's result) on tiny shapes."""
    dt = torch.bfloat16 if device.type == "cuda" else torch.float16
    f = dict(device=device)
    # decode: 4 requests of 64 tokens, Qwen3-Next's heads (16 q, 2 KV, 256 dims), 16-token pages
    bs, hq, hkv, d, batch, ctx = 16, 16, 2, 256, 4, 64
    k = torch.randn(batch * ctx // bs + 1, bs, hkv, d, **f).to(dt)
    v = torch.randn_like(k)
    tables = (torch.arange(batch * ctx // bs, **f).view(batch, -1) + 1).to(torch.int32)
    seq = torch.full((batch,), ctx, dtype=torch.int32, **f)
    q = torch.randn(batch, hq, d, **f).to(dt)
    out = torch.empty_like(q)
    plan_kw = dict(
        num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, cache_dtype=dt, q_dtype=dt,
        scale=d**-0.5, max_seq_len=ctx,
    )  # fmt: skip
    dplan = paged_decode.plan_decode(tables, seq, **plan_kw)
    yield (
        "paged_decode",
        lambda: paged_decode.paged_decode_attention(
            q, k, v, tables, seq, d**-0.5, max_seq_len=ctx, out=out
        ),
        lambda: paged_decode.plan_decode(tables, seq, **plan_kw),
        lambda: dplan.run(q, k, v, out=out),
        lambda: out,
    )
    # prefill: two requests of 16 new tokens, one after 48 cached
    cu = torch.tensor([0, 16, 32], dtype=torch.int32, **f)
    pseq = torch.tensor([16, 64], dtype=torch.int32, **f)
    qp = torch.randn(32, hq, d, **f).to(dt)
    pout = torch.empty_like(qp)
    pkw = dict(plan_kw, total_q=32, max_query_len=16, max_seq_len=64)
    pplan = paged_prefill.plan_prefill(tables[:2], cu, pseq, **pkw)
    yield (
        "paged_prefill",
        lambda: paged_prefill.paged_prefill_attention(
            qp, k, v, tables[:2], cu, pseq, d**-0.5, out=pout
        ),
        lambda: paged_prefill.plan_prefill(tables[:2], cu, pseq, **pkw),
        lambda: pplan.run(qp, k, v, out=pout),
        lambda: pout,
    )
    # MLA: 4 requests of 64 tokens, Kimi-Linear's 32 heads, latent 512 + 64, 64-token pages
    mbs, heads, dc, dr = 64, 32, 512, 64
    cache = torch.randn(batch + 1, mbs, dc + dr, **f).to(dt)
    mtables = (torch.arange(batch, **f).view(batch, 1) + 1).to(torch.int32)
    q_nope = torch.randn(batch, heads, dc, **f).to(dt)
    q_pe = torch.randn(batch, heads, dr, **f).to(dt)
    mout = torch.empty_like(q_nope)
    scale = (dc + dr) ** -0.5
    mkw = dict(
        num_heads=heads, kv_lora_rank=dc, qk_rope_head_dim=dr, block_size=mbs, cache_dtype=dt,
        q_dtype=dt, scale=scale, max_seq_len=ctx,
    )  # fmt: skip
    mplan = mla_decode.plan_mla_decode(mtables, seq, **mkw)
    yield (
        "mla_decode",
        lambda: mla_decode.mla_decode_attention(
            q_nope, q_pe, cache, mtables, seq, scale, max_seq_len=ctx, out=mout
        ),
        lambda: mla_decode.plan_mla_decode(mtables, seq, **mkw),
        lambda: mplan.run(q_nope, q_pe, cache, out=mout),
        lambda: mout,
    )
    # cache write: 4 decode tokens
    key = torch.randn(batch, hkv, d, **f).to(dt)
    value = torch.randn_like(key)
    slots = torch.arange(batch, dtype=torch.int64, **f) * bs + bs
    wkw = dict(
        num_heads=hkv, head_dim=d, block_size=bs, num_blocks=k.shape[0], key_dtype=dt,
        cache_dtype=dt,
    )  # fmt: skip
    wplan = cache_write.plan_write_kv_cache(slots, **wkw)
    yield (
        "write_kv_cache",
        lambda: cache_write.write_kv_cache(key, value, k, v, slots),
        lambda: cache_write.plan_write_kv_cache(slots, **wkw),
        lambda: wplan.run(key, value, k, v),
        lambda: k,
    )
    # states: 4 rows of a GDN-like state (16 heads x 32 x 32)
    pool = torch.randn(9, 16, 32, 32, **f).to(dt)
    ids = torch.arange(1, 5, dtype=torch.int32, **f)
    dst = torch.arange(5, 9, dtype=torch.int32, **f)
    rows = torch.empty(4, 16, 32, 32, dtype=dt, **f)
    skw = dict(row_shape=(16, 32, 32), num_slots=9, dtype=dt)
    for op in ("gather", "scatter", "copy"):
        make = getattr(state_copy, f"plan_{op}_states")
        ids_args = (ids, dst) if op == "copy" else ((dst,) if op == "scatter" else (ids,))
        splan = make(*ids_args, **skw)
        wrapper = {
            "gather": lambda: state_copy.gather_states(pool, ids, rows),
            "scatter": lambda: state_copy.scatter_states(pool, dst, rows),
            "copy": lambda: state_copy.copy_states(pool, ids, dst),
        }[op]
        run = (
            (lambda p=splan: p.run(pool, rows)) if op != "copy" else (lambda p=splan: p.run(pool))
        )
        yield (
            f"{op}_states",
            wrapper,
            lambda make=make, a=ids_args: make(*a, **skw),
            run,
            (lambda: rows) if op == "gather" else (lambda: pool),
        )


def measure(device: torch.device, say=print) -> list[dict]:
    """One row per (kernel, call): microseconds of host time per call; on a GPU the ``run``
    rows also say whether the call captures in a CUDA graph (``graph_ok``)."""
    rows = []
    if device.type != "cuda":
        with _launches_stubbed(direct=False):  # every launch binds its arguments in Triton
            for kernel, _, _, run, _ in _cases(device):
                rows.append({"kernel": kernel, "call": "run-binding", "us": _us(run, device, 200)})
    stub = _launches_stubbed(direct=True) if device.type != "cuda" else _nothing()
    with stub:
        for kernel, wrapper, plan, run, result in _cases(device):
            for call, fn in (("wrapper", wrapper), ("plan", plan), ("run", run)):
                calls = CALLS if device.type == "cuda" else 200
                rows.append({"kernel": kernel, "call": call, "us": _us(fn, device, calls)})
            if device.type == "cuda":
                try:
                    rows[-1]["graph_ok"] = _graph_ok(run, result)
                except Exception as e:  # a capture failure is a result
                    rows[-1]["graph_ok"] = False
                    rows[-1]["graph_error"] = repr(e)[:300]
            say(
                f"host time: {kernel} "
                + ", ".join(f"{r['call']} {r['us']:.1f} us" for r in rows[-3:])
            )
    return rows


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write host-<device>.json here")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = measure(device)
    for r in rows:
        print(f"{r['kernel']:16s} {r['call']:8s} {r['us']:8.1f} us", r.get("graph_ok", ""))
    if args.out:
        from paper import bench_kernels as bk

        meta = bk.device_meta(device, float("nan"))
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"host-{bk.device_tag(meta)}.json"
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
