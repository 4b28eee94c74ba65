"""`tfcompat.registry.sources.defined`: a method's own function behind transformers' wrappers."""

from __future__ import annotations

import functools

from tfcompat.registry.sources import defined, function


def _kernelized(cls):
    """As ``kernels``' ``use_kernelized_func`` (5.25): a closure replaces ``__init__``, no ``__wrapped__``."""
    orig_init = cls.__init__

    def new_init(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        self.hidden = {}

    cls.__init__ = new_init
    return cls


def _logged(fn):
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        return fn(*args, **kwargs)
    return inner


@_kernelized
class Mixer:
    def __init__(self, width: int) -> None:
        self.conv = width

    @_logged
    def forward(self, x):
        return x


def test_closure_wrapped_init_reads_as_the_class_defines_it():
    fn = defined(Mixer, "__init__")
    assert fn.__qualname__ == "Mixer.__init__"
    assert fn.__code__.co_names == ("conv",)  # the original body, not new_init's


def test_wraps_decorators_are_unwrapped_and_plain_methods_kept():
    assert defined(Mixer, "forward").__qualname__ == "Mixer.forward"
    assert defined(Mixer, "forward") is not vars(Mixer)["forward"]


def _as_function_module(func):
    """As ``kernels``' ``use_kernel_forward_from_hub`` on a function (5.25's ``apply_rotary_pos_emb``): an
    ``nn.Module`` instance in its place, whose class ``forward`` calls it from a closure cell."""
    import torch

    class Func(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)

    return Func()


def _rotate(q, k):
    return k, q


def test_a_kernels_function_module_reads_as_its_function():
    wrapped = _as_function_module(_rotate)
    assert function(wrapped) is _rotate and wrapped(1, 2) == (2, 1)
    assert function(_rotate) is _rotate and function(Mixer) is Mixer
