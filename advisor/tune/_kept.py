"""A finished tune's answer, kept with its study, so that running the same tune again prints it
instead of measuring it again: served while mpadvise's and torch's versions and the options that
shape the search still hold and the study holds no trial since.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from advisor._version import __version__
from advisor.tune._options import TuneOptions
from advisor.tune._storage import shared_storage, storage_exists
from advisor.tune._storage_retry import riding_out
from advisor.tune._study import stored_study
from probes import HardwareProfile, MpadviseError

STUDY_ATTR_ANSWER = "mpadvise:answer"

# Options that do not change what a tune measures or answers: where the study lives, how it is
# opened, and the device (the study's name holds the hardware fingerprint already).
_NOT_IN_KEY = frozenset({"storage", "resume", "fresh", "device"})


@dataclass(frozen=True)
class StoredAnswer:
    """A finished tune's answer as its study keeps it: its JSON, its config file (``None`` without
    one) and when it finished (UTC, to the minute)."""

    payload: dict[str, Any]
    config_text: str | None
    at: str


def answer_key(options: TuneOptions, profile: HardwareProfile) -> dict[str, Any]:
    shaping = {k: v for k, v in options.to_dict().items() if k not in _NOT_IN_KEY}
    return {"mpadvise": __version__, "torch": profile.torch_version, "options": shaping}


def store_answer(storage: str | None, study_name: str, key: dict[str, Any], payload: dict[str, Any],
                 config_text: str | None) -> None:
    """Keep a finished tune's answer with its study; nothing in memory or in a shared study (no one
    worker owns the answer). A storage that fails here loses only the shortcut."""
    if storage is None or shared_storage(storage):
        return
    try:
        with riding_out(storage) as worker:
            study = stored_study(storage, study_name, worker)
            if study is None:
                return
            trials = worker.call("counting the study's trials", lambda: len(study.get_trials(deepcopy=False)))
            stored = {"key": key, "json": payload, "config": config_text, "at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"), "trials": trials}
            worker.call("keeping the answer", lambda: study.set_user_attr(STUDY_ATTR_ANSWER, stored))
    except MpadviseError:
        return


def stored_answer(storage: str | None, study_name: str, key: dict[str, Any]) -> StoredAnswer | None:
    """The answer kept with the study, where it was tuned with ``key`` and no trial was added since."""
    if storage is None or shared_storage(storage) or not storage_exists(storage):
        return None
    with riding_out(storage) as worker:
        study = stored_study(storage, study_name, worker)
        if study is None:
            return None
        kept = worker.call("reading the study's answer", lambda: study.user_attrs.get(STUDY_ATTR_ANSWER))
        if not isinstance(kept, dict) or kept.get("key") != key or not isinstance(kept.get("json"), dict):
            return None
        trials = worker.call("counting the study's trials", lambda: len(study.get_trials(deepcopy=False)))
    if trials != kept.get("trials"):
        return None
    return StoredAnswer(kept["json"], kept.get("config"), str(kept.get("at") or "?"))
