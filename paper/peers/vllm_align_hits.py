"""align's hits and prefill chunks against vLLM's own ``KVCacheManager``, request by request.

vLLM is never committed here and never installed into the project's environment: run this with
a vLLM wheel's python importable (0.32.0 or 0.33.0; no GPU needed; its Python dependencies must
import, as for :mod:`paper.peers.vllm_qwen4_planner`)::

    pip download vllm==0.33.0 --no-deps -d /tmp/vllm033
    (cd /tmp/vllm033 && unzip -q -o vllm-*.whl 'vllm/*')
    PYTHONPATH=.:/tmp/vllm033 python -m paper.peers.vllm_align_hits

Qwen3.5-4B with one MTP token (align; hybridkv's ``inflate`` plan of the imported vLLM's block
size: 528 tokens under 0.32, 576 under 0.33) is served by both sides, one request after another
(each prefilled to its end, its answer decoded one token a step, then freed): vLLM's side is its
own ``KVCacheManager`` (one full-attention group, the drafter's, and one Mamba group in
``align`` mode, built from vLLM's spec classes; the head counts do not enter a hit) with its
prefill chunks cut by its own ``Scheduler._mamba_block_aligned_split``, called on a namespace
holding the attributes ``Scheduler.__init__`` derives; hybridkv's side is
:class:`hybridkv.alloc.HybridAllocator` with its ``prefill_chunk`` (what the scheduler asks).
Each request's hit and every chunk boundary are compared for every :data:`MODES` entry of the
version (under 0.32 EAGLE's block drop on and off; under 0.33 MTP's lookahead hashes, the drop
with ``disable_lookahead_block_hashes``, and no MTP), at hash units of one block and of 16
tokens (partial hits), under the retention intervals 0 (vLLM's default), ``None`` (every block)
and two blocks, and under 0.33 also with the Gated DeltaNet prefill exporting states from inside
a chunk (FlashInfer's, ``prefill_checkpoint_alignment`` from ``get_mamba_prefill_checkpoint_grid``:
the block, or ``lcm(h, 64)``) and without (the Triton prefill; 0.32's layers never export). The
requests (:func:`request_sets`): random prefixes of one long shared text followed by 0-20 fresh
tokens (so the prompt-tail states land inside blocks and on block boundaries), a mix of
whole-block, near-block and unshared prefixes, and multi-turn chats whose answers cross block
boundaries (where the retention interval decides which decode states a next turn finds). Writes
``vllm-align-hits-<version>.json`` / ``.md`` (``--out``, default
``paper/results/vllm-align-hits``); exits non-zero on any disagreement but those where vLLM's
hit is on a state no step computed at its position (counted apart).
"""

from __future__ import annotations

import argparse
import inspect
import math
import random
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request

from hybridkv import models
from hybridkv.alloc import AllocatorOptions, HybridAllocator
from hybridkv.alloc.check import check_consistency
from hybridkv.layouts import VllmTarget, make_plan

from ..provenance import run_meta, write_results

RESULTS = Path(__file__).parents[1] / "results" / "vllm-align-hits"
MAX_MODEL_LEN = 1 << 16
#: the scheduler's token budget per step (a prompt longer than this is chunked by it too)
MAX_TOKENS_PER_STEP = 8192
#: pool size in blocks, far more than the prompts fill: no eviction, so hits show the rules
NUM_BLOCKS = 2000
VOCAB = 50_000

#: a request: its prompt and the tokens it samples (the last one is sampled, never computed)
Served = tuple[list[int], list[int]]


@dataclass(frozen=True)
class Mode:
    """How MTP meets the prefix cache in one vLLM version: ``target`` plans hybridkv's side,
    ``drop`` is EAGLE's block drop, ``lookahead`` the tokens each hash also covers."""

    name: str
    target: dict
    drop: bool
    lookahead: int


