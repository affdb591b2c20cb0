"""Tiny random Bamba from transformers plus its hybridkv memory plan for every layout.

Paged attention / state-slot decoding through hybridkv is not wired yet; this shows the pieces.
Run: python examples/e2e_decode.py
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from hybridkv.e2e import build_tiny_model, make_tiny_plan, tiny_bamba_config
from hybridkv.layouts import LAYOUTS

cfg = tiny_bamba_config()
model = build_tiny_model(cfg)
prompt = torch.tensor([[1, 5, 9, 2, 7]])
with torch.no_grad():
    out = model.generate(prompt, max_new_tokens=8, do_sample=False)
print("transformers greedy tokens:", out[0].tolist())
for layout in LAYOUTS:
    plan = make_tiny_plan(cfg, layout)
    bufs = plan.allocate("cpu")
    k, _ = plan.kv_views(bufs, "layers.1.attn")
    conv = plan.state_views(bufs, "layers.0.mixer")["conv"]
    print(f"{layout:10s} k_cache {tuple(k.shape)}  conv slots {tuple(conv.shape)}")

# Prefill logits with attention through write_kv_cache + paged_prefill_attention (per_group plan).
from hybridkv.e2e import attn  # noqa: E402

plan = make_tiny_plan(cfg, "per_group")
bufs = plan.allocate("cpu")
with torch.no_grad():
    ref = model(prompt).logits
attn.register()
attn.set_context(attn.PagedContext(plan, bufs, torch.tensor([[1]])))
for m in model.modules():
    if hasattr(m, "config"):
        m.config._attn_implementation = attn.ATTN_NAME
with torch.no_grad():
    got = model(prompt).logits
print("paged prefill vs transformers max abs diff:", (got - ref).abs().max().item())
