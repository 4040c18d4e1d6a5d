"""fp8-te logic through a fake ``transformer_engine`` at the import boundary (real TE needs CUDA;
its real tests are in tests/gpu/)."""

from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fakes import DelayedScaling, Format

from advisor.runtime._setup import retarget_optimizer
from policies import Fp8Options, Policy
from probes import MpadviseError

CUDA = torch.device("cuda")  # never used for tensors: the fake modules stay on the CPU


@pytest.fixture
def fake_te(monkeypatch):
    """Install a fake transformer_engine with the pieces mpadvise uses; return a call log."""
    log: dict[str, list] = {"autocast": [], "fp8_autocast": [], "linear": [], "layernorm": [], "events": []}

    @dataclass
    class Float8CurrentScaling:
        fp8_format: Format = Format.HYBRID

    class MXFP8BlockScaling:
        pass

    class Float8BlockScaling:
        pass

    class Linear(nn.Linear):
        def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None):
            super().__init__(in_features, out_features, bias=bias, dtype=params_dtype)
            log["linear"].append((in_features, out_features, bias, str(device)))

    class LayerNorm(nn.LayerNorm):
        def __init__(self, hidden_size, eps=1e-5, params_dtype=None, device=None):
            super().__init__(hidden_size, eps=eps, dtype=params_dtype)
            log["layernorm"].append((hidden_size, eps))

    class autocast:  # noqa: N801 - TE's name
        """A class with __enter__, as TE's is (pytorch/quantization.py from 2.9)."""

        __slots__ = ("enabled", "recipe")

        def __init__(self, enabled=True, recipe=None):
            self.enabled, self.recipe = enabled, recipe

        def __enter__(self):
            # check_recipe_support (TE 2.15 and newer) refuses DelayedScaling in compiled code.
            if self.enabled and torch.compiler.is_compiling() and isinstance(self.recipe, DelayedScaling):
                raise RuntimeError(
                    "DelayedScaling is not supported under torch.compile. Please use other recipes instead."
                )
            log["autocast"].append((self.enabled, self.recipe))
            log["events"].append("enter te.autocast")
            return self

        def __exit__(self, *exc_info):
            log["events"].append("exit te.autocast")

    @contextlib.contextmanager
    def fp8_autocast(enabled=True, fp8_recipe=None):
        log["fp8_autocast"].append((enabled, fp8_recipe))
        log["events"].append("enter te.fp8_autocast")
        try:
            yield
        finally:
            log["events"].append("exit te.fp8_autocast")

    root = types.ModuleType("transformer_engine")
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.Linear, pytorch.LayerNorm, pytorch.autocast, pytorch.fp8_autocast = Linear, LayerNorm, autocast, fp8_autocast
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    for cls in (Format, DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling):
        setattr(recipe, cls.__name__, cls)
    root.pytorch, root.common, common.recipe = pytorch, common, recipe
    for name, mod in {
        "transformer_engine": root,
        "transformer_engine.pytorch": pytorch,
        "transformer_engine.common": common,
        "transformer_engine.common.recipe": recipe,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)
    log["module"] = pytorch
    log["recipe"] = recipe
    return log


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32, bias=False)
        self.head = nn.Linear(32, 3)  # 3 is not a multiple of 16: stays nn.Linear

    def forward(self, x):
        return self.head(self.down(torch.relu(self.up(self.norm(x)))))


def make_mode(fp8: Fp8Options | None = None):
    from policies.fp8_te import Fp8Te

    return Fp8Te(Policy(mode="fp8-te", fp8=fp8), CUDA)


def test_swaps_linear_where_shapes_allow(fake_te):
    torch.manual_seed(0)
    model = Block()
    reference = Block()
    reference.load_state_dict(model.state_dict())
    mode = make_mode()
    converted = mode.convert_module(model)
    te = fake_te["module"]
    assert isinstance(converted.up, te.Linear) and isinstance(converted.down, te.Linear)
    assert type(converted.head) is nn.Linear
    assert mode.converted == ["up", "down"]
    assert any("head (32->3)" in note for note in mode.notes)
    assert fake_te["linear"] == [(32, 64, True, "cuda"), (64, 32, False, "cuda")]
    x = torch.randn(4, 32)
    torch.testing.assert_close(converted(x), reference(x))  # weights were copied


