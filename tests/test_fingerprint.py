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


def test_a_run_records_a_digest_per_field_and_compare_names_the_one_that_differs(tmp_path, capsys):
    task = (20, "chat", "inflate", "last")
    _, record = fingerprint.sim_fingerprint(task)
    assert set(record["parts"]) == set(fingerprint.SIM_FIELDS)
    # the run's hash is the digest of the same fields (files written before parts compare)
    from paper import figures

    r = figures._sim_run(task)
    values = [getattr(r, name) for name in fingerprint.SIM_FIELDS]
    assert record["hash"] == fingerprint._digest(*values)
    changed = dict(record, hash="0", parts={**record["parts"], "ttft_s": "0"})
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    before.write_text(json.dumps({"runs": {"r": record}}))
    after.write_text(json.dumps({"runs": {"r": changed}}))
    assert fingerprint.compare(before, after) == 1
    out = capsys.readouterr().out
    assert "differs: r (in ttft_s)" in out and "parts" not in out
