"""Chat templates: HF's jinja2 dialect, rendered in an immutable sandbox within a time and size bound.

A template renders in the environment HF renders chat templates in (jinja2's
ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loop controls, a `tojson` that keeps
non-ASCII and does not HTML-escape) with HF's variables: messages, add_generation_prompt,
bos_token, eos_token, raise_exception, strftime_now, plus the caller's (tools, ...).

Bounds: RENDER_TIME_LIMIT_S seconds of rendering, checked between output chunks and at each call,
attribute, item and operator the sandbox sees; RENDER_MAX_CHARS characters of output, also checked
before a value that could pass it is built: `*`, `**`, `+` and `~` on their operands, printf-style `%`
and the `format` filter on their widths and precisions, str.format on each field's format spec,
the width of str.ljust / rjust / center / zfill / expandtabs and of the center and indent filters,
and what str.replace / str.join and the replace and join filters would build.
A template that fails (a syntax error, a sandbox refusal, a bound, an error while rendering, its
raise_exception) raises ChatTemplateError.
"""
from __future__ import annotations

import json
import re
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from verispec.errors import VerispecError

__all__ = ["ChatTemplate", "ChatTemplateError", "DEFAULT_CHAT_TEMPLATES", "MarkedRender", "RENDER_MAX_CHARS",
           "RENDER_TIME_LIMIT_S"]

#: seconds a chat template may render for.
RENDER_TIME_LIMIT_S = 5.0
#: characters a rendered chat (or one value a template builds: a string, a list, a padded field) may hold.
RENDER_MAX_CHARS = 1 << 24

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
# a printf conversion's flags, width and precision (`%(name)-10.3f`); `*` takes them from the values
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")
_WIDTH_METHODS = frozenset({"ljust", "rjust", "center", "zfill"})


class ChatTemplateError(VerispecError):
    """The chat template failed: a syntax error, a sandbox refusal, a render bound, an error while
    rendering (`refused=False`: the file's fault, HTTP 500), or its `raise_exception` refused
    these messages (`refused=True`: the request's fault, HTTP 400). `http_status` is that code."""

    param = "messages"

    def __init__(self, problem: str, *, refused: bool = False):
        self.problem, self.refused = problem, refused
        self.http_status = 400 if refused else 500
        super().__init__(f"the chat template refused these messages: {problem}; change the messages"
                         if refused else
                         f"the model's chat template failed: {problem}; fix tokenizer.chat_template "
                         "in the GGUF, or send plain text (no chat)")


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
        self._template = _compile(source)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **variables: Any) -> str:
        """The template's text for `messages` ([{"role", "content"}]); variables: bos_token,
        eos_token, tools, ... Raises ChatTemplateError."""
        return _render(self._template, messages=list(messages), add_generation_prompt=add_generation_prompt,
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


class _TemplateRefusal(Exception):
    """raise_exception() called by a template."""


def _compile(source: str):
    import jinja2

    try:
        return _jinja_env().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"syntax error at line {e.lineno}: {e.message}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"{type(e).__name__}: {e}") from None


def _render(template, **variables) -> str:
    """The template's output, refused once it runs past RENDER_TIME_LIMIT_S or RENDER_MAX_CHARS."""
    from jinja2.exceptions import SecurityError, TemplateError

    env = template.environment
    env.bound.deadline = time.monotonic() + RENDER_TIME_LIMIT_S  # per thread: the server renders in several
    chunks, size = [], 0
    try:
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > RENDER_MAX_CHARS:
                raise SecurityError(f"the output passed {RENDER_MAX_CHARS} characters")
            env.check_time()
            chunks.append(chunk)
    except _TemplateRefusal as e:
        raise ChatTemplateError(str(e), refused=True) from None
    except SecurityError as e:
        raise ChatTemplateError(f"the sandbox stopped it: {str(e).rstrip('.')}") from None
    except TemplateError as e:
        raise ChatTemplateError(f"{type(e).__name__}: {e}") from None
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RuntimeError,
            MemoryError) as e:  # RuntimeError: RecursionError among them; MemoryError: a value too large
        raise ChatTemplateError(f"{type(e).__name__} while rendering: {e}") from None
    return "".join(chunks)


# --- size checks, before a value is built -------------------------------------------------

def _too_large(what: str):
    from jinja2.exceptions import SecurityError

    return SecurityError(f"{what} would build a value longer than {RENDER_MAX_CHARS} characters")


def _check_count(count: int, what: str) -> None:
    if count > RENDER_MAX_CHARS:
        raise _too_large(what)


def _check_digits(digits: str, what: str) -> None:
    """A width or precision spelled in a format string (an int of any length: no int() of it)."""
    if len(digits) > len(str(RENDER_MAX_CHARS)) or int(digits) > RENDER_MAX_CHARS:
        shown = digits if len(digits) <= 20 else digits[:20] + "..."
        raise _too_large(f"{what} with a width or precision of {shown}")


