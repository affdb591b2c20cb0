"""EAGLE's block drop against vLLM 0.32's own ``KVCacheManager``, request by request, on a CPU.

vLLM is never committed here and never installed into the project's environment: run this with
the ``vllm==0.32.0`` wheel's python importable (no GPU needed; its Python dependencies must
import, as for :mod:`paper.peers.vllm_qwen4_planner`)::

    pip download vllm==0.32.0 --no-deps -d /tmp/vllm032
    (cd /tmp/vllm032 && unzip -q -o vllm-*.whl 'vllm/*')
    PYTHONPATH=.:/tmp/vllm032 python -m paper.peers.vllm_eagle_hits

Qwen3.5-4B with one MTP token under vLLM 0.32 (align; hybridkv's ``inflate`` plan of vLLM's
528-token blocks) is served by both sides, one request after another (each prefilled to its
end, its answer decoded one token a step, then freed): vLLM's side is its own
``KVCacheManager`` (one full-attention group, the drafter's, and one Mamba group in ``align``
mode, built from vLLM's spec classes; the head counts do not enter a hit) with its prefill
chunks cut by its own ``Scheduler._mamba_block_aligned_split``, called on a namespace holding
the attributes ``Scheduler.__init__`` derives; hybridkv's side is
:class:`hybridkv.alloc.HybridAllocator` with its ``prefill_chunk`` (what the scheduler asks).
Each request's hit and every chunk boundary are compared, at hash units of one block and of 16
tokens (partial hits), with the drop on and off, under the retention intervals 0 (vLLM's
default), ``None`` (every block) and two blocks. The requests (:func:`request_sets`): random
prefixes of one long shared text followed by 0-20 fresh tokens (so the prompt-tail states land
inside blocks and on block boundaries), a mix of whole-block, near-block and unshared prefixes,
and multi-turn chats whose answers cross block boundaries (where the retention interval decides
which decode states a next turn finds). Writes ``vllm-eagle-hits.json`` / ``.md`` (``--out``,
default ``paper/results/vllm-eagle-hits``); exits non-zero on any disagreement.
"""

from __future__ import annotations

import argparse
import random
import sys
import types
from collections.abc import Callable
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

RESULTS = Path(__file__).parents[1] / "results" / "vllm-eagle-hits"
MAX_MODEL_LEN = 1 << 16
#: the scheduler's token budget per step (a prompt longer than this is chunked by it too)
MAX_TOKENS_PER_STEP = 8192
#: pool size in blocks, far more than the prompts fill: no eviction, so hits show the rules
NUM_BLOCKS = 2000
VOCAB = 50_000

#: a request: its prompt and the tokens it samples (the last one is sampled, never computed)
Served = tuple[list[int], list[int]]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def request_sets(num_sets: int) -> list[tuple[str, list[Served]]]:
    """``num_sets`` sets of 40 one-token answers to prefixes of one shared 3,000-token text
    with 0-20 fresh tokens; one set of 30 prompts sharing 0-2,500 tokens (whole blocks, a
    block and a few tokens, under a block) followed by 5-700 fresh ones; and four chats of 8
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
    base = _tokens(rng, 3000)
    mixed = []
    for _ in range(30):
        shared = rng.choice([0, 16, 500, 528, 1056, 1060, 1600, 2112, 2500])
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


class VllmSide:
    """vLLM 0.32's ``KVCacheManager`` and prefill split for one configuration."""

    def __init__(self, block_size: int, hash_block_size: int, drop: bool, retention: int | None):
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
            prefill_checkpoint_alignment=None,  # 0.32's Gated DeltaNet layers never export
        )
        groups = [
            KVCacheGroupSpec(["attn"], attention, is_eagle_group=drop),
            KVCacheGroupSpec(["gdn"], state),
        ]
        config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=groups,
            prefix_cache_retention_interval=retention,
        )
        self.manager = KVCacheManager(
            config,
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=B,
            hash_block_size=hash_block_size,
            enable_caching=True,
            use_eagle=drop,
            num_prefill_lookahead=1,  # one MTP token
        )
        # what Scheduler.__init__ derives and _mamba_block_aligned_split reads
        coordinator = self.manager.coordinator
        partial = hash_block_size < B and coordinator.enable_partial_hash_hits
        self.scheduler = types.SimpleNamespace(
            cache_config=types.SimpleNamespace(block_size=B),
            hash_block_size=hash_block_size,
            block_size=B,
            use_eagle_block_drop=drop,
            mamba_has_prefill_checkpoint_blocks=False,
            mamba_prefill_checkpoint_alignment=None,
            max_num_scheduled_tokens=MAX_TOKENS_PER_STEP,
            scheduler_config=types.SimpleNamespace(long_prefill_token_threshold=0),
            mamba_partial_cache_hit=partial,
            mamba_shared_prefix_checkpoint=partial and self.manager.mamba_shared_prefix_checkpoint,
        )
        self.hasher: Callable = get_request_block_hasher(hash_block_size, sha256)

    def _split(self, request: Request, num_new: int, num_new_local: int = 0) -> int:
        return Scheduler._mamba_block_aligned_split(
            self.scheduler, request, num_new, num_new_local, 0
        )

    def serve(
        self, rid: str, prompt: list[int], answer: list[int]
    ) -> tuple[int, list[tuple[int, int]]]:
        """Admit ``prompt``, prefill it, decode ``answer`` one token a step, free: its hit and
        prefill chunks."""
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
        for i, token in enumerate(answer):
            request.append_output_token_ids(token)
            if i == len(answer) - 1:
                break  # the last sampled token finishes the request uncomputed
            mgr.new_step_starts()
            assert mgr.allocate_slots(request, 1, num_lookahead_tokens=1) is not None
            request.num_computed_tokens += 1
        mgr.free(request)
        return hit, chunks


