"""Per-request ring groups (:class:`RingManager`): a sparse-attention indexer's ring of raw keys
in a vLLM-format plan (GLM-5-Next's tail ring, Qwen4-Exp's QSA ring; vLLM 0.33's
``CircularBufferSpec``). A request holds one block for its whole life: the keys of the token
group still being compressed, overwritten as the request runs. The block covers no token range
and is never hashed or cached, so the group takes no part in prefix hits (vLLM's
``CircularBufferManager``: ``prefix_cacheable`` false, left out of the hit search). A hit needs
nothing from it: hits land on the token groups' block boundaries, which the ring divides (the
plan refuses one that does not), where the open group is empty."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Admission, GroupManager

if TYPE_CHECKING:  # pragma: no cover
    from ..request import Request

__all__ = ["RingManager"]


class RingManager(GroupManager):
    """See the module docstring."""

    kinds = ("indexer_ring",)
    caches_blocks = False

    def shrink_hit(self, hashes: list[bytes], limit: int, memo: dict[int, int]) -> int:
        return limit  # scratch: no hit rule (the coordinator leaves the group out anyway)

    def admit(self, r: Request, hit: int, adm: Admission) -> None:
        """A fresh ring block, whatever the hit (a preempted request re-admitted gets a new
        one: its ring was freed with it). A request's lists start empty, so nothing else to
        set."""
        adm.needs[self.group_id] = 1
