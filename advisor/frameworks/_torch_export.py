"""``mpadvise export --to torch``: a unified diff that makes a plain PyTorch script apply its
policy through ``advisor.load_policy()``, from the script's syntax tree (no line of it runs).
"""

from __future__ import annotations

import ast
import difflib
from pathlib import Path

from advisor.frameworks._export import Export, Exporter, ExportRefused, _Job

_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "LBFGS",
               "configure_optimizers")
_GONE_CALLS = ("step", "update", "unscale_", "zero_grad")


def script_for(config: Path | None) -> Path | None:
    """``config`` itself (a ``.py``), or the script beside a ``<script>.mpadvise.toml``, or ``None``."""
    if config is None or config.suffix == ".py":
        return config
    beside = config.with_name(config.name.removesuffix(".mpadvise.toml") + ".py")
    return beside if config.name.endswith(".mpadvise.toml") and beside.is_file() else None


def _name(node: ast.AST) -> str:
    return ast.unparse(node) if isinstance(node, (ast.Name, ast.Attribute)) else ""


def policy_diff(source: str, path: str) -> tuple[str, list[str]]:
    """The unified diff that makes ``source`` apply its policy through ``load_policy()``, and notes."""
    new, notes = patched_source(source, path)
    diff = "".join(difflib.unified_diff(source.splitlines(keepends=True), new.splitlines(keepends=True),
                                        fromfile=path, tofile=path))
    return diff, notes


def patched_source(source: str, path: str) -> tuple[str, list[str]]:
    """``source`` applying its policy through ``load_policy()``, and notes. ExportRefused when it
    does not parse, or builds no optimizer for ``mp.setup`` (a script that updates by hand)."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ExportRefused(f"{path} does not parse (line {exc.lineno}): no diff against it") from None
    lines = source.splitlines(keepends=True)
    replace: dict[int, list[str]] = {}  # 0-based line -> its new lines ([] removes it)
    indent = lambda i: lines[i][: len(lines[i]) - len(lines[i].lstrip())]  # noqa: E731
    optimizer = model = None
    scalers: set[str] = set()
    contexts: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
            text = ast.get_source_segment(source, value) or ""
            if isinstance(value, ast.Call) and "GradScaler" in _name(value.func):
                scalers.add(target)
                replace[node.lineno - 1] = []
            elif "autocast" in text:
                contexts.add(target)
            elif (optimizer is None and isinstance(value, ast.Call)
                  and _name(value.func).rpartition(".")[2] in _OPTIMIZERS):
                optimizer = target
                owner = value.func.value if isinstance(value.func, ast.Attribute) else None
                first = value.args[0] if value.args else None
                if _name(value.func).endswith("configure_optimizers") and owner is not None:
                    model = _name(owner)
                elif isinstance(first, ast.Call) and isinstance(first.func, ast.Attribute):
                    model = _name(first.func.value)
                i = node.lineno - 1
                replace[i] = [f"{indent(i)}mp = advisor.load_policy()\n", lines[i],
                              f"{indent(i)}{model or 'model'}, {target} = mp.setup({model or 'model'}, {target})\n"]
    if optimizer is None:
        raise ExportRefused(f"{path} builds no torch.optim optimizer that mp.setup() could take: a script that "
                            "updates its parameters by hand applies a policy through `mpadvise run` only")
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute):
            call, i = node.value, node.lineno - 1
            owner = call.func.value
            if call.func.attr == "backward":
                loss = owner.args[0] if isinstance(owner, ast.Call) and owner.args else owner
                replace[i] = [f"{indent(i)}mp.step({ast.unparse(loss)}, {optimizer})\n"]
            elif call.func.attr in _GONE_CALLS and _name(owner) in (optimizer, *scalers):
                replace[i] = []
        elif isinstance(node, ast.With):
            for item in node.items:
                expr = item.context_expr
                if (isinstance(expr, ast.Name) and expr.id in contexts) or (
                        isinstance(expr, ast.Call) and _name(expr.func).endswith("autocast")):
                    i = node.lineno - 1
                    replace[i] = [f"{indent(i)}with mp.autocast():\n"]
    last_import = max((n.end_lineno or n.lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))),
                      default=0)
    new = _apply(lines, replace, last_import)
    try:
        ast.parse(new)
    except SyntaxError:
        # A removed call was all of its block (``if amp: scaler.update()``): a pass keeps the block.
        kept = {i: v or [f"{indent(i)}pass  # {lines[i].strip()}\n"] for i, v in replace.items()}
        new = _apply(lines, kept, last_import)
    return new, [
        "mp.step() accumulates over the policy's grad_accum_steps: where the script accumulates by itself, set "
        "grad_accum_steps in the config file to its count",
        "mp.step() zeroes the gradients and clips at the policy's grad_clip_norm: clipping between the "
        "backward and the step moves into the config file",
        "in pure bf16/fp16 modes, pass the inputs through x, y = mp.to_device(x, y)"]


def _apply(lines: list[str], replace: dict[int, list[str]], last_import: int) -> str:
    new = [] if last_import else ["import advisor\n"]
    for i, line in enumerate(lines):
        new.extend(replace.get(i, [line]))
        if i == last_import - 1:
            new.append("import advisor\n")
    return "".join(new)


# Without a script to diff against: the lines a typical loop adds, around its own.
SNIPPET = [
    "import advisor",
    "",
    "mp = advisor.load_policy()  # the tuned config beside the script, the cache, or a safe default",
    "model, optimizer = mp.setup(model, optimizer)  # after building both, in place of the script's own",
    "for x, y in loader:",
    "    x, y = mp.to_device(x, y)",
    "    with mp.autocast():  # in place of the script's torch.autocast",
    "        loss = loss_fn(model(x), y)",
    "    mp.step(loss, optimizer)  # in place of backward, scaler and optimizer calls, and zero_grad",
]


class TorchExporter(Exporter):
    """A unified diff against the script; without one, the lines a typical loop adds."""

    target = "torch"
    title = "a plain PyTorch loop"

    def write(self, job: _Job) -> Export:
        data = {"mode": job.policy.mode, "script": None if self.script is None else str(self.script)}
        if self.script is None:
            job.notes.append("name the training script (mpadvise export train.py --to torch) for a diff against it")
            return job.python(SNIPPET, data=data)
        try:
            diff, notes = policy_diff(self.script.read_text(encoding="utf-8"), str(self.script))
        except OSError as exc:
            raise job.refuse(f"cannot read {self.script}: {exc.strerror or exc}") from None
        except ExportRefused as exc:
            raise job.refuse(str(exc)) from None
        return Export(self.target, diff, "diff", data, tuple(job.warnings), (*job.notes, *notes))
