"""The ``hybridkv`` command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.cli import main
from hybridkv.layouts import make_plan
from hybridkv.models import load

ROOT = Path(__file__).resolve().parents[1]


def test_bare_compare_runs_on_the_default(capsys):
    assert main(["compare"]) == 0
    out = capsys.readouterr().out
    for layout in ("inflate", "pack", "aggregate", "per_group", "two_level"):
        assert layout in out
    assert "% of ideal" in out


def test_models_lists_the_zoo(capsys):
    assert main(["models", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == 1 and out["command"] == "models"
    rows = out["models"]
    assert len(rows) >= 15
    assert {"qwen3-next-80b-a3b", "qwen3.5-4b"} <= {r["name"] for r in rows}
    # machine-readable: numbers and booleans, not formatted strings
    row = next(r for r in rows if r["name"] == "qwen3.5-4b")
    assert row["kv_bytes_per_token"] == 32768 and isinstance(row["state_bytes_per_seq"], int)
    assert row["mixers"] == {"gated_deltanet": 24, "full_attention": 8}
    assert row["verified"] in (True, False)
    assert main(["models"]) == 0
    assert "KV/token" in capsys.readouterr().out


def test_compare_json_records_what_it_compared(capsys):
    argv = ["compare", "--model", "qwen3.5-4b", "-tp", "2", "--gpu-memory", "20GiB", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["model"] == "qwen3.5-4b" and out["config"]["tp_size"] == 2
    assert out["config"]["memory_bytes"] == 20 * 2**30
    assert out["config"]["vllm_target"]["vllm_version"] == "0.33"
    assert {r["layout"].split("(")[0] for r in out["layouts"]} == {
        "inflate",
        "pack",
        "aggregate",
        "per_group",
        "two_level",
    }


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("hybridkv 0.")


def test_plan_json_has_placements(capsys):
    argv = ["plan", "--model", "qwen3.5-397b-a17b", "--layout", "inflate", "--tp", "2"]
    assert main([*argv, "--gpu-memory", "60GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # vLLM 0.33's default (prefix caching on): a multiple of lcm(16, 64) on Hopper
    assert plan["block_size"] == 2112
    assert plan["vllm"]["resolved"]["mamba_cache_mode"] == "align"
    assert plan["block_size_rule"].startswith("vLLM 0.33")
    assert plan["kv_placements"] and plan["state_placements"]
    assert 0 < plan["capacity"]["capacity_fraction"] <= 1
    assert main([*argv, "--gpu-memory", "60GiB", "--json", "--no-enable-prefix-caching"]) == 0
    assert json.loads(capsys.readouterr().out)["block_size"] == 2096


def test_plan_text_and_fp8(capsys):
    argv = ["plan", "--model", "qwen3.5-4b", "--kv-dtype", "fp8", "--gpu-memory", "16GiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "block size        1088 tokens" in out
    assert "prefix caching on, mamba_cache_mode=align" in out


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
    assert plan["block_size"] == 576  # the figure: vLLM 0.33 with prefix caching
    argv = ["plan", "--model", str(path), "--gpu-memory", "4GiB", "--json"]
    assert main([*argv, "--vllm-version", "0.32"]) == 0
    assert json.loads(capsys.readouterr().out)["block_size"] == 544
    assert main([*argv, "--gpu", "a100-80gb"]) == 0  # Triton GDN prefill: no 64-token alignment
    assert json.loads(capsys.readouterr().out)["block_size"] == 544


def _plan_json(argv, capsys):
    assert main(["plan", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_vllm_flag_names_match_hybridkv_flags(capsys):
    ours = ["--tp", "2", "--kv-dtype", "fp8", "--conv-dtype", "float16"]
    ours += ["--ssm-dtype", "float32", "--num-spec-tokens", "2"]
    vllm = ["-tp", "2", "--kv-cache-dtype", "fp8", "--mamba-cache-dtype", "float16"]
    vllm += ["--mamba-ssm-cache-dtype", "float32", "--num-speculative-tokens", "2"]
    base = ["--model", "qwen3.5-4b", "--gpu-memory", "20GiB"]
    a, b = _plan_json(base + ours, capsys), _plan_json(base + vllm, capsys)
    assert a == b
    assert a["tp_size"] == 2 and a["kv_dtype"] == "fp8_e4m3"
    assert a["vllm"]["resolved"]["num_speculative_blocks"] == 2
    # align mode with FlashInfer GDN: 2 + 2 speculative + 1 prefill checkpoint state blocks
    assert a["vllm"]["resolved"]["state_blocks_per_request"] == 5
    long = _plan_json([*base, "--tensor-parallel-size", "2"], capsys)
    assert long["tp_size"] == 2


def test_gpu_memory_utilization(capsys):
    base = ["--model", "qwen3.5-4b", "--gpu-memory-utilization", "0.9"]
    plan = _plan_json([*base, "--gpu", "h100", "--model-memory", "10GB"], capsys)
    # the H100 preset is the 81,559 MiB the device reports, not the datasheet's 80 GB
    assert plan["config"]["memory_bytes"] == int(0.9 * 81_559 * 2**20) - 10 * 10**9
    plan = _plan_json([*base, "--gpu-total-memory", "100GiB"], capsys)
    assert plan["config"]["memory_bytes"] == int(0.9 * 100 * 2**30)
    assert plan["vllm"]["gpu"] == "hopper"


def test_max_model_len_and_mamba_cache_mode(capsys):
    base = ["--model", "nemotron-h-8b", "--gpu-memory", "40GiB", "--max-model-len", "32768"]
    plan = _plan_json([*base, "--mamba-cache-mode", "none"], capsys)
    assert plan["vllm"]["resolved"]["mamba_cache_mode"] == "none"
    assert plan["vllm"]["resolved"]["max_model_len"] == 32768
    assert plan["vllm"]["resolved"]["state_blocks_per_request"] == 1
    plan = _plan_json(base, capsys)
    # Mamba-2 exports a prefill checkpoint block in align mode (vLLM 0.33): 2 + 0 + 1
    assert plan["vllm"]["resolved"]["state_blocks_per_request"] == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        pytest.param(["plan", "--model", "qwen9"], "hybridkv models", id="unknown-model"),
        pytest.param(["plan", "--kv-dtype", "int3"], "unknown kv_dtype", id="bad-dtype"),
        pytest.param(["plan", "--tp", "3"], "tensor-parallel size 3", id="bad-tp"),
        pytest.param(
            ["plan", "--gpu-memory", "1GiB", "--max-num-seqs", "4096"], "too small", id="too-small"
        ),
        pytest.param(["plan", "--gpu-memory", "80"], "has no unit", id="memory-without-unit"),
        pytest.param(["plan", "--gpu-memory", "1e99GiB"], "more memory than", id="memory-typo"),
        pytest.param(
            ["plan", "--layout", "pack", "--pack-size", "1000"], "at most 12", id="pack-too-big"
        ),
        pytest.param(
            ["advise", "--trace", "tests/data/no-such-trace.jsonl"],
            "no such file",
            id="missing-trace",
        ),
        pytest.param(
            ["plan", "--gpu-memory", "1GiB", "--gpu-memory-utilization", "0.9"],
            "give one of them",
            id="two-budgets",
        ),
        pytest.param(
            ["plan", "--gpu-memory-utilization", "0.9"], "--gpu-total-memory", id="no-gpu-size"
        ),
        pytest.param(
            ["plan", "--gpu-memory-utilization", "0.1", "--gpu", "h100", "--model-memory", "9GiB"],
            "leaves nothing",
            id="utilization-too-low",
        ),
        pytest.param(
            ["plan", "--no-enable-prefix-caching", "--mamba-cache-mode", "align"],
            "needs prefix caching",
            id="align-without-prefix-caching",
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
    err = capsys.readouterr().err.strip().splitlines()
    # notes (how a unit or a preset was read) may come first; the error is one line
    assert all(line.startswith("hybridkv: note:") for line in err[:-1]), err
    assert err[-1].startswith("hybridkv: error:") and message in err[-1]


def test_a_block_size_off_the_kernel_block_is_raised_on_a_hybrid_refused_without_states(
    capsys, tmp_path
):
    """vLLM 0.33's ``_align_hybrid_block_size`` takes ``max(kernel block, --block-size)`` as its
    unit and rounds the block it needs up to every backend's kernel block, so on a hybrid a
    ``--block-size`` of 24 is raised, not refused: Qwen3-Next's unit is lcm(24, 64) = 192 (align
    mode, FlashInfer's GDN checkpoints), and 192 x cdiv(1,097,728 B, 192 x 2,048 B) = 576. A
    model with no state (GraniteSWA, attention only) keeps the block it is given, so 24 is
    refused there with the multiples that would work."""
    assert main(["plan", "--block-size", "24", "--layout", "inflate"]) == 0
    out = capsys.readouterr().out
    assert "block size        576 tokens" in out and "--block-size 24" in out
    from hybridkv.e2e.families import TINY_CONFIGS

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_CONFIGS["granite_swa"]().to_dict()))
    assert main(["plan", "--model", str(path), "--block-size", "24", "--layout", "inflate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "not a multiple of the attention kernel block (16 tokens); use 16 or 32" in err


def test_plan_format_vllm_is_a_kv_cache_config(capsys):
    argv = ["plan", "--model", "qwen3-next-80b-a3b", "--gpu-memory", "40GiB", "--format", "vllm"]
    assert main(argv) == 0
    config = json.loads(capsys.readouterr().out)
    assert set(config) >= {"num_blocks", "kv_cache_tensors", "kv_cache_groups"}
    specs = [g["kv_cache_spec"] for g in config["kv_cache_groups"]]
    assert {s["kind"] for s in specs} == {"FullAttentionSpec", "MambaSpec"}
    assert {s["block_size"] for s in specs} == {576}  # align mode: the Mamba block is the block
    names = [n for g in config["kv_cache_groups"] for n in g["layer_names"]]
    assert "model.layers.3.self_attn.attn" in names and "model.layers.0.linear_attn" in names
    # a layout vLLM cannot express is one clear error line
    assert main([*argv, "--layout", "per_group"]) == 2
    assert "inflate" in capsys.readouterr().err


def test_plan_format_vllm_exports_glm5_next_as_vllm_packs_it(tmp_path, capsys):
    """``--format vllm`` plans GLM-5-Next in vLLM's cache formats (its k-pooled indexer and tail
    ring, packed block-outermost); ``--cache-formats vllm`` shows that plan as text, and
    ``--cache-formats transformers`` with ``--format vllm`` is refused with what to do."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(transformers.Glm5NextConfig().to_json_string())
    argv = ["plan", "--model", str(path), "--gpu-memory", "64GiB", "--max-num-seqs", "8"]
    assert main([*argv, "--format", "vllm"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["kv_cache_layout"] == "BLHNC" and config["num_blocks"] == 1_312
    assert [len(g["layer_names"]) for g in config["kv_cache_groups"]] == [9, 9, 8, 8, 22, 11]
    assert main([*argv, "--cache-formats", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "indexer_ring" in out and "BLHNC" in out
    assert main([*argv, "--format", "vllm", "--cache-formats", "transformers"]) == 2
    assert "plan with VllmTarget(cache_formats='vllm')" in capsys.readouterr().err
    assert main([*argv, "--cache-formats", "vllm", "--layout", "pack"]) == 2
    assert "which is layout 'inflate'" in capsys.readouterr().err


def test_a_config_file_under_any_name_is_read(tmp_path, capsys):
    path = tmp_path / "my-model.cfg"
    path.write_text((ROOT / "tests/data/hf_configs/zamba-7b-v1.json").read_text())
    assert main(["plan", "--model", str(path), "--gpu-memory", "40GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_name"]


def test_output_piped_into_head_is_not_a_traceback():
    cmd = [sys.executable, "-m", "hybridkv.cli", "plan", "--json"]
    # the reader exits before the command writes (it takes a second to import), as `head -0`
    head = "pass"
    producer = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    consumer = subprocess.run([sys.executable, "-c", head], stdin=producer.stdout, timeout=600)
    producer.stdout.close()
    _, err = producer.communicate(timeout=600)
    assert consumer.returncode == 0
    assert producer.returncode == 0
    assert b"Traceback" not in err


# ---- a CLI that never misleads: flags that cannot act are errors, units are said -------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--model-memory", "10GiB"], "used only with --gpu-memory-utilization"),
        (["plan", "--gpu-total-memory", "80GiB"], "used only with --gpu-memory-utilization"),
        (["plan", "--pack-size", "3"], "applies to --layout pack only, not 'inflate'"),
        (["plan", "--json", "--format", "vllm"], "pick one"),
        (["simulate", "--trace", "shared_prefix", "--requests", "0"], "at least 1, got 0"),
        (
            ["simulate", "--trace", "shared_prefix", "--layout", "per_group", "--pack-size", "2"],
            "applies to --layout pack only",
        ),
    ],
)
def test_flags_that_cannot_act_are_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_decimal_units_are_read_and_said(capsys):
    """``40G`` is 40 x 10^9 bytes (as ``40GB``), said on stderr; ``40Gi`` is 40 GiB."""
    assert main(["plan", "--gpu-memory", "40G", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["config"]["memory_bytes"] == 40 * 10**9
    assert "'40G' read as 40 x 10^9 bytes = 37.25 GiB" in captured.err
    assert main(["plan", "--gpu-memory", "40Gi", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["config"]["memory_bytes"] == 40 * 2**30
    assert "read as" not in captured.err


def test_bad_files_and_values_give_one_line_errors(tmp_path, capsys):
    binary = tmp_path / "trace.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    assert main(["simulate", "--trace", str(binary)]) == 2
    assert f"{binary} is not a text file" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--gpu-memory", "-1GiB"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--flag=value" in err and len(err.strip().splitlines()) == 2


def test_max_model_len_below_the_block_is_noted(capsys):
    assert main(["plan", "--model", "qwen3.5-4b", "--max-model-len", "100"]) == 0
    assert "max_model_len 100 is below the 576-token block" in capsys.readouterr().out


@pytest.mark.parametrize("gpu, total", [("h200", 150_109_880_320), ("h100", 81_559 * 2**20)])
def test_gpu_presets_are_the_reported_totals(gpu, total, capsys):
    """vLLM sizes --gpu-memory-utilization against what the device reports, not the datasheet:
    an H200 reports 150,109,880,320 B (139.80 GiB), not 141e9; where the figure comes from is
    said."""
    argv = ["plan", "--gpu", gpu, "--gpu-memory-utilization", "0.9", "--model-memory", "20GiB"]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["config"]["memory_bytes"] == int(0.9 * total) - 20 * 2**30
    assert f"--gpu {gpu}: {total:,} B" in captured.err and "measured:" in captured.err


def test_the_cli_does_not_import_torch():
    """plan, compare, doctor and --version need no tensors: the CLI starts without torch (about
    2 s of the ~3 s a call took when it imported it)."""
    code = (
        "import sys; from hybridkv.cli import main; "
        "main(['plan', '--model', 'qwen3.5-4b', '--json']); "
        "main(['doctor', '--model', 'qwen3.5-4b', '--json']); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_every_flag_has_help_and_its_default():
    """Every option of every command has help; every option that takes a value says its
    default (what leaving it unset does, where that is None; a default of 0 is shown too), per
    command (--max-num-seqs is 256 for plan and doctor, 64 for simulate and advise)."""
    import argparse

    from hybridkv.cli import build_parser

    parser = build_parser()
    commands = next(
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    for name, sub in commands.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            assert action.help, f"{name} {action.option_strings[0]} has no help"
            if not isinstance(action, argparse._StoreTrueAction):
                assert "default" in action.help, f"{name} {action.option_strings[0]}"
        text = sub.format_help()
        if "--seed" in text:
            assert "(default: 0)" in " ".join(text.split()), name
        if "--max-num-seqs" in text:
            want = 64 if name in ("simulate", "advise") else 256
            assert f"(default: {want})" in " ".join(text.split()), name


def test_doctor_refuses_layout_flags_it_cannot_use(capsys):
    assert main(["doctor", "--model", "qwen3.5-4b", "--pack-size", "2"]) == 2
    assert "--pack-size: doctor checks vLLM's own layout" in capsys.readouterr().err


def test_plan_format_vllm_exports_qwen4_exp_as_vllm_packs_it(capsys):
    """``--format vllm`` plans examples/qwen4_exp-qsa.json in vLLM's cache formats (BLNHC, 576
    tokens a block, 12,165,120 B a block at 64 GiB: tests/test_vllm_export.py derives them);
    ``--indexer-kv-dtype fp8`` halves the compressed keys (11,980,800 B a block: 5,735 blocks);
    transformers' formats are refused for export with what to do."""
    pytest.importorskip("transformers")
    example = Path(__file__).resolve().parent.parent / "examples" / "qwen4_exp-qsa.json"
    argv = ["plan", "--model", str(example), "--gpu-memory", "64GiB", "--max-num-seqs", "8"]
    assert main([*argv, "--format", "vllm"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["kv_cache_layout"] == "BLNHC" and config["num_blocks"] == 5_648
    assert [len(g["layer_names"]) for g in config["kv_cache_groups"]] == [2, 10, 10, 10, 10, 20]
    assert main([*argv, "--format", "vllm", "--indexer-kv-dtype", "fp8"]) == 0
    assert json.loads(capsys.readouterr().out)["num_blocks"] == 5_735 == 2**36 // 11_980_800
    assert main([*argv, "--format", "vllm", "--cache-formats", "transformers"]) == 2
    assert "QSACompressedKeyCache" in capsys.readouterr().err


def test_one_vocabulary_across_the_json_of_every_command(capsys):
    """plan, simulate, advise and doctor name the same things the same way (README, "JSON
    output"): the vLLM settings are ``vllm_target``, a plan's capacity is ``token_capacity`` and
    ``capacity_fraction``, a hit rate ``token_hit_rate``; and the numbers agree across them."""
    common = ["--model", "qwen3.5-0.8b", "--gpu-memory", "4GiB", "--max-num-seqs", "32", "--json"]
    workload = ["--trace", "multi_turn_chat", "--requests", "12"]

    def run(*argv: str) -> dict:
        assert main(list(argv)) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["schema"] == 1 and out["command"] == argv[0]
        return out

    plan = run("plan", *common, "--state-slots-per-seq", "2")  # align holds 2, as simulate plans
    sim = run("simulate", *common, *workload)
    advise = run("advise", *common, *workload, "--policies", "align", "--no-progress")
    doctor = run("doctor", *common)
    for out in (plan["config"], sim["config"], advise["config"], doctor):
        assert out["vllm_target"]["vllm_version"] == "0.33"
    assert sim["result"]["token_capacity"] == plan["capacity"]["token_capacity"]
    assert sim["result"]["capacity_fraction"] == round(plan["capacity"]["capacity_fraction"], 4)
    (inflate,) = [r for r in advise["results"] if r["config"] == "inflate align"]
    assert inflate["capacity_fraction"] == sim["result"]["capacity_fraction"]
    assert 0 <= sim["result"]["token_hit_rate"] <= 1 and "token_hit_rate" in inflate
    assert inflate["state_slots_per_seq"] == 2


def test_simulate_reserves_the_state_slots_its_policy_holds(capsys):
    """simulate plans the slots a running request holds under its checkpoint policy (align keeps
    the running state and the previous step's: 2), as advise does; the flag overrides it."""
    argv = ["simulate", "--model", "qwen3.5-0.8b", "--gpu-memory", "4GiB", "--max-num-seqs",
            "32", "--trace", "multi_turn_chat", "--requests", "6", "--json"]  # fmt: skip

    def capacity(*more: str) -> int:
        assert main([*argv, *more]) == 0
        return json.loads(capsys.readouterr().out)["result"]["token_capacity"]

    def planned(slots: int) -> int:
        plan = make_plan(
            load("qwen3.5-0.8b"), "inflate", memory=4 * 2**30, max_num_seqs=32,
            state_slots_per_seq=slots,
        )  # fmt: skip
        return plan.capacity.token_capacity

    assert planned(2) < planned(1)
    assert capacity() == capacity("--policy", "align") == planned(2)
    assert capacity("--policy", "last") == planned(1)
    assert capacity("--state-slots-per-seq", "1") == planned(1)


def test_simulate_says_what_marconis_alpha_was(capsys):
    """``--marconi-alpha`` fixes Marconi's alpha or (``auto``, the default) lets the run tune it
    once; simulate says which, when and what the tuning chose, in text and JSON. A number where
    nothing evicts by Marconi's utility, a negative one or a word is refused, naming the flag."""
    argv = ["simulate", "--model", "qwen3.5-4b", "--gpu-memory", "3GiB", "--max-num-seqs", "16",
            "--trace", "multi_turn_chat", "--requests", "400", "--layout", "two_level",
            "--policy", "marconi"]  # fmt: skip
    assert main(argv) == 0
    tuned = [line for line in capsys.readouterr().out.splitlines() if "Marconi's alpha" in line]
    assert len(tuned) == 1 and tuned[0].startswith("Marconi's alpha tuned online: ")
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["result"]
    (at,) = result["alpha_tuned_at"]
    assert f"{result['marconi_alpha']:g} after {at:,} finished requests" in tuned[0]
    assert result["alpha_choices"] == [result["marconi_alpha"]] and result["alpha_tuning_s"] > 0
    assert main([*argv, "--marconi-alpha", "1.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["marconi_alpha"] == 1.5 and out["result"]["marconi_alpha"] == 1.5
    assert out["result"]["alpha_tuned_at"] == [] and out["result"]["alpha_tuning_s"] == 0.0
    # LRU eviction: no alpha line, no alpha fields
    assert main([*argv[:-1], "last"]) == 0
    assert "Marconi's alpha" not in capsys.readouterr().out
    for more, message in [
        (["--policy", "last", "--marconi-alpha", "0.5"], "--marconi-alpha 0.5: marconi_alpha"),
        (["--marconi-alpha", "-1"], "must be 'auto' or a number >= 0, got -1.0"),
        (["--marconi-alpha", "x"], "must be 'auto' or a number >= 0, got 'x'"),
    ]:
        code = None
        try:
            code = main([*argv, *more])
        except SystemExit as exc:  # argparse's own refusal of a word
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err
