"""The first-step watchdog of a trial child, which does not count torch.compile's compiling."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

# How often the no-step watchdog looks at the clock and at torch.compile: a compilation is seen
# within this long of its start, and the thread stops at the first step, before any timing.
NO_STEP_POLL_S = 0.25


class CompileActivity:
    """Whether torch.compile is compiling in this process now, found without importing it:
    through Dynamo's start and end callbacks, registered at the first look once Dynamo is
    imported (and again after ``torch._dynamo.reset()``), and its count of pending compilations.
    """

    def __init__(self) -> None:
        self._compiling = False

    def _started(self, *_: Any) -> None:  # newer torch passes a CallbackArgs, older torch nothing
        self._compiling = True

    def _ended(self, *_: Any) -> None:
        self._compiling = False

    def compiling(self) -> bool:
        handler = getattr(sys.modules.get("torch._dynamo"), "callback_handler", None)
        if handler is None:  # no torch.compile in this process (or its import has not got there)
            return False
        try:
            if self._started not in handler.start_callbacks:
                handler.register_start_callback(self._started)
                handler.register_end_callback(self._ended)
        except (AttributeError, TypeError):  # a torch whose callbacks look otherwise
            return False
        pending = getattr(handler, "_CompilationCallbackHandler__pending_callbacks_counter", 0)
        return self._compiling or (isinstance(pending, int) and pending > 0)


class NoStepWatchdog:
    """Calls ``on_expire`` once when ``timeout`` seconds pass without a step. torch.compile
    compiles inside the first forward, which can take minutes, so the deadline is never earlier
    than ``timeout`` after the latest moment a compilation was seen running (the trial's own
    timeout still bounds one that never ends)."""

    def __init__(self, timeout: float, on_expire: Callable[[], None], *,
                 activity: CompileActivity | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self._on_expire = on_expire
        self._activity = activity or CompileActivity()
        self._clock = clock
        self._poll_s = min(NO_STEP_POLL_S, timeout / 4)
        self._deadline = clock() + timeout
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._watch, name="mpadvise-no-step", daemon=True).start()

    def cancel(self) -> None:
        self._stop.set()

    def expired(self) -> bool:
        now = self._clock()
        if self._activity.compiling():
            self._deadline = max(self._deadline, now + self.timeout)
            return False
        return now >= self._deadline

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            if self.expired():
                if not self._stop.is_set():
                    self._on_expire()
                return
