"""The first-step watchdog of a trial child (``NoStepWatchdog``), which does not count the time
torch.compile spends compiling (``CompileActivity``).
"""

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
    """Whether torch.compile is compiling in this process now, found without importing it.

    Dynamo runs start and end callbacks around each compilation (tracing a frame, a backward
    compiled lazily, a CUDA graph recorded), counting nested ones as one. ``torch.compile``
    imports Dynamo before it compiles anything, so the first look after that registers the
    callbacks here, and registers them again after ``torch._dynamo.reset()`` cleared them. A
    compilation already running when they were registered is seen through Dynamo's count of
    pending compilations, where this torch has it.
    """

    def __init__(self) -> None:
        self._compiling = False

    def _started(self, *_: Any) -> None:  # newer torch passes a CallbackArgs, older torch nothing
        self._compiling = True

    def _ended(self, *_: Any) -> None:
        self._compiling = False

    def compiling(self) -> bool:
        """True while a compilation runs; False too where torch.compile was never imported."""
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
    """Calls ``on_expire`` once when ``timeout`` seconds pass without a step, not counting the
    time torch.compile spends compiling.

    torch.compile compiles inside the first forward, before the first ``step()``; on a large
    model, or with ``mode="max-autotune"``, that alone can take minutes, and a deadline counted
    from ``load_policy()`` would end a healthy trial as "no-step". So the deadline moves while
    a compilation runs: it is never earlier than ``timeout`` after the latest moment the
    watchdog saw one running, and the script has the whole timeout to reach its first step
    after its last compilation. A compilation that never ends is still bounded by the trial's
    overall timeout, which the parent process enforces.
    """

    def __init__(
        self,
        timeout: float,
        on_expire: Callable[[], None],
        *,
        activity: CompileActivity | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float | None = None,
    ) -> None:
        self.timeout = timeout
        self._on_expire = on_expire
        self._activity = activity or CompileActivity()
        self._clock = clock
        self._poll_s = poll_s if poll_s is not None else min(NO_STEP_POLL_S, timeout / 4)
        self._deadline = clock() + timeout
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._watch, name="mpadvise-no-step", daemon=True).start()

    def cancel(self) -> None:
        """Stop watching (the script stepped)."""
        self._stop.set()

    def expired(self) -> bool:
        """One look: whether the time is up, moving the deadline if a compilation runs."""
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
