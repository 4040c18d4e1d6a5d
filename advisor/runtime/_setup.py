"""``AppliedPolicy.setup`` and ``fsdp_mixed_precision``: the model moved and converted for the
mode, its optimizer rewired to the converted parameters, and FSDP2's mixed precision."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from advisor._log import get_logger
from advisor.runtime._match import check_setup
from advisor.runtime._retarget import retarget_optimizer
from advisor.runtime._workload import model_signature
from policies import Policy, default_reduce_dtype, mode_class
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


@dataclass(frozen=True)
class FsdpPrecision:
    """FSDP2's ``MixedPrecisionPolicy`` dtypes by name; ``None`` keeps the parameters' own."""

    param_dtype: str | None
    reduce_dtype: str | None
    output_dtype: str | None = None


def fsdp_precision(policy: Policy) -> FsdpPrecision:
    """What FSDP2 should do for ``policy``: 16-bit compute over fp32 shards for the -mixed
    modes; fp32 (or the already cast 16-bit) parameters otherwise; reduction as the policy says.

    Outputs are left as computed: the loss runs in ``autocast()`` in fp32 as in one process,
    and an fp32 ``output_dtype`` would cast each block's output up and the next input down.
    """
    family = mode_class(policy.mode).dtype_family
    reduce = policy.reduce_dtype or default_reduce_dtype(policy.mode)
    if family in ("bf16", "fp16"):
        return FsdpPrecision(param_dtype=family, reduce_dtype=reduce)
    return FsdpPrecision(param_dtype=None, reduce_dtype=None if reduce == "fp32" else reduce)


def _torch_dtypes(precision: FsdpPrecision) -> tuple[Any, Any, Any]:
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    names = (precision.param_dtype, precision.reduce_dtype, precision.output_dtype)
    return tuple(None if name is None else dtypes[name] for name in names)  # type: ignore[return-value]


def fsdp_policy_refusal(model: Any, policy: Policy) -> str | None:
    """One line when a module was sharded with FSDP2 under other dtypes than ``policy``'s,
    which would silently override every candidate (an "fp32" reference computing in bf16)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded
    fsdp_module = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    if fsdp_module is None:
        return None
    wanted = _torch_dtypes(fsdp_precision(policy))
    for name, module in model.named_modules():
        if not isinstance(module, fsdp_module):
            continue
        # FSDP2 keeps the policy fully_shard was given on the module's state (torch 2.6 and
        # later: FSDPState._mp_policy; each FSDPParamGroup holds the same as mp_policy).
        state_of = getattr(module, "_get_fsdp_state", None)
        state = state_of() if callable(state_of) else None
        given = getattr(state, "_mp_policy", None)
        if given is None:
            group = getattr(state, "_fsdp_param_group", None)
            given = getattr(group, "mp_policy", None)
        if given is None:
            continue
        own = (given.param_dtype, given.reduce_dtype, given.output_dtype)
        if own != wanted:
            return (
                f"fully_shard({name or 'model'}) was given mp_policy={_describe_mp(own)}, but the {policy.mode} "
                f"policy needs {_describe_mp(wanted)}, so FSDP2 would train in the script's dtypes instead; "
                "pass mp_policy=mp.fsdp_mixed_precision() to every fully_shard"
            )
    return None


def _describe_mp(dtypes: tuple[Any, Any, Any]) -> str:
    names = ("param_dtype", "reduce_dtype", "output_dtype")
    short = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
    parts = [f"{n}={short.get(str(d), str(d))}" for n, d in zip(names, dtypes) if d is not None]
    return f"MixedPrecisionPolicy({', '.join(parts)})"
