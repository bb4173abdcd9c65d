"""The sandbox chat templates render in: HF's jinja2 environment, within a time and size bound.

The environment is the one HF renders chat templates in (jinja2's ImmutableSandboxedEnvironment,
trim_blocks, lstrip_blocks, loop controls, a `tojson` that keeps non-ASCII and does not
HTML-escape), with raise_exception and strftime_now. `compile_template` and `render` are what
`chat_template.ChatTemplate` calls.

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
import threading
import time

from verispec.errors import VerispecError

__all__ = ["ChatTemplateError", "RENDER_MAX_CHARS", "RENDER_TIME_LIMIT_S", "compile_template", "render"]

#: seconds a chat template may render for.
RENDER_TIME_LIMIT_S = 5.0
#: characters a rendered chat (or one value a template builds: a string, a list, a padded field) may hold.
RENDER_MAX_CHARS = 1 << 24

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


class _TemplateRefusal(Exception):
    """raise_exception() called by a template."""


def compile_template(source: str):
    """The jinja2 template of `source` in a fresh bounded environment. Raises ChatTemplateError."""
    import jinja2

    try:
        return _jinja_env().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"syntax error at line {e.lineno}: {e.message}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"{type(e).__name__}: {e}") from None


def render(template, **variables) -> str:
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
