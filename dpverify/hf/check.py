"""A Hugging Face model family under every backend, at a size a CPU runs.

``check_hf_config`` shrinks a configuration (``shrink``: same class, the structure kept),
builds the causal language model from it (``from_config``: nothing is downloaded), makes a
token batch with right padding and labels, and runs each backend's gradient check on it:
DataParallel, DDP and FSDP2 on the whole model, tensor parallelism with the family's own
plan (``tp_plan="hf"``) or one of the caller's, and a pipeline cut of its decoder layers.
Each backend's outcome is a row of the report: PASS, FAIL (a mismatch, with the check's
message: the tensor, the module, the layout; or, with the error's class in ``error``, a plan
or split that does not fit the model, the message naming the module) or SKIP (the backend
does not apply, and why).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpverify.core.comparison import StepComparison
from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.hf.base import load_config, require_transformers
from dpverify.hf.model import (
    IGNORE_INDEX,
    TokenBatch,
    build_model,
    dropout_fields,
    lm_loss,
    token_batch,
)
from dpverify.hf.plans import hf_tp_plan, load_plan_function, styled
from dpverify.hf.shrink import shrink
from dpverify.registry import Verdict

__all__ = ["HF_BACKENDS", "BackendOutcome", "HFCheckReport", "check_hf_config", "hf_tp_step"]

#: The backends ``check_hf_config`` runs, in order, by the names ``check --backend`` takes.
HF_BACKENDS: tuple[str, ...] = ("dp", "ddp", "fsdp", "tp", "pp")

PlanSpec = str | Callable[[nn.Module], Mapping[str, Any]] | Mapping[str, Any]


@dataclass(frozen=True)
class BackendOutcome:
    """One backend's check of the model.

    Attributes:
        backend: one of ``HF_BACKENDS``.
        verdict: PASS, FAIL (a mismatch), SKIP (the backend does not apply) or, for a plan
            or split that does not fit the model, FAIL with ``error`` set.
        seconds: how long the check took.
        detail: the check's summary, the mismatch's message, or why it was skipped.
        report: the comparison, when the check compared anything.
        error: the error's class name when the check could not run the model that way.
    """

    backend: str
    verdict: Verdict
    seconds: float
    detail: str
    report: StepComparison | None = None
    error: str | None = None


@dataclass(frozen=True)
class HFCheckReport:
    """What ``check_hf_config`` found.

    Attributes:
        model_type: the configuration's ``model_type`` (``"llama"``, ``"mixtral"``, ...).
        config: the configuration the checks ran (the shrunk one).
        parameters: the checked model's parameter count.
        outcomes: one per backend run, in ``HF_BACKENDS`` order.
        notes: how the checks had to be set up for this family (eval mode for a model
            that draws randomness; DDP's ``find_unused_parameters``).
    """

    model_type: str
    config: Any
    parameters: int
    outcomes: tuple[BackendOutcome, ...]
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether no backend failed."""
        return all(outcome.verdict is not Verdict.FAIL for outcome in self.outcomes)

    def outcome(self, backend: str) -> BackendOutcome:
        """The outcome of ``backend``.

        Raises:
            KeyError: that backend was not run.
        """
        for outcome in self.outcomes:
            if outcome.backend == backend:
                return outcome
        raise KeyError(f"{backend!r} was not run; these were: {[o.backend for o in self.outcomes]}")

    def __str__(self) -> str:
        lines = [f"{self.model_type}: {self.parameters:,} parameters"]
        for outcome in self.outcomes:
            first = outcome.detail.splitlines()[0] if outcome.detail else ""
            lines.append(f"  {outcome.backend:<5} {outcome.verdict.value:<5} {outcome.seconds:6.1f} s  {first}")
        return "\n".join(lines)


def check_hf_config(
    config: Any,
    *,
    backend: str | Sequence[str] = "all",
    tp_plan: PlanSpec = "hf",
    tp: int = 2,
    pp: int = 2,
    world_size: int = 2,
    batch_size: int = 4,
    seq_len: int = 16,
    max_params: int = 2_000_000,
    shrunk: bool = True,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    pool: Any = None,
) -> HFCheckReport:
    """Checks the model family of ``config`` under each backend, shrunk to CPU size.

    Args:
        config: a transformers configuration, the path of a ``config.json``, or a
            ``model_type`` (``"llama"``: that class's default configuration).
        backend: ``"all"``, one of ``HF_BACKENDS``, or a list of them.
        tp_plan: ``"hf"``: the configuration's own tensor-parallel plan, as transformers
            applies it; ``"MODULE:FN"`` or a function ``FN(model)``: a plan for
            ``parallelize_module`` (its styles torch's, or names of transformers' styles);
            or such a plan itself.
        tp: tensor-parallel ranks (the plan's widths must divide by it).
        pp: pipeline stages (at least this many decoder layers are kept).
        world_size: DataParallel's virtual devices and the DDP and FSDP2 ranks.
        batch_size: sequences in the batch (some right-padded).
        seq_len: tokens per sequence.
        max_params: the shrunk model's most parameters.
        shrunk: shrink ``config`` first (False: check it as given).
        dtype: the model's dtype. float32 (default): transformers computes norms,
            attention and expert routing in float32 whatever the model's dtype, so a
            float64 model still rounds like float32 there, finer than its anchor sees.
        seed: seeds the weights and the batch.
        pool: the ranks to use (default: the shared pool of each world size).

    Returns:
        One outcome per backend; ``report.ok`` is False when one failed.

    Raises:
        InvalidArgument: an argument cannot be used, or the configuration cannot be shrunk
            keeping its structure (the message names what).
    """
    require_transformers("check_hf_config")
    backends = _backends(backend)
    if not isinstance(shrunk, bool):
        raise InvalidArgument(f"shrunk={shrunk!r} must be True or False")
    loaded = load_config(config) if isinstance(config, str) else config
    checked = shrink(loaded, tp=tp, pp=pp, max_params=max_params) if shrunk else loaded
    model = build_model(checked, seed=seed, dtype=dtype)
    batch = token_batch(checked, batch_size=batch_size, seq_len=seq_len, seed=seed)
    notes: list[str] = []
    drawn = _randomness(checked)
    if drawn:
        # each rank (and replica) would draw its own masks and noise: a difference the
        # checks would explain, not a property of the plans
        model.eval()
        notes.append(f"checked in eval mode: {', '.join(f'{name}={value}' for name, value in drawn.items())} draw differently on each rank")
    # a step of its own on one device: only where DDP, whose buckets it concerns, runs
    unused = _unused_parameters(model, batch) if "ddp" in backends else []
    if unused:
        notes.append(
            f"DDP with find_unused_parameters=True: {len(unused)} parameters get no gradient from the loss "
            f"({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}); without it DDP never reduces their buckets"
        )
    runners: dict[str, Callable[[], StepComparison | str]] = {
        "dp": lambda: _dp(model, batch, lm_loss, world_size),
        "ddp": lambda: _ddp(model, batch, lm_loss, world_size, pool, find_unused=bool(unused)),
        "fsdp": lambda: _fsdp(model, batch, lm_loss, world_size, pool),
        "tp": lambda: _tp(model, batch, lm_loss, tp, _plan_of(tp_plan, model, tp), pool),
        "pp": lambda: _pp(model, batch, pp, pool),
    }
    outcomes = tuple(_run(name, runners[name]) for name in backends)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    return HFCheckReport(str(getattr(checked, "model_type", type(checked).__name__)), checked, parameters, outcomes, tuple(notes))


def _randomness(config: Any) -> dict[str, float]:
    """The configuration's sources of randomness in train mode: dropout probabilities and
    a router's jitter noise, by field, where non-zero."""
    drawn = dropout_fields(config)
    jitter = getattr(config, "router_jitter_noise", None)
    if isinstance(jitter, float) and jitter > 0:
        drawn["router_jitter_noise"] = jitter
    return drawn


def _unused_parameters(model: nn.Module, batch: TokenBatch) -> list[str]:
    """The parameters one step on one device leaves without a gradient (an index selector
    whose output only picks, a layer the batch never routes to)."""
    model.zero_grad(set_to_none=True)
    lm_loss(model(**_keywords(batch)), batch.labels).backward()
    unused = [name for name, parameter in model.named_parameters() if parameter.requires_grad and parameter.grad is None]
    model.zero_grad(set_to_none=True)
    return unused


def _backends(backend: str | Sequence[str]) -> tuple[str, ...]:
    names = [backend] if isinstance(backend, str) else list(backend)
    if names == ["all"]:
        return HF_BACKENDS
    unknown = [name for name in names if name not in HF_BACKENDS]
    if unknown or not names:
        raise InvalidArgument(f"backend={backend!r}: pass 'all' or some of {', '.join(map(repr, HF_BACKENDS))}")
    return tuple(name for name in HF_BACKENDS if name in names)


def _plan_of(spec: PlanSpec, model: nn.Module, tp: int) -> dict[str, Any]:
    """The plan ``spec`` names for ``model`` (see ``check_hf_config``'s ``tp_plan``)."""
    if spec == "hf":
        return hf_tp_plan(model, tp)
    if isinstance(spec, str):
        spec = load_plan_function(spec)
    plan = spec(model) if callable(spec) else spec
    if not isinstance(plan, Mapping):
        raise InvalidArgument(f"tp_plan gave {type(plan).__name__}; it must give a dict from module path to style")
    return styled(plan, model)


def _run(backend: str, runner: Callable[[], StepComparison | str]) -> BackendOutcome:
    """One backend's check: its comparison, its mismatch, the error of a layout that does
    not fit (the check's message names the module), or why it does not apply."""
    started = time.perf_counter()
    try:
        result = runner()
    except ParallelMismatch as mismatch:
        report = mismatch.report if isinstance(mismatch.report, StepComparison) else None
        return BackendOutcome(backend, Verdict.FAIL, time.perf_counter() - started, str(mismatch), report)
    except Exception as error:  # a layout that does not fit, a rank that raised, a model that cannot run so
        return BackendOutcome(backend, Verdict.FAIL, time.perf_counter() - started, f"{type(error).__name__}: {error}", error=type(error).__name__)
    seconds = time.perf_counter() - started
    if isinstance(result, str):
        return BackendOutcome(backend, Verdict.SKIP, seconds, result)
    # the summary sentence; the scenario, long for a whole plan, stays in the report
    return BackendOutcome(backend, Verdict.PASS, seconds, str(result).splitlines()[0].split(" Scenario: ")[0], result)


def _keywords(batch: Any) -> dict[str, Any]:
    # no cache: DataParallel cannot gather one, and a step does not need it
    return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "use_cache": False}


