"""FSDP2 under a policy: the MixedPrecisionPolicy each mode maps to, its numerics next to the
single-process modes, the reduction dtype as a Policy field and as a search dimension, and the
order in which a script sets up, wraps and shards its model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from advisor import AppliedPolicy, MpadviseError, Policy
from advisor.runtime import FsdpPrecision, fsdp_precision
from advisor.runtime._applied import rank_device
from advisor.trial import TrialResult
from advisor.tune._engine import tune_policy
from advisor.tune._options import TuneOptions
from advisor.tune._search import _suggest
from advisor.tune._space import REDUCE_CHOICES, Candidate, space_for
from policies import MODES, PolicyError, supported_modes
from probes import HardwareProfile

CPU = HardwareProfile(kind="cpu", name="test CPU", cores=2, torch_version=torch.__version__, cpu_flags=("amx_bf16",))

# mode -> (param_dtype, reduce_dtype) with the policy's reduce_dtype left out.
DEFAULTS = {
    "fp32": (None, None),
    "tf32": (None, None),
    "fp16-mixed": ("fp16", "fp32"),
    "bf16-mixed": ("bf16", "fp32"),
    "fp16-true": ("fp16", "fp16"),
    "bf16-true": ("bf16", "bf16"),
    "fp8-te": (None, None),
    "fp8-torchao": (None, None),
}


def applied(mode: str, **kwargs) -> AppliedPolicy:
    return AppliedPolicy(Policy(mode=mode, **kwargs), profile=CPU, source="test", device="cpu")


@pytest.fixture
def group_of_one():
    """A gloo process group of this process alone, which FSDP2 and DDP need."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# ---- the mapping -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_maps_to_its_fsdp_dtypes(mode):
    param, reduce = DEFAULTS[mode]
    assert fsdp_precision(Policy(mode=mode)) == FsdpPrecision(param_dtype=param, reduce_dtype=reduce, output_dtype=None)


@pytest.mark.parametrize(("mode", "reduce", "expected"), [
    ("bf16-mixed", "bf16", FsdpPrecision("bf16", "bf16")),
    ("fp16-mixed", "fp16", FsdpPrecision("fp16", "fp16")),
    ("bf16-true", "fp32", FsdpPrecision("bf16", "fp32")),
    ("fp32", "fp32", FsdpPrecision(None, None)),
])
def test_the_policys_reduce_dtype_wins(mode, reduce, expected):
    assert fsdp_precision(Policy(mode=mode, reduce_dtype=reduce)) == expected


def test_the_mixed_precision_policy_object():
    policy = applied("bf16-mixed").fsdp_mixed_precision()
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16, torch.float32, None)
    policy = applied("bf16-true", reduce_dtype="fp32").fsdp_mixed_precision()
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    full = applied("fp32").fsdp_mixed_precision()
    assert (full.param_dtype, full.reduce_dtype, full.output_dtype) == (None, None, None)


@pytest.mark.parametrize("mode", ["fp16-mixed", "bf16-mixed"])
def test_fsdp_computes_in_the_dtype_autocast_computes_in(mode):
    """The forward keeps running in autocast(): FSDP2's parameter dtype must be autocast's own,
    or a matmul would cast its weights twice, to two dtypes."""
    mp = applied(mode)
    with mp.autocast():
        autocast_dtype = torch.get_autocast_dtype("cpu")
    assert mp.fsdp_mixed_precision().param_dtype == autocast_dtype


def test_fp16_loss_scaling_agrees_across_shards():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    mp = applied("fp16-mixed")
    before = mp._mode.scaler
    mp.fsdp_mixed_precision()
    scaler = mp._mode.scaler
    # Each rank sees only its shard's gradients: the overflow check must be all-reduced.
    assert isinstance(scaler, ShardedGradScaler) and scaler is not before
    assert scaler.get_scale() == before.get_scale() and scaler.get_growth_interval() == before.get_growth_interval()
    assert mp.fsdp is True and applied("fp16-mixed").fsdp is False


