"""``AppliedPolicy.setup`` and ``fsdp_mixed_precision``: the model moved and converted for the
mode, its optimizer rewired to the converted parameters, and FSDP2's mixed precision."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from advisor._log import get_logger
from advisor.runtime._device import _distributed_wrapper
from advisor.runtime._fsdp import _torch_dtypes, fsdp_precision
from advisor.runtime._match import check_setup
from advisor.runtime._retarget import retarget_optimizer
from advisor.runtime._workload import model_signature
from probes import MpadviseError

if TYPE_CHECKING:
    import torch

    from advisor.runtime._applied import AppliedPolicy


def setup_model(applied: AppliedPolicy, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
    """``AppliedPolicy.setup``'s work: check the workload, move and convert the model."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise MpadviseError(f"setup(model, ...): expected a torch.nn.Module, got {type(model).__name__}")
    wrapper = _distributed_wrapper(model)
    if wrapper is not None:
        # The mode converts the bare model (dtypes, FP8 layers); a wrapper built before that
        # would keep buckets or shards of the old parameters.
        raise MpadviseError(wrapper)
    check_setup(applied, model, optimizer)
    before = dict(model.named_parameters())
    dtypes = {name: parameter.dtype for name, parameter in before.items()}
    model = model.to(applied.device)
    model = applied._mode.convert_module(model)
    after = dict(model.named_parameters())
    applied._converted = applied._converted or model_signature(model) != applied.model_signature or any(
        dtypes.get(name) != parameter.dtype for name, parameter in after.items()
    )
    if optimizer is not None:
        retarget_optimizer(optimizer, before, after, applied.device)
    for note in applied._mode.notes:
        get_logger().info(note)
    first = applied.model is None
    applied.model, applied.optimizer = model, optimizer
    if first and applied._observer is not None:
        applied._observer.after_setup(applied, model)
    return model if optimizer is None else (model, optimizer)


def fsdp_mixed_precision(applied: AppliedPolicy) -> Any:
    """``AppliedPolicy.fsdp_mixed_precision``'s work."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    precision = fsdp_precision(applied.policy)
    applied.fsdp = True
    # FSDP2 now holds the mode's dtypes: the mode can no longer be switched.
    applied._converted = applied._converted or precision.param_dtype is not None
    scaler = getattr(applied._mode, "scaler", None)
    if isinstance(scaler, torch.amp.GradScaler):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        if not isinstance(scaler, ShardedGradScaler):
            sharded = ShardedGradScaler(applied.device.type)
            sharded.load_state_dict(scaler.state_dict())
            applied._mode.scaler = sharded
    return MixedPrecisionPolicy(*_torch_dtypes(precision))
