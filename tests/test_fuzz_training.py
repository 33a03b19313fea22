"""``dpverify fuzz --backend ...`` draws training runs (``training_scenarios``) on every
backend: each example runs the backend's one-step checks on its scenario and then its
training checks, with the drawn optimizer, clip and accumulation. A user's step that is right
in the first optimizer step and wrong from the second is found only by the training check,
and its repro script raises the same; a pipeline schedule that is wrong on a model tied
across stages is caught by the pipeline training check, and its script raises the same."""

from __future__ import annotations

import importlib
import runpy
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, given, settings

import dpverify.cli.fuzz as fuzz_module
from dpverify.cli.fuzz import (
    TRAINING_CHECKS,
    FuzzConfig,
    Outcome,
    _CheckFailed,
    _example_runner,
    _training_runs,
    describe_training,
    fuzz,
    repro_script,
    scenario_strategy,
)
from dpverify.core.errors import ParallelMismatch
from dpverify.models.layouts import PipelineLayout, ShardedScenario
from dpverify.models.specs import DeviceList, LossSpec, ModelSpec, Scenario
from dpverify.models.training import OptimizerSpec, TrainingScenario
from dpverify.mutants import UnscaledGPipe

#: A DDP step users write for a trainer that changes its loss after the first step: right in
#: step 1, and from step 2 on the loss is divided by the world size again.
PLANTED = textwrap.dedent(
    '''
    def late_halved_step(ctx):
        model = ctx.ddp()
        output = model(*ctx.inputs, **ctx.kwargs)
        loss = ctx.loss_fn(output, ctx.target) * ctx.loss_weight
        if ctx.step_index > 0:
            loss = loss / ctx.world_size
        loss.backward()
        return output
    '''
)


def test_every_backend_runs_the_registrys_training_checks() -> None:
    for backend in ("dp", "ddp", "fsdp", "tp", "pp"):
        assert TRAINING_CHECKS[backend] == (f"{backend}-training",)
        assert describe_training(backend).endswith(f"({backend}-training)")
        assert "a global clip" in describe_training(backend)
    assert TRAINING_CHECKS["all"] == ("dp-training", "ddp-training")
    # the session's header says what the training runs draw, and only that
    assert "no_sync() accumulation over 1 or 2 micro-batches (ddp-training)" in describe_training("ddp")
    assert "tied" in describe_training("pp")
    assert "accumulation" not in describe_training("dp") + describe_training("tp") + describe_training("fsdp")


@pytest.mark.timeout(240)
@pytest.mark.deep  # a session that finds and shrinks: about 25 s
def test_a_step_wrong_from_the_second_optimizer_step_is_caught_by_the_training_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "planted_training.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    step = importlib.import_module("planted_training").late_halved_step
    config = FuzzConfig(
        backend="ddp", devices=2, max_examples=12, seed=0, target="planted_training:late_halved_step", target_object=step, state_dir=tmp_path / "state",
    )
    report = fuzz(config)
    failure = report.failure
    assert failure is not None
    # the one-step gradient check passes it on every example; only training sees step 2
    assert failure.check == "ddp-training"
    assert isinstance(failure.scenario, TrainingScenario)
    assert failure.scenario.steps >= 2
    assert "the table shows step 2" in failure.report
    script = failure.repro.read_text()
    assert 'CHECKS["ddp-training"].check(Case.from_scenario(scenario), Target(step=target).with_defaults(**scenario.code()))' in script
    assert "from dpverify.models.training import OptimizerSpec, TrainingScenario" in script
    # the script's check raises what the session reported
    with pytest.raises(ParallelMismatch) as caught:
        runpy.run_path(str(failure.repro), run_name="repro")["main"]()
    assert str(caught.value).splitlines()[0] == failure.report.splitlines()[0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["dp", "ddp", "fsdp", "tp", "pp", "all"])
def test_torchs_own_training_passes_a_short_session(backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple[str, bool]] = []
    run_check = fuzz_module._run_check

    def spy(name: str, *args: Any) -> Outcome:
        outcome = run_check(name, *args)
        ran.append((name, outcome.parallel))
        return outcome

    monkeypatch.setattr(fuzz_module, "_run_check", spy)
    # seed 0's first DataParallel examples are one-row batches, which nothing runs in parallel
    seed, examples = (0, 3) if backend in ("dp", "all") else (1, 2)
    report = fuzz(FuzzConfig(backend=backend, devices=2, max_examples=examples, seed=seed, state_dir=tmp_path))
    assert report.ok, report.failure and report.failure.report
    assert report.examples == examples
    # every training check of the session trained in parallel, and passed
    assert {name for name, parallel in ran if parallel and name.endswith("-training")} == set(TRAINING_CHECKS[backend])


