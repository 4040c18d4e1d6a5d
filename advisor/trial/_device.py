"""The device a trial times and measures (``DeviceClock``), and the loop API trial's device made
current, its memory capped (``TrialDevice``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ._peak_memory import TrialPeakRss, lifetime_peak_rss

if TYPE_CHECKING:
    import torch


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

        self.cuda = device.type == "cuda"
        self.clock = DeviceClock(device if self.cuda else None)
        self._previous_device: int | None = None  # in process: the current device to give back
        self._rss: TrialPeakRss | None = None
        if self.cuda:
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
