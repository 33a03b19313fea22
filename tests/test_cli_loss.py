"""The user's own loss and options on the command line: ``--loss MODULE:FN``,
``--output-key``, ``--ddp-kwargs`` and ``--checks all``; and a loss that cannot be applied,
or an output that cannot be read, is a usage error (exit 2) naming the option to change,
never a FAIL (exit 1 means only that the parallel step differs).

The user code is ``tests/cli_loss_code.py`` (the tests directory is on sys.path).
"""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpverify import InvalidArgument, assert_dp_grads_match
from dpverify.cli.fuzz import FuzzConfig, repro_script
from dpverify.cli.main import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from dpverify.cli.user_model import select_output
from dpverify.models.specs import DeviceList, LossSpec, ModelSpec, Scenario
from dpverify.registry import CHECKS, Case, Verdict

LM = ["cli_loss_code:token_lm", "--inputs", "cli_loss_code:token_batches"]
TOKEN_CE = ["--loss", "cli_loss_code:token_ce"]
DICT = ["cli_loss_code:dict_model", "--inputs", "cli_loss_code:dict_batches"]
#: even and uneven chunks
SPLITS = ["--batch-sizes", "8", "5", "--devices", "2", "4", "--no-color"]


def _flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def _usage(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Runs ``argv``, which must be a usage error; its stderr, with no raw traceback in it
    (only the user's own frames, when the user's code raised)."""
    assert main(argv) == EXIT_USAGE
    captured = capsys.readouterr()
    assert "Traceback (most recent call last):" not in captured.err + captured.out
    assert "FAIL" not in captured.out
    return " ".join(captured.err.split())


# --- --loss MODULE:FN ------------------------------------------------------------------------


def test_a_token_lm_passes_with_its_own_loss(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", *LM, *TOKEN_CE, *SPLITS]) == EXIT_OK
    out = _flat(capsys.readouterr().out)
    assert "loss: cli_loss_code:token_ce" in out
    assert "FAIL" not in out
    # two checks on four splits, every one of them compared
    assert out.count("PASS") >= 8


def test_a_token_lm_without_its_loss_is_a_usage_error_naming_loss(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage(capsys, ["check", *LM, *SPLITS])
    assert "--loss MODULE:FN" in err
    assert "cross_entropy" in err  # the loss that could not be applied
    assert "tensor 2x7x13" in err  # the output it could not be applied to


@pytest.mark.parametrize("loss", [[], TOKEN_CE], ids=["default-loss", "token-ce"])
def test_explain_takes_the_loss_too(loss: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    if not loss:
        assert "--loss MODULE:FN" in _usage(capsys, ["explain", *LM, "--no-color"])
        return
    assert main(["explain", *LM, *loss, "--no-color"]) == EXIT_OK
    captured = capsys.readouterr()
    assert "loss: cli_loss_code:token_ce" in _flat(captured.out)
    assert "Traceback" not in captured.err


@pytest.mark.parametrize(
    ("loss", "message"),
    [
        ("cli_loss_code:NOT_CALLABLE", "--loss 'cli_loss_code:NOT_CALLABLE' is int, not callable"),
        ("cli_loss_code:nowhere", "--loss 'cli_loss_code:nowhere': 'cli_loss_code' has no attribute 'nowhere'"),
        ("huber", "--loss 'huber' is not one of"),
        ("cli_loss_code:raising_loss", "ValueError: this loss is broken"),
        ("cli_loss_code:per_row_loss", "must return one floating-point value"),
    ],
)
def test_a_loss_that_cannot_be_used_is_a_usage_error(loss: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage(capsys, ["check", *DICT, "--output-key", "pred", "--loss", loss, *SPLITS])
    assert message in err
    assert "--loss" in err


def test_loss_and_output_key_belong_to_a_factory(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--output-key apply to MODULE:FACTORY" in _usage(capsys, ["check", "--model", "mlp", "--output-key", "pred"])


# --- --output-key ----------------------------------------------------------------------------


@pytest.mark.parametrize("inputs", [True, False], ids=["inputs", "inferred-batch"])
def test_a_dict_output_without_output_key_is_a_usage_error_listing_its_keys(inputs: bool, capsys: pytest.CaptureFixture[str]) -> None:
    model = DICT if inputs else DICT[:1]
    err = _usage(capsys, ["check", *model, *SPLITS])
    assert "['pred', 'aux']" in err
    assert "--output-key KEY" in err


@pytest.mark.parametrize("inputs", [True, False], ids=["inputs", "inferred-batch"])
def test_output_key_names_the_output_the_loss_applies_to(inputs: bool, capsys: pytest.CaptureFixture[str]) -> None:
    model = DICT if inputs else DICT[:1]
    assert main(["check", *model, "--output-key", "pred", *SPLITS]) == EXIT_OK
    out = _flat(capsys.readouterr().out)
    assert "loss: mse on output 'pred'" in out
    assert "FAIL" not in out


def test_explain_reads_the_output_key(capsys: pytest.CaptureFixture[str]) -> None:
    # the auxiliary head gets no gradient from a loss on 'pred': explain must not trip on it
    assert main(["explain", *DICT, "--output-key", "pred", "--no-color"]) == EXIT_OK
    assert "loss: mse on output 'pred'" in _flat(capsys.readouterr().out)


def test_an_unknown_output_key_lists_the_keys(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage(capsys, ["check", *DICT, "--output-key", "logits", *SPLITS])
    assert "--output-key 'logits': the forward returned a mapping with keys ['pred', 'aux']" in err


def test_a_tuple_output_takes_the_first_element_unless_output_key_says(capsys: pytest.CaptureFixture[str]) -> None:
    # the first element has 6 features and the target 3: the loss cannot take it
    err = _usage(capsys, ["check", "cli_loss_code:pair", "--inputs", "cli_loss_code:dict_batches", *SPLITS])
    assert "--output-key INDEX" in err
    assert main(["check", "cli_loss_code:pair", "--inputs", "cli_loss_code:dict_batches", "--output-key", "1", *SPLITS]) == EXIT_OK


def test_output_key_on_a_forward_that_returns_its_loss_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # the keyword model computes its own loss from labels: no loss is applied to an output
    argv = ["check", "cli_keywords_code:token_model", "--inputs", "cli_keywords_code:padded_labels", "--output-key", "logits"]
    assert "this forward returns its own loss" in _usage(capsys, argv)


def test_select_output_reads_keys_fields_and_indices() -> None:
    a, b = torch.zeros(1), torch.ones(1)
    Out = namedtuple("Out", ["logits", "extra"])
    assert select_output({"pred": a, "aux": b}, "aux") is b
    assert select_output(Out(a, b), "extra") is b
    assert select_output((a, b), "1") is b
    assert select_output([a, b], "-2") is a
    with pytest.raises(InvalidArgument, match="pass an index from 0 to 1"):
        select_output((a, b), "2")
    with pytest.raises(InvalidArgument, match=r"or a field of \['logits', 'extra'\]"):
        select_output(Out(a, b), "missing")
    with pytest.raises(InvalidArgument, match="leave --output-key out"):
        select_output(a, "pred")


# --- a setup problem is no FAIL --------------------------------------------------------------


def _token_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(13, 8), nn.Linear(8, 13))
    ids = torch.randint(0, 13, (6, 7))
    return model, ids, ids.clone()


def test_a_loss_that_fails_on_one_device_is_an_invalid_argument_not_a_mismatch() -> None:
    model, ids, labels = _token_case()
    # cross_entropy on (B, T, V) logits wants (B, V, ...) : it fails on one device as on two
    with pytest.raises(InvalidArgument, match="the single-device step raised too, so this is no parallel mismatch") as caught:
        assert_dp_grads_match(model, ids, labels, loss_fn=F.cross_entropy, device_ids=[0, 1])
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_the_registry_stops_on_a_setup_problem_instead_of_failing() -> None:
    model, ids, labels = _token_case()
    case = Case(model, (ids,), labels, F.cross_entropy, (0, 1))
    with pytest.raises(InvalidArgument, match="--loss MODULE:FN"):
        CHECKS["dp-grads"].run(case)
    # the same model with a loss it takes: compared, and passed
    token = Case(model, (ids,), labels, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()), (0, 1))
    assert CHECKS["dp-grads"].run(token).verdict is Verdict.PASS


def test_a_wrapper_that_raises_only_in_parallel_still_fails(capsys: pytest.CaptureFixture[str]) -> None:
    class Raising(nn.DataParallel):  # type: ignore[type-arg]
        def forward(self, *inputs: object, **kwargs: object) -> object:
            raise RuntimeError("the wrapper broke")

    model, ids, labels = _token_case()
    case = Case(model, (ids,), labels, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()), (0, 1))
    from dpverify.registry import Target

    result = CHECKS["dp-grads"].run(case, Target(parallel=Raising))
    assert result.verdict is Verdict.FAIL
    assert "the wrapper broke" in result.summary


def test_a_wrapper_that_reduces_replica_losses_is_pointed_at_parallel_loss_and_reduce(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage(capsys, ["check", "--model", "loss-in-forward", "--parallel", "cli_loss_code:ReducingParallel", "--batch-sizes", "4", "--devices", "2", "--no-color"])
    assert "returned one loss for 2 replicas: the wrapper reduces the replica losses itself" in err
    assert "--parallel-loss" in err
    assert "reduce=" in err


# --- --checks all ----------------------------------------------------------------------------


def test_checks_all_runs_every_check_that_applies(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--model", "loss-in-forward", "--checks", "all", "--batch-sizes", "4", "--devices", "2", "--no-color"]) == EXIT_OK
    default = _flat(capsys.readouterr().out)
    assert main(["check", "cli_loss_code:dict_model", "--output-key", "pred", "--checks", "all", "--batch-sizes", "4", "--devices", "2", "--no-color"]) == EXIT_OK
    assert "PASS" in _flat(capsys.readouterr().out)
    assert "loss.mean() of replica losses" in default


def test_checks_all_is_listed_and_accepted() -> None:
    from dpverify.cli.main import _parser

    args = _parser().parse_args(["check", "--model", "mlp", "--checks", "all"])
    assert args.checks == ["all"]


# --- --ddp-kwargs ----------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_ddp_kwargs_gives_ddp_the_fix_its_message_recommends(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch.distributed")
    argv = ["check", "cli_loss_code:unused_parameter", "--backend", "ddp", "--batch-sizes", "4", "--devices", "2", "--no-color"]
    assert main(argv) == EXIT_FAILED
    advice = _flat(capsys.readouterr().out)
    assert "--ddp-kwargs find_unused_parameters=true" in advice
    assert main([*argv, "--ddp-kwargs", "find_unused_parameters=true"]) == EXIT_OK
    out = _flat(capsys.readouterr().out)
    assert "PASS DDP grads match one device" in out or "OK: 1 passed" in out


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("find_unused_paramters=true", "DistributedDataParallel takes no keyword 'find_unused_paramters'; choose from"),
        ("device_ids=1", "each rank sets 'device_ids' itself"),
    ],
)
def test_ddp_kwargs_are_checked_against_ddp(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["check", "cli_loss_code:unused_parameter"], ["fuzz", "--max-examples", "1"]):
        assert message in _usage(capsys, [*command, "--backend", "ddp", "--ddp-kwargs", value])


def test_ddp_kwargs_need_a_backend_that_runs_ddp(capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["check", "cli_loss_code:unused_parameter"], ["fuzz", "--max-examples", "1"]):
        err = _usage(capsys, [*command, "--backend", "dp", "--ddp-kwargs", "static_graph=true"])
        assert "--ddp-kwargs goes to DistributedDataParallel, which --backend dp does not run" in err


@pytest.mark.parametrize("value", ["find_unused_parameters", "broadcast_buffers=maybe", ","])
def test_malformed_ddp_kwargs_are_refused_by_the_parser(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["check", "cli_loss_code:unused_parameter", "--backend", "ddp", "--ddp-kwargs", value])
    assert exited.value.code == EXIT_USAGE
    assert "--ddp-kwargs" in capsys.readouterr().err


def test_ddp_kwargs_parse_to_values() -> None:
    from dpverify.cli.main import _parser

    args = _parser().parse_args(["check", "--ddp-kwargs", "find_unused_parameters=true, broadcast_buffers=False,bucket_cap_mb=2.5"])
    assert args.ddp_kwargs == {"find_unused_parameters": True, "broadcast_buffers": False, "bucket_cap_mb": 2.5}


def test_fuzz_keeps_ddp_kwargs_in_its_repro_script_and_database_key() -> None:
    scenario = Scenario(ModelSpec(), 4, DeviceList((0, 1)), LossSpec())
    script = repro_script("ddp-grads", scenario, target=None, ddp_kwargs={"find_unused_parameters": True})
    assert "Target(step=target, ddp_kwargs={'find_unused_parameters': True})" in script
    compile(script, "repro.py", "exec")
    plain = FuzzConfig(backend="ddp")
    assert FuzzConfig(backend="ddp", ddp_kwargs=(("find_unused_parameters", True),)).database_key != plain.database_key


# --- verify --loss ---------------------------------------------------------------------------


def test_verify_takes_a_loss_for_the_models_it_fits(capsys: pytest.CaptureFixture[str]) -> None:
    from dpverify.cli.main import _parser, _verify_model
    from dpverify.cli.user_model import OutputLoss

    assert main(["verify", "--loss", "cli_loss_code:smoothed_ce", "--models", "conv", "loss-in-forward"]) == EXIT_OK
    assert capsys.readouterr().out.splitlines()[-1].startswith("OK: ")
    args = _parser().parse_args(["verify", "--loss", "cli_loss_code:smoothed_ce"])
    batch = _verify_model("conv", args).make_batch(4)
    assert isinstance(batch.loss_fn, OutputLoss)
    assert batch.loss_fn.fn.__name__ == "smoothed_ce"
    assert batch.loss_name == "cli_loss_code:smoothed_ce"
    # a forward that returns its loss keeps it
    assert _verify_model("loss-in-forward", args).make_batch(4).loss_fn is None


def test_verify_with_a_loss_a_model_cannot_take_names_loss_and_models(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage(capsys, ["verify", "--loss", "cli_loss_code:token_ce"])
    assert "built-in model 'mlp'" in err
    assert "--models" in err
    assert "cli_loss_code:token_ce" in err


def test_fuzz_gives_ddp_kwargs_to_every_ddp_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from dpverify.cli import fuzz
    from dpverify.registry import Target

    seen: list[tuple[str, Target]] = []

    def record(name: str, scenario: object, target: Target) -> fuzz.Outcome:
        seen.append((name, target))
        return fuzz.Outcome()

    monkeypatch.setattr(fuzz, "_run_check", record)
    config = FuzzConfig(backend="ddp", devices=2, ddp_kwargs=(("find_unused_parameters", True),))
    fuzz._example_runner(config)(Scenario(ModelSpec(), 4, DeviceList((0, 1)), LossSpec()))
    assert [name for name, _ in seen] == list(fuzz.DDP_CHECKS)
    assert all(target.ddp_kwargs == {"find_unused_parameters": True} for _, target in seen)


# --- fuzz --loss -----------------------------------------------------------------------------


def test_fuzz_uses_the_users_loss(tmp_path: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import cli_loss_code

    monkeypatch.chdir(str(tmp_path))
    cli_loss_code.CALLS.clear()
    # one worker: the loss counts its calls in this process
    assert main(["fuzz", "--loss", "cli_loss_code:counted_mse", "--max-examples", "5", "--seed", "2", "--workers", "1", "--no-color"]) == EXIT_OK
    assert "with loss cli_loss_code:counted_mse" in _flat(capsys.readouterr().out)
    assert cli_loss_code.CALLS  # the checks called it


@pytest.mark.deep
def test_fuzz_with_a_builtin_loss_name_draws_that_loss(capsys: pytest.CaptureFixture[str]) -> None:
    from hypothesis import find
    from hypothesis.errors import NoSuchExample

    from dpverify.cli.fuzz import scenario_strategy
    from dpverify.models.training import TrainingScenario

    # each example is a DataParallel training run of a drawn scenario
    drawn = find(scenario_strategy(FuzzConfig(loss="l1")), lambda s: True)
    assert isinstance(drawn, TrainingScenario)
    assert drawn.plain.loss.name == "l1"
    with pytest.raises(NoSuchExample):  # no other loss is ever drawn
        find(scenario_strategy(FuzzConfig(loss="l1")), lambda s: s.plain.loss.name != "l1")


def test_fuzz_refuses_a_loss_it_cannot_apply(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage(capsys, ["fuzz", "--loss", "cli_loss_code:token_ce", "--max-examples", "1"])
    assert "--loss cli_loss_code:token_ce cannot be applied to a drawn model's output" in err
    err = _usage(capsys, ["fuzz", "--loss", "cli_loss_code:huber", "--backend", "fsdp", "--max-examples", "1"])
    assert "--loss applies to --backend dp, ddp or all" in err


def test_fuzz_repro_script_imports_the_users_loss() -> None:
    scenario = Scenario(ModelSpec(), 4, DeviceList((0, 1)), LossSpec())
    script = repro_script("dp-grads", scenario, target=None, loss="cli_loss_code:huber")
    assert "from cli_loss_code import huber as loss" in script
    assert 'CHECKS["dp-grads"].check(with_user_loss(Case.from_scenario(scenario), loss), Target(parallel=target))' in script
    compile(script, "repro.py", "exec")
    assert FuzzConfig(loss="cli_loss_code:huber", loss_object=len).database_key != FuzzConfig().database_key
