"""Batched varlen prefill: the engine packs every prefill chunk of a step, whatever their lengths,
into one ``[1, T]`` forward (``Engine(batch_prefill=True)``, the default). Against the same
requests prefilled one chunk per forward (``batch_prefill=False``) and against transformers
alone, for every family the engine serves, each on a different layout.

The requests are built so that a packed forward holds chunks of different lengths, a chunk that
continues a request's earlier chunk (its state carried from a previous step), and a chunk that
starts after a prefix hit (its state restored from a checkpoint): three ways a recurrent state
can leak from one segment into the next, or be lost, inside the packed sequence. Cache memory is
NaN-poisoned, so a read of anything nothing wrote shows up in the logits.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

pytest.importorskip("transformers")

from hybridkv.e2e import build_tiny_model, hybrid_model_for, make_tiny_plan
from hybridkv.e2e.engine import Engine, hf_greedy
from hybridkv.e2e.families import SERVED, TINY_CONFIGS
from hybridkv.layouts import LAYOUTS
from hybridkv.sched import StepOutput

N = 3  # tokens generated per request
#: packed vs one chunk per forward: the same mixer calls on the same inputs, only the token-wise
#: layers see more rows at once (a different summation blocking at most)
TOL_SEQUENTIAL = 1e-5
TOL_TRANSFORMERS = 1e-4  # as tests/test_e2e.py: paged kernels sum in another order


#: families whose packed prefill another family's run covers, left out of the default run
#: (``HYBRIDKV_FULL_E2E=1`` runs them): GLM-5-Next packs the same NoPE MLA beside KDA as
#: Kimi-Linear, plus its indexer, and each MLA case is among the suite's slowest
COVERED = {"kimi_linear": "glm5_next"}
#: families whose packed prefill other tests cover, left out of the default run likewise, with
#: where: Qwen4-Exp's QSA prefill runs every prompt token as a row of the sparse decode kernel
#: (3.5 minutes here under the interpreter); its packing of two requests' unequal chunks into
#: one forward is served by test_e2e_families.py's serve test ("a" and "short" prefill
#: together), its chunking (a chunk continuing an earlier one) by test_e2e_qwen4.py
FULL_ONLY = {"qwen4_exp": "test_e2e_families.py serve, test_e2e_qwen4.py"}


def _cases(full: bool) -> list[tuple[str, str]]:
    """Each family on another layout (rotating), every layout used. An MLA family (Kimi-Linear,
    Bailing hybrid, GLM-5-Next), and Qwen4-Exp, whose QSA prefill runs each prompt token as a
    sparse decode row, take the first layout of its rotation with its own pool: MLA's
    latent pages are 64 tokens there and 128 on the shared-page layouts, and the prompts scale
    with them (each prompt token is a row of the MLA decode kernel, slow under the
    interpreter). Without ``full``, the families of :data:`COVERED` and :data:`FULL_ONLY` are
    left out."""
    out = []
    n = len(LAYOUTS)
    for i, name in enumerate(SERVED):
        if (name in COVERED or name in FULL_ONLY) and not full:
            continue
        order = [LAYOUTS[(i + 2 + k) % n] for k in range(n)]
        # each prompt token a row of a decode kernel: MLA's, and Qwen4-Exp's sparse QSA walk
        if {"mla", "indexer"} & set(hybrid_model_for(TINY_CONFIGS[name]()).layer_kinds):
            order = [lay for lay in order if lay in ("per_group", "two_level")]
        out.append((name, order[0]))
    return out


CASES = _cases(os.environ.get("HYBRIDKV_FULL_E2E") == "1")


def test_every_layout_is_used():
    assert {lay for _, lay in CASES} == set(LAYOUTS)
    assert all(cover in dict(CASES) for cover in COVERED.values())


@functools.cache
def _model(name: str) -> torch.nn.Module:
    return build_tiny_model(TINY_CONFIGS[name]())


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _serve(name: str, layout: str, *, batch_prefill: bool) -> tuple[Engine, list[StepOutput]]:
    """Chunks of at most ``c`` tokens, the plan's checkpoint granularity (16-64; the block for
    a model without states). First wave:
    prompts of 9, c + 13 and 3c - 2 tokens (prefilled in one, two and three steps). Second
    wave, once the first has finished: a prompt sharing the long one's first 2c tokens (a
    prefix hit) beside a fresh 13-token one."""
    model = _model(name)
    plan = make_tiny_plan(model.config, layout, state_slots_per_seq=2)
    # attention alone (GraniteSWA) has no checkpoints: its chunks are whole blocks
    c = plan.checkpoint_granularity if plan.state_groups else plan.block_size
    steps: list[StepOutput] = []
    eng = Engine(model, plan, prefill_chunk=c, batch_prefill=batch_prefill, on_step=steps.append)
    long = _prompt(3 * c - 2, seed=3)
    eng.generate({"short": _prompt(9, seed=1), "mid": _prompt(c + 13, seed=2), "long": long}, N)
    eng.generate({"hit": [*long[: 2 * c], *_prompt(11, seed=4)], "fresh": _prompt(13, seed=5)}, N)
    return eng, steps


@functools.cache
def _runs(name: str, layout: str) -> tuple:
    return _serve(name, layout, batch_prefill=True), _serve(name, layout, batch_prefill=False)


def _close(got: list[torch.Tensor], ref: list[torch.Tensor], tol: float, what: str) -> None:
    assert len(got) == len(ref) == N, what
    for step, (g, r) in enumerate(zip(got, ref)):
        assert torch.isfinite(g).all(), f"{what} step {step}: NaN read from the cache"
        err = (g - r).abs().max().item()
        assert err < tol, f"{what} step {step}: logits differ by {err}"


@pytest.mark.parametrize(("name", "layout"), CASES, ids=[f"{n}-{lay}" for n, lay in CASES])
def test_packed_prefill_matches_sequential_and_transformers(name, layout):
    (packed, packed_steps), (seq, _) = _runs(name, layout)
    for rid, r in packed.finished.items():
        s = seq.finished[rid]
        assert r.output == s.output, (
            f"{rid}: packed {r.output} != one chunk per forward {s.output}"
        )
        _close(r.logits, s.logits, TOL_SEQUENTIAL, f"{name} {rid} packed vs sequential")
        tokens, logits = hf_greedy(_model(name), r.prompt, N)
        assert r.output == tokens, f"{rid}: packed {r.output} != transformers {tokens}"
        _close(r.logits, logits, TOL_TRANSFORMERS, f"{name} {rid} packed vs transformers")

    # what the comparison covered: packed forwards of unequal chunks, a chunk continuing an
    # earlier step's, a chunk after a prefix hit, all next to each other
    multi = [s.prefill for s in packed_steps if len(s.prefill) > 1]
    assert any(len({n for _, _, n in chunks}) > 1 for chunks in multi), "no unequal chunks packed"
    assert any(start > 0 and r.rid != "hit" for chunks in multi for r, start, _ in chunks)
    hit = packed.finished["hit"].hits[0]
    assert hit.num_cached_tokens > 0
    assert bool(hit.state_copies) == bool(packed.plan.state_groups)
    assert any(r.rid == "hit" for chunks in multi for r, _, _ in chunks)
    assert packed.num_forwards < seq.num_forwards
