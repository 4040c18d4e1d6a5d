"""The device a trial times and measures (``DeviceClock``), the loop API trial's device made
current, its memory capped (``TrialDevice``), and the peak RSS of one in-process CPU trial."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# How often the RSS is sampled where the high-water mark cannot be reset: often enough to see
# an allocation that lives for a step, rarely enough to cost nothing measurable.
RSS_SAMPLE_S = 0.005


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (VmHWM); False where Linux does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5 resets the peak RSS only; 1-4 would clear page-referenced bits
    except OSError:
        return False
    return _high_water_mark() is not None


def _high_water_mark() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError, StopIteration), \
            open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return None


def _current_rss() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError, AttributeError), \
            open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return None


def lifetime_peak_rss() -> int | None:
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB, macOS bytes


class TrialPeakRss:
    """The peak RSS of this process from ``start()`` to ``stop()``: one in-process trial's own.
    Exact where the high-water mark can be reset, or where the lifetime peak (``ru_maxrss``) rose
    during the trial; else the RSS sampled every ``RSS_SAMPLE_S`` (a lower bound)."""

    def __init__(self) -> None:
        self._lifetime_at_start: int | None = None
        self._sampled = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peak: int | None = None
        self._hwm = self._stopped = False

    def start(self) -> None:
        self._hwm = reset_peak_rss()
        if self._hwm:
            return
        self._lifetime_at_start = lifetime_peak_rss()
        self._sampled = _current_rss() or 0
        if self._sampled:
            self._thread = threading.Thread(target=self._sample, name="mpadvise-rss", daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_S):
            self._sampled = max(self._sampled, _current_rss() or 0)

    def stop(self) -> int | None:
        if not self._stopped:
            self._stopped, self._peak = True, self._measure()
        return self._peak

    def _measure(self) -> int | None:
        if self._hwm:
            return _high_water_mark()
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sampled = max(self._sampled, _current_rss() or 0)
        lifetime, start = lifetime_peak_rss(), self._lifetime_at_start
        rose = lifetime is not None and start is not None and lifetime > start
        return lifetime if rose else (self._sampled or None)


class DeviceClock:
    """Time marks and peak memory on one CUDA device (``None``: the host clock, the CPU)."""

    def __init__(self, device: Any | None) -> None:
        self.device = device

    def mark(self) -> Any:
        if self.device is None:
            return time.perf_counter()
        import torch

        # On the trial device's stream, whatever the current device is by now: an event on
        # another device's stream would time that device's (absent) work.
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def sync(self) -> None:
        if self.device is not None:
            import torch

            torch.cuda.synchronize(self.device)

    @staticmethod
    def elapsed(a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if hasattr(a, "elapsed_time") else b - a

    def peak_memory(self) -> tuple[int | None, str]:
        """The CUDA peak allocated, or this process's lifetime peak RSS on a CPU; and its kind."""
        if self.device is not None:
            import torch

            return int(torch.cuda.max_memory_allocated(self.device)), "cuda-peak-allocated"
        rss = lifetime_peak_rss()
        return (None, "") if rss is None else (rss, "cpu-peak-rss")


class TrialDevice:
    """The device of a loop API trial until ``close()``: made the current one, its memory capped
    at ``memory_limit`` (CUDA). ``in_process``: the process outlives the trial, so its current
    device is given back and its lifetime peak RSS is not the trial's."""

    def __init__(self, device: torch.device, *, memory_limit: int | None, in_process: bool) -> None:
        import torch

        self.clock = DeviceClock(device if device.type == "cuda" else None)
        self._previous_device: int | None = None  # in process: the current device to give back
        self._rss: TrialPeakRss | None = None
        if device.type == "cuda":
            # The trial's device made the current one: whatever names "cuda" without an index (a
            # script's .cuda(), torch.compile's and CUDA graphs' allocations) uses it.
            if device.index is not None:  # plain "cuda" already means the current device
                if in_process:
                    self._previous_device = torch.cuda.current_device()
                torch.cuda.set_device(device)
            if memory_limit:
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, memory_limit / total), device)
            torch.cuda.reset_peak_memory_stats(device)
        elif in_process:
            self._rss = TrialPeakRss()
            self._rss.start()

    def peak_memory(self) -> tuple[int | None, str]:
        if self._rss is not None:
            return self._rss.stop(), "cpu-peak-rss"
        return self.clock.peak_memory()

    def close(self) -> None:
        if self._rss is not None:
            self._rss.stop()
        if self._previous_device is not None:
            import torch

            torch.cuda.set_device(self._previous_device)
            self._previous_device = None
