#!/usr/bin/env bash
# Prepare .whl/: the wheels that the GPU machine (CPython 3.12, x86-64, no network) lacks for the
# GPU check, exactly as pinned in scripts/gpu_wheels.txt, and prove the set is closed.
#
#   scripts/gpu_wheels.sh                  download what is missing, drop stale wheels, check
#   scripts/gpu_wheels.sh --check          check .whl/ against the lock only (no network)
#   scripts/gpu_wheels.sh --machine-needs  the machine's packages the check relies on, one a line
#
# The check reads pyproject.toml's dependencies, the torchao extra and the test packages the
# GPU steps run, follows every wheel's Requires-Dist (extras and markers evaluated for Linux,
# CPython 3.12, x86-64), and fails on a requirement that neither a pinned wheel nor the
# machine's package list meets, on a pin nothing needs, on a pin that would shadow one of the
# machine's packages, on a second version of a wheel, and on a wheel for another platform.
# .whl/ belongs to this script: wheels in it that the lock does not name are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
exec "$PY" - "$@" <<'PY'
from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version

LOCK = Path("scripts/gpu_wheels.txt")
WHEELS = Path(".whl")
# What the GPU steps need beyond the runtime dependencies: the torchao extra (fp8-torchao)
# and, from the dev extra, only what runs tests/gpu. Transformer Engine (the fp8 extra) needs
# a compile and is left out; torch is the machine's own.
EXTRAS = ("torchao",)
TEST_NEEDS = {"pytest", "pytest-timeout"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
MAX_MIB = 32  # the working tree that travels to the machine, wheels included, is capped at 64 MiB


def fail(problems: list[str]) -> None:
    for p in problems:
        print(f"gpu_wheels: {p}", file=sys.stderr)
    sys.exit(1)


def read_lock() -> tuple[dict[str, Version], dict[str, Version | None], dict[str, str]]:
    """The pinned downloads, the machine's packages (version or None) and its settings."""
    download: dict[str, Version] = {}
    machine: dict[str, Version | None] = {}
    settings: dict[str, str] = {}
    section = None
    for number, raw in enumerate(LOCK.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        if section == "download":
            req = Requirement(line)
            pins = [s for s in req.specifier if s.operator == "=="]
            if len(pins) != 1 or len(req.specifier) != 1 or req.marker or req.extras:
                fail([f"{LOCK}:{number}: {line!r} must be NAME==VERSION"])
            name = canonicalize_name(req.name)
            if name in download:
                fail([f"{LOCK}:{number}: {req.name} is pinned twice"])
            download[name] = Version(pins[0].version)
        elif section == "machine" and ":" in line and "==" not in line:
            key, _, value = line.partition(":")
            settings[key.strip()] = value.strip()
        elif section == "machine":
            for token in line.split():
                name, _, version = token.partition("==")
                machine[canonicalize_name(name)] = Version(version) if version else None
        else:
            fail([f"{LOCK}:{number}: {line!r} is outside [download] and [machine]"])
    return download, machine, settings


def wheel_files() -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for path in sorted(WHEELS.glob("*.whl")):
        name, _version, _build, _tags = parse_wheel_filename(path.name)
        found.setdefault(name, []).append(path)
    return found


def metadata(path: Path):
    with zipfile.ZipFile(path) as zf:
        (member,) = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(zf.read(member).decode())


def tag_fits(tag, python: Version) -> bool:
    """Whether a wheel tag installs on CPython ``python`` (3.12) on manylinux x86-64."""
    cp = f"cp{python.major}{python.minor}"
    if tag.platform != "any" and not (tag.platform.startswith("manylinux") and tag.platform.endswith("_x86_64")):
        return False
    if tag.interpreter in (f"py{python.major}", cp) and tag.abi in ("none", cp, "abi3"):
        return True
    if tag.interpreter.startswith("cp3") and tag.abi == "abi3":
        return int(tag.interpreter[3:]) <= python.minor
    return False


def check(download, machine, settings) -> tuple[dict[str, set[str]], list[str]]:
    """Walk the requirements from pyproject.toml; return the machine packages reached and problems."""
    python = Version(settings.get("python", "3.12.3"))
    environment = {
        "python_version": f"{python.major}.{python.minor}", "python_full_version": str(python),
        "implementation_name": "cpython", "implementation_version": str(python),
        "platform_python_implementation": "CPython", "os_name": "posix", "sys_platform": "linux",
        "platform_system": "Linux", "platform_machine": "x86_64", "platform_release": "",
        "platform_version": "", "extra": "",
    }
    problems: list[str] = []
    files = wheel_files()
    for name, paths in files.items():
        if name not in download:
            problems.append(f"{paths[0].name} is in {WHEELS}/ but not in {LOCK}")
        elif len(paths) > 1:
            problems.append(f"{len(paths)} wheels of {name} in {WHEELS}/ ({', '.join(p.name for p in paths)}): keep one")
    for name, version in download.items():
        paths = files.get(name, [])
        if not paths:
            problems.append(f"{name}=={version} is pinned but missing from {WHEELS}/ (run scripts/gpu_wheels.sh)")
            continue
        _n, found, _b, tags = parse_wheel_filename(paths[0].name)
        if found != version:
            problems.append(f"{paths[0].name} is not the pinned {name}=={version}")
        if not any(tag_fits(t, python) for t in tags):
            problems.append(f"{paths[0].name} does not install on CPython {python} manylinux x86-64")
        if name in machine:
            problems.append(f"{name} is pinned for download but the machine has it: the wheel would shadow the machine's")
    if problems:
        return {}, problems

    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    roots = [Requirement(r) for r in project["dependencies"]]
    roots += [Requirement(r) for extra in EXTRAS for r in optional[extra]]
    roots += [r for r in map(Requirement, optional.get("dev", [])) if canonicalize_name(r.name) in TEST_NEEDS]
    queue = [(r, "pyproject.toml") for r in roots if r.marker is None or r.marker.evaluate(environment)]
    needed_by: dict[str, set[str]] = {}
    machine_needs: dict[str, set[str]] = {}
    walked: set[tuple[str, str]] = set()
    while queue:
        req, by = queue.pop()
        name = canonicalize_name(req.name)
        if name in download:
            version = download[name]
            if not req.specifier.contains(version, prereleases=True):
                problems.append(f"{by} needs {req}, but the lock pins {name}=={version}")
            needed_by.setdefault(name, set()).add(by)
            meta = metadata(files[name][0])
            requires_python = meta.get("Requires-Python")
            if requires_python and not Requirement(f"python{requires_python}").specifier.contains(python):
                problems.append(f"{name}=={version} needs Python {requires_python}, the machine has {python}")
            for extra in ("", *sorted(req.extras)):
                if (name, extra) in walked:
                    continue
                walked.add((name, extra))
                for line in meta.get_all("Requires-Dist") or []:
                    dep = Requirement(line)
                    if dep.marker is None and extra:
                        continue  # met already through the plain requirement
                    if dep.marker is not None and not dep.marker.evaluate({**environment, "extra": extra}):
                        continue
                    queue.append((dep, f"{name}=={version}"))
        elif name in machine:
            have = machine[name]
            if have is not None and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{by} needs {req}, but the machine has {name}=={have}")
            machine_needs.setdefault(name, set()).add(by)
        else:
            problems.append(f"{by} needs {req}: neither pinned in [download] nor on the machine; add a pin")
    for name in sorted(set(download) - set(needed_by)):
        problems.append(f"{name}=={download[name]} is pinned but nothing needs it: remove it from {LOCK}")
    mib = sum(files[name][0].stat().st_size for name in download) / 2**20
    if mib > MAX_MIB:
        problems.append(f"{WHEELS}/ holds {mib:.1f} MiB, over the {MAX_MIB} MiB this check allows itself")
    if not problems:
        print(f"{'wheel':<22} {'version':<10} {'KiB':>6}  needed by")
        for name in sorted(download):
            size = files[name][0].stat().st_size // 1024
            print(f"{name:<22} {str(download[name]):<10} {size:>6}  {', '.join(sorted(needed_by[name]))}")
        print(f"{len(download)} wheels, {mib:.1f} MiB in {WHEELS}/; closed: every requirement is met by "
              f"a wheel here or by the machine's own packages ({len(machine_needs)} of them)")
    return machine_needs, problems


def download_missing(download) -> None:
    WHEELS.mkdir(exist_ok=True)
    for name, paths in wheel_files().items():
        for path in paths:
            if name not in download or parse_wheel_filename(path.name)[1] != download[name]:
                print(f"removing {path} (not pinned in {LOCK})")
                path.unlink()
    have = set(wheel_files())
    missing = [f"{name}=={version}" for name, version in download.items() if name not in have]
    if not missing:
        return
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(WHEELS), *missing]
    print("downloading:", " ".join(missing))
    subprocess.run(command, check=True)


def main(argv: list[str]) -> None:
    download, machine, settings = read_lock()
    if argv not in ([], ["--check"], ["--machine-needs"]):
        fail([f"unknown arguments {' '.join(argv)}; expected nothing, --check or --machine-needs"])
    if not argv:
        download_missing(download)
    if argv == ["--machine-needs"]:
        with contextlib.redirect_stdout(io.StringIO()):
            machine_needs, problems = check(download, machine, settings)
        if problems:
            fail(problems)
        for name in sorted(machine_needs):
            print(name if machine[name] is None else f"{name}=={machine[name]}")
        return
    _machine_needs, problems = check(download, machine, settings)
    if problems:
        fail(problems)
    if not argv:
        print(travel_size())


def travel_size() -> str:
    """What travels to the GPU machine: git's tracked and unignored files, plus .whl/."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], check=True,
                                capture_output=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        return "(no git here to size the working tree that travels)"
    tree = sum(Path(f).stat().st_size for f in listed if f and Path(f).is_file())
    wheels = sum(p.stat().st_size for p in WHEELS.glob("*.whl"))
    return (f"what travels: the working tree {tree / 2**20:.1f} MiB + {WHEELS}/ {wheels / 2**20:.1f} MiB "
            f"= {(tree + wheels) / 2**20:.1f} MiB of the 64 MiB allowed")


main(sys.argv[1:])
PY
