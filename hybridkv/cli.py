"""``hybridkv`` command line: the model zoo, one memory plan, or all layouts side by side."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from . import __version__, models
from .alloc import AllocatorOptions, ConfigError
from .alloc.policies import policy_class
from .costmodel import H100_SXM, H200, param_count
from .executors import ExecutorUnavailable, add_executor_arguments, executor_options
from .layouts import LAYOUTS, PlanTooSmall, make_plan
from .models.model import HybridModel
from .plan import MemoryPlan
from .target import CACHE_FORMATS, GPU_FAMILIES, INDEXER_KV_DTYPES, VLLM_VERSIONS, VllmTarget
from .units import decimal_unit_note, format_bytes, parse_bytes

DEFAULT_MODEL = "qwen3-next-80b-a3b"
#: version of every command's ``--json`` object (README, "JSON output"); bumped when a key
#: changes meaning or goes away
JSON_SCHEMA = 1
DEFAULT_MEMORY = "40GiB"
#: ``--gpu`` presets: (the memory the device reports, in bytes; the GPU family whose backends
#: decide vLLM's kernel alignments). vLLM sizes ``--gpu-memory-utilization`` against the total
#: that ``torch.cuda.mem_get_info()`` reports, which is less than the datasheet's GB; how each
#: figure was obtained is in ``GPU_MEMORY_SOURCES``. ``--gpu-total-memory`` overrides it.
GPU_PRESETS: dict[str, tuple[int, str]] = {
    "h100": (H100_SXM.memory_bytes, "hopper"),
    "h200": (H200.memory_bytes, "hopper"),
    "h20": (96 * 10**9, "hopper"),
    "a100-80gb": (80 * 10**9, "ampere"),
    "a100-40gb": (40 * 10**9, "ampere"),
    "l40s": (48 * 10**9, "ampere"),
}
#: where each preset's bytes come from ("measured": read on such a device; else not measured)
GPU_MEMORY_SOURCES: dict[str, str] = {
    "h100": "measured: nvidia-smi's total on an H100 80GB HBM3 (81,559 MiB); torch reports a "
    "little less, not measured here",
    "h200": "measured: torch.cuda.get_device_properties(0).total_memory on the H200 of the GPU "
    "suite runs, 2026-11-26 (139.80 GiB)",
    "h20": "not measured: datasheet 96 GB",
    "a100-80gb": "not measured: datasheet 80 GB",
    "a100-40gb": "not measured: datasheet 40 GB",
    "l40s": "not measured: datasheet 48 GB",
}


def _print_json(command: str, payload: dict) -> None:
    """Every ``--json`` object: the schema version and the command first, then the payload
    (numbers stay numbers; rates and capacities are fractions)."""
    print(json.dumps({"schema": JSON_SCHEMA, "command": command, **payload}, indent=2))


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


def _runtime(args: argparse.Namespace) -> dict:
    """The model's runtime options as the flags set them (``HybridModel.configure``'s names)."""
    method, tokens = _speculative(args)
    return dict(
        tp_size=args.tp if args.tp is not None else 1,
        kv_dtype=args.kv_dtype or "auto",
        conv_dtype=args.conv_dtype or "auto",
        ssm_dtype=args.ssm_dtype or "auto",
        num_spec_tokens=tokens,
        speculative_method=method,
        kv_dtype_skip_layers=tuple(args.kv_dtype_skip_layers or ()),
        dcp_size=args.dcp,
        cp_kv_cache_interleave_size=args.cp_interleave,
    )


#: vLLM 0.33 ``--speculative-config`` methods (``vllm/config/speculative.py``): the model's own
#: MTP layers (``mtp``, or a per-model name vLLM replaces with it: ``MTPModelTypes``), or a
#: drafter that keeps no KV cache
_MTP_METHODS = (
    "mtp", "deepseek_mtp", "dots3_note_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp",
    "glm4_moe_lite_mtp", "glm_ocr_mtp", "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp",
    "exaone4_5_mtp", "qwen3_next_mtp", "qwen4_exp_mtp", "qwen3_5_mtp", "longcat_flash_mtp",
    "bailing_hybrid_v3_mtp", "minimax_m3_mtp", "bailing_hybrid_mtp", "kimi_k3_mtp",
    "pangu_ultra_moe_mtp", "step3p5_mtp", "step5_mtp", "hy_v3_mtp", "hy_v4_mtp", "gemma4_mtp",
    "inkling_mtp", "glm5_next_mtp",
)  # fmt: skip
_CACHELESS_METHODS = ("ngram", "ngram_gpu", "suffix")


#: ``--speculative-config`` keys that change what MTP does to prefix hits (vLLM's switches of
#: the same names: :class:`~hybridkv.target.VllmTarget`)
_HIT_SWITCHES = ("disable_eagle_block_drop", "disable_lookahead_block_hashes")


def _speculative_json(args: argparse.Namespace) -> dict[str, object] | None:
    """``--speculative-config`` as a dict of the keys hybridkv reads (None when not given)."""
    given = getattr(args, "speculative_config", None)
    if given is None:
        return None
    try:
        config = json.loads(given)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON ({exc}): {given!r}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {given!r}")
    unknown = sorted(set(config) - {"method", "num_speculative_tokens", *_HIT_SWITCHES})
    if unknown:
        raise ValueError(
            f"--speculative-config: {', '.join(unknown)} would not change the cache plan and "
            "are not read; give method and num_speculative_tokens (and "
            f"{' or '.join(_HIT_SWITCHES)}, which change prefix hits)"
        )
    for key in _HIT_SWITCHES:
        if not isinstance(config.get(key, False), bool):
            raise ValueError(
                f"--speculative-config {key} must be true or false, got {config[key]!r}"
            )
    return config


def _speculative(args: argparse.Namespace) -> tuple[str, int]:
    """(``speculative_method``, ``num_spec_tokens``) from ``--speculative-config`` (vLLM's JSON:
    ``method`` and ``num_speculative_tokens``) and ``--num-speculative-tokens``."""
    flag = args.num_spec_tokens
    config = _speculative_json(args)
    if config is None:
        return "none", flag or 0
    method, tokens = config.get("method"), config.get("num_speculative_tokens")
    if method not in (*_MTP_METHODS, *_CACHELESS_METHODS):
        raise ValueError(
            f"--speculative-config method {method!r}: modelled are mtp (or a model's *_mtp "
            "name: the model's MTP layers draft, their KV caches join the model's) and "
            f"{', '.join(_CACHELESS_METHODS)} (no drafter cache); an EAGLE or draft model's "
            "own caches are not modelled"
        )
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(
            "--speculative-config needs num_speculative_tokens, a positive integer (the plan "
            f"depends on it), got {tokens!r}"
        )
    if flag is not None and flag != tokens:
        raise ValueError(
            f"--num-speculative-tokens {flag} and --speculative-config's num_speculative_tokens "
            f"{tokens} disagree; give one"
        )
    return ("mtp" if method in _MTP_METHODS else "none"), tokens


def _note_mtp_hits(model: HybridModel, args: argparse.Namespace) -> None:
    """Under MTP, say what vLLM does to prefix hits and whether the predictions model it (the
    doctor says it as a finding)."""
    if model.speculative_method == "mtp":
        hit_rule = _target(args).resolve(model).mtp_hit_rule()
        if hit_rule:
            print(f"hybridkv: note: MTP: {hit_rule}", file=sys.stderr)


def _is_config_path(model: str) -> bool:
    """A config file under any name (config.json, my-model.cfg) or a folder holding one."""
    path = Path(model)
    return path.suffix == ".json" or path.is_dir() or path.is_file()


def _load_model(args: argparse.Namespace) -> HybridModel:
    options = _runtime(args)
    path = Path(args.model)
    if _is_config_path(args.model):
        model = models.from_hf_config(path, **options)
        if model.doubts:  # what the reader had to assume (e.g. bf16 weights): say it
            print(f"hybridkv: note: {model.name}: {model.doubts}", file=sys.stderr)
        return model
    return models.load(args.model, **options)


def _plan(
    model: HybridModel, layout: str, args: argparse.Namespace, state_slots_per_seq: int = 1
) -> MemoryPlan:
    """``args``' plan in ``layout``; ``state_slots_per_seq`` is used where the flag is unset (the
    checkpoint policy's own count in simulate, 1 in plan and compare)."""
    pack: int | str = args.pack_size
    if isinstance(pack, str) and pack != "auto":
        try:
            pack = int(pack)
        except ValueError:
            raise ValueError(f"--pack-size must be an integer or 'auto', got {pack!r}") from None
    return make_plan(
        model,
        layout,
        memory=_cache_memory(args),
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        pack_size=pack,
        state_slots_per_seq=(
            state_slots_per_seq if args.state_slots_per_seq is None else args.state_slots_per_seq
        ),
        cache_state_slots=args.cache_state_slots,
        target=_target(args),
    )


