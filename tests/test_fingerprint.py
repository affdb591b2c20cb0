"""``paper.fingerprint``: a run's hash is deterministic, changes with what the run decided, and
``--compare`` reports runs that differ."""

from __future__ import annotations

import json

from paper import fingerprint


def test_a_run_hashes_the_same_twice_and_differs_by_policy():
    task = (20, "chat", "inflate", "last")
    key, first = fingerprint.sim_fingerprint(task)
    _, again = fingerprint.sim_fingerprint(task)
    _, other = fingerprint.sim_fingerprint((20, "chat", "inflate", "align"))
    assert key == "sim 20 / chat / inflate / last"
    assert first["hash"] == again["hash"] and first["steps"] == again["steps"] > 0
    assert other["hash"] != first["hash"]


def test_compare_lists_the_runs_that_differ(tmp_path, capsys):
    runs = {"a": {"hash": "1"}, "b": {"hash": "2"}}
    before, same, changed = (tmp_path / f"{n}.json" for n in ("before", "same", "changed"))
    before.write_text(json.dumps({"runs": runs}))
    same.write_text(json.dumps({"runs": runs}))
    changed.write_text(json.dumps({"runs": {**runs, "b": {"hash": "3"}}}))
    assert fingerprint.compare(before, same) == 0
    assert fingerprint.compare(before, changed) == 1
    assert "differs: b" in capsys.readouterr().out
