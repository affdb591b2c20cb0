"""An MTP drafter's KV caches (vLLM's ``--speculative-config '{"method": "mtp", ...}'``).

vLLM 0.33 registers the drafter's attention layers beside the target model's (``is_draft``
specs, equal to the target's, so grouped with them): Qwen3-Next's one MTP layer makes 13
full-attention layers of 12, and vLLM's grouping then gives the attention group 13 layers and
each pool block 13 pages, not 12. These tests check the configs' MTP layer counts, that grouping,
its capacity by hand, the export's layer names and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv import models
from hybridkv.cli import main
from hybridkv.layouts import make_plan
from hybridkv.models.model import HybridModel
from hybridkv.vllm_export import kv_cache_config, vllm_disagreements

CONFIGS = Path(__file__).parent / "data" / "hf_configs"
GIB = 2**30
MTP = dict(speculative_method="mtp", num_spec_tokens=2)


@pytest.mark.parametrize(
    "name, positions",
    [
        ("qwen3-next-80b-a3b", (0,)),  # no num_nextn_predict_layers: vLLM's default 1
        ("qwen3.5-27b", (0,)),  # text_config.mtp_num_hidden_layers 1
        ("nemotron-3-super-120b-a12b", (0,)),  # mtp_hybrid_override_pattern "*E"
        ("nemotron-3.5-lightning-30b-a3b", (0,)),  # mtp_layers_block_type [attention, moe]
        ("nemotron-h-56b", ()),  # no num_nextn_predict_layers: no MTP layers
        ("falcon-h1-34b", ()),  # a family without a modelled MTP drafter
    ],
)
def test_mtp_attention_layers_from_configs(name, positions):
    """The reader's count, and the zoo entry written from the same config agrees."""
    parsed = models.from_hf_config(CONFIGS / f"{name}.json")
    assert parsed.mtp_attention_layers == positions
    assert models.load(name).mtp_attention_layers == positions


def test_nemotron_pattern_positions():
    """An attention layer per ``*`` of the pattern, repeated per MTP step."""
    config = json.loads((CONFIGS / "nemotron-3-super-120b-a12b.json").read_text())
    for pattern, steps, want in (("*E", 1, (0,)), ("E*", 1, (1,)), ("*E", 2, (0, 2))):
        config.update(mtp_hybrid_override_pattern=pattern, num_nextn_predict_layers=steps)
        assert models.from_hf_config(config).mtp_attention_layers == want
    config["mtp_hybrid_override_pattern"] = "*M"
    with pytest.raises(ValueError, match="mtp_hybrid_override_pattern"):
        models.from_hf_config(config)


def test_the_drafter_joins_vllms_grouping():
    """Qwen3-Next with MTP: 13 full-attention layers (the drafter's last, named as vLLM names
    it) and 36 GDN layers. vLLM's rule (group size 13: 36 >= 1.5 x 13) makes one attention group
    of 13 and three GDN groups of 12, so a pool block holds 13 pages: 40 GiB holds
    40 GiB // (13 x 1,179,648 B) = 2,800 blocks, not 3,034."""
    plain = models.load("qwen3-next-80b-a3b")
    model = models.load("qwen3-next-80b-a3b", **MTP)
    drafter = model.layer("mtp.layers.0.attn")
    assert drafter.index == 48 and drafter.spec == plain.layer("layers.3.attn").spec
    assert model.layer_kinds == {"gated_deltanet": 36, "full_attention": 13}
    plan = make_plan(model, "inflate", memory=40 * GIB, max_num_seqs=64)
    assert sorted(len(g.layers) for g in plan.groups) == [12, 12, 12, 13]
    page = plan.block_size * 2 * 2 * 256 * 2  # tokens x K,V x heads x dim x bf16
    assert page == 1_179_648
    config = kv_cache_config(plan, model)
    assert config["num_blocks"] == 40 * GIB // (13 * page) == 2_800
    plain_config = kv_cache_config(make_plan(plain, "inflate", memory=40 * GIB), plain)
    assert plain_config["num_blocks"] == 40 * GIB // (12 * page) == 3_034
    (attention,) = [g for g in config["kv_cache_groups"] if len(g["layer_names"]) == 13]
    assert attention["layer_names"][-1] == "mtp.layers.0.self_attn.attn"
    assert not [n for n in vllm_disagreements(plan, model) if n.startswith("groups")]
    # align mode: 2 + 2 speculative + 1 prefill-checkpoint state blocks per GDN group
    assert plan.vllm.state_blocks_per_request == 5


