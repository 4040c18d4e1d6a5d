"""``AppliedPolicy.setup`` and ``fsdp_mixed_precision``: the model moved and converted for the
mode, its optimizer rewired to the converted parameters, and FSDP2's mixed precision."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from advisor._log import get_logger
from advisor.runtime._match import check_setup
from advisor.runtime._workload import model_signature
from policies import Policy, default_reduce_dtype, mode_class
from probes import MpadviseError

if TYPE_CHECKING:
    import torch

    from advisor.runtime._applied import AppliedPolicy

_SHARD_FIX = ("call mp.setup(model) on the bare model first, then fully_shard it with "
              "mp_policy=mp.fsdp_mixed_precision(), then build the optimizer on the sharded "
              "parameters")


def setup_model(applied: AppliedPolicy, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
    """``AppliedPolicy.setup``'s work: check the workload, move and convert the model."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise MpadviseError(f"setup(model, ...): expected a torch.nn.Module, got {type(model).__name__}")
    # The mode converts the bare model (dtypes, FP8 layers); a wrapper built before that would
    # keep buckets or shards of the old parameters.
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise MpadviseError("setup(model): the model is already wrapped in DistributedDataParallel; "
                            "call mp.setup(model, optimizer) on the bare model first, then wrap the "
                            "model it returns")
    # Not imported: nothing can be sharded yet.
    fsdp_module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", ())
    for name, module in model.named_modules():
        if isinstance(module, fsdp_module):
            where = f"its module {name!r} is" if name else "the model is"
            raise MpadviseError(f"setup(model): {where} already sharded with fully_shard; {_SHARD_FIX}")
    check_setup(applied, model, optimizer)
    before = dict(model.named_parameters())
    dtypes = {name: parameter.dtype for name, parameter in before.items()}
    model = applied._mode.convert_module(model.to(applied.device))
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


def retarget_optimizer(optimizer: torch.optim.Optimizer, before: dict[str, torch.nn.Parameter],
                       after: dict[str, torch.nn.Parameter], device: torch.device) -> None:
    """Point the optimizer at parameters that a conversion replaced (matched by name), each
    once, with the state of the one it replaced; an MpadviseError where it split a tied one."""
    targets: dict[int, torch.nn.Parameter] = {}
    for name, old in before.items():
        new = after.get(name)
        if new is not None and targets.setdefault(id(old), new) is not new:
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
        params = (replaced.get(id(p), p) for p in group["params"])
        unique = {id(p): p for p in params if id(p) not in seen}
        seen.update(unique)
        group["params"] = list(unique.values())
    for old in list(optimizer.state):
        new = replaced.get(id(old))
        if new is not None:
            state = optimizer.state.pop(old)
            optimizer.state[new] = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in state.items()}


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


@dataclass(frozen=True)
class FsdpPrecision:
    """FSDP2's ``MixedPrecisionPolicy`` dtypes by name; ``None`` keeps the parameters' own."""

    param_dtype: str | None
    reduce_dtype: str | None
    output_dtype: str | None = None


def fsdp_precision(policy: Policy) -> FsdpPrecision:
    """What FSDP2 should do for ``policy``: 16-bit compute over fp32 shards for the -mixed
    modes; fp32 (or the already cast 16-bit) parameters otherwise; reduction as the policy says.
    Outputs are left as computed: an fp32 ``output_dtype`` would cast each block's output up and
    the next input down, and the loss runs in ``autocast()`` in fp32 as in one process."""
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
    # Not imported: nothing is sharded.
    fsdp_module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
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
        group = getattr(state, "_fsdp_param_group", None)
        given = getattr(state, "_mp_policy", None) or getattr(group, "mp_policy", None)
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
