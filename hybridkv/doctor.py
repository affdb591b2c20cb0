"""``hybridkv doctor``: what vLLM's prefix cache will do with a hybrid model, and what fixes it.

Given what a user gives vLLM (a model, its cache dtypes, vLLM's flags) and, optionally, their
workload, :func:`diagnose` answers with numbers: the attention block vLLM will use and the rule
that made it; the shortest shared prefix that can hit; what align mode's checkpoints serve of
the workload; what ``max_model_len`` does to caching; the capacity fp8 KV really buys; how many
requests run at once (in vLLM's pages: vLLM reserves no state per ``--max-num-seqs``, so states
that do not all fit lower the concurrency, not the start; a ``max_model_len`` request that does
not fit stops vLLM, as its start-up check does). Then the vLLM flags that change each finding,
each with the block size, token capacity and (given a workload) the hit rate the allocator
predicts for it, and hybridkv's own layout beside them.

Hit rates come from :func:`hybridkv.replay.replay`: the workload's requests one at a time on the
plan's memory, with vLLM's allocator rules (align checkpoints, hash unit = block unless
``--prefix-match-unit``, unreachable entries kept as vLLM keeps them). They are token hit rates
(prompt tokens served from cache over prompt tokens), the number vLLM's
``prefix_cache_hit_rate`` metric reports.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .alloc import AllocatorOptions
from .alloc.groups import group_roles
from .alloc.policies import state_sized_scale
from .layouts import PlanTooSmall, make_plan
from .models.model import MTP_PREFIX, HybridModel
from .plan import MemoryPlan
from .target import VllmRules, VllmTarget
from .traces import Request, Trace
from .traces.reuse import infinite_cache_hits
from .units import format_bytes
from .vllm_families import not_served_reason

if TYPE_CHECKING:  # the export module is imported when a diagnosis needs it
    from .vllm_export import LoggedCapacity, RequestBlocks

__all__ = ["Diagnosis", "Finding", "Remedy", "diagnose", "prefix_trace"]

#: vLLM 0.33's ``--prefix-match-unit`` value the remedy tries (PR #46384's example)
PREFIX_MATCH_UNIT = 16

#: a model loader: the same model with other runtime options (``kv_dtype``, ``ssm_dtype``, ...)
Loader = Callable[..., HybridModel]


@dataclass(frozen=True)
class Finding:
    """One answer: ``key`` names the question, ``severity`` is ``ok``, ``note`` or ``problem``,
    ``text`` says it with numbers, ``data`` holds the numbers."""

    key: str
    severity: str
    text: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Remedy:
    """A change of vLLM flags (or hybridkv's layout) and what it predicts."""

    key: str
    flags: tuple[str, ...]
    why: str
    block_size: int
    token_capacity: int
    token_hit_rate: float | None  # None: no workload given


@dataclass(frozen=True)
class Diagnosis:
    model: str
    vllm_version: str
    block_size: int
    block_size_rule: str
    prefix_caching: bool
    mamba_cache_mode: str
    vllm_target: dict[str, Any]  # every vLLM setting the diagnosis follows (as in plan's JSON)
    workload: dict[str, Any] | None
    findings: tuple[Finding, ...]
    remedies: tuple[Remedy, ...]

    def finding(self, key: str) -> Finding | None:
        return next((f for f in self.findings if f.key == key), None)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def text(self) -> str:
        mark = {"ok": "ok     ", "note": "note   ", "problem": "PROBLEM"}
        lines = [
            f"hybridkv doctor: {self.model} on vLLM {self.vllm_version} (prefix caching "
            f"{'on' if self.prefix_caching else 'off'}, mamba_cache_mode="
            f"{self.mamba_cache_mode})"
        ]
        if self.workload:
            w = self.workload
            lines.append(
                f"workload: {w['name']}, {w['requests']:,} requests, mean prompt "
                f"{w['mean_prompt']:,.0f} tokens, {100 * w['shared_fraction']:.1f}% of prompt "
                "tokens repeat an earlier prompt's start"
            )
        lines.append("")
        lines.extend(f"{mark[f.severity]} {f.text}" for f in self.findings)
        if self.remedies:
            lines += ["", "what changes it (predicted by hybridkv's allocator):"]
            for r in self.remedies:
                rate = r.token_hit_rate
                hit = "" if rate is None else f", hit rate {100 * rate:.1f}%"
                # a JSON flag value is quoted for the shell, as it is typed
                flags = " ".join(shlex.quote(f) if f.startswith("{") else f for f in r.flags)
                lines.append(
                    f"  {flags or '(as given)':<44} block {r.block_size:>5}, "
                    f"{r.token_capacity:>10,} tokens{hit}"
                )
                lines.append(f"      {r.why}")
        return "\n".join(lines)


def prefix_trace(
    prompt_len: int, shared_prefix: int, num_requests: int = 64, output_len: int = 16
) -> Trace:
    """``num_requests`` prompts of ``prompt_len`` tokens whose first ``shared_prefix`` tokens are
    the same (a system prompt) and the rest unique: the workload of a user who gives only those
    two numbers."""
    if prompt_len < 1:
        raise ValueError(f"--prompt-len must be >= 1, got {prompt_len}")
    if not 0 <= shared_prefix <= prompt_len:
        raise ValueError(
            f"--shared-prefix must be in [0, --prompt-len={prompt_len}], got {shared_prefix}"
        )
    if num_requests < 1:
        raise ValueError(f"the workload needs at least one request, got {num_requests}")
    rng = np.random.default_rng(0)
    common = rng.integers(1, 50_000, shared_prefix, dtype=np.int32)
    requests = []
    for i in range(num_requests):
        own = rng.integers(1, 50_000, prompt_len - shared_prefix, dtype=np.int32)
        requests.append(
            Request(
                request_id=i,
                arrival_s=float(i),
                prompt=np.concatenate([common, own]),
                output_length=output_len,
                output_ids=rng.integers(1, 50_000, output_len, dtype=np.int32),
                prefix_group=0,
                shared_prefix_length=shared_prefix if i else 0,
            )
        )
    params = {"prompt_len": prompt_len, "shared_prefix": shared_prefix, "requests": num_requests}
    return Trace("prompt statistics", tuple(requests), params)


def _vllm_options(plan: MemoryPlan, hash_unit: int | None = None) -> AllocatorOptions:
    """The allocator as vLLM runs it on ``plan``: align checkpoints, hits in whole blocks (or
    ``--prefix-match-unit`` tokens), entries no hit can reach kept until they age out."""
    on = plan.vllm is None or plan.vllm.enable_prefix_caching
    unit = hash_unit or plan.block_size
    return AllocatorOptions(
        enable_prefix_caching=on,
        hash_block_size=unit,
        checkpoint_policy="align",
        # partial_hash_hits_enabled: a unit finer than the state block, or as fine under DCP
        # (align's hits inside a block land on vLLM's keys: a full block's end, a prompt's tail)
        partial_block_hits=unit < plan.block_size or plan.dcp_size > 1,
        evict_unreachable=False,
    )


def _hit_rate(plan: MemoryPlan, trace: Trace | None, options: AllocatorOptions) -> float | None:
    from .replay import replay

    if trace is None:
        return None
    if not options.enable_prefix_caching:
        return 0.0
    result = replay(plan, trace, options)
    return float(result.hits.sum() / max(1, result.prompts.sum()))


def _workload(trace: Trace) -> dict[str, Any]:
    prompts = trace.prompt_lengths()
    shared = infinite_cache_hits(trace, 1)
    return {
        "name": trace.name,
        "requests": len(trace),
        "mean_prompt": float(prompts.mean()),
        "min_prompt": int(prompts.min()),
        "shared_fraction": float(shared.sum() / max(1, prompts.sum())),
        "mean_request": float(np.mean([len(r.prompt) + r.output_length for r in trace.requests])),
    }


def diagnose(
    load: Loader,
    *,
    runtime: dict[str, Any],
    memory: int,
    max_num_seqs: int,
    target: VllmTarget,
    block_size: int | None = None,
    trace: Trace | None = None,
) -> Diagnosis:
    """Diagnose ``load(**runtime)`` under vLLM ``target`` with ``memory`` bytes of cache per rank
    (``runtime``: the loader's options as the user set them: ``kv_dtype``, ``ssm_dtype``, ...;
    ``block_size``: vLLM's ``--block-size``; ``trace``: the workload, if any)."""

    def plan_for(num_seqs: int | None = None, **change: Any) -> tuple[HybridModel, MemoryPlan]:
        model = load(**{**runtime, **{k: v for k, v in change.items() if k != "target"}})
        plan = make_plan(
            model, "inflate", memory=memory, max_num_seqs=num_seqs or planned,
            block_size=block_size, target=change.get("target", target),
        )  # fmt: skip
        return model, plan

    not_served = not_served_reason(load(**runtime))
    if not_served is not None:
        raise ValueError(
            f"{not_served}, so there is no vLLM prefix cache for the doctor to diagnose; "
            "`hybridkv compare` plans the model's memory in hybridkv's layouts"
        )
    # each computed once: the workload's statistics and the replay of the flags as given
    workload = _workload(trace) if trace is not None else None
    planned = max_num_seqs
    refused: PlanTooSmall | None = None
    try:
        model, plan = plan_for()
    except PlanTooSmall as too_small:
        # vLLM reserves no state per --max-num-seqs: it starts, and runs what fits at once
        refused = too_small
        model, plan = _most_admitted(plan_for, max_num_seqs, workload, target)
        planned = plan.config.max_num_seqs
    rules = plan.vllm
    if rules is None or not rules.is_hybrid:
        raise ValueError(
            f"{model.name} has no recurrent-state layer next to its attention: vLLM's hybrid "
            "block alignment does not apply, and there is nothing for the doctor to check"
        )
    _check_starts(model, plan, plan_for, memory, target)
    big = plan.block_size
    findings = [
        Finding(
            "block_size",
            "note" if big > 64 else "ok",
            f"vLLM {target.version} will use {big}-token attention blocks: {plan.block_size_rule}",
            {"block_size": big, "rule": plan.block_size_rule},
        )
    ]
    as_given = _hit_rate(plan, trace, _vllm_options(plan))
    findings += _cache_findings(plan, trace, target, workload, as_given)
    findings.append(_fp8_finding(model, plan, plan_for, runtime))
    if model.kv_dtype_skip_layers:
        findings.append(_skip_layers_finding(model, plan, plan_for))
    if model.speculative_method == "mtp":
        findings.append(_mtp_finding(model, plan, rules))
    if model.dcp_size > 1:
        findings.append(_dcp_finding(model, plan, plan_for))
    findings.append(_concurrency_finding(model, plan, workload, max_num_seqs, refused))
    remedies = _remedies(model, plan, plan_for, runtime, trace, target, as_given)
    return Diagnosis(
        model=model.name,
        vllm_version=target.version,
        block_size=big,
        block_size_rule=plan.block_size_rule,
        prefix_caching=rules.enable_prefix_caching,
        mamba_cache_mode=rules.mamba_cache_mode,
        vllm_target=target.to_dict(),
        workload=workload,
        findings=tuple(findings),
        remedies=tuple(remedies),
    )


def _hit_block(plan: MemoryPlan) -> int:
    """Tokens a prefix hit is a multiple of under vLLM's own hash unit: the lcm of the block
    sizes of the groups whose hits need the whole prefix (the block size, unless
    --kv-cache-dtype-skip-layers gave the quantized layers larger blocks). Under DCP the hash
    unit is the gcd of the blocks' spans, the state block, and vLLM accepts it for hits inside
    the sharded attention blocks (``partial_hash_hits_enabled``): hits land on the state
    block."""
    if plan.dcp_size > 1 and plan.state_groups:
        return plan.checkpoint_granularity
    return _whole_block(plan)


def _whole_block(plan: MemoryPlan) -> int:
    """The lcm of the block sizes of the groups whose hits need the whole prefix: where vLLM's
    keys of full blocks fall together (the block size where there is none)."""
    blocks = [block for _, block in group_roles(plan.groups).full]
    return math.lcm(*blocks) if blocks else plan.block_size


def _hit_block_text(plan: MemoryPlan) -> str:
    """The whole-prefix attention groups' block sizes, as the findings print them."""
    blocks = sorted({block for _, block in group_roles(plan.groups).full})
    return " and ".join(f"{b:,}-token" for b in blocks)


def _cache_findings(
    plan: MemoryPlan,
    trace: Trace | None,
    target: VllmTarget,
    w: dict[str, Any] | None,
    align: float | None,
) -> list[Finding]:
    rules, big = plan.vllm, _hit_block(plan)
    if not rules.enable_prefix_caching:
        return [
            Finding(
                "prefix_caching",
                "note",
                "prefix caching is off: no prompt is served from cache (vLLM keeps one state "
                f"per request for {rules.max_model_len or 'max_model_len'} tokens)",
            )
        ]
    lookahead = rules.hash_lookahead_tokens
    # under EAGLE's block drop a hit gives a hit unit back (the block; a state block of the
    # sharded attention blocks under DCP): a prefix serves only once a unit more is shared
    drop = big if rules.eagle_block_drop else 0
    extra = lookahead + drop
    shortest = big + extra
    if lookahead:
        after = (
            f", and under MTP a block's hash covers the {lookahead} "
            f"token{'s' * (lookahead > 1)} after it"
        )
    elif drop:
        after = (
            f", and under MTP it drops the last {drop:,} tokens of every hit (EAGLE's block "
            "drop), so a prefix serves a block less than it shares"
        )
    else:
        after = ""
    data: dict[str, Any] = {"min_shared_tokens": shortest}
    if plan.dcp_size > 1:
        # vLLM keys an attention block at its end and a prompt at its tail only: a prefix that
        # different prompts share hits on whole (sharded) attention blocks
        across = _whole_block(plan) + extra
        data["min_shared_tokens_across_prompts"] = across
        where = (
            f"keeps Mamba states only at {big}-token block boundaries and keys its "
            f"{_hit_block_text(plan)} attention blocks (sharded over {plan.dcp_size} "
            "decode-context-parallel ranks) at their ends and at an earlier prompt's tail, so a "
            f"prefix that different prompts share (a system prompt) needs {across:,} tokens"
        )
    else:
        where = f"caches whole {big}-token blocks and keeps Mamba states only at block boundaries"
    out = [
        Finding(
            "min_hit",
            "note",
            f"no prefix hit is possible for a shared prefix shorter than {shortest} tokens: vLLM "
            f"{where}{after} (nothing in its logs or metrics names this minimum)",
            data,
        )
    ]
    mml = target.max_model_len
    if mml is not None and mml < big:
        out.append(
            Finding(
                "max_model_len",
                "problem",
                f"--max-model-len {mml} is below the {big}-token block: no request ever fills "
                "a block, so prefix caching can never hit (vLLM #48401)",
                {"max_model_len": mml, "block_size": big},
            )
        )
    if trace is not None:
        whole = infinite_cache_hits(trace, big, lookahead=lookahead).sum()
        prompts = max(1, int(trace.prompt_lengths().sum()))
        shared = w["shared_fraction"] * prompts
        every = _hit_rate(
            plan, trace, _vllm_options(plan).replace(prefix_cache_retention_interval=None)
        )
        severity = "problem" if align == 0 and shared > 0 else ("note" if align < 0.5 else "ok")
        out.append(
            Finding(
                "align_checkpoint",
                severity,
                f"of the workload's prompt tokens, {100 * shared / prompts:.1f}% repeat an "
                f"earlier prompt's start, {100 * whole / prompts:.1f}% in whole {big}-token "
                f"blocks; vLLM's align mode (the states it keeps at block boundaries) serves "
                f"{100 * align:.1f}%, a state kept at every block boundary would serve "
                f"{100 * every:.1f}%",
                {
                    "shared_fraction": shared / prompts,
                    "whole_block_fraction": whole / prompts,
                    "align_token_hit_rate": align,
                    "every_block_token_hit_rate": every,
                    "prompts_below_block": int((trace.prompt_lengths() < big).sum()),
                    "min_prompt": w["min_prompt"],
                },
            )
        )
    return out


def _fp8_finding(
    model: HybridModel, plan: MemoryPlan, plan_for: Callable, runtime: dict[str, Any]
) -> Finding:
    """What fp8 KV buys: the pool's token slots (about 2x: vLLM doubles the block to fill the
    same state page) and what vLLM's start-up log will say, which counts each request's state
    blocks too and so shows less (vLLM #55196's 1.00-1.84x)."""
    is_fp8 = model.kv_dtype.startswith("fp8")  # canonical names: fp8_e4m3, fp8_e5m2
    other_dtype = "auto" if is_fp8 else "fp8"
    # the unquantized plan has no layer to skip (and fp8's is the one as given, skips and all)
    try:
        other_model, other = plan_for(kv_dtype=other_dtype, kv_dtype_skip_layers=())
    except ValueError as refused:  # vLLM serves no such configuration (e.g. fp8 sparse MLA
        # under DCP): the finding says why, rather than the doctor failing on its own question
        text = f"--kv-cache-dtype {other_dtype} is not an option with these flags: {refused}"
        return Finding("fp8", "note", text, {"refused": str(refused)})
    (fp8, fp8_model), (wide, wide_model) = (
        ((plan, model), (other, other_model)) if is_fp8 else ((other, other_model), (plan, model))
    )
    ratio = fp8.capacity.token_capacity / max(1, wide.capacity.token_capacity)
    if ratio > 2.05:
        # the states reserved for max_num_seqs take nearly all of the cache: the few blocks
        # beside them decide, and fp8's slightly different page changes how many fit
        share = wide.capacity.state_reserved_bytes / max(1, wide.config.memory_bytes)
        versus = (
            f"more than attention-only models' 2.00x because the states of "
            f"--max-num-seqs {wide.config.max_num_seqs} requests, set aside first, take "
            f"{100 * share:.0f}% of the cache and the blocks left beside them decide: "
            f"{wide.capacity.token_capacity // max(1, wide.block_size):,} of "
            f"{wide.block_size} tokens in {wide.kv_dtype}, "
            f"{fp8.capacity.token_capacity // max(1, fp8.block_size):,} of {fp8.block_size} in "
            f"{fp8.kv_dtype} (vLLM sets nothing aside: read its start-up log's ratio)"
        )
    elif ratio >= 1.95:
        versus = "about what attention-only models get (2.00x)"
    else:
        versus = "where attention-only models get 2.00x (vLLM #55196)"
    skips = fp8_model.kv_dtype_skip_layers
    which = f"layer{'s' if len(skips) > 1 else ''} {', '.join(skips)}"
    given = f" ({which} kept {fp8_model.dtype}, as given)" if skips else ""
    text = (
        f"fp8 KV{given} buys {ratio:.2f}x token capacity here "
        f"({wide.capacity.token_capacity:,} -> {fp8.capacity.token_capacity:,} tokens), {versus}"
    )
    if fp8.block_size > wide.block_size:
        text += (
            f"; the block grows {wide.block_size} -> {fp8.block_size} tokens to hold the same "
            f"state page, so each hit needs {fp8.block_size / wide.block_size:.3g}x the shared "
            "prefix"
        )
    data: dict[str, Any] = {
        "capacity_ratio": ratio,
        "block_size_bf16": wide.block_size,
        "block_size_fp8": fp8.block_size,
    }
    logged = _logged_capacities(wide, wide_model, fp8, fp8_model)
    severity = "note" if ratio < 1.95 else "ok"
    if logged is not None:
        before, after = logged
        logged_ratio = after.tokens / max(1, before.tokens)
        text += (
            f". vLLM's start-up log will show {logged_ratio:.2f}x (GPU KV cache size "
            f"{before.tokens:,} -> {after.tokens:,} tokens, maximum concurrency at "
            f"{before.max_model_len:,} tokens {before.max_concurrency:.2f}x -> "
            f"{after.max_concurrency:.2f}x): it counts a max_model_len request's "
            f"{before.state_blocks_per_request} state blocks beside its "
            f"{before.attention_blocks_per_request} -> {after.attention_blocks_per_request} "
            "attention blocks, and fp8 does not shrink states"
        )
        if logged_ratio < 1.95:
            text += " (vLLM #55196); a longer --max-model-len logs closer to 2x"
            severity = "note"
        data.update(
            logged_ratio=logged_ratio,
            logged_tokens_bf16=before.tokens,
            logged_tokens_fp8=after.tokens,
            logged_max_concurrency_bf16=before.max_concurrency,
            logged_max_concurrency_fp8=after.max_concurrency,
            max_model_len=before.max_model_len,
            state_blocks_per_request=before.state_blocks_per_request,
        )
    return Finding("fp8", severity, text, data)


def _skip_layers_finding(model: HybridModel, plan: MemoryPlan, plan_for: Callable) -> Finding:
    """What ``--kv-cache-dtype-skip-layers`` costs in vLLM's one pool of equal pages: the
    skipped layers' pages are the widest, so every other page is unified to them (the
    quantized layers' block grows, state pages are padded), against fp8 everywhere."""
    _, plain = plan_for(kv_dtype_skip_layers=())
    skipped = [layer.index for layer in model.kv_dtype_skipped_layers]
    blocks = sorted({g.block_size for g in plan.attention_groups})
    ratio = plan.capacity.token_capacity / max(1, plain.capacity.token_capacity)
    text = (
        f"--kv-cache-dtype-skip-layers keeps {len(skipped)} of {len(model.attention_layers)} "
        f"attention layers at {model.dtype} ({', '.join(map(str, skipped[:8]))}"
        f"{', ...' if len(skipped) > 8 else ''}); vLLM gives every page the size of the widest "
        f"({plan.extra['page_bytes']:,} B, against {plain.extra['page_bytes']:,} B with "
        f"{model.kv_dtype} everywhere), so attention blocks are "
        f"{' and '.join(f'{b:,}' for b in blocks)} tokens (hits land on multiples of "
        f"{plan.scheduler_block_size:,}) and each state page is padded to it: "
        f"{plan.capacity.token_capacity:,} tokens, {ratio:.2f}x of fp8 everywhere "
        f"({plain.capacity.token_capacity:,})"
    )
    data = {
        "skipped_layers": skipped,
        "attention_block_sizes": blocks,
        "scheduler_block_size": plan.scheduler_block_size,
        "page_bytes": plan.extra["page_bytes"],
        "page_bytes_without_skip": plain.extra["page_bytes"],
        "token_capacity": plan.capacity.token_capacity,
        "token_capacity_without_skip": plain.capacity.token_capacity,
        "capacity_ratio": ratio,
    }
    return Finding("skip_layers", "note" if ratio < 0.95 else "ok", text, data)


def _logged_capacities(
    wide: MemoryPlan, wide_model: HybridModel, fp8: MemoryPlan, fp8_model: HybridModel
) -> tuple[LoggedCapacity, LoggedCapacity] | None:
    """vLLM's logged capacity of both plans, or None where it cannot be computed (a family vLLM
    does not serve, a sliding-window group, no max_model_len): the finding then says only the
    token slots."""
    from .vllm_export import logged_capacity

    try:
        return logged_capacity(wide, wide_model), logged_capacity(fp8, fp8_model)
    except ValueError:
        return None


def _dcp_finding(model: HybridModel, plan: MemoryPlan, plan_for: Callable) -> Finding:
    """What ``--decode-context-parallel-size`` does here: the attention blocks span it times a
    rank's rows and a rank holds it times the tokens, while the states, not sharded, keep their
    bytes, so each request's states weigh it times more tokens of KV."""
    _, plain = plan_for(dcp_size=1, cp_kv_cache_interleave_size=1)
    dcp = model.dcp_size
    spans = _hit_block_text(plan)
    ratio = plan.capacity.token_capacity / max(1, plain.capacity.token_capacity)
    weight = dcp * model.state_bytes_per_seq / model.kv_bytes_per_token
    text = (
        f"--decode-context-parallel-size {dcp}: each rank keeps one token in {dcp} of every "
        f"attention layer, so its {plan.block_size}-row pages hold {spans} attention blocks and "
        f"{plan.capacity.token_capacity:,} tokens fit ({ratio:.2f}x the "
        f"{plain.capacity.token_capacity:,} without DCP); the recurrent states are not sharded, "
        f"so a request's states weigh as much as {weight:,.0f} tokens of KV (against "
        f"{weight / dcp:,.0f}) and every cached state costs {dcp}x the context it would"
    )
    data = {
        "dcp_size": dcp,
        "attention_block_sizes": sorted({b for _, b in group_roles(plan.groups).full}),
        "rows_per_block": plan.block_size,
        "token_capacity": plan.capacity.token_capacity,
        "token_capacity_without_dcp": plain.capacity.token_capacity,
        "state_weight_tokens": weight,
    }
    return Finding("dcp", "ok", text, data)


def _mtp_finding(model: HybridModel, plan: MemoryPlan, rules: VllmRules) -> Finding:
    """What the MTP drafter costs, and what it does to prefix hits (modelled or not)."""
    drafter = [layer.name for layer in model.layers if layer.name.startswith(MTP_PREFIX)]
    text = (
        f"MTP speculative decoding adds the drafter's {len(drafter)} attention layer(s) to the "
        f"cache, planned here ({len(model.attention_layers)} attention layers in all)"
    )
    hit_rule = rules.mtp_hit_rule()
    if hit_rule:
        text += f"; {hit_rule}"
    return Finding(
        "mtp",
        "note",
        text,
        {
            "drafter_layers": drafter,
            # schema 1's key: whether the predictions follow what vLLM does to hits under MTP
            # (the lookahead hashes and EAGLE's block drop both are)
            "hit_drop_modelled": True,
            "hash_lookahead_tokens": rules.hash_lookahead_tokens,
            "eagle_block_drop": rules.eagle_block_drop,
        },
    )


def _request_tokens(workload: dict[str, Any] | None, target_len: int | None) -> int | None:
    """The request length concurrency is counted at: the workload's mean request, else the
    max_model_len request vLLM's start-up log counts (None: neither known)."""
    if workload is not None:
        return max(1, round(workload["mean_request"]))
    return target_len


def _held_tokens(plan: MemoryPlan, tokens: int | None) -> int:
    """KV tokens a request of ``tokens`` holds in ``plan``'s whole blocks (one block: None)."""
    big = plan.block_size
    return -(-tokens // big) * big if tokens else big


def _most_admitted(
    plan_for: Callable, max_num_seqs: int, workload: dict[str, Any] | None, target: VllmTarget
) -> tuple[HybridModel, MemoryPlan]:
    """The model and plan of the most requests (fewer than ``max_num_seqs``, whose states do
    not fit) that run at once, each with its pages for a request of :func:`_request_tokens`'s
    length (in vLLM's pages where the plan is exportable, else in the plan's capacity). vLLM
    admits a request while its pages are free, so this is its concurrency on such requests;
    one at least (a request that fits alone runs). ValueError when not even one request's
    states and one block fit (vLLM would not start)."""
    try:
        model, one = plan_for(num_seqs=1)
    except PlanTooSmall as refused:
        raise ValueError(
            f"vLLM {target.version} would not start: one request's state pages and one KV "
            f"block need {format_bytes(refused.needed_bytes)}, more than the "
            f"{format_bytes(refused.memory_bytes)} cache; give the cache more memory "
            "(--gpu-memory)"
        ) from None
    tokens = _request_tokens(workload, one.vllm.max_model_len if one.vllm else None)
    blocks = _vllm_blocks(one, model, tokens)
    held = _held_tokens(one, tokens)
    hi = max_num_seqs - 1
    if blocks is not None:  # the null block serves no request
        hi = min(hi, (blocks.num_blocks - 1) // blocks.total)

    def runs(n: int) -> MemoryPlan | None:
        try:
            plan = plan_for(num_seqs=n)[1]
        except PlanTooSmall:
            return None
        fits = blocks is not None or n * held <= plan.capacity.token_capacity
        return plan if fits else None

    # the most n with a plan that runs them: monotone, as each request's states take KV from
    # the rest, so a binary search
    best, lo = one, 2
    while lo <= hi:
        n = (lo + hi) // 2
        plan = runs(n)
        if plan is None:
            hi = n - 1
        else:
            best, lo = plan, n + 1
    return model, best


def _vllm_blocks(plan: MemoryPlan, model: HybridModel, tokens: int | None) -> RequestBlocks | None:
    """vLLM's pages for a request of ``tokens`` (one block: None) on ``plan``, or None where the
    plan is not exportable (a family vLLM does not serve, a sliding-window group)."""
    from .vllm_export import request_blocks

    try:
        return request_blocks(plan, model, tokens or plan.block_size)
    except ValueError:
        return None


def _check_starts(
    model: HybridModel, plan: MemoryPlan, plan_for: Callable, memory: int, target: VllmTarget
) -> None:
    """vLLM's start-up check (``check_enough_kv_cache_memory``): the cache must hold one
    request of max_model_len, its KV in whole blocks of each attention group beside its state
    pages, or vLLM raises before serving anything. Counted in vLLM's pages where the plan is
    exportable, else in the plan's capacity beside one request's states."""
    max_len = plan.vllm.max_model_len if plan.vllm else None
    if not max_len:
        return
    blocks = _vllm_blocks(plan, model, max_len)
    if blocks is not None:
        pages = blocks.num_blocks - 1  # the null block serves no request
        if blocks.total <= pages:
            return
        spare = pages - blocks.state - blocks.ring
        # the longest request whose attention blocks fit beside its state pages
        room, longer = 0, max_len
        while room < longer:
            mid = (room + longer + 1) // 2
            if blocks.attention_blocks(mid) <= spare:
                room = mid
            else:
                longer = mid - 1
        need = (
            f"takes {blocks.total:,} of the pool's {pages:,} pages ({blocks.attention:,} "
            f"attention in {_block_sizes_text(blocks)}-token blocks, "
            f"{blocks.state + blocks.ring:,} state)"
        )
    else:
        one = plan if plan.config.max_num_seqs == 1 else plan_for(num_seqs=1)[1]
        room = one.capacity.token_capacity
        held = _held_tokens(plan, max_len)
        if held <= room:
            return
        need = (
            f"holds {held:,} tokens of KV in {plan.block_size}-token blocks beside its state "
            f"pages, and {room:,} fit"
        )
    raise ValueError(
        f"vLLM {target.version} would not start with {format_bytes(memory)} of cache: one "
        f"request of max_model_len {max_len:,} tokens {need}; give the cache more memory "
        f"(--gpu-memory) or lower --max-model-len (to {room:,} at most)"
    )


def _block_sizes_text(blocks: RequestBlocks) -> str:
    """The attention groups' block sizes as text: ``1088`` or ``1088- and 2176``."""
    sizes = sorted(set(blocks.attention_block_sizes))
    return "- and ".join(str(size) for size in sizes)


def _concurrency_finding(
    model: HybridModel,
    plan: MemoryPlan,
    workload: dict[str, Any] | None,
    max_num_seqs: int,
    refused: PlanTooSmall | None,
) -> Finding:
    """How many requests vLLM runs at once: of the workload's mean length, else of
    max_model_len (the number vLLM's start-up log gives), in vLLM's pages where the plan is
    exportable (a request takes its state and ring pages and whole attention blocks from the one
    pool; vLLM reserves nothing per ``--max-num-seqs``), else in the plan's capacity.
    ``refused``: ``max_num_seqs`` requests' states did not fit, and ``plan`` reserves those of
    the requests that run (:func:`_most_admitted`)."""
    big, planned = plan.block_size, plan.config.max_num_seqs
    tokens = _request_tokens(workload, plan.vllm.max_model_len)
    blocks = _vllm_blocks(plan, model, tokens)
    if blocks is not None:  # each attention group at its own block size
        held = max(-(-blocks.tokens // b) * b for b in blocks.attention_block_sizes)
        sizes = _block_sizes_text(blocks)
        up_to = "up to " if len(set(blocks.attention_block_sizes)) > 1 else ""
        fits = min(max_num_seqs, (blocks.num_blocks - 1) // blocks.total)
        ring = f", {blocks.ring} ring" if blocks.ring else ""
        each = (
            f"{blocks.total} of the pool's {blocks.num_blocks - 1:,} pages ({blocks.state} "
            f"state{ring}, {blocks.attention} attention)"
        )
    else:
        held, sizes, up_to = _held_tokens(plan, tokens), str(big), ""
        fits = min(max_num_seqs, plan.capacity.token_capacity // held)
        each = "its state slot"
    if refused is not None:
        fits = planned
    length = (
        f"the workload's mean length ({tokens:,} tokens)"
        if workload is not None
        else f"max_model_len ({tokens:,} tokens, as vLLM's start-up log counts)"
        if tokens
        else "one block"
    )
    count, fit, whose = (
        ("1 request", "fits", "one request's")
        if fits == 1
        else (f"{fits:,} requests", "fit", f"{fits:,} requests'")
    )
    padded = tokens is not None and held > tokens
    pct = 100 * (held - tokens) / held if padded else 0.0
    padding = f", {pct:.{0 if pct >= 1 else 1}f}% of it padding" if padded else ""
    flag = "" if refused is not None else f" (--max-num-seqs {max_num_seqs})"
    text = (
        f"{count} of {length} {fit} at once{flag}: each holds {each} and {up_to}{held:,} "
        f"tokens of KV in whole {sizes}-token blocks{padding}"
    )
    if refused is not None:
        need = (
            f"{max_num_seqs * (blocks.state + blocks.ring):,} pages"
            if blocks is not None
            else format_bytes(refused.needed_bytes)
        )
        text = (
            f"--max-num-seqs {max_num_seqs} requests' states alone need {need}, more than the "
            f"{format_bytes(refused.memory_bytes)} cache holds; vLLM reserves none up front, so "
            f"it starts and admits a request only while its pages are free: {text}. The "
            f"findings and predictions here plan {whose} states"
        )
    # at max_model_len (no workload) the count is vLLM's worst case, not a problem by itself
    few = workload is not None and fits < max_num_seqs // 4
    severity = "problem" if refused is not None or few else "note"
    return Finding(
        "concurrency",
        severity,
        text,
        {
            "max_num_seqs": max_num_seqs,
            "concurrent_requests": fits,
            "request_tokens": tokens,
            "tokens_held": held,
            "pages_per_request": None if blocks is None else blocks.total,
            "token_capacity": plan.capacity.token_capacity,
            "blocks": plan.capacity.token_capacity // big,  # schema 1's key: the plan's blocks
        },
    )


def _remedies(
    model: HybridModel,
    plan: MemoryPlan,
    plan_for: Callable,
    runtime: dict[str, Any],
    trace: Trace | None,
    target: VllmTarget,
    as_given: float | None,
) -> list[Remedy]:
    def remedy(key: str, flags: tuple[str, ...], why: str, p: MemoryPlan, opts) -> Remedy:
        return Remedy(key, flags, why, p.block_size, p.capacity.token_capacity,
                      _hit_rate(p, trace, opts))  # fmt: skip

    out = [
        Remedy("as_given", (), "the flags as given", plan.block_size,
               plan.capacity.token_capacity, as_given)
    ]  # fmt: skip
    if target.version == "0.33" and plan.vllm.enable_prefix_caching:
        out.append(
            remedy(
                "prefix_match_unit",
                ("--prefix-match-unit", str(PREFIX_MATCH_UNIT)),
                f"hits at {PREFIX_MATCH_UNIT}-token granularity inside a block (vLLM 0.33, "
                "PR #46384); the block stays as large",
                plan,
                _vllm_options(plan, PREFIX_MATCH_UNIT),
            )
        )
    if model.ssm_dtype == "float32":
        _, half = plan_for(ssm_dtype="bfloat16")
        out.append(
            remedy(
                "ssm_dtype",
                ("--mamba-ssm-cache-dtype", "bfloat16"),
                "a bf16 recurrent state halves the state page, and with it the block (check "
                "the model's accuracy with it)",
                half,
                _vllm_options(half),
            )
        )
    if plan.vllm.hash_lookahead_tokens or plan.vllm.eagle_block_drop:
        # MTP's lookahead hashes cost a block wherever a shared prefix ends on one, EAGLE's
        # block drop a block of every hit; vLLM's switch turns both off (SpeculativeConfig)
        plain = dataclasses.replace(target, disable_eagle_block_drop=True)
        _, p = plan_for(target=plain)
        spec = {"method": "mtp", "num_speculative_tokens": model.num_spec_tokens}
        gain = (
            "a hit no longer needs the token after it"
            if plan.vllm.hash_lookahead_tokens
            else "a hit no longer gives its last block back"
        )
        out.append(
            remedy(
                "mtp_plain_hashes",
                ("--speculative-config", json.dumps({**spec, "disable_eagle_block_drop": True})),
                f"plain block hashes: {gain}, and the drafter reads a cached block's last "
                "position built from another next token (vLLM warns that speculative "
                "acceptance may drop)",
                p,
                _vllm_options(p),
            )
        )
    if model.kv_dtype_skip_layers:
        _, p = plan_for(kv_dtype_skip_layers=())
        out.append(
            remedy(
                "skip_layers_off",
                ("without --kv-cache-dtype-skip-layers",),
                f"{model.kv_dtype} in every attention layer: equal pages, no unification (check "
                "the model's accuracy without the wider layers; per_group keeps them in a "
                "pool of their own at no cost to the rest)",
                p,
                _vllm_options(p),
            )
        )
    dcp = _dcp_remedy(model, plan_for)
    if dcp is not None:
        size, interleave, p = dcp
        mla = any(layer.spec.kind == "mla" for layer in model.layers)
        held = "MLA latent" if mla else "KV head"
        flags = ("--decode-context-parallel-size", str(size))
        if interleave > 1:  # a k-pooled indexer's keys each on one rank (vLLM's requirement)
            flags += ("--cp-kv-cache-interleave-size", str(interleave))
        out.append(
            remedy(
                "dcp",
                flags,
                f"the {size} TP ranks that keep copies of one {held} shard its tokens instead: "
                f"{size}x the tokens in the same memory; a resend or extension of a prompt still "
                f"hits on the {p.checkpoint_granularity:,}-token state block, a prefix that "
                "different prompts share only in whole (sharded) attention blocks; decode then "
                "gathers queries "
                "and merges partial attention across them (time not priced here), and vLLM "
                "needs an attention backend that returns the softmax LSE in decode",
                p,
                _vllm_options(p),
            )
        )
    mml, hit_block = target.max_model_len, _hit_block(plan)
    if mml is not None and mml < hit_block:
        longer = dataclasses.replace(target, max_model_len=hit_block * 2)
        _, p = plan_for(target=longer)
        out.append(
            remedy(
                "max_model_len",
                ("--max-model-len", str(hit_block * 2)),
                "a request must be able to fill a block for any hit",
                p,
                _vllm_options(p),
            )
        )
    out.append(_hybridkv_remedy(model, plan, trace))
    return out


def _dcp_remedy(model: HybridModel, plan_for: Callable) -> tuple[int, int, MemoryPlan] | None:
    """The largest decode context parallel size vLLM accepts for this model and TP where
    the flags set none (the ranks that replicate the KV shard its tokens instead), the least
    interleave it needs, and its plan; None where TP is 1, DCP is set, or no size passes
    vLLM's checks."""
    if model.dcp_size > 1:
        return None
    size, interleave = model.largest_dcp_size(), model.dcp_interleave_unit
    if size == 1:
        return None
    return size, interleave, plan_for(dcp_size=size, cp_kv_cache_interleave_size=interleave)[1]


def _per_group_plan(model: HybridModel, plan: MemoryPlan) -> MemoryPlan:
    """per_group in ``plan``'s memory with as many slots for cached states as running
    requests, halved while they do not fit (a large state, e.g. Nemotron-3-Ultra's 0.4 GiB a
    request, may leave room for fewer); none at the least. ValueError if not even that fits."""
    slots = plan.config.max_num_seqs
    while True:
        try:
            return make_plan(
                model,
                "per_group",
                memory=plan.config.memory_bytes,
                max_num_seqs=plan.config.max_num_seqs,
                cache_state_slots=slots,
                # hybridkv's own layout keeps transformers' cache formats (vLLM's exist in
                # vLLM's layout only)
                target=dataclasses.replace(plan.vllm.target, cache_formats="transformers"),
            )
        except ValueError:
            if slots == 0:
                raise
            slots //= 2


def _hybridkv_remedy(model: HybridModel, plan: MemoryPlan, trace: Trace | None) -> Remedy:
    """hybridkv's per_group layout: 16-token attention blocks in their own pool, states in
    theirs, a state checkpoint at the end of every prompt."""
    p = _per_group_plan(model, plan)
    slots = p.config.cache_state_slots
    # the policies that suit different workloads, the best on this one: a state at each
    # prompt's end (multi-turn chats), every 64 tokens inside prompts (system prompts shared by
    # prompts that then differ), or a ladder down from each prompt's end (documents asked again)
    base = AllocatorOptions(hash_block_size=p.block_size)
    tried = {
        "last": (base.replace(checkpoint_policy="last"), (), "at each prompt end"),
        "periodic": (
            base.replace(checkpoint_policy="periodic", checkpoint_interval=64),
            ("--checkpoint-interval", "64"),
            "every 64 tokens of a prompt",
        ),
        "hash_ladder": (
            base.replace(checkpoint_policy="hash_ladder"),
            (),
            "at each prompt's last multiple of "
            f"{state_sized_scale(p, p.block_size):,} tokens and of its doublings",
        ),
    }
    rates = [(_hit_rate(p, trace, opts), name) for name, (opts, _, _) in tried.items()]
    rate, name = max(rates, key=lambda rn: -1.0 if rn[0] is None else rn[0])
    _, flags, where = tried[name]
    return Remedy(
        "hybridkv",
        ("hybridkv layout per_group", f"--policy {name}", *flags),
        f"{p.block_size}-token attention blocks and a separate state pool with {slots:,} "
        f"slots for cached states, states kept {where}; hybridkv's allocator, not a vLLM flag",
        p.block_size,
        p.capacity.token_capacity,
        rate,
    )
