"""The sandbox chat templates render in: HF's jinja2 environment, within a time and size bound.

The environment is the one HF renders chat templates in (jinja2's ImmutableSandboxedEnvironment,
trim_blocks, lstrip_blocks, loop controls, a `tojson` that keeps non-ASCII and does not
HTML-escape), with raise_exception and strftime_now. `compile_template` and `render` are what
`chat.template.ChatTemplate` calls.

Bounds: RENDER_TIME_LIMIT_S seconds of rendering, enforced from outside the rendering call (a
watchdog timer raises in the rendering thread at the deadline, so a filter looping in Python, such
as wordwrap or urlize over a long text, stops there; also checked between output chunks and at each
call, attribute, item and operator the sandbox sees); RENDER_MAX_CHARS characters of output, also
checked before a value that could pass it is built: `*`, `**`, `+` and `~` on their operands,
printf-style `%` and the `format` filter on their widths and precisions, str.format on each field's
format spec, the width of str.ljust / rjust / center / zfill / expandtabs and of the center and indent
filters, what str.replace / str.join / str.translate and the replace and join filters would build,
and every stringification of a container (`{{ l }}`, `~`, `%s`, `{}`, the string, pprint, tojson
(its indent counted), join, escape and text filters): a lower bound of its text's length, counted
before str() builds it. Lists and splits a filter or method builds item by item (list, batch,
slice, sum, str.split / splitlines, wordwrap's and urlize's words) hold at most RENDER_MAX_ITEMS
items; escape and urlencode are counted exactly before they run; every filter's result is checked.
The size checks are `chat.bounds`, the bounded filters `chat.filters`; this module holds the
environment, its operators and calls, the deadline and `render`. A template that fails (a syntax
error, a sandbox refusal, a bound, an error while rendering, its raise_exception) raises
ChatTemplateError.
"""
from __future__ import annotations

import ctypes
import re
import threading
import time

from verispec.chat.bounds import (RENDER_MAX_CHARS, RENDER_MAX_ITEMS, check_binop, check_count, check_digits,
                                  check_str_call, check_text, checked_text)
from verispec.errors import VerispecError

__all__ = ["ChatTemplateError", "RENDER_MAX_CHARS", "RENDER_MAX_ITEMS", "RENDER_TIME_LIMIT_S", "compile_template",
           "render"]

#: seconds a chat template may render for.
RENDER_TIME_LIMIT_S = 5.0

_DIGITS = re.compile(r"\d+")


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


class _Deadline(BaseException):
    """Raised in the rendering thread by its watchdog (BaseException: no template or jinja2
    `except Exception` swallows it)."""


class _Watchdog:
    """A timer that raises _Deadline in the thread that started it once `seconds` pass, unless
    `stop()` came first. After stop() returns nothing more is raised (a _Deadline sent but not
    yet raised is withdrawn, and `fired` says so)."""

    def __init__(self, seconds: float):
        self._thread_id, self._lock = threading.get_ident(), threading.Lock()
        self.fired = self._stopped = False
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if not self._stopped:
                self.fired = True
                _raise_in_thread(self._thread_id, _Deadline)

    def stop(self) -> None:
        self._timer.cancel()
        with self._lock:
            self._stopped = True
            if self.fired:
                _raise_in_thread(self._thread_id, None)  # withdraw it, if not raised yet


def _raise_in_thread(thread_id: int, exception) -> None:
    """CPython's PyThreadState_SetAsyncExc: `exception` is raised in that thread at its next
    bytecode (None withdraws one not yet raised)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exception) if exception is not None else None)


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
        watchdog = _Watchdog(RENDER_TIME_LIMIT_S)
        try:
            for chunk in template.generate(**variables):
                size += len(chunk)
                if size > RENDER_MAX_CHARS:
                    raise SecurityError(f"the output passed {RENDER_MAX_CHARS} characters")
                env.check_time()
                chunks.append(chunk)
        finally:
            watchdog.stop()
        if watchdog.fired:  # it fired as the render ended, and was withdrawn
            raise _Deadline
    except _Deadline:
        raise ChatTemplateError(f"the sandbox stopped it: rendering ran past {RENDER_TIME_LIMIT_S:g} s") from None
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


def _jinja_env():
    """A fresh sandboxed environment as HF renders chat templates in, bounded as the module says."""
    from datetime import datetime

    from jinja2.compiler import CodeGenerator
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
    from jinja2.utils import generate_lorem_ipsum

    from verispec.chat.filters import bound_filters

    class FormatSpecs(SandboxedFormatter):
        """str.format as the sandbox runs it, each field's spec (nested fields filled in) checked."""

        def format_field(self, value, format_spec):
            for digits in _DIGITS.findall(format_spec):
                check_digits(digits, "str.format")
            check_text(value, "str.format")
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
            texts = [checked_text(part, "'~'") for part in parts]
            check_count(sum(map(len, texts)), "'~'")
            return "".join(texts)

        def check_time(self):
            if time.monotonic() > getattr(self.bound, "deadline", float("inf")):
                raise SecurityError(f"rendering ran past {RENDER_TIME_LIMIT_S:g} s")

        def call_binop(self, context, operator, left, right):
            self.check_time()
            check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(self, __context, __obj, *args, **kwargs):
            self.check_time()
            check_str_call(__obj, args, kwargs)
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

    def lipsum(n=5, html=True, min=20, max=100):
        if isinstance(n, int) and isinstance(max, int):
            check_count(n * max * 2, "lipsum()")
        return generate_lorem_ipsum(n, html, min, max)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                  finalize=lambda value: checked_text(value, "the output of {{ ... }}"))
    bound_filters(env)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["lipsum"] = lipsum
    return env
