"""Memory maps: a unit's rows come from the plan, and every byte of a row is drawn once."""

from __future__ import annotations

import pytest

from hybridkv import models
from hybridkv.layouts import LAYOUTS, make_plan
from hybridkv.viz import unit_map


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unit_map_rows_are_the_plans_unit_rows(layout):
    model = models.load("qwen3.5-0.8b")
    plan = make_plan(model, layout, memory=2**30, max_num_seqs=2)
    for g in plan.groups:
        m = unit_map(plan, g.group_id, max_rows=100)
        rows = plan.unit_rows(g.group_id, 1)
        assert m.row_labels == tuple(r.label for r in rows)
        assert m.row_bytes == rows[0].nbytes and m.hidden_rows == 0
        for i in range(len(rows)):
            cursor = 0
            for s in (s for s in m.segments if s.row == i):
                assert s.start == cursor, "segments of a row tile it without gaps or overlaps"
                cursor = s.end
                if s.part != "padding":
                    assert s.layer_index == model.layer(s.layer).index
            assert cursor == m.row_bytes
        data = sum(n for part, n in m.bytes_by_part().items() if part != "padding")
        assert data == plan.id_data_bytes(g.group_id) * len({r.block_id for r in rows})


def test_unit_map_hides_rows_past_max_rows():
    plan = make_plan(models.load("qwen3.5-0.8b"), "per_group", memory=2**30, max_num_seqs=2)
    state = plan.state_groups[0]
    m = unit_map(plan, state.group_id, max_rows=2)
    assert len(m.row_labels) == 2
    assert m.hidden_rows == len(state.layers) - 2
    assert {s.row for s in m.segments} == {0, 1}


@pytest.mark.parametrize("layout", ["inflate", "two_level"])
def test_indexer_keys_have_their_own_colour(layout):
    # GLM-5-Next: the sparse-attention indexer's keys ride in the latent's page (inflate) or
    # have a group of their own (two_level); either way they are drawn as indexer, not latent
    from hybridkv.e2e import make_tiny_plan
    from hybridkv.e2e.families import TINY_CONFIGS
    from hybridkv.viz import PART_COLORS

    plan = make_tiny_plan(TINY_CONFIGS["glm5_next"](), layout)
    parts: dict[str, int] = {}
    for g in plan.groups:
        if not g.is_state:
            for part, nbytes in unit_map(plan, g.group_id).bytes_by_part().items():
                parts[part] = parts.get(part, 0) + nbytes
    indexers = [p for p in plan.kv_placements if p.kind == "indexer"]
    latents = [p for p in plan.kv_placements if p.kind == "mla"]
    assert indexers and latents
    assert parts["indexer"] > 0 and parts["latent"] > 0
    # one page's worth of each: the unit holds one block of every layer it serves
    per_block = {p.kind: p.k_bytes_per_block for p in plan.kv_placements}
    assert parts["indexer"] % per_block["indexer"] == 0
    assert parts["latent"] % per_block["mla"] == 0
    assert PART_COLORS["indexer"] not in (PART_COLORS["latent"], PART_COLORS["K"])
