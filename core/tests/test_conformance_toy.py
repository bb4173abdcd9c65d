"""The conformance suites on the toy trunk, with and without recurrent state."""
import pytest

from verispec.testing import TargetConformance, ToyTarget


class TestToyRecurrent(TargetConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def target(cls):
        return ToyTarget(vocab_size=32, recurrent=True)


class TestToyAttentionOnly(TargetConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def target(cls):
        return ToyTarget(vocab_size=32, recurrent=False)
