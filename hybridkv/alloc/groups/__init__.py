"""Group managers: one per KV cache group, a class per kind of group, behind one interface
(:class:`~.base.GroupManager`), and the :class:`~.coordinator.Coordinator` that finds the
longest prefix they all serve. Kinds: full attention and MLA (:mod:`.full_attention`), sliding
window (:mod:`.sliding_window`), recurrent state (:mod:`.state`). A new kind is one module with
its manager class, plus its line in :data:`~.coordinator.MANAGER_CLASSES`."""

from .base import Admission, GroupManager
from .coordinator import MANAGER_CLASSES, Coordinator, manager_class
from .full_attention import FullAttentionManager
from .sliding_window import SlidingWindowManager
from .state import StateManager

__all__ = [
    "MANAGER_CLASSES",
    "Admission",
    "Coordinator",
    "FullAttentionManager",
    "GroupManager",
    "SlidingWindowManager",
    "StateManager",
    "manager_class",
]