# ---- numerics in one process ----------------------------------------------------------------


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def two_steps(mp: AppliedPolicy, model: nn.Module, *, shard: bool) -> list[torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g)
    model = mp.setup(model)
    if shard:
        for block in model.blocks:
            fully_shard(block, mp_policy=mp.fsdp_mixed_precision())
        fully_shard(model, mp_policy=mp.fsdp_mixed_precision())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(2):
        xb, yb = mp.to_device(x, y)
        with mp.autocast():
            loss = F.cross_entropy(model(xb).float(), yb)
        mp.step(loss, optimizer)
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize(("mode", "rtol"), [("fp32", 1e-6), ("bf16-mixed", 1.6e-2), ("bf16-true", 1.6e-2)])
def test_fsdp2_trains_like_the_same_mode_in_one_process(group_of_one, mode, rtol):
    """fp32 shards exactly; bf16-mixed under FSDP2 casts the weights once to bf16 where
    autocast would, so it stays within bf16's tolerance (Transformer Engine's rtol) of the
    unsharded run, through an optimizer step."""
    torch.manual_seed(0)
    model = Blocks()
    plain = two_steps(applied(mode), copy.deepcopy(model), shard=False)
    sharded = two_steps(applied(mode), copy.deepcopy(model), shard=True)
    assert all(v.dtype == torch.float32 for v in sharded)  # the loss runs in fp32, as in one process
    for a, b in zip(plain, sharded):
        assert math.isclose(float(a), float(b), rel_tol=rtol)
    assert float(sharded[1]) < float(sharded[0])  # it trained


def test_bf16_mixed_keeps_fp32_master_weights_under_fsdp2(group_of_one):
    from torch.distributed.fsdp import fully_shard

    mp = applied("bf16-mixed")
    model = mp.setup(Blocks())
    fully_shard(model, mp_policy=mp.fsdp_mixed_precision())
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the shards the optimizer steps


def test_setup_refuses_a_model_wrapped_before_it(group_of_one):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    with pytest.raises(MpadviseError, match="already wrapped in DistributedDataParallel; call mp.setup"):
        applied("bf16-true").setup(DistributedDataParallel(nn.Linear(4, 4)))
    sharded = nn.Linear(4, 4)
    fully_shard(sharded)
    with pytest.raises(MpadviseError, match="already sharded with fully_shard; call mp.setup"):
        applied("bf16-true").setup(sharded)


def test_setup_refuses_a_model_with_a_block_sharded_before_it(group_of_one):
    from torch.distributed.fsdp import fully_shard

    model = Blocks()
    fully_shard(model.blocks[1])
    with pytest.raises(MpadviseError, match="its module 'blocks.1' is already sharded with fully_shard; call mp.setup"):
        applied("bf16-mixed").setup(model)


# ---- a MixedPrecisionPolicy of the script's own ----------------------------------------------


def train_one_step(mp: AppliedPolicy, shard) -> None:
    """setup, shard as ``shard(model)`` says, one step: where a script's own policy is found."""
    model = mp.setup(Blocks())
    shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = mp.to_device(torch.randn(8, 32), torch.randint(0, 4, (8,)))
    with mp.autocast():
        loss = F.cross_entropy(model(x).float(), y)
    mp.step(loss, optimizer)


@pytest.mark.parametrize(("mode", "own", "said"), [
    # The "fp32" reference computing in bf16: the defect this check exists for.
    ("fp32", {"param_dtype": torch.bfloat16}, "mp_policy=MixedPrecisionPolicy(param_dtype=bf16), but the fp32 "
                                               "policy needs MixedPrecisionPolicy()"),
    ("bf16-mixed", {}, "mp_policy=MixedPrecisionPolicy(), but the bf16-mixed policy needs "
                       "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)"),
    ("bf16-mixed", {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16}, "reduce_dtype=bf16), but"),
    ("bf16-true", {"param_dtype": torch.float16}, "param_dtype=fp16"),
])
def test_a_scripts_own_fsdp_policy_is_refused_at_the_first_step(group_of_one, mode, own, said):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def shard(model):
        for block in model.blocks:
            fully_shard(block, mp_policy=MixedPrecisionPolicy(**own))
        fully_shard(model, mp_policy=MixedPrecisionPolicy(**own))

    mp = applied(mode)
    with pytest.raises(MpadviseError) as raised:
        train_one_step(mp, shard)
    message = str(raised.value)
    assert "\n" not in message and said in message
    assert message.startswith("fully_shard(model) was given mp_policy=")  # the first found, the root
    assert message.endswith("pass mp_policy=mp.fsdp_mixed_precision() to every fully_shard")
    assert mp.optimizer_steps == 0


