"""An MTP drafter's KV caches (vLLM's ``--speculative-config '{"method": "mtp", ...}'``).

vLLM 0.33 registers the drafter's attention layers beside the target model's (``is_draft``
specs, equal to the target's, so grouped with them): Qwen3-Next's one MTP layer makes 13
full-attention layers of 12, and vLLM's grouping then gives the attention group 13 layers and
each pool block 13 pages, not 12. These tests check the configs' MTP layer counts, that grouping,
its capacity by hand, the export's layer names and the refusals.

The drafter's KV at a position is built from the next token, so vLLM 0.33 hashes every unit with
the token(s) after it (lookahead block hashes, ``num_hash_lookahead_tokens``) where 0.32 dropped
the last block of each hit: both are modelled (hashes, the allocator's hits, align's checkpoint
positions, the doctor's predictions); the drop's own tests are in ``test_eagle_block_drop.py``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from alloc_serving import serve_prefill

from hybridkv import models
from hybridkv.alloc import AllocatorOptions, ConfigError, HybridAllocator
from hybridkv.alloc.check import check_consistency
from hybridkv.alloc.hashing import NONE_HASH, extend_unit_hashes, get_hash_fn, token_array
from hybridkv.cli import main
from hybridkv.layouts import VllmTarget, make_plan
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


def test_the_doctor_says_what_mtp_costs_and_what_vllm_does_to_hits(capsys):
    """The drafter's layer is planned; vLLM 0.33's lookahead hashes and vLLM 0.32's block drop
    are modelled and said so, in the doctor and in simulate's note."""
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    assert main(["doctor", "--speculative-config", spec, "--json"]) == 0
    finding = next(f for f in json.loads(capsys.readouterr().out)["findings"] if f["key"] == "mtp")
    assert finding["data"] == {
        "drafter_layers": ["mtp.layers.0.attn"],
        "hit_drop_modelled": True,
        "hash_lookahead_tokens": 1,
        "eagle_block_drop": False,
    }
    assert "13 attention layers" in finding["text"] and "lookahead block hashes" in finding["text"]
    assert "modelled in these predictions" in finding["text"]
    old = ["doctor", "--speculative-config", spec, "--vllm-version", "0.32", "--json"]
    assert main(old) == 0
    finding = next(f for f in json.loads(capsys.readouterr().out)["findings"] if f["key"] == "mtp")
    assert finding["data"]["hit_drop_modelled"] is True and finding["data"]["eagle_block_drop"]
    assert "EAGLE's block drop" in finding["text"] and "modelled in these" in finding["text"]
    args = ["simulate", "--speculative-config", spec, "--trace", "shared_prefix"]
    assert main([*args, "--requests", "4"]) == 0
    assert "lookahead block hashes" in capsys.readouterr().err


# ---- lookahead hashes ---------------------------------------------------------------------


def _hashes(tokens: list[int], h: int, lookahead: int, upto: int | None = None) -> list[bytes]:
    fn = get_hash_fn("sha256")
    upto = len(tokens) if upto is None else upto
    return extend_unit_hashes([], token_array(tokens), upto, h, b"", fn, lookahead)


@pytest.mark.parametrize("lookahead", [1, 3])
def test_a_lookahead_hash_covers_the_tokens_after_its_unit(lookahead):
    """Unit ``i`` exists once the ``L`` tokens after it do, and changes with them only; hashing
    as tokens arrive gives the same list as hashing them at once."""
    rng = random.Random(lookahead)
    h = 4
    tokens = [rng.randrange(1000) for _ in range(6 * h + 2)]
    full = _hashes(tokens, h, lookahead)
    assert len(full) == (len(tokens) - lookahead) // h
    assert len(_hashes(tokens[: 2 * h + lookahead - 1], h, lookahead)) == 1
    assert len(_hashes(tokens[: 2 * h + lookahead], h, lookahead)) == 2
    fn = get_hash_fn("sha256")
    unit0 = token_array(tokens[: h + lookahead]).tobytes()
    assert full[0] == fn(NONE_HASH + unit0)  # the unit and the L tokens after it
    assert full[0] != _hashes(tokens, h, 0)[0]
    changed = list(tokens)
    changed[2 * h + lookahead - 1] += 1  # the last token unit 1's hash covers
    other = _hashes(changed, h, lookahead)
    assert other[:1] == full[:1] and other[1] != full[1]
    grown: list[bytes] = []
    for n in range(len(tokens) + 1):
        extend_unit_hashes(grown, token_array(tokens[:n]), n, h, b"", fn, lookahead)
    assert grown == full


