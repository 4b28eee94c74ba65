"""The error contract: one hierarchy under TfcompatError, messages that say what is supported and how to fix it."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tfcompat
from tfcompat import errors, registry

ERROR_CLASSES = [getattr(errors, name) for name in errors.__all__]


class TestUnknownFamily:
    """An unknown family key raises UnknownFamilyError (a ValueError) with a did-you-mean and the supported families."""

    @pytest.mark.parametrize("bad", ["glm-4v", "GLM4V", "glm_4v", "Glm4V"])
    def test_did_you_mean(self, bad: str) -> None:
        with pytest.raises(tfcompat.UnknownFamilyError, match=r"did you mean 'glm4v'") as info:
            tfcompat.resolve(bad)
        err = info.value
        assert isinstance(err, ValueError)
        assert err.family == bad
        assert repr(bad) in str(err)
        supported_line = re.search(r"^  supported: (.*)$", str(err), re.M)
        assert supported_line, str(err)
        for key in registry.families():
            assert re.search(rf"\b{re.escape(key)}\b", supported_line.group(1)), key

    def test_caught_as_value_error(self) -> None:
        with pytest.raises(ValueError, match="unknown model family"):
            tfcompat.resolve("glm-4v")

    def test_no_guess_for_unrelated_key(self) -> None:
        # not a causal LM (a causal LM without a written table is derived: tests/test_derived.py)
        with pytest.raises(tfcompat.UnknownFamilyError, match=r"unknown model family 'resnet'") as info:
            registry.match("resnet", "5.0.0")
        assert "did you mean" not in str(info.value)
        assert "glm4v" in info.value.supported  # still lists what is supported


class TestUnsupportedVersion:
    """A version below the family's span raises UnsupportedVersionError naming the version, family, span and a fix."""

    def test_message(self) -> None:
        with pytest.raises(tfcompat.UnsupportedVersionError,
                           match=r"glm4v is not supported on transformers 4\.52\.4") as info:
            registry.match("glm4v", "4.52.4")
        msg = str(info.value)
        for needle in ("4.52.4", "glm4v", "supported", "fix", "4.53"):
            assert needle in msg, needle
        assert info.value.family == "glm4v"
        assert info.value.transformers_version == "4.52.4"
        assert "4.53" in info.value.fix
        assert not isinstance(info.value, ValueError)


class TestHierarchy:
    """Every error class is exported from tfcompat and subclasses TfcompatError."""

    @pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
    def test_exported(self, cls: type) -> None:
        assert getattr(tfcompat, cls.__name__) is cls
        assert cls.__name__ in tfcompat.__all__
        assert issubclass(cls, tfcompat.TfcompatError)
        assert issubclass(cls, Exception)

    def test_every_exported_exception_is_in_the_hierarchy(self) -> None:
        exported = [getattr(tfcompat, n) for n in tfcompat.__all__]
        exceptions = {o for o in exported
                      if isinstance(o, type) and issubclass(o, Exception) and not issubclass(o, Warning)}
        assert exceptions == set(ERROR_CLASSES)

    def test_probe_failures_are_unsupported_versions(self) -> None:
        assert issubclass(tfcompat.SymbolProbeError, tfcompat.UnsupportedVersionError)

    def test_input_errors_are_value_errors(self) -> None:
        assert issubclass(tfcompat.InvalidInputError, ValueError)
        assert issubclass(tfcompat.UnknownFamilyError, ValueError)


class TestPickle:
    """Errors survive a pickle round trip (they cross torch.multiprocessing workers) with message and fields intact."""

    FIELDS = ("what", "family", "transformers_version", "why", "supported", "fix")

    @pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
    def test_round_trip(self, cls: type) -> None:
        err = cls("it broke", family="glm4v", transformers_version="5.0.0rc1", why="because", supported="4.53+",
                  fix="do x")
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls
        assert str(back) == str(err)
        assert back.args == err.args
        for name in self.FIELDS:
            assert getattr(back, name) == getattr(err, name), name

    @pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
    def test_round_trip_minimal(self, cls: type) -> None:
        err = cls("just what")
        back = pickle.loads(pickle.dumps(err))
        assert str(back) == str(err) == "just what"

    def test_raised_error_round_trip(self) -> None:
        with pytest.raises(tfcompat.UnknownFamilyError) as info:
            tfcompat.resolve("glm-4v")
        back = pickle.loads(pickle.dumps(info.value))
        assert type(back) is tfcompat.UnknownFamilyError
        assert str(back) == str(info.value)
        assert back.family == "glm-4v"


@pytest.mark.broad  # release-independent; a fresh interpreter is slow on a loaded machine
class TestImportIsLight:
    """`import tfcompat` (and `tfcompat.tiny_models`) imports no transformers module (resolve() and patch() import
    it, for the family asked for)."""

    def test_fresh_interpreter(self) -> None:
        root = Path(tfcompat.__file__).resolve().parent.parent
        code = (
            "import json, sys\n"
            "def tf(): return sorted(m for m in sys.modules if m == 'transformers' or m.startswith('transformers.'))\n"
            "import tfcompat, tfcompat.tiny_models\n"
            "after_import = tf()\n"
            "from tfcompat import registry\n"
            "registry.match('glm4v', '5.0.0'); registry.families()\n"
            "after_match = tf()\n"
            "import transformers\n"
            "print(json.dumps({'file': tfcompat.__file__, 'after_import': after_import, 'after_match': after_match,\n"
            "                  'after_transformers': tf()}))\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        assert Path(report["file"]).resolve() == Path(tfcompat.__file__).resolve()
        assert report["after_import"] == []
        assert report["after_match"] == []  # matching versions reads metadata and family tables only
        assert "transformers" in report["after_transformers"]  # the probe does see transformers once imported
