"""The Triton kernels, from the package: this module re-exports the public API of the top-level
``kernels/`` folder, which installs as ``hybridkv_kernels``.

The kernels live outside ``hybridkv`` so that each file (torch and triton only, with its torch
``*_ref`` beside it) can be lifted into another project; they install as ``hybridkv_kernels``
because a top-level ``kernels`` module would shadow the Hugging Face ``kernels`` package that
transformers probes for. Their tests are in ``tests/kernel_tests/``.

Each kernel has a one-call wrapper and a plan / run pair (FlashInfer's split: plan once per
step from the block tables, slots and shapes; run once per layer with no host work beyond the
launch):

- ``kernels/cache_write.py``: :func:`write_kv_cache`; :func:`plan_write_kv_cache`
- ``kernels/indexer_scores.py``: :func:`indexer_scores`; :func:`plan_indexer_scores` (the
  pool scores of GLM-5-Next's DSA indexer over its paged rows, and with
  ``pool="mean_norm_rope"`` of Qwen4-Exp's QSA indexer, whose reference
  ``hybridkv_kernels.indexer_scores.mean_norm_rope_scores_ref`` is not re-exported here: the
  references here are the wrappers')
- ``kernels/paged_decode.py``: :func:`paged_decode_attention`; :func:`plan_decode`
- ``kernels/paged_prefill.py``: :func:`paged_prefill_attention`; :func:`plan_prefill`
- ``kernels/mla_decode.py``: :func:`mla_decode_attention`; :func:`plan_mla_decode`
- ``kernels/state_copy.py``: :func:`gather_states`, :func:`scatter_states`,
  :func:`copy_states`; :func:`plan_gather_states`, :func:`plan_scatter_states`,
  :func:`plan_copy_states`

Importing this module imports triton: set ``TRITON_INTERPRET=1`` before it to run the kernels on
a CPU.
"""

from __future__ import annotations

from hybridkv.triton_compat import patch_interpreter_scalars
from hybridkv_kernels.cache_write import plan_write_kv_cache, write_kv_cache, write_kv_cache_ref
from hybridkv_kernels.indexer_scores import (
    indexer_scores,
    indexer_scores_ref,
    plan_indexer_scores,
)
from hybridkv_kernels.mla_decode import (
    mla_decode_attention,
    mla_decode_attention_ref,
    plan_mla_decode,
)
from hybridkv_kernels.paged_decode import (
    paged_decode_attention,
    paged_decode_attention_ref,
    plan_decode,
)
from hybridkv_kernels.paged_prefill import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
    plan_prefill,
)
from hybridkv_kernels.state_copy import (
    copy_states,
    copy_states_ref,
    gather_states,
    gather_states_ref,
    plan_copy_states,
    plan_gather_states,
    plan_scatter_states,
    scatter_states,
    scatter_states_ref,
)

# the interpreter of Triton <= 3.6 with NumPy >= 2.4 (kernel launches need it, imports do not)
patch_interpreter_scalars()

#: the one-call wrappers, each with its torch reference ``<name>_ref``
WRAPPERS = (
    "copy_states",
    "gather_states",
    "indexer_scores",
    "mla_decode_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "scatter_states",
    "write_kv_cache",
)
#: the planners: one plan per step, ``plan.run(...)`` per layer
PLANNERS = (
    "plan_copy_states",
    "plan_decode",
    "plan_gather_states",
    "plan_indexer_scores",
    "plan_mla_decode",
    "plan_prefill",
    "plan_scatter_states",
    "plan_write_kv_cache",
)

__all__ = [
    "copy_states",
    "copy_states_ref",
    "gather_states",
    "gather_states_ref",
    "indexer_scores",
    "indexer_scores_ref",
    "mla_decode_attention",
    "mla_decode_attention_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "plan_copy_states",
    "plan_decode",
    "plan_gather_states",
    "plan_indexer_scores",
    "plan_mla_decode",
    "plan_prefill",
    "plan_scatter_states",
    "plan_write_kv_cache",
    "scatter_states",
    "scatter_states_ref",
    "write_kv_cache",
    "write_kv_cache_ref",
]
