"""Generated text streamed to a terminal beside verispec's warnings (`verispec generate`, `chat`).

Text arrives a token at a time and rarely ends a line; a warning logged meanwhile (the cost
governor parking a slow speculator) would land inside it. `warnings_on_their_own_line(stdout,
stderr)` streams the text and, while it is open, starts each verispec warning on a line of its
own when both streams are the same terminal (elsewhere they are separate files and nothing is
added).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TextIO


class StreamedText:
    """`stream` as text goes to it, remembering whether the last character ended a line."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.mid_line = False

    def write(self, text: str) -> None:
        if text:
            print(text, end="", file=self.stream, flush=True)
            self.mid_line = not text.endswith("\n")


class _LineStartHandler(logging.StreamHandler):
    """Emits warnings to `stream`, first ending the streamed text's line when both are one terminal."""

    def __init__(self, text: StreamedText, stream: TextIO):
        super().__init__(stream)
        self.text = text
        self.setLevel(logging.WARNING)

    def emit(self, record) -> None:
        if self.text.mid_line and self.text.stream.isatty() and self.stream.isatty():
            self.stream.write("\n")
            self.text.mid_line = False
        super().emit(record)


@contextlib.contextmanager
def warnings_on_their_own_line(stdout: TextIO, stderr: TextIO) -> Iterator[StreamedText]:
    """`with warnings_on_their_own_line(stdout, stderr) as text: text.write(...)`: the "verispec"
    logger's warnings go to `stderr` through a handler that knows where the text stands."""
    text = StreamedText(stdout)
    handler, logger = _LineStartHandler(text, stderr), logging.getLogger("verispec")
    logger.addHandler(handler)
    try:
        yield text
    finally:
        logger.removeHandler(handler)
