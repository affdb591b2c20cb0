"""Qwen4-Exp's vLLM-format export against vLLM 0.33's own planner, field by field, on a CPU.

vLLM is never committed here and never installed into the project's environment: run this with
the ``vllm==0.33.0`` wheel's python importable, e.g. unpacked into a scratch folder, in a
scratch venv that has vLLM's Python dependencies (no GPU needed)::

    pip download vllm==0.33.0 --no-deps -d /tmp/vllm033
    (cd /tmp/vllm033 && unzip -q -o vllm-*.whl 'vllm/*')
    python -m venv /tmp/vllm-venv --system-site-packages  # then pip install what vllm imports
    PYTHONPATH=.:/tmp/vllm033 /tmp/vllm-venv/bin/python -m paper.peers.vllm_qwen4_planner

For each configuration (:data:`CASES`) it builds the caches Qwen4-Exp's layers register, in
vLLM's registration order: the QSA indexer's ``QSAKeyStateCache`` and ``QSACompressedKeyCache``
as vLLM's own objects, the PLE, GDN and QSA-attention layers as bare instances of vLLM's classes
holding only the attributes their ``get_kv_cache_spec`` / ``get_state_*`` /
``get_prefill_checkpoint_alignment`` read (their ``__init__`` loads weights and kernels), and a
plain ``FullAttentionSpec`` layer on FlashAttention where the config has no indexer
(``Qwen3NextAttention``). Then vLLM's own ``MambaModelConfig.verify_and_update_config``,
``Platform.update_block_size_for_backend`` (the block size and state padding),
``customize_attention_spec``, ``resolve_kv_cache_layout``, ``get_kv_cache_groups``,
``get_kv_cache_config_from_groups``, ``resolve_kv_cache_block_sizes``,
``resolve_cache_hit_alignment_tokens`` and ``get_max_concurrency_for_kv_cache_config`` give
vLLM's config, which is compared with :func:`hybridkv.vllm_export.vllm_objects` of hybridkv's
plan: block size, layout, ``num_blocks``, every group's layer names and spec (dataclass
equality: every field of every layer's spec), every tensor, the hash and hit block sizes and
the logged concurrency. Prints one line per configuration; exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
import transformers
from torch import nn
from vllm.config.cache import CacheConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.models.qwen4_exp.common.qsa_cache import QSACompressedKeyCache, QSAKeyStateCache
from vllm.models.qwen4_exp.nvidia import model as qmodel
from vllm.models.qwen4_exp.nvidia.ple_layer import Qwen4ExpPLELayer
from vllm.models.qwen4_exp.nvidia.qsa import (
    Qwen4ExpQSAAttention,
    Qwen4ExpQSAFlashAttentionBackend,
)
from vllm.platforms.interface import Platform
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core import kv_cache_planning as kp
from vllm.v1.core import single_type_kv_cache_manager  # noqa: F401 (registers managers)
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_max_concurrency_for_kv_cache_config,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode
from vllm.v1.worker.utils import customize_attention_spec

from hybridkv import models
from hybridkv.layouts import make_plan
from hybridkv.target import VllmTarget
from hybridkv.vllm_export import kv_cache_config, logged_capacity, vllm_objects


class _PlainAttention(nn.Module, AttentionLayerBase):
    """Qwen3NextAttention's Attention (no QSA): FullAttentionSpec on FlashAttention."""

    def __init__(self, heads, head_dim, kv_dtype_str, model_config):
        super().__init__()
        self.num_kv_heads, self.head_size, self.kv_cache_dtype = heads, head_dim, kv_dtype_str
        self.dtype = kv_cache_dtype_str_to_dtype(kv_dtype_str, model_config)

    def get_attn_backend(self):
        return FlashAttentionBackend

    def get_kv_cache_spec(self, vllm_config):
        return FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            head_size_v=self.head_size,
            dtype=self.dtype,
            kv_quant_mode=get_kv_quant_mode(self.kv_cache_dtype),
        )


def _stub(cls, **attrs):
    obj = cls.__new__(cls)
    nn.Module.__init__(obj)
    for k, v in attrs.items():
        object.__setattr__(obj, k, v)
    return obj


