"""``hybridkv`` command line: the model zoo, one memory plan, or all layouts side by side."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from . import models
from .layouts import LAYOUTS, make_plan
from .models.model import HybridModel
from .plan import MemoryPlan
from .units import format_bytes

DEFAULT_MODEL = "qwen3-next-80b-a3b"
DEFAULT_MEMORY = "40GiB"


def _table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A plain-text table; ``columns`` are (key, header)."""
    cells = [[h for _, h in columns]] + [[str(r[k]) for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if n else c.ljust(w) for c, w in zip(row, widths)))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _load_model(args: argparse.Namespace) -> HybridModel:
    options = dict(
        tp_size=args.tp,
        kv_dtype=args.kv_dtype,
        conv_dtype=args.conv_dtype,
        ssm_dtype=args.ssm_dtype,
        num_spec_tokens=args.num_spec_tokens,
    )
    path = Path(args.model)
    if path.suffix == ".json" or path.is_dir():
        return models.from_hf_config(path, **options)
    return models.load(args.model, **options)


def _plan(model: HybridModel, layout: str, args: argparse.Namespace) -> MemoryPlan:
    pack: int | str = args.pack_size
    if isinstance(pack, str) and pack != "auto":
        try:
            pack = int(pack)
        except ValueError:
            raise ValueError(f"--pack-size must be an integer or 'auto', got {pack!r}") from None
    return make_plan(
        model,
        layout,
        memory=args.gpu_memory,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        pack_size=pack,
        state_slots_per_seq=args.state_slots_per_seq,
        cache_state_slots=args.cache_state_slots,
    )


