"""Allocator errors: misuse raises, it never corrupts the pools."""

from __future__ import annotations


class AllocatorError(ValueError):
    """Base class of allocator misuse errors."""


class UnknownRequest(AllocatorError):
    def __init__(self, req_id: object):
        super().__init__(
            f"request {req_id!r} is not known to the allocator (add_request it first)"
        )


class DoubleFree(AllocatorError):
    def __init__(self, req_id: object):
        super().__init__(f"request {req_id!r} was already freed; free each request once")


class DuplicateRequest(AllocatorError):
    def __init__(self, req_id: object):
        super().__init__(f"request {req_id!r} is already running; use a new id or free it first")


class MaxLengthExceeded(AllocatorError):
    def __init__(self, req_id: object, length: int, max_len: int):
        super().__init__(
            f"request {req_id!r} would reach {length} tokens, past max_model_len={max_len}; "
            f"stop it or raise max_model_len"
        )


class PoolExhausted(RuntimeError):
    """Not enough free blocks: the caller should preempt a request and retry."""

    def __init__(self, pool: str, wanted: int, free: int):
        super().__init__(
            f"pool {pool!r} has {free} free blocks, {wanted} needed: preempt a request"
        )
        self.pool, self.wanted, self.free = pool, wanted, free
