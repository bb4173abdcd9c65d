"""PluginCalls: a speculator's calls run on a worker thread and are abandoned past a bound.

A plugin's `propose` that never returns must not stop the engine: every request would hang with
it. The engine hands each speculator call to one worker thread and waits at most `bound_s`
seconds; past that the call is abandoned (its thread is left to finish on its own, a daemon, and
a new worker serves later calls), `PluginTimeout` is raised, and the execution switches the
speculator off with one warning and finishes the step plainly (verispec.execution). Anything the
call raises is re-raised in the caller; a BaseException that is not an Exception (SystemExit,
KeyboardInterrupt, GeneratorExit raised by plugin code) comes back as `PluginRaised`, so a plugin
never ends the process. The worker adds a thread handoff (tens of µs) to each call; the cost
model measures it with the drafter's own time.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable

#: seconds a speculator call may run before it is abandoned.
PLUGIN_CALL_BOUND_S = 30.0


class PluginTimeout(Exception):
    """A plugin call did not return within its bound (it was abandoned)."""


class PluginRaised(Exception):
    """Plugin code raised a BaseException that is not an Exception (SystemExit, KeyboardInterrupt)."""


class _Job:
    def __init__(self, fn: Callable, args: tuple):
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None


class PluginCalls:
    """Runs `fn(*args)` on a worker thread, waiting at most `bound_s` seconds (> 0) for it."""

    def __init__(self, bound_s: float = PLUGIN_CALL_BOUND_S):
        if not bound_s > 0:
            raise ValueError(f"PluginCalls(bound_s={bound_s}): give a positive number of seconds")
        self.bound_s = bound_s
        self._jobs: queue.SimpleQueue | None = None
        #: calls abandoned so far (each left a thread behind until its call returns).
        self.num_abandoned = 0

    def __call__(self, fn: Callable, *args):
        """fn(*args)'s result. Raises what it raised (Exceptions), PluginRaised for other
        BaseExceptions, PluginTimeout when it ran past bound_s."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._jobs,), name="verispec-plugin", daemon=True).start()
        job = _Job(fn, args)
        self._jobs.put(job)
        if not job.done.wait(self.bound_s):
            self._jobs.put(None)  # the stuck worker ends once its call returns
            self._jobs = None
            self.num_abandoned += 1
            name = getattr(fn, "__qualname__", repr(fn))
            raise PluginTimeout(f"{name} did not return within {self.bound_s:g} s; abandoned")
        if job.error is not None:
            if isinstance(job.error, Exception):
                raise job.error
            raise PluginRaised(f"{type(job.error).__name__}: {job.error}") from job.error
        return job.result


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            job.result = job.fn(*job.args)
        except BaseException as exc:  # noqa: BLE001 -- handed to the caller, never this thread's end
            job.error = exc
        job.done.set()
