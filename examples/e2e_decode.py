"""Serve a tiny random Bamba (Mamba-2 + attention) and Qwen3-Next (Gated DeltaNet + attention)
out of hybridkv memory plans, and check the tokens against transformers alone.

Block ids come from HybridAllocator; K/V live in the plan's pages (write_kv_cache,
paged_prefill_attention, paged_decode_attention), recurrent states in its state slots
(gather/scatter/copy_states); the second request reuses the first one's cached prefix.
Run: python examples/e2e_decode.py   (CPU: the Triton interpreter; see the README for the
measured run time). A progress bar over the runs shows on a terminal.
"""

import os
import sys

import torch
from tqdm import tqdm

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from hybridkv.e2e import (
    build_tiny_model,
    make_tiny_plan,
    tiny_bamba_config,
    tiny_qwen3_next_config,
)
from hybridkv.e2e.engine import Engine, hf_greedy
from hybridkv.layouts import LAYOUTS

prefix = list(range(1, 51))
prompts = {"a": [*prefix, 7, 7], "b": [*prefix, 9], "c": [5, 3, 8]}
configs = (tiny_bamba_config, tiny_qwen3_next_config)
bar = tqdm(total=len(configs) * len(LAYOUTS), desc="e2e", disable=not sys.stderr.isatty())
for make_config in configs:
    cfg = make_config()
    model = build_tiny_model(cfg)
    ref = {rid: hf_greedy(model, p, 6)[0] for rid, p in prompts.items()}
    for layout in LAYOUTS:
        bar.set_postfix_str(f"{cfg.model_type} {layout}")
        plan = make_tiny_plan(cfg, layout, state_slots_per_seq=2, cache_state_slots=4)
        engine = Engine(model, plan)  # cache memory starts as NaN: unwritten reads would show
        engine.add_request("a", prompts["a"], 6)
        engine.step()  # "a" prefills (and checkpoints its state) before "b" arrives
        out = engine.generate({"b": prompts["b"], "c": prompts["c"]}, 6)
        out["a"] = engine.finished["a"].output
        hit = engine.finished["b"].hits[0]
        tqdm.write(
            f"{cfg.model_type:10s} {layout:10s} block {plan.block_size:2d}  "
            f"same tokens as transformers: {out == ref}  "
            f"b reused {hit.num_cached_tokens} tokens, {len(hit.state_copies)} state checkpoint(s)"
        )
        bar.update()
bar.close()