#: per vLLM version (major.minor): the modes compared
MODES = {
    "0.32": (
        Mode("drop", dict(version="0.32"), drop=True, lookahead=0),
        # disable_eagle_block_drop, or a model without a drafter
        Mode("no-drop", dict(version="0.32"), drop=False, lookahead=0),
    ),
    "0.33": (
        Mode("lookahead", dict(version="0.33"), drop=False, lookahead=1),
        Mode(
            "drop",
            dict(version="0.33", disable_lookahead_block_hashes=True),
            drop=True,
            lookahead=0,
        ),
        Mode("no-mtp", dict(version="0.33"), drop=False, lookahead=0),
    ),
}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def request_sets(num_sets: int, block: int) -> list[tuple[str, list[Served]]]:
    """``num_sets`` sets of 40 one-token answers to prefixes of one shared 3,000-token text
    with 0-20 fresh tokens; one set of 30 prompts sharing 0 to 5 blocks (whole blocks, a block
    and a few tokens, just under a block) followed by 5-700 fresh ones; and four chats of 8
    turns (each turn's prompt: the last turn's prompt and answer, then 30-700 new tokens;
    answers of 1-900 tokens, decoded one token a step, so they cross block boundaries)."""
    sets = []
    for seed in range(num_sets):
        rng = random.Random(100 + seed)
        base = _tokens(rng, 3000)
        prefixes = [
            (base[: rng.randrange(1, 3000)] + _tokens(rng, rng.choice([0, 0, 1, 3, 20])), [1])
            for _ in range(40)
        ]
        sets.append((f"prefixes-{seed}", prefixes))
    rng = random.Random(1)
    B = block
    base = _tokens(rng, 6 * B)
    mixed = []
    for _ in range(30):
        shared = rng.choice([0, 16, B - 28, B, B + 4, 2 * B, 3 * B + 16, 4 * B, 5 * B - 1])
        mixed.append((base[:shared] + _tokens(rng, rng.randrange(5, 700)), [1]))
    sets.append(("mixed", mixed))
    for seed in range(4):
        rng = random.Random(200 + seed)
        chat, context = [], []
        for _ in range(8):
            prompt = context + _tokens(rng, rng.randrange(30, 700))
            answer = _tokens(rng, rng.randrange(1, 900))
            chat.append((prompt, answer))
            context = prompt + answer
        sets.append((f"chat-{seed}", chat))
    return sets


def export_grid(block: int, hash_block_size: int) -> int:
    """vLLM 0.33's ``get_mamba_prefill_checkpoint_grid`` for FlashInfer's GDN prefill: the
    block, or ``lcm(h, 64)`` with a finer hash unit."""
    return block if hash_block_size == block else math.lcm(hash_block_size, 64)