@pytest.mark.parametrize("bias", [True, False])
def test_layernorms_stay_torch_layernorms(fake_te, bias):
    # A TE LayerNorm alone brings no FP8: its output is high precision unless TE fuses it into
    # the next op (LayerNormLinear, LayerNormMLP, te.ops.Sequential). It always has a bias, and
    # computes in the autocast dtype, where torch's layer_norm runs in fp32 under autocast.
    model = nn.Sequential(nn.LayerNorm(32, bias=bias), nn.Linear(32, 32))
    names = [name for name, _ in model.named_parameters()]
    mode = make_mode()
    converted = mode.convert_module(model)
    assert type(converted[0]) is nn.LayerNorm
    assert [name for name, _ in converted.named_parameters()] == names
    assert fake_te["layernorm"] == []
    assert mode.converted == ["1"]


def test_optimizer_trains_the_swapped_parameters(fake_te):
    model = Block()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = dict(model.named_parameters())
    converted = make_mode().convert_module(model)
    after = dict(converted.named_parameters())
    retarget_optimizer(optimizer, before, after, torch.device("cpu"))
    trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert trained == {id(p) for p in converted.parameters()}
    old_up = converted.up.weight.detach().clone()
    converted(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    assert not torch.equal(converted.up.weight, old_up)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (None, ("DelayedScaling", "HYBRID", 1024, 0)),
        (Fp8Options(recipe="delayed", fp8_format="e4m3", amax_history_len=16, margin=1), ("DelayedScaling", "E4M3", 16, 1)),
        (Fp8Options(recipe="current"), ("Float8CurrentScaling", "HYBRID", None, None)),
        (Fp8Options(recipe="mxfp8"), ("MXFP8BlockScaling", None, None, None)),
        (Fp8Options(recipe="block"), ("Float8BlockScaling", None, None, None)),
    ],
)
def test_recipe_comes_from_the_policy(fake_te, options, expected):
    recipe = make_mode(options).recipe
    fmt = getattr(recipe, "fp8_format", None)
    got = (
        type(recipe).__name__,
        fmt.name if fmt is not None else None,
        getattr(recipe, "amax_history_len", None),
        getattr(recipe, "margin", None),
    )
    assert got == expected


def test_forward_runs_under_te_autocast_with_the_recipe(fake_te):
    mode = make_mode()
    with mode.forward_context():
        pass
    assert fake_te["autocast"] == [(True, mode.recipe)]
    assert fake_te["fp8_autocast"] == []


def test_older_te_falls_back_to_fp8_autocast(fake_te, monkeypatch):
    monkeypatch.delattr(fake_te["module"], "autocast")
    mode = make_mode()
    with mode.forward_context():
        pass
    assert fake_te["fp8_autocast"] == [(True, mode.recipe)]


@pytest.fixture
def torch_autocast_log(fake_te, monkeypatch):
    """Record torch.autocast calls in the fake TE's event log (CUDA autocast is off on a CPU build)."""
    calls = []

    @contextlib.contextmanager
    def autocast(device_type, dtype=None, enabled=True, cache_enabled=None):
        calls.append((device_type, dtype, enabled))
        fake_te["events"].append("enter torch.autocast")
        try:
            yield
        finally:
            fake_te["events"].append("exit torch.autocast")

    monkeypatch.setattr(torch, "autocast", autocast)
    return calls


@pytest.mark.parametrize("te_name", ["autocast", "fp8_autocast"])
def test_forward_runs_te_autocast_inside_bf16_autocast(fake_te, torch_autocast_log, monkeypatch, te_name):
    # Outside TE's modules (attention, activations, the loss) the forward runs in bf16, as
    # under fp8-torchao, not in fp32.
    if te_name == "fp8_autocast":
        monkeypatch.delattr(fake_te["module"], "autocast")
    with pytest.raises(RuntimeError, match="boom"), make_mode().forward_context():
        raise RuntimeError("boom")
    assert torch_autocast_log == [("cuda", torch.bfloat16, True)]
    assert fake_te["events"] == [
        "enter torch.autocast",
        f"enter te.{te_name}",
        f"exit te.{te_name}",
        "exit torch.autocast",
    ]


