"""Keep an optimizer training a model whose conversion replaced some of its parameters."""

from __future__ import annotations

from typing import TYPE_CHECKING

from probes import MpadviseError

if TYPE_CHECKING:
    import torch


def retarget_optimizer(
    optimizer: torch.optim.Optimizer,
    before: dict[str, torch.nn.Parameter],
    after: dict[str, torch.nn.Parameter],
    device: torch.device,
) -> None:
    """Point the optimizer at parameters that a conversion replaced (matched by name), each
    once, with the state of the one it replaced; an MpadviseError where it split a tied one."""
    targets: dict[int, torch.nn.Parameter] = {}
    for name, old in before.items():
        new = after.get(name)
        if new is None:
            continue
        earlier = targets.setdefault(id(old), new)
        if earlier is not new:
            raise MpadviseError(
                f"setup(): the conversion split the parameter {name!r}, which the model shares "
                "between modules, into separate parameters; untie them before setup(), or use bf16-mixed"
            )
    replaced = {key: new for key, new in targets.items() if id(new) != key}
    if not replaced:
        return
    # Once each: two replaced Parameters that became one (a tie) must not be stepped twice.
    seen: set[int] = set()
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            new = replaced.get(id(p), p)
            if id(new) not in seen:
                seen.add(id(new))
                params.append(new)
        group["params"] = params
    for old in list(optimizer.state):
        new = replaced.get(id(old))
        if new is not None:
            state = optimizer.state.pop(old)
            optimizer.state[new] = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in state.items()}


def upcast_in_place(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Make every parameter and its optimizer state fp32 in place (the same Parameter objects)."""
    import torch

    count = 0
    for parameter in model.parameters():
        if parameter.is_floating_point() and parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()
            parameter.grad = None
            count += 1
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                    state[key] = value.float()
    return count
