"""The one thread that steps the engine's scheduler while requests run or wait."""
from __future__ import annotations

import threading

from verispec.engine import InferenceEngine

#: seconds the engine thread waits idle before it ends (the next request starts it again).
ENGINE_THREAD_IDLE_S = 30.0


class EngineThread:
    """The one thread that steps the engine while requests run or wait (started on demand; it
    ends after ENGINE_THREAD_IDLE_S seconds without work)."""

    def __init__(self, engine: InferenceEngine):
        self.engine = engine
        self._work = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False

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
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            if not self._work.wait(ENGINE_THREAD_IDLE_S):
                with self._lock:
                    if not self._work.is_set():
                        self._thread = None
                        return
            self._work.clear()
            while self.engine.has_work:
                self.engine.step()  # failures reach the requests of that step, never this thread
            with self._lock:
                if self._stopping:
                    self._thread = None
                    return
