"""`Record`: one change a patch made, kept by its `tfcompat.hf.patching.PatchHandle` (and by the modules that
change things for it, such as `tfcompat.hf.fused`) so it can be listed and undone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Record"]

@dataclass(frozen=True)
class Record:
    """One change: ``target.attr`` went from ``old`` to ``new`` (``old`` is `None` with ``was_set=False``
    when the attribute was not in the instance's ``__dict__``); scope is "instance", "config", "hook" or
    "process"."""

    scope: str
    target: Any
    attr: str
    old: Any
    new: Any
    was_set: bool
    note: str

    def __str__(self) -> str:
        return f"[{self.scope}] {type(self.target).__name__}.{self.attr}: {self.note}"
