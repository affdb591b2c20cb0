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
