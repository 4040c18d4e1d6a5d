"""The plain-torch adapter's pure parts: the script's precision flag and what to pass for a mode,
the line that says what a script reached, and the diff ``export --to torch`` writes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from advisor.frameworks import PrecisionFlag, flag_advice, policy_diff, precision_flag, script_for
from advisor.frameworks._export import ExportRefused
from advisor.frameworks._torch_export import patched_source
from advisor.frameworks._torch_hooks import Sightings, seen_line

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    ("argv", "source", "expected"),
    [
        (["--dtype=float16"], "", PrecisionFlag("dtype", "float16")),
        (["--batch", "8", "--precision", "bf16"], "", PrecisionFlag("precision", "bf16")),
        (["--mixed-precision=no"], "", PrecisionFlag("mixed_precision", "no")),
        (["--amp"], "", PrecisionFlag("amp", "on")),
        ([], "parser.add_argument('--fp16', action='store_true')\n", PrecisionFlag("fp16", None)),
        ([], "dtype = 'bfloat16' if cuda else 'float32'\n", PrecisionFlag("dtype", None)),
        (["--lr=1e-3"], "import torch\n", None),
        ([], "    dtype = torch.float32\n", None),  # a local variable is no setting
    ],
)
def test_the_scripts_precision_flag_is_read_from_its_arguments_then_its_source(argv, source, expected):
    assert precision_flag(argv, source) == expected


def test_the_advice_names_the_flag_and_the_value_for_the_mode():
    flag = PrecisionFlag("dtype", "float16")
    assert flag_advice(flag, "fp32").endswith("for fp32 pass --dtype=float32")
    assert "--dtype (given float16) was overruled" in flag_advice(flag, "bf16-mixed")
    assert flag_advice(flag, "bf16-mixed").endswith("pass --dtype=bfloat16")
    assert "pure half weights have no flag value" in flag_advice(flag, "bf16-true")
    assert flag_advice(PrecisionFlag("mixed_precision", None), "fp16-mixed").endswith("--mixed_precision=fp16")
    assert flag_advice(PrecisionFlag("amp", "on"), "fp32").endswith("pass no --amp")


def test_the_line_says_what_was_and_was_not_seen():
    assert seen_line(Sightings(), what="x") == (
        "x: it ran no forward of a module, no backward, no optimizer step (no torch.optim optimizer built)")
    seen = Sightings(models=["GPT"], forwards=3, backwards=1, optimizers=1)
    assert seen_line(seen, what="y") == "y: it ran 3 forwards of GPT, 1 backward, no optimizer step"


def test_the_export_diff_applies_the_policy_through_load_policy():
    source = (EXAMPLES / "plain_gpt.py").read_text()
    diff, notes = policy_diff(source, "plain_gpt.py")
    added = [line[1:] for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    removed = [line[1:].strip() for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    assert added[0] == "import advisor"
    assert "mp = advisor.load_policy()" in added and "model, optimizer = mp.setup(model, optimizer)" in added
    assert "        mp.step(loss, optimizer)" in added and "        with mp.autocast():" in added
    assert set(removed) == {"scaler = torch.amp.GradScaler(device_type, enabled=(dtype == \"float16\"))",
                            "with ctx:", "scaler.scale(loss).backward()", "scaler.unscale_(optimizer)",
                            "scaler.step(optimizer)", "scaler.update()", "optimizer.zero_grad(set_to_none=True)"}
    assert any("clipping" in note for note in notes)
    with pytest.raises(ExportRefused, match="builds no torch.optim optimizer"):
        policy_diff((EXAMPLES / "plain_manual.py").read_text(), "plain_manual.py")
    with pytest.raises(ExportRefused, match="does not parse"):
        policy_diff("def broken(:\n", "broken.py")


@pytest.mark.parametrize("example", ["plain_gpt.py", "plain_mlp.py"])
def test_the_patched_script_parses(example):
    new, _ = patched_source((EXAMPLES / example).read_text(), example)
    ast.parse(new)
    block = "import torch\nopt = torch.optim.SGD(model.parameters())\nif amp:\n    scaler.update()\nloss.backward()\n"
    new, _ = patched_source(block.replace("if amp", "scaler = torch.amp.GradScaler()\nif amp"), "t.py")
    ast.parse(new)
    assert "    pass  # scaler.update()" in new


def test_the_script_of_an_export(tmp_path):
    script, config = tmp_path / "train.py", tmp_path / "train.mpadvise.toml"
    assert script_for(script) == script and script_for(config) is None and script_for(None) is None
    script.write_text("import torch\n")
    assert script_for(config) == script and script_for(tmp_path / "other.toml") is None
