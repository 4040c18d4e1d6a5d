"""``python -m advisor.tune.job REQUEST.json RESULT.json``: one tune of a script in a process of
its own (a daemon job), exactly as ``mpadvise tune`` runs it. ``REQUEST.json`` holds
``TuneRequest.to_dict()``; ``ScriptTune.to_dict()`` is written to ``RESULT.json`` whole, only
when the tune answered (exit 0 or 3; 1 an error, 2 a usage error, 130 interrupted). Progress and
an error (one ``error: ...`` line) go to stderr; stdout is left to the script's own prints.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from advisor._secure import open_private_new
from advisor.tune._service import ProgressCallbacks, TuneRequest, run_ratio_text, tune_script
from probes import MpadviseError, UsageError


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if len(args) != 2:
            raise UsageError("usage: python -m advisor.tune.job REQUEST.json RESULT.json")
        request_path, result_path = (Path(a) for a in args)
        try:
            data = json.loads(request_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise MpadviseError(f"cannot read the tune request {request_path}: {exc}") from None
        if not isinstance(data, dict):
            raise MpadviseError(f"tune request {request_path}: expected a JSON object")
        done = tune_script(TuneRequest.from_dict(data), progress=progress_lines)
        write_result(result_path, done.to_dict())
    except MpadviseError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        return 130
    return done.exit_code


def write_result(path: Path, result: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with os.fdopen(open_private_new(tmp), "w", encoding="utf-8") as out:
            json.dump(result, out, indent=2, default=str)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise MpadviseError(f"cannot write the tune result {path}: {exc.strerror or exc}") from None


@contextmanager
def progress_lines(total: int) -> Iterator[ProgressCallbacks]:

    def on_done(label: str, ev: Any, m: Any) -> None:
        # One run's ratio, named so: the tune's speed-up is its paired figure, decided at the end.
        print(f"  {label}: {m.outcome}{run_ratio_text(ev)}", file=sys.stderr, flush=True)

    def on_round(number: int, most: int, runs: int) -> None:
        print(f"re-measure round {number} of at most {most}: {runs} runs", file=sys.stderr, flush=True)

    yield (lambda label: None, on_done, on_round)


if __name__ == "__main__":
    sys.exit(main())
