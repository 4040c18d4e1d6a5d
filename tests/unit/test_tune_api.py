"""advisor.tune(train_fn): the tuner in this process, on a real tiny training function."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import advisor
from policies import load_config


def train(mp):
    torch.manual_seed(0)
    x = torch.randn(512, 16)
    y = (x @ torch.randn(16, 4)).argmax(1)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model, opt = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=3e-3))
    batch = mp.micro_batch_size(32)
    while True:
        for i in range(0, 512, batch):
            xb, yb = mp.to_device(x[i : i + batch], y[i : i + batch])
            with mp.autocast():
                loss = F.cross_entropy(model(xb).float(), yb)
            mp.step(loss, opt)


def test_in_process_tune_measures_judges_and_writes(tmp_path):
    out = tmp_path / "fn.mpadvise.toml"
    result = advisor.tune(train, modes=["bf16-mixed"], trials=2, steps=32, warmup=2, no_priors=True,
                          remeasure=False, out=out)
    assert result.reference.outcome == "ok" and len(result.reference.result.losses) == 34
    assert result.space.user_batch == 32
    assert result.search.runs == 2
    modes = {c.mode for c in result.search.measured}
    assert modes <= {"fp32", "bf16-mixed"} and "bf16-mixed" in modes
    assert result.policy is not None and result.policy.tuned_on.trials >= 2
    assert load_config(out) == result.policy