def _dp(model: nn.Module, batch: Any, loss_fn: Any, world_size: int) -> StepComparison:
    from dpverify.checks.dp import assert_dp_grads_match

    return assert_dp_grads_match(
        model, (), batch.labels, loss_fn=loss_fn, device_ids=list(range(world_size)), forward_kwargs=_keywords(batch),
    )


def _ddp(model: nn.Module, batch: Any, loss_fn: Any, world_size: int, pool: Any, *, find_unused: bool) -> StepComparison:
    from dpverify.ddp.checks import assert_ddp_grads_match

    return assert_ddp_grads_match(
        model, (), batch.labels, loss_fn=loss_fn, world_size=world_size, forward_kwargs=_keywords(batch), pool=pool,
        ddp_kwargs={"find_unused_parameters": True} if find_unused else None,
    )


def _fsdp(model: nn.Module, batch: Any, loss_fn: Any, world_size: int, pool: Any) -> StepComparison:
    from dpverify.sharded.fsdp import assert_fsdp_grads_match

    return assert_fsdp_grads_match(model, (), batch.labels, loss_fn=loss_fn, world_size=world_size, forward_kwargs=_keywords(batch), pool=pool)


def _tp(model: nn.Module, batch: Any, loss_fn: Any, tp: int, plan: dict[str, Any], pool: Any) -> StepComparison:
    from dpverify.sharded.tensor_parallel import assert_tensor_parallel_grads_match

    return assert_tensor_parallel_grads_match(
        model, (), batch.labels, loss_fn=loss_fn, world_size=tp, plan=plan, forward_kwargs=_keywords(batch), pool=pool,
        step=hf_tp_step,
    )


