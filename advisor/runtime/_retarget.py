"""Keep an optimizer training a model whose conversion replaced some of its parameters."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def retarget_optimizer(
    optimizer: torch.optim.Optimizer,
    before: dict[str, torch.nn.Parameter],
    after: dict[str, torch.nn.Parameter],
    device: torch.device,
) -> None:
    """Point the optimizer at parameters that a conversion replaced, matched by name."""
    replaced = {id(old): after[name] for name, old in before.items() if name in after and after[name] is not old}
    if not replaced:
        return
    for group in optimizer.param_groups:
        group["params"] = [replaced.get(id(p), p) for p in group["params"]]
    for old_id, new in replaced.items():
        for old in list(optimizer.state):
            if id(old) == old_id:
                state = optimizer.state.pop(old)
                optimizer.state[new] = {
                    k: (v.to(device) if hasattr(v, "to") else v) for k, v in state.items()
                }
