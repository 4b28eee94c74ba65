"""The registry: family tables, resolution beyond the declared ranges, and probe failures."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

import tfcompat
from tfcompat import registry
from tfcompat.errors import TfcompatError
from tfcompat.inputs.reference_rope import REFERENCES
from tfcompat.registry import lookup, tables, upstream
from tfcompat.registry.records import LinearAttention
from tfcompat.registry.validation import check_family
from tfcompat.registry.versions import VersionRange, installed_transformers, release_floor

FAMILY = registry.family("glm4v")
FAMILY_FILES = sorted((Path(tfcompat.__file__).parent / "registry" / "tables").glob("*.py"))


@pytest.mark.parametrize("key", sorted(registry.families()))
class TestTables:
    """Rule: every family is one well-formed table: contiguous entries, a vision tower exactly for the vision
    families, deviations named by the family's reference, and it resolves on the installed release."""

    def test_entries_are_contiguous_and_named(self, key):
        fam = registry.family(key)
        assert fam.entries and all(e.family == key for e in fam.entries)
        for before, after in zip(fam.entries, fam.entries[1:]):
            assert before.versions.high == after.versions.low, (before.versions, after.versions)
            assert release_floor(after.versions.low) < release_floor(after.versions.high or "99.0")

    def test_vision_fields_agree(self, key):
        fam = registry.family(key)
        for entry in fam.entries:
            assert (entry.vision is not None) == fam.is_vision, entry.versions
            if entry.vision is not None:
                assert entry.vision.owner in entry.classes
        assert bool(fam.sample_vision) == fam.is_vision
        assert not fam.reference_rope_index or fam.is_vision

    def test_deviations_are_the_references(self, key):
        fam = registry.family(key)
        named = {d for e in fam.entries for d in e.rope_index_deviations}
        if fam.reference_rope_index is None:
            assert not named
        else:
            assert fam.reference_rope_index in REFERENCES
            assert named <= REFERENCES[fam.reference_rope_index].deviations.keys()

    def test_resolves_on_the_installed_release(self, key):
        if key not in registry.installed_families():
            pytest.skip(f"{key} is not in this transformers ({registry.family(key).supported})")
        version = str(installed_transformers())
        bug = upstream.bug_in(registry.match(key, version)[0].module, version, key)
        if bug is not None:  # tests/test_upstream.py checks the refusal
            pytest.skip(f"{key} is refused on transformers {version} for the upstream bug {bug.name}")
        r = tfcompat.resolve(key)
        assert r.spec is registry.family(key) and r.family == key
        assert all(p.ok for p in r.probes)


@pytest.mark.parametrize("path", FAMILY_FILES, ids=lambda p: p.name)
def test_family_modules_import_only_the_records(path):
    """Rule: a family table imports `tfcompat.registry.records`, `tfcompat.registry.versions` and its builders, never
    the lookup (which imports the tables) nor transformers."""
    allowed = {"records", "versions"} | {p.stem for p in FAMILY_FILES}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            names = [node.module] if node.module else [a.name for a in node.names]
            assert all(n.split(".")[0] in allowed for n in names), (path.name, names)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            top = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            assert top.split(".")[0] in {"__future__", "dataclasses", "typing", "torch"}, (path.name, top)


