"""tfcompat: model patches (packed sequences, varlen attention) that keep working across transformers releases.

Importing tfcompat imports neither transformers' model modules nor transformers itself; `resolve` and
`patch` do, for the family asked for.
"""

from __future__ import annotations

import importlib.metadata as _metadata

from . import heads, ulysses
from .errors import (
    InvalidInputError,
    PatchedModelError,
    PatchError,
    SymbolProbeError,
    TfcompatError,
    TransportError,
    UnknownFamilyError,
    UnsupportedVersionError,
)
from .hf.patching import PatchHandle, is_patched, patch
from .inputs.embedding import embed_inputs
from .inputs.pack import Packed, pack
from .inputs.rope_index import rope_index
from .registry import ForwardCompatWarning, Resolved, resolve

try:  # one source: pyproject.toml's [project] version, read back from the installed package's metadata
    __version__ = _metadata.version(__name__)
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "ForwardCompatWarning",
    "InvalidInputError",
    "Packed",
    "PatchError",
    "PatchHandle",
    "PatchedModelError",
    "Resolved",
    "SymbolProbeError",
    "TfcompatError",
    "TransportError",
    "UnknownFamilyError",
    "UnsupportedVersionError",
    "__version__",
    "embed_inputs",
    "heads",
    "is_patched",
    "pack",
    "patch",
    "resolve",
    "rope_index",
    "ulysses",
]
