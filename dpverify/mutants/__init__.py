"""A catalogue of real data-parallel bugs, and correct implementations to compare with
(docs/mutants.md).

Each mutant is a small, readable implementation with one bug that people really make, in
the shape the code under test takes (``Mutant.kind``): a DataParallel-signature wrapper, a
criterion wrapper, a reduction of per-replica losses, a per-rank DDP or FSDP2 step, a
tensor-parallel plan builder or a pipeline schedule class, passed to a registry check as
``Mutant.target``. ``MUTANTS`` describes them all: the bug, the registry check that catches
it (``dpverify.registry.CHECKS``), and a phrase the failure message contains; ``PROPERTIES``
gives each of those checks the random scenarios it runs on, and ``EXACT_PROPERTIES`` the
gradient checks of every backend in exact mode (``Case.exact``) on
``exact_scenarios``, where the one-ulp mutants (``Mutant.exact``), which move one element
of one reduced gradient by one unit in the last place, are caught. The data path's and the
evaluation loop's mutants (kinds ``"loader"`` and ``"eval"``) are caught by the registry
checks ``"ddp-data"`` and ``"ddp-metric"`` on ``DataScenario``s, passed as ``Target.loader``
and ``Target.evaluate``. The implementations live in ``dp``,
``ddp``, ``sharded``, ``training`` and ``data``; every name is exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import hypothesis.strategies as st
from hypothesis.strategies import SearchStrategy

from dpverify.data.samples import LoaderFactory
from dpverify.models.data import DataScenario
from dpverify.models.layouts import ShardedScenario
from dpverify.models.specs import KINDS
from dpverify.mutants.data import (
    drop_last_eval_loader,
    fixed_rank_loader,
    gather_trim_eval,
    integer_mean_eval,
    mean_of_rank_means_eval,
    no_set_epoch_loader,
    padded_loader,
    padded_sum_eval,
    same_shuffle_loader,
    sum_count_eval,
    unpadded_loader,
)
from dpverify.mutants.ddp import (
    double_accumulation_division_step,
    forward_outside_no_sync_step,
    manual_allreduce_step,
    one_ulp_comm_hook_step,
    rank_seeded_init_step,
    same_seed_ranks_step,
    summed_allreduce_step,
    summed_loss_step,
    sync_first_micro_batch_step,
    undivided_accumulation_step,
    zero_grad_in_loop_step,
)
from dpverify.mutants.dp import (
    AveragingDataParallel,
    BalancedDropsChunkDataParallel,
    BalancedOffsetDataParallel,
    DeepCopyDataParallel,
    DetachedReplicasDataParallel,
    LastReplicaBuffersDataParallel,
    LocalBatchStatistic,
    LostForwardState,
    MeanCriterionParallel,
    OneUlpDataParallel,
    OutputDeviceFirstDataParallel,
    ReplicaOutputsDataParallel,
    ReversedGatherDataParallel,
    ScratchDataParallel,
    TinyErrorDataParallel,
    WeightedCriterionParallel,
    mean_of_replica_losses,
    weighted_replica_losses,
)
from dpverify.mutants.sharded import (
    LocalOutputColwiseParallel,
    NoAllReduceRowwiseParallel,
    OneUlpGPipe,
    OneUlpRowwiseParallel,
    SkipLastMicrobatchGPipe,
    UnscaledGPipe,
    averaged_tied_grads_hook,
    fsdp_one_ulp_step,
    fsdp_summed_loss_step,
    fsdp_undivided_step,
    fsdp_wrong_weight_step,
    local_output_plan,
    no_allreduce_plan,
    one_ulp_plan,
    tp_global_clip,
    tp_one_rank_clip,
)
from dpverify.mutants.training import (
    CLIP_NORM,
    LocalBatchOffset,
    clip_reduced_twice,
    local_batch_offset,
    local_shard_clip,
)
from dpverify.registry import CHECKS, MICRO_BATCHES, Case, Target
from dpverify.strategies import (
    Scenario,
    data_scenarios,
    device_lists,
    exact_scenarios,
    loss_specs,
    model_specs,
    scenarios,
    sharded_scenarios,
)

__all__ = [
    "CLIP_NORM",
    "EXACT_PROPERTIES",
    "MUTANTS",
    "PROPERTIES",
    "AveragingDataParallel",
    "BalancedDropsChunkDataParallel",
    "BalancedOffsetDataParallel",
    "DeepCopyDataParallel",
    "DetachedReplicasDataParallel",
    "LastReplicaBuffersDataParallel",
    "LocalBatchOffset",
    "LocalBatchStatistic",
    "LocalOutputColwiseParallel",
    "LostForwardState",
    "MeanCriterionParallel",
    "Mutant",
    "NoAllReduceRowwiseParallel",
    "OneUlpDataParallel",
    "OneUlpGPipe",
    "OneUlpRowwiseParallel",
    "OutputDeviceFirstDataParallel",
    "Property",
    "ReplicaOutputsDataParallel",
    "ReversedGatherDataParallel",
    "ScratchDataParallel",
    "SkipLastMicrobatchGPipe",
    "TinyErrorDataParallel",
    "UnscaledGPipe",
    "WeightedCriterionParallel",
    "averaged_tied_grads_hook",
    "clip_reduced_twice",
    "double_accumulation_division_step",
    "drop_last_eval_loader",
    "fixed_rank_loader",
    "forward_outside_no_sync_step",
    "fsdp_one_ulp_step",
    "fsdp_summed_loss_step",
    "fsdp_undivided_step",
    "fsdp_wrong_weight_step",
    "gather_trim_eval",
    "integer_mean_eval",
    "local_batch_offset",
    "local_output_plan",
    "local_shard_clip",
    "manual_allreduce_step",
    "mean_of_rank_means_eval",
    "mean_of_replica_losses",
    "no_allreduce_plan",
    "no_set_epoch_loader",
    "one_ulp_comm_hook_step",
    "one_ulp_plan",
    "padded_loader",
    "padded_sum_eval",
    "rank_seeded_init_step",
    "same_seed_ranks_step",
    "same_shuffle_loader",
    "sum_count_eval",
    "summed_allreduce_step",
    "summed_loss_step",
    "sync_first_micro_batch_step",
    "tp_global_clip",
    "tp_one_rank_clip",
    "undivided_accumulation_step",
    "unpadded_loader",
    "weighted_replica_losses",
    "zero_grad_in_loop_step",
]


# --------------------------------------------------------------------------- properties


def _runs(name: str, exact: bool = False) -> Callable[[Scenario | ShardedScenario], bool]:
    """Whether registry check ``name`` runs on a scenario (in exact mode when ``exact``): a
    property draws only those, so a scenario the check does not apply to (an eval-mode
    buffer counter for the buffer check) or skips (a one-row BatchNorm chunk, fewer rows
    than ranks) is never a false catch."""
    spec = CHECKS[name]

    def runs(scenario: Scenario | ShardedScenario) -> bool:
        return spec.why_not(replace(Case.from_scenario(scenario), exact=exact)) is None

    return runs


def _equal_micro_batches(scenario: Scenario) -> bool:
    # equal shards of equal micro-batches: the common case, where a missing 1/k shows as a
    # clean factor the message can name
    return scenario.batch_size % (MICRO_BATCHES * len(scenario.devices.device_ids)) == 0


def _tied_embedding(scenario: ShardedScenario) -> ShardedScenario:
    """The scenario with its ``sequential`` model made ``tied-sequential``: as many
    children (its layout stands), the first an embedding and the last sharing its weight."""
    plain = scenario.scenario
    return replace(scenario, scenario=replace(plain, model=replace(plain.model, kind="tied-sequential")))


@dataclass(frozen=True)
class Property:
    """A registry check over random scenarios: the check's name (a key of ``CHECKS``) and
    the scenarios it draws. Hypothesis lives here, not in the registry, so that importing
    the engine never imports it. ``code``: the correct code the check runs where the code
    under test leaves a field None and the check has no default of its own (the metric
    check's evaluation loop). ``exact``: the check runs in exact mode (``Case.exact``:
    dyadic float64 copies, every operation shown exact, no tolerance)."""

    check: str
    scenarios: SearchStrategy[Scenario] | SearchStrategy[ShardedScenario] | SearchStrategy[DataScenario]
    code: Target = field(default_factory=Target)
    exact: bool = False

    def run(self, scenario: Scenario | ShardedScenario | DataScenario, target: Target | None = None) -> None:
        """``CHECKS[check].check`` on one scenario against ``target`` (default: torch's own);
        raises what the check raises (``ParallelMismatch`` when the code under test is caught)."""
        __tracebackhide__ = True
        given = {name: value for name, value in vars(self.code).items() if value is not None}
        case = Case.from_scenario(scenario)
        CHECKS[self.check].check(replace(case, exact=True) if self.exact else case, (target or Target()).with_defaults(**given))


def _judged_on_its_merits(scenario: DataScenario) -> bool:
    """Whether torch's construction of ``scenario`` is one the data-path check passes, padding
    accepted: no ``drop_last`` (a loader that drops samples can leave the same ones out of
    every epoch, which fails by design; tests/test_properties_data.py covers those)."""
    return not (scenario.drop_last or scenario.loader_drop_last)


def _evaluation(scenario: DataScenario) -> DataScenario:
    """The scenario's loader as an evaluation builds it: no ``drop_last`` (every sample seen)."""
    return replace(scenario, drop_last=False, loader_drop_last=False)


def _data_properties() -> dict[str, Property]:
    return {
        # the training loader over 1 to 3 epochs, on 2 to 4 ranks
        "ddp-data": Property("ddp-data", data_scenarios().filter(_judged_on_its_merits)),
        # an evaluation on 2 to 4 ranks, every rank with a sample of its own: a rank with
        # none has no mean for a mean of per-rank means (0/0), and a loader that drops its
        # last partial batch would evaluate nothing, which the check refuses as untestable;
        # the correct evaluation gathers per-sample losses and trims the padding
        "ddp-metric": Property(
            "ddp-metric", data_scenarios().filter(lambda s: s.size > s.world_size).map(_evaluation),
            Target(evaluate=gather_trim_eval),
        ),
    }


def _properties() -> dict[str, Property]:
    devices = device_lists(min_devices=2)  # a data-parallel bug needs two devices to show
    exact = scenarios(models=model_specs(exact=True), devices=devices)
    ddp_models = model_specs(kinds=[k for k in KINDS if k != "kwargs"], exact=True)
    # the DDP checks take a mean loss (their exact recipe weights it by n_r * W / B); the
    # device list's length is the world size (2 or 3 ranks, one pool each); float32 and
    # float64, as the DataParallel properties.
    ddp = scenarios(
        models=ddp_models, devices=device_lists(min_devices=2, max_devices=3),
        losses=loss_specs(reductions=("mean",)), max_batch=12,
    )
    # the DDP gradient check replays train-mode nn.Dropout masks from the ranks, so it also
    # draws dropout models in train mode (where ranks seeded alike show)
    ddp_dropout = scenarios(
        models=st.one_of(ddp_models, model_specs(kinds=["dropout"]).filter(lambda m: not m.deterministic)),
        devices=device_lists(min_devices=2, max_devices=3), losses=loss_specs(reductions=("mean",)), max_batch=12,
    )
    drawn: dict[str, SearchStrategy[Any]] = {
        "dp-grads": exact,
        "dp-grad-sum": exact,
        "dp-buffers": scenarios(models=model_specs(kinds=["buffer-counter", "batchnorm"]), devices=devices),
        "dp-weighted-loss": scenarios(models=model_specs(kinds=["loss-head"]), devices=devices),
        # training on models without state of their own: the built-in counters lose theirs
        # under DataParallel by design (dp-state), which dp-training rightly reports
        "dp-training": scenarios(
            models=model_specs(kinds=[k for k in KINDS if k not in ("buffer-counter", "attribute-counter")], exact=True),
            devices=devices,
        ),
        "ddp-grads": ddp_dropout,
        "ddp-accumulation": ddp.filter(_equal_micro_batches),
        # the sharded checks on 2 or 3 ranks (tensor parallelism on 2: a 2-D mesh needs 4),
        # each with layouts drawn for its model (``sharded_scenarios``)
        "fsdp-grads": sharded_scenarios("fsdp", world_sizes=(2, 3)),
        "pp-grads": sharded_scenarios("pp", world_sizes=(2, 3)),
        "tp-grads": sharded_scenarios("tp", world_sizes=(2,)),
        "tp-training": sharded_scenarios("tp", world_sizes=(2,)),
        # pipelines whose first stage's embedding is the last stage's output projection
        # (tied weights): the training check's after_backward must sum the two copies
        "pp-training": sharded_scenarios("pp", world_sizes=(2, 3)).map(_tied_embedding),
        # the DDP and FSDP2 training checks (three optimizer steps each) on small scenarios of 2 ranks
        "ddp-training": scenarios(
            models=ddp_models, devices=device_lists(min_devices=2, max_devices=2),
            losses=loss_specs(reductions=("mean",)), max_batch=8,
        ),
        "fsdp-training": sharded_scenarios("fsdp", world_sizes=(2,), max_batch=6),
    }
    return {name: Property(name, strategy.filter(_runs(name))) for name, strategy in drawn.items()}


#: The property each registry check and each data check runs, by the check's name
#: (``Mutant.caught_by``).
PROPERTIES: dict[str, Property] = {**_properties(), **_data_properties()}


def _exact_properties() -> dict[str, Property]:
    drawn: dict[str, SearchStrategy[Any]] = {
        # DataParallel on 2 to 4 devices: a one-device step has nothing to reduce
        "dp-grads": exact_scenarios("dp", world_sizes=(2, 3, 4)),
        **{f"{backend}-grads": exact_scenarios(backend) for backend in ("ddp", "fsdp", "tp", "pp")},
    }
    return {name: Property(name, strategy.filter(_runs(name, exact=True)), exact=True) for name, strategy in drawn.items()}


#: The gradient check of every backend in exact mode (``Property.exact``), on
#: ``exact_scenarios`` (on 2 ranks, DataParallel on 2 to 4 devices), by the check's name:
#: where the one-ulp mutants are caught (``Mutant.exact``, ``Mutant.caught_in``).
EXACT_PROPERTIES: dict[str, Property] = _exact_properties()


#: The ``Target`` field a mutant of each kind (but ``"criterion"``) is passed as.
_TARGET_FIELDS = {
    "dp": "parallel", "reduce": "reduce", "ddp-step": "step", "fsdp-step": "step", "tp-plan": "plan",
    "pp-schedule": "schedule", "hook": "after_backward", "model": "model", "loader": "loader",
}


@dataclass(frozen=True)
class Mutant:
    """One catalogued bug.

    Attributes:
        name: short identifier.
        implementation: the wrapper class, reduction function or DDP step.
        kind: what the implementation is (the package docstring says each), and so how
            ``target`` passes it: ``"dp"``, ``"criterion"`` (whose model wrapper is
            ``model``), ``"reduce"``, ``"ddp-step"``, ``"fsdp-step"``, ``"tp-plan"``,
            ``"pp-schedule"``, ``"hook"`` (an ``after_backward`` hook of the training
            checks), ``"model"`` (``model(module) -> nn.Module``, the user's module
            written with the bug, given the scenario's module), ``"loader"`` (a
            ``loader_factory(dataset, rank, world_size, epoch)``) or ``"eval"`` (an
            ``eval_fn(model, loader)``, over ``loader`` when it has one).
        bug: what is wrong, in one sentence.
        caught_by: the check that catches it (a key of ``PROPERTIES``: of ``CHECKS``, or
            a data check, ``"ddp-data"`` or ``"ddp-metric"``, for the last two kinds).
        message: a phrase the failure message contains, pointing at the bug.
        model: a criterion mutant's model wrapper (correct: the bug is the criterion's).
        loader: an eval mutant's loader factory, the one its evaluation was written for
            (correct: the bug is the evaluation's); None: the property's default.
        exact: caught in exact mode only (a one-ulp error, below every tolerance):
            ``caught_by`` is a key of ``EXACT_PROPERTIES``.
    """

    name: str
    implementation: Callable[..., Any]
    kind: str
    bug: str
    caught_by: str
    message: str
    model: Callable[..., Any] | None = None
    loader: LoaderFactory | None = None
    exact: bool = False

    @property
    def caught_in(self) -> Property:
        """The property that catches this mutant: ``caught_by``'s, in exact mode for an
        ``exact`` mutant."""
        return (EXACT_PROPERTIES if self.exact else PROPERTIES)[self.caught_by]

    @property
    def target(self) -> Target:
        """The mutant as the code under test: the ``Target`` field of its kind
        (``_TARGET_FIELDS``), a criterion's pair ``Target(parallel=model, parallel_loss=...)``,
        or an evaluation loop with the loader it was written for
        ``Target(loader=loader, evaluate=...)``."""
        if self.kind == "criterion":
            return Target(parallel=self.model, parallel_loss=self.implementation)
        if self.kind == "eval":
            return Target(loader=self.loader, evaluate=self.implementation)
        if self.kind in _TARGET_FIELDS:
            given: dict[str, Any] = {_TARGET_FIELDS[self.kind]: self.implementation}
            return Target(**given)
        raise ValueError(
            f"mutant {self.name!r} has kind {self.kind!r}; expected 'criterion', 'loader', 'eval' or one of "
            f"{', '.join(map(repr, _TARGET_FIELDS))}"
        )

    def check(self, scenario: Scenario | ShardedScenario | DataScenario) -> None:
        """Runs the catching check on one scenario with this mutant (raises when caught)."""
        __tracebackhide__ = True
        self.caught_in.run(scenario, self.target)


#: What an exact check's failure says of a one-ulp mutant's gradient: one element differs.
ONE_ULP = "Bit for bit: 1 of the"

MUTANTS: dict[str, Mutant] = {
    m.name: m
    for m in (
        Mutant("averaging", AveragingDataParallel, "dp", "averages replica gradients instead of summing them", "dp-grads", "the replica gradients were averaged"),
        Mutant("deep-copy", DeepCopyDataParallel, "dp", "runs a deep copy per replica, so no gradient reaches the module", "dp-grads", "No gradient reached the module's parameters"),
        Mutant("detached-replicas", DetachedReplicasDataParallel, "dp", "detaches every replica but the first", "dp-grad-sum", "accumulated grad"),
        Mutant("reversed-gather", ReversedGatherDataParallel, "dp", "gathers outputs in reverse replica order", "dp-grads", "gathered out of order"),
        Mutant("output-device-first", OutputDeviceFirstDataParallel, "dp", "puts the output device's chunk first when gathering", "dp-grads", "gathered out of order"),
        Mutant("last-replica-buffers", LastReplicaBuffersDataParallel, "dp", "keeps the last replica's buffers instead of the first's", "dp-buffers", "buffer '"),
        Mutant("balanced-offset", BalancedOffsetDataParallel, "dp", "a balanced-chunk DataParallel whose chunks start at a fixed stride, so they overlap and the last rows are lost", "dp-grads", "tensors are not close"),
        Mutant("balanced-drops-chunk", BalancedDropsChunkDataParallel, "dp", "a balanced-chunk DataParallel that replicates for one device fewer than it splits for, so the last chunk never runs", "dp-grads", "reached no replica"),
        Mutant("criterion-mean-of-means", MeanCriterionParallel, "criterion", "a criterion wrapper that averages the replicas' mean losses, weighting uneven chunks alike", "dp-grads", "The loss-averaging trap", model=ReplicaOutputsDataParallel),
        Mutant("tiny-error", TinyErrorDataParallel, "dp", "scales one parameter's gradient by 1 + 1e-4", "dp-grads", "tensors are not close"),
        Mutant("mean-of-means", mean_of_replica_losses, "reduce", "averages per-replica losses with loss.mean() on uneven chunks", "dp-weighted-loss", "The chunks are uneven"),
        Mutant("ddp-summed-loss", summed_loss_step, "ddp-step", "sums each rank's losses and never divides by the batch", "ddp-grads", "the sum over the rank's rows"),
        Mutant("ddp-summed-allreduce", summed_allreduce_step, "ddp-step", "a hand-written all-reduce that sums gradients without dividing by the world size", "ddp-grads", "the world size"),
        Mutant("ddp-rank-seeded-init", rank_seeded_init_step, "ddp-step", "initialises each rank with its own seed and never broadcasts rank 0's parameters", "ddp-grads", "tensors are not close"),
        Mutant("ddp-forward-outside-no-sync", forward_outside_no_sync_step, "ddp-step", "runs the forward outside no_sync(), so every micro-batch synchronises", "ddp-accumulation", "synchronised"),
        Mutant("ddp-undivided-accumulation", undivided_accumulation_step, "ddp-step", "accumulates micro-batch losses without dividing by their number", "ddp-accumulation", "the number of micro-batches"),
        Mutant("ddp-zero-grad-in-loop", zero_grad_in_loop_step, "ddp-step", "calls zero_grad() inside the accumulation loop", "ddp-accumulation", "tensors are not close"),
        Mutant("fsdp-undivided", fsdp_undivided_step, "fsdp-step", "skips the reduce-scatter's average: FSDP2 sums the ranks' gradients", "fsdp-grads", "the world size"),
        Mutant("fsdp-summed-loss", fsdp_summed_loss_step, "fsdp-step", "sums each rank's losses over its rows instead of averaging them", "fsdp-grads", "tensors are not close"),
        Mutant("tp-no-allreduce", no_allreduce_plan, "tp-plan", "a RowwiseParallel that skips its all-reduce, so each rank's output is its partial sum", "tp-grads", "no collective ran on it"),
        Mutant("tp-local-output", local_output_plan, "tp-plan", "a ColwiseParallel whose local shard of the output columns is used as the whole output", "tp-grads", "the local shard of a ColwiseParallel output was used as the whole output"),
        Mutant("pp-unscaled", UnscaledGPipe, "pp-schedule", "a GPipe schedule that does not scale gradients by 1/n_microbatches", "pp-grads", "microbatches"),
        Mutant("pp-skip-last-microbatch", SkipLastMicrobatchGPipe, "pp-schedule", "a GPipe schedule that never runs its last microbatch", "pp-grads", "microbatch"),
        Mutant("fsdp-wrong-weight", fsdp_wrong_weight_step, "fsdp-step", "weights each rank's loss by n_r / B, forgetting the world size FSDP2 divides by", "fsdp-grads", "the world size"),
        Mutant("lost-forward-state", LostForwardState, "model", "a model that counts its forwards in a Python attribute and scales its output by a warm-up factor: DataParallel's replicas lose the count", "dp-training", "attribute changes are lost"),
        Mutant("dp-local-buffer", LocalBatchStatistic, "model", "a model that updates an EMA buffer in forward from the rows it sees: DataParallel keeps replica 0's update, from its chunk alone", "dp-training", "DataParallel keeps replica 0's buffers"),
        Mutant("tp-one-rank-clip", tp_one_rank_clip, "hook", "a gradient clip run only on rank 0 (under `if ctx.rank == 0`), so the other tensor-parallel ranks step their shards unclipped", "tp-training", "did not run alike on every rank"),
        Mutant("pp-untied-embedding", averaged_tied_grads_hook, "hook", "a stage hook that averages a tied embedding's gradient over the first and last stage instead of summing the two parts", "pp-training", "instead of summed"),
        Mutant("ddp-double-accumulation-division", double_accumulation_division_step, "ddp-step", "divides each micro-batch's loss by the number of micro-batches twice", "ddp-accumulation", "one over the number of micro-batches"),
        Mutant("ddp-sync-wrong-micro-batch", sync_first_micro_batch_step, "ddp-step", "synchronises on the first micro-batch instead of the last (no_sync() if i != 0)", "ddp-accumulation", "synchronised on micro-batch 1 of"),
        Mutant("ddp-same-seed-ranks", same_seed_ranks_step, "ddp-step", "seeds every rank alike (torch.manual_seed(0) on every rank), so every rank draws the same dropout masks", "ddp-grads", "Every rank draws the same random numbers"),
        Mutant("fsdp-local-shard-clip", local_shard_clip, "hook", "clips gradients by a norm computed from the rank's local FSDP2 shard", "fsdp-training", "local shard"),
        Mutant("ddp-clip-reduced-twice", clip_reduced_twice, "hook", "clips gradients by a norm whose square is all-reduced again over ranks that already hold the averaged gradient", "ddp-training", "1/sqrt("),
        Mutant("ddp-local-batch-buffer", local_batch_offset, "model", "updates a running statistic in forward from the rank's own shard and uses it in the output", "ddp-training", "updated them from its own shard"),
        Mutant("no-set-epoch", no_set_epoch_loader, "loader", "a shuffling DistributedSampler whose set_epoch(epoch) is never called, so every epoch repeats the first one's order", "ddp-data", "call sampler.set_epoch(epoch)"),
        Mutant("fixed-rank-sampler", fixed_rank_loader, "loader", "a DistributedSampler given a seed value where the rank belongs (rank=0 on every rank), so every rank loads the same part", "ddp-data", "a fixed value"),
        Mutant("same-shuffle-ranks", same_shuffle_loader, "loader", "a shuffling DataLoader seeded alike on every rank with no DistributedSampler, so every rank loads the whole dataset in the same order", "ddp-data", "does not split the dataset between the ranks"),
        Mutant("padded-sum-eval", padded_sum_eval, "eval", "an evaluation that all-reduces the loss sum and count over DistributedSampler's padded shards, counting the repeated samples twice", "ddp-metric", "were counted twice"),
        Mutant("drop-last-eval", drop_last_eval_loader, "loader", "an evaluation loader with drop_last=True, so each rank's last partial batch is never evaluated", "ddp-metric", "were never evaluated (drop_last=True in the DataLoader)"),
        Mutant("integer-mean-eval", integer_mean_eval, "eval", "an accuracy from int64 counts all-reduced then floor-divided by the world size (a mean-reduced integer metric state)", "ddp-metric", "Integer flooring", loader=unpadded_loader),
        Mutant("mean-of-rank-means-eval", mean_of_rank_means_eval, "eval", "each rank's mean loss all-reduced and divided by the world size, weighting uneven shares alike", "ddp-metric", "A mean of per-rank means", loader=unpadded_loader),
        Mutant("dp-one-ulp", OneUlpDataParallel, "dp", "moves one element of the first parameter's summed replica gradient up by one unit in the last place", "dp-grads", ONE_ULP, exact=True),
        Mutant("ddp-one-ulp", one_ulp_comm_hook_step, "ddp-step", "a comm hook whose all-reduce returns one element of the first bucket one unit in the last place too large", "ddp-grads", ONE_ULP, exact=True),
        Mutant("fsdp-one-ulp", fsdp_one_ulp_step, "fsdp-step", "moves one element of rank 0's shard of the first reduce-scattered gradient up by one unit in the last place", "fsdp-grads", ONE_ULP, exact=True),
        Mutant("tp-one-ulp", one_ulp_plan, "tp-plan", "a RowwiseParallel whose weight gradient has one element of rank 0's shard one unit in the last place too large", "tp-grads", ONE_ULP, exact=True),
        Mutant("pp-one-ulp", OneUlpGPipe, "pp-schedule", "a GPipe schedule whose first stage moves one element of its first gradient up by one unit in the last place", "pp-grads", ONE_ULP, exact=True),
    )
}
