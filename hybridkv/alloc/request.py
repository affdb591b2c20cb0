"""A running request as the allocator tracks it (:class:`Request`)."""

from __future__ import annotations

from typing import Any

__all__ = ["INF", "Request"]

INF = 1 << 62


class Request:
    """One running request's allocator state: its tokens and hashes, block lists per group, and
    what its commits and checkpoints track (the fields say what)."""

    __slots__ = (
        "blocks",
        "branch_at",
        "end_ckpt",
        "end_copies",
        "end_position",
        "extra",
        "hashes",
        "hit_unit",
        "junction",
        "last_mark",
        "lead",
        "limit",
        "lora_id",
        "ncached",
        "nprompt",
        "num_alloc",
        "req_id",
        "row",
        "sources",
        "step_start",
        "tokens",
        "unkeyed",
        "work_at",
    )

    def __init__(
        self,
        req_id: Any,
        tokens: Any,
        extra: bytes,
        lora_id: int | None,
        hashes: list[bytes],
        num_groups: int,
    ) -> None:
        self.req_id = req_id
        self.tokens = tokens  # array('i'): no Python object per token
        self.extra = extra
        self.lora_id = lora_id
        self.hashes = hashes  # one per full hash unit of the known tokens
        self.blocks: list[list[int]] = [[] for _ in range(num_groups)]
        self.num_alloc = 0  # tokens with slots in every group
        self.ncached = [0] * num_groups  # attention blocks already considered for caching
        self.lead = [0] * num_groups  # sliding window: leading null blocks
        self.row = -1
        self.limit = 0  # allocate_slots may take the fast path while num_alloc < limit
        self.work_at = INF  # num_alloc at which the next commit has caching work
        # the private end-of-request checkpoint (``last`` and its kin): state gid -> its slot,
        # all at ``end_position``; ``end_copies`` is the commit's copy list for it (running slot
        # -> end slot, group order), made once every state group has its slot and dropped
        # whenever ``end_ckpt`` changes, so a roll is one list extend however many groups
        self.end_ckpt: dict[int, int] = {}
        self.end_position = 0
        self.end_copies: list[tuple[int, int, int]] | None = None
        self.sources: list[tuple[int, int]] = []  # (gid, id) hits copy from, held to commit
        self.branch_at = -1  # marconi: position of this request's branch point
        self.nprompt = len(tokens)  # align: the prompt's length (vLLM's num_prompt_tokens)
        self.junction = 0  # align: vLLM's shared_prefix_boundary, found at admission
        self.step_start = -1  # align with exports: num_alloc when the uncommitted step began
        self.last_mark = 0  # periodic / hash_boundary: the last position a state was kept at
        self.hit_unit: bytes | None = None  # the hash unit of the state its hit copied from
        #: states copied at a position whose key needs tokens not known yet (lookahead hashes):
        #: ``(position, [(group, slot), ...])``, keyed by a later commit
        self.unkeyed: list[tuple[int, list[tuple[int, int]]]] = []