class HybridkvSide:
    """hybridkv's allocator for the same configuration."""

    def __init__(self, plan, hash_block_size: int, drop: bool, retention: int | None):
        options = AllocatorOptions(
            hash_block_size=hash_block_size,
            max_model_len=MAX_MODEL_LEN,
            prefill_checkpoint_alignment=None,
            prefix_cache_retention_interval=retention,
            # vLLM keeps the KV past the last state until it ages out (a junction probe reads it)
            evict_unreachable=False,
            # on: the plan's rule (vLLM 0.32 under MTP); off: what vLLM does without a drafter
            eagle_block_drop="auto" if drop else False,
        )
        self.allocator = HybridAllocator(plan, options)
        assert self.allocator.options.eagle_block_drop is drop

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


def compare(num_sets: int) -> list[dict]:
    init_none_hash(sha256)
    model = models.load("qwen3.5-4b", speculative_method="mtp", num_spec_tokens=1)
    plan = make_plan(
        model, "inflate", memory="8GiB", max_num_seqs=16, target=VllmTarget(version="0.32")
    )
    B = plan.block_size
    rows = []
    for set_name, requests in request_sets(num_sets):
        for h in (B, 16):
            for drop in (True, False):
                for retention in (0, None, 2 * B):
                    vllm = VllmSide(B, h, drop, retention)
                    ours = HybridkvSide(plan, h, drop, retention)
                    hits, our_hits, diffs = [], [], []
                    for i, (prompt, answer) in enumerate(requests):
                        want = vllm.serve(f"r{i}", prompt, answer)
                        got = ours.serve(f"r{i}", prompt, answer)
                        hits.append(want[0])
                        our_hits.append(got[0])
                        if want != got:
                            diffs.append(
                                {
                                    "request": i,
                                    "prompt": len(prompt),
                                    "vllm": want,
                                    "hybridkv": got,
                                }
                            )
                    rows.append(
                        {
                            "prompts": set_name,
                            "block_size": B,
                            "hash_block_size": h,
                            "eagle_block_drop": drop,
                            "retention_interval": retention,
                            "requests": len(requests),
                            "hit_tokens": sum(hits),
                            "hybridkv_hit_tokens": sum(our_hits),
                            "hits_inside_a_block": sum(1 for x in hits if x % B),
                            "disagreements": diffs,
                        }
                    )
                    print(
                        f"{set_name:11} h={h:<4} drop={drop!s:5} retention={retention!s:5} "
                        f"{len(requests)} requests, {sum(hits):,} hit tokens, "
                        f"{len(diffs)} disagreements",
                        flush=True,
                    )
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# EAGLE's block drop: hybridkv against vLLM 0.32's KVCacheManager",
        "",
        f"`python -m paper.peers.vllm_eagle_hits` at `{meta['commit']}`, {meta['date']}, "
        f"vLLM {meta['versions']['vllm']}. Qwen3.5-4B, one MTP token, "
        f"{rows[0]['block_size']}-token blocks; hits and chunk boundaries of every request.",
        "",
        "| prompts | hash unit | drop | retention | requests | hit tokens (vLLM) "
        "| hit tokens (hybridkv) | hits inside a block | disagreements |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompts']} | {r['hash_block_size']} | {r['eagle_block_drop']} "
            f"| {r['retention_interval']} | {r['requests']} | {r['hit_tokens']:,} "
            f"| {r['hybridkv_hit_tokens']:,} | {r['hits_inside_a_block']} "
            f"| {len(r['disagreements'])} |"
        )
    total = {
        k: sum(r[k] for r in rows)
        for k in ("requests", "hit_tokens", "hybridkv_hit_tokens", "hits_inside_a_block")
    }
    lines.append(
        f"| all {len(rows)} | | | | {total['requests']:,} | {total['hit_tokens']:,} "
        f"| {total['hybridkv_hit_tokens']:,} | {total['hits_inside_a_block']:,} "
        f"| {sum(len(r['disagreements']) for r in rows)} |"
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", type=int, default=6, help="shared-prefix prompt sets")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows = compare(args.sets)
    meta = run_meta("EAGLE's block drop against vLLM 0.32's KVCacheManager", argv)
    meta["versions"]["vllm"] = vllm.__version__
    path = write_results(args.out, "vllm-eagle-hits", meta, rows, markdown(rows, meta))
    bad = sum(len(r["disagreements"]) for r in rows)
    print(f"{bad} disagreements in {len(rows)} configurations; wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
