"""Rope settings of a config, and one rotary call for every release's convention."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .records import RopeConfigKey, Rotary

__all__ = ["ApplyRotary", "rope_config", "uniform_rotary"]

ApplyRotary = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor]]


def rope_config(config: Any, key: RopeConfigKey) -> dict[str, Any]:
    """The rope settings of a (possibly composite) config as one flat dict.

    Reads ``config.text_config`` when present, then the dict at ``key`` (``rope_scaling`` on 4.x,
    ``rope_parameters`` on 5.x), and fills ``rope_theta`` / ``partial_rotary_factor`` from the top level
    of the text config where the dict lacks them. Keys: ``rope_type``, ``rope_theta``, ``mrope_section``, ...
    """
    text = getattr(config, "text_config", None) or config
    found = dict(getattr(text, key, None) or {})
    if "type" in found and "rope_type" not in found:
        found["rope_type"] = found["type"]
    for name in ("rope_theta", "partial_rotary_factor"):
        if name not in found and getattr(text, name, None) is not None:
            found[name] = getattr(text, name)
    return found


def uniform_rotary(fn: Callable[..., Any], rotary: Rotary, key: RopeConfigKey) -> ApplyRotary:
    """``apply_rotary(q, k, cos, sin, config) -> (q, k)`` whatever the installed convention.

    fn: the installed module function named by ``rotary.apply``. q, k: ``(B, H, L, D)``; cos, sin: what
    the installed rotary embedding returns (``(3, B, L, D)`` sectioned or ``(B, L, D)`` folded); config:
    the model or text config (read at ``key`` for ``mrope_section``).
    """
    if rotary.layout == "sectioned":
        def apply_rotary(q, k, cos, sin, config):
            return fn(q, k, cos, sin, rope_config(config, key)["mrope_section"])
    else:
        def apply_rotary(q, k, cos, sin, config):
            return fn(q, k, cos, sin)
    apply_rotary.__doc__ = uniform_rotary.__doc__
    return apply_rotary
