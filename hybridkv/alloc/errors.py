"""Allocator errors; each message says what the caller should do next."""

from __future__ import annotations


class AllocatorError(ValueError):
    """Base class for misuse of the allocator API."""


class UnknownRequest(AllocatorError):
    def __init__(self, req_id: object) -> None:
        super().__init__(
            f"request {req_id!r} is not known to the allocator; call add_request() first"
        )


class DoubleFree(AllocatorError):
    def __init__(self, what: object) -> None:
        super().__init__(f"{what} was already freed; free each request/block exactly once")


class MaxLengthExceeded(AllocatorError):
    def __init__(self, req_id: object, length: int, max_len: int) -> None:
        super().__init__(
            f"request {req_id!r} would reach {length} tokens > max_model_len={max_len}; "
            "finish or truncate the request, or raise max_model_len"
        )


class PoolExhausted(RuntimeError):
    def __init__(self, pool: str, need: int, have: int) -> None:
        super().__init__(
            f"pool {pool!r} needs {need} free ids but has {have}; preempt or free requests first"
        )
