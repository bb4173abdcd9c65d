"""The size bounds of a chat template's render: each check refuses a value before it is built.

RENDER_MAX_CHARS characters for any text a template builds, RENDER_MAX_ITEMS items for any list
built item by item. The checks count from the operands, never from the result: `*`, `**`, `+` and
`%` on their operands (`check_binop`), printf-style and str.format widths and precisions
(`check_printf`, `check_digits`), the str methods whose result grows with their arguments
(`check_str_call`: ljust / rjust / center / zfill / expandtabs, replace, join, translate, and the
pieces of split / splitlines), and every stringification of a container (`check_text`, `checked_text`:
a lower bound of its repr's length from `text_floor`, counted before str() builds it). A check that
fails raises jinja2's SecurityError, which `chat.sandbox.render` reports as a ChatTemplateError;
`chat.sandbox` calls these from its operators, calls and filters.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import ItemsView, KeysView, ValuesView

#: characters a rendered chat (or one value a template builds: a string, a list, a padded field) may hold.
RENDER_MAX_CHARS = 1 << 24
#: items a list built item by item (|list, |batch, str.split, wordwrap's words, ...) may hold: a list of
#: RENDER_MAX_CHARS one-character strings alone would take a GB.
RENDER_MAX_ITEMS = 1 << 20

# a printf conversion's flags, width and precision (`%(name)-10.3f`); `*` takes them from the values
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_WIDTH_METHODS = frozenset({"ljust", "rjust", "center", "zfill"})


def too_large(what: str):
    from jinja2.exceptions import SecurityError

    return SecurityError(f"{what} would build a value longer than {RENDER_MAX_CHARS} characters")


def check_count(count: int, what: str) -> None:
    if count > RENDER_MAX_CHARS:
        raise too_large(what)


def check_items(count: int, what: str) -> None:
    if count > RENDER_MAX_ITEMS:
        from jinja2.exceptions import SecurityError

        raise SecurityError(f"{what} would build a list of more than {RENDER_MAX_ITEMS} items")


_CONTAINERS = (list, tuple, set, frozenset, dict, KeysView, ValuesView, ItemsView)
_END = object()


def text_floor(value, per_item=lambda depth: 2, quotes: int = 2) -> int:
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


def check_text(value, what: str, per_item=lambda depth: 2, quotes: int = 2) -> None:
    """Refuse a value whose text (str(), a repr, a JSON dump) would pass RENDER_MAX_CHARS."""
    if not isinstance(value, str) and text_floor(value, per_item, quotes) > RENDER_MAX_CHARS:
        raise too_large(what)


def checked_text(value, what: str) -> str:
    """str(value), checked (check_text) before it is built."""
    check_text(value, what)
    return value if isinstance(value, str) else str(value)


def check_digits(digits: str, what: str) -> None:
    """A width or precision spelled in a format string (an int of any length: no int() of it)."""
    if len(digits) > len(str(RENDER_MAX_CHARS)) or int(digits) > RENDER_MAX_CHARS:
        shown = digits if len(digits) <= 20 else digits[:20] + "..."
        raise too_large(f"{what} with a width or precision of {shown}")


def check_binop(operator: str, left, right) -> None:
    sized = (str, bytes, list, tuple)
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, sized) and isinstance(n, int):
                check_count(len(seq) * n, "'*'")
    elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        check_count(len(left) + len(right), "'+'")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 \
            and abs(left) > 1:
        check_count(right * abs(left).bit_length(), f"{left} ** {right}")
    elif operator == "%" and isinstance(left, str):
        check_printf(left, right)
        for value in right.values() if isinstance(right, dict) else right if isinstance(right, tuple) else (right,):
            check_text(value, "'%'")


def check_printf(fmt: str, values) -> None:
    """printf-style `fmt % values`: each conversion's width and precision, and with `*` the ints it takes."""
    starred = False
    for m in _PRINTF_SPEC.finditer(fmt):
        for number in m.groups():
            if number == "*":
                starred = True
            elif number:
                check_digits(number, "'%'")
    if starred:
        for value in values if isinstance(values, tuple) else (values,):
            if isinstance(value, int):
                check_count(value, "'%' with '*'")


def check_str_call(method, args, kwargs) -> None:
    """A str method whose result grows with its arguments: ljust, rjust, center, zfill, expandtabs,
    replace, join."""
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(owner, (str, bytes)):
        return
    if name in _WIDTH_METHODS and args and isinstance(args[0], int):
        check_count(args[0], f"str.{name}")
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tabsize, int):
            check_count(len(owner) + owner.count("\t") * tabsize, "str.expandtabs")
    elif name == "replace" and len(args) >= 2:
        check_replace(owner, *args[:3])
    elif name == "join" and args:
        check_join(owner, args[0])
    elif name in ("split", "rsplit") and isinstance(owner, str):
        sep = args[0] if args else kwargs.get("sep")
        maxsplit = args[1] if len(args) > 1 else kwargs.get("maxsplit", -1)
        pieces = count_pieces(owner, WHITESPACE) if sep is None else owner.count(sep) + 1 if isinstance(sep, str) \
            and sep else 1
        check_items(min(pieces, maxsplit + 1) if isinstance(maxsplit, int) and maxsplit >= 0 else pieces,
                     f"str.{name}")
    elif name == "splitlines" and isinstance(owner, str):
        check_items(count_pieces(owner, LINE_BREAKS), "str.splitlines")
    elif name == "translate" and isinstance(owner, str) and args and isinstance(args[0], dict):
        grown = sum(owner.count(chr(k) if isinstance(k, int) else k) * (len(v) - 1)
                    for k, v in args[0].items() if isinstance(v, str) and isinstance(k, (int, str)) and len(v) > 1
                    and (not isinstance(k, int) or 0 <= k <= 0x10FFFF))
        check_count(len(owner) + grown, "str.translate")


#: what str.split() splits at, and str.splitlines().
WHITESPACE = "".join(c for c in map(chr, range(0x3001)) if c.isspace())
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def count_pieces(s: str, separators: str) -> int:
    """An upper bound on the pieces `s` splits into at any of `separators` (one count per
    separator: cheap, before any piece is built)."""
    if len(s) // 2 + 1 <= RENDER_MAX_ITEMS:
        return len(s) // 2 + 1
    return sum(s.count(c) for c in separators) + 1


def check_replace(s, old, new, count=-1) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str) and isinstance(count, int):
        hits = s.count(old) if count < 0 else min(count, s.count(old))  # "".count("") is 1: a gap each
        check_count(len(s) + hits * (len(new) - len(old)), "replace")


def check_join(separator, items) -> None:
    if isinstance(separator, str) and isinstance(items, (list, tuple)):
        pieces = sum(len(item) for item in items if isinstance(item, str))
        check_count(pieces + len(separator) * max(len(items) - 1, 0), "join")
