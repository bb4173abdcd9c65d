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
A template that fails (a syntax error, a sandbox refusal, a bound, an error while rendering, its
raise_exception) raises ChatTemplateError.
"""
from __future__ import annotations

import ctypes
import itertools
import json
import re
import threading
import time
from collections.abc import ItemsView, KeysView, ValuesView

from verispec.errors import VerispecError

__all__ = ["ChatTemplateError", "RENDER_MAX_CHARS", "RENDER_MAX_ITEMS", "RENDER_TIME_LIMIT_S", "compile_template",
           "render"]

#: seconds a chat template may render for.
RENDER_TIME_LIMIT_S = 5.0
#: characters a rendered chat (or one value a template builds: a string, a list, a padded field) may hold.
RENDER_MAX_CHARS = 1 << 24
#: items a list built item by item (|list, |batch, str.split, wordwrap's words, ...) may hold: a list of
#: RENDER_MAX_CHARS one-character strings alone would take a GB.
RENDER_MAX_ITEMS = 1 << 20

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


# --- size checks, before a value is built -------------------------------------------------

def _too_large(what: str):
    from jinja2.exceptions import SecurityError

    return SecurityError(f"{what} would build a value longer than {RENDER_MAX_CHARS} characters")


def _check_count(count: int, what: str) -> None:
    if count > RENDER_MAX_CHARS:
        raise _too_large(what)


def _check_items(count: int, what: str) -> None:
    if count > RENDER_MAX_ITEMS:
        from jinja2.exceptions import SecurityError

        raise SecurityError(f"{what} would build a list of more than {RENDER_MAX_ITEMS} items")


_CONTAINERS = (list, tuple, set, frozenset, dict, KeysView, ValuesView, ItemsView)
_END = object()


def _text_floor(value, per_item=lambda depth: 2, quotes: int = 2) -> int:
    """A lower bound on the length of `value`'s text: str() of a str is itself; of a container, its
    repr: each str item len + `quotes`, each other item one character, each container 2 plus
    `per_item(depth)` for each item it holds at that depth (a separator; tojson's indent adds more).
    Counting stops once past RENDER_MAX_CHARS, before iterating a container whose size alone passes."""
    if isinstance(value, str):
        return len(value)
    total, stack = 0, [(iter((value,)), 0)]
    while stack and total <= RENDER_MAX_CHARS:
        items, depth = stack[-1]
        item = next(items, _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, (str, bytes)):
            total += len(item) + quotes
        elif isinstance(item, _CONTAINERS):
            total += 2 + len(item) * per_item(depth + 1)
            if isinstance(item, dict):
                total += 2 * len(item)  # ": "
                stack.append((itertools.chain.from_iterable(item.items()), depth + 1))
            elif total <= RENDER_MAX_CHARS:
                stack.append((iter(item), depth + 1))
        else:
            total += 1
    return total


def _check_text(value, what: str, per_item=lambda depth: 2, quotes: int = 2) -> None:
    """Refuse a value whose text (str(), a repr, a JSON dump) would pass RENDER_MAX_CHARS."""
    if not isinstance(value, str) and _text_floor(value, per_item, quotes) > RENDER_MAX_CHARS:
        raise _too_large(what)


def _text(value, what: str) -> str:
    """str(value), checked (_check_text) before it is built."""
    _check_text(value, what)
    return value if isinstance(value, str) else str(value)


def _check_digits(digits: str, what: str) -> None:
    """A width or precision spelled in a format string (an int of any length: no int() of it)."""
    if len(digits) > len(str(RENDER_MAX_CHARS)) or int(digits) > RENDER_MAX_CHARS:
        shown = digits if len(digits) <= 20 else digits[:20] + "..."
        raise _too_large(f"{what} with a width or precision of {shown}")


def _check_binop(operator: str, left, right) -> None:
    sized = (str, bytes, list, tuple)
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
        for value in right.values() if isinstance(right, dict) else right if isinstance(right, tuple) else (right,):
            _check_text(value, "'%'")


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
    if not isinstance(owner, (str, bytes)):
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
    elif name in ("split", "rsplit") and isinstance(owner, str):
        sep = args[0] if args else kwargs.get("sep")
        maxsplit = args[1] if len(args) > 1 else kwargs.get("maxsplit", -1)
        pieces = _pieces(owner, _WHITESPACE) if sep is None else owner.count(sep) + 1 if isinstance(sep, str) \
            and sep else 1
        _check_items(min(pieces, maxsplit + 1) if isinstance(maxsplit, int) and maxsplit >= 0 else pieces,
                     f"str.{name}")
    elif name == "splitlines" and isinstance(owner, str):
        _check_items(_pieces(owner, _LINE_BREAKS), "str.splitlines")
    elif name == "translate" and isinstance(owner, str) and args and isinstance(args[0], dict):
        grown = sum(owner.count(chr(k) if isinstance(k, int) else k) * (len(v) - 1)
                    for k, v in args[0].items() if isinstance(v, str) and isinstance(k, (int, str)) and len(v) > 1
                    and (not isinstance(k, int) or 0 <= k <= 0x10FFFF))
        _check_count(len(owner) + grown, "str.translate")


#: what str.split() splits at, and str.splitlines().
_WHITESPACE = "".join(c for c in map(chr, range(0x3001)) if c.isspace())
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def _pieces(s: str, separators: str) -> int:
    """An upper bound on the pieces `s` splits into at any of `separators` (one count per
    separator: cheap, before any piece is built)."""
    if len(s) // 2 + 1 <= RENDER_MAX_ITEMS:
        return len(s) // 2 + 1
    return sum(s.count(c) for c in separators) + 1


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
    from jinja2 import pass_environment, pass_eval_context
    from jinja2.compiler import CodeGenerator
    from jinja2.filters import (do_batch, do_center, do_format, do_indent, do_join, do_pprint, do_replace,
                                do_striptags, do_title, do_urlencode, do_urlize, do_wordwrap, make_attrgetter,
                                sync_do_slice as do_slice)
    from jinja2.utils import generate_lorem_ipsum
    from markupsafe import escape as do_escape
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter

    class FormatSpecs(SandboxedFormatter):
        """str.format as the sandbox runs it, each field's spec (nested fields filled in) checked."""

        def format_field(self, value, format_spec):
            for digits in _DIGITS.findall(format_spec):
                _check_digits(digits, "str.format")
            _check_text(value, "str.format")
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
            texts = [_text(part, "'~'") for part in parts]
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
        if isinstance(indent, int) and not isinstance(indent, bool):
            _check_count(indent, "the tojson filter's indent")
        step = max(indent, 0) if isinstance(indent, int) else len(indent) if isinstance(indent, str) else None
        _check_text(value, "the tojson filter", per_item=(lambda depth: 2) if step is None else
                    (lambda depth: 2 + step * depth))
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def pprint(value):
        _check_text(value, "the pprint filter", per_item=lambda depth: 2 + depth)
        return do_pprint(value)

    def string(value):
        return value if isinstance(value, str) else _text(value, "the string filter")

    def format_filter(value, *args, **kwargs):
        _check_printf(_text(value, "the format filter"), kwargs or args)
        for arg in (*args, *kwargs.values()):
            _check_text(arg, "the format filter")
        return do_format(value, *args, **kwargs)

    def center(value, width=80):
        if isinstance(width, int):
            _check_count(width, "the center filter")
        return do_center(_text(value, "the center filter"), width)

    def indent(s, width=4, first=False, blank=False):
        lines = _text(s, "the indent filter").count("\n") + 1
        _check_count(lines * (width if isinstance(width, int) else len(str(width))), "the indent filter")
        return do_indent(s, width, first, blank)

    @pass_eval_context
    def replace(eval_ctx, s, old, new, count=None):
        _check_replace(_text(s, "the replace filter"), str(old), str(new), -1 if count is None else count)
        return do_replace(eval_ctx, s, old, new, count)

    @pass_eval_context
    def join(eval_ctx, value, d="", attribute=None):
        items = value if isinstance(value, (list, tuple)) else bounded_list(value)
        if attribute is None:
            _check_count(len(str(d)) * max(len(items) - 1, 0), "the join filter")  # its separators alone
            _check_items(len(items), "the join filter")
            _check_join(str(d), [_text(item, "the join filter") for item in items])
        return do_join(eval_ctx, items, d, attribute)

    def escape(value):
        if hasattr(value, "__html__"):
            return do_escape(value)
        text = _text(value, "the escape filter")
        _check_count(len(text) + 4 * (text.count("&") + text.count('"') + text.count("'"))
                     + 3 * (text.count("<") + text.count(">")), "the escape filter")
        return do_escape(text)

    def forceescape(value):
        return escape(str(_text(value, "the forceescape filter")))

    def urlencode(value):
        if isinstance(value, str):
            raw = value.encode("utf-8", "surrogatepass")
            _check_count(len(raw) + 2 * len(raw.translate(None, _URL_SAFE)), "the urlencode filter")
        else:
            _check_text(value, "the urlencode filter", per_item=lambda depth: 2, quotes=0)
        return do_urlencode(value)

    @pass_environment
    def wordwrap(environment, s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
        text = _text(s, "the wordwrap filter")
        if isinstance(width, int) and width > 0:
            words = _pieces(text, _WHITESPACE + "-") + len(text) // width
            _check_items(words, "the wordwrap filter")
            newline = environment.newline_sequence if wrapstring is None else wrapstring
            _check_count(len(text) + words * len(str(newline)), "the wordwrap filter")
        return do_wordwrap(environment, text, width, break_long_words, wrapstring, break_on_hyphens)

    @pass_eval_context
    def urlize(eval_ctx, value, *args, **kwargs):
        text = _text(value, "the urlize filter")
        _check_items(_pieces(text, _WHITESPACE), "the urlize filter")
        return do_urlize(eval_ctx, text, *args, **kwargs)

    def wordcount(s):  # jinja2's builds the list of words to count them
        return sum(1 for _ in _WORD.finditer(_text(s, "the wordcount filter")))

    def title(s):
        text = _text(s, "the title filter")
        _check_items(2 * _pieces(text, _WHITESPACE + "-({[<"), "the title filter")
        return do_title(text)

    def striptags(value):
        text = value if hasattr(value, "__html__") else _text(value, "the striptags filter")
        _check_items(_pieces(str(text), _WHITESPACE), "the striptags filter")
        return do_striptags(text)

    def bounded_list(value):
        if isinstance(value, str) or hasattr(value, "__len__"):
            _check_items(len(value), "the list filter")
            return list(value)
        items = []
        for item in value:
            items.append(item)
            if len(items) > RENDER_MAX_ITEMS:
                _check_items(len(items), "the list filter")
        return items

    def batch(value, linecount, fill_with=None):
        if isinstance(linecount, int):
            _check_items(linecount, "the batch filter")
            if hasattr(value, "__len__") and linecount > 0:
                _check_items(-(-len(value) // linecount), "the batch filter")
        return do_batch(value, linecount, fill_with)

    def slice_filter(value, slices, fill_with=None):
        if isinstance(slices, int):
            _check_items(slices, "the slice filter")
        return do_slice(bounded_list(value), slices, fill_with)

    @pass_environment
    def sum_filter(environment, iterable, attribute=None, start=0):
        get = make_attrgetter(environment, attribute) if attribute is not None else None
        total, size = (list(start) if isinstance(start, list) else start), None
        if isinstance(start, (str, bytes, list, tuple)):
            size = len(start)
        for item in iterable:
            item = get(item) if get is not None else item
            if size is not None and hasattr(item, "__len__"):
                size += len(item)
                (_check_count if isinstance(start, (str, bytes)) else _check_items)(size, "the sum filter")
            total += item
        return total

    def lipsum(n=5, html=True, min=20, max=100):
        if isinstance(n, int) and isinstance(max, int):
            _check_count(n * max * 2, "lipsum()")
        return generate_lorem_ipsum(n, html, min, max)

    replaced = dict(tojson=tojson, pprint=pprint, string=string, format=format_filter, center=center,
                    indent=indent, replace=replace, join=join, e=escape, escape=escape, forceescape=forceescape,
                    urlencode=urlencode, wordwrap=wordwrap, urlize=urlize, list=bounded_list, batch=batch,
                    slice=slice_filter, sum=sum_filter, wordcount=wordcount, title=title, striptags=striptags)
    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                  finalize=lambda value: _text(value, "the output of {{ ... }}"))
    env.filters.update(replaced)
    for name, f in env.filters.items():
        if name not in replaced and name in _TEXT_FILTERS:
            f = _value_checked(f, name, lambda value, what: _check_text(value, what))
        elif name not in replaced and name in _LIST_FILTERS:
            f = _value_checked(f, name, _check_sized)
        env.filters[name] = _result_checked(env, f, name)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["lipsum"] = lipsum
    return env


#: jinja2's filters that take their value's text (str() of it) and return text of about that size.
_TEXT_FILTERS = frozenset({"capitalize", "lower", "upper", "trim", "truncate", "safe", "xmlattr"})
#: jinja2's filters that make a list of their value's items (sorted()) before their own loop.
_LIST_FILTERS = frozenset({"sort", "groupby", "dictsort"})
_WORD = re.compile(r"\w+")
#: the bytes urlencode leaves as they are (urllib.parse.quote's always-safe set, and "/").
_URL_SAFE = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-~/"


def _check_sized(value, what: str) -> None:
    if hasattr(value, "__len__"):
        _check_items(len(value), what)


def _value_checked(f, name: str, check):
    """jinja2's filter `f` (its value first, after what its pass_* decorator passes), with
    `check(value, what)` run before the filter."""
    import functools

    passed = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(f)
    def checked(*args, **kwargs):
        if len(args) > passed:
            check(args[passed], f"the {name} filter")
        return f(*args, **kwargs)
    return checked


def _result_checked(env, f, name: str):
    """Filter `f` with the deadline checked before it runs and its result after: text longer than
    RENDER_MAX_CHARS, or a list or tuple longer than RENDER_MAX_ITEMS, is refused."""
    import functools

    @functools.wraps(f)
    def checked(*args, **kwargs):
        env.check_time()
        result = f(*args, **kwargs)
        if isinstance(result, (str, bytes)):
            _check_count(len(result), f"the {name} filter")
        elif isinstance(result, (list, tuple)):
            _check_items(len(result), f"the {name} filter")
        return result
    return checked
