"""hybridkv: memory layouts, allocator, simulator and kernels for hybrid-model caches.

- :mod:`hybridkv.specs`: per-layer state specs with exact byte formulas.
- :mod:`hybridkv.models`: the model zoo and a Hugging Face ``config.json`` reader.
- :mod:`hybridkv.layouts`: layout strategies producing a :class:`~hybridkv.plan.MemoryPlan`.
"""

from .plan import MemoryPlan, PlanConfig

__version__ = "0.1.0"

__all__ = ["MemoryPlan", "PlanConfig", "__version__"]
