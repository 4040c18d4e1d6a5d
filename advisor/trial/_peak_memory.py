"""The peak RSS of one in-process trial on a CPU, and this process's lifetime peak."""

from __future__ import annotations

import os
import sys
import threading

# How often the RSS is sampled where the high-water mark cannot be reset: often enough to see
# an allocation that lives for a step, rarely enough to cost nothing measurable.
RSS_SAMPLE_S = 0.005


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (VmHWM) to its current RSS; False where Linux
    does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5 resets the peak RSS only; 1-4 would clear page-referenced bits
    except OSError:
        return False
    return _status_bytes("VmHWM") is not None


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _current_rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
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

    Exact where the high-water mark can be reset; else a lifetime peak (``ru_maxrss``) that rose
    during the trial, and is exact; else the current RSS sampled every ``RSS_SAMPLE_S`` (a lower
    bound).
    """

    def __init__(self) -> None:
        self._hwm = False
        self._lifetime_at_start: int | None = None
        self._sampled = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peak: int | None = None
        self._stopped = False

    def start(self) -> None:
        if reset_peak_rss():
            self._hwm = True
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
        if self._stopped:
            return self._peak
        self._stopped = True
        if self._hwm:
            self._peak = _status_bytes("VmHWM")
            return self._peak
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sampled = max(self._sampled, _current_rss() or 0)
        lifetime = lifetime_peak_rss()
        if lifetime is not None and self._lifetime_at_start is not None and lifetime > self._lifetime_at_start:
            self._peak = lifetime
        else:
            self._peak = self._sampled or None
        return self._peak
