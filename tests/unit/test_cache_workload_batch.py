"""The global batch a script asks for is kept: a tuned policy splits it, whatever it is now.

A tuned policy records the global batch it was tuned at (``[tuned_on] global_batch``) and
derives the accumulation from the script's own batch at run time; a hand-written policy with
``grad_accum_steps`` does what it says. A fallback to the safe default after
``micro_batch_size()`` answered keeps the micro-batch it handed out and its accumulation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import advisor
import probes
from advisor.runtime._split import BatchSplit, batch_split, tuned_global_batch
from policies import Policy, TunedOn

FINGERPRINT = "0123456789abcdef"


def _tuned(micro: int | None, accum: int | None, global_batch: int | None, **tuned: object) -> Policy:
    return Policy(
        mode="fp32", micro_batch_size=micro, grad_accum_steps=accum,
        tuned_on=TunedOn(hardware_fingerprint=FINGERPRINT, global_batch=global_batch, **tuned),  # type: ignore[arg-type]
    )


def _applied(policy: Policy) -> advisor.AppliedPolicy:
    return advisor.AppliedPolicy(policy, profile=probes.cpu_profile(), source="test", device="cpu")


def _optimizer_steps(mp: advisor.AppliedPolicy, micro_batches: int) -> int:
    """How many optimizer steps ``micro_batches`` calls of ``step()`` take."""
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(micro_batches):
        mp.step(model(torch.randn(2, 4)).square().mean(), optimizer)
    return mp.optimizer_steps


def test_a_tuned_split_keeps_another_script_batch_with_one_warning(warnings: list[str]) -> None:
    policy = _tuned(16, 4, 64)
    mp = _applied(policy)
    assert mp.micro_batch_size(64) == 16 and (mp.grad_accum_steps, mp.global_batch) == (4, 64)
    assert warnings == []
    mp = _applied(policy)
    assert mp.micro_batch_size(128) == 16 and (mp.grad_accum_steps, mp.global_batch) == (8, 128)
    assert len(warnings) == 1
    assert "batch 128 differs from the global batch 64 the policy was tuned at: keeping the global batch 128" in warnings[0]


def test_a_hand_written_accumulation_is_what_it_states(warnings: list[str], caplog: pytest.LogCaptureFixture) -> None:
    # README, "The config file": micro_batch_size and grad_accum_steps as written.
    mp = _applied(Policy(mode="fp32", micro_batch_size=32, grad_accum_steps=4))
    with caplog.at_level("INFO", logger="mpadvise"):
        assert mp.micro_batch_size(64) == 32
    assert (mp.grad_accum_steps, mp.global_batch) == (4, 128)
    assert warnings == []
    assert "global batch changes from 64 to 128 (policy micro-batch 32 x 4)" in caplog.text
    assert _optimizer_steps(mp, 8) == 2


def test_a_fallback_in_setup_after_micro_batch_size_keeps_the_global_batch(warnings: list[str]) -> None:
    mp = _applied(_tuned(16, 4, 64, model_signature="f" * 16))
    assert mp.micro_batch_size(64) == 16
    model = nn.Linear(4, 1)
    mp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert mp.policy.tuned_on is None  # the safe default: the model is not the tuned one
    assert (mp.grad_accum_steps, mp.global_batch) == (4, 64)
    assert len(warnings) == 1 and "keeping micro-batch 16 x 4 (global batch 64)" in warnings[0]
    assert _optimizer_steps(mp, 8) == 2  # 8 micro-batches of 16: two steps of 64


def test_a_policy_tuned_before_global_batch_was_recorded_keeps_the_script_batch(warnings: list[str]) -> None:
    # micro 32 x 2 was a split of the script's 64 at tuning time.
    policy = _tuned(32, 2, None)
    assert tuned_global_batch(policy) == 64
    mp = _applied(policy)
    assert mp.micro_batch_size(128) == 32 and mp.global_batch == 128
    assert len(warnings) == 1 and "differs from the global batch 64" in warnings[0]


def test_a_scale_batch_winner_changes_the_global_batch_as_tuned(warnings: list[str]) -> None:
    mp = _applied(_tuned(128, 1, 64))
    assert mp.micro_batch_size(64) == 128 and mp.global_batch == 128
    assert warnings == []
    assert tuned_global_batch(_tuned(128, 1, None)) is None  # older record: as stated


@pytest.mark.parametrize(
    ("micro", "tuned_batch", "batch", "split"),
    [
        (None, 64, 64, (64, 1)),
        (None, 64, 96, (96, 1)),
        (16, 64, 64, (16, 4)),
        (16, 64, 96, (16, 6)),
        (16, 64, 100, (10, 10)),  # the largest divisor of 100 that fits the measured 16
        (16, 64, 8, (8, 1)),
        (128, 64, 256, (128, 2)),
    ],
)
def test_batch_split_of_a_tuned_policy(micro: int | None, tuned_batch: int, batch: int, split: tuple[int, int]) -> None:
    result = batch_split(_tuned(micro, None, tuned_batch), batch)
    assert (result.micro, result.accum) == split
    assert result.warning == (batch != tuned_batch)


def test_batch_split_of_a_hand_written_policy_is_unchanged() -> None:
    assert batch_split(Policy(micro_batch_size=16), 64) == BatchSplit(16, 4)
    odd = batch_split(Policy(micro_batch_size=16), 100)
    assert (odd.micro, odd.accum, odd.warning) == (16, 6, True)
    assert (batch_split(Policy(micro_batch_size=128), 64).micro, batch_split(Policy(), 64)) == (128, BatchSplit(64, 1))