def _qwen35(memory: str = "8GiB", **runtime):
    model = models.load("qwen3.5-4b", **runtime)
    return model, make_plan(model, "inflate", memory=memory, max_num_seqs=16)


@pytest.mark.parametrize("h", [16, None])
def test_a_prefix_shared_up_to_a_block_boundary_hits_a_block_earlier_under_mtp(h):
    """vLLM 0.33's rule on Qwen3.5-4B's 544-token blocks (align, vLLM's layout): a prompt that
    shares exactly two blocks with a cached one hits both without MTP and only when one more
    token agrees under MTP (the cached unit's hash covers the token after it); a resend hits the
    same either way (the replay boundary leaves a token to recompute)."""
    rng = random.Random(h)
    for method, lookahead in (("none", 0), ("mtp", 1)):
        _, plan = _qwen35(speculative_method=method, num_spec_tokens=1)
        B = plan.block_size
        assert plan.vllm.hash_lookahead_tokens == lookahead
        options = AllocatorOptions(
            hash_block_size=h or B, max_model_len=1 << 16, prefill_checkpoint_alignment=None
        )
        a = HybridAllocator(plan, options)
        assert a.lookahead == lookahead  # "auto": the plan's vLLM rules
        tokens = [rng.randrange(1, 50_000) for _ in range(2 * B + 10)]
        serve_prefill(a, "first", tokens)
        other = [50_001 + i for i in range(40)]  # tokens no prompt had
        assert a.find_longest_cache_hit([*tokens, 7]) == 2 * B
        exact = a.find_longest_cache_hit(tokens[: 2 * B] + other)
        one_more = a.find_longest_cache_hit(tokens[: 2 * B + 1] + other)
        assert one_more == 2 * B
        assert exact == (0 if lookahead else 2 * B)  # no state at one block: nothing


def test_lookahead_keeps_hybridkv_layouts_consistent():
    """Every checkpoint policy on a hybridkv layout under lookahead hashes: random prompts that
    share prefixes of random lengths, the consistency checker after every step, and a hit never
    longer than the prefix the new prompt shares with a cached one minus the lookahead."""
    from hybridkv.alloc.policies import POLICIES

    rng = random.Random(0)
    model, _ = _qwen35(speculative_method="mtp", num_spec_tokens=1)
    plan = make_plan(model, "per_group", memory="2GiB", max_num_seqs=8)
    base = [rng.randrange(1, 50_000) for _ in range(400)]
    for policy in POLICIES:
        a = HybridAllocator(
            plan,
            AllocatorOptions(checkpoint_policy=policy, max_model_len=4096, hash_block_size=16),
        )
        assert a.lookahead == 1
        seen: list[list[int]] = []
        for i in range(12):
            shared = rng.choice([0, 16, 32, 100, 160, 400])
            tokens = base[:shared] + [
                rng.randrange(1, 50_000) for _ in range(rng.randrange(8, 90))
            ]
            longest = max((_common(tokens, s) for s in seen), default=0)
            hit = a.find_longest_cache_hit(tokens)
            assert hit <= max(0, longest - 1), (policy, i, hit, longest)
            serve_prefill(a, f"r{i}", tokens)
            seen.append(tokens)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_vllm_rules_for_mtp_hits():
    """vLLM 0.33: a lookahead of ``num_prefill_lookahead_tokens`` (1, or the speculative tokens
    for multi-module MTP); vLLM 0.32: the block drop; nothing without MTP or prefix caching."""
    qwen = models.load("qwen3-next-80b-a3b")

    def rules(model: HybridModel, **target):
        return VllmTarget(**target).resolve(model)

    mtp = qwen.configure(speculative_method="mtp", num_spec_tokens=3)
    assert (rules(mtp).hash_lookahead_tokens, rules(mtp).eagle_block_drop) == (1, False)
    assert (
        rules(mtp, version="0.32").hash_lookahead_tokens,
        rules(mtp, version="0.32").eagle_block_drop,
    ) == (0, True)
    assert rules(mtp, enable_prefix_caching=False).hash_lookahead_tokens == 0
    assert rules(qwen.configure(num_spec_tokens=3)).hash_lookahead_tokens == 0  # ngram-like
    two = dict(json.loads((CONFIGS / "qwen3-next-80b-a3b.json").read_text()))
    two["num_nextn_predict_layers"] = 2  # two MTP modules: multi-module MTP
    two_modules = models.from_hf_config(two, speculative_method="mtp", num_spec_tokens=3)
    assert rules(two_modules).hash_lookahead_tokens == 3
    one_token = models.from_hf_config(two, speculative_method="mtp", num_spec_tokens=1)
    assert rules(one_token).hash_lookahead_tokens == 1
    # Qwen3.5's drafter config carries no num_nextn_predict_layers: vLLM counts one module
    q35 = models.load("qwen3.5-27b", speculative_method="mtp", num_spec_tokens=3)
    assert rules(q35).hash_lookahead_tokens == 1


