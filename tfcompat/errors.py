"""The exception hierarchy.

Every error follows one template: what failed, for which family, on which transformers version, why, what
is supported, and how to fix it. The fields are kept as attributes so callers can branch on them.
"""

from __future__ import annotations

__all__ = [
    "TfcompatError",
    "UnknownFamilyError",
    "UnsupportedVersionError",
    "SymbolProbeError",
    "PatchError",
    "InvalidInputError",
    "PatchedModelError",
    "TransportError",
]


class TfcompatError(Exception):
    """Base class: one message template for every tfcompat failure."""

    def __init__(
        self,
        what: str,
        *,
        family: str | None = None,
        transformers_version: str | None = None,
        why: str = "",
        supported: str = "",
        fix: str = "",
    ) -> None:
        self.what = what
        self.family = family
        self.transformers_version = transformers_version
        self.why = why
        self.supported = supported
        self.fix = fix
        super().__init__(self._render())

    def _render(self) -> str:
        lines = [self.what]
        for label, value in (
            ("family", self.family),
            ("transformers", self.transformers_version),
            ("why", self.why),
            ("supported", self.supported),
            ("fix", self.fix),
        ):
            if value:
                lines.append(f"  {label}: {value}")
        return "\n".join(lines)

    def __reduce__(self):  # keep errors picklable across torch.multiprocessing workers
        kwargs = dict(
            family=self.family,
            transformers_version=self.transformers_version,
            why=self.why,
            supported=self.supported,
            fix=self.fix,
        )
        return _rebuild, (type(self), self.what, kwargs)


def _rebuild(cls: type[TfcompatError], what: str, kwargs: dict) -> TfcompatError:
    return cls(what, **kwargs)


class UnknownFamilyError(TfcompatError, ValueError):
    """The family key is not in the registry."""


class UnsupportedVersionError(TfcompatError):
    """The installed transformers is outside every range declared for the family."""


class SymbolProbeError(UnsupportedVersionError):
    """A symbol the family needs is missing or has the wrong shape in the installed transformers."""


class PatchError(TfcompatError):
    """A patch cannot be applied to this model (raised by ``patch()``, never inside a forward)."""


class InvalidInputError(TfcompatError, ValueError):
    """Inputs violate the contract: shapes, dtypes, position-id layout, sequence-parallel sizes."""


class PatchedModelError(TfcompatError, RuntimeError):
    """A patched model was changed or used in a way its patch cannot follow (its attention implementation
    replaced after ``patch()``, the model pickled); raised by the call that finds it."""


class TransportError(TfcompatError, RuntimeError):
    """The Ulysses transport the ranks agreed on could not start (raised at the first exchange that needs it)."""
