"""Checks on the user's script and mode names, done before any trial starts."""

from __future__ import annotations

import os
from pathlib import Path

from policies import mode_dtypes, mode_names, supported_modes
from probes import HardwareProfile, MpadviseError, UsageError


def check_script(script: str | os.PathLike[str]) -> Path:
    """The script's resolved path, after checking that it exists and compiles (UsageError, exit 2,
    for a path that is not a file; MpadviseError, one line, for one that does not compile)."""
    path = Path(script)
    if not path.is_file():
        raise UsageError(f"script {path} {'is not a file' if path.exists() else 'does not exist'}")
    try:
        source = path.read_bytes()
    except OSError as exc:
        raise MpadviseError(f"cannot read script {path}: {exc.strerror or exc}") from None
    try:
        compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise MpadviseError(f"script {path} has a syntax error at line {exc.lineno}: {exc.msg}") from None
    except ValueError as exc:  # null bytes
        raise MpadviseError(f"script {path} is not Python source: {exc}") from None
    return path.resolve()


def check_modes(modes: list[str], profile: HardwareProfile) -> list[str]:
    """The requested modes, each known (UsageError) and supported on ``profile`` (MpadviseError)."""
    support = supported_modes(profile)
    for mode in modes:
        if mode not in support:
            raise UsageError(f"unknown mode {mode!r}; expected one of {', '.join(mode_names())}")
        if not support[mode].supported:
            available = ", ".join(m for m, s in support.items() if s.supported)
            raise MpadviseError(f"mode {mode} cannot run on {profile.name}: {support[mode].reason}; available here: {available}")
    return list(dict.fromkeys(modes))


def default_trial_modes(profile: HardwareProfile) -> list[str]:
    """Every supported mode except fp32 (the reference) and FP8 emulation (no speed to gain)."""
    dtypes = mode_dtypes()
    return [
        m for m, s in supported_modes(profile).items()
        if s.supported and m != "fp32" and not (dtypes[m] == "fp8" and s.emulated)
    ]