class TiedLM(nn.Module):
    """A language model whose output head shares the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.norm = nn.LayerNorm(32)
        self.lm_head = nn.Linear(32, 64, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens):
        return self.lm_head(self.norm(self.embed(tokens)))


def _adam_step(model, optimizer) -> None:
    tokens = torch.arange(8).reshape(2, 4)
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_swap_keeps_a_tied_head_tied_and_in_the_optimizer_once(fake_te):
    torch.manual_seed(0)
    model = TiedLM()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    _adam_step(model, optimizer)  # state to carry over, as after a resume
    tied_state = {k: v.clone() for k, v in optimizer.state[model.embed.weight].items()}
    # What AppliedPolicy.setup does around the conversion.
    before = dict(model.named_parameters())
    converted = make_mode().convert_module(model)
    retarget_optimizer(optimizer, before, dict(converted.named_parameters()), torch.device("cpu"))

    assert isinstance(converted.lm_head, fake_te["module"].Linear)
    tied = converted.lm_head.weight
    assert tied is converted.embed.weight
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    assert sum(p is tied for p in trained) == 1
    assert {id(p) for p in trained} == {id(p) for p in converted.parameters()}
    for key, value in tied_state.items():
        torch.testing.assert_close(optimizer.state[tied][key], value)
    old = tied.detach().clone()
    _adam_step(converted, optimizer)
    assert converted.lm_head.weight is converted.embed.weight
    assert not torch.equal(tied, old)


def test_a_module_used_twice_is_swapped_once(fake_te):
    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    converted = make_mode().convert_module(model)
    assert isinstance(converted[0], fake_te["module"].Linear)
    assert converted[0] is converted[2]
    assert len(fake_te["linear"]) == 1


def test_state_dict_checks_recipe_on_resume(fake_te):
    mode = make_mode()
    state = mode.state_dict()
    make_mode().load_state_dict(state)
    with pytest.raises(MpadviseError, match="resume with the same policy"):
        make_mode(Fp8Options(recipe="current")).load_state_dict(state)


def test_missing_transformer_engine_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    with pytest.raises(MpadviseError, match=r'pip install "mpadvise\[fp8\]"'):
        make_mode()


def test_fp8_te_refuses_a_cpu_device(fake_te):
    from policies.fp8_te import Fp8Te

    with pytest.raises(MpadviseError, match="needs a CUDA device"):
        Fp8Te(Policy(mode="fp8-te"), torch.device("cpu"))


# --- recipe shapes and token counts ----------------------------------------------------------


class Wide(nn.Module):
    """Features that are multiples of 16 but not all of 32: MXFP8 keeps the 48-wide layer."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.mid = nn.Linear(64, 48)
        self.down = nn.Linear(48, 32)

    def forward(self, x):
        return self.down(self.mid(self.up(x)))


def test_mxfp8_keeps_layers_whose_features_are_not_multiples_of_32(fake_te):
    te_linear = fake_te["module"].Linear
    delayed = make_mode().convert_module(Wide())
    assert all(isinstance(layer, te_linear) for layer in (delayed.up, delayed.mid, delayed.down))
    mode = make_mode(Fp8Options(recipe="mxfp8"))
    mxfp8 = mode.convert_module(Wide())
    assert isinstance(mxfp8.up, te_linear)
    assert type(mxfp8.mid) is nn.Linear and type(mxfp8.down) is nn.Linear
    assert any("not divisible by 32): mid (64->48), down (48->32)" in note for note in mode.notes)


@pytest.mark.parametrize(("recipe", "multiple"), [(None, 8), ("current", 8), ("block", 8), ("mxfp8", 32)])
def test_a_ragged_token_count_is_refused_with_the_shape_and_the_fix(fake_te, torch_autocast_log, recipe, multiple):
    mode = make_mode(Fp8Options(recipe=recipe) if recipe else None)
    model = mode.convert_module(Block())
    with mode.forward_context():
        model(torch.randn(2, multiple, 32))  # whole multiples run
        with pytest.raises(MpadviseError) as caught:
            model(torch.randn(3, 5, 32))
    message = str(caught.value)
    assert "layer norm" not in message and "layer up got an input of shape (3, 5, 32), 15 tokens" in message
    assert f"only on a multiple of {multiple} tokens" in message
    assert "drop_last=True" in message


def test_the_token_check_is_off_outside_the_fp8_context(fake_te, torch_autocast_log):
    mode = make_mode()
    model = mode.convert_module(Block())
    assert model(torch.randn(5, 32)).shape == (5, 3)  # TE runs high precision there, any shape
    with pytest.raises(RuntimeError, match="boom"), mode.forward_context():
        raise RuntimeError("boom")
    assert model(torch.randn(5, 32)).shape == (5, 3)  # and the window closed after an error


def test_a_recipe_this_te_lacks_names_the_version_it_needs(fake_te, monkeypatch):
    monkeypatch.delattr(fake_te["recipe"], "Float8BlockScaling")
    with pytest.raises(MpadviseError, match=r"'block' needs transformer-engine 2\.3 or newer.*upgrade it"):
        make_mode(Fp8Options(recipe="block"))


# --- Linears whose forward never runs --------------------------------------------------------


