"""The shared scheduler (:mod:`hybridkv.sched`): one trace through the simulator's roofline clock
and through the engine's model runner gets the same schedule, step by step; and the scheduler's
own rules on a plain allocator (token budget, per-request threshold, preemption, admission)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from hybridkv import traces
from hybridkv.alloc import HybridAllocator
from hybridkv.costmodel import ParamCount
from hybridkv.e2e import (
    hybrid_model_for,
    make_tiny_plan,
    tiny_bamba_config,
    tiny_qwen3_next_config,
)
from hybridkv.sched import Scheduler, SchedulerConfig, Seq, StepOutput
from hybridkv.sim import SimConfig, simulate

CONFIGS = {"bamba": tiny_bamba_config, "qwen3_next": tiny_qwen3_next_config}


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _workload() -> list[tuple[list[int], int]]:
    """Seven prompts, 5 to 150 tokens (chunked by the 64-token threshold), 2 to 9 outputs. The
    engine runs at most four at once, so the last ones wait. Request 4 is the second turn of
    request 0 (:data:`SECOND_TURN`): it arrives when request 0 finishes, its prompt is request
    0's prompt and answer plus 9 tokens; request 5 shares request 0's first 40 tokens."""
    first = _prompt(61, seed=1)
    return [
        (first, 6),
        (_prompt(150, seed=3), 4),
        (_prompt(5, seed=4), 9),
        (_prompt(77, seed=6), 5),
        (_prompt(9, seed=5), 3),  # the new tokens of request 0's second turn
        ([*first[:40], *_prompt(33, seed=7)], 2),
        (_prompt(18, seed=8), 7),
    ]


#: (second turn, first turn)
SECOND_TURN = (4, 0)


def _record(log: list, out: StepOutput, parked_as_count: bool) -> None:
    """What the schedule of a step is: who decodes, which chunks, hits, preemptions."""
    decode = out.num_decode if parked_as_count else [s.rid for s in out.decode]
    log.append(
        (
            out.step,
            decode,
            [(s.rid, start, n) for s, start, n in out.prefill],
            [(s.rid, s.hits[-1].num_cached_tokens) for s in out.admitted],
            [s.rid for s in out.preempted],
        )
    )


@functools.cache
def _model(name: str):
    from hybridkv.e2e import build_tiny_model

    return build_tiny_model(CONFIGS[name]())


ENGINE_KW = dict(prefill_chunk=64, max_num_batched_tokens=160)


@pytest.mark.parametrize(
    "name,layout,policy,memory",
    [
        ("bamba", "pack", "align", "4MiB"),
        ("qwen3_next", "per_group", "marconi", "4MiB"),
        ("bamba", "aggregate", "last", "tight"),
    ],
)
def test_simulator_and_engine_schedule_alike(name, layout, policy, memory):
    """The engine serves the workload (greedy tokens from a tiny random model); the simulator
    replays the same prompts with those outputs as the trace's. Every step must match: the
    decoders, each prefill chunk (request, start, length), each admission's hit and each
    preemption; with parked decoders (``fast_decode``) the number of decoders per step."""
    pytest.importorskip("transformers")
    from hybridkv.e2e.engine import Engine

    config = CONFIGS[name]()
    kw = dict(state_slots_per_seq=2 if policy == "align" else 1, cache_state_slots=4)
    if memory == "tight":
        # little more than the largest request alone: requests preempt each other
        plan = make_tiny_plan(config, layout, fit_tokens=200, **kw)
    else:
        plan = make_tiny_plan(config, layout, memory=memory, **kw)
    work = _workload()
    child, parent = SECOND_TURN
    prompts = {i: p for i, (p, _) in enumerate(work)}
    eng_log: list = []

    def on_step(out: StepOutput) -> None:
        _record(eng_log, out, False)
        for seq in out.finished:
            if seq.rid == parent:  # the next turn arrives as the first ends (no think time)
                prompts[child] = [*seq.prompt, *seq.outputs, *work[child][0]]
                eng.add_request(child, prompts[child], work[child][1])

    eng = Engine(_model(name), plan, checkpoint_policy=policy, on_step=on_step, **ENGINE_KW)
    for i, (p, n) in enumerate(work):
        if i != child:
            eng.add_request(i, p, n)
    eng.run()
    n_params = sum(p.numel() for p in _model(name).parameters())
    requests = [
        traces.Request(
            request_id=i,
            arrival_s=0.0,
            prompt=np.asarray(prompts[i], dtype=np.int32),
            output_length=n,
            output_ids=np.asarray(eng.finished[i].output, dtype=np.int32),
            parent_id=parent if i == child else -1,
        )
        for i, (_, n) in enumerate(work)
    ]
    trace = traces.Trace("engine outputs", tuple(requests))
    sim_config = SimConfig(
        checkpoint_policy=policy,
        max_num_batched_tokens=ENGINE_KW["max_num_batched_tokens"],
        long_prefill_token_threshold=ENGINE_KW["prefill_chunk"],
        prefill_checkpoint_alignment=None,  # the engine cannot export from inside a prefill
        max_model_len=config.max_position_embeddings,
        fast_decode=False,
        params=ParamCount(n_params, n_params, "the tiny model's tensors"),
    )
    model = hybrid_model_for(config)
    sim_log: list = []
    r = simulate(plan, model, trace, sim_config, on_step=lambda out: _record(sim_log, out, False))
    assert r.finished == len(work)
    assert sim_log == eng_log
    # the schedule is not trivial: prefix hits (in the roomy plans), chunked prefills,
    # batched decodes, preemptions (in the tight ones)
    assert any(hit for step in eng_log for _, hit in step[3]) or memory == "tight"
    assert any(n == 64 for step in eng_log for _, _, n in step[2]) or policy == "align"
    assert max(len(step[1]) for step in eng_log) >= 3
    if memory == "tight":
        assert any(step[4] for step in eng_log), "the tight plan was meant to preempt"
    # parked decoders: the same steps, decoders counted instead of listed
    fast_log: list = []
    simulate(
        plan,
        model,
        trace,
        SimConfig(**{**sim_config.__dict__, "fast_decode": True}),
        on_step=lambda out: _record(fast_log, out, True),
    )
    counted = [(s, len(d), *rest) for s, d, *rest in eng_log]
    assert fast_log == counted


# ---- the scheduler's own rules, with an executor that only counts ---------------------------


class _Tokens:
    """An executor that samples token 7 for everyone and records the steps."""

    def __init__(self) -> None:
        self.steps: list[StepOutput] = []
        self.copies = 0

    def execute(self, out: StepOutput) -> list[int]:
        self.steps.append(out)
        return [7] * len(out.sampling)

    def checkpoint(self, copies) -> None:
        self.copies += len(copies)


def _sched(layout: str = "pack", *, policy: str = "last", memory="4MiB", **config):
    plan = make_tiny_plan(tiny_bamba_config(), layout, memory=memory, cache_state_slots=4)
    alloc = HybridAllocator(plan, checkpoint_policy=policy, max_model_len=4096)
    return Scheduler(alloc, SchedulerConfig(**config))


def _run(sched: Scheduler, executor: _Tokens, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not sched.has_work():
            return
        out = sched.step(executor)
        assert out.has_work, sched.stuck_message()
    raise AssertionError("did not finish")


def test_budget_and_threshold_cut_chunks_on_the_granularity():
    """A 200-token prompt under a 100-token threshold: chunks of 96 (the largest multiple of the
    48-token... granularity that fits), then the rest; the budget is shared with a decoder."""
    sched = _sched(max_num_batched_tokens=512, long_prefill_token_threshold=100)
    g = sched.align
    ex = _Tokens()
    sched.add(Seq("long", _prompt(200, 1), 2))
    _run(sched, ex)
    chunks = [n for out in ex.steps for _, _, n in out.prefill]
    assert sum(chunks) == 200
    assert all(n % g == 0 for n in chunks[:-1]) and all(n <= 100 for n in chunks)
    assert chunks[0] == 100 // g * g


def test_without_prefix_caching_the_budget_is_not_cut_to_the_block():
    """vLLM 0.33 aligns prefill chunks only in align mode: with prefix caching off a 200-token
    prompt under a 50-token threshold runs 50, 50, 50, 50 (not 32-token multiples)."""
    plan = make_tiny_plan(tiny_bamba_config(), "pack", block_size=32, cache_state_slots=4)
    alloc = HybridAllocator(plan, enable_prefix_caching=False, max_model_len=4096)
    sched = Scheduler(alloc, SchedulerConfig(long_prefill_token_threshold=50))
    ex = _Tokens()
    sched.add(Seq("plain", _prompt(200, 6), 2))
    _run(sched, ex)
    assert [n for out in ex.steps for _, _, n in out.prefill] == [50, 50, 50, 50]


@pytest.mark.parametrize("policy", ["align", "last", "marconi"])
def test_a_threshold_below_the_granularity_advances_sub_block(policy):
    """A 16-token threshold under a 32-token block (vLLM 0.33 runs it: a block too wide for one
    chunk advances sub-block, _mamba_block_aligned_split): every prompt completes in chunks of
    at most 16, states are kept only where one could be (the allocator stays consistent), and a
    resent prompt hits what it hits under a 64-token threshold."""
    from hybridkv.alloc.check import check_consistency

    hits = {}
    for threshold in (16, 64):
        plan = make_tiny_plan(tiny_bamba_config(), "pack", block_size=32, cache_state_slots=4)
        alloc = HybridAllocator(plan, checkpoint_policy=policy, max_model_len=4096)
        sched = Scheduler(alloc, SchedulerConfig(long_prefill_token_threshold=threshold))
        ex = _Tokens()
        prompt = _prompt(200, 4)
        for rid in ("first", "again"):
            sched.add(Seq(rid, prompt, 2))
            _run(sched, ex)
            check_consistency(alloc)
        chunks = [n for out in ex.steps for _, _, n in out.prefill]
        again = next(seq for out in ex.steps for seq in out.finished if seq.rid == "again")
        hits[threshold] = again.hits[0].num_cached_tokens
        assert all(0 < n <= threshold for n in chunks)
        assert sum(chunks) == 400 - hits[threshold]
    assert hits[16] == hits[64] > 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
    ],
    ids=["no-seqs", "no-budget", "negative-threshold"],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


def test_parking_needs_a_script():
    sched = _sched(park_decoders=True)
    with pytest.raises(ValueError, match="script"):
        sched.add(Seq("x", [1, 2, 3], 2))


def test_a_script_shorter_than_the_outputs_is_refused():
    # a parked decoder takes its tokens as one slice of the script: a short one would hand the
    # allocator fewer tokens than the steps it decoded
    with pytest.raises(ValueError, match="lists 1 output tokens, fewer than max_new_tokens=2"):
        Seq("x", [1, 2, 3], 2, script=[5])


def test_max_num_seqs_and_fifo_admission():
    sched = _sched(max_num_seqs=2)
    ex = _Tokens()
    seqs = [Seq(i, _prompt(10 + i, i), 3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    _run(sched, ex)
    admitted = [s.rid for out in ex.steps for s in out.admitted]
    assert admitted == list(range(5))
    assert max(len(out.decode) + len(out.prefill) for out in ex.steps) == 2
    assert all(s.outputs == [7, 7, 7] for s in seqs)


def test_preemption_recomputes_and_admits_nobody_in_that_step():
    """In a plan barely larger than one request, decoders crossing block boundaries preempt the
    newest; no request is admitted in a step that preempted (vLLM); every request still
    finishes with all its tokens, the preempted ones after a recompute of prompt + outputs."""
    plan = make_tiny_plan(tiny_bamba_config(), "pack", fit_tokens=64, max_num_seqs=3)
    alloc = HybridAllocator(plan, checkpoint_policy="last", max_model_len=4096)
    sched = Scheduler(alloc, SchedulerConfig(max_num_seqs=3))
    ex = _Tokens()
    seqs = [Seq(i, _prompt(40, 20 + i), 20) for i in range(3)]
    for s in seqs:
        sched.add(s)
    _run(sched, ex)
    assert sched.num_preemptions > 0
    assert all(not (out.preempted and out.admitted) for out in ex.steps)
    assert all(s.outputs == [7] * 20 for s in seqs)
    assert any(k > 0 for s in seqs for k in s.preempted_at)
    # a preempted request is re-admitted with its outputs so far as part of its prompt
    readmit = [
        (s, out) for out in ex.steps for s in out.admitted if s.preempted_at and len(s.hits) > 1
    ]
    assert readmit


@pytest.mark.parametrize("kind", ["list", "int32-array"])
def test_token_range_is_a_slice_of_tokens(kind):
    prompt = [5, 6, 7, 8] if kind == "list" else np.array([5, 6, 7, 8], dtype=np.int32)
    seq = Seq("r", prompt, 5)
    seq.outputs += [9, 10, 11]
    full = seq.tokens()
    for a in range(len(full) + 1):
        for b in range(a, len(full) + 2):
            assert seq.token_range(a, b) == full[a:b], (a, b)


def test_token_array_is_tokens_as_int32():
    """``Seq.token_array`` (what an admission hands the allocator) holds exactly ``tokens()``
    for a trace's int32 prompt, another NumPy dtype and a list; ids past int32 raise rather
    than wrap."""
    rng = np.random.default_rng()
    outputs = rng.integers(0, 2**31, 7).tolist()
    ids = rng.integers(0, 2**31, 50)
    for prompt in (ids.astype(np.int32), ids.astype(np.int64), ids.tolist()):
        seq = Seq(0, prompt, 7, script=outputs)
        seq.outputs = outputs[:4]
        assert seq.token_array().tolist() == seq.tokens() == [*ids.tolist(), *outputs[:4]]
    with pytest.raises(OverflowError):
        Seq(0, ids.astype(np.int64) + 2**31, 7).token_array()
