"""The one thread that steps the engine's scheduler while requests run or wait."""
from __future__ import annotations

import threading
import time

from verispec.engine import InferenceEngine

#: seconds the engine thread waits idle before it ends (the next request starts it again).
ENGINE_THREAD_IDLE_S = 30.0
#: seconds one engine step may run before /health calls the engine stuck (a speculator call is
#: abandoned long before: verispec.plugin_calls).
ENGINE_STEP_STUCK_S = 120.0


class EngineThread:
    """The one thread that steps the engine while requests run or wait (started on demand; it
    ends after ENGINE_THREAD_IDLE_S seconds without work)."""

    def __init__(self, engine: InferenceEngine):
        self.engine = engine
        self._work = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.stuck_after_s = ENGINE_STEP_STUCK_S
        self._step_started: float | None = None  # monotonic seconds, while a step runs

    def health(self) -> str | None:
        """None when the engine thread is well; else why not, one line: it died with work left, or
        one step has run past stuck_after_s."""
        thread, started = self._thread, self._step_started
        if thread is not None and not thread.is_alive() and self.engine.has_work:
            return "the engine thread has died with requests left; restart the server"
        if started is not None and time.monotonic() - started > self.stuck_after_s:
            return (f"one engine step has run for {time.monotonic() - started:.0f} s (more than "
                    f"{self.stuck_after_s:g} s): the engine is stuck")
        return None

    def stop(self, timeout: float) -> None:
        """Finish the step under way (and any cancelled requests' last one), then end; waits up
        to `timeout` seconds, so that no forward runs while the interpreter exits."""
        with self._lock:
            self._stopping = True
            self._work.set()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def wake(self) -> None:
        """Something was queued or cancelled: step until the engine has no work."""
        with self._lock:
            self._work.set()
            if self._thread is None:  # started before it is published: health() never sees it unstarted
                thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)
                thread.start()
                self._thread = thread

    def _run(self) -> None:
        while True:
            if not self._work.wait(ENGINE_THREAD_IDLE_S):
                with self._lock:
                    if not self._work.is_set():
                        self._thread = None
                        return
            self._work.clear()
            while self.engine.has_work:
                self._step_started = time.monotonic()
                try:
                    self.engine.step()  # failures reach the requests of that step, never this thread
                finally:
                    self._step_started = None
            with self._lock:
                if self._stopping:
                    self._thread = None
                    return
