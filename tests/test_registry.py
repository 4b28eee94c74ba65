"""Resolution beyond the declared ranges, and probe failures."""

from __future__ import annotations

from dataclasses import replace

import pytest

import tfcompat
from tfcompat import registry
from tfcompat.families import glm4v


class TestForwardCompatibility:
    """Rule: a transformers newer than every range resolves by probing, with a warning; a failed probe raises
    naming the module, the symbol and the supported range."""

    def test_newer_version_probes_with_a_warning(self, monkeypatch):
        """Simulated by reporting 5.99.0 as installed: the newest entry is probed against the real modules,
        so it resolves where they are the newest entry's, and raises naming the symbol where they are not."""
        actual = registry.versions.installed_transformers()
        monkeypatch.setattr(registry.versions, "installed_transformers", lambda: "5.99.0")
        registry._resolve.cache_clear()
        try:
            with pytest.warns(tfcompat.ForwardCompatWarning, match="newer than every glm4v entry"):
                if actual in glm4v.ENTRIES[-1].versions:
                    r = registry.resolve("glm4v")
                    assert r.forward_compatible and r.entry is glm4v.ENTRIES[-1]
                    assert "NOT declared" in r.explain()
                else:
                    with pytest.raises(tfcompat.SymbolProbeError, match="5.99.0") as info:
                        registry.resolve("glm4v")
                    assert "transformers.models.glm4v.modeling_glm4v" in str(info.value)
                    assert "nearest supported" in str(info.value)
        finally:
            registry._resolve.cache_clear()

    def test_failed_probe_names_module_symbol_and_support(self):
        bogus = replace(glm4v.ENTRIES[-1], apply_rotary="apply_rotary_that_was_removed")
        with pytest.raises(tfcompat.SymbolProbeError) as info:
            registry._probe(bogus, "5.99.0", True)
        msg = str(info.value)
        assert "transformers.models.glm4v.modeling_glm4v.apply_rotary_that_was_removed" in msg
        assert "5.99.0" in msg and "supported" in msg and "fix" in msg
        assert isinstance(info.value, tfcompat.UnsupportedVersionError)

    def test_wrong_rotary_convention_is_caught(self):
        entry, _ = registry.match("glm4v", registry.versions.installed_transformers())
        flipped = replace(entry, rotary_layout="folded" if entry.rotary_layout == "sectioned" else "sectioned")
        with pytest.raises(tfcompat.SymbolProbeError, match="convention"):
            registry._probe(flipped, registry.versions.installed_transformers(), False)

    def test_missing_class_is_caught(self):
        entry, _ = registry.match("glm4v", registry.versions.installed_transformers())
        broken = replace(entry, classes={**entry.classes, "attention": "Glm4vTextAttentionGone"})
        with pytest.raises(tfcompat.SymbolProbeError, match="Glm4vTextAttentionGone is missing"):
            registry._probe(broken, registry.versions.installed_transformers(), False)
