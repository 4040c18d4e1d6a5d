"""The argv that runs one of mpadvise's modules in a child process, safe from shadowing."""

from __future__ import annotations

import sys

# Python 3.10 has no -P: this runs the module as -m does, with the working directory (which
# -c puts first on sys.path) taken off again.
_SAFE_RUN_MODULE = ("import runpy, sys; del sys.path[0]; "
                    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")


def module_argv(module: str, *, version: tuple[int, int] = sys.version_info[:2]) -> list[str]:
    """The arguments after the interpreter (of ``version``) that run ``module`` without the working
    directory on ``sys.path``, where the user's own ``advisor`` or ``probes`` would shadow ours."""
    return ["-P", "-m", module] if version >= (3, 11) else ["-c", _SAFE_RUN_MODULE, module]
