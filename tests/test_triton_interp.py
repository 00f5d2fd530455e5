"""The test suite's interpreter speed-up (tests/triton_interp.py): helper calls inside a launch patch nothing more,
and the kernel computes the same."""

import torch
import triton
import triton.language as tl
import triton_interp


@triton.jit
def _scaled(x, s):
    return x * s


@triton.jit
def _shifted(x, b):
    return _scaled(x, 2.0) + b  # a helper calling a helper


@triton.jit
def _affine_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = _shifted(x, 1.0)
    for _ in range(3):
        y = _scaled(y, 0.5)
    tl.store(y_ptr + offs, y, mask=mask)


def test_helpers_inside_a_launch_do_not_repatch_the_language(monkeypatch, seed):
    from triton.runtime import interpreter as ti

    assert triton_interp.install()  # the pinned triton 3.6 (pyproject's test extra): installed by conftest already
    calls = []
    original = ti._patch_lang
    monkeypatch.setattr(ti, "_patch_lang", lambda fn: calls.append(fn.__name__) or original(fn))
    x = torch.randn(37)
    y = torch.empty_like(x)
    _affine_kernel[(3,)](x, y, x.numel(), BLOCK=16)
    # one patch for the launch; unwrapped, each of the 3 programs' 5 helper calls (1 + 1 nested + 3 in the loop)
    # patched it again: 16 calls
    assert calls == ["_affine_kernel"], f"seed {seed}: {calls}"
    torch.testing.assert_close(y, (x * 2 + 1) / 8, msg=f"seed {seed}")
    # the language is restored after the launch: outside one a builtin is the unpatched function again
    assert tl.core.is_builtin(tl.load)


def test_a_helper_called_outside_a_launch_goes_the_original_way(monkeypatch):
    from triton.runtime import interpreter as ti

    scopes = []
    original = ti._patch_lang
    monkeypatch.setattr(ti, "_patch_lang", lambda fn: scopes.append((fn.__name__, original(fn))) or scopes[-1][1])
    try:
        got = _scaled(torch.tensor(3.0), 2.0)  # a @jit function called from host code: not inside a launch
    finally:
        for _, scope in reversed(scopes):  # the original call leaves the language patched: put it back
            scope.restore()
    assert [name for name, _ in scopes] == ["_scaled"]
    assert float(got) == 6.0
    assert tl.core.is_builtin(tl.load)