def reference(
    text: dict,
    *,
    wrapper: bool = True,
    tp: int = 1,
    kv: str = "auto",
    indexer_kv: str = "auto",
    spec: int = 0,
    prefix: bool = True,
    max_model_len: int = 32_768,
    memory: int = 64 << 30,
    gdn_backend: str = "flashinfer",
    block_size: int | None = None,
):
    cfg = transformers.Qwen4ExpTextConfig(**text)
    # Qwen4ExpForCausalLMConfig strips the MRoPE section; the wrapper keeps it
    uses_mrope = wrapper and bool((cfg.rope_parameters or {}).get("mrope_section"))
    hf_config = transformers.Qwen4ExpConfig(text_config=text) if wrapper else cfg
    cache_config = CacheConfig(
        block_size=block_size,
        cache_dtype=kv,
        enable_prefix_caching=prefix,
    )
    model_config = SimpleNamespace(
        dtype=torch.bfloat16,
        hf_text_config=cfg,
        hf_config=hf_config,
        use_mla=False,
        is_hybrid=True,
        architecture="Qwen4ExpForConditionalGeneration" if wrapper else "Qwen4ExpForCausalLM",
        max_model_len=max_model_len,
        get_num_kv_heads=lambda pc: max(1, cfg.num_key_value_heads // tp),
        get_head_size=lambda: cfg.head_dim,
        uses_mrope=uses_mrope,
        multimodal_config=None,
    )
    spec_config = SimpleNamespace(num_speculative_tokens=spec, method="ngram") if spec else None
    vllm_config = SimpleNamespace(
        model_config=model_config,
        cache_config=cache_config,
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
        ),
        scheduler_config=SimpleNamespace(
            disable_hybrid_kv_cache_manager=False,
            max_num_batched_tokens=8192,
            max_num_seqs=256,
            enable_chunked_prefill=True,
        ),
        attention_config=SimpleNamespace(
            hisparse_config=None,
            resolve_indexer_kv_dtype=lambda default: (
                default if indexer_kv == "auto" else indexer_kv
            ),
        ),
        compilation_config=SimpleNamespace(static_forward_context={}),
        speculative_config=spec_config,
        num_speculative_tokens=spec,
        kv_transfer_config=None,
    )
    # MambaModelConfig.verify_and_update_config
    from vllm.model_executor.models.config import MambaModelConfig

    MambaModelConfig.verify_and_update_config(vllm_config)
    ctx = vllm_config.compilation_config.static_forward_context
    p = "language_model.model.layers" if wrapper else "model.layers"
    qsa = getattr(cfg, "indexer_n_heads", None) is not None
    kv_heads = max(1, cfg.num_key_value_heads // tp)
    kv_str = kv
    kv_torch = kv_cache_dtype_str_to_dtype(kv_str, model_config)
    for i, kind in enumerate(cfg.layer_types):
        if (i + 1) in cfg.ple_layer_ids:
            ctx[f"{p}.{i}.ple"] = _stub(
                Qwen4ExpPLELayer,
                model_config=model_config,
                cache_config=cache_config,
                hc_hidden_size=cfg.hidden_size * cfg.hc_count,
                conv_state_len=(cfg.ple_conv_kernel_size - 1) * cfg.ngram_size,
                num_spec_tokens=spec,
                prefix=f"{p}.{i}.ple",
            )
        if kind == "linear_attention":
            ctx[f"{p}.{i}.linear_attn"] = _stub(
                QwenGatedDeltaNetAttention,
                model_config=model_config,
                cache_config=cache_config,
                tp_size=tp,
                num_k_heads=cfg.linear_num_key_heads,
                num_v_heads=cfg.linear_num_value_heads,
                head_k_dim=cfg.linear_key_head_dim,
                head_v_dim=cfg.linear_value_head_dim,
                conv_kernel_size=cfg.linear_conv_kernel_dim,
                num_spec=spec,
                vllm_config=vllm_config,
                _checkpoint_alignment=(
                    64
                    if cache_config.mamba_cache_mode == "align" and gdn_backend == "flashinfer"
                    else None
                ),
            )
        elif qsa:
            idx = f"{p}.{i}.self_attn.indexer"
            indexer_kv_dtype = vllm_config.attention_config.resolve_indexer_kv_dtype("bf16")
            idx_dtype = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}[indexer_kv_dtype]
            QSAKeyStateCache(
                head_size=cfg.indexer_head_dim,
                dtype=torch.bfloat16,
                cache_rope_positions=uses_mrope,
                prefix=f"{idx}.raw_key_cache",
                cache_config=cache_config,
                compress_ratio=cfg.indexer_compress_ratio,
                vllm_config=vllm_config,
            )
            QSACompressedKeyCache(
                head_size=cfg.indexer_head_dim,
                dtype=idx_dtype,
                compress_ratio=cfg.indexer_compress_ratio,
                prefix=f"{idx}.compressed_key_cache",
                cache_config=cache_config,
                vllm_config=vllm_config,
            )
            ctx[f"{p}.{i}.self_attn.attn"] = _stub(
                Qwen4ExpQSAAttention,
                num_kv_heads=kv_heads,
                head_dim=cfg.head_dim,
                kv_cache_torch_dtype=kv_torch,
                kv_cache_dtype=kv_str,
                attn_backend=Qwen4ExpQSAFlashAttentionBackend,
            )
        else:
            ctx[f"{p}.{i}.self_attn.attn"] = _PlainAttention(
                kv_heads, cfg.head_dim, kv_str, model_config
            )
    # the registry resolves the architecture to the model class (its mamba spec helpers)
    from vllm.model_executor.models import ModelRegistry

    cls = qmodel.Qwen4ExpForCausalLM
    ModelRegistry.resolve_model_cls = lambda *a, **k: (cls, model_config.architecture)
    Platform.update_block_size_for_backend(vllm_config)
    specs = {}
    for name, layer in ctx.items():
        s = layer.get_kv_cache_spec(vllm_config)
        if s is None:
            continue
        from vllm.v1.kv_cache_interface import AttentionSpec

        if isinstance(s, AttentionSpec):
            s = customize_attention_spec(layer.get_attn_backend(), s)
        specs[name] = s
    backends = []
    for layer in ctx.values():
        b = layer.get_attn_backend()
        if b not in backends:
            backends.append(b)
    layouts = [x.name for x in get_supported_kv_cache_layouts(backends)]
    layout = resolve_kv_cache_layout(vllm_config, [layouts], specs.values())
    groups = kp.get_kv_cache_groups(vllm_config, specs)
    config = kp.get_kv_cache_config_from_groups(vllm_config, groups, memory)
    config.kv_cache_layout = layout.name
    scheduler = generate_scheduler_kv_cache_config([config])
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(scheduler, vllm_config)
    hit = resolve_cache_hit_alignment_tokens(scheduler, vllm_config, scheduler_block, hash_block)
    concurrency = get_max_concurrency_for_kv_cache_config(vllm_config, config)
    return SimpleNamespace(
        block_size=cache_config.block_size,
        layout=layout.name,
        config=config,
        hash_block_size=hash_block,
        cache_hit_alignment_tokens=hit,
        scheduler_block_size=scheduler_block,
        max_concurrency=concurrency,
        vllm_config=vllm_config,
    )


ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
QSA = dict(
    indexer_n_heads=16,
    indexer_kv_heads=1,
    indexer_head_dim=128,
    indexer_budget=2048,
    indexer_compress_ratio=4,
    rope_parameters=ROPE,
    ple_layer_ids=[1, 2],
    eos_token_id=2,
)
NO_PLE = {k: v for k, v in QSA.items() if k != "ple_layer_ids"}