def _target(args: argparse.Namespace) -> VllmTarget:
    """The vLLM the plan follows, from vLLM's own flags."""
    gpu = args.gpu or "h100"
    family = GPU_PRESETS[gpu][1] if gpu in GPU_PRESETS else gpu
    return VllmTarget(
        version=args.vllm_version,
        enable_prefix_caching=args.enable_prefix_caching,
        mamba_cache_mode=args.mamba_cache_mode,
        gpu=family,
        gdn_prefill_backend=args.gdn_prefill_backend,
        max_model_len=args.max_model_len,
        cache_formats=_cache_formats(args),
        indexer_kv_dtype=getattr(args, "indexer_kv_dtype", None) or "auto",
        **{
            key: value
            for key, value in (_speculative_json(args) or {}).items()
            if key in _HIT_SWITCHES
        },
    )


def _add_cache_formats(p: argparse.ArgumentParser, more: str) -> None:
    """``--cache-formats``, of ``plan`` and ``simulate`` (``more``: the end of its help)."""
    p.add_argument(
        "--cache-formats",
        choices=CACHE_FORMATS,
        default=None,
        help="where vLLM keeps a cache in another format than transformers (GLM-5-Next's "
        "and Qwen4-Exp's indexers; K and V side by side per token in an attention page): "
        "plan transformers' (default) or vLLM's, which inflate packs as vLLM 0.33 does"
        f"{more}",
    )


def _cache_formats(args: argparse.Namespace) -> str:
    """``plan --cache-formats``; ``--format vllm`` prints vLLM's layout, so it plans vLLM's
    formats unless told otherwise (the same capacity, but for GLM-5-Next's and Qwen4-Exp's
    indexers)."""
    chosen = getattr(args, "cache_formats", None)
    if chosen is not None:
        return chosen
    return "vllm" if getattr(args, "format", None) == "vllm" else "transformers"


def _cache_memory(args: argparse.Namespace) -> int:
    """Bytes for the cache on each rank: ``--gpu-memory`` itself, or vLLM's
    ``--gpu-memory-utilization`` x the GPU's memory less what the model takes before the cache."""
    util = args.gpu_memory_utilization
    for flag, value in (
        ("--gpu-memory", args.gpu_memory),
        ("--gpu-total-memory", args.gpu_total_memory),
        ("--model-memory", args.model_memory),
    ):
        if value is not None and (note := decimal_unit_note(value)):
            print(f"hybridkv: note: {flag} {note}", file=sys.stderr)
    if util is None:
        unused = [
            flag
            for flag, value in (
                ("--model-memory", args.model_memory),
                ("--gpu-total-memory", args.gpu_total_memory),
            )
            if value is not None
        ]
        if unused:
            raise ValueError(
                f"{' and '.join(unused)}: used only with --gpu-memory-utilization (the cache is "
                "then utilization x GPU memory - model memory); add it, or give the cache's "
                "bytes with --gpu-memory alone"
            )
        return parse_bytes(args.gpu_memory or DEFAULT_MEMORY)
    if args.gpu_memory is not None:
        raise ValueError(
            "--gpu-memory (bytes for the cache) and --gpu-memory-utilization (a fraction of the "
            "GPU) both set the cache budget; give one of them"
        )
    if not 0 < util <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {util}")
    if args.gpu_total_memory is not None:
        total = parse_bytes(args.gpu_total_memory)
    elif args.gpu in GPU_PRESETS:
        total = GPU_PRESETS[args.gpu][0]
        print(
            f"hybridkv: note: --gpu {args.gpu}: {total:,} B of GPU memory "
            f"({GPU_MEMORY_SOURCES[args.gpu]}); --gpu-total-memory overrides it",
            file=sys.stderr,
        )
    else:
        raise ValueError(
            "--gpu-memory-utilization needs the GPU's memory: --gpu with one of "
            f"{', '.join(GPU_PRESETS)}, or --gpu-total-memory (e.g. 80GB)"
        )
    model_bytes = parse_bytes(args.model_memory) if args.model_memory else 0
    cache = int(util * total) - model_bytes
    if cache <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {util} x {format_bytes(total)} leaves nothing for the "
            f"cache after --model-memory {format_bytes(model_bytes)}; raise the utilization or "
            "lower --model-memory"
        )
    return cache


