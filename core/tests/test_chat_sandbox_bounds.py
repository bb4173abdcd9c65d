"""verispec.chat.sandbox's bounds against hostile templates: every filter and
every stringification stays within RENDER_MAX_CHARS / RENDER_MAX_ITEMS, refused before the value
is built, and the RENDER_TIME_LIMIT_S deadline is enforced from outside the rendering call (a
filter looping in Python stops there). The hostile set runs in a subprocess under a 1 GiB
address-space limit: a template that builds a GB-sized value fails there with MemoryError instead
of a bound's refusal."""
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from verispec.chat import sandbox
from verispec.chat.sandbox import RENDER_MAX_CHARS, ChatTemplateError, compile_template, render

#: a message of 8 MB, the server's largest body.
BIG = "x" * 8_000_000
#: 8 MB of words.
WORDS = "word " * 1_600_000

#: (template, what a render must end with: "refused" by a size bound, or "ok"); each runs with
#: big=BIG, words=WORDS and messages=[a user message holding BIG].
HOSTILE = [
    ("{{ big | wordwrap(1) }}", "refused"),
    ("{{ words | wordwrap(79) }}", "refused"),
    ("{{ words[:500000] | wordwrap(79) | length }}", "ok"),
    ("{{ words | urlize }}", "refused"),
    ("{{ big | urlize | length }}", "ok"),
    ("{{ ('www.a.com ' * 50000) | urlize | length }}", "ok"),
    ("{% set l = 'x' * 16000000 %}{{ l | list | length }}", "refused"),
    ("{% set l = [0] * 16000000 %}{{ l }}", "refused"),
    ("{% set l = [0] * 16000000 %}{{ l | string }}", "refused"),
    ("{% set l = [0] * 16000000 %}{{ l | pprint }}", "refused"),
    ("{% set l = [0] * 16000000 %}{{ l | tojson }}", "refused"),
    ("{{ [1, 2] | tojson(indent=10**8) }}", "refused"),
    ("{{ ([[1] * 1000] * 1000) | tojson(indent=100) }}", "refused"),
    ("{% set l = ['x' * 1000] * 20000 %}{{ l }}", "refused"),
    ("{% set l = ['x' * 1000] * 20000 %}{{ l ~ '' }}", "refused"),
    ("{% set l = ['x' * 1000] * 20000 %}{{ '%s' % (l,) }}", "refused"),
    ("{% set l = ['x' * 1000] * 20000 %}{{ '{}'.format(l) }}", "refused"),
    ("{% set l = ['x' * 1000] * 20000 %}{{ [l] | join }}", "refused"),
    ("{% set l = ['x' * 1000] * 10000 %}{{ (l ~ '') | length }}", "ok"),
    ("{{ 'x'.encode() * 10**10 }}", "refused"),
    ("{{ ('x' * 2**23).translate({120: 'y' * 100}) }}", "refused"),
    ("{{ ('a ' * 2**23).split() | length }}", "refused"),
    ("{{ ('a\\n' * 2**23).splitlines() | length }}", "refused"),
    ("{{ ('<' * 2**23) | e }}", "refused"),
    ("{{ ('<' * 2**23) | forceescape }}", "refused"),
    ("{{ ('\u4e2d' * 2**23) | urlencode }}", "refused"),
    ("{{ lipsum(10**6) }}", "refused"),
    ("{{ ([0] * 2**23) | batch(1) | list | length }}", "refused"),
    ("{{ [0] | batch(10**9, 0) | list | length }}", "refused"),
    ("{{ ([0] * 10) | slice(10**9) | list | length }}", "refused"),
    ("{{ ([[0] * 16] * 2**20) | sum(start=[]) | length }}", "refused"),
    ("{{ words | title }}", "refused"),
    ("{{ words | striptags }}", "refused"),
    ("{{ words | wordcount }}", "ok"),
    ("{{ ('\u4e2d' * 2**23) | sort | length }}", "refused"),
    ("{{ ('\u4e2d' * 2**23) | list | length }}", "refused"),
    ("{% set l = [0] * 16000000 %}{{ l | join(',') }}", "refused"),
    ("{{ messages | tojson | length }}", "ok"),
    ("{{ ([big] * 2) | tojson | length }}", "ok"),
    ("{{ big | center(2**24) | length }}", "ok"),
]

_RUNNER = textwrap.dedent("""
    import json, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    from verispec.chat.sandbox import ChatTemplateError, compile_template, render
    big, words = "x" * 8_000_000, "word " * 1_600_000
    for source in json.load(sys.stdin):
        began = time.monotonic()
        try:
            outcome = "ok", len(render(compile_template(source), big=big, words=words,
                                        messages=[{"role": "user", "content": big}]))
        except ChatTemplateError as e:
            outcome = "error", e.problem
        print(json.dumps([source, *outcome, time.monotonic() - began]), flush=True)
""")


