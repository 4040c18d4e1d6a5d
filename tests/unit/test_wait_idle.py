"""Trials wait for a GPU that other processes are using (the daemon sets this)."""

from __future__ import annotations

import pytest

from advisor.tune._run import wait_until_idle
from probes import HardwareProfile, MpadviseError

GPU = HardwareProfile(kind="cuda", name="NVIDIA H100 80GB HBM3", index=0, compute_capability=(9, 0), uuid="GPU-1")


def test_waits_until_no_other_compute_process(monkeypatch):
    answers = [[4242, 4343], [4242], []]
    asked: list[tuple[int, str | None]] = []

    def fake_busy(index, nvml=None, *, uuid=None):
        asked.append((index, uuid))
        return answers.pop(0)

    monkeypatch.setattr("probes.gpu_busy", fake_busy)
    sleeps: list[float] = []
    seen: list[list[int]] = []
    wait_until_idle(GPU, poll_s=2.0, on_wait=seen.append, sleep=sleeps.append)
    assert sleeps == [2.0, 2.0]
    assert seen == [[4242, 4343], [4242]]
    assert asked == [(0, "GPU-1")] * 3


def test_cpu_never_waits(monkeypatch):
    monkeypatch.setattr("probes.gpu_busy", lambda *a, **k: [1])
    wait_until_idle(HardwareProfile(kind="cpu", name="cpu"), sleep=lambda s: (_ for _ in ()).throw(AssertionError))


def test_the_wait_is_bounded_and_says_what_to_do(monkeypatch):
    monkeypatch.setattr("probes.gpu_busy", lambda *a, **k: [4242])
    now = [0.0]

    def sleep(seconds: float) -> None:
        if now[0] > 10 * 3600:
            raise AssertionError("still waiting after ten hours: the wait has no bound")
        now[0] += seconds

    with pytest.raises(MpadviseError) as caught:
        wait_until_idle(GPU, poll_s=5.0, max_wait_s=60.0, sleep=sleep, clock=lambda: now[0])
    message = str(caught.value)
    assert "4242" in message and "60 s" in message and GPU.name in message
    assert "MPADVISE_WAIT_IDLE_GPU" in message  # the way out
    assert 60.0 <= now[0] <= 65.0


def test_the_default_bound_is_finite(monkeypatch):
    monkeypatch.setattr("probes.gpu_busy", lambda *a, **k: [4242])
    now = [0.0]

    def sleep(seconds: float) -> None:
        if now[0] > 10 * 24 * 3600:
            raise AssertionError("still waiting after ten days: the wait has no bound")
        now[0] += seconds

    with pytest.raises(MpadviseError):
        wait_until_idle(GPU, sleep=sleep, clock=lambda: now[0])