class VllmSide:
    """vLLM's ``KVCacheManager`` and prefill split for one configuration."""

    def __init__(
        self,
        block_size: int,
        hash_block_size: int,
        mode: Mode,
        export: int | None,
        retention: int | None,
    ):
        B = block_size
        attention = FullAttentionSpec(
            block_size=B, num_kv_heads=4, head_size=256, dtype=torch.bfloat16
        )
        state = MambaSpec(
            block_size=B,
            shapes=((16, 128), (16, 128, 128)),
            dtypes=(torch.bfloat16, torch.float32),
            mamba_cache_mode="align",
            num_speculative_blocks=1,
            num_prefill_checkpoint_blocks=int(export is not None),
            prefill_checkpoint_alignment=export,
        )
        groups = [
            KVCacheGroupSpec(["attn"], attention, is_eagle_group=mode.drop),
            KVCacheGroupSpec(["gdn"], state),
        ]
        config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=groups,
            prefix_cache_retention_interval=retention,
        )
        lookahead = {}
        if "num_hash_lookahead_tokens" in inspect.signature(KVCacheManager).parameters:
            lookahead = dict(num_hash_lookahead_tokens=mode.lookahead)
        else:
            assert mode.lookahead == 0, "this vLLM has no lookahead hashes"
        self.manager = KVCacheManager(
            config,
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=B,
            hash_block_size=hash_block_size,
            enable_caching=True,
            use_eagle=mode.drop,
            num_prefill_lookahead=1,  # one MTP token
            **lookahead,
        )
        # what Scheduler.__init__ derives and _mamba_block_aligned_split reads
        coordinator = self.manager.coordinator
        partial = hash_block_size < B and coordinator.enable_partial_hash_hits
        self.scheduler = types.SimpleNamespace(
            cache_config=types.SimpleNamespace(block_size=B),
            hash_block_size=hash_block_size,
            block_size=B,
            use_eagle_block_drop=mode.drop,
            num_hash_lookahead_tokens=mode.lookahead,
            mamba_has_prefill_checkpoint_blocks=export is not None,
            mamba_prefill_checkpoint_alignment=export,
            max_num_scheduled_tokens=MAX_TOKENS_PER_STEP,
            scheduler_config=types.SimpleNamespace(long_prefill_token_threshold=0),
            mamba_partial_cache_hit=partial,
            mamba_shared_prefix_checkpoint=partial and self.manager.mamba_shared_prefix_checkpoint,
        )
        self.hash_block_size, self.block_size, self.export = hash_block_size, B, export
        self.drop, self.lookahead = mode.drop, mode.lookahead
        # HybridKVCacheCoordinator's hit alignment: the hash unit with partial hits
        self.hit_alignment = hash_block_size if partial else B
        #: hashes of the prefixes at whose end the state layers computed a state
        self.computed: set = set()
        self.hit_was_computed = True
        self.hasher: Callable = get_request_block_hasher(
            hash_block_size,
            sha256,
            **({"num_hash_lookahead_tokens": mode.lookahead} if lookahead else {}),
        )

    def _split(self, request: Request, num_new: int, num_new_local: int = 0) -> int:
        return Scheduler._mamba_block_aligned_split(
            self.scheduler, request, num_new, num_new_local, 0
        )

    def serve(
        self, rid: str, prompt: list[int], answer: list[int]
    ) -> tuple[int, list[tuple[int, int]]]:
        """Admit ``prompt``, prefill it, decode ``answer`` one token a step, free: its hit and
        prefill chunks. :attr:`hit_was_computed` says whether the state the hit resumes from
        was ever computed at that position on this prefix."""
        mgr = self.manager
        request = Request(
            rid,
            list(prompt),
            SamplingParams(max_tokens=len(answer)),
            None,
            block_hasher=self.hasher,
        )
        mgr.new_step_starts()
        blocks, hit, boundary = mgr.get_computed_blocks(request)
        h = self.hash_block_size
        self.hit_was_computed = hit == 0 or request.block_hashes[hit // h - 1] in self.computed
        request.shared_prefix_boundary = boundary
        num_new = self._split(request, min(len(prompt) - hit, MAX_TOKENS_PER_STEP), hit)
        assert num_new > 0
        out = mgr.allocate_slots(
            request,
            num_new,
            num_new_computed_tokens=hit,
            new_computed_blocks=blocks,
            num_lookahead_tokens=1,
        )
        assert out is not None, "vLLM's pool is full: raise NUM_BLOCKS"
        request.num_computed_tokens = hit + num_new
        chunks = [(hit, hit + num_new)]
        while request.num_computed_tokens < request.num_tokens:
            mgr.new_step_starts()
            start = request.num_computed_tokens
            num_new = self._split(
                request, min(request.num_tokens_with_spec - start, MAX_TOKENS_PER_STEP)
            )
            assert num_new > 0
            assert mgr.allocate_slots(request, num_new, num_lookahead_tokens=1) is not None
            chunks.append((start, start + num_new))
            request.num_computed_tokens += num_new
        # where the state layers computed a state: every step's end, and the state the
        # worker exports from inside a chunk (vLLM's own compute_mamba_prefill_checkpoints)
        states = [end for _, end in chunks] + [self._exported(s, e) for s, e in chunks]
        for i, token in enumerate(answer):
            request.append_output_token_ids(token)
            if i == len(answer) - 1:
                break  # the last sampled token finishes the request uncomputed
            mgr.new_step_starts()
            assert mgr.allocate_slots(request, 1, num_lookahead_tokens=1) is not None
            request.num_computed_tokens += 1
            states.append(request.num_computed_tokens)
        known = len(request.block_hashes)
        self.computed.update(
            request.block_hashes[p // h - 1]
            for p in states
            if p and p % h == 0 and p // h <= known
        )
        mgr.free(request)
        return hit, chunks

    def _exported(self, start: int, end: int) -> int:
        """The position of the state the worker exports from inside the chunk, or 0."""
        if self.export is None:
            return 0
        from vllm.model_executor.layers.mamba.checkpoint import (
            compute_mamba_prefill_checkpoints,
        )

        offsets, _ = compute_mamba_prefill_checkpoints(
            [end],
            [end - start],
            hash_block_size=self.hash_block_size,
            mamba_block_size=self.block_size,
            checkpoint_alignment=self.export,
            drop_eagle_block=self.drop,
            cache_hit_alignment_tokens=self.hit_alignment,
            num_hash_lookahead_tokens=self.lookahead,
        )
        return start + offsets[0] if offsets[0] else 0


class HybridkvSide:
    """hybridkv's allocator for the same configuration."""

    def __init__(
        self, plan, hash_block_size: int, mode: Mode, export: int | None, retention: int | None
    ):
        options = AllocatorOptions(
            hash_block_size=hash_block_size,
            max_model_len=MAX_MODEL_LEN,
            prefill_checkpoint_alignment=export,
            prefix_cache_retention_interval=retention,
            # vLLM keeps the KV past the last state until it ages out (a junction probe reads it)
            evict_unreachable=False,
            # the plan's rules where the mode is the target's own, else the mode's
            eagle_block_drop="auto" if mode.drop else False,
            hash_lookahead_tokens="auto" if mode.lookahead else 0,
        )
        self.allocator = HybridAllocator(plan, options)
        resolved = self.allocator.options
        assert resolved.eagle_block_drop is mode.drop, resolved
        assert resolved.hash_lookahead_tokens == mode.lookahead, resolved

    def serve(
        self, rid: str, prompt: list[int], answer: list[int]
    ) -> tuple[int, list[tuple[int, int]]]:
        a = self.allocator
        hit = a.find_longest_cache_hit(prompt)
        a.add_request(rid, prompt)
        chunks = []
        while (start := a.num_tokens(rid)) < len(prompt):
            n = a.prefill_chunk(rid, len(prompt) - start, MAX_TOKENS_PER_STEP)
            assert n > 0 and a.allocate_slots(rid, n)
            a.take_state_copies()
            chunks.append((start, start + n))
        for token in answer[:-1]:  # as the scheduler: the last one finishes the request
            a.append_tokens(rid, [token])
            assert a.allocate_slots(rid, 1)
            a.take_state_copies()
        a.free(rid)
        check_consistency(a)
        return hit, chunks


def compare(num_sets: int) -> tuple[str, list[dict]]:
    """Every configuration of the imported vLLM's version: its version and one row each."""
    version = ".".join(vllm.__version__.split(".")[:2])
    if version not in MODES:
        raise SystemExit(f"vLLM {vllm.__version__} imported; this compares 0.32 or 0.33")
    init_none_hash(sha256)
    model = models.load("qwen3.5-4b", speculative_method="mtp", num_spec_tokens=1)
    rows = []
    for mode in MODES[version]:
        plan = make_plan(
            model, "inflate", memory="8GiB", max_num_seqs=16, target=VllmTarget(**mode.target)
        )
        B = plan.block_size
        for set_name, requests in request_sets(num_sets, B):
            for h in (B, 16):
                # 0.32's GDN layers never export; 0.33's do under FlashInfer's prefill
                exports = (None,) if version == "0.32" else (None, export_grid(B, h))
                for export in exports:
                    for retention in (0, None, 2 * B):
                        rows.append(
                            _compare_one(plan, mode, set_name, requests, h, export, retention)
                        )
    return version, rows


def _compare_one(plan, mode: Mode, set_name: str, requests, h, export, retention) -> dict:
    B = plan.block_size
    vllm_side = VllmSide(B, h, mode, export, retention)
    ours = HybridkvSide(plan, h, mode, export, retention)
    hits, our_hits, diffs, uncomputed = [], [], [], 0
    for i, (prompt, answer) in enumerate(requests):
        want = vllm_side.serve(f"r{i}", prompt, answer)
        got = ours.serve(f"r{i}", prompt, answer)
        hits.append(want[0])
        our_hits.append(got[0])
        uncomputed += not vllm_side.hit_was_computed
        if want != got:
            diffs.append(
                {
                    "request": i,
                    "prompt": len(prompt),
                    "vllm": want,
                    "hybridkv": got,
                    # vLLM resumed from a state block no step computed at that position
                    "vllm_hit_uncomputed": not vllm_side.hit_was_computed,
                }
            )
    print(
        f"{mode.name:9} {set_name:11} h={h:<4} export={export!s:5} retention={retention!s:5} "
        f"{len(requests)} requests, {sum(hits):,} hit tokens, {len(diffs)} disagreements, "
        f"{uncomputed} vLLM hits on uncomputed states",
        flush=True,
    )
    return {
        "mode": mode.name,
        "prompts": set_name,
        "block_size": B,
        "hash_block_size": h,
        "eagle_block_drop": mode.drop,
        "hash_lookahead_tokens": mode.lookahead,
        "prefill_checkpoint_alignment": export,
        "retention_interval": retention,
        "requests": len(requests),
        "hit_tokens": sum(hits),
        "hybridkv_hit_tokens": sum(our_hits),
        "hits_inside_a_block": sum(1 for x in hits if x % B),
        "vllm_hits_uncomputed": uncomputed,
        "disagreements": diffs,
    }


def markdown(rows: list[dict], meta: dict) -> str:
    version = meta["versions"]["vllm"]
    lines = [
        f"# align's hits and chunks: hybridkv against vLLM {version}'s KVCacheManager",
        "",
        f"`python -m paper.peers.vllm_align_hits` at `{meta['commit']}`, {meta['date']}, "
        f"vLLM {version}. Qwen3.5-4B, one MTP token, {rows[0]['block_size']}-token blocks; "
        "the hit and the prefill chunk boundaries of every request (export: the state layers' "
        "prefill checkpoint alignment, None where they cannot export).",
        "",
        "| mode | prompts | hash unit | export | retention | requests | hit tokens (vLLM) "
        "| hit tokens (hybridkv) | hits inside a block | disagreements "
        "| of which vLLM's hit is on an uncomputed state |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['prompts']} | {r['hash_block_size']} "
            f"| {r['prefill_checkpoint_alignment']} | {r['retention_interval']} "
            f"| {r['requests']} | {r['hit_tokens']:,} | {r['hybridkv_hit_tokens']:,} "
            f"| {r['hits_inside_a_block']} | {len(r['disagreements'])} "
            f"| {_uncomputed(r)} |"
        )
    total = {
        k: sum(r[k] for r in rows)
        for k in ("requests", "hit_tokens", "hybridkv_hit_tokens", "hits_inside_a_block")
    }
    lines.append(
        f"| all {len(rows)} | | | | | {total['requests']:,} | {total['hit_tokens']:,} "
        f"| {total['hybridkv_hit_tokens']:,} | {total['hits_inside_a_block']:,} "
        f"| {sum(len(r['disagreements']) for r in rows)} "
        f"| {sum(_uncomputed(r) for r in rows)} |"
    )
    lines += [
        "",
        "A hit on an uncomputed state: vLLM's hit ends at a block whose cached state block holds "
        "a state no step of the request that cached it computed at that position (the peer "
        "tracks the position of every state it computes: chunk ends, exports, decode steps). "
        "hybridkv does not follow those hits, so they are counted apart and do not fail the run.",
    ]
    return "\n".join(lines) + "\n"


def _uncomputed(row: dict) -> int:
    """The row's disagreements where vLLM resumed from a state no step computed there."""
    return sum(1 for d in row["disagreements"] if d["vllm_hit_uncomputed"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", type=int, default=6, help="shared-prefix prompt sets")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    version, rows = compare(args.sets)
    meta = run_meta(f"align's hits and chunks against vLLM {version}'s KVCacheManager", argv)
    meta["versions"]["vllm"] = vllm.__version__
    path = write_results(args.out, f"vllm-align-hits-{version}", meta, rows, markdown(rows, meta))
    total = sum(len(r["disagreements"]) for r in rows)
    uncomputed = sum(_uncomputed(r) for r in rows)
    print(
        f"{total} disagreements in {len(rows)} configurations ({uncomputed} where vLLM's hit "
        f"is on a state no step computed there); wrote {path}"
    )
    return 1 if total > uncomputed else 0


if __name__ == "__main__":
    sys.exit(main())
