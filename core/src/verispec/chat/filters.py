"""jinja2's filters, bounded: each refuses, before it builds it, a value past the render's size bounds.

Replaced whole (REPLACED, under jinja2's names): those whose result grows with an argument (center,
indent, format, replace, join, wordwrap, batch, slice, sum), those that stringify a container (string,
pprint, tojson with its indent counted, escape and forceescape, urlencode, join's items), and those
that build a list item by item (list, slice, urlize's, title's and striptags' words, wordcount, which
jinja2 writes as a list). The other text filters (capitalize, lower, upper, trim, truncate, safe,
xmlattr) have their value's text checked first, and the sorting ones (sort, groupby, dictsort) their
value's length. After every filter its result is checked: text past RENDER_MAX_CHARS, a list or tuple
past RENDER_MAX_ITEMS is refused. The checks are `chat.bounds`; `chat.sandbox` calls `bound_filters`
on each environment it makes.
"""
from __future__ import annotations

import functools
import json
import re

from jinja2 import pass_environment, pass_eval_context
from jinja2.filters import (do_batch, do_center, do_format, do_indent, do_join, do_pprint, do_replace, do_striptags,
                            do_title, do_urlencode, do_urlize, do_wordwrap, make_attrgetter, sync_do_slice as do_slice)
from markupsafe import escape as do_escape

from verispec.chat.bounds import (RENDER_MAX_ITEMS, WHITESPACE, check_count, check_items, check_join, check_printf,
                                  check_replace, check_text, checked_text, count_pieces)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    if isinstance(indent, int) and not isinstance(indent, bool):
        check_count(indent, "the tojson filter's indent")
    step = max(indent, 0) if isinstance(indent, int) else len(indent) if isinstance(indent, str) else None
    check_text(value, "the tojson filter", per_item=(lambda depth: 2) if step is None else
                (lambda depth: 2 + step * depth))
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def pprint(value):
    check_text(value, "the pprint filter", per_item=lambda depth: 2 + depth)
    return do_pprint(value)


def string(value):
    return value if isinstance(value, str) else checked_text(value, "the string filter")


def format_filter(value, *args, **kwargs):
    check_printf(checked_text(value, "the format filter"), kwargs or args)
    for arg in (*args, *kwargs.values()):
        check_text(arg, "the format filter")
    return do_format(value, *args, **kwargs)


def center(value, width=80):
    if isinstance(width, int):
        check_count(width, "the center filter")
    return do_center(checked_text(value, "the center filter"), width)


def indent(s, width=4, first=False, blank=False):
    lines = checked_text(s, "the indent filter").count("\n") + 1
    check_count(lines * (width if isinstance(width, int) else len(str(width))), "the indent filter")
    return do_indent(s, width, first, blank)


@pass_eval_context
def replace(eval_ctx, s, old, new, count=None):
    check_replace(checked_text(s, "the replace filter"), str(old), str(new), -1 if count is None else count)
    return do_replace(eval_ctx, s, old, new, count)


@pass_eval_context
def join(eval_ctx, value, d="", attribute=None):
    items = value if isinstance(value, (list, tuple)) else bounded_list(value)
    if attribute is None:
        check_count(len(str(d)) * max(len(items) - 1, 0), "the join filter")  # its separators alone
        check_items(len(items), "the join filter")
        check_join(str(d), [checked_text(item, "the join filter") for item in items])
    return do_join(eval_ctx, items, d, attribute)


def escape(value):
    if hasattr(value, "__html__"):
        return do_escape(value)
    text = checked_text(value, "the escape filter")
    check_count(len(text) + 4 * (text.count("&") + text.count('"') + text.count("'"))
                 + 3 * (text.count("<") + text.count(">")), "the escape filter")
    return do_escape(text)


def forceescape(value):
    return escape(str(checked_text(value, "the forceescape filter")))


def urlencode(value):
    if isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        check_count(len(raw) + 2 * len(raw.translate(None, _URL_SAFE)), "the urlencode filter")
    else:
        check_text(value, "the urlencode filter", per_item=lambda depth: 2, quotes=0)
    return do_urlencode(value)


