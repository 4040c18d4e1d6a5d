"""``mpadvise export [CONFIG] --to TARGET``: a tuned policy as a framework's own settings; and
``mpadvise policy``: which policy ``load_policy()`` would apply for a script, and why."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from rich.markup import escape

import probes
from advisor._load import resolve_policy
from advisor._secure import write_file_atomic
from advisor.cache import lookup
from advisor.cli._common import bad_value, err_console
from advisor.frameworks import check_target, export_policy, script_for
from policies import Policy, load_config
from probes import MpadviseError, UsageError, hardware_fingerprint


def export_command(config: Path | None, *, target: str | None, out: Path | None, json_output: bool,
                   force: bool = False) -> None:
    """Export the policy of ``config`` to ``target``; print it, or write it to ``out`` whole."""
    target = check_target(target)
    if out is not None and (refusal := out_refusal(out, config=config, force=force)) is not None:
        raise UsageError(refusal)
    policy, source, device = resolve_for_export(config)
    export = export_policy(policy, target, device=device, source=source, script=script_for(config))
    if json_output:
        document = {"policy": policy.to_dict(), "source": source, "device": device, **export.to_dict()}
        text = json.dumps(document, indent=2, default=str) + "\n"
    else:
        # The file's extension names the format: Accelerate's config file for .yaml, code for .py.
        export = export if out is None else export.for_file(out)
        text = export.text
    if out is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        try:
            write_file_atomic(out, text)
        except OSError as exc:
            raise MpadviseError(f"cannot write {out}: {exc.strerror or exc}") from None
    if json_output:
        return
    for warning in export.warnings:
        err_console.print(f"[yellow]warning[/] [bold]{escape(warning.id)}[/]: {escape(warning.message)}",
                          highlight=False, soft_wrap=True)
    elsewhere = _cuda_elsewhere(policy, target) if device == "cuda" else None
    for note in [*export.notes, *([elsewhere] if elsewhere else [])]:
        err_console.print(f"note: {escape(note)}", highlight=False, soft_wrap=True)
    if out is not None:
        err_console.print(f"wrote {escape(str(out))} ({target}, {export.format})", highlight=False, soft_wrap=True)


def _cuda_elsewhere(policy: Policy, target: str) -> str | None:
    """What a CUDA export means here without a CUDA device (the framework would train on the
    CPU, or could not apply it), or ``None`` with one."""
    from advisor.frameworks import FRAMEWORKS, framework_class, refusal

    if probes.primary_profile().is_cuda:
        return None
    tuned = policy.tuned_on is not None and bool(policy.tuned_on.hardware_fingerprint)
    why = "the GPU it was tuned on" if tuned else "a config file without [tuned_on] is taken to be for a GPU"
    text = f"these settings are for CUDA ({why}); this machine has no CUDA device"
    if target not in FRAMEWORKS:
        return text
    label = framework_class(target).label
    reason = refusal(policy, target, device="cpu")
    if reason is not None:
        return f"{text}: here on the CPU {label} cannot apply it ({reason})"
    return f"{text}: here {label} would apply it on the CPU, where it was never measured"


def resolve_for_export(config: Path | None) -> tuple[Policy, str, str]:
    """The policy to export, where it came from, and the device it trains on: a config file as it
    stands; a script's as ``mpadvise policy`` resolves it."""
    if config is None:
        raise UsageError("mpadvise export needs a config file (.toml) or a training script (.py): "
                         "mpadvise export train.mpadvise.toml --to lightning")
    if config.suffix not in (".toml", ".py"):
        raise UsageError(f"{config}: expected a config file (.toml, as mpadvise tune writes) or a "
                         "training script (.py)")
    if not config.exists():
        raise UsageError(f"{config} does not exist")
    if config.suffix == ".toml":
        # A config file is exported as it stands: it may well be for another machine. One that
        # does not load is a bad argument, as a bad --config is to mpadvise run.
        with bad_value():
            policy = load_config(config)
        return policy, f"config file {config}", _device_of(policy, local_cuda=None)
    info = explain_policy(config, device=None)
    policy = Policy.from_dict(info["policy"], source=info["source"])
    return policy, info["source"], _device_of(policy, local_cuda=probes.profile_for(None).is_cuda)


def _device_of(policy: Policy, *, local_cuda: bool | None) -> str:
    """Where the policy trains: where it was tuned; else this machine for a script's policy
    (a safe default is this machine's), and CUDA for a hand-written config file."""
    tuned = policy.tuned_on
    if tuned is not None and tuned.hardware_fingerprint:
        return "cuda" if tuned.cuda else "cpu"
    return "cpu" if local_cuda is False else "cuda"


# How a .py export begins (its docstring): export --out replaces a .py file only when it is one.
EXPORT_MARKS = ("'mpadvise policy ", '"mpadvise policy ')


def out_refusal(out: Path, *, config: Path | None, force: bool) -> str | None:
    """Why ``export --out`` must not write ``out``, or ``None`` when it may: an existing file is
    replaced only with ``--force``, and never when it is the file being exported, a directory, or
    a ``.py`` file that is no earlier export. A symlink there is replaced, never followed."""
    if not os.path.lexists(out):
        parent = out.absolute().parent
        return None if parent.is_dir() else f"--out {out}: its directory {parent} does not exist"
    over = f"refusing to write the export over {out}: it is"
    if config is not None and config.exists() and out.exists() and os.path.samefile(out, config):
        what = "script" if config.suffix == ".py" else "config file"
        return f"{over} the {what} being exported; name another file with --out"
    if os.path.islink(out):
        pass  # the export replaces the link; the file it points to is never written
    elif out.is_dir():
        return f"{over} a directory; name a file with --out"
    elif not out.is_file():
        return f"{over} not a regular file; name a file with --out"
    elif out.suffix.lower() == ".py" and not _earlier_export(out):
        return (f"{over} a Python file that mpadvise export did not write (a training script?), "
                "even with --force; name another file with --out")
    if not force:
        return f"refusing to overwrite {out}: it exists; add --force to replace it"
    return None


def _earlier_export(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.readline(200).startswith(EXPORT_MARKS)
    except (OSError, UnicodeDecodeError):
        return False


def explain_policy(target: Path | None, *, device: str | None) -> dict[str, Any]:
    """Resolve as ``load_policy()`` does for ``target``, a config file or a script."""
    profile = probes.profile_for(device)
    if target is not None and not target.exists():
        raise UsageError(f"{target} does not exist")
    if target is not None and target.suffix == ".toml":
        with bad_value():  # a file that does not load is a bad argument, as to export and run
            load_config(target)
        resolution = resolve_policy(target, profile=profile, script=None, environ=os.environ)
    else:
        script = target.resolve() if target is not None else None
        resolution = resolve_policy(None, profile=profile, script=script, environ=os.environ, cached=lookup)
    mismatch = resolution.mismatch
    return {
        "hardware": {"name": profile.name, "fingerprint": hardware_fingerprint(profile)},
        "source": resolution.source,
        "kind": resolution.kind.value,
        "policy": resolution.policy.to_dict(),
        "describe": resolution.policy.describe(),
        "not_applied_because": None if mismatch is None else mismatch.reason(),
        "differences": [] if mismatch is None else [d.to_dict() for d in mismatch.differences],
    }
