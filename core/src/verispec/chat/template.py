"""Chat templates: HF's jinja2 dialect, compiled and rendered in `chat.sandbox`'s bounded sandbox.

A template renders with HF's variables: messages, add_generation_prompt, bos_token, eos_token,
raise_exception, strftime_now, plus the caller's (tools, ...). `ChatTemplate.render_marked` also
says where each message's content lies in the render (how user text is kept from becoming control
tokens). A template that fails raises ChatTemplateError (chat.sandbox's bounds and refusals).
"""
from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from verispec.chat.sandbox import (RENDER_MAX_CHARS, RENDER_TIME_LIMIT_S, ChatTemplateError, compile_template,
                                   render)

__all__ = ["ChatTemplate", "ChatTemplateError", "DEFAULT_CHAT_TEMPLATES", "MarkedRender", "RENDER_MAX_CHARS",
           "RENDER_TIME_LIMIT_S"]

# Gemma's turn format (Gemma 2/3 instruction-tuned models; the Gemma 3 GGUFs carry no
# template): BOS, `<start_of_turn>{user|model}\n{text}<end_of_turn>\n`, the system text
# prepended to the first user turn, turn content trimmed, as in Google's HF chat template.
_GEMMA_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- if message['role'] not in ('user', 'assistant', 'model') -%}"
    "{{- raise_exception('Gemma knows the roles system, user and assistant, not ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- set role = 'user' if message['role'] == 'user' else 'model' -%}"
    "{{- '<start_of_turn>' + role + '\n' + (ns.system if role == 'user' else '')"
    " + message['content'] | trim + '<end_of_turn>\n' -}}"
    "{%- if role == 'user' -%}{%- set ns.system = '' -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)

#: chat templates used only when the GGUF has no `tokenizer.chat_template`, by architecture.
DEFAULT_CHAT_TEMPLATES: Mapping[str, str] = {"gemma": _GEMMA_TEMPLATE, "gemma2": _GEMMA_TEMPLATE,
                                             "gemma3": _GEMMA_TEMPLATE}

# whitespace around each sentinel: where a template trims content, it is gone
_PAD = " \t\n"


class MarkedRender(NamedTuple):
    """A render split into the template's own text and the messages' str contents."""

    #: the render of the messages.
    text: str
    #: the template's text around the contents: len(contents) + 1 pieces.
    markup: list[str]
    #: each str content as the render holds it (trimmed on the sides where the template trims).
    contents: list[str]

    @property
    def follows(self) -> bool:
        """Whether the template copies each content into `text` as is (at most trimmed)."""
        return "".join(_interleave(self.markup, self.contents)) == self.text

    def content_spans(self) -> list[tuple[int, int]]:
        """[start, end) character offsets of each content in `text` (meaningful when `follows`)."""
        spans, at = [], 0
        for piece, content in zip(self.markup, self.contents):
            at += len(piece)
            spans.append((at, at + len(content)))
            at += len(content)
        return spans


class ChatTemplate:
    """One chat template, compiled. Raises ChatTemplateError for a template that does not parse."""

    def __init__(self, source: str):
        #: the jinja2 source.
        self.source = source
        self._template = compile_template(source)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **variables: Any) -> str:
        """The template's text for `messages` ([{"role", "content"}]); variables: bos_token,
        eos_token, tools, ... Raises ChatTemplateError."""
        return render(self._template, messages=list(messages), add_generation_prompt=add_generation_prompt,
                       **variables)

    def render_marked(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                      **variables: Any) -> MarkedRender:
        """`render(messages)` and where each str content lies in it: the template renders a second
        time with each such content replaced by a unique sentinel (padded with whitespace, so a
        template that trims content is followed), which splits that render into markup and
        contents. Raises ChatTemplateError."""
        messages = list(messages)
        text = self.render(messages, add_generation_prompt, **variables)
        texts = [m.get("content") if isinstance(m.get("content"), str) else None for m in messages]
        nonce = secrets.token_hex(8)
        while any(nonce in t for t in texts if t) or nonce in text:
            nonce = secrets.token_hex(8)
        marked = [{**m, "content": f"{_PAD}\ue000{nonce}:{i}\ue001{_PAD}"} if texts[i] is not None else m
                  for i, m in enumerate(messages)]
        rendered_marked = self.render(marked, add_generation_prompt, **variables)
        markup, contents = _split_at_sentinels(rendered_marked, nonce, texts)
        return MarkedRender(text, markup, contents)


def _split_at_sentinels(rendered: str, nonce: str,
                        texts: Sequence[str | None]) -> tuple[list[str], list[str]]:
    """The markup pieces of a render whose contents are sentinels, and the text each sentinel
    stands for (its message's content, trimmed on the side where the template trimmed)."""
    pattern = re.compile(f"({re.escape(_PAD)})?\ue000{nonce}:(\\d+)\ue001({re.escape(_PAD)})?")
    markup, contents, at = [], [], 0
    for m in pattern.finditer(rendered):
        markup.append(rendered[at:m.start()])
        text = texts[int(m.group(2))] or ""
        text = text if m.group(1) else text.lstrip()
        contents.append(text if m.group(3) else text.rstrip())
        at = m.end()
    markup.append(rendered[at:])
    return markup, contents


def _interleave(markup: list[str], contents: list[str]):
    for piece, content in zip(markup, contents + [""]):
        yield piece
        yield content
