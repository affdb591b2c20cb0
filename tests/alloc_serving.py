"""Test helper shared by the allocator's rule tests: a request served as a scheduler would."""

from __future__ import annotations

from hybridkv.alloc import HybridAllocator
from hybridkv.alloc.check import check_consistency


def serve_prefill(a: HybridAllocator, rid: str, tokens: list[int]) -> None:
    """Prefill ``tokens`` in the chunks the allocator's policy splits them into (vLLM's split
    for ``align``), checking the allocator after every step, then free the request."""
    a.add_request(rid, tokens)
    while a.num_tokens(rid) < len(tokens):
        n = a.split_prefill(rid, len(tokens) - a.num_tokens(rid))
        assert n > 0 and a.allocate_slots(rid, n)
        a.take_state_copies()
        check_consistency(a)
    a.free(rid)
    check_consistency(a)
