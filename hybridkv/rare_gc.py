"""Python's cyclic garbage collector, run rarely while a simulation runs.

The allocator keeps millions of small container objects alive (a cache index entry, a parent
link and a holder list per cached hash unit), and CPython's collector walks every tracked object
of a generation each time it collects it: with the default thresholds (700, 10, 10), 10,000 chat
requests on ``two_level`` / ``last`` spent 4.0 s of a 36.7 s run in collections (2.7 s in full
ones), and freed a few hundred objects in all (the simulator makes next to no reference cycles;
``gc.get_stats()`` after a run). Raising the thresholds for the run keeps the collector working
(a cycle is still freed, later) without walking the allocator's state thousands of times:
0.5 s of collection in the same run. Results do not depend on it; the old thresholds come back
when the run ends, even on an error.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["SIMULATION_THRESHOLDS", "rare_cyclic_gc"]

#: ``gc.set_threshold`` while a simulation runs: a young-generation pass every 100,000 net
#: allocations (CPython's default: 700), an older one every 50 of those, a full one every 100
#: older ones (both default 10)
SIMULATION_THRESHOLDS = (100_000, 50, 100)


@contextmanager
def rare_cyclic_gc(thresholds: tuple[int, int, int] = SIMULATION_THRESHOLDS) -> Iterator[None]:
    """Run the body with the collector's ``thresholds``, restoring the caller's afterwards.
    Calls nest (the innermost thresholds rule inside it)."""
    previous = gc.get_threshold()
    gc.set_threshold(*thresholds)
    try:
        yield
    finally:
        gc.set_threshold(*previous)
