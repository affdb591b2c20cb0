"""The paged-attention context of the end-to-end engine: its views come from the plan."""

from __future__ import annotations

import pytest
import torch

from hybridkv import models
from hybridkv.e2e.attn import PagedContext
from hybridkv.layouts import LAYOUTS, make_plan


@pytest.mark.parametrize("layout", LAYOUTS)
def test_context_views_every_attention_layer_by_its_index(layout):
    # Falcon-H1 holds attention and Mamba-2 in every decoder layer
    model = models.load("falcon-h1-0.5b")
    plan = make_plan(model, layout, fit_tokens=64, max_num_seqs=1)
    buffers = plan.allocate("meta")
    ctx = PagedContext(plan, buffers, [])
    assert sorted(ctx.views) == [layer.index for layer in model.attention_layers]
    for p in plan.kv_placements:
        k, v, gid = ctx.views[p.layer_index]
        want_k, want_v = plan.kv_views(buffers, p.layer)
        assert gid == p.group_id
        assert (k.shape, k.stride(), k.storage_offset()) == (
            want_k.shape,
            want_k.stride(),
            want_k.storage_offset(),
        )
        assert isinstance(v, torch.Tensor) and v.storage_offset() == want_v.storage_offset()
