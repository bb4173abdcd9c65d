"""verispec.chat.template: a template that fails is a ChatTemplateError (a syntax error, a loop
past the time bound, a value past the size bound, refused before it is built), and ordinary
formatting renders as Python formats it."""
import time

import pytest

from verispec.chat import sandbox
from verispec.chat.template import RENDER_MAX_CHARS, ChatTemplate, ChatTemplateError

#: a width far past RENDER_MAX_CHARS: building the value would take a GiB
WIDE = 10**9
assert WIDE > RENDER_MAX_CHARS


def test_a_syntax_error_names_its_line_and_is_the_files_fault():
    with pytest.raises(ChatTemplateError, match=r"failed: syntax error at line 2: unexpected '}'") as e:
        ChatTemplate("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    assert e.value.http_status == 500 and not e.value.refused and len(str(e.value).splitlines()) == 1


def test_a_template_looping_past_the_time_bound_stops_there(monkeypatch):
    monkeypatch.setattr(sandbox, "RENDER_TIME_LIMIT_S", 0.2)
    looping = ChatTemplate("{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}")
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match="rendering ran past 0.2 s") as e:
        looping.render([])
    assert time.monotonic() - started < 1.5 and e.value.http_status == 500


@pytest.mark.parametrize("source", [
    "{{ 'x' * 10**10 }}",
    "{% set s = ('x' * 10**7) + ('x' * 10**7) %}{{ s | length }}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    "{{ ns.s | length }}",
    f"{{{{ '{{:>{WIDE}}}'.format(1) }}}}",
    f"{{{{ '{{x:{WIDE}}}'.format_map({{'x': 1}}) }}}}",
    f"{{{{ '{{:{{w}}}}'.format(1, w={WIDE}) }}}}",  # a nested spec, filled in before the check
    f"{{{{ '%{WIDE}d' % 1 }}}}",
    f"{{{{ '%.{WIDE}f' % 1 }}}}",
    f"{{{{ '%*d' % ({WIDE}, 1) }}}}",
    f"{{{{ '%{WIDE}d' | format(1) }}}}",
    f"{{{{ 'x'.ljust({WIDE}) }}}}",
    f"{{{{ '7'.zfill({WIDE}) }}}}",
    f"{{{{ 'a\\tb'.expandtabs({WIDE}) }}}}",
    f"{{{{ 'x' | center({WIDE}) }}}}",
    f"{{{{ 'a\\nb' | indent({WIDE}) }}}}",
    "{% set s = 'x' * 2**23 %}{{ s.replace('x', s) | length }}",
    "{% set s = 'x' * 2**23 %}{{ s | replace('x', s) | length }}",
    "{% set s = 'x' * 2**23 %}{{ s.join(['ab'] * 2**22) | length }}",
    "{% set s = 'x' * 2**23 %}{{ (['ab'] * 2**22) | join(s) | length }}",
])
def test_a_value_past_the_size_bound_is_refused_before_it_is_built(source):
    with pytest.raises(ChatTemplateError, match="would build a value longer than 16777216 characters") as e:
        ChatTemplate(source).render([])
    assert e.value.http_status == 500


@pytest.mark.parametrize("error", [MemoryError(), RecursionError("maximum recursion depth exceeded"),
                                   OverflowError("int too large")])
def test_an_error_the_template_raises_while_rendering_is_a_template_error(error):
    def fail():
        raise error
    with pytest.raises(ChatTemplateError, match=f"{type(error).__name__} while rendering") as e:
        ChatTemplate("{{ fail() }}").render([], fail=fail)
    assert e.value.http_status == 500


def test_ordinary_widths_and_formats_render_as_python_formats_them():
    source = ("{{ '{:>5}|{:.2f}|{n:03}|'.format('a', 3.14159, n=7) }}{{ '{k}|'.format_map({'k': 'v'}) }}"
              "{{ '%-4s|%03d|%.1f|' % ('b', 7, 2.25) }}{{ '%s-%s|' | format(1, 2) }}"
              "{{ 'x'.ljust(3) }}|{{ 'a' | center(5) }}|{{ 'a\\nb' | indent(2) }}|"
              "{{ 'a\\tb'.expandtabs(4) }}|{{ ('ab' + 'cd') * 2 }}|{{ 'a' ~ 1 ~ none }}|"
              "{{ 'abc'.replace('b', 'XX') }}|{{ 'abcb' | replace('b', 'Y', 1) }}|"
              "{{ '-'.join(['a', 'b']) }}|{{ [1, 2] | join(', ') }}|"
              "{{ [{'n': 1}, {'n': 2}] | join('+', attribute='n') }}")
    assert ChatTemplate(source).render([]) == ("    a|3.14|007|v|b   |007|2.2|1-2|x  |  a  |a\n  b|a   b|"
                                               "abcdabcd|a1None|aXXc|aYcb|a-b|1, 2|1+2")