def test_the_one_block_with_its_own_policy_is_named(group_of_one):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def shard(model):
        fully_shard(model.blocks[0], mp_policy=mp.fsdp_mixed_precision())
        fully_shard(model.blocks[1], mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
        fully_shard(model, mp_policy=mp.fsdp_mixed_precision())

    mp = applied("fp32")
    with pytest.raises(MpadviseError, match=r"^fully_shard\(blocks.1\) was given mp_policy=MixedPrecisionPolicy\(reduce_dtype=bf16\)"):
        train_one_step(mp, shard)


@pytest.mark.parametrize("mode", ["fp32", "bf16-mixed", "bf16-true", "fp16-mixed"])
def test_the_policys_own_fsdp_policy_trains(group_of_one, mode):
    from torch.distributed.fsdp import fully_shard

    def shard(model):
        for block in model.blocks:
            fully_shard(block, mp_policy=mp.fsdp_mixed_precision())
        fully_shard(model, mp_policy=mp.fsdp_mixed_precision())

    mp = applied(mode)
    train_one_step(mp, shard)
    assert mp.optimizer_steps == 1


def test_fp32_sharded_without_a_policy_is_fsdp2s_default_and_trains(group_of_one):
    from torch.distributed.fsdp import fully_shard

    mp = applied("fp32")
    train_one_step(mp, fully_shard)
    assert mp.optimizer_steps == 1


def test_no_fsdp_changes_nothing():
    mp = applied("bf16-mixed")
    train_one_step(mp, lambda model: None)
    assert mp.optimizer_steps == 1


def test_setup_then_ddp_keeps_the_bare_models_signature(group_of_one):
    from torch.nn.parallel import DistributedDataParallel

    from advisor.runtime import model_signature

    net = nn.Linear(4, 4)
    mp = applied("bf16-true")
    model = mp.setup(net)
    DistributedDataParallel(model)
    assert mp.model_signature == model_signature(nn.Linear(4, 4))


@pytest.mark.parametrize(("device", "local_rank", "expected"), [
    (None, "1", "cuda:1"),
    ("cuda", "3", "cuda:3"),
    ("cuda:0", "1", "cuda:0"),
    (None, None, "cuda:0"),
])
def test_each_process_of_a_node_takes_its_own_gpu(device, local_rank, expected):
    env = {} if local_rank is None else {"LOCAL_RANK": local_rank}
    assert rank_device(device, "cuda:0", env) == expected
    assert rank_device(None, "cpu", env) == "cpu"


# ---- the Policy field -----------------------------------------------------------------------


def test_reduce_dtype_round_trips_and_is_described():
    policy = Policy(mode="bf16-mixed", reduce_dtype="bf16", micro_batch_size=16, grad_accum_steps=2)
    assert Policy.from_toml(policy.to_toml()) == policy
    assert Policy.from_dict(policy.to_dict()) == policy
    assert 'reduce_dtype = "bf16"' in policy.to_toml()
    assert policy.describe() == "bf16-mixed (reduce in bf16) micro-batch 16 x 2"
    assert "reduce_dtype" not in Policy(mode="bf16-mixed").to_dict()


@pytest.mark.parametrize(("mode", "reduce", "needle"), [
    ("bf16-mixed", "int8", "reduce_dtype: 'int8' is not allowed; expected one of fp32, bf16, fp16"),
    ("fp32", "bf16", "reduce_dtype: 'bf16' does not apply to 'fp32'; expected fp32"),
    ("bf16-mixed", "fp16", "expected fp32 or bf16"),
])
def test_reduce_dtype_is_validated(mode, reduce, needle):
    with pytest.raises(PolicyError, match=needle.replace("(", r"\(")):
        Policy(mode=mode, reduce_dtype=reduce)
    with pytest.raises(PolicyError, match="config.toml"):
        Policy.from_toml(f'mode = "{mode}"\nreduce_dtype = "{reduce}"\n', source="config.toml")


# ---- the search dimension -------------------------------------------------------------------


def test_fsdp_adds_the_reduce_dimension_to_the_16_bit_modes_only():
    support = supported_modes(CPU)
    plain = space_for(support, 3, modes=["fp32", "bf16-mixed", "bf16-true"])
    sharded = space_for(support, 3, modes=["fp32", "bf16-mixed", "bf16-true"], fsdp=True)
    assert all(c.reduce_dtype is None for c in plain.grid())
    labels = [c.label for c in sharded.grid()]
    assert labels == ["fp32", "bf16-mixed reduce-fp32", "bf16-mixed reduce-bf16", "bf16-true reduce-fp32",
                      "bf16-true reduce-bf16"]
    # A candidate that leaves the dimension out takes the mode's default, named.
    assert sharded.normalise(Candidate("bf16-mixed", 3)) == Candidate("bf16-mixed", reduce_dtype="fp32")
    assert sharded.normalise(Candidate("bf16-true")).reduce_dtype == "bf16"
    assert plain.normalise(Candidate("bf16-mixed", reduce_dtype="bf16")).reduce_dtype is None
    assert Candidate("bf16-mixed", reduce_dtype="bf16").policy(3) == Policy(mode="bf16-mixed", reduce_dtype="bf16")
    assert Candidate("bf16-mixed", reduce_dtype="bf16").params() == {"mode": "bf16-mixed", "reduce_dtype": "16-bit"}


def test_the_sampler_proposes_and_replays_reduce_dtypes():
    space = space_for(supported_modes(CPU), 8, modes=["bf16-mixed", "fp16-mixed", "fp32"], fsdp=True)
    import optuna

    grid = set(space.grid())
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=4))
    wanted = [Candidate("bf16-mixed", reduce_dtype="bf16"), Candidate("fp16-mixed", 4, "static", 4096.0, reduce_dtype="fp16")]
    for cand in wanted:
        params = cand.params()
        params.setdefault("micro_batch", 8)
        study.enqueue_trial(params)
    for cand in wanted:  # an enqueued candidate comes back as itself
        trial = study.ask()
        assert _suggest(trial, space) == space.normalise(cand)
        study.tell(trial, 1.0)
    for _ in range(20):  # bf16 and fp16 modes share one categorical parameter without clashing
        trial = study.ask()
        cand = _suggest(trial, space)
        assert cand in grid
        assert trial.params.get("reduce_dtype", REDUCE_CHOICES[0]) in REDUCE_CHOICES
        study.tell(trial, 1.0)


