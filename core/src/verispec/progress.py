"""Progress for long work that has no steps to count (a model load): one line on stderr naming
the work and its elapsed time, drawn once the work has taken `delay` seconds, refreshed by a
timer thread, cleared when the work ends. Silent when stderr is not a terminal (tqdm's
`disable=None`), so logs and pipes get nothing. Work with steps uses a tqdm bar directly
(checkpoint assembly, weight conversion, the bench).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def elapsed(desc: str, *, delay: float = 1.0, interval: float = 0.5) -> Iterator[None]:
    """`with elapsed("loading model.gguf"): ...` shows `loading model.gguf [00:03]` on a terminal
    after `delay` seconds, redrawn every `interval` seconds (both in seconds)."""
    from tqdm import tqdm

    bar = tqdm(desc=desc, total=None, delay=delay, disable=None, leave=False, bar_format="{desc} [{elapsed}]")
    if bar.disable:
        yield
        return
    done = threading.Event()

    def tick() -> None:
        if done.wait(delay):
            return  # finished within the delay: nothing was drawn
        while not done.is_set():
            bar.refresh()
            done.wait(interval)

    thread = threading.Thread(target=tick, name="verispec-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        bar.close()