def _check_binop(operator: str, left, right) -> None:
    sized = (str, list, tuple)
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, sized) and isinstance(n, int):
                _check_count(len(seq) * n, "'*'")
    elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        _check_count(len(left) + len(right), "'+'")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 \
            and abs(left) > 1:
        _check_count(right * abs(left).bit_length(), f"{left} ** {right}")
    elif operator == "%" and isinstance(left, str):
        _check_printf(left, right)


def _check_printf(fmt: str, values) -> None:
    """printf-style `fmt % values`: each conversion's width and precision, and with `*` the ints it takes."""
    starred = False
    for m in _PRINTF_SPEC.finditer(fmt):
        for number in m.groups():
            if number == "*":
                starred = True
            elif number:
                _check_digits(number, "'%'")
    if starred:
        for value in values if isinstance(values, tuple) else (values,):
            if isinstance(value, int):
                _check_count(value, "'%' with '*'")


def _check_str_call(method, args, kwargs) -> None:
    """A str method whose result grows with its arguments: ljust, rjust, center, zfill, expandtabs,
    replace, join."""
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(owner, str):
        return
    if name in _WIDTH_METHODS and args and isinstance(args[0], int):
        _check_count(args[0], f"str.{name}")
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tabsize, int):
            _check_count(len(owner) + owner.count("\t") * tabsize, "str.expandtabs")
    elif name == "replace" and len(args) >= 2:
        _check_replace(owner, *args[:3])
    elif name == "join" and args:
        _check_join(owner, args[0])


def _check_replace(s, old, new, count=-1) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str) and isinstance(count, int):
        hits = s.count(old) if count < 0 else min(count, s.count(old))  # "".count("") is 1: a gap each
        _check_count(len(s) + hits * (len(new) - len(old)), "replace")


def _check_join(separator, items) -> None:
    if isinstance(separator, str) and isinstance(items, (list, tuple)):
        pieces = sum(len(item) for item in items if isinstance(item, str))
        _check_count(pieces + len(separator) * max(len(items) - 1, 0), "join")


def _jinja_env():
    """A fresh sandboxed environment as HF renders chat templates in, bounded as the module says."""
    from datetime import datetime

    from jinja2.exceptions import SecurityError
    from jinja2 import pass_eval_context
    from jinja2.compiler import CodeGenerator
    from jinja2.filters import do_center, do_format, do_indent, do_join, do_replace
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter

    class FormatSpecs(SandboxedFormatter):
        """str.format as the sandbox runs it, each field's spec (nested fields filled in) checked."""

        def format_field(self, value, format_spec):
            for digits in _DIGITS.findall(format_spec):
                _check_digits(digits, "str.format")
            return super().format_field(value, format_spec)

    class CheckedConcat(CodeGenerator):
        """Compiles `~` to the environment's `concat`, which checks the parts' length before joining."""

        def visit_Concat(self, node, frame):
            self.write("environment.concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        code_generator_class = CheckedConcat
        bound = threading.local()

        def concat(self, parts):  # `~`, as jinja2's str_join (no autoescape here) does it
            self.check_time()
            texts = [str(part) for part in parts]
            _check_count(sum(map(len, texts)), "'~'")
            return "".join(texts)

        def check_time(self):
            if time.monotonic() > getattr(self.bound, "deadline", float("inf")):
                raise SecurityError(f"rendering ran past {RENDER_TIME_LIMIT_S:g} s")

        def call_binop(self, context, operator, left, right):
            self.check_time()
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(self, __context, __obj, *args, **kwargs):
            self.check_time()
            _check_str_call(__obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj, attribute):
            self.check_time()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            self.check_time()
            return super().getitem(obj, argument)

        def wrap_str_format(self, value):
            formats = super().wrap_str_format(value)
            if formats is None:
                return None
            source, checker = value.__self__, FormatSpecs(self)

            def checked(*args, **kwargs):  # a dry run with checked specs, then the sandbox's own
                if value.__name__ == "format":
                    checker.vformat(source, args, kwargs)
                elif len(args) == 1 and not kwargs:  # format_map(mapping); other calls fail in `formats`
                    checker.vformat(source, (), args[0])
                return formats(*args, **kwargs)
            return checked

    def raise_exception(message):
        raise _TemplateRefusal(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def format_filter(value, *args, **kwargs):
        _check_printf(str(value), kwargs or args)
        return do_format(value, *args, **kwargs)

    def center(value, width=80):
        if isinstance(width, int):
            _check_count(width, "the center filter")
        return do_center(value, width)

    def indent(s, width=4, first=False, blank=False):
        lines = str(s).count("\n") + 1
        _check_count(lines * (width if isinstance(width, int) else len(str(width))), "the indent filter")
        return do_indent(s, width, first, blank)

    @pass_eval_context
    def replace(eval_ctx, s, old, new, count=None):
        _check_replace(str(s), str(old), str(new), -1 if count is None else count)
        return do_replace(eval_ctx, s, old, new, count)

    @pass_eval_context
    def join(eval_ctx, value, d="", attribute=None):
        items = list(value)
        if attribute is None:
            _check_join(str(d), [str(item) for item in items])
        return do_join(eval_ctx, items, d, attribute)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters.update(tojson=tojson, format=format_filter, center=center, indent=indent, replace=replace,
                       join=join)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