def test_hostile_templates_end_within_the_bounds_under_a_1_gib_address_space():
    done = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps([s for s, _ in HOSTILE]),
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == len(HOSTILE), done.stderr[-3000:]
    for (source, expected), (_, outcome, detail, seconds) in zip(HOSTILE, results):
        assert seconds < sandbox.RENDER_TIME_LIMIT_S + 1.5, (source, seconds)
        if expected == "ok":
            assert outcome == "ok" and detail <= RENDER_MAX_CHARS, (source, detail)
        else:  # refused by a bound, before building: never a MemoryError at the 1 GiB limit
            assert outcome == "error" and ("would build" in detail or "ran past" in detail), (source, detail)


def test_the_deadline_stops_a_filter_looping_in_python(monkeypatch):
    """wordcount over 16 MB of words is one filter call of about a second, with no sandbox callback
    inside it: only a deadline enforced from outside the call stops it at 0.1 s, well before the
    call would end (timed here first, so a faster machine keeps the comparison)."""
    template = compile_template("{{ (words ~ words) | wordcount }}")
    began = time.monotonic()
    assert render(template, words=WORDS) == "3200000"
    whole = time.monotonic() - began
    monkeypatch.setattr(sandbox, "RENDER_TIME_LIMIT_S", 0.1)
    began = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"rendering ran past 0.1 s") as e:
        render(template, words=WORDS)
    stopped = time.monotonic() - began
    assert stopped < whole / 2, (stopped, whole)
    assert e.value.http_status == 500


def test_a_deadline_at_the_end_of_a_render_never_leaks_out_of_it(monkeypatch):
    """Renders whose deadline falls before, around and after their end (limits scaled to the time
    a render takes here): each returns or raises ChatTemplateError, and the code after it runs
    undisturbed (a watchdog exception not yet raised when the render ends is withdrawn)."""
    template = compile_template("{% for m in messages %}{{ m.content | wordcount }}{% endfor %}")
    messages = [{"role": "user", "content": "a b c " * 2000}] * 20
    began = time.monotonic()
    render(template, messages=messages)
    took = time.monotonic() - began
    outcomes = set()
    for factor in [0.1, 0.4, 0.7, 0.9, 1.0, 1.1, 1.3, 4.0] * 3:
        monkeypatch.setattr(sandbox, "RENDER_TIME_LIMIT_S", took * factor)
        try:
            render(template, messages=messages)
            outcomes.add("ok")
        except ChatTemplateError:
            outcomes.add("late")
        total = 0
        for i in range(100_000):  # time for a stray exception to surface
            total += i
        assert total == sum(range(100_000))
    assert outcomes == {"ok", "late"}


def test_renders_in_several_threads_keep_their_own_deadlines(monkeypatch):
    monkeypatch.setattr(sandbox, "RENDER_TIME_LIMIT_S", 0.3)
    slow = compile_template("{{ (words ~ words) | wordcount }}{{ (words ~ words) | wordcount }}")
    fast = compile_template("{{ messages | length }}")
    results = {}

    def run(name, template):
        try:
            results[name] = render(template, words=WORDS, messages=[1, 2])
        except ChatTemplateError as e:
            results[name] = e
    threads = [threading.Thread(target=run, args=("slow", slow))] + [
        threading.Thread(target=run, args=(f"fast{i}", fast)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert isinstance(results["slow"], ChatTemplateError)
    assert all(results[f"fast{i}"] == "2" for i in range(4))


@pytest.mark.parametrize("source, expected", [
    ("{{ [1, 'a', {'k': [2]}] }}|{{ [1, 'a'] | string }}|{{ {'k': 'v'} | tojson }}|{{ [1] | tojson(indent=2) }}",
     "[1, 'a', {'k': [2]}]|[1, 'a']|{\"k\": \"v\"}|[\n  1\n]"),
    ("{{ 'a b c' | wordwrap(3) }}|{{ 'see www.a.com' | urlize }}|{{ '<b>' | e }}|{{ 'a b' | urlencode }}",
     "a b\nc|see <a href=\"https://www.a.com\" rel=\"noopener\">www.a.com</a>|&lt;b&gt;|a%20b"),
    ("{{ 'a b'.split() }}|{{ [1, 2, 3] | batch(2) | list }}|{{ [[1], [2]] | sum(start=[]) }}|"
     "{{ 'ab' | list }}|{{ 'ab cd' | title }}|{{ '<i>x</i> y' | striptags }}|{{ 'a b' | wordcount }}|"
     "{{ 'ab'.translate({97: 'xy'}) }}|{{ '%s' % ([1],) }}|{{ '{}'.format([2]) }}|{{ [3, 1] | sort }}",
     "['a', 'b']|[[1, 2], [3]]|[1, 2]|['a', 'b']|Ab Cd|x y|2|xyb|[1]|[2]|[1, 3]"),
])
def test_ordinary_filters_and_stringifications_render_as_jinja2_renders_them(source, expected):
    import jinja2.sandbox

    assert render(compile_template(source)) == expected
    plain = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    if "tojson" not in source:  # jinja2's own tojson HTML-escapes; HF's (ours) does not
        assert plain.from_string(source).render() == expected
