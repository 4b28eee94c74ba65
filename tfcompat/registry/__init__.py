"""What each family looks like on each transformers release; no forward-time code.

The face of the registry: `families`, `family`, `match`, `resolve`, `resolve_model` and `Resolved`
(`lookup`), over the records (`records`), version ranges (`versions`), symbol probes (`probing`), the
uniform rotary adapter (`rotary`) and the family tables (`families/`).
"""

from .lookup import (
    ForwardCompatWarning,
    Resolved,
    VisionModules,
    derivable_types,
    families,
    family,
    installed_families,
    match,
    resolve,
    resolve_entry,
    resolve_model,
)

__all__ = ["ForwardCompatWarning", "Resolved", "VisionModules", "derivable_types", "families", "family",
           "installed_families", "match", "resolve", "resolve_entry", "resolve_model"]