def test_nemotron_drafter_name():
    model = models.load("nemotron-3-super-120b-a12b", **MTP)
    plan = make_plan(model, "inflate", memory=40 * GIB, max_num_seqs=16)
    names = [n for g in kv_cache_config(plan, model)["kv_cache_groups"] for n in g["layer_names"]]
    assert "mtp.layers.0.mixer.attn" in names


@pytest.mark.parametrize(
    "name, options, match",
    [
        ("bamba-9b", MTP, "no MTP drafter is modelled"),
        ("qwen3-next-80b-a3b", dict(speculative_method="mtp"), "at least 1"),
        ("qwen3-next-80b-a3b", dict(speculative_method="eagle"), "must be one of none, mtp"),
    ],
)
def test_refusals(name, options, match):
    with pytest.raises(ValueError, match=match):
        models.load(name, **options)


def test_the_drafter_is_a_runtime_option_not_zoo_data():
    """A configured model's description leaves the drafter's layers out (it keeps where they
    are), and reading it back gives the same model."""
    model = models.load("qwen3-next-80b-a3b", **MTP)
    data = model.to_dict()
    assert data["mtp_attention_layers"] == [0]
    assert all(i < 48 for m in data["mixers"] for i in m["layers"])
    back = HybridModel.from_dict(data).configure(**MTP)
    assert back.layers == model.layers
    assert models.load("qwen3-next-80b-a3b").configure(**MTP).layers == model.layers


def test_cli_speculative_config(capsys):
    args = ["plan", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']
    assert main(args) == 0
    assert "(13)]" in capsys.readouterr().out  # the attention group lists 13 layers
    for extra, message in (
        (['{"method": "eagle3", "num_speculative_tokens": 2}'], "EAGLE"),
        (['{"method": "mtp"}'], "needs num_speculative_tokens"),
        (['{"method": "mtp", "num_speculative_tokens": 2, "model": "x"}'], "model would not"),
        (["not json"], "is not JSON"),
    ):
        assert main(["plan", "--speculative-config", *extra]) == 2
        assert message in capsys.readouterr().err
    conflicting = [*args, "--num-speculative-tokens", "3"]
    assert main(conflicting) == 2
    assert "disagree" in capsys.readouterr().err


def test_the_engine_refuses_a_drafter_cache():
    pytest.importorskip("transformers")
    from hybridkv.e2e import hybrid_model_for, tiny_qwen3_next_config
    from hybridkv.e2e.states import Unservable, check_wired

    model = hybrid_model_for(tiny_qwen3_next_config(), "float32").configure(**MTP)
    plan = make_plan(model, "inflate", memory="4MiB", max_num_seqs=2, block_size=16)
    with pytest.raises(Unservable, match="runs no speculative decoding"):
        check_wired(plan)


def test_the_doctor_says_what_mtp_costs_and_what_it_does_not_model(capsys):
    """The drafter's layer is planned; the hit drop vLLM makes under MTP is not modelled, and
    the doctor (and simulate) say so rather than predict hits as if it were."""
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    assert main(["doctor", "--speculative-config", spec, "--json"]) == 0
    finding = next(f for f in json.loads(capsys.readouterr().out)["findings"] if f["key"] == "mtp")
    assert finding["data"] == {"drafter_layers": ["mtp.layers.0.attn"], "hit_drop_modelled": False}
    assert "13 attention layers" in finding["text"] and "does not model" in finding["text"]
    args = ["simulate", "--speculative-config", spec, "--trace", "shared_prefix"]
    assert main([*args, "--requests", "4"]) == 0
    assert "predicted hit rates can exceed vLLM's" in capsys.readouterr().err