class FsdpScriptRunner:
    """Pretends to run an FSDP2 script: every trial reports the script sharded with FSDP2."""

    def __init__(self, fsdp: bool) -> None:
        self.fsdp = fsdp
        self.policies: list[Policy] = []

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        self.policies.append(policy)
        ms = 10.0 if policy.mode == "fp32" else 5.0 if policy.reduce_dtype == "bf16" else 6.0
        losses = tuple(2.0 * math.exp(-i / 20) for i in range(40))
        return TrialResult(outcome="ok", label=label, policy=policy.to_dict(), losses=losses,
                           step_times=tuple([ms / 1e3] * 40), samples=tuple([64] * 40), skipped=(False,) * 40,
                           warmup_steps=3, user_batch=64, global_batch=64, fsdp=self.fsdp, ranks=2,
                           workload_fingerprint="ab" * 8, model_signature="cd" * 8)


@pytest.mark.parametrize("fsdp", [True, False])
def test_the_tune_searches_the_reduce_dtype_when_the_reference_says_fsdp(fsdp):
    runner = FsdpScriptRunner(fsdp)
    options = TuneOptions(trials=6, modes=("bf16-mixed",), scale_batch=False)
    result = tune_policy(runner, CPU, options, dtype_ratio={"fp32": 1.0, "bf16": 2.0}, remeasure=False)
    reduces = {p.reduce_dtype for p in runner.policies if p.mode == "bf16-mixed"}
    assert result.space.fsdp is fsdp
    assert result.to_dict()["space"]["fsdp"] is fsdp
    if fsdp:
        assert reduces == {"fp32", "bf16"}
        assert result.policy.reduce_dtype == "bf16"  # measured faster, and stable
    else:
        assert reduces == {None}
        assert result.policy.reduce_dtype is None
