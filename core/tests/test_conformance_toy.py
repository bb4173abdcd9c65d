"""The conformance suites on the toy trunk, with and without recurrent state."""
import pytest

from verispec.testing import TrunkConformance, ToyTrunk


class TestToyRecurrent(TrunkConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def trunk(cls):
        return ToyTrunk(vocab_size=32, recurrent=True)


class TestToyAttentionOnly(TrunkConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def trunk(cls):
        return ToyTrunk(vocab_size=32, recurrent=False)


def test_a_trunk_with_too_short_a_context_fails_at_once_naming_what_it_needs(tmp_path):
    """The README's requirement is the suite's: 219 positions with the defaults."""
    import subprocess
    import sys

    assert TrunkConformance.required_context_length() == 219
    (tmp_path / "test_short.py").write_text(
        "import pytest\nfrom verispec.testing import TrunkConformance, ToyTrunk\n"
        "class TestShort(TrunkConformance):\n"
        "    @pytest.fixture(scope='class')\n    @classmethod\n"
        "    def trunk(cls):\n        return ToyTrunk(vocab_size=32, recurrent=False, max_context_length=218)\n"
        "class TestEnough(TestShort):\n"
        "    @pytest.fixture(scope='class')\n    @classmethod\n"
        "    def trunk(cls):\n        return ToyTrunk(vocab_size=32, recurrent=False, max_context_length=219)\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                        str(tmp_path / "test_short.py")], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "max_context_length >= 219" in r.stdout and "this one holds 218" in r.stdout
    assert "12 passed, 12 errors" in r.stdout, r.stdout[-2000:]
