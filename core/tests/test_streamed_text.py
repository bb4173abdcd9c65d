"""Warnings logged while text streams start on their own line when stdout and stderr are one terminal."""
import io
import logging

from verispec.streamed_text import warnings_on_their_own_line


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_warning_mid_line_starts_a_line_of_its_own_on_a_terminal():
    out, err = Terminal(), Terminal()
    with warnings_on_their_own_line(out, err) as text:
        text.write("This function uses")
        logging.getLogger("verispec").warning("speculator parked")
        text.write(" recursion.\n")
        logging.getLogger("verispec.engine").warning("at a line start")
    assert out.getvalue() == "This function uses recursion.\n"
    assert err.getvalue() == "\nspeculator parked\nat a line start\n"


def test_files_get_no_extra_newline_and_the_handler_goes_away():
    out, err = io.StringIO(), io.StringIO()
    logger = logging.getLogger("verispec")
    handlers = list(logger.handlers)
    with warnings_on_their_own_line(out, err) as text:
        text.write("partial")
        logger.warning("note")
        logger.info("not shown")
    assert err.getvalue() == "note\n" and logger.handlers == handlers
