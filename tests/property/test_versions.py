"""Property tests for version ranges and registry matching (tfcompat.registry.versions, tfcompat.registry).

Versions are generated in every PEP 440 shape transformers builds come in (release, dev, pre, post, local
and their combinations, in several spellings) on release lines in and around the glm4v span 4.53 .. 5.25.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from packaging.version import Version

import tfcompat
from tfcompat import registry
from tfcompat.registry.tables.glm4v import FAMILY
from tfcompat.registry.versions import VersionRange, installed_transformers

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SPAN_LOW = Version("4.53.0.dev0")
SPAN_HIGH = Version("5.26.0.dev0")
BY_LOW = {e.versions.low: e for e in FAMILY.entries}

# ---------------------------------------------------------------------------------------------- strategies

ALL_LINES = st.tuples(st.sampled_from([4, 5, 6]), st.integers(0, 60))
SPAN_LINES = st.one_of(st.tuples(st.just(4), st.integers(53, 60)), st.tuples(st.just(5), st.integers(0, 25)))
BELOW_LINES = st.one_of(st.tuples(st.integers(0, 3), st.integers(0, 60)), st.tuples(st.just(4), st.integers(0, 52)))
ABOVE_LINES = st.one_of(st.tuples(st.just(5), st.integers(26, 60)), st.tuples(st.integers(6, 9), st.integers(0, 60)))

PRE_SPELLINGS = {"a": ["a", "alpha"], "b": ["b", "beta"], "rc": ["rc", "c", "pre", "RC"]}
LOCALS = st.one_of(
    st.sampled_from(["cpu", "cu121.g1234", "local", "rocm6.2", "cu118.torch2.13"]),
    st.from_regex(r"[a-z0-9]{1,6}(\.[a-z0-9]{1,6}){0,2}", fullmatch=True),
)


@st.composite
def version_strings(draw: st.DrawFn, lines: st.SearchStrategy[tuple[int, int]] = ALL_LINES) -> str:
    """A PEP 440 version string on a release line drawn from ``lines``: release, pre, post, dev, local."""
    major, minor = draw(lines)
    release = [major, minor, *draw(st.lists(st.integers(0, 12), max_size=2))]
    s = ".".join(map(str, release))
    if draw(st.booleans()):  # pre-release
        kind = draw(st.sampled_from(sorted(PRE_SPELLINGS)))
        s += (draw(st.sampled_from(["", ".", "-"])) + draw(st.sampled_from(PRE_SPELLINGS[kind]))
              + str(draw(st.integers(0, 5))))
    if draw(st.booleans()):  # post-release
        n = draw(st.integers(0, 9))
        s += draw(st.sampled_from([f".post{n}", f"-post{n}", f".rev{n}", f"-{n}"]))
    if draw(st.booleans()):  # dev
        s += draw(st.sampled_from([".dev", "-dev", "dev"])) + str(draw(st.integers(0, 20)))
    if draw(st.booleans()):
        s += "+" + draw(LOCALS)
    Version(s)  # the strategy only yields valid versions
    return s


def line_strings(majors=st.sampled_from([4, 5]), minors=st.integers(0, 12)) -> st.SearchStrategy[str]:
    return st.builds(lambda a, b: f"{a}.{b}", majors, minors)


# ---------------------------------------------------------------------------------------------- matching


class TestDeclaredSpan:
    """Every version v with 4.53.0.dev0 <= v < 5.26.0.dev0 matches exactly one glm4v entry, not forward-compatibly."""

    @SETTINGS
    @given(version_strings(SPAN_LINES))
    @example("4.53.0.dev0")
    @example("4.53.0a0.dev0")
    @example("4.53.0.dev0+cpu")
    @example("5.25.99.post9+cu121")
    @example("5.25.0")
    @example("5.24.0rc3.dev1")
    def test_exactly_one_entry(self, v: str) -> None:
        assert SPAN_LOW <= Version(v) < SPAN_HIGH
        containing = [e for e in FAMILY.entries if v in e.versions]
        assert len(containing) == 1, (v, [str(e.versions) for e in containing])
        entry, forward = registry.match("glm4v", v)
        assert forward is False
        assert entry is containing[0]

    @SETTINGS
    @given(version_strings(SPAN_LINES))
    def test_normalized_and_raw_spellings_agree(self, v: str) -> None:
        assert registry.match("glm4v", v) == registry.match("glm4v", str(Version(v)))

    @pytest.mark.parametrize(
        ("version", "low"),
        [
            ("4.53.0.dev0", "4.53"),
            ("4.53.3", "4.53"),
            ("4.54.0.dev0", "4.54"),
            ("4.54.9.post2", "4.54"),
            ("4.55.99.post2", "4.55"),
            ("4.56.0rc1", "4.56"),
            ("4.57.6.post1", "4.56"),
            ("4.99.0+local", "4.56"),
            ("5.0.0.dev0", "5.0"),
            ("5.0.0rc1", "5.0"),
            ("5.0.0a1.dev3", "5.0"),
            ("5.2.9", "5.0"),
            ("5.3.0.dev0", "5.3"),
            ("5.16.9.post3", "5.3"),
            ("5.17.0.dev0", "5.17"),
            ("5.17.0+local", "5.17"),
            ("5.23.1", "5.17"),
            ("5.24.0", "5.24"),
            ("5.24.0.dev0", "5.24"),
            ("5.25.0", "5.24"),
        ],
    )
    def test_builds_land_in_their_release_line(self, version: str, low: str) -> None:
        assert registry.match("glm4v", version) == (BY_LOW[low], False)


class TestOlderVersionsRejected:
    """Every version below 4.53.0.dev0 raises UnsupportedVersionError naming the family and what is supported."""

    @SETTINGS
    @given(version_strings(BELOW_LINES))
    @example("4.52.4")
    @example("4.52.99999.post9+local")
    @example("4.52.0rc1")
    @example("0.0")
    def test_raises(self, v: str) -> None:
        assert Version(v) < SPAN_LOW
        with pytest.raises(tfcompat.UnsupportedVersionError, match=r"(?s)glm4v.*4\.53") as info:
            registry.match("glm4v", v)
        assert v in str(info.value)
        assert info.value.family == "glm4v"
        assert info.value.transformers_version == v
        assert not any(v in e.versions for e in FAMILY.entries)


class TestNewerVersionsForwardCompatible:
    """Every version >= 5.26.0.dev0 resolves against the newest entry, flagged forward-compatible."""

    @SETTINGS
    @given(version_strings(ABOVE_LINES))
    @example("5.26.0.dev0")
    @example("5.26.0.dev0+cpu")
    @example("5.26.0rc1")
    @example("6.0.0")
    @example("5.100")
    def test_newest_entry_flagged(self, v: str) -> None:
        assert Version(v) >= SPAN_HIGH
        assert registry.match("glm4v", v) == (FAMILY.entries[-1], True)
        assert not any(v in e.versions for e in FAMILY.entries)


class TestEveryVersionClassified:
    """Any version is exactly one of: inside one entry, older (raises), newer (forward-compatible)."""

    @SETTINGS
    @given(version_strings(ALL_LINES))
    def test_trichotomy(self, v: str) -> None:
        parsed = Version(v)
        if parsed < SPAN_LOW:
            with pytest.raises(tfcompat.UnsupportedVersionError):
                registry.match("glm4v", v)
        elif parsed >= SPAN_HIGH:
            assert registry.match("glm4v", v) == (FAMILY.entries[-1], True)
        else:
            entry, forward = registry.match("glm4v", v)
            assert not forward
            assert [e for e in FAMILY.entries if v in e.versions] == [entry]


# ---------------------------------------------------------------------------------------------- VersionRange


class TestVersionRange:
    """``v in VersionRange(lo, hi)`` iff ``lo.0.dev0 <= v < hi.0.dev0`` on PEP 440 ordering; ranges are intervals."""

    @SETTINGS
    @given(line_strings(), st.one_of(st.none(), line_strings()),
           version_strings(st.tuples(st.sampled_from([4, 5]), st.integers(0, 12))))
    def test_membership_matches_pep440_ordering(self, lo: str, hi: str | None, v: str) -> None:
        expected = Version(f"{lo}.0.dev0") <= Version(v) and (hi is None or Version(v) < Version(f"{hi}.0.dev0"))
        r = VersionRange(lo, hi)
        assert (v in r) is expected
        assert (Version(v) in r) is expected

    @settings(max_examples=100, deadline=None)
    @given(
        line_strings(),
        st.one_of(st.none(), line_strings()),
        st.lists(version_strings(st.tuples(st.sampled_from([4, 5]), st.integers(0, 12))), min_size=2, max_size=30),
    )
    def test_membership_is_an_interval(self, lo: str, hi: str | None, vs: list[str]) -> None:
        r = VersionRange(lo, hi)
        inside = "".join("1" if v in r else "0" for v in sorted(vs, key=Version))
        # no holes: the members of a sorted list are one contiguous run; unbounded ranges are upward closed
        assert re.fullmatch(r"0*1*0*" if hi is not None else r"0*1*", inside), inside

    @SETTINGS
    @given(
        st.lists(line_strings(), min_size=3, max_size=3).map(lambda ls: sorted(ls, key=Version)),
        version_strings(st.tuples(st.sampled_from([4, 5]), st.integers(0, 12))),
    )
    def test_adjacent_ranges_partition_their_union(self, lines: list[str], v: str) -> None:
        a, b, c = lines
        left, right, union = VersionRange(a, b), VersionRange(b, c), VersionRange(a, c)
        assert not (v in left and v in right)
        assert (v in left or v in right) is (v in union)

    @pytest.mark.parametrize(
        ("version", "inside"),
        [("4.99", False), ("5.0.0.dev0", True), ("5.0.0rc1", True), ("5.2.9.post1+local", True), ("5.3.0.dev0", False)],
    )
    def test_boundaries_are_dev0_of_the_release_line(self, version: str, inside: bool) -> None:
        assert (version in VersionRange("5.0", "5.3")) is inside

    def test_str(self) -> None:
        assert str(VersionRange("5.0", "5.3")) == ">=5.0,<5.3"
        assert str(VersionRange("5.0")) == ">=5.0"


class TestEntriesContiguous:
    """A family's entries are contiguous and non-overlapping: each entry's high is the next entry's low."""

    @pytest.mark.parametrize("key", sorted(registry.families()))
    def test_contiguous(self, key: str) -> None:
        entries = registry.families()[key].entries
        assert entries
        for e in entries:
            assert e.family == key
            assert e.versions.high is None or Version(e.versions.low) < Version(e.versions.high), e.versions
        for e, nxt in zip(entries, entries[1:]):
            assert e.versions.high is not None, f"only the newest entry may be unbounded: {e.versions}"
            assert e.versions.high == nxt.versions.low, (str(e.versions), str(nxt.versions))

    def test_glm4v_span(self) -> None:
        assert FAMILY.entries[0].versions.low == "4.53"
        assert FAMILY.entries[-1].versions.high == "5.26"
        assert registry.families()["glm4v"] is FAMILY


# ---------------------------------------------------------------------------------------------- resolve


class TestResolveInstalled:
    """resolve() on the installed transformers picks the entry holding that version and probes every symbol."""

    def test_entry_contains_installed_version(self) -> None:
        installed = installed_transformers()
        resolved = tfcompat.resolve("glm4v")
        entry, forward = registry.match("glm4v", installed)
        assert resolved.transformers_version == installed
        assert resolved.entry is entry
        assert resolved.forward_compatible is forward
        if not forward:
            assert installed in resolved.entry.versions

    def test_explain_lists_range_and_every_probe_ok(self) -> None:
        resolved = tfcompat.resolve("glm4v")
        text = resolved.explain()
        assert str(resolved.entry.versions) in text
        assert resolved.entry.why in text
        assert resolved.probes
        for p in resolved.probes:
            assert p.ok, p
            assert f"[ok] {p.what}: {p.detail}" in text
        assert text.count("[ok]") == len(resolved.probes)
        assert "[FAIL]" not in text
        probed = {p.what for p in resolved.probes}
        assert {f"{role} class" for role in resolved.entry.classes} <= probed

    def test_cached(self) -> None:
        first = tfcompat.resolve("glm4v")
        assert tfcompat.resolve("glm4v") is first