def cmd_models(args: argparse.Namespace) -> int:
    rows = []
    for name in models.list_models():
        m = models.load(name)
        rows.append(
            {
                "name": name,
                "layers": m.num_hidden_layers,
                "mixers": dict(m.layer_kinds),
                "kv_bytes_per_token": m.kv_bytes_per_token,
                "state_bytes_per_seq": m.state_bytes_per_seq,
                "verified": m.verified,
                "hf_repo": m.hf_repo,
            }
        )
    if args.json:  # numbers stay numbers (bytes, TP 1, the model's own dtypes)
        _print_json("models", {"models": rows})
        return 0
    for row in rows:
        row["kv_per_token"] = format_bytes(row["kv_bytes_per_token"])
        row["state_per_seq"] = format_bytes(row["state_bytes_per_seq"])
        row["mixers"] = ", ".join(f"{n} {k}" for k, n in row["mixers"].items())
        row["verified"] = "yes" if row["verified"] else "no"
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


def _describe(plan: MemoryPlan) -> str:
    cap = plan.capacity
    lines = [
        f"{plan.model_name}  layout={plan.layout}"
        + (f"({plan.pack_size})" if plan.layout == "pack" else "")
        + f"  TP={plan.tp_size}"
        + (f"  DCP={plan.dcp_size}" if plan.dcp_size > 1 else "")
        + f"  kv_dtype={plan.kv_dtype}  "
        f"memory={format_bytes(plan.config.memory_bytes)}  "
        f"max_num_seqs={plan.config.max_num_seqs}",
        f"block size        {plan.block_size} tokens (kernel alignment {plan.kernel_alignment})",
        f"  rule            {plan.block_size_rule}",
        *(
            [
                f"vLLM target       {plan.vllm.target.version} on {plan.vllm.target.gpu}: "
                f"prefix caching {'on' if plan.vllm.enable_prefix_caching else 'off'}, "
                f"mamba_cache_mode={plan.vllm.mamba_cache_mode}, "
                f"{plan.vllm.state_blocks_per_request} state block(s) per request in vLLM"
            ]
            if plan.vllm is not None
            else []
        ),
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
        # groups' own block sizes (per-group layouts, unified pages under skip layers)
        block = f"  block {g.block_size}" if g.block_size != plan.block_size else ""
        if g.dcp_size > 1:  # DCP: the block's tokens over dcp ranks, one rank's page its rows
            block += f" ({g.rows_per_block} a rank, dcp {g.dcp_size})"
        lines.append(
            f"  {g.group_id:>3} {g.kind:<15} page {format_bytes(g.page_bytes):>11}{block}  "
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


def _check_pack_size(args: argparse.Namespace) -> None:
    if str(args.pack_size) != "auto" and args.layout != "pack":
        raise ValueError(
            f"--pack-size {args.pack_size} applies to --layout pack only, not {args.layout!r}; "
            "drop it or use --layout pack"
        )


def cmd_plan(args: argparse.Namespace) -> int:
    if args.json and args.format == "vllm":
        raise ValueError(
            "--json prints hybridkv's plan and --format vllm vLLM's KVCacheConfig: pick one"
        )
    _check_pack_size(args)
    model = _load_model(args)
    plan = _plan(model, args.layout, args)
    fmt = "json" if args.json else args.format
    if fmt == "json":
        _print_json("plan", plan.to_dict())
    elif fmt == "vllm":
        from .vllm_export import kv_cache_config

        print(json.dumps(kv_cache_config(plan, model), indent=2))
    else:
        print(_describe(plan))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    model = _load_model(args)
    rows, errors, ideal = [], [], 0
    for layout in LAYOUTS:
        try:
            plan = _plan(model, layout, args)
        except ValueError as exc:  # this layout does not fit, or is refused: say so beside
            fits = not isinstance(exc, PlanTooSmall)  # the others, with which of the two
            errors.append({"layout": layout, "error": str(exc), "too_small": not fits})
            continue
        rows.append(plan.summary_row())
        # the padding-free capacity of this budget: the same whatever the layout
        ideal = plan.capacity.ideal_token_capacity
    if not rows:
        raise ValueError(errors[0]["error"])
    if args.json:
        out = {"config": _run_config(model, args), "layouts": rows, "errors": errors}
        _print_json("compare", out)
        return 0
    for row in rows:
        row["token_capacity"] = f"{row['token_capacity']:,}"
        row["capacity_fraction"] = f"{100 * row['capacity_fraction']:.2f}%"
        row["padding"] = format_bytes(row["padding_bytes"])
        row["unusable"] = format_bytes(row["unusable_bytes"])
    print(
        f"{model.name}  TP={model.tp_size}"
        + (f"  DCP={model.dcp_size}" if model.dcp_size > 1 else "")
        + f"  kv={model.kv_dtype}  state={model.conv_dtype}/"
        f"{model.ssm_dtype}  memory={format_bytes(_cache_memory(args))}  "
        f"max_num_seqs={args.max_num_seqs}  "
        f"ideal capacity {ideal:,} tokens"
    )
    print(
        _table(
            rows,
            [
                ("layout", "layout"),
                ("block_size", "block"),
                ("token_capacity", "token capacity"),
                ("capacity_fraction", "% of ideal"),
                ("padding", "padding"),
                ("unusable", "unusable"),
                ("groups", "groups"),
                ("tensors", "tensors"),
            ],
        )
    )
    for e in errors:
        why = "does not fit" if e["too_small"] else "is not planned"
        print(f"  {e['layout']} {why}: {e['error']}")
    return 0


def _run_config(model: HybridModel, args: argparse.Namespace) -> dict:
    """What a ``--json`` result was computed for."""
    return {
        "model": model.name,
        "tp_size": model.tp_size,
        "dcp_size": model.dcp_size,
        "cp_kv_cache_interleave_size": model.cp_kv_cache_interleave_size,
        "kv_dtype": model.kv_dtype,
        "conv_dtype": model.conv_dtype,
        "ssm_dtype": model.ssm_dtype,
        "num_spec_tokens": model.num_spec_tokens,
        "speculative_method": model.speculative_method,
        "memory_bytes": _cache_memory(args),
        "max_num_seqs": args.max_num_seqs,
        "block_size": args.block_size,
        "vllm_target": _target(args).to_dict(),
        "model_doubts": model.doubts,
    }


#: generated workloads get this many requests unless --requests says otherwise
DEFAULT_REQUESTS = 200


def _load_trace(args: argparse.Namespace):
    """The workload of ``--trace``: ``mooncake`` (the shipped Mooncake trace), a ``.jsonl`` file
    or a generated workload's name, with the trace options applied."""
    from . import traces

    name = args.trace
    path = Path(name)
    if args.requests is not None and args.requests < 1:
        raise ValueError(f"--requests must be at least 1, got {args.requests}")
    if path.is_dir():
        raise ValueError(f"--trace {name!r} is a folder; give a .jsonl file inside it")
    if name == "mooncake" or path.suffix == ".jsonl" or path.is_file():
        options = dict(
            limit=args.requests,
            rate_scale=args.rate_scale,
            shared_length=args.shared_length,
            time_scale=args.time_scale,
            seed=args.seed,
        )
        if name == "mooncake":
            return traces.load_mooncake(**options)
        return traces.load_jsonl(path, **options)
    if name not in traces.WORKLOADS:
        raise ValueError(
            f"--trace {name!r} is neither a workload ({', '.join(traces.WORKLOADS)}), "
            "'mooncake' (the Mooncake trace shipped with hybridkv) nor an existing .jsonl file"
        )
    given = [
        flag
        for flag, value, default in (
            ("--time-scale", args.time_scale, None),
            ("--rate-scale", args.rate_scale, 1.0),
            ("--shared-length", args.shared_length, "blocks"),
        )
        if value != default
    ]
    if given:
        raise ValueError(
            f"{', '.join(given)} {'apply' if len(given) > 1 else 'applies'} to trace files "
            "(--trace mooncake or a .jsonl), not to "
            f"the generated workload {name!r}"
        )
    return traces.generate(name, args.requests or DEFAULT_REQUESTS, seed=args.seed)


def _trace_info(trace) -> dict:
    """What a replay's trace was and how it was read (for text and ``--json``)."""
    p = trace.params
    arrivals = trace.arrivals()
    info = {
        "name": trace.name,
        "requests": len(trace),
        "duration_s": round(float(arrivals[-1] - arrivals[0]), 3) if len(trace) else 0.0,
        "prompt_tokens": int(trace.prompt_lengths().sum()),
    }
    for key in ("time_scale", "time_unit", "rate_scale", "shared_length", "generator", "seed"):
        if key in p:
            info[key] = p[key]
    return info


def _trace_line(info: dict) -> str:
    line = (
        f"trace {info['name']}: {info['requests']:,} requests over "
        f"{info['duration_s'] / 60:.1f} min, {info['prompt_tokens']:,} prompt tokens"
    )
    if "time_unit" in info:
        line += (
            f"; timestamps in {info['time_unit']}, arrivals / {info['rate_scale']:g} "
            f"(--rate-scale); shared length read as {info['shared_length']!r} "
            "(--shared-length)"
        )
    return line


def _add_trace_options(p: argparse.ArgumentParser, default: str) -> None:
    g = p.add_argument_group("workload")
    g.add_argument(
        "--trace",
        default=default,
        help="'mooncake' (Mooncake's synthetic trace, shipped), a .jsonl trace, or a generated "
        "workload: multi_turn_chat, shared_prefix, agentic, no_sharing (default %(default)s)",
    )
    g.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"trace files: read only the first N requests; generated workloads: N requests "
        f"(default {DEFAULT_REQUESTS})",
    )
    g.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="seconds per timestamp unit of a trace file (default: ms for Mooncake's format, "
        "else s)",
    )
    g.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="load factor for a trace file: arrival times are divided by it (0.05 replays one "
        "GPU's share of a 20-GPU cluster trace)",
    )
    g.add_argument(
        "--shared-length",
        choices=("blocks", "continuation"),
        default="blocks",
        help="how far a prompt of a block-hashed trace shares an earlier one: exactly the "
        "shared hash blocks, or (continuation) all of an earlier prompt it extends, as a chat's "
        "next turn",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of a generated workload")


#: the allocator's options (:class:`~hybridkv.alloc.AllocatorOptions` names) ``simulate`` has
#: flags for, and each flag's argparse ``dest`` (the flag is ``--`` + it, dashed)
ALLOCATOR_FLAGS: dict[str, str] = {
    "checkpoint_policy": "policy",
    "checkpoint_interval": "checkpoint_interval",
    "hash_block_size": "hash_block_size",
    "eviction": "eviction",
    "partial_hit_points": "partial_hit_points",
    "marconi_alpha": "marconi_alpha",
}


def _marconi_alpha(value: str) -> float | str:
    """``--marconi-alpha``: ``auto`` or a number (its range is the options' to check)."""
    if value == "auto":
        return value
    try:
        return float(value)
    except ValueError:
        message = f"must be 'auto' or a number >= 0, got {value!r}"
        raise argparse.ArgumentTypeError(message) from None


def _allocator_options(
    args: argparse.Namespace, plan: MemoryPlan, base: AllocatorOptions
) -> AllocatorOptions:
    """``base`` with what the flags of :data:`ALLOCATOR_FLAGS` set (the hash unit defaults to
    ``min(16, block size)``), checked against ``plan``. A bad value is a ``ValueError`` that
    names the flag and value given, then what is wrong and what would fix it."""
    values = {name: getattr(args, dest) for name, dest in ALLOCATOR_FLAGS.items()}
    if values["hash_block_size"] is None:  # 0 or less is the options' error, not the default
        values["hash_block_size"] = min(16, plan.block_size)
    try:
        options = base.replace(**values)
        options.for_plan(plan)  # the checks that need the plan (the hash unit divides blocks)
    except ConfigError as exc:
        given = [
            f"--{dest.replace('_', '-')} {getattr(args, dest)}"
            for name, dest in ALLOCATOR_FLAGS.items()
            if name in str(exc) and getattr(args, dest) is not None
        ]
        raise ValueError(f"{', '.join(given)}: {exc}" if given else str(exc)) from None
    return options


def cmd_simulate(args: argparse.Namespace) -> int:
    from . import traces
    from .sim import SimConfig, simulate

    _check_pack_size(args)
    model = _load_model(args)
    _note_mtp_hits(model, args)
    trace = _load_trace(args)
    # the slots a running request holds are the policy's to say (align keeps two), as in advise
    plan = _plan(model, args.layout, args, policy_class(args.policy).state_slots_per_request)
    config = SimConfig(allocator=_allocator_options(args, plan, SimConfig().allocator))
    unit = config.allocator.hash_block_size
    try:
        result = simulate(plan, model, trace, config, progress=_show_progress(args))
    except RuntimeError as exc:  # a plan too small for the trace: the simulator says why
        raise ValueError(str(exc)) from None
    total = max(1, int(trace.prompt_lengths().sum()))
    capacity = plan.capacity.ideal_token_capacity
    bounds = {
        "attention_only_unlimited": round(traces.hit_fraction(trace, unit), 4),
        "attention_only_same_memory": round(
            int(traces.lru_cache_hits(trace, unit, capacity).sum()) / total, 4
        ),
        "same_memory_tokens": capacity,
    }
    info = _trace_info(trace)
    summary = result.summary()
    params = param_count(model)  # what the roofline priced the steps with (cached)
    if args.json:
        config_info = _run_config(model, args)
        config_info.update(
            params=params.to_dict(),
            layout=args.layout,
            plan_block_size=plan.block_size,
            policy=args.policy,
            checkpoint_interval=args.checkpoint_interval,
            eviction=config.allocator.resolved_eviction(),
            hash_block_size=unit,
            partial_hit_points=config.allocator.resolved_partial_hit_points(),
            marconi_alpha=config.allocator.marconi_alpha,
        )
        summary.update(result.alpha_summary())
        # the plan's capacity, in plan's and advise's names (README, "JSON output")
        summary.update(
            token_capacity=plan.capacity.token_capacity,
            capacity_fraction=round(plan.capacity.fraction_of_ideal, 4),
        )
        out = {"config": config_info, "trace": info, "result": summary, "bounds": bounds}
        _print_json("simulate", out)
        return 0
    print(_trace_line(info))
    interval = f" every {args.checkpoint_interval}" if args.checkpoint_interval else ""
    print(
        f"{model.name}  {args.layout} (block {plan.block_size})  policy {args.policy}{interval}"
        f", {config.allocator.resolved_eviction()} eviction"
        f"  memory={format_bytes(_cache_memory(args))}  max_num_seqs={args.max_num_seqs}  "
        f"hash unit {unit}"
    )
    print(
        f"parameters (the roofline's): {params.total / 1e9:,.1f}B total, "
        f"{params.active / 1e9:,.2f}B active ({params.source})"
    )
    print(
        f"hit rate {100 * summary['token_hit_rate']:.1f}% of prompt tokens; attention-only "
        f"with unlimited memory {100 * bounds['attention_only_unlimited']:.1f}%, with the same "
        f"memory (LRU, {capacity:,} tokens) {100 * bounds['attention_only_same_memory']:.1f}%"
    )
    print(
        f"TTFT p50 {summary['ttft_p50_ms']:,.0f} ms, p90 {summary['ttft_p90_ms']:,.0f} ms; "
        f"{summary['throughput_tok_s']:,.0f} output tok/s; {summary['preemptions']} preemptions;"
        f" {summary['finished']:,} finished"
    )
    print(
        f"state checkpoints {summary['checkpoints']:,} ({summary['checkpoint_gib']:,.1f} GiB "
        f"written); held on average: states {summary['state_gib_mean']:.1f} GiB, KV "
        f"{summary['kv_gib_mean']:.1f} GiB"
    )
    alpha_line = _alpha_line(result.alpha_summary())
    if alpha_line:
        print(alpha_line)
    if "reachable_gib_mean" in summary:
        print(
            f"pool on average (memory_breakdown): cached and reachable "
            f"{summary['reachable_gib_mean']:.2f} GiB, cached but unreachable "
            f"{summary['unreachable_gib_mean']:.2f} GiB, owned but empty "
            f"{summary['owned_empty_gib_mean']:.2f} GiB, free {summary['free_gib_mean']:.2f} GiB"
        )
    return 0


def _alpha_line(alpha: dict) -> str | None:
    if not alpha:
        return None
    if not alpha["alpha_tuned_at"]:
        return f"Marconi's alpha {alpha['marconi_alpha']:g} throughout (not tuned in this run)"
    tunings = ", ".join(
        f"{a:g} after {n:,}" for n, a in zip(alpha["alpha_tuned_at"], alpha["alpha_choices"])
    )
    return (
        f"Marconi's alpha tuned online: {tunings} finished requests "
        f"({alpha['alpha_tuning_s']:.1f} s of replays, no simulated time)"
    )


def _show_progress(args: argparse.Namespace) -> bool:
    """A progress bar when asked, or by default when stderr is a terminal."""
    if getattr(args, "progress", None) is not None:
        return bool(args.progress)
    return sys.stderr.isatty()


def cmd_advise(args: argparse.Namespace) -> int:
    from .advise import RANKED_BY, Pins, advise
    from .executors import open_executor

    executor = open_executor(executor_options(args))  # a missing Ray is said before any work
    model = _load_model(args)
    _note_mtp_hits(model, args)
    trace = _load_trace(args)
    pack = args.pack_size
    if pack != "auto":
        try:
            pack = int(pack)
        except ValueError:
            raise ValueError(f"--pack-size must be 'auto' or a number, got {pack!r}") from None
    pins = Pins(
        block_size=args.block_size,
        pack_size=None if pack == "auto" else pack,
        state_slots_per_seq=args.state_slots_per_seq,
        cache_state_slots=args.cache_state_slots,
        policies=tuple(args.policies) if args.policies else None,
    )
    with executor:
        advice = advise(
            model,
            trace,
            memory=_cache_memory(args),
            max_num_seqs=args.max_num_seqs,
            pins=pins,
            target=_target(args),
            progress=_show_progress(args),
            executor=executor,
        )
    if args.json:
        out = {
            "config": _run_config(model, args),
            "trace": _trace_info(trace),
            "ranked_by": list(RANKED_BY),
            "recommended": advice.recommended,
            "ties": advice.ties,
            "results": advice.results,
            "errors": advice.errors,
        }
        _print_json("advise", out)
        return 0 if advice.results else 1
    memory = format_bytes(_cache_memory(args))
    if not advice.results:  # nothing ran: say why for every configuration, and fail
        raise ValueError(_nothing_ran(model, memory, advice.errors, args.max_num_seqs))
    dcp = f"  DCP={model.dcp_size}" if model.dcp_size > 1 else ""
    print(f"{model.name}  TP={model.tp_size}{dcp}  memory={memory}")
    print(_trace_line(_trace_info(trace)))
    good = [
        {
            **r,
            "capacity_fraction": f"{100 * r['capacity_fraction']:.2f}",
            "token_hit_rate": f"{100 * r['token_hit_rate']:.1f}",
        }
        for r in advice.results
    ]
    cols = [
        ("config", "configuration"),
        ("block_size", "block"),
        ("capacity_fraction", "capacity %"),
        ("token_hit_rate", "hit rate %"),
        ("ttft_p50_ms", "TTFT p50 ms"),
        ("ttft_p90_ms", "TTFT p90 ms"),
        ("throughput_tok_s", "tok/s"),
        ("preemptions", "preempt"),
    ]
    print(_table(good, cols))
    if advice.errors:
        print("\nnot run:")
        for r in advice.errors:
            print(f"  {r['config']}: {r['error']}")
    if advice.recommended:
        print(
            f"\nrecommended: {advice.recommended} (lowest median TTFT on this workload, then "
            "throughput, then hit rate)"
        )
    if advice.ties:
        print(
            f"{len(advice.ties)} configurations tie on all three: {', '.join(advice.ties)}; "
            "any of them is as good on this workload"
        )
    return 0


def _nothing_ran(model: HybridModel, memory: str, errors: list[dict], max_num_seqs: int) -> str:
    """advise's error when no configuration ran: the smallest memory one would need, then one
    line per configuration (its need where it did not fit, else its own error)."""
    needs = [e for e in errors if "needed_bytes" in e]
    head = f"no configuration fits {model.name} in {memory} for this workload"
    if needs:
        least = min(needs, key=lambda e: e["needed_bytes"])
        head += (
            f"; the smallest, {least['config']}, needs {format_bytes(least['needed_bytes'])} "
            f"for --max-num-seqs {max_num_seqs}: give the cache that much (--gpu-memory) or "
            "lower --max-num-seqs"
        )
    lines = [
        f"  {e['config']}: needs {format_bytes(e['needed_bytes'])}"
        if "needed_bytes" in e
        else f"  {e['config']}: {e['error']}"
        for e in errors
    ]
    return "\n".join([head + ":", *lines])


def cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import diagnose, prefix_trace

    unused = [
        flag
        for flag, value, default in (
            ("--pack-size", str(args.pack_size), "auto"),
            ("--state-slots-per-seq", args.state_slots_per_seq, None),
            ("--cache-state-slots", args.cache_state_slots, 0),
        )
        if value != default
    ]
    if unused:
        raise ValueError(
            f"{', '.join(unused)}: doctor checks vLLM's own layout, which these do not change"
        )
    stats = (args.prompt_len, args.shared_prefix)
    if args.trace is not None and any(v is not None for v in stats):
        raise ValueError(
            "give the workload as --trace or as --prompt-len/--shared-prefix, not both"
        )
    if (args.prompt_len is None) != (args.shared_prefix is None):
        raise ValueError("--prompt-len and --shared-prefix go together (prompt statistics)")
    trace = None
    if args.trace is not None:
        trace = _load_trace(args)
    elif args.prompt_len is not None:
        trace = prefix_trace(args.prompt_len, args.shared_prefix, args.requests or 64)
    runtime = _runtime(args)
    base = _load_model(args)  # reads the config once, prints its notes once

    def load(**options) -> HybridModel:  # the same model with other runtime options
        if _is_config_path(args.model):
            return models.from_hf_config(Path(args.model), **options)
        return models.load(base.name, **options)

    diagnosis = diagnose(
        load,
        runtime=runtime,
        memory=_cache_memory(args),
        max_num_seqs=args.max_num_seqs,
        target=_target(args),
        block_size=args.block_size,
        trace=trace,
    )
    if args.json:
        _print_json("doctor", diagnosis.to_dict())
    else:
        print(diagnosis.text())
    return 0


def _add_plan_options(p: argparse.ArgumentParser) -> None:
    """Plan options. vLLM's own flag names work too (``-tp``, ``--kv-cache-dtype``, ...)."""
    p.add_argument("--model", default=DEFAULT_MODEL, help="zoo name or path to a config.json")
    mem = p.add_argument_group("memory")
    mem.add_argument(
        "--gpu-memory",
        default=None,
        help=f"bytes for the cache on each rank, e.g. 40GiB (default {DEFAULT_MEMORY})",
    )
    mem.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM's fraction of GPU memory; the cache gets it times the GPU's memory "
        "(--gpu preset or --gpu-total-memory) less --model-memory (default: unset, the cache "
        "is --gpu-memory)",
    )
    mem.add_argument(
        "--gpu-total-memory",
        default=None,
        help="the GPU's memory, e.g. 80GB (default: what the --gpu preset's device reports)",
    )
    mem.add_argument(
        "--model-memory",
        default=None,
        help="bytes per rank vLLM takes before the cache (weights, activation peak, CUDA "
        "graphs); default 0, so the cache is an upper bound",
    )
    par = p.add_argument_group("model runtime (hybridkv names, vLLM names)")
    par.add_argument(
        "--tp",
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        dest="tp",
        help="tensor-parallel size; the plan is one rank's (default 1)",
    )
    par.add_argument(
        "--decode-context-parallel-size",
        "-dcp",
        type=int,
        default=1,
        dest="dcp",
        help="vLLM's decode context parallelism: the TP ranks that shard each attention layer's "
        "tokens instead of replicating its KV; a rank keeps one token in this many and an "
        "attention block spans this many times its page's tokens (default 1)",
    )
    par.add_argument(
        "--cp-kv-cache-interleave-size",
        type=int,
        default=1,
        dest="cp_interleave",
        help="vLLM's DCP interleave: the tokens a rank keeps in a row before the next rank's "
        "turn; moves no byte, but must divide the block's rows and, for GLM-5-Next's "
        "k-pooled indexer, be a multiple of its pool (default 1)",
    )
    par.add_argument(
        "--kv-dtype",
        "--kv-cache-dtype",
        default=None,
        dest="kv_dtype",
        help="KV cache dtype: auto, bfloat16, fp8, ... (default auto: the model's dtype)",
    )
    par.add_argument(
        "--kv-cache-dtype-skip-layers",
        nargs="+",
        default=None,
        dest="kv_dtype_skip_layers",
        metavar="LAYER",
        help="vLLM's flag: decoder layer indices (or sliding_window) whose attention keeps the "
        "model dtype under a quantized --kv-cache-dtype (default none)",
    )
    par.add_argument(
        "--conv-dtype",
        "--mamba-cache-dtype",
        default=None,
        dest="conv_dtype",
        help="conv-state dtype (vLLM's --mamba-cache-dtype; default auto: the model's dtype)",
    )
    par.add_argument(
        "--ssm-dtype",
        "--mamba-ssm-cache-dtype",
        default=None,
        dest="ssm_dtype",
        help="SSM-state dtype (vLLM's --mamba-ssm-cache-dtype; default auto: what the config "
        "declares, else the conv dtype)",
    )
    par.add_argument(
        "--num-spec-tokens",
        "--num-speculative-tokens",
        type=int,
        default=None,
        dest="num_spec_tokens",
        help="speculative tokens per step; they lengthen the conv state (default 0)",
    )
    par.add_argument(
        "--speculative-config",
        default=None,
        help='vLLM\'s JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\': '
        "with mtp the model's MTP layers' KV caches join its own (Qwen3-Next, Qwen3.5/3.6, "
        "Nemotron-H); ngram and suffix keep none. disable_eagle_block_drop and "
        "disable_lookahead_block_hashes (vLLM's switches) change what MTP does to prefix hits "
        "(default: unset, no speculative decoding)",
    )
    tgt = p.add_argument_group("vLLM target (whose rules the shared-pool layouts follow)")
    tgt.add_argument(
        "--vllm-version",
        default=VLLM_VERSIONS[0],
        choices=VLLM_VERSIONS,
        help="vLLM release whose rules apply (default %(default)s)",
    )
    tgt.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's prefix caching (default: vLLM's, on for hybrid models); on puts the "
        "Mamba cache in align mode",
    )
    tgt.add_argument(
        "--mamba-cache-mode",
        choices=("none", "align"),
        default=None,
        help="vLLM's Mamba cache mode (default: align with prefix caching, else none)",
    )
    tgt.add_argument(
        "--gpu",
        default=None,
        choices=(*GPU_PRESETS, *GPU_FAMILIES),
        help="GPU preset or family; decides backends and kernel alignments (default h100)",
    )
    tgt.add_argument(
        "--gdn-prefill-backend",
        choices=("auto", "flashinfer", "triton"),
        default="auto",
        help="vLLM's Gated DeltaNet prefill kernels; FlashInfer's export states every 64 tokens, "
        "which aligns the block to 64 (auto: FlashInfer on Hopper with vLLM 0.33)",
    )
    tgt.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="vLLM's --max-model-len (the Mamba block size without prefix caching; default: "
        "unset, no limit on a request's length)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="requests vLLM runs at once, each holding a state slot (vLLM's flag)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="requested attention block size (advise: the only block size tried; default: "
        "unset, the layout's own rule)",
    )
    p.add_argument(
        "--pack-size",
        default="auto",
        help="layers per page for --layout pack (advise: the only pack size tried)",
    )
    p.add_argument(
        "--state-slots-per-seq",
        type=int,
        default=None,
        help="state pages reserved per running request (default: the checkpoint policy's in "
        "simulate and advise, 2 with align, else 1; 1 in plan and compare)",
    )
    p.add_argument(
        "--cache-state-slots",
        type=int,
        default=0,
        help="extra state slots for cached checkpoints (advise default: max-num-seqs for "
        "per_group, else 0)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")


