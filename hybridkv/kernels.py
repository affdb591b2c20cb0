"""The Triton kernels, from the package: this module re-exports the public wrappers of the
top-level ``kernels/`` folder, which installs as ``hybridkv_kernels``.

The kernels live outside ``hybridkv`` so that each file (torch and triton only, with its torch
``*_ref`` beside it) can be lifted into another project; they install as ``hybridkv_kernels``
because a top-level ``kernels`` module would shadow the Hugging Face ``kernels`` package that
transformers probes for. Their tests are in ``tests/kernel_tests/``.

- ``kernels/cache_write.py``: :func:`write_kv_cache` (scatter new K/V into a paged layout)
- ``kernels/paged_decode.py``: :func:`paged_decode_attention` (GQA decode, split-K, windows)
- ``kernels/paged_prefill.py``: :func:`paged_prefill_attention` (varlen causal prefill/extend)
- ``kernels/mla_decode.py``: :func:`mla_decode_attention` (absorbed MLA decode)
- ``kernels/state_copy.py``: :func:`gather_states`, :func:`scatter_states`, :func:`copy_states`

Importing this module imports triton: set ``TRITON_INTERPRET=1`` before it to run the kernels on
a CPU.
"""

from __future__ import annotations

from hybridkv_kernels.cache_write import write_kv_cache, write_kv_cache_ref
from hybridkv_kernels.mla_decode import mla_decode_attention, mla_decode_attention_ref
from hybridkv_kernels.paged_decode import paged_decode_attention, paged_decode_attention_ref
from hybridkv_kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_ref
from hybridkv_kernels.state_copy import (
    copy_states,
    copy_states_ref,
    gather_states,
    gather_states_ref,
    scatter_states,
    scatter_states_ref,
)

__all__ = [
    "copy_states",
    "copy_states_ref",
    "gather_states",
    "gather_states_ref",
    "mla_decode_attention",
    "mla_decode_attention_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "scatter_states",
    "scatter_states_ref",
    "write_kv_cache",
    "write_kv_cache_ref",
]
