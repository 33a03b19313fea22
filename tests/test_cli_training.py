"""The training checks from the command line: ``check --step MODULE:FN`` (alias
``--after-backward``), ``--optimizer`` and ``--steps`` reach the checks that train
(``CheckSpec.training``). A user's clip hook, written into a module file as users write it,
is caught when its norm is all-reduced twice and passes as a global clip; a bad optimizer
and a training option that no check would take are usage errors naming the option.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from dpverify import InvalidArgument
from dpverify.cli.main import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from dpverify.cli.user_model import user_model
from dpverify.models.training import OptimizerSpec

#: The user's module: a model, batches that follow torch's seed, two clip hooks (one reduces
#: the norm over the ranks although DDP averaged the gradients already), an optimizer factory.
USER_CODE = textwrap.dedent(
    '''
    import torch
    import torch.distributed as dist
    from torch import nn

    NOT_CALLABLE = 3


    def make():
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


    def batches(batch_size):
        return torch.randn(batch_size, 4), torch.randn(batch_size, 3)


    def fixed_batches(batch_size):
        return torch.ones(batch_size, 4), torch.zeros(batch_size, 3)


    def clip(ctx):
        torch.nn.utils.clip_grad_norm_(ctx.module.parameters(), 0.05)


    def clip_reduced_twice(ctx):
        params = [p for p in ctx.module.parameters() if p.grad is not None]
        squares = torch.stack([p.grad.pow(2).sum() for p in params]).sum()
        dist.all_reduce(squares, group=ctx.group)  # DDP averaged already: this sums W copies
        scale = (0.05 / (squares.sqrt() + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.mul_(scale)


    def nesterov(params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True)


    def not_an_optimizer(params):
        return list(params)
    '''
)
MODULE = "cli_training_user_code"
MODEL = [f"{MODULE}:make", "--inputs", f"{MODULE}:batches", "--backend", "ddp", "--batch-sizes", "4", "--devices", "2", "--no-color"]


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("user")
    (folder / f"{MODULE}.py").write_text(USER_CODE)
    return folder


@pytest.fixture(autouse=True)
def _in_user_dir(user_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the command line imports MODULE:FN from the current directory, as a user runs it
    monkeypatch.chdir(user_dir)
    monkeypatch.syspath_prepend(str(user_dir))


def _flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def _run(capsys: pytest.CaptureFixture[str], argv: list[str], expected: int) -> str:
    code = main(["check", *argv])
    captured = capsys.readouterr()
    assert code == expected, captured.out + captured.err
    return _flat(captured.out + captured.err)


# --------------------------------------------------------------------------- the hook


@pytest.mark.parametrize("option", ["--step", "--after-backward"])
def test_a_clip_whose_norm_is_reduced_twice_fails_from_the_command_line(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, [*MODEL, option, f"{MODULE}:clip_reduced_twice", "--checks", "ddp-training"], EXIT_FAILED)
    assert f"after backward: {MODULE}:clip_reduced_twice" in out  # the header
    assert "FAIL: training, 3 optimizer steps, B=4 on 2" in out
    assert "clip_reduced_twice(ctx) ran after every backward, on every rank and in the single-device run" in out
    assert "the table shows step 1" in out  # over-clipped from the first step on


def test_the_global_clip_passes_and_joins_the_default_checks(capsys: pytest.CaptureFixture[str]) -> None:
    # no --checks: the backend's training check runs beside the default ones
    out = _run(capsys, [*MODEL, "--step", f"{MODULE}:clip"], EXIT_OK)
    assert f"3 optimizer steps of SGD(lr=0.1, momentum=0.9) (the default), each on a batch of its own; after backward: {MODULE}:clip" in out
    assert "PASS training, 3 optimizer steps, B=4 on 2" in out
    assert "PASS DDP grads match one device, B=4 on 2" in out
    assert "OK: 2 passed, 0 failed" in out


def test_steps_set_the_optimizer_steps_the_check_trains(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, [*MODEL, "--step", f"{MODULE}:clip_reduced_twice", "--steps", "2", "--checks", "ddp-training"], EXIT_FAILED)
    assert "training checks: 2 optimizer steps of" in out
    assert "FAIL: training, 2 optimizer steps, B=4 on 2" in out
    # the check's own report: it trained and compared two steps
    assert "2 steps of DDP training with SGD(lr=0.1, momentum=0.9)" in out
    assert "Parameters, buffers and optimizer state compared after each of the 2 optimizer steps" in out


# SGD: Adam's update is unchanged when every step's gradient is scaled by the same factor,
# so a clip that always clips too much cannot show under Adam
@pytest.mark.parametrize(
    ("spelling", "named"),
    [("sgd:lr=0.05,weight_decay=0.01", "SGD(lr=0.05, weight_decay=0.01)"), (f"{MODULE}:nesterov", "nesterov")],
    ids=["built-in", "factory"],
)
def test_the_optimizer_reaches_the_check(spelling: str, named: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, [*MODEL, "--optimizer", spelling, "--step", f"{MODULE}:clip_reduced_twice", "--checks", "ddp-training"], EXIT_FAILED)
    shown = named if spelling.startswith("sgd") else spelling
    assert f"3 optimizer steps of {shown}, each on a batch of its own" in out
    assert f"3 steps of DDP training with {named} must match single-device training" in out


def test_the_header_says_when_every_step_trains_on_the_same_batch(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [f"{MODULE}:make", "--inputs", f"{MODULE}:fixed_batches", *MODEL[3:], "--step", f"{MODULE}:clip", "--checks", "ddp-training"]
    out = _run(capsys, argv, EXIT_OK)
    assert f"each on the same batch (--inputs {MODULE}:fixed_batches gave the same batch for two steps)" in out


# --------------------------------------------------------------------------- usage errors


@pytest.mark.parametrize(
    ("spelling", "message"),
    [
        ("rmsprop:lr=0.1", "'rmsprop' is not a built-in optimizer; write one of sgd, adam, adamw"),
        ("sgd:lr=fast", "lr='fast' is not a number"),
        ("sgd:betas=0.9", "'betas=0.9' is not one of lr=VALUE, momentum=VALUE, weight_decay=VALUE"),
        ("adam:momentum=0.9", "momentum=0.9 is SGD's"),
        ("sgd:lr=-1", "lr=-1.0 must be positive"),
        (f"{MODULE}:make", "raised TypeError"),
        (f"{MODULE}:not_an_optimizer", "returned list; pass a module-level function params -> Optimizer"),
        (f"{MODULE}:NOT_CALLABLE", "is int, not callable"),
        (f"{MODULE}:nowhere", f"{MODULE!r} has no attribute 'nowhere'"),
    ],
)
def test_a_bad_optimizer_is_a_usage_error_naming_it(spelling: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _run(capsys, [*MODEL, "--optimizer", spelling], EXIT_USAGE)
    assert f"--optimizer {spelling!r}" in err
    assert message in err
    assert "FAIL" not in err
    assert "Traceback (most recent call last)" not in err


@pytest.mark.parametrize("option", [["--step", f"{MODULE}:clip"], ["--steps", "2"], ["--optimizer", "sgd"]])
def test_a_training_option_no_training_check_takes_is_a_usage_error(option: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    err = _run(capsys, [*MODEL, *option, "--checks", "ddp-grads"], EXIT_USAGE)
    assert f"{option[0]} goes to the training checks (" in err
    assert "none of them runs with --backend ddp --checks ddp-grads: add ddp-training to --checks" in err


def test_a_step_that_is_not_callable_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    err = _run(capsys, [*MODEL, "--step", f"{MODULE}:NOT_CALLABLE"], EXIT_USAGE)
    assert f"--step '{MODULE}:NOT_CALLABLE' is int, not callable; pass a module-level function FN(ctx)" in err


# --------------------------------------------------------------------------- the pieces


def test_each_step_trains_on_a_batch_of_its_own_where_the_batch_follows_the_seed() -> None:
    drawn = user_model(f"{MODULE}:make", inputs_spec=f"{MODULE}:batches").step_batches(4, 3)
    assert torch.equal(drawn[0].inputs[0], user_model(f"{MODULE}:make", inputs_spec=f"{MODULE}:batches").make_batch(4).inputs[0])
    assert not torch.equal(drawn[0].inputs[0], drawn[1].inputs[0])
    assert not torch.equal(drawn[1].inputs[0], drawn[2].inputs[0])
    fixed = user_model(f"{MODULE}:make", inputs_spec=f"{MODULE}:fixed_batches").step_batches(4, 2)
    assert torch.equal(fixed[0].inputs[0], fixed[1].inputs[0])  # a function that ignores the seed


def test_an_optimizer_spec_prints_parses_and_builds_torchs_optimizer() -> None:
    spec = OptimizerSpec.parse("sgd:lr=0.05,momentum=0.9")
    assert spec == OptimizerSpec("sgd", 0.05, 0.9)
    assert OptimizerSpec.parse(str(spec)) == spec
    assert eval(repr(spec)) == spec
    assert OptimizerSpec.parse("adamw").lr == 1e-3
    made = spec.factory()([torch.zeros(2, requires_grad=True)])
    assert isinstance(made, torch.optim.SGD)
    assert made.defaults["momentum"] == 0.9
    with pytest.raises(InvalidArgument, match="name='rmsprop' is not one of"):
        OptimizerSpec("rmsprop")
