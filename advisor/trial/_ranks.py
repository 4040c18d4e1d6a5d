"""The ranks of a multi-process trial on this node, started without torchrun's elastic agent.

``python -I -S _ranks.py --nproc N -- COMMAND...`` starts ``COMMAND`` N times with the
variables torchrun sets. Why not torchrun: its c10d TCPStore listens on every interface with
no authentication, and its agent unpickles what it reads back from it, so another local user
who finds the port runs code as the tuning user. Here the ranks meet through a ``FileStore`` in
a 0700 directory (``STORE_ENV``), at which every rank points torch's ``env://`` rendezvous
(``use_file_store``); gloo and NCCL keep their sockets on loopback, carrying tensor bytes only.

No restarts: when a rank fails the others are stopped, and how each rank ended is written to
``EXITS_ENV``'s file, from which the parent blames the rank that failed first. Run as a plain
file (standard library only), as ``_proctree.py`` is."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

if __package__:
    from ._proctree import _exit_as, end_with_parent
else:  # run as a plain file (ranks_argv): its sibling, by path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _proctree import _exit_as, end_with_parent

STORE_ENV = "MPADVISE_RANK_STORE"  # the FileStore of every rank's env:// rendezvous
EXITS_ENV = "MPADVISE_RANK_EXITS"  # where the launcher writes how each rank ended
GRACE_S = 10.0  # seconds the other ranks get after SIGTERM, once one failed, before SIGKILL
LOOPBACK = "127.0.0.1"


def ranks_argv(nproc: int) -> list[str]:
    # -I -S: no site-packages and no script directory on sys.path, nothing from the environment.
    return ["-I", "-S", str(Path(__file__).resolve()), "--nproc", str(nproc), "--"]


def rank_environment(base: Mapping[str, str], *, rank: int, nproc: int, port: int, store: str) -> dict[str, str]:
    # TORCHELASTIC_RUN_ID: what torch.distributed.is_torchelastic_launched() (and Lightning) read.
    env = dict(base)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
        WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc),
        MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="mpadvise",
        TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", **{STORE_ENV: store},
    )
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # it would send env:// to an agent's TCP store
    return env


def run_ranks(nproc: int, command: Sequence[str], *, exits: str | None) -> int:
    """Run ``command`` as ranks 0..nproc-1, the rest stopped when one fails; its status, else 0."""
    store_dir = tempfile.mkdtemp(prefix="mpadvise-ranks-")  # 0700: only this user reaches the store
    store = os.path.join(store_dir, "store")
    # MASTER_PORT: a free loopback port, which Lightning and Accelerate check is set.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        port = int(s.getsockname()[1])
    me = os.getpid()
    procs: dict[int, subprocess.Popen[bytes]] = {}
    ended: list[dict[str, Any]] = []

    def finish() -> None:  # how each rank ended, for the parent's blame; the store removed
        if exits:
            with contextlib.suppress(OSError):
                Path(f"{exits}.tmp").write_text(json.dumps({"ended": ended}))
                os.replace(f"{exits}.tmp", exits)
        shutil.rmtree(store_dir, ignore_errors=True)

    def stop_others(signum: int) -> None:
        for proc in procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(proc.pid, signum)

    def on_signal(signum: int, frame: object) -> None:
        stop_others(signal.SIGKILL)
        finish()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(me, signum)

    for name in ("SIGTERM", "SIGHUP", "SIGINT"):
        signal.signal(getattr(signal, name), on_signal)
    try:
        for rank in range(nproc):
            procs[rank] = subprocess.Popen(
                list(command), env=rank_environment(os.environ, rank=rank, nproc=nproc, port=port, store=store),
                preexec_fn=lambda: end_with_parent(signal.SIGKILL, parent=me))
    except OSError as exc:
        stop_others(signal.SIGKILL)
        print(f"mpadvise: cannot start {command[0]}: {exc}", file=sys.stderr)
        finish()
        return 127
    first_failure: int | None = None
    stopping_since: float | None = None
    while any(p.returncode is None for p in procs.values()):
        if stopping_since is None:
            # Wake the moment a rank ends (without reaping it), so that the order of the record
            # is the order in which ranks ended: the first is the one a failure is blamed on.
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        for rank, proc in procs.items():
            if proc.returncode is None and proc.poll() is not None:
                status = proc.returncode
                name = f"signal {-status}"
                with contextlib.suppress(ValueError):
                    name = None if status >= 0 else signal.Signals(-status).name
                ended.append({"rank": rank, "pid": proc.pid, "status": status, "signal": name,
                              "at": time.time(), "stopped": stopping_since is not None})
                if status != 0 and stopping_since is None:
                    first_failure, stopping_since = status, time.monotonic()
                    stop_others(signal.SIGTERM)
        if stopping_since is not None:
            if time.monotonic() - stopping_since > GRACE_S:
                stop_others(signal.SIGKILL)
            time.sleep(0.02)
    finish()
    return first_failure or 0


class AfterImport:
    """A meta path finder that finds nothing itself: once ``name`` is imported (by the finders
    after it), ``then(module)`` runs; then it leaves ``sys.meta_path``."""

    def __init__(self, name: str, then: Callable[[Any], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if find is None else find(name, path, target)
            if spec is not None:
                exec_module = getattr(spec.loader, "exec_module", None)
                if exec_module is not None:

                    def run(module: Any, exec_module: Callable[[Any], None] = exec_module) -> None:
                        exec_module(module)
                        self.then(module)

                    spec.loader.exec_module = run  # this loader only
                return spec
        return None


def use_file_store() -> None:
    """In a rank started by this launcher: make torch's ``env://`` rendezvous meet through the
    trial's FileStore, now or once torch's rendezvous module is imported. Only the ``env``
    scheme's handler changes: a script's own ``init_method`` or ``store`` is left as it is."""
    path = os.environ.get(STORE_ENV)
    if not path:
        return

    def handler(url: str, **kwargs: Any) -> Any:
        from urllib.parse import parse_qs, urlparse

        from torch.distributed import FileStore

        query = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
        rank = int(query.get("rank", os.environ["RANK"]))
        world_size = int(query.get("world_size", os.environ["WORLD_SIZE"]))
        yield FileStore(path, world_size), rank, world_size
        raise RuntimeError("Unable to perform re-rendezvous through the trial's file store")

    def install(rendezvous: Any) -> None:
        rendezvous._rendezvous_handlers["env"] = handler

    if "torch.distributed.rendezvous" in sys.modules:
        install(sys.modules["torch.distributed.rendezvous"])
    else:
        sys.meta_path.insert(0, AfterImport("torch.distributed.rendezvous", install))


if __name__ == "__main__":
    argv = sys.argv[1:]
    nproc = int(argv[1]) if len(argv) > 1 and argv[1].isdigit() else 0
    if len(argv) < 4 or argv[0] != "--nproc" or nproc < 1 or argv[2] != "--":
        print(f"usage: python {sys.argv[0]} --nproc N -- COMMAND [ARGS...]", file=sys.stderr)
        _exit_as(2)
    end_with_parent(signal.SIGKILL)  # the trial's launcher (``_proctree``) gone: so are the ranks
    _exit_as(run_ranks(nproc, argv[3:], exits=os.environ.get(EXITS_ENV) or None))