CASES = {
    "defaults": dict(text={}),
    "qsa": dict(text=QSA),
    "qsa-fp8": dict(text=QSA, kv="fp8"),
    "qsa-tp2": dict(text=QSA, tp=2),
    "qsa-ratio16": dict(text={**QSA, "indexer_compress_ratio": 16}),
    "qsa-ratio8-spec3": dict(text={**QSA, "indexer_compress_ratio": 8}, spec=3),
    "qsa-no-prefix": dict(text=QSA, prefix=False),
    "qsa-indexer-fp8": dict(text=QSA, indexer_kv="fp8"),
    "qsa-spec3": dict(text=QSA, spec=3),
    "qsa-causal": dict(text=QSA, wrapper=False),
    "qsa-nople-tp8": dict(text=NO_PLE, tp=8),
    "qsa-triton": dict(text=QSA, gdn_backend="triton"),
    "qsa-fp8-tp2-noprefix": dict(text=QSA, kv="fp8", tp=2, prefix=False),
    "defaults-tp8": dict(text={}, tp=8),
    # no PLE layer, but vLLM sizes the block by the PLE state of the config (8 x 2,048 channels)
    "qsa-nople-hc8-tp8": dict(text={**NO_PLE, "hc_count": 8}, tp=8),
    "defaults-hc8-tp8": dict(text={"hc_count": 8}, tp=8),
    "ple-no-indexer": dict(text={"ple_layer_ids": [1, 2], "eos_token_id": 2}),
    "qsa-mrope": dict(
        text={
            **QSA,
            "rope_parameters": {**ROPE, "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        }
    ),
    "qsa-mrope-causal": dict(
        text={
            **QSA,
            "rope_parameters": {**ROPE, "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        },
        wrapper=False,
    ),
}


def hybridkv_config(
    text,
    *,
    wrapper=True,
    tp=1,
    kv="auto",
    indexer_kv="auto",
    spec=0,
    prefix=True,
    max_model_len=32_768,
    memory=64 << 30,
    gdn_backend="flashinfer",
):
    if wrapper:
        cfg = transformers.Qwen4ExpConfig(text_config=text or None).to_dict()
    else:
        cfg = transformers.Qwen4ExpTextConfig(**text).to_dict()
        cfg["architectures"] = ["Qwen4ExpForCausalLM"]
    model = models.from_hf_config(cfg, kv_dtype=kv, tp_size=tp, num_spec_tokens=spec)
    target = VllmTarget(
        cache_formats="vllm",
        enable_prefix_caching=prefix,
        max_model_len=max_model_len,
        indexer_kv_dtype=indexer_kv,
        gdn_prefill_backend=gdn_backend,
    )
    plan = make_plan(model, "inflate", memory=memory, max_num_seqs=8, target=target)
    return model, plan


def rows(tensors):
    return [(t.size, list(t.layers), t.layer_stride, t.block_stride, t.offset) for t in tensors]


def main() -> int:
    failures = 0
    for name, case in CASES.items():
        ref = reference(**case)
        model, plan = hybridkv_config(**case)
        ours = vllm_objects(plan, model)
        data = kv_cache_config(plan, model)
        logged = logged_capacity(plan, model)
        theirs = ref.config
        checks = {
            "block_size": (plan.block_size, ref.block_size),
            "kv_cache_layout": (ours.kv_cache_layout, ref.layout),
            "num_blocks": (ours.num_blocks, theirs.num_blocks),
            "group layer_names": (
                [g.layer_names for g in ours.kv_cache_groups],
                [g.layer_names for g in theirs.kv_cache_groups],
            ),
            "group specs (every field)": (
                [g.kv_cache_spec for g in ours.kv_cache_groups],
                [g.kv_cache_spec for g in theirs.kv_cache_groups],
            ),
            "tensors": (rows(ours.kv_cache_tensors), rows(theirs.kv_cache_tensors)),
            "hash_block_size": (data["hash_block_size"], ref.hash_block_size),
            "cache_hit_alignment_tokens": (
                data["cache_hit_alignment_tokens"],
                ref.cache_hit_alignment_tokens,
            ),
            "max_concurrency": (round(logged.max_concurrency, 9), round(ref.max_concurrency, 9)),
        }
        bad = [k for k, (a, b) in checks.items() if a != b]
        block_bytes = (
            max(t.block_stride for t in theirs.kv_cache_tensors)
            if (theirs.kv_cache_tensors)
            else 0
        )
        print(
            f"{name:22s} block {ref.block_size:5d} layout {ref.layout} bytes/block "
            f"{plan.pools[0].block_bytes:>11,} (vLLM block_stride {block_bytes:>11,}) blocks "
            f"{theirs.num_blocks:6d} groups {len(theirs.kv_cache_groups):2d} hash "
            f"{ref.hash_block_size} hit {ref.cache_hit_alignment_tokens} "
            f"{'OK' if not bad else 'MISMATCH ' + ', '.join(bad)}"
        )
        for k in bad:
            a, b = checks[k]
            if isinstance(a, list):
                for i, (x, y) in enumerate(zip(a, b)):
                    if x != y:
                        print(f"   {k}[{i}]:\n     hybridkv {x}\n     vLLM     {y}")
                        break
                if len(a) != len(b):
                    print(f"   {k}: lengths {len(a)} vs {len(b)}")
            else:
                print(f"   {k}: hybridkv {a} vLLM {b}")
        failures += bool(bad)
    return failures


if __name__ == "__main__":
    sys.exit(main())