def test_hash_lookahead_option():
    with pytest.raises(ConfigError, match="hash_lookahead_tokens"):
        AllocatorOptions(hash_lookahead_tokens=-1)
    with pytest.raises(ConfigError, match="hash_lookahead_tokens"):
        AllocatorOptions(hash_lookahead_tokens=True)
    _, plan = _qwen35()
    assert AllocatorOptions().for_plan(plan).hash_lookahead_tokens == 0
    assert AllocatorOptions(hash_lookahead_tokens=2).for_plan(plan).hash_lookahead_tokens == 2


def test_doctor_predicts_the_lookahead_cost(capsys):
    """A workload whose shared prefix is exactly three of Qwen3-Next's 576-token blocks: vLLM
    0.33 under MTP serves two of them (the third's hash covers a token the prompts do not
    share), without MTP all three; the doctor's as-given prediction says so."""
    flags = ["doctor", "--prompt-len", "3000", "--shared-prefix", "1728", "--json"]
    rates = []
    for extra in ([], ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}']):
        assert main([*flags, *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["block_size"] == 576
        rates.append(next(r for r in out["remedies"] if r["key"] == "as_given")["token_hit_rate"])
    without, under = rates
    assert without > under > 0
    assert (
        main([*flags, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    finding = {f["key"]: f for f in out["findings"]}
    assert finding["min_hit"]["data"]["min_shared_tokens"] == 577  # a block and its next token
    assert "shorter than 577 tokens" in finding["min_hit"]["text"]
    # the shared prefix of each later prompt: two whole blocks that the next token proves
    assert (
        finding["align_checkpoint"]["data"]["whole_block_fraction"]
        < finding["align_checkpoint"]["data"]["shared_fraction"]
    )
    # the hits are whole blocks: three against two of each later prompt's 3,000 tokens
    assert under / without == pytest.approx(2 / 3, abs=0.01)


def test_speculative_switches_decide_the_hit_rule(capsys):
    """vLLM's ``disable_eagle_block_drop`` (plain hashes: hits as without MTP) and
    ``disable_lookahead_block_hashes`` (back to the block drop) are read from
    ``--speculative-config``; a value that is not a bool is refused by name."""
    flags = ["doctor", "--prompt-len", "3000", "--shared-prefix", "1728", "--json"]

    def doctor(**switches):
        spec = json.dumps({"method": "mtp", "num_speculative_tokens": 1, **switches})
        assert main([*flags, "--speculative-config", spec]) == 0
        out = json.loads(capsys.readouterr().out)
        mtp = next(f for f in out["findings"] if f["key"] == "mtp")
        rate = next(r for r in out["remedies"] if r["key"] == "as_given")["token_hit_rate"]
        return mtp, rate

    assert main(flags) == 0
    plain = next(
        r for r in json.loads(capsys.readouterr().out)["remedies"] if r["key"] == "as_given"
    )["token_hit_rate"]
    mtp, rate = doctor(disable_eagle_block_drop=True)
    assert rate == plain and mtp["data"]["hash_lookahead_tokens"] == 0
    assert "disable_eagle_block_drop" in mtp["text"]
    mtp, dropped = doctor(disable_lookahead_block_hashes=True)
    assert mtp["data"]["eagle_block_drop"] and mtp["data"]["hit_drop_modelled"]
    assert "EAGLE's block drop" in mtp["text"]
    assert dropped < plain  # a block of every hit given back
    mtp, rate = doctor()
    assert rate < plain and mtp["data"]["hash_lookahead_tokens"] == 1
    old = json.dumps(
        {"method": "mtp", "num_speculative_tokens": 1, "disable_lookahead_block_hashes": True}
    )
    assert main([*flags, "--vllm-version", "0.32", "--speculative-config", old]) == 2
    assert "vLLM 0.33 switch" in capsys.readouterr().err
    bad = json.dumps({"method": "mtp", "num_speculative_tokens": 1, "disable_eagle_block_drop": 1})
    assert main([*flags, "--speculative-config", bad]) == 2
    assert "disable_eagle_block_drop must be true or false" in capsys.readouterr().err


def test_mtp_turns_a_one_block_shared_prefix_into_zero_hits(capsys):
    """vLLM #45238 reports hybrid prefix hits dropping to 0% and that speculative decoding also
    triggers it. Under MTP a shared prefix of exactly one block (Qwen3.5-4B: 576 tokens, 64
    requests of 1,000) hits nothing in vLLM 0.33 (the block's hash covers a token the prompts do
    not share), where without MTP every later request hits it; the doctor says it is a problem
    and predicts the switch that restores the hits (plain hashes)."""
    flags = ["doctor", "--model", "qwen3.5-4b", "--prompt-len", "1000", "--shared-prefix", "576"]
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'

    def run(*extra):
        assert main([*flags, *extra, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        return out, {r["key"]: r for r in out["remedies"]}

    out, remedies = run()
    assert out["block_size"] == 576 and remedies["as_given"]["token_hit_rate"] > 0.5
    plain_rate = remedies["as_given"]["token_hit_rate"]
    out, remedies = run("--speculative-config", spec)
    assert remedies["as_given"]["token_hit_rate"] == 0.0
    assert (
        next(f for f in out["findings"] if f["key"] == "align_checkpoint")["severity"] == "problem"
    )
    fix = remedies["mtp_plain_hashes"]
    assert json.loads(fix["flags"][1]) == {
        "method": "mtp",
        "num_speculative_tokens": 2,
        "disable_eagle_block_drop": True,
    }
    assert fix["token_hit_rate"] == plain_rate
    assert main([*flags, "--speculative-config", spec]) == 0  # the text form quotes the JSON
    assert '--speculative-config \'{"method": "mtp"' in capsys.readouterr().out


def test_the_export_tags_the_drafters_group_only_under_the_block_drop():
    """vLLM 0.33 sets ``is_eagle_group`` on the groups holding the drafter's layers only when
    it drops a block of every hit for them (``use_eagle_block_drop``: lookahead hashes turned
    off); with its default lookahead hashes, and without MTP, no group is tagged."""
    for switches, tagged in (({}, []), ({"disable_lookahead_block_hashes": True}, [3])):
        target = VllmTarget(**switches)
        model = models.load("qwen3-next-80b-a3b", **MTP)
        plan = make_plan(model, "inflate", memory="40GiB", target=target)
        groups = kv_cache_config(plan, model)["kv_cache_groups"]
        assert [i for i, g in enumerate(groups) if g["is_eagle_group"]] == tagged
        for i in tagged:
            assert any(n.startswith("mtp.") for n in groups[i]["layer_names"])


@pytest.mark.parametrize("h", [None, 16])
def test_a_decode_state_on_a_block_boundary_is_cached_once_the_next_token_is_known(h):
    """vLLM 0.33 under MTP, align keeping a state at every block (retention ``None``): a decode
    step ending on a block boundary computes the state there, but the unit's lookahead hash
    covers the token after it, which the step has not sampled yet. vLLM keeps the state block in
    the request's table and caches it once the hash exists (the next step), so a next chat turn
    resumes from that block; hybridkv copies the state at once and keys it then. An answer that
    ends on the boundary leaves the state unkeyed, and it is freed with the request."""
    rng = random.Random(h)
    _, plan = _qwen35(speculative_method="mtp", num_spec_tokens=1)
    B = plan.block_size
    options = AllocatorOptions(
        hash_block_size=h or B,
        max_model_len=1 << 16,
        prefill_checkpoint_alignment=None,
        prefix_cache_retention_interval=None,
        evict_unreachable=False,
    )
    for answer_len, decode_state_cached in ((B, True), (B - 100 + 1, False)):
        a = HybridAllocator(plan, options)
        assert a.lookahead == 1
        prompt = [rng.randrange(1, 50_000) for _ in range(B + 100)]
        answer = [rng.randrange(1, 50_000) for _ in range(answer_len)]
        a.add_request("turn-1", prompt)
        while (start := a.num_tokens("turn-1")) < len(prompt):
            n = a.prefill_chunk("turn-1", len(prompt) - start, 8192)
            assert n > 0 and a.allocate_slots("turn-1", n)
            a.take_state_copies()
        for token in answer[:-1]:  # the last token is sampled, never computed
            a.append_tokens("turn-1", [token])
            assert a.allocate_slots("turn-1", 1)
            a.take_state_copies()
            check_consistency(a)
        a.free("turn-1")
        check_consistency(a)
        # the last decode step ended at B + 100 + answer_len - 1 == 2B in the second case:
        # its state's hash needs the token after 2B, which never came, so only the prompt's
        # states are found
        hit = a.find_longest_cache_hit([*prompt, *answer, *range(1, 300)])
        prompt_hit = a.find_longest_cache_hit([*prompt, *range(50_001, 50_300)])
        assert B <= prompt_hit < 2 * B
        assert hit == (2 * B if decode_state_cached else prompt_hit)
