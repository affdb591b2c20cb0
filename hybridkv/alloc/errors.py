"""Allocator errors. Each message says what the caller should do next.

Misuse of the API raises a subclass of :class:`AllocatorError` (a ``ValueError``): the call did
nothing and retrying it unchanged will fail again. :class:`PoolExhausted` (a ``RuntimeError``)
is the one expected failure: memory is full right now, and the caller preempts or waits.
"""

from __future__ import annotations


class AllocatorError(ValueError):
    """Base class for misuse of the allocator API."""


class ConfigError(AllocatorError):
    """The allocator cannot run with these settings on this plan."""


class UnknownRequest(AllocatorError):
    def __init__(self, req_id: object) -> None:
        self.req_id = req_id
        super().__init__(
            f"request {req_id!r} is not known to the allocator; call add_request() first"
        )


class DuplicateRequest(AllocatorError):
    def __init__(self, req_id: object) -> None:
        self.req_id = req_id
        super().__init__(
            f"request {req_id!r} is already running; free() it before adding it again"
        )


class DoubleFree(AllocatorError):
    def __init__(self, what: object) -> None:
        self.what = what
        super().__init__(f"{what} was already freed; free each request or block exactly once")


class MaxLengthExceeded(AllocatorError):
    def __init__(self, req_id: object, length: int, max_len: int) -> None:
        self.req_id, self.length, self.max_len = req_id, length, max_len
        super().__init__(
            f"request {req_id!r} would reach {length} tokens > max_model_len={max_len}; "
            "finish or truncate the request, or give the allocator a larger max_model_len "
            "(AllocatorOptions(max_model_len=...), which HybridAllocator, "
            "SimConfig(allocator=...) and the engine take; vLLM's --max-model-len)"
        )


class PoolExhausted(RuntimeError):
    """Not enough free (or evictable) ids right now; nothing was changed."""

    def __init__(self, pool: str, need: int, have: int) -> None:
        self.pool, self.need, self.have = pool, need, have
        super().__init__(
            f"pool {pool!r} needs {need} free ids but has {have}; preempt or free requests "
            "and retry"
        )
