"""The fp32 and tf32 modes' process-wide TF32 switches: set for a block, restored exactly.

torch >= 2.9 has two APIs for the same switches: the legacy one
(``torch.set_float32_matmul_precision``, ``allow_tf32``) and the per-backend, per-operator
``fp32_precision`` one, whose ``"none"`` means "inherit from the parent". A user may set
either; the modes must run under both and leave each as it was, ``"none"`` included. The
CPU build has every switch (cuDNN's too), so the CUDA semantics are checked here on a
``cuda`` device that never holds a tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from advisor import AppliedPolicy, Policy
from probes import HardwareProfile

CPU = HardwareProfile(kind="cpu", name="test CPU", cores=2, torch_version=torch.__version__)
NEW_API = hasattr(torch.backends, "fp32_precision")
needs_new_api = pytest.mark.skipif(not NEW_API, reason="this torch has only the legacy TF32 API")

# Every (backend, operator) switch of the new API; ("generic", "all") is the root.
SWITCHES = [
    ("generic", "all"),
    ("cuda", "all"),
    ("cuda", "matmul"),
    ("cuda", "conv"),
    ("cuda", "rnn"),
    ("mkldnn", "all"),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
]


def _read(getter: Callable[[], object]) -> object:
    try:
        return getter()
    except RuntimeError:
        return "refused"  # torch refuses to report a mixed legacy/new state


def _state() -> tuple:
    """Everything a user can read of the switches, through both APIs."""
    legacy = (
        _read(torch.get_float32_matmul_precision),
        _read(lambda: torch.backends.cuda.matmul.allow_tf32),
        _read(lambda: torch.backends.cudnn.allow_tf32),
    )
    if not NEW_API:
        return legacy
    return legacy + tuple(torch._C._get_fp32_precision_getter(*key) for key in SWITCHES)


@pytest.fixture(autouse=True)
def default_switches():
    """Start and leave every test with the switches as a fresh process has them."""
    _reset()
    yield
    _reset()


def _reset() -> None:
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True
    if NEW_API:
        for key in SWITCHES:
            if key not in (("cuda", "conv"), ("cuda", "rnn")):
                torch._C._set_fp32_precision_setter(*key, "none")


def applied(mode: str, device: str = "cpu") -> AppliedPolicy:
    return AppliedPolicy(Policy(mode=mode), profile=CPU, source="test", device=device)


def train_one_step(mp: AppliedPolicy) -> None:
    torch.manual_seed(0)
    net = nn.Linear(8, 2)
    model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = mp.to_device(torch.randn(4, 8), torch.tensor([0, 1, 0, 1]))
    with mp.autocast():
        loss = F.cross_entropy(model(x), y)
    mp.step(loss, optimizer)


def _new_api_tf32_on_cuda_matmul() -> None:
    torch.backends.cuda.matmul.fp32_precision = "tf32"


def _new_api_tf32_everywhere() -> None:
    torch.backends.fp32_precision = "tf32"


def _new_api_ieee_everywhere() -> None:
    torch.backends.fp32_precision = "ieee"


def _new_api_bf16_on_cpu() -> None:
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"


def _new_api_tf32_for_cudnn() -> None:
    torch.backends.cudnn.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "none"


NEW_API_STATES = {
    "cuda-matmul-tf32": _new_api_tf32_on_cuda_matmul,
    "generic-tf32": _new_api_tf32_everywhere,
    "generic-ieee": _new_api_ieee_everywhere,
    "mkldnn-matmul-bf16": _new_api_bf16_on_cpu,
    "cudnn-tf32-conv-inherits": _new_api_tf32_for_cudnn,
}


@needs_new_api
@pytest.mark.parametrize("state", sorted(NEW_API_STATES))
@pytest.mark.parametrize("mode", ["fp32", "tf32"])
def test_steps_run_under_the_new_api_and_restore_it(state, mode):
    NEW_API_STATES[state]()
    before = _state()
    mp = applied(mode)
    train_one_step(mp)
    assert _state() == before
    with mp:
        train_one_step(mp)
    assert _state() == before


@needs_new_api
@pytest.mark.parametrize("state", sorted(NEW_API_STATES))
@pytest.mark.parametrize("mode", ["fp32", "tf32"])
def test_cuda_switches_restored_exactly_after_an_error(state, mode):
    NEW_API_STATES[state]()
    before = _state()
    mp = applied(mode, device="cuda")
    with pytest.raises(RuntimeError, match="boom"), mp:
        raise RuntimeError("boom")
    assert _state() == before


@needs_new_api
def test_unset_switches_come_back_unset():
    # "none" inherits: after the block a parent's change must still reach the child.
    mp = applied("fp32", device="cuda")
    with mp:
        pass
    assert torch.backends.cuda.matmul.fp32_precision == "none"
    assert torch.backends.mkldnn.matmul.fp32_precision == "none"
    torch.backends.fp32_precision = "tf32"
    with mp:
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    torch.backends.fp32_precision = "ieee"
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
    torch.backends.cudnn.conv.fp32_precision = "none"
    with mp:
        pass
    torch.backends.cudnn.fp32_precision = "tf32"
    assert torch.backends.cudnn.conv.fp32_precision == "tf32"


@needs_new_api
def test_fp32_on_cuda_turns_tf32_off_where_the_new_api_turned_it_on():
    torch.backends.fp32_precision = "tf32"
    with applied("fp32", device="cuda"):
        for switch in (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn):
            assert switch.fp32_precision == "ieee"
        # Inside, the legacy API agrees, so code that still reads it runs.
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cuda.matmul.allow_tf32 is False
        assert torch.backends.cudnn.allow_tf32 is False
    assert torch.backends.cudnn.conv.fp32_precision == "tf32"


@needs_new_api
def test_tf32_on_cuda_turns_tf32_on_for_matmuls_and_cudnn():
    torch.backends.fp32_precision = "ieee"
    with applied("tf32", device="cuda"):
        for switch in (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn):
            assert switch.fp32_precision == "tf32"
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.backends.cudnn.allow_tf32 is True
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"


@needs_new_api
def test_fp32_on_cpu_turns_reduced_precision_off_and_leaves_cudnn_alone():
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    with applied("fp32"):
        assert torch.backends.cudnn.conv.fp32_precision == "ieee"
        assert torch.backends.cudnn.rnn.fp32_precision == "tf32"
        assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"


@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
@pytest.mark.parametrize("mode", ["fp32", "tf32"])
def test_legacy_precision_restored_exactly(precision, mode):
    # allow_tf32 is a view of the matmul precision: writing it back would turn "medium" into
    # "high".
    torch.set_float32_matmul_precision(precision)
    torch.backends.cudnn.allow_tf32 = False
    before = _state()
    with applied(mode, device="cuda"):
        pass
    assert _state() == before


@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
def test_legacy_api_alone_restored_exactly(monkeypatch, precision):
    from probes import _switches

    monkeypatch.setattr(_switches, "has_fp32_precision_api", lambda torch: False)
    torch.set_float32_matmul_precision(precision)
    before = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    with applied("fp32", device="cuda"):
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cudnn.allow_tf32 is False
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before


def test_nested_blocks_set_nothing_twice():
    mp = applied("fp32", device="cuda")
    with mp:
        inside = _state()
        with mp, applied("fp32", device="cuda"):
            assert _state() == inside
        assert _state() == inside