def cmd_models(args: argparse.Namespace) -> int:
    rows = []
    for name in models.list_models():
        m = models.load(name)
        rows.append(
            {
                "name": name,
                "layers": m.num_hidden_layers,
                "mixers": ", ".join(f"{n} {k}" for k, n in m.layer_kinds.items()),
                "kv_per_token": format_bytes(m.kv_bytes_per_token),
                "state_per_seq": format_bytes(m.state_bytes_per_seq),
                "verified": "yes" if m.verified else "no",
                "hf_repo": m.hf_repo,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = [
        ("name", "model"),
        ("layers", "layers"),
        ("mixers", "cache layers"),
        ("kv_per_token", "KV/token (TP1)"),
        ("state_per_seq", "state/request (TP1)"),
        ("verified", "verified"),
    ]
    print(_table(rows, cols))
    print(f"\n{len(rows)} models; `hybridkv plan --model NAME` plans one of them.")
    return 0


def _describe(plan: MemoryPlan, model: HybridModel) -> str:
    cap = plan.capacity
    lines = [
        f"{plan.model_name}  layout={plan.layout}"
        + (f"({plan.pack_size})" if plan.layout == "pack" else "")
        + f"  TP={plan.tp_size}  kv_dtype={plan.kv_dtype}  "
        f"memory={format_bytes(plan.config.memory_bytes)}  "
        f"max_num_seqs={plan.config.max_num_seqs}",
        f"block size        {plan.block_size} tokens (kernel alignment {plan.kernel_alignment})",
        f"token capacity    {cap.token_capacity:,} tokens "
        f"({100 * cap.fraction_of_ideal:.2f}% of the ideal {cap.ideal_token_capacity:,})",
        f"padding           {format_bytes(cap.padding_bytes)}; "
        f"unusable {format_bytes(cap.unusable_bytes)}",
        f"states            {format_bytes(cap.state_bytes)} of real state in "
        f"{format_bytes(cap.state_reserved_bytes)} reserved",
        "",
        "pools:",
    ]
    for p in plan.pools:
        lines.append(
            f"  {p.name:<10} {p.kind:<10} {p.num_blocks:>9,} units x {format_bytes(p.block_bytes)}"
            f"  tensors={','.join(p.tensors) if len(p.tensors) <= 4 else len(p.tensors)}"
        )
    lines.append("groups:")
    for g in plan.groups:
        layers = ", ".join(g.layers[:4]) + (
            f", ... ({len(g.layers)})" if len(g.layers) > 4 else ""
        )
        pad = f" +{g.padding_slots} padding" if g.padding_slots else ""
        lines.append(
            f"  {g.group_id:>3} {g.kind:<15} page {format_bytes(g.page_bytes):>11}  "
            f"[{layers}]{pad}"
        )
    lines.append("first placements (bytes):")
    for kv in plan.kv_placements[:3]:
        lines.append(
            f"  {kv.layer:<18} {kv.tensor:<10} K@{kv.k_offset} V@{kv.v_offset} "
            f"block_stride={kv.block_stride} token_stride={kv.token_stride} "
            f"head_stride={kv.head_stride}"
        )
    for st in plan.state_placements[:2]:
        comps = " ".join(f"{c.name}{list(c.shape)}:{c.dtype}@{c.offset}" for c in st.components)
        lines.append(
            f"  {st.layer:<18} {st.tensor:<10} slot_stride={st.slot_stride} "
            f"offset={st.offset} {comps}"
        )
    if plan.notes:
        lines.append("notes:")
        lines.extend(f"  - {n}" for n in plan.notes)
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    model = _load_model(args)
    plan = _plan(model, args.layout, args)
    if args.json:
        print(plan.to_json(indent=2))
    else:
        print(_describe(plan, model))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    model = _load_model(args)
    rows = []
    for layout in LAYOUTS:
        plan = _plan(model, layout, args)
        row = plan.summary_row()
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        row["token_capacity"] = f"{row['token_capacity']:,}"
        row["pct_of_ideal"] = f"{row['pct_of_ideal']:.2f}%"
        row["padding"] = format_bytes(row["padding_bytes"])
        row["unusable"] = format_bytes(row["unusable_bytes"])
    ideal = _plan(model, "per_group", args).capacity.ideal_token_capacity
    print(
        f"{model.name}  TP={model.tp_size}  kv={model.kv_dtype}  state={model.conv_dtype}/"
        f"{model.ssm_dtype}  memory={args.gpu_memory}  max_num_seqs={args.max_num_seqs}  "
        f"ideal capacity {ideal:,} tokens"
    )
    print(
        _table(
            rows,
            [
                ("layout", "layout"),
                ("block_size", "block"),
                ("token_capacity", "token capacity"),
                ("pct_of_ideal", "% of ideal"),
                ("padding", "padding"),
                ("unusable", "unusable"),
                ("groups", "groups"),
                ("tensors", "tensors"),
            ],
        )
    )
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    from . import traces
    from .advise import advise

    model = _load_model(args)
    path = Path(args.trace)
    if path.suffix == ".jsonl":
        trace = traces.load_jsonl(path)
    else:
        trace = traces.generate(args.trace, args.requests, seed=args.seed)
    rows = advise(
        model,
        trace,
        memory=args.gpu_memory,
        max_num_seqs=args.max_num_seqs,
        progress=args.progress,
    )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{model.name}  memory={args.gpu_memory}  trace={args.trace} ({len(trace)} requests)")
    good = [r for r in rows if "error" not in r]
    cols = [
        ("config", "configuration"),
        ("block_size", "block"),
        ("capacity_pct", "capacity %"),
        ("hit_rate", "hit rate"),
        ("ttft_p50_ms", "TTFT p50 ms"),
        ("ttft_p90_ms", "TTFT p90 ms"),
        ("throughput_tok_s", "tok/s"),
        ("preemptions", "preempt"),
    ]
    print(_table(good, cols))
    for r in rows:
        if "error" in r:
            print(f"  {r['config']}: {r['error']}")
    if good:
        print(f"\nrecommended: {good[0]['config']} (lowest median TTFT on this workload)")
    return 0


def _add_plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="zoo name or path to a config.json")
    p.add_argument(
        "--gpu-memory",
        default=DEFAULT_MEMORY,
        help="bytes for the cache on each rank, e.g. 40GiB (default %(default)s)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--kv-dtype", default="auto", help="KV cache dtype: auto, bfloat16, fp8, ...")
    p.add_argument("--conv-dtype", default="auto", help="conv-state dtype (mamba_cache_dtype)")
    p.add_argument("--ssm-dtype", default="auto", help="SSM-state dtype (mamba_ssm_cache_dtype)")
    p.add_argument("--num-spec-tokens", type=int, default=0, help="speculative tokens")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--block-size", type=int, default=None, help="requested attention block size")
    p.add_argument("--pack-size", default="auto", help="layers per page for --layout pack")
    p.add_argument(
        "--state-slots-per-seq",
        type=int,
        default=1,
        help="state pages per running request (2 for vLLM's align prefix caching)",
    )
    p.add_argument(
        "--cache-state-slots", type=int, default=0, help="extra state slots for checkpoints"
    )
    p.add_argument("--json", action="store_true", help="print JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridkv",
        description="Memory layouts for the KV cache and recurrent state of hybrid LLMs.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("models", help="list the model zoo")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)
    p = sub.add_parser("plan", help="one memory plan")
    _add_plan_options(p)
    p.add_argument("--layout", default="inflate", choices=LAYOUTS)
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("compare", help="all layouts side by side")
    _add_plan_options(p)
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("advise", help="simulate a workload under each layout and recommend one")
    _add_plan_options(p)
    p.add_argument(
        "--trace",
        default="multi_turn_chat",
        help="a workload name (multi_turn_chat, shared_prefix, agentic, no_sharing) or a .jsonl",
    )
    p.add_argument("--requests", type=int, default=200, help="requests of a generated workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", action="store_true")
    p.set_defaults(func=cmd_advise, max_num_seqs=64)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, KeyError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"hybridkv: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
