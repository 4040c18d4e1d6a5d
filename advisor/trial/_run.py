"""``python -P -m advisor.trial._run [LAUNCH...] SCRIPT [ARGS...]``: run a cold trial's command
as python would, torch's import marked; ``... --warm-server FD [PRELOAD...]`` is the warm server.
No module imports this one (no second copy in sys.modules)."""

from __future__ import annotations

import signal
import sys
from typing import NoReturn

from ._proctree import end_with_parent
from ._python_command import RUN_MODULE, exit_forked, parse_command, prepare_torch, run_as_python
from ._ranks import use_file_store
from ._warm_server import SERVER_FLAG, serve


def main(argv: list[str]) -> NoReturn:
    if argv[:1] == [SERVER_FLAG] and len(argv) >= 2:
        serve(int(argv[1]), argv[2:])
        raise SystemExit(0)
    command = parse_command(argv)
    if command is None:
        print(f"usage: python -P -m {RUN_MODULE} [-P] (-m MODULE | SCRIPT) [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    # Nothing of a trial outlives its launcher (a tune killed by SIGKILL takes its trials along).
    end_with_parent(signal.SIGKILL)
    # A rank of a multi-process trial meets its peers through the trial's private file store.
    use_file_store()
    prepare_torch()
    code = run_as_python(command)
    if code >= 0:
        raise SystemExit(code)  # the interpreter's own way out: threads joined, atexit, flush
    exit_forked(code)  # a signal's status (KeyboardInterrupt): the same way out, then the signal


if __name__ == "__main__":
    main(sys.argv[1:])
