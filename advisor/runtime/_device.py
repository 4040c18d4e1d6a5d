"""Where this process trains, whether the model it was given can still be converted, and
moving a batch there."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def rank_device(device: str | torch.device | None, profile_device: str, env: Mapping[str, str]) -> str | torch.device:
    """``device`` when named with an index (or not CUDA); under torchrun on a GPU
    ``cuda:LOCAL_RANK``, so each process of a node takes its own GPU; else ``profile_device``."""
    if device is not None and str(device) != "cuda":
        return device
    chosen = device if device is not None else profile_device
    local_rank = env.get("LOCAL_RANK", "")
    if str(chosen).startswith("cuda") and local_rank.isdigit():
        return f"cuda:{int(local_rank)}"
    return chosen


def _distributed_wrapper(model: Any) -> str | None:
    """Why ``setup()`` cannot take an already wrapped ``model``; ``None`` for a bare one."""
    import torch

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return ("setup(model): the model is already wrapped in DistributedDataParallel; call "
                "mp.setup(model, optimizer) on the bare model first, then wrap the model it returns")
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing can be sharded yet
    fix = ("call mp.setup(model) on the bare model first, then fully_shard it with "
           "mp_policy=mp.fsdp_mixed_precision(), then build the optimizer on the sharded parameters")
    if fsdp is not None and isinstance(model, getattr(fsdp, "FSDPModule", ())):
        return f"setup(model): the model is already sharded with fully_shard; {fix}"
    if fsdp is not None:
        for name, module in model.named_modules():
            if name and isinstance(module, getattr(fsdp, "FSDPModule", ())):
                return f"setup(model): its module {name!r} is already sharded with fully_shard; {fix}"
    return None


def move_to(value: Any, device: torch.device, convert: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` (a tensor, or lists/tuples/dicts of them) on ``device``, through ``convert``."""
    import torch

    if isinstance(value, torch.Tensor):
        return convert(value.to(device, non_blocking=True))
    if isinstance(value, (list, tuple)):
        return type(value)(move_to(v, device, convert) for v in value)
    if isinstance(value, dict):
        return {k: move_to(v, device, convert) for k, v in value.items()}
    return value
