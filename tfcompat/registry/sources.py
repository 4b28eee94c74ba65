"""The function a class defines for a method, behind the wrappers transformers puts around it.

Reading a model's structure reads its methods' source. ``functools.wraps`` decorators are undone by
`inspect.unwrap`; the ``kernels`` package (a dependency of transformers from 5.25) replaces the ``__init__`` of
every class decorated with ``use_kernelized_func`` by a closure ``new_init`` that calls the original, without
``__wrapped__``: the original is the closure's cell holding ``Class.__init__``.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["defined"]


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
