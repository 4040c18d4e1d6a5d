"""The guard's two slow signals: the loss's trend over windows of steps, and updates lost to
rounding.

* **Behind fp32** (where the tune recorded fp32's curve): in the last whole window the run
  shares with that curve, the middle half of its losses above fp32's over the same steps by
  more than the verdicts' final gap. The last window, as the verdicts judge a trial's final
  level: a scaler's first skipped steps delay the early descent.
* **Climb**: a window's middle half above the best window's by more than the verdicts' climb
  margin. Quartiles, not means: a loss heading towards zero, or a noisy one, never trips.
* **Stall**: in the pure 16-bit modes a small learning rate takes updates below the weights'
  resolution. A flat loss cannot be told from convergence, so the cause is measured: every
  ``probe_every`` steps, the fraction of sampled 16-bit elements with a gradient that the step
  left unchanged (one device sync per probe).

A climb or a stall must hold for ``windows`` windows (or probes) in a row.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

BEHIND = "behind fp32"
CLIMB = "loss climb"
STALL = "stall"


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The first and third quartiles of ``values`` (at least two)."""
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def above(low: float, high: float, margin: float) -> bool:
    """Whether a window whose first quartile is ``low`` lies above one whose third quartile is
    ``high`` by more than ``margin`` of its size."""
    return low > high + margin * abs(high)


class LossTrend:
    """Windows of ``window`` applied steps' finite losses, checked against ``reference`` (fp32's
    loss per optimizer step in the tune, where recorded) by ``gap_margin``, and against the best
    window so far by ``climb_margin``, which must hold ``windows`` windows in a row."""

    def __init__(self, window: int, windows: int, climb_margin: float, gap_margin: float,
                 reference: Sequence[float] = ()) -> None:
        self.window, self.windows = window, windows
        self.climb_margin, self.gap_margin = climb_margin, gap_margin
        self.reference = [float(v) for v in reference]
        self.losses: list[float] = []
        self.start = 0  # the optimizer step of the current window's first loss
        self.best: tuple[float, float] | None = None  # the best window's quartiles
        self.climbs = self.climb_since = 0  # windows in a row that climbed, from this step

    def add(self, step: int, loss: float) -> tuple[str, int, str] | None:
        """One applied step's finite loss; the signal that holds now, if any."""
        if not self.losses:
            self.start = step
        self.losses.append(loss)
        if len(self.losses) < self.window:
            return None
        low, high = quartiles(self.losses)
        start, self.losses = self.start, []
        found = self._behind(start, step, low) or self._climb(start, low)
        if self.best is None or high < self.best[1]:
            self.best = (low, high)
        return found

    def _behind(self, start: int, end: int, low: float) -> tuple[str, int, str] | None:
        if end > len(self.reference) or end + self.window <= len(self.reference):
            return None  # not the last whole window the run shares with fp32's curve
        shared = self.reference[start - 1:end]
        if not all(math.isfinite(v) for v in shared):
            return None
        ref_high = quartiles(shared)[1]
        if not above(low, ref_high, self.gap_margin):
            return None
        return (BEHIND, start, f"the loss's lower quartile {low:.4g} over steps {start}-{end}, above fp32's upper "
                f"quartile {ref_high:.4g} in the tune by more than {self.gap_margin:.0%}")

    def _climb(self, start: int, low: float) -> tuple[str, int, str] | None:
        if self.best is None:
            return None
        if not above(low, self.best[1], self.climb_margin):
            self.climbs = 0
            return None
        if self.climbs == 0:
            self.climb_since = start
        self.climbs += 1
        if self.climbs < self.windows:
            return None
        return (CLIMB, self.climb_since, f"the loss's lower quartile {low:.4g}, above the best window's upper "
                f"quartile {self.best[1]:.4g} by more than {self.climb_margin:.0%}, {self.windows} windows "
                f"of {self.window} steps in a row")

    def state_dict(self) -> dict[str, Any]:
        # "runs" and "since" keep the checkpoint format of a climb counter keyed by signal.
        return {"losses": list(self.losses), "start": self.start, "best": self.best,
                "runs": {CLIMB: self.climbs}, "since": {CLIMB: self.climb_since}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = [float(v) for v in state.get("losses", ())]
        self.start = int(state.get("start", 0))
        best = state.get("best")
        self.best = None if best is None else (float(best[0]), float(best[1]))
        self.climbs = int(state.get("runs", {}).get(CLIMB, self.climbs))
        self.climb_since = int(state.get("since", {}).get(CLIMB, self.climb_since))


class UpdateProbe:
    """Every ``every`` optimizer steps, the fraction of sampled 16-bit parameter elements (at
    most ``sample`` from each) that had a gradient and did not change in the step."""

    def __init__(self, every: int, sample: int = 1024) -> None:
        self.every, self.sample = every, sample
        self._before: list[tuple[Any, Any]] | None = None

    def before(self, step: int, params: Iterable[Any]) -> None:
        """Before optimizer step ``step``: keep a sample of each 16-bit parameter with a gradient,
        and which of its elements have one."""
        import torch

        self._before = None
        if step % self.every:
            return
        half = (torch.bfloat16, torch.float16)
        taken = []
        for p in params:
            if p.grad is not None and p.dtype in half:
                values = p.detach().reshape(-1)[:self.sample].clone()
                taken.append((p, values, p.grad.detach().reshape(-1)[:self.sample] != 0))
        self._before = taken or None

    def lost(self) -> float | None:
        """After the step: the fraction of sampled updates lost, or ``None`` where none was probed."""
        if self._before is None:
            return None
        changed = eligible = 0
        for p, before, wanted in self._before:
            moved = p.detach().reshape(-1)[:before.numel()] != before
            changed += (moved & wanted).sum()
            eligible += wanted.sum()
        self._before = None
        total = int(eligible)  # the probe's one sync, every ``every`` steps
        return None if total == 0 else 1.0 - int(changed) / total
