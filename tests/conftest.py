"""Test configuration.

Kernels run on the CPU under the Triton interpreter. The mode is fixed when ``@triton.jit``
runs, so ``TRITON_INTERPRET`` must be set before any kernel module (or triton) is imported.
"""

import os

# One intra-op thread per test process: the suite runs one worker per core (``-n 2``) on
# tensors of a few KB, where torch's default of a thread per core only adds contention
# (tests/test_e2e.py took 106 s with it, 82 s without). Set before torch is imported;
# subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

if not os.environ.get("HYBRIDKV_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

    from hybridkv.triton_compat import patch_interpreter_scalars

    # Triton <= 3.6's interpreter with NumPy >= 2.4 cannot take runtime loop bounds
    patch_interpreter_scalars()
