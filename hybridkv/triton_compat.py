"""Compatibility of the installed Triton with what hybridkv runs on it.

:func:`patch_interpreter_scalars`: under Triton <= 3.6's interpreter with NumPy >= 2.4, a kernel
loop ``for t in range(lo, hi, BLOCK)`` with runtime bounds fails ("only 0-dimensional arrays can
be converted to Python scalars"): the interpreter holds every runtime scalar as a one-element
array and converts it with ``int(array)``, which NumPy 2.4 refuses; Triton 3.7 converts
``array.squeeze()`` (triton-lang/triton#9171). The patch does the same for older interpreters.
It touches only the interpreter (``TRITON_INTERPRET=1``), never compiled kernels.
"""

from __future__ import annotations

import os


def patch_interpreter_scalars() -> bool:
    """Give the interpreter's ``tl.tensor`` Triton 3.7's ``__index__``; a no-op outside the
    interpreter, where Triton already has it, or where the interpreter's internals differ.
    Returns whether the patch is in place."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return False
    if getattr(original, "hybridkv_scalar_index", False):
        return True

    def index(self) -> int:
        return int(self.handle.data.squeeze())

    def patch(tensor, *scope) -> None:
        original(tensor, *scope)
        if scope:  # Triton 3.6+: attributes are set through a scope restored after each launch
            scope[0].set_attr(tensor, "__index__", index)
        else:  # Triton 3.3-3.5
            tensor.__index__ = index

    patch.hybridkv_scalar_index = True
    interpreter._patch_lang_tensor = patch
    return True
