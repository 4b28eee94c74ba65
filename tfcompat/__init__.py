"""tfcompat: model patches (packed sequences, varlen attention) that keep working across transformers releases.

Importing tfcompat imports neither transformers' model modules nor transformers itself; `resolve` and
`patch` do, for the family asked for.
"""

from __future__ import annotations

from . import heads, ulysses
from .embedding import embed_inputs
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
from .packer import Packed, pack
from .patching import PatchHandle, patch
from .registry import ForwardCompatWarning, Resolved, resolve
from .rope_index import rope_index

__version__ = "0.1.0"

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
    "pack",
    "patch",
    "resolve",
    "rope_index",
    "ulysses",
]
