"""Triton 3.6's interpreter, with @jit helper calls made inside a launch without re-patching triton.language.

A launch (``GridExecutor.__call__``) patches the language once for its whole grid and restores it after. A call of
a @jit helper from inside the kernel (``InterpretedFunction.__call__``) patches it again, on every call: an
``inspect.getmembers`` scan of ``tl``, ``tl.tensor`` and ``tl.math`` that re-wraps what the launch has already
wrapped, about a quarter of an interpreted kernel test's time. Here a helper whose language modules the launch in
progress already patched runs directly, as the launch's own body does; any other call goes the original way. Only
the interpreter the tests pin (triton 3.6.x, pyproject's ``test`` extra) is changed; another version is left as is.
"""

from __future__ import annotations

import inspect
import threading
from functools import cache

_state = threading.local()


@cache  # a helper's module globals hold the same language modules on every call
def _language_modules(fn) -> frozenset[int]:
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def install() -> bool:
    """Wrap the interpreter's launch and helper call; True when installed (triton 3.6.x only)."""
    import triton

    if not triton.__version__.startswith("3.6."):
        return False
    from triton.runtime import interpreter as ti

    grid_call, fn_call = ti.GridExecutor.__call__, ti.InterpretedFunction.__call__
    if getattr(grid_call, "_vserve_wrapped", False):
        return True

    def launch(self, *args, **kwargs):
        outer = getattr(_state, "patched", None)
        _state.patched = _language_modules(self.fn)
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _state.patched = outer

    def helper(self, *args, **kwargs):
        patched = getattr(_state, "patched", None)
        if patched is None or not _language_modules(self.fn) <= patched:
            return fn_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as the original call reports a helper's failure
            raise ti.InterpreterError(repr(e)) from e

    launch._vserve_wrapped = True
    ti.GridExecutor.__call__ = launch
    ti.InterpretedFunction.__call__ = helper
    return True