class Attention(nn.Module):
    """nn.MultiheadAttention, whose out_proj is a Linear it never calls, then a Linear that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        return self.proj(self.attn(x, x, x, need_weights=False)[0])


def _torchao_mode():
    pytest.importorskip("torchao.float8", reason="fp8-torchao needs torchao")
    from policies.fp8_torchao import Fp8Torchao

    return Fp8Torchao(Policy(mode="fp8-torchao"), torch.device("cpu"))


def test_both_fp8_modes_keep_the_attention_out_proj_and_say_why(fake_te):
    # MultiheadAttention passes out_proj.weight to F.multi_head_attention_forward and never
    # calls out_proj.forward: a Float8Linear there would count as FP8 and run none.
    kept_note = "attn.out_proj (32->32)"
    te_mode, torchao_mode = make_mode(), _torchao_mode()
    te_model = te_mode.convert_module(Attention())
    torchao_model = torchao_mode.convert_module(Attention())
    assert type(te_model.attn.out_proj) is type(torchao_model.attn.out_proj) is type(Attention().attn.out_proj)
    assert isinstance(te_model.proj, fake_te["module"].Linear)
    assert type(torchao_model.proj).__name__ == "Float8Linear"
    assert te_mode.converted == torchao_mode.converted == ["proj"]
    for mode in (te_mode, torchao_mode):
        (note,) = [note for note in mode.notes if kept_note in note]
        assert "MultiheadAttention" in note and "never calls its forward" in note
    assert torchao_model(torch.randn(2, 8, 32)).shape == (2, 8, 32)


def test_a_plain_linear_put_in_as_out_proj_is_kept_too(fake_te):
    for mode in (make_mode(), _torchao_mode()):
        model = Attention()
        model.attn.out_proj = nn.Linear(32, 32)  # MHA still never calls it
        converted = mode.convert_module(model)
        assert type(converted.attn.out_proj) is nn.Linear
        assert mode.converted == ["proj"]
        assert any("attn.out_proj (32->32)" in note for note in mode.notes)


def test_the_torchao_filter_alone_keeps_the_attention_out_proj():
    # Accelerate converts with the mode's module_filter_fn and no convert_module call.
    mode = _torchao_mode()
    model = Attention()
    assert not mode.module_filter(model.attn.out_proj, "attn.out_proj")
    assert mode.module_filter(model.proj, "proj")
    mode.note_conversion()
    assert any("MultiheadAttention" in note and "attn.out_proj (32->32)" in note for note in mode.notes)


# --- torch.compile ---------------------------------------------------------------------------


@pytest.fixture
def compiling(monkeypatch):
    """Run as if torch.compile were tracing the forward context (what TE checks)."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)


def test_under_torch_compile_the_default_recipe_becomes_current(fake_te, torch_autocast_log, compiling):
    # TE refuses DelayedScaling inside a compiled region; the user did not ask for it.
    mode = make_mode(Fp8Options(fp8_format="e4m3"))
    with mode.forward_context():
        pass
    ((enabled, recipe),) = fake_te["autocast"]
    assert type(recipe).__name__ == "Float8CurrentScaling" and recipe.fp8_format is Format.E4M3
    assert any("torch.compile" in note and "current" in note for note in mode.notes)
    with mode.forward_context():
        pass
    assert sum("torch.compile" in note for note in mode.notes) == 1


def test_the_default_recipe_stays_delayed_outside_torch_compile(fake_te, torch_autocast_log):
    # A compiled model with mp.autocast() entered outside it: TE enters its autocast eagerly.
    mode = make_mode()
    with mode.forward_context():
        pass
    assert type(fake_te["autocast"][0][1]) is DelayedScaling
    assert mode.state_dict() == {"fp8_recipe": "DelayedScaling"}


def test_delayed_named_under_torch_compile_says_which_recipe_to_use(fake_te, torch_autocast_log, compiling):
    mode = make_mode(Fp8Options(recipe="delayed"))
    with mode.forward_context():
        loss = torch.ones((), requires_grad=True) * 2
    with pytest.raises(MpadviseError) as caught:
        mode.backward(loss)
    message = str(caught.value)
    assert "torch.compile" in message and 'recipe = "current"' in message


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [None, "delayed"])
def test_a_compiled_training_step_that_enters_the_forward_context_runs(fake_te, torch_autocast_log, recipe):
    # Real Dynamo over the fake TE: before, TE's refusal inside the traced with-block crashed
    # the compiled step (an AssertionError from Dynamo, not even TE's message).
    mode = make_mode(Fp8Options(recipe=recipe) if recipe else None)
    model = nn.Linear(32, 32)

    @torch.compile(backend="eager")
    def forward(x):
        with mode.forward_context():
            return model(x)

    loss = forward(torch.randn(8, 32)).sum()
    if recipe is None:
        assert any("the current recipe" in note for note in mode.notes)
        mode.backward(loss)
    else:
        with pytest.raises(MpadviseError, match='torch.compile.*set recipe = "current"'):
            mode.backward(loss)
