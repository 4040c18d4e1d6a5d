"""How a trial child writes its result (whole, with any uncaught exception) and ends."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from probes import UnsupportedHere

from ._schema import Stage, unknown_result_fields
from ._timeline import marks


class TrialComplete(BaseException):
    """Ends an in-process trial once its window is measured (a BaseException, so that a
    training function's ``except Exception`` does not swallow it)."""


class ResultWriter:
    """Writes the result file atomically, so the parent never reads half a file."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.data: dict[str, Any] = {}

    def write(self, **fields: Any) -> None:
        """Add ``fields`` (each declared in ``RESULT_FIELDS``) to the result and write it whole."""
        unknown = unknown_result_fields(fields)
        if unknown:
            raise ValueError(f"the trial result has no fields {unknown}; declare them in RESULT_FIELDS")
        self.data.update(fields, timeline=marks())
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, default=str))
        tmp.replace(self.path)


def install_excepthook(writer: ResultWriter) -> None:
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if issubclass(exc_type, UnsupportedHere):
            writer.write(stage=Stage.UNSUPPORTED, reason=str(exc))
        elif not issubclass(exc_type, KeyboardInterrupt):
            # The time tells the rank that failed first from those that lost it as a peer.
            writer.write(stage=Stage.EXCEPTION, exception={"type": exc_type.__name__, "message": str(exc).splitlines()[0] if str(exc) else "",
                                                       "at": time.time()})
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def end_trial_process(code: int) -> NoReturn:
    """End the trial child now: the result is written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
