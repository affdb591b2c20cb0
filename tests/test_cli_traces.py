"""Real traces from the command line: ``hybridkv simulate`` and ``advise`` with ``--trace
mooncake`` or a ``.jsonl`` file, the trace options, what the output states, and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv.cli import main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_mooncake_states_how_it_read_the_trace(capsys):
    code, out, _ = _run(
        capsys, "simulate", "--trace", "mooncake", "--requests", "30", "--rate-scale", "0.05"
    )
    assert code == 0
    assert "mooncake_synthetic: 30 requests" in out
    assert "timestamps in milliseconds (Mooncake's format" in out
    assert "arrivals / 0.05" in out and "shared length read as 'blocks'" in out
    assert "attention-only with unlimited memory" in out and "with the same memory" in out
    assert "state checkpoints" in out
    # where the pool's bytes were, from the simulator's memory breakdown samples
    line = next(x for x in out.splitlines() if x.startswith("pool on average"))
    assert "cached and reachable" in line and "owned but empty" in line and "free" in line


@pytest.mark.parametrize("policy", ["hash_boundary", "periodic"])
def test_simulate_json(capsys, policy):
    code, out, _ = _run(
        capsys,
        "simulate",
        "--trace",
        "mooncake",
        "--requests",
        "25",
        "--shared-length",
        "continuation",
        "--policy",
        policy,
        "--checkpoint-interval",
        "1024",
        "--json",
    )
    assert code == 0
    got = json.loads(out)
    assert set(got) == {"schema", "command", "config", "trace", "result", "bounds"}
    assert got["schema"] == 1 and got["command"] == "simulate"
    assert got["config"]["policy"] == policy and got["config"]["checkpoint_interval"] == 1024
    assert got["trace"]["shared_length"] == "continuation"
    assert got["trace"]["time_scale"] == 1e-3 and got["trace"]["requests"] == 25
    b = got["bounds"]
    assert 0 <= b["attention_only_same_memory"] <= b["attention_only_unlimited"] <= 1
    assert got["result"]["finished"] == 25


def test_simulate_a_jsonl_in_seconds(capsys, tmp_path):
    p = tmp_path / "mine.jsonl"
    p.write_text(
        "\n".join(
            json.dumps({"timestamp": t, "input_length": 300, "output_length": 4}) for t in range(5)
        )
    )
    code, out, _ = _run(capsys, "simulate", "--trace", str(p), "--json")
    assert code == 0
    got = json.loads(out)
    assert got["trace"]["time_unit"].startswith("seconds")
    assert got["trace"]["duration_s"] == 4.0


def test_advise_header_states_the_trace(capsys):
    code, out, _ = _run(capsys, "advise", "--trace", "mooncake", "--requests", "6")
    assert code == 0
    assert "timestamps in milliseconds" in out and "shared length read as 'blocks'" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trace", "chat"], "neither a workload"),
        (["--trace", "multi_turn_chat", "--rate-scale", "2"], "--rate-scale applies to trace"),
        (
            ["--trace", "agentic", "--time-scale", "1", "--shared-length", "continuation"],
            "--time-scale, --shared-length apply to trace files",
        ),
        (["--trace", "missing.jsonl"], "no such file: missing.jsonl"),
        (["--trace", "mooncake", "--rate-scale", "0"], "rate_scale must be a finite number > 0"),
        (["--trace", "mooncake", "--requests", "0"], "--requests must be at least 1, got 0"),
        (
            ["--trace", "mooncake", "--policy", "last", "--checkpoint-interval", "512"],
            "checkpoint_interval applies to the periodic, hash_boundary and hash_ladder",
        ),
        # 0 is not "the default": the default is the flag left out
        (
            ["--trace", "mooncake", "--hash-block-size", "0"],
            "--hash-block-size 0: hash_block_size must be an integer >= 1, got 0",
        ),
    ],
    ids=[
        "unknown-name",
        "rate-on-generated",
        "two-options-on-generated",
        "missing-file",
        "zero-rate",
        "zero-requests",
        "interval-on-last",
        "zero-hash-unit",
    ],
)
def test_errors(capsys, argv, message):
    code, out, err = _run(capsys, "simulate", *argv)
    assert code == 2 and out == ""
    assert message in err and "Traceback" not in err


def test_reader_assumptions_are_shown(capsys, tmp_path):
    """A config.json without torch_dtype plans as bf16, and the CLI says it assumed so."""
    from pathlib import Path

    src = Path(__file__).parent / "data" / "hf_configs" / "qwen3-next-80b-a3b.json"
    cfg = json.loads(src.read_text())
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, out, err = _run(capsys, "compare", "--model", str(path), "--json")
    assert code == 0
    assert "hybridkv: note:" in err and "bfloat16 assumed" in err
    assert "bfloat16 assumed" in json.loads(out)["config"]["model_doubts"]


def test_long_request_error_names_the_fix(capsys, tmp_path):
    p = tmp_path / "long.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "input_length": 400_000, "output_length": 2}))
    code, _, err = _run(
        capsys, "simulate", "--trace", str(p), "--gpu-memory", "4GiB", "--max-num-seqs", "4"
    )
    assert code == 2
    assert "cannot fit in the plan's memory even alone" in err and "--gpu-memory" in err


def test_compare_reports_a_layout_that_does_not_fit(capsys):
    code, out, _ = _run(
        capsys, "compare", "--model", "qwen3.5-4b", "--gpu-memory", "16GiB", "--kv-dtype", "fp8"
    )
    assert code == 0
    assert "aggregate does not fit: 16.00 GiB is too small" in out and "per_group" in out
    code, out, _ = _run(
        capsys, "compare", "--model", "qwen3.5-4b", "--gpu-memory", "16GiB", "--json"
    )
    got = json.loads(out)
    assert [e["layout"] for e in got["errors"]] == ["aggregate"]
    assert got["errors"][0]["too_small"] is True
    assert "aggregate" not in [r["layout"] for r in got["layouts"]]
    code, _, err = _run(capsys, "compare", "--model", "qwen3.5-4b", "--gpu-memory", "1GiB")
    assert code == 2 and "too small" in err


def test_compare_tells_a_refused_layout_from_one_that_does_not_fit(capsys):
    """GLM-5-Next in vLLM's cache formats has one layout, vLLM's packed inflate: compare plans
    it and says the others are not planned (and why), not that they do not fit."""
    example = Path(__file__).resolve().parent.parent / "examples" / "glm5_next-defaults.json"
    args = ["compare", "--model", str(example), "--cache-formats", "vllm", "--gpu-memory", "80GiB"]
    code, out, _ = _run(capsys, *args)
    assert code == 0 and "inflate " in out
    for layout in ("pack", "aggregate", "per_group", "two_level"):
        assert f"{layout} is not planned: cache_formats='vllm'" in out
    assert "does not fit" not in out
    code, out, _ = _run(capsys, *args, "--json")
    got = json.loads(out)
    assert [r["layout"] for r in got["layouts"]] == ["inflate"]
    assert {e["too_small"] for e in got["errors"]} == {False}
