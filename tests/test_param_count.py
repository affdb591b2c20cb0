"""Parameter counts read off a config (:mod:`hybridkv.models.param_count`): equal to the
parameters of the model transformers builds from it (real weights, tiny configs: dense, mixture
of experts, tied embeddings, a multimodal wrapper whose vision tower is left out), close to
the model cards at full size, and what lets ``hybridkv simulate`` run a ``config.json`` the zoo
does not know."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from hybridkv import costmodel, models
from hybridkv.cli import main
from hybridkv.e2e import build_tiny_model
from hybridkv.e2e.families import TINY_CONFIGS
from hybridkv.models.param_count import params_from_config

TOWERS = ("visual", "vision")


def _real_counts(model) -> tuple[int, int]:
    """(all parameters but the towers', those of routed-expert modules) of a built model;
    ``parameters()`` yields a tied weight once."""
    seen, total, routed = set(), 0, 0
    for name, module in model.named_modules():
        if any(t in name for t in TOWERS):
            continue
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
                routed += p.numel() if type(module).__name__.endswith("Experts") else 0
    return total, routed


@pytest.mark.parametrize("name", ["bamba", "qwen3_next", "granitemoehybrid", "glm5_next", "lfm2"])
def test_counts_equal_the_built_model(name):
    """Counted on the meta device from the config's dict = the parameters of the same config
    built with real weights; routed experts count top_k / num_experts of theirs."""
    cfg = TINY_CONFIGS[name]()
    model = build_tiny_model(cfg)
    got = params_from_config(cfg.to_dict())
    total, routed = _real_counts(model)
    assert got.total == total
    text = cfg.get_text_config()
    keys = ("num_experts", "n_routed_experts", "num_local_experts")
    experts = next((getattr(text, k) for k in keys if getattr(text, k, 0)), 0)
    if routed:
        k = text.num_experts_per_tok
        assert experts and got.active == total - routed + routed * k // experts
        assert f"routed experts at {k} of {experts}" in got.source
    else:
        assert got.active == total
    assert "meta device" in got.source
    if name == "glm5_next":  # its vision tower is left out, and it is not small
        tower = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
        assert tower > 0 and sum(p.numel() for p in model.parameters()) == total + tower


def test_tied_embeddings_count_once():
    cfg = TINY_CONFIGS["bamba"]()
    cfg.tie_word_embeddings = True
    tied = params_from_config(cfg.to_dict())
    cfg.tie_word_embeddings = False
    untied = params_from_config(cfg.to_dict())
    assert untied.total - tied.total == cfg.vocab_size * cfg.hidden_size


def test_full_size_counts_are_near_the_model_cards():
    """Qwen3-Next-80B-A3B's stored config: 79.7B total (card: 80B); 3.87B active, above the
    card's 3B, which leaves the embeddings out (they are 0.62B of it here)."""
    with open("tests/data/hf_configs/qwen3-next-80b-a3b.json") as f:
        got = params_from_config(json.load(f))
    card = models.load("qwen3-next-80b-a3b").params
    assert abs(got.total - card.total) / card.total < 0.01
    assert card.active < got.active < 1.35 * card.active
    assert "routed experts at 10 of 512" in got.source


def test_the_cost_model_counts_a_config_the_zoo_does_not_know():
    """A config.json the zoo has no name for gets its counts from the config (before, the
    cost model stopped with a KeyError); a zoo model keeps its card's."""
    cfg = TINY_CONFIGS["glm5_next"]().to_dict()
    model = models.from_hf_config(cfg)
    assert model.params is None
    assert costmodel.param_count(model) == params_from_config(cfg)
    zoo = models.load("qwen3-next-80b-a3b")
    assert costmodel.param_count(zoo) == zoo.params


def test_an_unknown_model_type_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="does not know model_type 'not_a_model'") as err:
        params_from_config({"model_type": "not_a_model", "hidden_size": 8})
    assert "pass params=ParamCount" in str(err.value)
    with pytest.raises(ValueError, match="no model_type"):
        params_from_config({"hidden_size": 8})


def test_simulate_runs_a_config_json_outside_the_zoo(capsys, tmp_path):
    """``hybridkv simulate --model config.json`` on GLM-5-Next's (tiny) config, which no zoo
    entry names: the run prices its steps with the counted parameters and says so."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_CONFIGS["glm5_next"]().to_dict()))
    code = main(["simulate", "--model", str(path), "--requests", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["result"]["finished"] == 8
    params = out["config"]["params"]
    assert params["source"].startswith("counted from the config") and params["active"] > 0
    assert main(["simulate", "--model", str(path), "--requests", "8"]) == 0
    assert "parameters (the roofline's):" in capsys.readouterr().out
