"""FLOPs per optimizer step, counted once in a warm-up step, in real trials: the loop API's
examples, Lightning's Trainer and the Hugging Face Trainer; the token estimate where counting
finds nothing; the first-step watchdog counting from the candidate's application; and the
breakdown ``mpadvise trial`` prints.

The count is checked against a count made by hand from the model's shapes: a Linear layer of
``i`` inputs and ``o`` outputs costs ``2 * B * i * o`` FLOPs forward (2 per multiply-add),
as much again for its weight gradient, and as much again for its input gradient, which
autograd computes for every layer but the first (the data needs no gradient). So an MLP's
count is a little under the usual ``6 x parameters x batch``, by its first layer's input
gradient and its biases (element-wise work, which the counter does not count).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import statistics
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from advisor.frameworks import plan_for
from advisor.frameworks._plan import launch_argv
from advisor.trial import TrialSpec, _step_window, run_in_process, run_trial
from policies import Policy
from probes import HardwareProfile

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
CPU = HardwareProfile(kind="cpu", name="test CPU", cores=2)
CHILD_MARKS = ("policy_applied", "first_step", "warmup_done", "measured_done")


def mlp_flops(widths: list[int], batch: int) -> int:
    """FLOPs of one training step of an MLP with these layer widths (inputs first), by hand."""
    layers = list(zip(widths, widths[1:]))
    forward = sum(2 * batch * i * o for i, o in layers)
    input_grads = sum(2 * batch * i * o for i, o in layers[1:])  # the first layer's input needs none
    return forward + forward + input_grads


def mlp_parameters(widths: list[int]) -> int:
    return sum(i * o + o for i, o in zip(widths, widths[1:]))


def spec(tmp_path: Path, mode: str = "fp32", **fields) -> TrialSpec:
    base = TrialSpec(policy=Policy(mode=mode).to_dict(), result_path=str(tmp_path / "result.json"),
                     warmup_steps=2, measure_steps=2, device="cpu", count_flops=True)
    return dataclasses.replace(base, **fields)


# ---- the loop API, in real trials ---------------------------------------------------------------


def test_an_mlp_counts_what_its_shapes_say(tmp_path, isolated_home):
    width, batch = 2048, 64
    result = run_trial(EXAMPLES / "mlp.py", ["--width", str(width), "--batch-size", str(batch), "--samples", "512",
                                              "--epochs", "1"], spec(tmp_path), timeout=240)
    assert result.outcome == "ok", result.reason + result.stderr_tail
    widths = [256, width, width, 10]
    assert result.flops_basis == "counted"
    assert result.flops_per_step == mlp_flops(widths, batch)
    # 6 x parameters x batch overcounts by the first layer's input gradient (3.7% here) and the biases.
    ratio = result.flops_per_step / (6 * mlp_parameters(widths) * batch)
    assert 0.95 < ratio < 1.0, ratio
    assert set(CHILD_MARKS) <= set(result.timeline) and result.applied


def test_a_tiny_transformer_gets_a_count(tmp_path, isolated_home):
    result = run_trial(EXAMPLES / "tiny_lm.py", ["--steps", "8"], spec(tmp_path), timeout=240)
    assert result.outcome == "ok", result.reason + result.stderr_tail
    assert result.flops_basis == "counted"
    # Within a factor of two of 6 x parameters x tokens (batch 32 x context 64): attention's own
    # matmuls add to it, the embedding lookup takes from it.
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("tiny_lm", EXAMPLES / "tiny_lm.py"))
    module.__spec__.loader.exec_module(module)
    net = module.TinyLM(len(set(module.generate_text(4000))))
    estimate = 6 * sum(p.numel() for p in net.parameters()) * 32 * 64
    assert 0.5 < result.flops_per_step / estimate < 2.0, (result.flops_per_step, estimate)


# ---- the counted step, in process ---------------------------------------------------------------------


def _counting() -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any("FlopCounter" in type(mode).__name__ for mode in _get_current_dispatch_mode_stack())


def _mlp_trainer(counted: list[bool], *, batch: int = 16):
    def train(mp) -> None:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
        model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
        micro = mp.micro_batch_size(batch)
        while True:
            for _ in range(batch // micro):
                counted.append(_counting())
                x, y = mp.to_device(torch.randn(micro, 32), torch.randint(0, 8, (micro,)))
                with mp.autocast():
                    loss = F.cross_entropy(model(x), y)
                mp.step(loss, optimizer)

    return train


def test_only_the_second_step_is_counted_and_no_measured_step_carries_the_counter(tmp_path):
    counted: list[bool] = []
    data, error = run_in_process(_mlp_trainer(counted), spec(tmp_path, warmup_steps=3, measure_steps=4), profile=CPU)
    assert error is None and data["complete"], data
    assert counted == [False, True, False, False, False, False, False]  # forwards of steps 1..7
    assert not _counting()
    assert data["flops_basis"] == "counted" and data["flops_per_step"] == mlp_flops([32, 64, 8], 16)


def test_every_micro_batch_of_the_step_is_counted(tmp_path):
    counted: list[bool] = []
    accumulating = dataclasses.replace(spec(tmp_path), policy=Policy(mode="fp32", micro_batch_size=4).to_dict())
    data, error = run_in_process(_mlp_trainer(counted), accumulating, profile=CPU)
    assert error is None and data["grad_accum_steps"] == 4, data
    assert counted[:8] == [False] * 4 + [True] * 4
    assert data["flops_per_step"] == mlp_flops([32, 64, 8], 16)


class Bag(nn.Module):
    """An embedding bag: token ids in, no matmul at all (nothing the counter counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.frozen = nn.Parameter(torch.ones(16), requires_grad=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return (self.embed(tokens) * self.frozen).mean(dim=1)


def _bag_trainer(batch: int = 8, context: int = 12):
    def train(mp) -> None:
        torch.manual_seed(0)
        net = Bag()
        model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        while True:
            tokens = mp.to_device(torch.randint(0, 100, (batch, context)))
            mp.step(model(tokens).pow(2).mean(), optimizer)

    return train


def test_token_ids_with_nothing_counted_fall_back_to_six_n_t(tmp_path):
    data, error = run_in_process(_bag_trainer(), spec(tmp_path), profile=CPU)
    assert error is None and data["complete"], data
    assert data["flops_basis"] == "6 x parameters x tokens"
    assert data["flops_per_step"] == 6 * (100 * 16) * (8 * 12)  # the frozen scale is not trained
    assert any("estimated as 6 x parameters x tokens (96 tokens)" in note for note in data["notes"])


def test_a_counter_that_fails_falls_back_and_says_why(tmp_path, monkeypatch):
    def broken():
        raise RuntimeError("no dispatch modes here")

    monkeypatch.setattr(_step_window, "_guarded_flop_counter", broken)
    data, error = run_in_process(_bag_trainer(), spec(tmp_path), profile=CPU)
    assert error is None
    assert data["flops_basis"] == "6 x parameters x tokens"
    assert any("RuntimeError: no dispatch modes here" in note for note in data["notes"])


def test_float_inputs_with_nothing_counted_leave_the_flops_unknown(tmp_path):
    def train(mp) -> None:
        net = nn.Sequential(nn.Tanh())
        scale = nn.Parameter(torch.ones(4))
        optimizer = torch.optim.SGD([scale], lr=0.1)
        mp.setup(net, optimizer)
        while True:
            mp.step((net(torch.randn(8, 4)) * scale).pow(2).mean(), optimizer)

    data, error = run_in_process(train, spec(tmp_path), profile=CPU)
    assert error is None and data["complete"], data
    assert data["flops_per_step"] is None and data["flops_basis"] is None
    assert any("FLOPs per step not known" in note for note in data["notes"])


def test_a_warm_up_too_short_to_hold_the_counted_step_is_not_counted(tmp_path):
    data, error = run_in_process(_mlp_trainer([]), spec(tmp_path, warmup_steps=1), profile=CPU)
    assert error is None and data["flops_per_step"] is None
    assert any("--warmup 2 or more" in note for note in data["notes"])


def test_without_count_flops_nothing_is_counted(tmp_path):
    counted: list[bool] = []
    data, _ = run_in_process(_mlp_trainer(counted), spec(tmp_path, count_flops=False), profile=CPU)
    assert not any(counted) and data["flops_per_step"] is None and data["flops_basis"] is None
    assert not any("FLOPs" in note for note in data["notes"])


# ---- frameworks ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_lightning_trainer_counts_through_its_hooks(tmp_path, isolated_home):
    script = EXAMPLES / "lightning_mlp.py"
    args = ["--width", "256", "--batch-size", "32", "--samples", "512", "--max-steps", "50"]
    result = run_trial(script, args, spec(tmp_path, framework="lightning"), timeout=240,
                       launch=plan_for(script, "lightning").launch)
    assert result.outcome == "ok", result.reason + result.stderr_tail
    assert result.flops_basis == "counted" and result.flops_per_step == mlp_flops([256, 256, 256, 10], 32)
    assert set(CHILD_MARKS) <= set(result.timeline)


@pytest.mark.slow
def test_hf_trainer_counts_through_its_hooks(tmp_path, isolated_home, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    args = ["--width", "128", "--batch", "32", "--max-steps", "100"]
    result = run_trial(SCRIPTS / "hf_wide_mlp.py", args, spec(tmp_path, framework="transformers"), timeout=240,
                       launch=launch_argv("transformers"))
    assert result.outcome == "ok", result.reason + result.stderr_tail
    # features 64, depth 4 (three hidden 128 x 128 layers), 8 classes
    assert result.flops_basis == "counted" and result.flops_per_step == mlp_flops([64, 128, 128, 128, 128, 8], 32)
    assert set(CHILD_MARKS) <= set(result.timeline)


LATE_TRAINER = """
import time

import lightning as L
import torch

time.sleep(4)  # data preparation, say: before the Trainer, so before the candidate is applied
L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
time.sleep(120)  # the Trainer exists, and no step ever comes
"""


@pytest.mark.slow
def test_the_first_step_watchdog_counts_from_the_trainers_construction(tmp_path, isolated_home):
    script = tmp_path / "late_trainer.py"
    script.write_text(LATE_TRAINER)
    result = run_trial(script, [], spec(tmp_path, framework="lightning", first_step_timeout=1.5, count_flops=False),
                       timeout=90, launch=plan_for(script, "lightning").launch)
    # The four seconds before the Trainer did not count: the watchdog fired after it was built.
    assert result.outcome == "no-step", result.reason + result.stderr_tail
    assert "within 1.5 s of the policy's application" in result.reason
    assert "policy_applied" in result.timeline and result.applied


# ---- mpadvise trial's breakdown ------------------------------------------------------------------------


def test_trial_prints_the_breakdown_and_tflops_within_80_columns(tmp_path, isolated_home, cli):
    stream = tmp_path / "trial.jsonl"
    proc = cli("trial", str(EXAMPLES / "mlp.py"), "-m", "bf16-mixed", "--steps", "4", "--warmup", "2",
               "--stream", str(stream), "--", "--samples", "512", "--epochs", "20",
               env={**os.environ, "COLUMNS": "80"}, timeout=600)
    assert proc.returncode in (0, 3), proc.stderr
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "Where each trial's time went" in line)
    heading = lines[start + 1].split()
    assert heading == ["trial", "start-up", "set-up", "1st", "step", "warm-up", "measured", "exit", "TFLOP/s"]
    rows = {line.split()[0] if not line.startswith("fp32 replicate") else "fp32 replicate": line
            for line in lines[start + 2:start + 5]}
    assert set(rows) == {"fp32", "fp32 replicate", "bf16-mixed"}, lines[start:start + 6]
    for label, line in rows.items():
        cells = line[len(label):].split()
        assert len(cells) == 7, line  # one line per trial: nothing wrapped or cut
        assert all(cell == "-" or float(cell) >= 0 for cell in cells), line
        assert float(cells[-1]) > 0, line  # the TFLOP/s, from the reference's counted FLOPs
    assert all(len(line) <= 80 for line in lines[start:start + 5])

    # --json's payload, as the stream's last line carries it: per trial its timeline, phases and FLOPs.
    payload = json.loads(stream.read_text().splitlines()[-1])
    reference = payload["reference"]
    assert reference["flops_basis"] == "counted" and reference["flops_per_step"] == mlp_flops([256, 512, 512, 10], 128)
    assert set(CHILD_MARKS) <= set(reference["timeline"])
    assert list(reference["phases"]) == ["startup", "script_setup", "to_first_step", "warmup", "measured", "exit"]
    assert reference["phases"]["measured"] > 0 and reference["achieved_tflops"] > 0
    candidate = payload["candidates"][0]
    assert candidate["mode"] == "bf16-mixed" and candidate["achieved_tflops"] > 0
    median = statistics.median(candidate["step_times"][2:])  # the measured steps, after 2 of warm-up
    assert candidate["achieved_tflops"] == pytest.approx(reference["flops_per_step"] / median / 1e12, rel=1e-9)
    assert set(CHILD_MARKS) <= set(payload["replicate"]["timeline"])
    trial_lines = [json.loads(line) for line in stream.read_text().splitlines()[:-1]]
    assert all("phases" in line and "flops_per_step" in line for line in trial_lines)
