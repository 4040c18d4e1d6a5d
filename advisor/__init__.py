"""mpadvise: measure, pick and apply the fastest stable precision policy for PyTorch training.

What a training script needs::

    import advisor

    mp = advisor.load_policy()
    model, optimizer = mp.setup(model, optimizer)
    loader = DataLoader(ds, batch_size=mp.micro_batch_size(64))
    for x, y in loader:
        x, y = mp.to_device(x, y)
        with mp.autocast():
            loss = loss_fn(model(x), y)
        mp.step(loss, optimizer)
"""

from __future__ import annotations

from advisor._load import load_policy
from advisor._version import __version__
from advisor.runtime import AppliedPolicy
from advisor.tune import tune
from policies import MODES, Fp8Options, LossScale, Policy, PolicyError
from probes import MpadviseError

__all__ = [
    "MODES",
    "AppliedPolicy",
    "Fp8Options",
    "LossScale",
    "MpadviseError",
    "Policy",
    "PolicyError",
    "__version__",
    "load_policy",
    "tune",
]