class TestForwardCompatibility:
    """Rule: a transformers newer than every range resolves by probing, with a warning; a failed probe raises
    naming the module, the symbol and the supported range."""

    def test_newer_version_probes_with_a_warning(self, monkeypatch):
        """Simulated by reporting 5.99.0 as installed: the newest entry is probed against the real modules,
        so it resolves where they are the newest entry's, and raises naming the symbol where they are not."""
        actual = registry.versions.installed_transformers()
        monkeypatch.setattr(registry.versions, "installed_transformers", lambda: "5.99.0")
        lookup._resolve.cache_clear()
        try:
            with pytest.warns(tfcompat.ForwardCompatWarning, match="newer than every glm4v entry"):
                if actual in FAMILY.entries[-1].versions:
                    r = registry.resolve("glm4v")
                    assert r.forward_compatible and r.entry is FAMILY.entries[-1]
                    assert "NOT declared" in r.explain()
                else:
                    with pytest.raises(tfcompat.SymbolProbeError, match="5.99.0") as info:
                        registry.resolve("glm4v")
                    assert "transformers.models.glm4v.modeling_glm4v" in str(info.value)
                    assert "nearest supported" in str(info.value)
        finally:
            lookup._resolve.cache_clear()

    def test_failed_probe_names_module_symbol_and_support(self):
        newest = FAMILY.entries[-1]
        bogus = replace(newest, rotary=replace(newest.rotary, apply="apply_rotary_that_was_removed"))
        with pytest.raises(tfcompat.SymbolProbeError) as info:
            registry.resolve_entry(FAMILY, bogus, "5.99.0", True)
        msg = str(info.value)
        assert "transformers.models.glm4v.modeling_glm4v.apply_rotary_that_was_removed" in msg
        assert "5.99.0" in msg and "supported" in msg and "fix" in msg
        assert isinstance(info.value, tfcompat.UnsupportedVersionError)

    def test_wrong_rotary_convention_is_caught(self):
        entry, _ = registry.match("glm4v", registry.versions.installed_transformers())
        layout = "folded" if entry.rotary.layout == "sectioned" else "sectioned"
        flipped = replace(entry, rotary=replace(entry.rotary, layout=layout))
        with pytest.raises(tfcompat.SymbolProbeError, match="convention"):
            registry.resolve_entry(FAMILY, flipped, registry.versions.installed_transformers(), False)

    def test_missing_class_is_caught(self):
        entry, _ = registry.match("glm4v", registry.versions.installed_transformers())
        broken = replace(entry, classes={**entry.classes, "attention": "Glm4vTextAttentionGone"})
        with pytest.raises(tfcompat.SymbolProbeError, match="Glm4vTextAttentionGone is missing"):
            registry.resolve_entry(FAMILY, broken, registry.versions.installed_transformers(), False)

    def test_vision_owner_without_the_tower_is_caught(self):
        entry, _ = registry.match("glm4v", registry.versions.installed_transformers())
        broken = replace(entry, vision=replace(entry.vision, owner="text_model"))
        with pytest.raises(tfcompat.SymbolProbeError, match="Glm4vTextModel.get_image_features is missing"):
            registry.resolve_entry(FAMILY, broken, registry.versions.installed_transformers(), False)


class TestTableValidation:
    """Rule: a malformed family table fails when `registry.families()` collects it, in any environment."""

    @pytest.mark.parametrize("fam, match", [
        (lambda f: replace(f, entries=()), "no entries"),
        (lambda f: replace(f, entries=(f.entries[1], f.entries[0], *f.entries[2:])), "not contiguous"),
        (lambda f: replace(f, entries=(f.entries[0], *f.entries[2:])), "not contiguous"),
        (lambda f: replace(f, entries=(replace(f.entries[0], versions=VersionRange(
            f.entries[0].versions.low, f.entries[1].versions.high)), *f.entries[1:])), "not contiguous"),
        (lambda f: replace(f, entries=(replace(f.entries[0], vision=None), *f.entries[1:])), "no vision tower"),
        (lambda f: replace(f, entries=(replace(f.entries[0], family="qwen2_vl"), *f.entries[1:])), "names family"),
        (lambda f: replace(f, entries=(replace(f.entries[0], classes={
            k: v for k, v in f.entries[0].classes.items() if k != "rotary"}), *f.entries[1:])), "no class role rotary"),
        (lambda f: replace(f, entries=(replace(f.entries[0], linear_attention=LinearAttention()),
                                       *f.entries[1:])), "linear_attention"),
        (lambda f: replace(f, sample_vision=()), "sample_vision"),
    ], ids=["empty", "order", "gap", "overlap", "vision", "key", "roles", "linear", "sample"])
    def test_bad_table_is_refused(self, fam, match):
        check_family(FAMILY)  # non-vacuity: the real table passes
        with pytest.raises(TfcompatError, match=r"family table of 'glm4v' is malformed(.|\n)*" + match):
            check_family(fam(FAMILY))

    def test_families_checks_every_table(self, monkeypatch):
        broken = replace(FAMILY, entries=(FAMILY.entries[0], *FAMILY.entries[2:]))
        monkeypatch.setattr(tables, "FAMILIES", (*tables.FAMILIES, broken))
        lookup.families.cache_clear()
        try:
            with pytest.raises(TfcompatError, match="not contiguous"):
                registry.families()
        finally:
            monkeypatch.undo()
            lookup.families.cache_clear()
        assert "glm4v" in registry.families()