def hf_tp_step(ctx: Any) -> Any:
    """The tensor-parallel step as transformers sets a model up: the plan applied, then the
    tied weights tied again (``from_pretrained`` ties after it distributes the model, so the
    head shares the embedding's sharded weight), then ``tp_step``'s forward and backward."""
    from dpverify.sharded.tensor_parallel import tp_step

    model = ctx.parallelize()
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    return tp_step(ctx)


def _pp(model: nn.Module, batch: TokenBatch, pp: int, pool: Any) -> StepComparison | str:
    """The pipeline check on the model cut along its ``base_model_pp_plan``, the loss summed
    over each microbatch's tokens and divided by the whole batch's (``scale_grads=False``:
    the schedule sums the microbatches' losses to the full batch's token mean, the exact
    recipe whatever their token counts); a head tied to the embedding trains one step with
    the tied weight's gradients summed across its two stages (``sync_tied_grads``), which no
    one step does by itself."""
    from dpverify.hf.pipeline import pipeline_module, require_same_logits, split_points_for
    from dpverify.sharded.pipeline import (
        assert_pipeline_grads_match,
        assert_pipeline_training_matches,
        sync_tied_grads,
    )

    if not getattr(model.config, "base_model_pp_plan", None):
        return f"{type(model).__name__}'s configuration has no base_model_pp_plan: no pipeline split of its own"
    inputs = (batch.input_ids, batch.attention_mask)
    try:
        staged = pipeline_module(model)
        require_same_logits(model, staged, *inputs)
    except InvalidArgument as error:
        return f"dpverify cannot cut {type(model).__name__} into pipeline stages: {str(error).splitlines()[0]}"
    loss = TokenSum(_predicted(batch.labels))
    options: dict[str, Any] = {
        "world_size": pp, "n_microbatches": 2, "split_points": split_points_for(staged, pp), "scale_grads": False,
        "objective": lm_loss, "pool": pool,
    }
    if _tied_head(model):
        return assert_pipeline_training_matches(
            staged, [(inputs, batch.labels)], loss_fn=loss, optimizer=sgd, after_backward=sync_tied_grads, **options,
        )
    return assert_pipeline_grads_match(staged, inputs, batch.labels, loss_fn=loss, **options)


@dataclass(frozen=True)
class TokenSum:
    """A microbatch's summed token cross-entropy divided by ``tokens``, the whole batch's
    predicted tokens: summed over the microbatches, the full batch's token mean."""

    tokens: int

    def __call__(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        return lm_loss(output, labels) * _predicted(labels) / max(self.tokens, 1)


def _predicted(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def sgd(params: Any) -> torch.optim.Optimizer:
    """The pipeline training check's optimizer for a tied head: plain SGD."""
    return torch.optim.SGD(params, lr=0.1)


def _tied_head(model: nn.Module) -> bool:
    head = getattr(model, "get_output_embeddings", lambda: None)()
    embedding = getattr(model, "get_input_embeddings", lambda: None)()
    return head is not None and embedding is not None and head.weight is embedding.weight
