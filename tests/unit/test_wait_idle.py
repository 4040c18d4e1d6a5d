"""Trials wait for a GPU that other processes are using (the daemon sets this)."""

from __future__ import annotations

from advisor.tune._trials import wait_until_idle
from probes import HardwareProfile

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
