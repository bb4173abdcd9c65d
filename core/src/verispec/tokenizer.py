"""The tokenizer and chat template a GGUF carries in its own metadata (`tokenizers`, jinja2).

`Tokenizer.from_gguf(file)` wraps the `tokenizers.Tokenizer` that `verispec.gguf.vocab` builds from
the `tokenizer.ggml.*` keys with transformers' GGUF converter, and caches. That covers
`tokenizer.ggml.model` "llama" (SentencePiece-style BPE; Gemma gets its respelled-space and
file-order merge fixes), "gpt2" (byte-level BPE; the `tokenizer.ggml.pre` split regex, e.g.
qwen2, llama3), "gemma4" and "t5". Only the first start imports transformers (Gemma's 262k
vocabulary on 2 shared cores: 4-7 s cold, 1-2 s warm, GGUF open included; the cache entry's
sha256 check takes 0.02 s for Gemma's 33 MB).

BOS/EOS follow llama.cpp: `tokenizer.ggml.add_bos_token` (default: on for "llama"
vocabularies, off otherwise) and `add_eos_token`. Text passed to `encode` may contain
special tokens ("<start_of_turn>", "<|im_start|>"); they are matched whole, as llama.cpp does
with parse_special. `encode_chat` keeps the template's markup and the messages' text apart:
only the markup yields control tokens, a message's "<|im_end|>" stays text.

Chat templates render through verispec.chat.template (jinja2's immutable sandbox, bounded in
time and size; a template that fails raises its ChatTemplateError).
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from verispec.chat.template import DEFAULT_CHAT_TEMPLATES, ChatTemplate
from verispec.errors import VerispecError
from verispec.gguf import vocab
from verispec.gguf.io import GGUFFile

__all__ = [
    "ForgedControlToken",
    "InvalidText",
    "NoChatTemplate",
    "StreamDecoder",
    "Tokenizer",
    "TokenizerError",
    "UnsupportedTokenizer",
    "text_problem",
]

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# End-of-turn spellings that also end generation when the vocabulary has them
# (llama.cpp's end-of-generation set, ggml-org/llama.cpp:src/llama-vocab.cpp).
_END_OF_TURN = ("<end_of_turn>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
                "<|return|>", "<｜end▁of▁sentence｜>", "<end_of_utterance>")

class TokenizerError(VerispecError):
    """A tokenizer cannot be built from, or used with, this file."""


class InvalidText(TokenizerError):
    """`encode` was given something that is not Unicode text: not a str, or a str holding a
    lone surrogate (which no UTF-8 byte sequence spells)."""

    def __init__(self, problem: str):
        self.problem = problem
        super().__init__(f"cannot tokenize: {problem}; pass Unicode text (valid UTF-8)")


def text_problem(text: str, *, os_bytes: bool = False) -> str | None:
    """None when `text` is Unicode text (it encodes as UTF-8); else where the first fault is.

    A lone surrogate is the fault: JSON's "\\ud800" escape makes one, and Python keeps each byte
    of a command-line argument that is not UTF-8 as one (U+DC80..U+DCFF, surrogateescape).
    os_bytes=True reads those as such bytes: "byte 0xe9 at byte 3 is not valid UTF-8".
    """
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        i = e.start
        code = ord(text[i])
        if os_bytes and 0xDC80 <= code <= 0xDCFF:
            offset = len(text[:i].encode("utf-8"))
            return f"byte 0x{code - 0xDC00:02x} at byte {offset} is not valid UTF-8"
        return f"a lone surrogate U+{code:04X} at character {i} is not Unicode text"


class UnsupportedTokenizer(TokenizerError):
    def __init__(self, model: str, architecture: str, reason: str):
        self.model, self.architecture = model, architecture
        super().__init__(f"cannot build the {model!r} tokenizer of a {architecture!r} GGUF: {reason}")


class NoChatTemplate(TokenizerError):
    def __init__(self, architecture: str):
        self.architecture = architecture
        super().__init__(
            f"this {architecture!r} GGUF has no tokenizer.chat_template and verispec has no default for "
            f"the family (defaults: {', '.join(sorted(DEFAULT_CHAT_TEMPLATES))}); "
            "send plain text instead (`verispec generate` without --chat, or the server's /v1/completions), "
            "or use a GGUF converted with its chat template")


class ForgedControlToken(TokenizerError):
    """Message content holds control-token text that the chat template's transformation of
    content leaves no way to keep as text."""

    def __init__(self, tokens: Sequence[str]):
        self.tokens = tuple(tokens)
        self.param = "messages"
        super().__init__(f"a message holds control token text ({', '.join(sorted(set(self.tokens)))}) and this "
                         "chat template transforms message content, so it cannot be kept as text; "
                         "remove it from the message")


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and stop tokens."""

    def __init__(self, backend, *, architecture: str, tokens: Sequence[str], bos_id: int | None,
                 eos_id: int | None, add_bos: bool, add_eos: bool, stop_ids: Sequence[int],
                 chat_template: str | None):
        #: the `tokenizers.Tokenizer` doing the work.
        self.backend = backend
        self.architecture = architecture
        self.bos_id, self.eos_id = bos_id, eos_id
        self.add_bos, self.add_eos = add_bos, add_eos
        #: ids that end generation: EOS, EOT/EOM ids and end-of-turn tokens in the vocabulary.
        self.stop_ids: tuple[int, ...] = tuple(stop_ids)
        #: `tokenizer.chat_template` from the GGUF, or None.
        self.chat_template = chat_template
        #: number of token ids the model's vocabulary has (the GGUF's token list).
        self.vocab_size = len(tokens)
        #: the vocabulary pieces as the GGUF spells them, by id (`tokenizer.ggml.tokens`).
        self.tokens: Sequence[str] = tokens
        self._compiled: dict[str, ChatTemplate] = {}
        self._special: frozenset[int] | None = None
        self._as_text = None

    @classmethod
    def from_gguf(cls, gguf: GGUFFile | str | os.PathLike, *, use_cache: bool = True) -> Tokenizer:
        """Build (or load from the cache) the tokenizer described by a GGUF's metadata.

        Raises MissingKey (no tokenizer.ggml.model / tokens), UnsupportedTokenizer.
        """
        if not isinstance(gguf, GGUFFile):
            gguf = GGUFFile.open(gguf)
        md = gguf.metadata
        model = gguf.require("tokenizer.ggml.model")
        tokens = gguf.require("tokenizer.ggml.tokens")
        try:
            backend = vocab.load_backend(gguf, model, use_cache)
        except vocab.UnbuildableVocabulary as e:
            raise UnsupportedTokenizer(model, gguf.architecture, e.reason) from None
        bos_id = md.get("tokenizer.ggml.bos_token_id")
        eos_id = md.get("tokenizer.ggml.eos_token_id")
        add_bos = bool(md.get("tokenizer.ggml.add_bos_token", model == "llama")) and bos_id is not None
        add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
        return cls(backend, architecture=gguf.architecture, tokens=tokens, bos_id=bos_id, eos_id=eos_id,
                   add_bos=add_bos, add_eos=add_eos,
                   stop_ids=_stop_ids(md, tokens), chat_template=md.get("tokenizer.chat_template"))

    # -- ids --

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`; with add_special, BOS/EOS as the file asks (add_bos_token).
        Raises InvalidText for a non-str or a str holding a lone surrogate."""
        try:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        except TypeError:  # `tokenizers` takes only str that encodes as UTF-8
            if not isinstance(text, str):
                raise InvalidText(f"encode takes a str, not {type(text).__name__}") from None
            raise InvalidText(text_problem(text) or "the tokenizer refused the text") from None
        if add_special and self.add_bos:
            ids = [self.bos_id, *ids]
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of `ids`; control tokens (BOS, EOS, <end_of_turn>, ...) are left out unless
        skip_special=False, as llama.cpp renders them."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry as the GGUF spells it."""
        return self.tokens[token_id]

    # -- chat --

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **kwargs) -> str:
        """The prompt text for `messages` ([{"role", "content"}]) through the GGUF's chat template
        (verispec.chat.template: sandboxed, bounded, HF's variables, with bos_token and eos_token
        from this vocabulary and **kwargs such as tools), or the family default in
        DEFAULT_CHAT_TEMPLATES when the file has none. To tokenize it, use `encode_chat`, which
        keeps message text from becoming control tokens. Raises NoChatTemplate, ChatTemplateError.
        """
        return self._template().render(messages, add_generation_prompt, **self._special_tokens(), **kwargs)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **kwargs) -> list[int]:
        """Token ids of `render_chat(messages)` in which only the template's markup yields control
        tokens: a message content holding "<|im_end|>" is tokenized as that text.

        The contents are located in the render by `ChatTemplate.render_marked`. When no control
        token falls inside a content the ids are those of the whole render; otherwise the markup
        pieces are encoded with special tokens and the contents as text. A template that
        transforms content beyond trimming is checked by its control tokens instead: the render
        must hold exactly those of its markup. Raises NoChatTemplate, ChatTemplateError,
        ForgedControlToken (such a template, and content holding control token text).
        """
        render = self._template().render_marked(messages, add_generation_prompt, **self._special_tokens(),
                                                **kwargs)
        encoding = self._encode_whole(render.text)
        special = self._special_ids()
        if not render.follows:  # a template transforming content
            whole = [i for i in encoding.ids if i in special]
            if whole != [i for i in self._encode_whole("".join(render.markup)).ids if i in special]:
                raise ForgedControlToken([self.tokens[i] for i in whole])
            return encoding.ids
        spans = render.content_spans()
        if not any(i in special and any(a < end and start < b for a, b in spans)
                   for i, (start, end) in zip(encoding.ids, encoding.offsets)):
            return encoding.ids
        text_backend = self._text_backend()
        ids: list[int] = []
        for piece, content in zip(render.markup, render.contents + [""]):
            ids += self._encode_whole(piece).ids if piece else []
            ids += text_backend.encode(content, add_special_tokens=False).ids if content else []
        return ids

    def _template(self) -> ChatTemplate:
        source = self.chat_template or DEFAULT_CHAT_TEMPLATES.get(self.architecture)
        if source is None:
            raise NoChatTemplate(self.architecture)
        if source not in self._compiled:
            self._compiled[source] = ChatTemplate(source)
        return self._compiled[source]

    def _special_tokens(self) -> dict[str, str]:
        return {name: self.tokens[i] if i is not None else ""
                for name, i in (("bos_token", self.bos_id), ("eos_token", self.eos_id))}

    def _encode_whole(self, text: str):
        try:
            return self.backend.encode(text, add_special_tokens=False)
        except TypeError:
            raise InvalidText(text_problem(text) or "the tokenizer refused the text") from None

    def _special_ids(self) -> frozenset[int]:
        if self._special is None:
            self._special = frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)
        return self._special

    def _text_backend(self):
        """A copy of the backend that reads special-token spellings as text (a copy, not a toggle
        of the shared one: the server encodes from several threads)."""
        if self._as_text is None:
            from tokenizers import Tokenizer as Backend

            backend = Backend.from_str(self.backend.to_str())
            backend.encode_special_tokens = True
            self._as_text = backend
        return self._as_text

    def __repr__(self) -> str:
        return (f"Tokenizer({self.architecture}, vocab_size={self.vocab_size}, bos={self.bos_id}, "
                f"eos={self.eos_id}, stop_ids={list(self.stop_ids)})")


class StreamDecoder:
    """Incremental detokenizer: `feed(id)` returns the text that id adds, holding back
    bytes of a UTF-8 character split across tokens until it is complete.

    It decodes a short window of recent ids, (prefix, read], and emits the new suffix, so
    tokenizers whose decoders look at neighbours (SentencePiece's leading space, byte
    fallback, byte-level BPE) come out as `decode(all ids)` does. `context` seeds the window
    with the last prompt ids so the first generated token gets its leading space right.
    The concatenation of all deltas plus `flush()` equals `tokenizer.decode(ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True, context: Sequence[int] = ()):
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self._ids: list[int] = [int(i) for i in context[-4:]]
        self._prefix = 0  # window start
        self._read = len(self._ids)  # ids before this are already emitted

    def feed(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        done = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            delta = text[len(done):]
            self._prefix, self._read = self._read, len(self._ids)
            # keep the window short: decode cost stays O(1) per token
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes as U+FFFD)."""
        done = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(done):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special=self.skip_special) if ids else ""


def _stop_ids(md: Mapping[str, Any], tokens: Sequence[str]) -> list[int]:
    ids = [md.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    types = md.get("tokenizer.ggml.token_type")
    wanted = set(_END_OF_TURN)
    for i, token in enumerate(tokens):
        if token in wanted and (types is None or int(types[i]) in (_CONTROL, _USER_DEFINED)):
            ids.append(i)
    return sorted({i for i in ids if i is not None})
