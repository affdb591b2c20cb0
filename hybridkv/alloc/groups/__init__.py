"""Group managers: one per KV cache group, a class per kind of group, behind one interface
(:class:`~.base.GroupManager`), and the :class:`~.coordinator.Coordinator` that finds the
longest prefix they all serve. Kinds: full attention and MLA (:mod:`.full_attention`), sliding
window (:mod:`.sliding_window`), recurrent state (:mod:`.state`), a sparse-attention indexer's
per-request ring (:mod:`.ring`). A new kind is one module with its manager class, plus its line
in :data:`~.coordinator.MANAGER_CLASSES`; what the kind is to a hit (:func:`group_roles`) follows
from the class."""

from .base import Admission, GroupManager
from .coordinator import MANAGER_CLASSES, Coordinator, GroupRoles, group_roles, manager_class
from .full_attention import FullAttentionManager
from .ring import RingManager
from .sliding_window import SlidingWindowManager
from .state import StateManager

__all__ = [
    "MANAGER_CLASSES",
    "Admission",
    "Coordinator",
    "FullAttentionManager",
    "GroupManager",
    "GroupRoles",
    "RingManager",
    "SlidingWindowManager",
    "StateManager",
    "group_roles",
    "manager_class",
]
