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
    """Point the optimizer at parameters that a conversion replaced, matched by name.

    The optimizer holds each new Parameter once, with the state of the one it replaced, also
    where one Parameter had several names (an output head tied to its embedding).

    Args:
        optimizer: built on the model's parameters before the conversion.
        before: the model's parameters by name before the conversion.
        after: the same after it; a name missing from either is left alone.
        device: where the optimizer state goes with its parameter.

    Raises:
        MpadviseError: a Parameter known by several names became several Parameters: the
            conversion broke a tie, and no single replacement can be trained in its place.
    """
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
    """Make every floating-point parameter, its gradient and its optimizer state fp32, in place.

    The Parameter objects stay the same (their ``data`` is replaced), so the optimizer keeps
    training them; a pure 16-bit run becomes one with fp32 master weights.

    Returns:
        How many parameters were upcast.
    """
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
