"""hybridkv's Triton kernels, installed as ``hybridkv_kernels`` (``hybridkv.kernels`` re-exports
their wrappers). Each module is standalone (torch and triton only) with its torch ``*_ref``
beside it; the tests are in ``tests/kernel_tests/``."""
