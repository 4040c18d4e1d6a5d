"""advisor.tune(train_fn): the tuner in this process, on a real tiny training function."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import advisor
from advisor.cache._recommend import cached_answers
from advisor.cache._store import open_store
from policies import load_config


def train(mp):
    torch.manual_seed(0)
    x = torch.randn(512, 16)
    y = (x @ torch.randn(16, 4)).argmax(1)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model, opt = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=3e-3))
    batch = mp.micro_batch_size(32)
    while True:
        for i in range(0, 512, batch):
            xb, yb = mp.to_device(x[i : i + batch], y[i : i + batch])
            with mp.autocast():
                loss = F.cross_entropy(model(xb).float(), yb)
            mp.step(loss, opt)


def test_in_process_tune_measures_judges_writes_and_caches_as_mpadvise_tune_does(tmp_path, cache_home):
    out = tmp_path / "fn.mpadvise.toml"
    result = advisor.tune(train, modes=["bf16-mixed"], trials=2, steps=32, warmup=2, no_priors=True,
                          remeasure=False, out=out)
    assert result.reference.outcome == "ok" and len(result.reference.result.losses) == 34
    assert result.space.user_batch == 32
    assert result.search.runs == 2
    modes = {c.mode for c in result.search.measured}
    assert modes <= {"fp32", "bf16-mixed"} and "bf16-mixed" in modes
    assert result.policy is not None and result.policy.tuned_on.trials >= 2
    assert load_config(out) == result.policy

    # Cached under the file that defines the function, so that its script's load_policy() finds it.
    here = result.policy.tuned_on.hardware_fingerprint
    profile = _profile_with(here)
    answers = cached_answers(profile, __file__)
    assert [a.policy.mode for a in answers] == [result.policy.mode]
    assert answers[0].policy.tuned_on.workload_fingerprint == result.policy.tuned_on.workload_fingerprint
    with open_store() as store:
        rows = store.find_recommendations(hardware_fp=here, with_trials=True)
    assert len(rows) == 1 and rows[0]["speedup_vs_fp32"] == result.policy.tuned_on.speedup_vs_fp32
    assert {t["mode"] for t in rows[0]["trials"]} == {c.mode for c in result.search.measured}


def test_no_cache_leaves_the_cache_alone(cache_home):
    result = advisor.tune(train, modes=["bf16-mixed"], trials=1, steps=32, warmup=2, no_priors=True, remeasure=False,
                          no_cache=True)
    assert result.policy is not None
    assert not (cache_home / "mpadvise.db").exists()


def _profile_with(fingerprint):
    import probes

    profile = probes.profile_for(None)
    assert probes.hardware_fingerprint(profile) == fingerprint
    return profile


def test_a_stored_study_with_finished_trials_is_kept_unless_asked(tmp_path, cache_home):
    import pytest

    from advisor.tune._study_status import kept_study
    from probes import UsageError

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    quick = dict(modes=["bf16-mixed"], trials=1, steps=32, warmup=2, no_priors=True, remeasure=False, no_cache=True,
                 storage=storage, study_name="fn")
    advisor.tune(train, **quick)
    held = kept_study(storage, "fn")
    assert held is not None and held.finished >= 1
    # Before, a second call without resume deleted the study's trials without a word.
    with pytest.raises(UsageError, match=r"holds \d+ finished trial.*pass resume=True to continue it, or fresh=True"):
        advisor.tune(train, **quick)
    assert kept_study(storage, "fn") == held
    resumed = advisor.tune(train, **quick, resume=True)
    assert resumed.search.resumed >= 1
    advisor.tune(train, **quick, fresh=True)
    assert kept_study(storage, "fn").finished >= 1
