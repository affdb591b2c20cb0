"""hybridkv's ``marconi`` policy against Marconi's own simulator, at equal bytes.

Marconi (MLSys'25, https://github.com/ruipeterpan/marconi) evaluates its policy with a
trace-driven simulator of a radix tree: per request ``match_prefix`` on the prompt, then
``insert`` of prompt + answer under a capacity in bytes. Its default model is NVIDIA's 7B
Attention-Mamba2 hybrid (4 attention + 24 Mamba-2 layers, ``d_model`` 4096, ``d_state`` 128,
fp16) with its own byte formulas (``utils.py``): ``2 * d * 2`` bytes of KV per token per
attention layer and ``d * n * 2 + (2d + 2n) * 4 * 2`` bytes of state per Mamba layer.

:func:`marconi_model` is a hybridkv model with exactly those bytes, so a hybridkv plan of
``C`` bytes and Marconi's tree of capacity ``C`` hold the same data. Both sides replay
hybridkv's ``multi_turn_chat`` (2,000 requests, seed 0, exact token ids) one request at a time
(:func:`hybridkv.replay.replay`).

The peer's numbers come from running its code: ``python -m paper.marconi_gap --peer PATH``
(``PATH``: a checkout of the repository; its code is CC BY-NC and is imported from there, never
copied) writes ``paper/results/marconi-peer.json`` with the commit, date and versions. The
figure reads that file; the hybridkv side is recomputed by every run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from hybridkv import traces
from hybridkv.alloc import AllocatorOptions
from hybridkv.alloc.policies import policy_class
from hybridkv.costmodel import H100_SXM, ParamCount, StepCoster
from hybridkv.executors import (
    Executor,
    ExecutorUnavailable,
    LocalExecutor,
    add_executor_arguments,
    executor_options,
    open_executor,
)
from hybridkv.layouts import make_plan
from hybridkv.models.model import HybridModel
from hybridkv.replay import replay

from .registry import PACKAGES, Context, register

RESULTS = Path(__file__).parent / "results" / "marconi-peer.json"
#: the cache sizes compared (bytes): Marconi's artifact sweeps 1-10 GB for chat traces
CAPACITIES = (1_200_000_000, 5_000_000_000, 11_500_000_000)
NUM_REQUESTS = 2000
#: the peer's policies: Marconi (its V2, alpha tuned online), SGLang+ (V1: LRU on leaves),
#: vLLM+ (every 32-token block's state kept), and Marconi with its capacity enforced after
#: every insert (its eviction miscounts the bytes it frees; see the paper)
PEER_POLICIES = ("marconi", "sglang+", "vllm+", "marconi capacity-enforced")
#: hybridkv's layouts in the comparison; ``per_group+cache`` is per_group whose state pool
#: also holds cached states: a quarter of the budget (per_group's pools are fixed, so some
#: split has to be chosen; plain per_group caches no state at all with one running request)
LAYOUTS = ("inflate", "pack", "aggregate", "per_group+cache", "two_level")
PER_GROUP_STATE_SHARE = 0.25


def marconi_model() -> HybridModel:
    """Marconi's default 7B hybrid, byte for byte: per token 4 x 16,384 B of KV (32 KV heads
    of 128, fp16), per request 24 x 1,116,160 B of Mamba-2 state. The Mamba-2 shape (128 heads
    of 64, 2 groups, ``d_state`` 64, ``d_conv`` 5) is chosen so that its SSM tensor (1,048,576
    B) and conv tensor (4 x 8,448 x 2 = 67,584 B) equal Marconi's ``d * n * 2`` and
    ``(2d + 2n) * 4 * 2`` with ``d = 4096, n = 128``; only the bytes enter a cache policy."""
    attention = [3, 10, 17, 24]
    return HybridModel.from_dict(
        {
            "name": "marconi-7b-bytes",
            "display_name": "Marconi's 7B hybrid (byte-equal)",
            "num_hidden_layers": 28,
            "torch_dtype": "float16",
            "mixers": [
                {
                    "kind": "full_attention",
                    "num_heads": 32,
                    "num_kv_heads": 32,
                    "head_dim": 128,
                    "head_dim_v": 128,
                    "layers": attention,
                },
                {
                    "kind": "mamba2",
                    "num_heads": 128,
                    "head_dim": 64,
                    "n_groups": 2,
                    "d_state": 64,
                    "d_conv": 5,
                    "layers": [i for i in range(28) if i not in attention],
                },
            ],
            "sources": [
                "ruipeterpan/marconi utils.py get_kvs_size / get_mamba_state_size, "
                "policy_exploration.py defaults (24 SSM, 4 attention layers, d 4096, n 128)"
            ],
        }
    )


@cache
def chat_trace(n: int = NUM_REQUESTS) -> traces.Trace:
    return traces.multi_turn_chat(n, seed=0)


def plan(layout: str, capacity: int):
    model = marconi_model()
    if layout == "per_group+cache":
        return make_plan(
            model,
            "per_group",
            memory=capacity,
            max_num_seqs=1,
            cache_state_slots=per_group_cache_slots(capacity),
        )
    return make_plan(model, layout, memory=capacity, max_num_seqs=1)


def per_group_cache_slots(capacity: int) -> int:
    """Cached-state slots of ``per_group+cache``: a quarter of the budget, in whole states."""
    return int(PER_GROUP_STATE_SHARE * capacity) // marconi_model().state_bytes_per_seq


#: Marconi's 7B by its FLOP formulas (``utils.py``): per token 24 x (12 d^2 + 16 d n + 10 d)
#: (Mamba) + 4 x 8 d^2 (attention projections) + 28 x 16 d^2 (MLP) ~ 1.31e10 FLOPs, i.e.
#: 2 x 6.54e9 parameters; hybridkv's cost model adds the attention context and the recurrent
#: updates itself
MARCONI_PARAMS = ParamCount(6.54e9, 6.54e9, "Marconi utils.py FLOP formulas, d 4096, n 128")


def marconi_flops() -> Callable[[int, int], float]:
    """FLOPs of prefilling ``new`` tokens after ``cached`` on Marconi's 7B (the FLOP model of
    the ``marconi`` eviction and of its alpha tuning)."""
    return StepCoster(marconi_model(), H100_SXM, params=MARCONI_PARAMS).prefill_flops


def run_hybridkv(
    layout: str, capacity: int, policy: str = "marconi", n: int = NUM_REQUESTS, **options: Any
):
    """One replay of the chat trace on ``layout`` at ``capacity`` bytes (a ReplayResult).
    ``marconi`` tunes its alpha as Marconi does unless ``marconi_alpha`` is given; ``options``
    are :func:`~hybridkv.replay.replay`'s (allocator options and ``marconi_alpha``)."""
    # marconi weighs the FLOPs a state saves by Marconi's 7B, as the peer does
    # a policy whose eviction weighs value needs the FLOP model of Marconi's 7B
    flops = marconi_flops() if policy_class(policy).eviction == "marconi" else None
    base = AllocatorOptions(checkpoint_policy=policy, marconi_flops=flops)
    return replay(plan(layout, capacity), chat_trace(n), base, sample_every=5, **options)


