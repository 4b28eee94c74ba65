"""The function a class or module defines, behind the wrappers transformers puts around it.

Reading a model's structure reads its methods' and functions' source. ``functools.wraps`` decorators are undone by
`inspect.unwrap`. The ``kernels`` package (a dependency of transformers from 5.25) wraps without ``__wrapped__``:
``use_kernelized_func`` replaces a decorated class's ``__init__`` by a closure ``new_init`` whose cell holds
``Class.__init__``, and ``use_kernel_forward_from_hub`` on a function (``apply_rotary_pos_emb``) puts an
``nn.Module`` instance in its place whose class ``forward`` calls the function from its closure cell ``func``.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["defined", "function"]


def defined(owner: type, name: str) -> Any:
    """``owner.name`` as ``owner``'s class body defines it: unwrapped, or taken from a wrapping closure's cells
    (the function whose qualified name is ``Owner.name``); the attribute itself where neither applies."""
    fn = inspect.unwrap(vars(owner)[name])
    want = f"{owner.__qualname__}.{name}"
    if inspect.isfunction(fn) and fn.__qualname__ != want and fn.__closure__:
        inner = next((c.cell_contents for c in fn.__closure__ if inspect.isfunction(getattr(c, "cell_contents", None))
                      and c.cell_contents.__qualname__ == want), None)
        if inner is not None:
            return inspect.unwrap(inner)
    return fn


def function(obj: Any) -> Any:
    """The Python function ``obj`` runs: ``obj`` unwrapped, or the function a kernels function module calls (its
    class ``forward``'s closure cell ``func``); ``obj`` itself where neither applies."""
    if inspect.isfunction(obj):
        return inspect.unwrap(obj)
    forward = getattr(type(obj), "forward", None)
    if inspect.isfunction(forward) and forward.__closure__ and "func" in forward.__code__.co_freevars:
        inner = forward.__closure__[forward.__code__.co_freevars.index("func")].cell_contents
        if inspect.isfunction(inner):
            return inspect.unwrap(inner)
    return obj