class _Parser(argparse.ArgumentParser):
    """argparse, with a two-line error instead of the whole usage: what is wrong, and where the
    help is. A value that starts with '-' (``--gpu-memory -1GiB``) reads as a flag to argparse;
    say so."""

    def error(self, message: str) -> NoReturn:
        if "expected one argument" in message:
            message += " (a value starting with '-' must be written --flag=value)"
        self.exit(2, f"{self.prog}: error: {message}\n(see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hybridkv",
        description="Memory layouts for the KV cache and recurrent state of hybrid LLMs.",
    )
    parser.add_argument("--version", action="version", version=f"hybridkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("models", help="list the model zoo")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_models)
    p = sub.add_parser("plan", help="one memory plan")
    _add_plan_options(p)
    p.add_argument("--layout", default="inflate", choices=LAYOUTS, help="memory layout")
    p.add_argument(
        "--format",
        default="text",
        choices=("text", "json", "vllm"),
        help="text, the plan as JSON, or the plan as vLLM's KVCacheConfig (JSON)",
    )
    _add_cache_formats(p, " (default with --format vllm)")
    p.add_argument(
        "--indexer-kv-dtype",
        choices=INDEXER_KV_DTYPES,
        default=None,
        help="vLLM's --attention-config indexer_kv_dtype: the dtype of Qwen4-Exp's compressed "
        "QSA keys in vLLM's formats (auto: bf16; fp8: e4m3 without scales; default: auto)",
    )
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("compare", help="all layouts side by side")
    _add_plan_options(p)
    _add_cache_formats(p, " (GLM-5-Next's and Qwen4-Exp's: inflate only)")
    p.set_defaults(func=cmd_compare)
    from .advise import ADVISED_POLICIES
    from .alloc import ALL_POLICIES

    p = sub.add_parser("advise", help="simulate a workload under each layout and recommend one")
    _add_plan_options(p)
    _add_trace_options(p, "multi_turn_chat")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one progress bar over the configurations (default: when stderr is a terminal)",
    )
    p.add_argument(
        "--policies",
        nargs="+",
        choices=ALL_POLICIES,
        metavar="POLICY",
        help="the checkpoint policies tried, each at its own default interval (default: "
        f"{' '.join(ADVISED_POLICIES)}; any of {', '.join(ALL_POLICIES)})",
    )
    add_executor_arguments(p, "the configurations' simulations")
    # advise's own choices unless pinned (see hybridkv.advise.Pins)
    p.set_defaults(func=cmd_advise, max_num_seqs=64, cache_state_slots=None)
    p = sub.add_parser(
        "simulate",
        help="replay a workload or a real trace on one plan; compare with attention-only bounds",
    )
    _add_plan_options(p)
    _add_trace_options(p, "mooncake")
    from .alloc.options import EVICTIONS, PARTIAL_HIT_POINTS

    p.add_argument("--layout", default="inflate", choices=LAYOUTS, help="memory layout")
    _add_cache_formats(p, "; its sparse-attention indexers' rings are per-request scratch")
    p.add_argument(
        "--policy",
        default="align",
        choices=ALL_POLICIES,
        help="state checkpoint policy (align: vLLM 0.33's; periodic / hash_boundary / hash_ladder "
        "keep states inside prompts every --checkpoint-interval tokens / at its last multiple / "
        "at its last multiple and its doublings)",
    )
    p.add_argument(
        "--checkpoint-interval",
        type=int,
        default=None,
        help="periodic / hash_boundary: tokens between kept states (default 512); hash_ladder: "
        "its first rung (default: the state's size in KV tokens, rounded up to a power-of-two "
        "multiple of the hash unit)",
    )
    p.add_argument(
        "--hash-block-size",
        type=int,
        default=None,
        help="the prefix cache's hash unit (default min(16, block size))",
    )
    p.add_argument(
        "--eviction",
        default="auto",
        choices=EVICTIONS,
        help="lru, marconi (recency against prefill FLOPs saved per byte, across KV and states) "
        "or auto: the policy's own (marconi for marconi and hash_ladder, else lru)",
    )
    p.add_argument(
        "--partial-hit-points",
        default="auto",
        choices=PARTIAL_HIT_POINTS,
        help="where a hit inside an attention block may land: units (any hash unit a cached "
        "block holds: hybridkv's cache) or keys (only a full block's end or an earlier prompt's "
        "tail, as vLLM keys them: what vLLM serves with --prefix-match-unit below the block or "
        "decode context parallelism) (default: auto, the policy's own: keys for align, units "
        "for the others)",
    )
    p.add_argument(
        "--marconi-alpha",
        type=_marconi_alpha,
        default="auto",
        help="the weight of prefill FLOPs saved against recency in Marconi's eviction: a number "
        "fixes it; auto (the default) tunes it online once, as Marconi does, by replaying the "
        "first window of finished requests",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a progress bar (default: when stderr is a terminal)",
    )
    p.set_defaults(func=cmd_simulate, max_num_seqs=64)
    p = sub.add_parser(
        "doctor",
        help="what vLLM's prefix cache does with this model (and your workload), and the "
        "flags that change it",
    )
    _add_plan_options(p)
    w = p.add_argument_group("workload (optional)")
    w.add_argument(
        "--trace",
        default=None,
        help="a .jsonl trace, 'mooncake', or a generated workload (multi_turn_chat, "
        "shared_prefix, agentic, no_sharing; default: unset, and the findings about a "
        "workload's prefixes and the remedies' hit rates are left out)",
    )
    w.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"requests of the workload (default {DEFAULT_REQUESTS}; 64 with --prompt-len)",
    )
    w.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help="tokens per prompt, with --shared-prefix (default: unset, no workload)",
    )
    w.add_argument(
        "--shared-prefix",
        type=int,
        default=None,
        help="tokens every prompt starts with, with --prompt-len (default: unset)",
    )
    # the doctor describes what vLLM runs, so it plans vLLM's cache formats (GLM-5-Next's and
    # Qwen4-Exp's indexers; K and V side by side in a page, the same capacity, in every other)
    p.set_defaults(
        func=cmd_doctor, time_scale=None, rate_scale=1.0, shared_length="blocks", seed=0,
        cache_formats="vllm",
    )  # fmt: skip
    _show_defaults(parser)
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append ``(default: X)`` to every option's help that does not say its default already,
    per command (``--max-num-seqs`` is 256 for plan and 64 for simulate)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _show_defaults(sub)
            continue
        if not action.option_strings or action.help in (None, argparse.SUPPRESS):
            continue
        default = action.default
        # by identity: ``0 in (False,)`` holds, and a default of 0 (--seed) is worth showing
        if any(default is x for x in (None, False, argparse.SUPPRESS)) or "default" in action.help:
            continue
        action.help += " (default: %(default)s)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UnicodeDecodeError:  # before ValueError, whose subclass it is
        where = getattr(args, "trace", None) or getattr(args, "model", None)
        print(
            f"hybridkv: error: {where} is not a text file (UTF-8 JSON / JSONL expected)",
            file=sys.stderr,
        )
        return 2
    except (ValueError, KeyError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"hybridkv: error: {msg}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"hybridkv: error: no such file: {exc.filename or exc}", file=sys.stderr)
        return 2
    except ExecutorUnavailable as exc:
        print(f"hybridkv: error: {exc}", file=sys.stderr)
        return 2
    except IsADirectoryError as exc:
        print(f"hybridkv: error: {exc.filename} is a folder, not a file", file=sys.stderr)
        return 2

    except BrokenPipeError:
        # output piped into e.g. `head`, which closed it: stop quietly, as Unix tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
