"""PluginCalls: a speculator's calls run on a worker thread and are abandoned past a bound.

A plugin's `propose` that never returns must not stop the engine: every request would hang with
it. The engine hands each speculator call to one worker thread and waits at most `bound_s`
seconds, and no longer than the nearest time limit of the requests in the step (`deadline`, set
by the scheduler each step), so a request's --request-timeout ends it even while a call hangs; a
call that time limit interrupts still gets PLUGIN_CALL_GRACE_S seconds from its start, so a
working speculator is not switched off because a request ran out of time during one of its calls.
Past the wait the call is abandoned (its thread is left to finish on its own, a daemon, and a new
worker serves later calls), `PluginTimeout` is raised naming the rule and its numbers, and the
execution switches the speculator off with one warning and finishes the step plainly
(verispec.execution); a timed-out request then ends at that step's token. Anything the call
raises is re-raised in the caller; a BaseException that is not an Exception (SystemExit,
KeyboardInterrupt, GeneratorExit raised by plugin code) comes back as `PluginRaised`, so a plugin
never ends the process. The worker adds a thread handoff (tens of µs) to each call; the cost
model measures it with the drafter's own time.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

#: seconds a speculator call may run before it is abandoned.
PLUGIN_CALL_BOUND_S = 30.0
#: seconds a call may run, at least, when a request's time limit passes during it (a working
#: speculator's call returns well within it).
PLUGIN_CALL_GRACE_S = 1.0


class PluginTimeout(Exception):
    """A plugin call did not return within its wait (it was abandoned); `rule` says which limit
    ended it, with its numbers ("did not return within 30 s")."""

    def __init__(self, name: str, rule: str):
        super().__init__(f"{name} {rule}; abandoned")
        self.rule = rule


class PluginRaised(Exception):
    """Plugin code raised a BaseException that is not an Exception (SystemExit, KeyboardInterrupt)."""


class _Job:
    def __init__(self, fn: Callable, args: tuple):
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None


class PluginCalls:
    """Runs `fn(*args)` on a worker thread, waiting at most `bound_s` seconds (> 0) for it, and
    no longer than `deadline` (module docstring)."""

    def __init__(self, bound_s: float = PLUGIN_CALL_BOUND_S):
        if not bound_s > 0:
            raise ValueError(f"PluginCalls(bound_s={bound_s}): give a positive number of seconds")
        self.bound_s = bound_s
        #: the nearest time limit of the requests in the step being run: (the time.perf_counter()
        #: at which it passes, the limit in seconds); None = none. The scheduler sets it each step.
        self.deadline: tuple[float, float] | None = None
        self._jobs: queue.SimpleQueue | None = None
        #: calls abandoned so far (each left a thread behind until its call returns).
        self.num_abandoned = 0

    def __call__(self, fn: Callable, *args):
        """fn(*args)'s result. Raises what it raised (Exceptions), PluginRaised for other
        BaseExceptions, PluginTimeout when it ran past its wait (`wait`)."""
        wait, rule = self.wait()
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._jobs,), name="verispec-plugin", daemon=True).start()
        job = _Job(fn, args)
        self._jobs.put(job)
        if not job.done.wait(wait):
            self._jobs.put(None)  # the stuck worker ends once its call returns
            self._jobs = None
            self.num_abandoned += 1
            raise PluginTimeout(getattr(fn, "__qualname__", repr(fn)), rule)
        if job.error is not None:
            if isinstance(job.error, Exception):
                raise job.error
            raise PluginRaised(f"{type(job.error).__name__}: {job.error}") from job.error
        return job.result

    def wait(self) -> tuple[float, str]:
        """(seconds a call starting now may run, the rule that sets it, for PluginTimeout): the
        earlier of bound_s and `deadline`, a deadline giving at least PLUGIN_CALL_GRACE_S."""
        if self.deadline is not None:
            at, limit_s = self.deadline
            left = max(at - time.perf_counter(), PLUGIN_CALL_GRACE_S)
            if left < self.bound_s:
                return left, f"ran past a request's time limit of {limit_s:g} s (waited {left:.2g} s)"
        return self.bound_s, f"did not return within {self.bound_s:g} s"


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
