"""Process-wide matmul switches, set for a block and restored exactly afterwards.

torch >= 2.9 keeps the TF32 switches twice: the legacy API (one matmul precision, one cuDNN
flag) and ``fp32_precision`` per backend and operator, where ``"none"`` inherits from
``(backend, "all")``, which inherits from the generic one. Its getters report the value in
effect, so writing back what was read would turn an inherited ``"none"`` into an explicit
value. The legacy setters write the new switches, not the other way round, and the legacy
getters refuse ("mix of the legacy and new APIs") once a new switch holds what they cannot
express: they are read only while the switches they check are neutral. Both APIs are set to
agree inside the block: the kernels read the new ones, some of torch's Python (the inductor
autotuning cache) the legacy ones."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# The new-API switches that the legacy setters write: set_float32_matmul_precision writes
# the matmul ones, cudnn.allow_tf32 the cuDNN ones. They are all that this module changes.
_MATMUL_SWITCHES = (("cuda", "matmul"), ("mkldnn", "matmul"))
_CUDNN_SWITCHES = (("cuda", "conv"), ("cuda", "rnn"))

_Switch = tuple[str, str]


@contextlib.contextmanager
def matmul_switches(*, tf32: bool, cuda: bool) -> Iterator[None]:
    """TF32 on or off for matmuls (and, with ``cuda``, cuDNN convolutions and RNNs) inside the
    block; every switch comes back exactly, an inherited one inheriting again. Where they already
    hold the wanted values nothing is set or restored: this runs twice per training step."""
    import torch

    if not has_fp32_precision_api(torch):
        with _legacy_switches(torch, tf32=tf32, cuda=cuda):
            yield
        return
    switches = _MATMUL_SWITCHES + (_CUDNN_SWITCHES if cuda else ())
    if _already_set(torch, switches, tf32=tf32, cuda=cuda):
        yield
        return
    read = {switch: _get(torch, switch) for switch in switches}
    own = {switch: _own_precision(torch, switch) for switch in switches}
    precision, cudnn_tf32 = _legacy_state(torch, cuda=cuda, own=own)
    try:
        value = "tf32" if tf32 else "ieee"
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        if cuda:
            torch.backends.cudnn.allow_tf32 = tf32
        # cudnn.allow_tf32 = False writes "none", which inherits TF32 where the user turned it
        # on for all of CUDA or everywhere: "TF32 off" has to be stated.
        for switch in switches:
            _set(torch, switch, value)
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        if cudnn_tf32 is not None:
            torch.backends.cudnn.allow_tf32 = cudnn_tf32
        # After the legacy setters, which overwrite these switches.
        _put_back(torch, own)
        # A fresh process reads cuDNN's convolutions and RNNs as "tf32" while their own switches
        # are unset, a default no setter restores: "none" written back would read "none", and
        # torch would then refuse to report cudnn.allow_tf32 at all. Where the value put back
        # does not read as before, the value read before is set.
        for switch, before in read.items():
            if _get(torch, switch) != before:
                _set(torch, switch, before)


def has_fp32_precision_api(torch: Any) -> bool:
    return hasattr(torch.backends, "fp32_precision")


@contextlib.contextmanager
def _legacy_switches(torch: Any, *, tf32: bool, cuda: bool) -> Iterator[None]:
    precision = "high" if tf32 else "highest"
    saved_precision = torch.get_float32_matmul_precision()
    cudnn = torch.backends.cudnn
    if saved_precision == precision and (not cuda or cudnn.allow_tf32 == tf32):
        yield
        return
    saved_cudnn = cudnn.allow_tf32
    try:
        # matmul.allow_tf32 is a view of the matmul precision ("highest" or not): setting
        # the precision sets it, and writing it back would turn "medium" into "high".
        torch.set_float32_matmul_precision(precision)
        if cuda:
            cudnn.allow_tf32 = tf32
        yield
    finally:
        torch.set_float32_matmul_precision(saved_precision)
        cudnn.allow_tf32 = saved_cudnn


def _get(torch: Any, switch: _Switch) -> str:
    # What torch.backends.<backend>.<op>.fp32_precision reads: the value in effect, inherited
    # where the switch itself is "none". The attributes do not reach every switch (the
    # setter of torch.backends.mkldnn.fp32_precision writes the generic one).
    return torch._C._get_fp32_precision_getter(*switch)


def _set(torch: Any, switch: _Switch, value: str) -> None:
    torch._C._set_fp32_precision_setter(*switch, value)


def _put_back(torch: Any, own: dict[_Switch, str]) -> None:
    for switch, value in own.items():
        _set(torch, switch, value)


def _own_precision(torch: Any, switch: _Switch) -> str:
    """The value set on ``switch`` itself, ``"none"`` where it inherits: torch reports the value
    in effect, so the parent is changed for a moment to see whether the switch follows it."""
    backend, op = switch
    value = _get(torch, switch)
    if backend == "generic" or value == "none":
        return value
    parent = ("generic", "all") if op == "all" else (backend, "all")
    parent_own = _own_precision(torch, parent)
    probe = "tf32" if value == "ieee" else "ieee"
    _set(torch, parent, probe)
    try:
        inherits = _get(torch, switch) == probe
    finally:
        _set(torch, parent, parent_own)
    return "none" if inherits else value


def _legacy_state(torch: Any, *, cuda: bool, own: dict[_Switch, str]) -> tuple[str, bool | None]:
    """The legacy matmul precision and (on CUDA) cuDNN flag, read exactly; ``own`` is put back.

    The matmul getter always answers with both matmul switches at "ieee"; the cuDNN getter,
    with both cuDNN switches at "tf32", answers exactly when its flag is on."""
    try:
        _put_back(torch, dict.fromkeys(_MATMUL_SWITCHES, "ieee"))
        precision = torch.get_float32_matmul_precision()
        if not cuda:
            return precision, None
        _put_back(torch, dict.fromkeys(_CUDNN_SWITCHES, "tf32"))
        with contextlib.suppress(RuntimeError):
            return precision, bool(torch.backends.cudnn.allow_tf32)
        return precision, False
    finally:
        _put_back(torch, own)


def _already_set(torch: Any, switches: tuple[_Switch, ...], *, tf32: bool, cuda: bool) -> bool:
    # "none" in effect means no switch asks for reduced precision: IEEE fp32.
    wanted = {"tf32"} if tf32 else {"ieee", "none"}
    with contextlib.suppress(RuntimeError):
        return (all(_get(torch, switch) in wanted for switch in switches)
                and torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
                and (not cuda or torch.backends.cudnn.allow_tf32 == tf32))
    return False