# ---- the peer ------------------------------------------------------------------------------
def _import_peer(checkout: Path) -> tuple[Any, Any]:
    """Marconi's two tree classes from a checkout. Its modules import ``transformers`` and
    ``scipy`` names they never use on this path; stand-ins are put in place when missing."""
    import types

    for name, attrs in (
        ("transformers", ("AutoTokenizer", "AutoModelForCausalLM")),
        ("scipy.stats", ("rankdata",)),
    ):
        try:
            __import__(name)
        except ImportError:
            mod = types.ModuleType(name)
            for a in attrs:
                setattr(mod, a, None)
            sys.modules[name] = mod
            if "." in name:
                sys.modules.setdefault(name.split(".")[0], types.ModuleType(name.split(".")[0]))
    sys.path.insert(0, str(checkout))
    try:
        from radix_cache_hybrid import RadixCache  # type: ignore[import-not-found]
        from radix_cache_vllm import RadixCache as RadixCacheVllm  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(checkout))
    return RadixCache, RadixCacheVllm


def run_peer(checkout: Path, capacity: int, policy: str, n: int = NUM_REQUESTS) -> dict[str, Any]:
    """Marconi's simulator on the chat trace, as its ``policy_exploration.py`` drives it."""
    tree_cls, vllm_cls = _import_peer(checkout)
    reqs = [(r.prompt.tolist(), r.output_ids.tolist()) for r in chat_trace(n).requests]
    if policy == "vllm+":
        tree = vllm_cls(capacity_bytes=capacity, block_size=32, use_logical_ts=True)
    else:
        version = 1 if policy == "sglang+" else 2
        tree = tree_cls(
            capacity_bytes=capacity,
            evict_policy_version=version,
            eff_weight=0.0,
            use_logical_ts=True,
            bootstrap_multiplier=5,
        )
    enforce = policy == "marconi capacity-enforced"
    sizes: list[int] = []
    over = 0
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its tuning
        for i, (prompt, answer) in enumerate(reqs):
            tree.match_prefix(prompt)
            tree.insert(token_ids=prompt + answer, state_at_leaf=i, state_at_branchoff=i)
            if enforce:
                while tree.get_tree_size() > capacity and tree.num_nodes > 1:
                    tree.evict(bytes_to_remove=tree.get_tree_size() - capacity)
            if policy != "vllm+":
                size = tree.get_tree_size()
                over += size > capacity
                if i >= n // 2:
                    sizes.append(size)
    hist = tree.request_history
    out: dict[str, Any] = {
        "policy": policy,
        "capacity": capacity,
        "token_hit_rate": sum(x[2] for x in hist) / sum(x[1] for x in hist),
        "hits": [int(x[2]) for x in hist],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if sizes:
        out["tree_bytes_mean_second_half"] = sum(sizes) / len(sizes)
        out["tree_bytes_max_second_half"] = max(sizes)
        out["inserts_over_capacity"] = over
    if policy in ("marconi", "marconi capacity-enforced"):
        out["alpha_at_end"] = float(tree.eff_weight)
    return out


def _commit(path: Path) -> str | None:
    try:
        return subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _peer_run(task: tuple[Path, int, str, int]) -> dict[str, Any]:
    """``(checkout, capacity, policy, requests)`` -> :func:`run_peer` (module level, so an
    executor can run it in a worker; the checkout must be at the same path there)."""
    return run_peer(*task)


def measure_peer(
    checkout: Path,
    commit: str | None = None,
    n: int = NUM_REQUESTS,
    executor: Executor | None = None,
) -> dict:
    """Every peer policy at every capacity, side by side on ``executor`` (default: one after
    the other here); the record written to :data:`RESULTS`."""
    import numpy as np

    tasks = [(checkout.resolve(), c, p, n) for c in CAPACITIES for p in PEER_POLICIES]
    runs = (executor or LocalExecutor()).map(_peer_run, tasks)
    return {
        "what": "Marconi's trace-driven simulator on hybridkv's multi_turn_chat "
        f"({n} requests, seed 0), one request at a time",
        "peer": "https://github.com/ruipeterpan/marconi",
        "peer_commit": commit or _commit(checkout),
        "date": dt.date.today().isoformat(),
        "machine": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "hybridkv_commit": _commit(Path(__file__).parent.parent),
        "runs": runs,
    }


@cache
def peer_results() -> dict[str, Any] | None:
    """The committed peer measurement, or None."""
    if not RESULTS.exists():
        return None
    return json.loads(RESULTS.read_text())


def peer_rate(capacity: int, policy: str) -> float | None:
    data = peer_results()
    if data is None:
        return None
    for run in data["runs"]:
        if run["capacity"] == capacity and run["policy"] == policy:
            return float(run["token_hit_rate"])
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", type=Path, help="a checkout of ruipeterpan/marconi to measure")
    ap.add_argument("--peer-commit", help="its commit, when the checkout has no .git")
    ap.add_argument(
        "--requests",
        type=int,
        default=NUM_REQUESTS,
        help=f"requests of the chat trace (default {NUM_REQUESTS})",
    )
    add_executor_arguments(
        ap, "the peer's runs (on Ray, the checkout must be at the same path on every node)"
    )
    args = ap.parse_args(argv)
    if args.peer is None:
        ap.error("--peer PATH is required (the figure itself is made by paper.figures)")
    if not (args.peer / "radix_cache_hybrid.py").exists():
        ap.error(f"{args.peer} is not a Marconi checkout (no radix_cache_hybrid.py)")
    try:
        with open_executor(executor_options(args, PACKAGES, ap)) as executor:
            data = measure_peer(args.peer, args.peer_commit, args.requests, executor)
    except ExecutorUnavailable as exc:
        ap.error(str(exc))
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    for run in data["runs"]:
        print(f"{run['capacity'] / 1e9:5.1f} GB  {run['policy']:<26} {run['token_hit_rate']:.2%}")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    # the module imported by name runs, so the peer runs it maps are paper.marconi_gap.*,
    # which a worker (a Ray one too) imports by that name (see paper.figures)
    from paper.marconi_gap import main as _main

    raise SystemExit(_main())


# ---- the figure ----------------------------------------------------------------------------
def _figure_runs(small: bool) -> tuple[int, tuple[int, ...]]:
    return (80, (CAPACITIES[0],)) if small else (NUM_REQUESTS, CAPACITIES)


#: the ablations the table runs beside each policy: allocator options switched off
VARIANTS: dict[str, dict[str, bool]] = {
    "": {},
    "no cascade": {"evict_unreachable": False},
    "by group": {"marconi_across_groups": False},
}


def _gap_run(task: tuple[str, int, str, str, int]):
    """``(layout, capacity, policy, variant, requests)`` -> the replay (``variant``: a key of
    :data:`VARIANTS`), or why the layout cannot run it (module level, so :meth:`Context.map`
    can run it in a worker)."""
    layout, cap, policy, variant, n = task
    try:
        return run_hybridkv(layout, cap, policy, n=n, **VARIANTS[variant])
    except ValueError as e:  # a layout whose memory cannot hold the longest request
        return f"{layout} at {cap / 1e9:g} GB: {e}"


def _loss_split(ours, peer: list[int], prompts) -> tuple[float, float, float]:
    """Points of hit rate lost to the peer on requests within one hash unit of it (where
    states can sit), lost on the rest, and won, over all prompt tokens."""
    import numpy as np

    d = np.asarray(peer) - np.asarray(ours)
    total = float(np.sum(prompts))
    small = float(d[(d > 0) & (d <= 16)].sum()) / total
    big = float(d[d > 16].sum()) / total
    won = float(-d[d < 0].sum()) / total
    return 100 * small, 100 * big, 100 * won


@register(
    "marconi_gap",
    "hybridkv's marconi policy against Marconi's own simulator at equal bytes, with the "
    "byte breakdown that says where each cache's memory went.",
)
def marconi_gap(ctx: Context) -> list[Path]:
    import matplotlib.pyplot as plt
    import numpy as np

    from . import data

    n, capacities = _figure_runs(ctx.small)
    peer = peer_results() if n == NUM_REQUESTS else None
    runs: dict[tuple[str, str, int, str], Any] = {}
    misfits: list[str] = []

    tasks = []
    for cap in capacities:
        tasks += [(layout, cap, "marconi", "", n) for layout in LAYOUTS]
        for layout in ("inflate", "two_level"):
            tasks += [(layout, cap, "align", "", n), (layout, cap, "marconi", "no cascade", n)]
        tasks.append(("two_level", cap, "marconi", "by group", n))
    for (layout, cap, policy, variant, _), got in zip(tasks, ctx.map(_gap_run, tasks)):
        if isinstance(got, str):
            misfits.append(got)
        else:
            runs[(layout, policy, cap, variant)] = got

    def rate(key: tuple[str, str, int, str]) -> float | None:
        r = runs.get(key)
        return None if r is None else r.token_hit_rate

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}"

    rows = []
    for cap in capacities:
        row = {"cap": f"{cap / 1e9:g} GB"}
        for p in PEER_POLICIES:
            row[p] = pct(peer_rate(cap, p)) if peer else "-"
        for layout in LAYOUTS:
            row[f"{layout}+marconi"] = pct(rate((layout, "marconi", cap, "")))
        for layout in ("inflate", "two_level"):
            row[f"{layout}+align"] = pct(rate((layout, "align", cap, "")))
            no_cascade = (layout, "marconi", cap, "no cascade")
            row[f"{layout}+marconi, no cascade"] = pct(rate(no_cascade))
        row["two_level+marconi, by group"] = pct(rate(("two_level", "marconi", cap, "by group")))
        rows.append(row)
    cols = [("cap", "capacity")]
    cols += [(p, f"{p} (peer)") for p in PEER_POLICIES]
    cols += [(f"{x}+marconi", f"{x} marconi") for x in LAYOUTS]
    cols += [(f"{x}+align", f"{x} align") for x in ("inflate", "two_level")]
    cols += [
        (f"{x}+marconi, no cascade", f"{x} marconi, evict_unreachable off")
        for x in ("inflate", "two_level")
    ]
    cols.append(("two_level+marconi, by group", "two_level marconi, marconi_across_groups off"))

    mid = capacities[len(capacities) // 2]
    bd_rows = []
    for layout in LAYOUTS:
        for policy in ("marconi", "align"):
            r = runs.get((layout, policy, mid, ""))
            if r is None:
                continue
            m = r.breakdown_mean()
            bd_rows.append(
                {
                    "layout": layout,
                    "policy": policy,
                    "hit": pct(r.token_hit_rate),
                    **{
                        k: f"{m[k] / 1e9:.2f}"
                        for k in (
                            "reachable_kv",
                            "reachable_state",
                            "unreachable",
                            "owned_empty",
                            "padding",
                            "free",
                            "unusable",
                        )
                    },
                    "states": f"{m['cached_states']:.1f}",
                }
            )
    bd_cols = [
        ("layout", "layout"),
        ("policy", "policy"),
        ("hit", "hit %"),
        ("reachable_kv", "reachable KV"),
        ("reachable_state", "reachable states"),
        ("unreachable", "cached, unreachable"),
        ("owned_empty", "owned but empty"),
        ("padding", "padding"),
        ("free", "free"),
        ("unusable", "unusable"),
        ("states", "states cached"),
    ]

    split_rows = []
    if peer:
        prompts = np.asarray([len(r.prompt) for r in chat_trace(n).requests])
        for cap in capacities:
            ref = next(
                x["hits"]
                for x in peer["runs"]
                if x["capacity"] == cap and x["policy"] == "marconi"
            )
            for layout in ("inflate", "two_level"):
                if (layout, "marconi", cap, "") not in runs:
                    continue
                small_loss, big_loss, won = _loss_split(
                    runs[(layout, "marconi", cap, "")].hits, ref, prompts
                )
                split_rows.append(
                    {
                        "cap": f"{cap / 1e9:g} GB",
                        "layout": layout,
                        "small": f"{small_loss:.2f}",
                        "big": f"{big_loss:.2f}",
                        "won": f"{won:.2f}",
                    }
                )

    # figure: hit rate per capacity, peer policies then hybridkv's layouts
    fig, ax = plt.subplots(figsize=(9, 4.2))
    series = [(p, f"{p} (peer)") for p in PEER_POLICIES[:3]] + [
        (f"{x}+marconi", f"hybridkv {x} + marconi") for x in LAYOUTS
    ]
    width = 0.8 / len(series)
    cmap = plt.get_cmap("tab10")
    for j, (key, label) in enumerate(series):
        xs, ys = [], []
        for i, row in enumerate(rows):
            if row[key] != "-":
                xs.append(i + (j - (len(series) - 1) / 2) * width)
                ys.append(float(row[key]))
        if xs:
            ax.bar(xs, ys, width, color=cmap(j), label=label, hatch="//" if j < 3 else None)
    ax.set_xticks(range(len(rows)), [r["cap"] for r in rows])
    ax.set_ylabel("prompt tokens served from the cache (%)")
    ax.set_xlabel("cache capacity (bytes, Marconi's 7B hybrid byte for byte)")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"multi_turn_chat, {n} requests, one at a time", fontsize=9)
    png = ctx.save(fig, "marconi_gap")

    summary = ctx.summary("marconi_gap", _summary(rows, peer is not None))
    prov = (
        f"Peer: {peer['peer']} at commit {peer['peer_commit']}, measured {peer['date']} "
        f"({peer['machine']}, Python {peer['python']}) by `python -m paper.marconi_gap "
        f"--peer PATH`, file `paper/results/marconi-peer.json`."
        if peer
        else "Peer: not measured here (no paper/results/marconi-peer.json or a small run)."
    )
    over = ""
    if peer:
        over = (
            "Peer tree size (mean over the second half / max / inserts over capacity): "
            + (
                "; ".join(
                    f"{x['capacity'] / 1e9:g} GB {x['policy']}: "
                    f"{x['tree_bytes_mean_second_half'] / 1e9:.2f} / "
                    f"{x['tree_bytes_max_second_half'] / 1e9:.2f} GB / "
                    f"{x['inserts_over_capacity']}"
                    for x in peer["runs"]
                    if x["policy"] in ("marconi", "marconi capacity-enforced")
                )
            )
            + "."
        )
    lines = [
        summary,
        "",
        f"Trace: hybridkv multi_turn_chat({n}, seed=0), exact token ids, one request at a "
        "time (`hybridkv.replay`); model: Marconi's 7B hybrid byte for byte "
        "(`paper.marconi_gap.marconi_model`); hash unit 16 tokens; max_num_seqs 1; "
        "per_group+cache: per_group with a quarter of the budget in cached-state slots "
        f"({', '.join(str(per_group_cache_slots(c)) for c in capacities)}). {prov}",
        "",
        "Token hit rate (%):",
        "",
        data.markdown_table(rows, cols),
        "",
        f"Where the bytes are at {mid / 1e9:g} GB (GB, mean after each request of the "
        "second half; `hybridkv.alloc.memory_breakdown`):",
        "",
        data.markdown_table(bd_rows, bd_cols),
    ]
    alpha_rows = [
        {
            "cap": f"{cap / 1e9:g} GB",
            **{
                x: (
                    "-"
                    if (r := runs.get((x, "marconi", cap, ""))) is None
                    else f"{r.marconi_alpha:g} (after {r.alpha_tuned_at + 1})"
                    if r.alpha_tuned_at is not None
                    else f"{r.marconi_alpha:g} (never tuned)"
                )
                for x in LAYOUTS
            },
        }
        for cap in capacities
    ]
    lines += [
        "",
        'hybridkv `marconi`\'s alpha, tuned as Marconi tunes its own (`marconi_alpha="auto"`: '
        "0 until five times as many requests as were served before the first eviction, then "
        "the grid value 0-2 that saved the most FLOPs replaying those; in brackets, the "
        "requests seen). The peer's own tuning ended at "
        + (
            ", ".join(
                f"{x['alpha_at_end']:g} ({x['capacity'] / 1e9:g} GB)"
                for x in peer["runs"]
                if x["policy"] == "marconi"
            )
            if peer
            else "(not measured here)"
        )
        + ":",
        "",
        data.markdown_table(alpha_rows, [("cap", "capacity"), *((x, x) for x in LAYOUTS)]),
    ]
    small_cap = capacities[0]
    tl, inf = (
        runs.get(("two_level", "marconi", small_cap, "")),
        runs.get(("inflate", "marconi", small_cap, "")),
    )
    if tl is not None and inf is not None:
        # what two_level's pages cost in bytes, and what those bytes are worth on inflate
        t, i = tl.breakdown_mean(), inf.breakdown_mean()
        lost = sum(t[k] - i[k] for k in ("owned_empty", "padding", "unusable"))
        shrunk = run_hybridkv("inflate", int(small_cap - lost), "marconi", n=n)
        lines += [
            "",
            f"What two_level's large pages cost at {small_cap / 1e9:g} GB: owned but empty, "
            f"padding and unusable bytes exceed inflate's by {lost / 1e9:.3f} GB on average; "
            f"inflate + marconi given {(small_cap - lost) / 1e9:.3f} GB reaches "
            f"{100 * shrunk.token_hit_rate:.1f}% (two_level: {100 * tl.token_hit_rate:.1f}%, "
            f"inflate at {small_cap / 1e9:g} GB: {100 * inf.token_hit_rate:.1f}%).",
        ]
    if misfits:
        lines += ["", "Not run (`-` above): " + "; ".join(misfits)]
    if over:
        lines += ["", over]
    if split_rows:
        lines += [
            "",
            "Against the peer's Marconi, request by request (points of hit rate): lost on "
            "requests within 16 tokens of the peer's hit (a state sits on a hash boundary; "
            "the peer's at the exact token), lost on the rest (a prefix no longer cached), "
            "won:",
            "",
            data.markdown_table(
                split_rows,
                [
                    ("cap", "capacity"),
                    ("layout", "layout"),
                    ("small", "lost, within 16 tokens"),
                    ("big", "lost, prefix evicted"),
                    ("won", "won"),
                ],
            ),
        ]
    md = ctx.table("marconi_gap", "\n".join(lines))
    return [png, md]


def _summary(rows: list[dict], have_peer: bool) -> str:
    """The comparison in words, from the table's numbers."""
    if not have_peer:
        best = max(
            float(r[f"{x}+marconi"]) for r in rows for x in LAYOUTS if r[f"{x}+marconi"] != "-"
        )
        return f"hybridkv's marconi policy reaches up to {best:.1f}% (peer not measured here)."
    parts = []
    for r in rows:
        ref = float(r["marconi"])
        gaps = ", ".join(
            f"{x} {float(r[f'{x}+marconi']) - ref:+.1f}"
            for x in ("inflate", "two_level")
            if r[f"{x}+marconi"] != "-"
        )
        parts.append(f"{r['cap']}: Marconi {ref:.1f}%, hybridkv {gaps} points")
    return "hybridkv marconi against Marconi's simulator at equal bytes: " + "; ".join(parts) + "."
