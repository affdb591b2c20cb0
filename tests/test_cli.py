"""The ``hybridkv`` command line."""

from __future__ import annotations

import json

import pytest

from hybridkv.cli import main


def test_bare_compare_runs_on_the_default(capsys):
    assert main(["compare"]) == 0
    out = capsys.readouterr().out
    for layout in ("inflate", "pack", "aggregate", "per_group", "two_level"):
        assert layout in out
    assert "% of ideal" in out


def test_models_lists_the_zoo(capsys):
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) >= 15
    assert {"qwen3-next-80b-a3b", "qwen3.5-4b"} <= {r["name"] for r in rows}


def test_plan_json_has_placements(capsys):
    argv = ["plan", "--model", "qwen3.5-397b-a17b", "--layout", "inflate", "--tp", "2"]
    assert main([*argv, "--gpu-memory", "60GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["block_size"] == 2096
    assert plan["kv_placements"] and plan["state_placements"]
    assert 0 < plan["capacity"]["fraction_of_ideal"] <= 1


def test_plan_text_and_fp8(capsys):
    argv = ["plan", "--model", "qwen3.5-4b", "--kv-dtype", "fp8", "--gpu-memory", "16GiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "block size        1056 tokens" in out


def test_plan_reads_a_config_json(tmp_path, capsys):
    config = {
        "model_type": "qwen3_next",
        "architectures": ["Qwen3NextForCausalLM"],
        "num_hidden_layers": 8,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "full_attention_interval": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "torch_dtype": "bfloat16",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["plan", "--model", str(path), "--gpu-memory", "4GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["block_size"] == 544


@pytest.mark.parametrize(
    "argv, message",
    [
        pytest.param(["plan", "--model", "qwen9"], "hybridkv models", id="unknown-model"),
        pytest.param(["plan", "--kv-dtype", "int3"], "unknown kv_dtype", id="bad-dtype"),
        pytest.param(["plan", "--tp", "3"], "tensor-parallel size 3", id="bad-tp"),
        pytest.param(
            ["plan", "--gpu-memory", "1GiB", "--max-num-seqs", "4096"], "too small", id="too-small"
        ),
        pytest.param(
            ["plan", "--block-size", "24", "--layout", "per_group"],
            "kernel alignment",
            id="bad-block",
        ),
    ],
)
def test_errors_are_one_clear_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridkv: error:") and message in err
