"""``dpverify fuzz --backend ddp`` and ``fsdp`` draw training runs (``training_scenarios``):
each example runs the backend's one-step checks on its scenario and then its training checks,
with the drawn optimizer, clip and accumulation. A user's step that is right in the first
optimizer step and wrong from the second is found only by the training check, and its repro
script raises the same."""

from __future__ import annotations

import importlib
import runpy
import textwrap
from pathlib import Path

import pytest
from hypothesis import Phase, given, settings

from dpverify.cli.fuzz import (
    TRAINING_CHECKS,
    FuzzConfig,
    _CheckFailed,
    _example_runner,
    describe_training,
    fuzz,
    repro_script,
    scenario_strategy,
)
from dpverify.core.errors import ParallelMismatch
from dpverify.models.specs import DeviceList, ModelSpec, Scenario
from dpverify.models.training import OptimizerSpec, TrainingScenario

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


def test_the_training_backends_run_the_registrys_training_checks() -> None:
    assert TRAINING_CHECKS["ddp"] == ("ddp-training",)
    assert TRAINING_CHECKS["fsdp"] == ("fsdp-training",)
    # the session's header says what the training runs draw, and only that
    assert describe_training("ddp").endswith("a global clip, no_sync() accumulation (ddp-training)")
    assert "clip" not in describe_training("fsdp")


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
@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_torchs_own_training_passes_a_short_session(backend: str, tmp_path: Path) -> None:
    report = fuzz(FuzzConfig(backend=backend, devices=2, max_examples=2, seed=1, state_dir=tmp_path))
    assert report.ok, report.failure and report.failure.report
    assert report.examples == 2


def test_a_training_repro_script_pastes_its_scenario() -> None:
    scenario = TrainingScenario(Scenario(ModelSpec("mlp"), 4, DeviceList((0, 1))), OptimizerSpec("adam", 0.01), steps=2, clip=0.05, micro_batches=2)
    script = repro_script("ddp-training", scenario, target=None)
    assert f"scenario = {scenario!r}" in script
    assert "Target(step=target).with_defaults(**scenario.code())" in script
    namespace: dict[str, object] = {}
    exec(script.split("\ndef main")[0], namespace)  # the imports and the scenario, without running it
    assert namespace["scenario"] == scenario


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_the_sessions_draw_optimizers_clips_and_accumulation(backend: str) -> None:
    seen: set[object] = set()

    @settings(database=None, max_examples=60, phases=[Phase.generate], deadline=None)
    @given(scenario_strategy(FuzzConfig(backend=backend, devices=2)))
    def draw(scenario: TrainingScenario) -> None:
        assert scenario.backend == backend
        assert scenario.world_size == 2
        assert scenario.plain.batch_size >= scenario.micro_batches * 2
        seen.update({scenario.optimizer.name, ("steps", scenario.steps), ("clip", scenario.clip is not None), ("k", scenario.micro_batches)})

    draw()
    # DDP accumulates and clips; FSDP2 does neither (see _CLIP_NORMS)
    assert {"sgd", "adam", "adamw", ("steps", 3)} <= seen
    assert (("clip", True) in seen, ("k", 2) in seen) == ((True, True) if backend == "ddp" else (False, False))


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
