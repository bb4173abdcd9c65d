"""The real pair: Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct (skipped,
naming the install line, when a checkpoint's packages are not installed)."""
import pytest
from verispec.engine import SpecOptions
from verispec.testing import real_checkpoint

pytestmark = pytest.mark.real_checkpoint

PROMPT = [{"role": "user", "content": "Here is a function:\n\ndef area(w, h):\n    return w * h\n\n"
                                      "Add type hints and a docstring; reply with the function only."}]


@pytest.fixture(scope="module")
def engine():
    import verispec

    target = real_checkpoint("qwen2.5-coder-1.5b-instruct")
    return verispec.load(target, enabled=False, kv_cache_gb=0)


def test_the_real_pair_binds_and_its_speculative_stream_is_the_plain_one(engine):
    plain = [e.token for e in engine.generate(PROMPT, max_tokens=48, ignore_eos=True)]
    engine.update_speculation(SpecOptions(spec_type="draft-model", adaptive=False, min_draft_prob=0.0,
                                          draft_model=real_checkpoint("qwen2.5-coder-0.5b-instruct")))
    generation = engine.generate(PROMPT, max_tokens=48, ignore_eos=True)
    assert [e.token for e in generation] == plain
    stats = generation.result.spec
    assert stats.num_draft_tokens > 20 and stats.acceptance_rate > 0.5  # same family, same tokenizer


def test_a_drafter_of_another_tokenizer_is_declined_naming_the_piece(engine):
    from verispec.speculator_choice import SpeculationUnavailable

    with pytest.raises(SpeculationUnavailable, match=r"the tokenizers differ at id \d+: the trunk's piece is"):
        engine.update_speculation(SpecOptions(spec_type="draft-model",
                                              draft_model=real_checkpoint("smollm2-135m-instruct")))
