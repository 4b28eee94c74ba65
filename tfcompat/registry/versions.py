"""The installed transformers version (read from metadata, no import) and half-open version ranges.

Ranges are ``[low, high)`` on PEP 440 ordering with boundaries at ``X.Y.0.dev0``, so dev, rc, post and local
builds of a release fall in the range of that release: ``5.0.0.dev0`` and ``5.0.0rc1`` are 5.x builds,
``4.57.6.post1`` is a 4.57 build. (A ``SpecifierSet(">=5.0")`` would reject ``5.0.0.dev0``.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import metadata

from packaging.version import InvalidVersion, Version

__all__ = ["VersionRange", "installed_transformers", "parse", "release_floor"]


def parse(version: str | Version) -> Version:
    """Parse a version string; raises ``ValueError`` naming the bad input."""
    if isinstance(version, Version):
        return version
    try:
        return Version(version)
    except InvalidVersion:
        raise ValueError(f"not a PEP 440 version: {version!r}") from None


def release_floor(version: str) -> Version:
    """``"5.17"`` -> ``Version("5.17.0.dev0")``: the first build of that release line."""
    v = parse(version)
    major, minor, *rest = (*v.release, 0, 0)
    return Version(f"{major}.{minor}.{rest[0]}.dev0")


@dataclass(frozen=True)
class VersionRange:
    """``[low, high)`` with ``high=None`` meaning unbounded; both given as ``"X.Y"`` release lines."""

    low: str
    high: str | None = None

    def __contains__(self, version: object) -> bool:
        v = parse(version)  # type: ignore[arg-type]
        if v < release_floor(self.low):
            return False
        return self.high is None or v < release_floor(self.high)

    def __str__(self) -> str:
        return f">={self.low}" if self.high is None else f">={self.low},<{self.high}"


@functools.cache
def installed_transformers() -> str | None:
    """The installed transformers version string, or None; reads package metadata, never imports it."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None