@pytest.mark.parametrize(
    ("check", "scenario", "field"),
    [
        ("ddp-training", TrainingScenario(Scenario(ModelSpec("mlp"), 4, DeviceList((0, 1))), OptimizerSpec("adam", 0.01), steps=2, clip=0.05, micro_batches=2), "step"),
        ("dp-training", TrainingScenario(Scenario(ModelSpec("mlp"), 5, DeviceList((2, 0, 1))), OptimizerSpec("sgd", 0.1, 0.9), clip=1.0, dp=True), "parallel"),
        (
            "pp-training",
            TrainingScenario(ShardedScenario(Scenario(ModelSpec("tied-sequential"), 4, DeviceList((0, 1))), PipelineLayout((2,), 2, "1f1b")), clip=0.05),
            "schedule",
        ),
    ],
)
def test_a_training_repro_script_pastes_its_scenario(check: str, scenario: TrainingScenario, field: str) -> None:
    script = repro_script(check, scenario, target=None)
    assert f"scenario = {scenario!r}" in script
    assert f"Target({field}=target).with_defaults(**scenario.code())" in script
    namespace: dict[str, object] = {}
    exec(script.split("\ndef main")[0], namespace)  # the imports and the scenario, without running it
    assert namespace["scenario"] == scenario


@pytest.mark.parametrize("backend", ["dp", "ddp", "fsdp", "tp", "pp", "all"])
def test_the_sessions_draw_optimizers_clips_and_accumulation(backend: str) -> None:
    seen: set[object] = set()

    @settings(database=None, max_examples=60, phases=[Phase.generate], deadline=None)
    @given(scenario_strategy(FuzzConfig(backend=backend, devices=2)))
    def draw(scenario: TrainingScenario) -> None:
        assert scenario.backend == ("dp" if backend == "all" else backend)
        assert scenario.world_size <= 2
        seen.update({
            scenario.optimizer.name, ("steps", scenario.steps), ("clip", scenario.clip is not None), ("k", scenario.micro_batches),
            scenario.plain.model.kind,
        })

    draw()
    # every backend clips; DDP alone accumulates under no_sync(); half the pipelines tie weights
    assert {"sgd", "adam", "adamw", ("steps", 3), ("clip", True)} <= seen
    assert (("k", 2) in seen) == (backend == "ddp")
    assert ("tied-sequential" in seen) == (backend == "pp")


def test_dataparallel_trains_models_without_state_of_their_own_and_all_adds_ddp() -> None:
    def trained(kind: str, backend: str) -> list[tuple[str, str]]:
        scenario = TrainingScenario(Scenario(ModelSpec(kind), 4, DeviceList((1, 0, 2))), clip=0.05, dp=True)
        return [(name, run.backend) for name, run in _training_runs(scenario, FuzzConfig(backend=backend, devices=2))]

    assert trained("mlp", "dp") == [("dp-training", "dp")]
    # the counters lose their state under DataParallel by design (dp-state checks that)
    assert trained("attribute-counter", "dp") == []
    # under all, DDP's training check too, on --devices ranks
    assert trained("mlp", "all") == [("dp-training", "dp"), ("ddp-training", "ddp")]
    scenario = TrainingScenario(Scenario(ModelSpec("mlp"), 4, DeviceList((1, 0, 2))), clip=0.05, dp=True)
    ddp = _training_runs(scenario, FuzzConfig(backend="all", devices=2))[1][1]
    assert ddp.plain.devices == DeviceList((0, 1))
    assert ddp.clip == 0.05
    assert not ddp.dp


def test_a_schedule_wrong_on_a_tied_pipeline_is_caught_by_the_training_check(tmp_path: Path) -> None:
    """GPipe that never divides by its microbatches on a model whose embedding the last stage
    shares: the one-step check is not run (no one step makes tied gradients whole), the
    training check catches it, and the repro script raises the same."""
    model = ModelSpec("tied-sequential", features=3, hidden=4, depth=1, train=False)
    plain = Scenario(model, 4, DeviceList((0, 1)), LossSpec("mse"))
    # a clip that never engages (one that does would rescale the wrong gradient to its norm),
    # so that the hook is pipeline_clip, summing the tied copies
    scenario = TrainingScenario(ShardedScenario(plain, PipelineLayout((2,), 2, "gpipe")), OptimizerSpec("sgd", 0.1), steps=2, clip=100.0)
    config = FuzzConfig(backend="pp", devices=2, target="dpverify.mutants:UnscaledGPipe", target_object=UnscaledGPipe)
    with pytest.raises(_CheckFailed) as caught:
        _example_runner(config)(scenario)
    assert caught.value.check == "pp-training"
    assert "pipeline_clip(max_norm=100.0)" in caught.value.result.detail
    path = tmp_path / "repro.py"
    path.write_text(repro_script("pp-training", scenario, target=config.target, path=path))
    with pytest.raises(ParallelMismatch) as again:
        runpy.run_path(str(path), run_name="repro")["main"]()
    assert str(again.value).splitlines()[0] == caught.value.result.detail.splitlines()[0]


def test_one_example_runs_the_one_step_checks_then_the_training_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "planted_training.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    step = importlib.import_module("planted_training").late_halved_step
    example = _example_runner(FuzzConfig(backend="ddp", devices=2, target="planted_training:late_halved_step", target_object=step))
    scenario = TrainingScenario(Scenario(ModelSpec("mlp", train=False), 4, DeviceList((0, 1))), OptimizerSpec("sgd", 0.1), steps=2, clip=1.0)
    assert example(scenario.scenario).parallel  # one step: right
    with pytest.raises(_CheckFailed) as caught:
        example(scenario)
    assert caught.value.check == "ddp-training"
    assert caught.value.scenario == scenario
    assert "global_clip(max_norm=1.0)(ctx) ran after every backward" in caught.value.result.detail
    assert "the table shows step 2" in caught.value.result.detail
