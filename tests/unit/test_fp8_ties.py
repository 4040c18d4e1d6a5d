"""Tied parameters (an output head sharing its embedding's weight) through the FP8 conversions.

A conversion that gives a swapped layer its own Parameter breaks the tie: the head stops
sharing the embedding's updates, and the optimizer, matched to the new parameters by name,
drops it. After setup() a tie is still one Parameter, trained once, with its optimizer state.
fp8-torchao runs on this CPU; fp8-te is covered with a fake Transformer Engine in
test_fp8_te_fake.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from advisor import AppliedPolicy, Policy
from advisor.runtime._setup import retarget_optimizer
from policies._fp8 import retie, tied_parameters
from probes import HardwareProfile, MpadviseError

CPU = HardwareProfile(kind="cpu", name="test CPU", cores=2, torch_version=torch.__version__)


class TiedLM(nn.Module):
    """A language model whose output head shares the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.body = nn.Linear(32, 32)
        self.lm_head = nn.Linear(32, 64, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens):
        return self.lm_head(torch.relu(self.body(self.embed(tokens))))


TOKENS = torch.arange(16).reshape(2, 8)


def _loss(model) -> torch.Tensor:
    return F.cross_entropy(model(TOKENS).float().flatten(0, 1), TOKENS.flatten())


@pytest.fixture
def fsdp_float8_all_gather(monkeypatch):
    """Make torchao wrap each converted weight in a new Parameter, as its FSDP all-gather does."""
    import torchao.float8 as float8

    config_type = float8.Float8LinearConfig
    monkeypatch.setattr(
        config_type,
        "from_recipe_name",
        classmethod(lambda cls, name: cls(enable_fsdp_float8_all_gather=True)),
    )


def _train_tied_under_fp8_torchao() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    _loss(model).backward()
    optimizer.step()  # state to carry over, as after a resume
    optimizer.zero_grad()
    tied_state = {k: v.clone() for k, v in optimizer.state[model.embed.weight].items()}

    mp = AppliedPolicy(Policy(mode="fp8-torchao"), profile=CPU, source="test", device="cpu")
    model, optimizer = mp.setup(model, optimizer)

    assert type(model.lm_head).__name__ == "Float8Linear"
    tied = model.lm_head.weight
    assert tied is model.embed.weight
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    assert sum(p is tied for p in trained) == 1
    assert {id(p) for p in trained} == {id(p) for p in model.parameters()}
    for key, value in tied_state.items():
        torch.testing.assert_close(optimizer.state[tied][key], value)
    old = tied.detach().clone()
    with mp.autocast():
        loss = _loss(model)
    assert mp.step(loss, optimizer)
    assert model.lm_head.weight is model.embed.weight
    assert not torch.equal(model.embed.weight.detach(), old)


def test_fp8_torchao_keeps_a_tied_head_tied():
    _train_tied_under_fp8_torchao()


def test_fp8_torchao_reties_a_head_whose_conversion_made_a_new_parameter(fsdp_float8_all_gather):
    _train_tied_under_fp8_torchao()


def test_tied_parameters_names_every_holder():
    model = TiedLM()
    (tie,) = tied_parameters(model)
    assert tie.parameter is model.embed.weight
    assert tie.holders == (("embed", "weight"), ("lm_head", "weight"))
    assert tie.describe() == "embed.weight = lm_head.weight"
    assert tied_parameters(nn.Linear(4, 4)) == []


def test_retie_keeps_the_parameter_the_conversion_made():
    model = TiedLM()
    ties = tied_parameters(model)
    new = nn.Parameter(model.embed.weight.detach().clone())
    model.lm_head.weight = new
    retie(model, ties)
    assert model.embed.weight is new and model.lm_head.weight is new


def test_retie_refuses_a_tie_whose_shape_changed():
    model = TiedLM()
    ties = tied_parameters(model)
    model.lm_head.weight = nn.Parameter(torch.zeros(32, 64))
    with pytest.raises(MpadviseError, match=r"embed\.weight = lm_head\.weight"):
        retie(model, ties)


def test_retarget_refuses_a_tie_split_in_two():
    model = TiedLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = dict(model.named_parameters(remove_duplicate=False))
    model.lm_head.weight = nn.Parameter(model.embed.weight.detach().clone())
    after = dict(model.named_parameters(remove_duplicate=False))
    with pytest.raises(MpadviseError, match="split the parameter 'lm_head.weight'"):
        retarget_optimizer(optimizer, before, after, torch.device("cpu"))


def test_retarget_trains_a_retied_parameter_once_whatever_names_it_is_given():
    model = TiedLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = dict(model.named_parameters(remove_duplicate=False))
    new = nn.Parameter(model.embed.weight.detach().clone())
    model.embed.weight = new
    model.lm_head.weight = new
    retarget_optimizer(optimizer, before, dict(model.named_parameters(remove_duplicate=False)), torch.device("cpu"))
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    assert sum(p is new for p in trained) == 1
    assert {id(p) for p in trained} == {id(p) for p in model.parameters()}