@pass_environment
def wordwrap(environment, s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    text = checked_text(s, "the wordwrap filter")
    if isinstance(width, int) and width > 0:
        words = count_pieces(text, WHITESPACE + "-") + len(text) // width
        check_items(words, "the wordwrap filter")
        newline = environment.newline_sequence if wrapstring is None else wrapstring
        check_count(len(text) + words * len(str(newline)), "the wordwrap filter")
    return do_wordwrap(environment, text, width, break_long_words, wrapstring, break_on_hyphens)


@pass_eval_context
def urlize(eval_ctx, value, *args, **kwargs):
    text = checked_text(value, "the urlize filter")
    check_items(count_pieces(text, WHITESPACE), "the urlize filter")
    return do_urlize(eval_ctx, text, *args, **kwargs)


def wordcount(s):  # jinja2's builds the list of words to count them
    return sum(1 for _ in _WORD.finditer(checked_text(s, "the wordcount filter")))


def title(s):
    text = checked_text(s, "the title filter")
    check_items(2 * count_pieces(text, WHITESPACE + "-({[<"), "the title filter")
    return do_title(text)


def striptags(value):
    text = value if hasattr(value, "__html__") else checked_text(value, "the striptags filter")
    check_items(count_pieces(str(text), WHITESPACE), "the striptags filter")
    return do_striptags(text)


def bounded_list(value):
    if isinstance(value, str) or hasattr(value, "__len__"):
        check_items(len(value), "the list filter")
        return list(value)
    items = []
    for item in value:
        items.append(item)
        if len(items) > RENDER_MAX_ITEMS:
            check_items(len(items), "the list filter")
    return items


def batch(value, linecount, fill_with=None):
    if isinstance(linecount, int):
        check_items(linecount, "the batch filter")
        if hasattr(value, "__len__") and linecount > 0:
            check_items(-(-len(value) // linecount), "the batch filter")
    return do_batch(value, linecount, fill_with)


def slice_filter(value, slices, fill_with=None):
    if isinstance(slices, int):
        check_items(slices, "the slice filter")
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
            (check_count if isinstance(start, (str, bytes)) else check_items)(size, "the sum filter")
        total += item
    return total


#: the filters replaced whole: the bounded versions above, under jinja2's names.
REPLACED = dict(tojson=tojson, pprint=pprint, string=string, format=format_filter, center=center,
                indent=indent, replace=replace, join=join, e=escape, escape=escape, forceescape=forceescape,
                urlencode=urlencode, wordwrap=wordwrap, urlize=urlize, list=bounded_list, batch=batch,
                slice=slice_filter, sum=sum_filter, wordcount=wordcount, title=title, striptags=striptags)


def bound_filters(env) -> None:
    """Install the bounded filters in `env` (a `chat.sandbox` environment): REPLACED under jinja2's names,
    the text and list filters' values checked before they run, and every filter wrapped so the deadline is
    checked before it runs and its result after (`env.check_time`)."""
    env.filters.update(REPLACED)
    for name, f in env.filters.items():
        if name not in REPLACED and name in _TEXT_FILTERS:
            f = _value_checked(f, name, lambda value, what: check_text(value, what))
        elif name not in REPLACED and name in _LIST_FILTERS:
            f = _value_checked(f, name, _check_sized)
        env.filters[name] = _result_checked(env, f, name)


#: jinja2's filters that take their value's text (str() of it) and return text of about that size.
_TEXT_FILTERS = frozenset({"capitalize", "lower", "upper", "trim", "truncate", "safe", "xmlattr"})
#: jinja2's filters that make a list of their value's items (sorted()) before their own loop.
_LIST_FILTERS = frozenset({"sort", "groupby", "dictsort"})
_WORD = re.compile(r"\w+")
#: the bytes urlencode leaves as they are (urllib.parse.quote's always-safe set, and "/").
_URL_SAFE = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-~/"


def _check_sized(value, what: str) -> None:
    if hasattr(value, "__len__"):
        check_items(len(value), what)


def _value_checked(f, name: str, check):
    """jinja2's filter `f` (its value first, after what its pass_* decorator passes), with
    `check(value, what)` run before the filter."""
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
    @functools.wraps(f)
    def checked(*args, **kwargs):
        env.check_time()
        result = f(*args, **kwargs)
        if isinstance(result, (str, bytes)):
            check_count(len(result), f"the {name} filter")
        elif isinstance(result, (list, tuple)):
            check_items(len(result), f"the {name} filter")
        return result
    return checked
