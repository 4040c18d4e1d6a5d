"""``micro_batch_size()`` called for a training and an evaluation loader: the first call sets the
training batch, which the policy splits; a later call with another batch gets it back unchanged."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from fakes import Net

import advisor
import probes
from advisor.runtime import AppliedPolicy
from advisor.tune._run import FunctionRunner, TrialSettings
from policies import Policy, TunedOn

TRAIN, EVAL = 64, 256


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def info_lines():
    logger = logging.getLogger("mpadvise")
    handler = _Lines()
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


def test_the_first_call_sets_the_training_batch(info_lines: list[str]) -> None:
    mp = advisor.load_policy(Policy(mode="fp32", micro_batch_size=16), device="cpu")
    assert mp.micro_batch_size(TRAIN) == 16
    assert mp.micro_batch_size(EVAL) == EVAL  # an evaluation loader is not split
    assert mp.micro_batch_size(EVAL) == EVAL
    assert mp.micro_batch_size(TRAIN) == 16
    assert (mp.user_batch, mp.grad_accum_steps, mp.global_batch) == (TRAIN, 4, TRAIN)
    mentions = [line for line in info_lines if f"micro_batch_size({EVAL})" in line]
    assert len(mentions) == 1 and "training batch" in mentions[0]


def test_a_tuned_answer_is_not_judged_on_the_evaluation_batch(warnings: list[str]) -> None:
    profile = probes.profile_for("cpu")
    tuned = Policy(mode="bf16-mixed", micro_batch_size=16, grad_accum_steps=4, tuned_on=TunedOn(
        hardware_fingerprint=probes.hardware_fingerprint(profile), torch=profile.torch_version or "",
        workload_fingerprint="0123456789abcdef", global_batch=TRAIN,
    ))
    mp = AppliedPolicy(tuned, profile=profile, source="cache entry #1", device="cpu", match_workload=True)
    assert mp.micro_batch_size(TRAIN) == 16
    assert mp.micro_batch_size(EVAL) == EVAL
    assert mp.mode == "bf16-mixed" and mp.grad_accum_steps == 4 and warnings == []


def _train_and_evaluate(mp) -> None:
    torch.manual_seed(0)
    model = Net()
    model, optimizer = mp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(1024, 16), torch.randint(0, 4, (1024,))
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=mp.micro_batch_size(TRAIN))
    evaluation = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=mp.micro_batch_size(EVAL))
    assert len(evaluation) == 1024 // EVAL
    while True:
        for xb, yb in train:
            xb, yb = mp.to_device(xb, yb)
            with mp.autocast():
                loss = F.cross_entropy(model(xb), yb)
            mp.step(loss, optimizer)


def test_a_trial_records_the_training_batch() -> None:
    settings = TrialSettings(warmup_steps=1, measure_steps=4, device="cpu")
    result = FunctionRunner(_train_and_evaluate, settings)(Policy(mode="fp32", micro_batch_size=16), "split")
    assert result.outcome == "ok", (result.reason, result.stderr_tail)
    assert (result.user_batch, result.grad_accum_steps, result.global_batch) == (TRAIN, 4, TRAIN)
    assert set(result.samples) == {TRAIN}
