"""Public assertion helpers: a parallel step against the single-device step."""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from dpverify.checks.replay import Replay, replay_dataparallel, settle_by_replay
from dpverify.core.comparison import (
    Derived,
    Msg,
    StepComparison,
    TensorComparison,
    TensorId,
    Terms,
    Tolerance,
    compare_tensors,
    explain_scale,
    render,
    require_finite,
    step_comparison,
    uniform_scale,
)
from dpverify.core.devices import cuda_device_count, normalize_device_ids, normalize_output_device
from dpverify.core.divergence import ONE_ROW_BATCHNORM, divergence_sources
from dpverify.core.errors import InvalidArgument, NonFiniteReference, ParallelMismatch
from dpverify.core.numerics import FLOAT64_JITTER, largest_abs
from dpverify.core.scatter import ScatterPlan, plan_scatter
from dpverify.core.step import (
    Key,
    LossFn,
    StepResult,
    as_inputs,
    batch_size_of,
    copy_module,
    first_parameter_dtype,
    quiet_size_warnings,
    run_step,
)
from dpverify.core.tracebacks import describe_exception
from dpverify.core.tree import concatenate, first_batched, map_tensors
from dpverify.core.validation import (
    require_arguments_fit,
    require_bool,
    require_callable,
    require_loss_fn,
    require_mapping,
    require_module_with_grads,
    require_target_rows,
)
from dpverify.core.virtual import data_parallel, observe_gathers, virtual_devices
from dpverify.exact.case import EXACT, Evidence, ExactCase, prove, require_no_tolerance
from dpverify.exact.grid import dyadic_tree

__all__ = [
    "Check", "LossModule", "References", "SharedSteps", "assert_dp_grads_match", "assert_grad_sum_equals_mean_loss_grad",
    "grad_sum_matches", "grads_match", "output_id", "raise_unless_ok",
]

Parallel = Callable[..., Callable[..., Any]]
#: ``parallel_loss_fn(criterion, device_ids=..., output_device=...)`` -> ``loss(outputs, target)``
ParallelLoss = Callable[..., Callable[[Any, Any], torch.Tensor]]


class LossModule(nn.Module):
    """A loss function as a module, for criterion wrappers that replicate their criterion
    (``parallel_loss_fn`` receives ``loss_fn`` as one of these when it is a plain function)."""

    def __init__(self, loss_fn: LossFn) -> None:
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, output: Any, target: Any) -> torch.Tensor:
        return self.loss_fn(output, target)

    def extra_repr(self) -> str:
        return getattr(self.loss_fn, "__qualname__", type(self.loss_fn).__name__)


def _require_ids_on_this_machine(ids: Sequence[int]) -> None:
    """On a machine with CUDA devices, ids beyond them run on virtual devices only as the
    first ``n`` ids (more devices than the machine has, as ``dpverify check --devices 4``
    asks on two GPUs); other ids beyond them (``[0, 99]`` on two GPUs) are a mistake that
    would otherwise silently run on virtual devices instead of the GPUs asked for.

    Raises:
        InvalidArgument: CUDA devices exist, an id is beyond them, and the ids are not
            ``0 .. n - 1``.
    """
    gpus = cuda_device_count()
    if gpus and max(ids) >= gpus and sorted(ids) != list(range(len(ids))):
        raise InvalidArgument(
            f"device_ids={list(ids)}: this machine has {gpus} CUDA device{'s' if gpus != 1 else ''} "
            f"(ids 0 to {gpus - 1}); pass ids below {gpus}, or device_ids=list(range(n)) to run n virtual "
            "devices on the CPU"
        )


def _require_rows_for_every_replica(module: nn.Module, plan: ScatterPlan, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """torch's ``scatter_kwargs`` copies a keyword argument that is not a tensor to every
    device, while the batch makes fewer chunks than devices: the replicas of the devices
    left without rows are called with the keyword arguments and no positional input
    (torch/nn/parallel/scatter_gather.py, ``scatter_kwargs`` pads the inputs with ``()``),
    and a forward that needs one fails there.

    Raises:
        InvalidArgument: such a replica would be called without the positional arguments
            its forward requires.
    """
    empty = [device for device, rows in zip(plan.device_ids[: plan.n_replicas], plan.chunk_sizes, strict=False) if rows == 0]
    if not empty or not args:
        return
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    needed = [p.name for p in parameters if p.kind in positional and p.default is inspect.Parameter.empty and p.name not in kwargs]
    if not needed:
        return
    copied = sorted(name for name, value in kwargs.items() if not isinstance(value, torch.Tensor))
    rows = sum(plan.chunk_sizes)
    raise InvalidArgument(
        f"device_ids={list(plan.device_ids)}: {rows} rows make {plan.n_replicas - len(empty)} chunks, yet torch's "
        f"DataParallel runs {plan.n_replicas} replicas, because scatter_kwargs copies the keyword arguments "
        f"{copied} (not tensors) to every device; the replicas on devices {empty} get those and no positional "
        f"input, and {type(module).__name__}.forward needs {', '.join(needed)}. Use at most "
        f"{plan.n_replicas - len(empty)} devices for this batch, or pass {', '.join(copied)} as tensors with a row "
        "per sample (split like the batch)"
    )


def _gather_problem(value: Any, path: str = "output") -> str | None:
    """What in a forward's output torch's ``gather`` cannot gather
    (torch/nn/parallel/scatter_gather.py, ``gather_map``: tensors, None, dicts,
    namedtuples, and tuples or lists of them), or None."""
    if value is None or isinstance(value, torch.Tensor):
        return None
    if isinstance(value, Mapping):
        return next((p for k, v in value.items() if (p := _gather_problem(v, f"{path}[{k!r}]")) is not None), None)
    if isinstance(value, (tuple, list)):
        return next((p for i, v in enumerate(value) if (p := _gather_problem(v, f"{path}[{i}]")) is not None), None)
    return f"{path} is of type {type(value).__name__}"


def _ungatherable_output(check: Check) -> str | None:
    """Why DataParallel cannot gather what the module returns (its output on the batch, in
    this process, in eval-free no-grad mode), or None when it can: the error a failed
    parallel step is explained with."""
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            output = copy_module(check.module, None)(*check.args, **check.kwargs)
    except Exception:
        return None
    problem = _gather_problem(output)
    if output is None:
        return (
            f"{type(check.module).__name__}.forward returned None: DataParallel gathers None as None, so "
            "loss_fn(None, target) has nothing to compare; return the output the loss needs"
        )
    if problem is None:
        return None
    return (
        f"{problem}, which DataParallel cannot gather: torch's gather takes tensors, None, and dicts, "
        "namedtuples, tuples or lists of them (torch.nn.parallel.scatter_gather.gather). Return one of "
        "those (a dataclass as dataclasses.astuple(out) or a dict, a Hugging Face ModelOutput is a dict), "
        "or check a wrapper that handles it with parallel="
    )


@dataclass(frozen=True)
class Check:
    """A validated check: the module, its arguments, the split and where the steps run.

    Shared by every helper so that arguments are validated, and the scatter planned, once
    and the same way.
    """

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    device_ids: list[int]
    output_device: int
    parallel: Parallel
    device: torch.device
    plan: ScatterPlan
    tolerance: Tolerance
    dtype: torch.dtype
    dim: int = 0
    parallel_loss: ParallelLoss | None = None
    #: exact mode: ``module``, ``args`` and ``kwargs`` are the dyadic float64 copies of the
    #: user's (``ExactCase``), compared with ``EXACT``, no tolerance
    exact: bool = False

    @classmethod
    def create(
        cls,
        module: nn.Module,
        inputs: Any,
        *,
        device_ids: Sequence[int],
        output_device: int | None = None,
        parallel: Parallel | None = None,
        rtol: float | None = None,
        atol: float | None = None,
        forward_kwargs: Mapping[str, Any] | None = None,
        dim: int = 0,
        parallel_loss_fn: ParallelLoss | None = None,
        exact: bool = False,
    ) -> Check:
        require_module_with_grads(module, why="there is no gradient to compare")
        if require_bool(exact, "exact"):
            require_no_tolerance(rtol, atol)
        if parallel is not None:
            require_callable(
                parallel, "parallel",
                "a DataParallel-like class or function (module, device_ids=..., output_device=...) -> module",
            )
        if parallel_loss_fn is not None:
            require_callable(
                parallel_loss_fn, "parallel_loss_fn",
                "a criterion wrapper (criterion, device_ids=..., output_device=...) -> loss(outputs, target)",
            )
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise InvalidArgument(f"dim={dim!r} must be an int, the dimension the batch is split along")
        ids = normalize_device_ids(device_ids)
        target = normalize_output_device(output_device, ids)
        kwargs: dict[str, Any] = {}
        if forward_kwargs is not None:
            kwargs = dict(require_mapping(forward_kwargs, "forward_kwargs", "{'attention_mask': mask}"))
        require_arguments_fit(module, inputs)
        args = as_inputs(inputs, keywords=bool(kwargs))
        batch_size_of(args, dim=dim, kwargs=kwargs)
        # Real devices when they exist, for torch's DataParallel and a user's wrapper alike.
        real = cuda_device_count() > max(ids)
        _require_ids_on_this_machine(ids)
        device = torch.device("cuda", ids[0]) if real else torch.device("cpu")
        plan = plan_scatter(args, kwargs, ids, dim=dim)
        _require_rows_for_every_replica(module, plan, args, kwargs)
        if exact:  # the user's module and tensors stay as they are
            grid = ExactCase.of(module, args, None, kwargs)
            module, args, kwargs = grid.module, grid.args, grid.kwargs
        return cls(
            module=module,
            args=args,
            kwargs=kwargs,
            device_ids=ids,
            output_device=target,
            parallel=parallel or data_parallel,
            device=device,
            plan=plan,
            tolerance=EXACT if exact else Tolerance(rtol=rtol, atol=atol),
            dtype=first_parameter_dtype(module),
            dim=dim,
            parallel_loss=parallel_loss_fn,
            exact=exact,
        )

    def require_target(self, target: Any) -> None:
        """The target has the batch's rows (checked when the batch is split along dim 0; a
        batch split along another dimension leaves the target's layout to the loss)."""
        if self.dim == 0:
            require_target_rows(target, batch_size_of(self.args, kwargs=self.kwargs))

    def on_grid(self, value: Any) -> Any:
        """``value`` (a target, a batch) as the check's steps take it: in exact mode its
        dyadic float64 copy, as ``ExactCase`` makes the inputs' (``dyadic_tree``)."""
        return dyadic_tree(value) if self.exact else value

    def proven(self, loss_fn: LossFn, target: Any, shared: SharedSteps | None = None) -> list[str]:
        """In exact mode, the report's note that the step rounds nothing (``prove``: the
        full batch, the batch reversed, and the scatter's chunks with one loss on the
        gathered outputs, as DataParallel computes it); ``target`` on the grid. The
        evidence of a split is kept in ``shared``. Nothing outside exact mode.

        Raises:
            InvalidArgument: an operation of the step cannot be shown exact (the message
                names it, where it ran and what to change).
        """
        if not self.exact:
            return []
        require_loss_fn(loss_fn)
        self.require_target(target)
        store = SharedSteps() if shared is None else shared.for_check(self)
        split = (tuple(self.plan.chunk_sizes), self.dim)
        if split not in store.evidence:
            case = ExactCase(self.module, self.args, self.kwargs, target)
            evidence = prove(case, loss_fn, pieces=self.plan.chunk_sizes, dim=self.dim, gathered=True)
            if self.parallel_loss is not None:
                self._prove_chunk_losses(case, loss_fn)
            store.evidence[split] = evidence
        return [store.evidence[split].note()]

    def _prove_chunk_losses(self, case: ExactCase, loss_fn: LossFn) -> None:
        """A criterion wrapper computes ``loss_fn`` on each replica's chunk, where a mean
        divides by the chunk's count: that arithmetic must be exact too, or a correct pair
        would differ from the full batch by its rounding.

        Raises:
            InvalidArgument: a chunk's loss cannot be shown exact.
        """
        try:
            prove(case, loss_fn, pieces=self.plan.chunk_sizes, dim=self.dim, gathered=False)
        except InvalidArgument as refusal:
            raise InvalidArgument(
                f"{refusal} (with parallel_loss_fn, loss_fn runs on each replica's chunk, of "
                f"{list(self.plan.chunk_sizes)} rows: choose a batch and devices whose chunks make that count a power of two, "
                "such as 8 rows on 2 or 4 devices)"
            ) from None

    @property
    def scenario(self) -> str:
        """The case as planned: the batch, torch's split, where outputs go, the wrappers."""
        return self._scenario(self.plan.describe())

    def scenario_of(self, step: StepResult | None) -> str:
        """The case as the parallel step ran it: the split the wrapper really made, where it
        differs from torch's scatter (a balanced first chunk, a lost chunk)."""
        ran = list(step.replica_rows) if step is not None else []
        planned = list(self.plan.chunk_sizes)
        if not ran or ran == planned:
            return self.scenario
        batch = sum(planned)
        forwards = f"{len(ran)} replica forward{'s' if len(ran) != 1 else ''}"
        return self._scenario(
            f"batch of {batch} rows on device_ids {list(self.device_ids)} -> the wrapper ran {forwards} "
            f"on chunks of {ran} rows ({sum(ran)} of {batch}; torch's scatter would give {planned})"
        )

    def _scenario(self, split: str) -> str:
        text = split
        if self.dim != 0:
            text += f" along dim {self.dim}"
        text += f"; outputs gathered on {_where(self.output_device)}; wrapper {_name(self.parallel)}"
        if self.parallel_loss is not None:
            text += f"; criterion wrapper {_name(self.parallel_loss)}"
        if self.device.type == "cpu" and max(self.device_ids) + 1 > max(len(self.device_ids), cuda_device_count()):
            text += f"; virtual devices (a real machine would need {max(self.device_ids) + 1} CUDA devices for these ids)"
        return text

    def devices(self) -> contextlib.AbstractContextManager[Any]:
        """Where the parallel step runs: a wrapper or criterion wrapper of the user's inside
        ``virtual_devices`` where the CUDA devices are missing (torch.nn.DataParallel or a
        subclass built without them sets device_ids=[] and runs the module once on the whole
        batch, which would check nothing); torch's own through ``data_parallel``, which
        picks real or virtual itself."""
        users = self.parallel is not data_parallel or self.parallel_loss is not None
        if users and self.device.type == "cpu":
            return virtual_devices(max(self.device_ids) + 1)
        return contextlib.nullcontext()

    def explain_gather_error(self, error: BaseException) -> None:
        """Adds why a parallel forward along a dim other than 0 failed to gather, when that
        is the likely cause (torch stacks scalar outputs into a vector only for dim 0)."""
        if self.dim != 0 and isinstance(error, IndexError):
            error.add_note(
                f"dpverify: with dim={self.dim}, torch's gather concatenates every output along "
                f"dim {self.dim} (it stacks scalars into a vector only for dim 0), so each "
                f"replica's output tensors, a returned loss included, need a dimension {self.dim}: "
                f"return the loss as loss.reshape({', '.join(['1'] * (self.dim + 1))})."
            )

    def wrapper_kwargs(self) -> dict[str, Any]:
        """The keyword arguments a wrapper is built with: ``dim`` only when it is not 0, so
        that wrappers without a ``dim`` parameter work on the usual split."""
        kwargs: dict[str, Any] = {"device_ids": self.device_ids, "output_device": self.output_device}
        if self.dim != 0:
            kwargs["dim"] = self.dim
        return kwargs

    def wrap(self, model: nn.Module) -> Callable[..., Any]:
        return self.parallel(model, **self.wrapper_kwargs())

    def parallel_loss_of(self, loss_fn: LossFn, target: Any) -> Callable[[Any], torch.Tensor]:
        """The parallel step's loss of its output: ``loss_fn(output, target)``, or the
        criterion wrapper's loss, the wrapper built on first use (inside ``devices()``,
        where it sees the virtual devices) around ``loss_fn`` as a module."""
        if self.parallel_loss is None:
            return quiet_size_warnings(_loss_of(loss_fn, target))
        require_loss_fn(loss_fn)
        factory = self.parallel_loss
        built: list[Callable[[Any, Any], torch.Tensor]] = []

        def loss(output: Any) -> torch.Tensor:
            if not built:
                criterion = loss_fn if isinstance(loss_fn, nn.Module) else LossModule(loss_fn)
                built.append(factory(criterion, **self.wrapper_kwargs()))
            result: torch.Tensor = built[0](output, target)
            return result

        return quiet_size_warnings(loss)

    def run(
        self,
        loss_of_output: Callable[[Any], torch.Tensor],
        *,
        parallel: bool,
        dtype: torch.dtype | None = None,
        record_replicas: bool | str = False,
        loss_argument: str = "loss_fn",
        measure_terms: bool = False,
        jitter: float = 0.0,
        split: bool = False,
        watch: Collection[str] = (),
    ) -> StepResult:
        """One step: through the wrapper (``parallel``) or alone, in ``dtype``; ``split``:
        alone, one chunk of the parallel split at a time (``_Split``); ``watch``: the
        submodules whose running the step reports (``StepResult.ran``)."""
        stage = "parallel" if parallel else "single-device"
        if dtype == torch.float64:
            stage = "float64 single-device"
        devices = self.devices() if parallel else contextlib.nullcontext()
        rows: list[int] = []
        gathers: list[int] = []
        try:
            with devices:
                result = run_step(
                    self.module,
                    self.args,
                    loss_of_output,
                    wrap=(
                        (lambda model: _WatchGathers(self.wrap(model), gathers)) if parallel
                        else _Split(self.plan.chunk_sizes, self.dim) if split
                        else None
                    ),
                    dtype=dtype,
                    device=self.device,
                    record_replicas=record_replicas,
                    loss_argument=loss_argument,
                    kwargs=self.kwargs,
                    measure_terms=measure_terms,
                    jitter=jitter,
                    dim=self.dim,
                    rows_seen=rows,
                    device_ids=self.device_ids,
                    watch=watch,
                )
                return replace(result, gathered_on=tuple(gathers)) if parallel else result
        except InvalidArgument:
            raise
        except Exception as error:
            lost = sum(self.plan.chunk_sizes) - sum(rows)
            if parallel and rows and lost > 0:
                raise ParallelMismatch(
                    f"The parallel step raised {type(error).__name__} after its wrapper lost rows of the "
                    f"batch: {len(rows)} replica forward{'s' if len(rows) != 1 else ''} received chunks of "
                    f"{rows} rows, {sum(rows)} of {sum(self.plan.chunk_sizes)} ({lost} reached no replica), "
                    f"so what comes back no longer lines up with the batch. {type(error).__name__}: "
                    f"{str(error).splitlines()[0] if str(error) else ''}\nScenario: {self.scenario}."
                ) from error
            error.add_note(f"dpverify: raised by the {stage} step. Scenario: {self.scenario}.")
            if parallel:
                self.explain_gather_error(error)
            for source in divergence_sources(self.module):
                error.add_note(f"dpverify: {source.describe()}")
            if dtype == torch.float64:
                error.add_note(
                    "dpverify: the float64 anchor run failed; pass rtol= and atol= to compare "
                    "with explicit tolerances instead"
                )
            raise

    def references(
        self, loss_in: Callable[[torch.dtype | None], Callable[[Any], torch.Tensor]], loss_argument: str = "loss_fn",
        *, shared: SharedSteps | None = None, rows: dict[Any, Any] | None = None, compared: bool = False,
    ) -> References:
        """The single-device step, plus what anchors the tolerance unless explicit
        tolerances were given: its float64 twin, and for float64 models a float32 probe and
        a jittered float64 run. ``loss_in(dtype)`` gives the loss for a run in ``dtype``
        (None: the working dtype).

        ``shared``: the steps of the checks this one is grouped with on the same module,
        batch and loss (``SharedSteps``); the steps it holds are not run again, and the
        steps run here are added to it. None: this check's own. ``rows``: the comparisons
        already made of the parallel step's own tensors (``Check.against``'s ``reuse``).

        ``compared``: the caller compares every gradient of the single-device step with the
        float64 one under the anchored rule (``_compare_proving``), which reads each of them
        anyway: their finiteness is proven there, not by a pass of its own
        (``SharedSteps.unproven``), and the error is the same.

        Raises:
            NonFiniteReference: the single-device or float64 step is not finite; nothing
                is compared then.
        """
        store = SharedSteps() if shared is None else shared.for_check(self)
        steps = store.steps
        step_rows = {} if rows is None else rows

        def step(kind: str, dtype: torch.dtype | None, stage: str | None = None, **options: Any) -> StepResult:
            # Stored only once it ran and proved finite (``stage``: what a non-finite one
            # is called): a failing step fails every check. The comparison proves the
            # gradients of the two steps it reads whole.
            deferred = compared and stage is not None and kind in _PROVEN_BY_COMPARISON
            if kind in steps:
                if kind in store.unproven and not deferred:
                    store.prove_finite()
                return steps[kind]
            try:
                result = self.run(loss_in(dtype), parallel=False, dtype=dtype, loss_argument=loss_argument, **options)
                if stage is not None:
                    _require_finite_step(result, stage, grads=not deferred)
            except Exception:
                # a step left unproven raises first, as it did when it was proven at once
                _unproven_first(store)
                raise
            steps[kind] = result
            if deferred:
                assert stage is not None
                store.unproven[kind] = stage
            return result

        def split(dtype: torch.dtype | None) -> Callable[[], StepResult | None]:
            # keyed by the split too: the checks of one batch on several device counts share steps
            kind = f"split {dtype} {tuple(self.plan.chunk_sizes)} dim {self.dim}"

            def run() -> StepResult | None:
                try:
                    return step(kind, dtype, "chunk-by-chunk single-device", split=True)
                except Exception:  # a module that cannot run chunk by chunk alone, or not finite: no such sample
                    return None

            return run

        # the module's divergence sources by type; the single-device step reports which of
        # them its forward called
        sources = [source.module for source in divergence_sources(self.module)]

        def made(
            expected: StepResult, anchor: StepResult | None = None, probe: StepResult | None = None,
            jitter: StepResult | None = None, settle: Callable[[], StepResult] | None = None,
        ) -> References:
            # A second reference that runs the parallel split chunk by chunk, without the
            # wrapper (the working dtype and the other precision), for a tensor that fails
            # every other rounding sample; not for a module with divergence sources.
            splits = None
            if anchor is not None and len(self.plan.chunk_sizes) > 1 and not sources:
                other = torch.float32 if self.dtype == torch.float64 else torch.float64
                splits = (split(None), split(other))
            # The last word on a tensor that fails every sample: a replay of DataParallel's
            # algorithm, measured against the single-device step in both precisions. Not
            # where a divergence source ran (one the forward never calls does not count):
            # what it feeds depends on the chunk, which the replay never settles, and a
            # mismatch of this module is reported with its sources as the likely cause,
            # as above (``dpverify check`` compares its eval-mode copy exactly).
            replay = None
            if anchor is not None and self.parallel_loss is None and not expected.ran:
                twin_full = probe if self.dtype == torch.float64 else anchor
                replay = (lambda: store.replay(self, loss_in, expected, twin_full)) if twin_full is not None else None
            return References(
                expected, anchor, probe, jitter, settle, splits=splits, shared=store, rows=step_rows, replay=replay,
            )

        if self.tolerance.explicit:
            return made(step("expected", None, "single-device", watch=sources))
        expected = step("expected", None, "single-device", watch=sources)
        anchor = step("anchor", torch.float64, "float64 single-device", measure_terms=True)
        if self.dtype == torch.float64:
            probe = step("probe", torch.float32)
            jitter = step("jitter", torch.float64, jitter=FLOAT64_JITTER)
            return made(expected, anchor, probe, jitter)
        if sources:
            # A mismatch of this module lists those sources as its likely cause, and
            # ``dpverify check`` explains it: a second sample of the rounding would not
            # change what the check reports.
            return made(expected, anchor)
        # Parameters one unit in the last place off: how far rounding alone moves this step.
        eps = torch.finfo(self.dtype).eps
        return made(expected, anchor, settle=lambda: step("settle", None, "jittered single-device", jitter=eps))

    def compare(self, actual: StepResult, refs: References, *, outputs: bool = True) -> list[TensorComparison]:
        """Outputs (when asked), the loss, and every parameter's gradient."""
        expected = refs.expected
        rows: list[TensorComparison] = []
        if outputs:
            actual_outputs = dict(compared_outputs(actual, expected))
            for path, tensor in expected.outputs:
                if path not in actual_outputs:
                    rows.append(TensorComparison(output_id(path), tuple(tensor.shape), tensor.numel(), mismatched=tensor.numel(), problem="is missing from the parallel step's output"))
                    continue
                rows.append(self.against(output_id(path), actual_outputs[path], refs, Key.output(path)))
        loss_terms = refs.anchor.loss_terms if refs.anchor is not None else None
        rows.append(self.against(TensorId("loss"), actual.loss, refs, Key.loss(), Terms(loss_terms, loss_terms) if loss_terms else None))
        for name in expected.grads:
            rows.append(self.against(TensorId("grad", name), actual.grads.get(name), refs, Key.grad(name), actual.terms(name), reuse=True))
        return rows

    def against(
        self, which: TensorId, actual: torch.Tensor | None, refs: References, key: Key,
        terms: Terms | None = None, *, contrast: bool = False, reuse: bool = False,
        pick: Callable[[StepResult], torch.Tensor | None] | None = None,
    ) -> TensorComparison:
        """Compares one parallel tensor, ``which``, with the references' tensor that ``key`` picks;
        ``terms`` is the magnitude of what the parallel step summed into it, if known. A
        ``contrast`` is expected to differ: it gets no second rounding sample. ``pick``
        finds ``actual``'s counterpart in a replay of DataParallel's algorithm (default
        ``key``), for a tensor made from the parallel step's own (a sum of its replicas').

        ``reuse``: ``actual`` is a tensor of the parallel step itself (its gradient), which
        the checks sharing the step compare alike: the comparison is made once per step
        (``References.rows``) and renamed for the others.
        """
        if reuse and actual is not None:
            slot = (id(actual), key, terms, contrast, self.tolerance)
            done = refs.rows.get(slot)
            if done is not None and done[0] is actual:
                again: TensorComparison = done[1].renamed(which)
                return again
            result = self.against(which, actual, refs, key, terms, contrast=contrast)
            refs.rows[slot] = (actual, result)
            return result

        def compare(sample: torch.Tensor | None) -> TensorComparison:
            # The references' tensors of ``key`` are the same objects for every row of
            # every check that shares them: what the rule derives from them is derived once.
            return compare_tensors(
                which, actual, refs.keyed(key), refs.keyed(key, "anchor"), self.tolerance, refs.keyed(key, "probe"),
                terms, sample, derived=refs.shared.derived,
            )

        result = compare(refs.keyed(key, "jitter"))
        if result.ok or result.problem is not None or contrast:
            return result
        if refs.settle is not None:
            # A tensor that fails against one sample of the single-device rounding gets a
            # second sample before it is called a mismatch: ill-conditioned computations
            # round with heavy tails. Passing checks never pay for this step.
            result = compare(refs.keyed(key, "settled"))
            if result.ok:
                return result
        sample = refs.split_sample(key, self.dtype)
        if sample is not None:
            # The step run chunk by chunk as the parallel split runs it, where its distance
            # from the full batch is rounding (``References.split_sample``).
            # Batch-size-dependent kernels round each chunk differently from the full batch.
            split_result = compare(sample)
            if split_result.ok:
                return split_result
        # The last word, run only here: a tensor bit-identical to a replay of DataParallel's
        # algorithm whose chunking is neutral passes (dpverify.checks.replay.settle_by_replay).
        replayed = refs.replay() if refs.replay is not None else None
        return result if replayed is None else settle_by_replay(result, actual, replayed, pick or key, key, compare)

    def replica_failures(self, ran: int, *, lost: str | None = None) -> list[str]:
        """A failure unless the parallel step really ran in parallel, judged by the
        ``ran`` replica forwards its hooks saw: fewer than two where the split calls for
        two or more matched nothing parallel (a torch.nn.DataParallel built without CUDA
        devices runs the module once, on the whole batch), so it is never a pass, whatever
        the model returns (an output, a dict, its own loss). ``lost`` says which chunks
        never ran, when the forwards received fewer rows than the batch holds: the fault is
        then a dropped chunk, not a call on the whole batch."""
        planned = self.plan.n_replicas
        if ran == 0:
            return [
                "No replica ran a forward of the module's copies: the wrapper never called the "
                "module (or a copy of it made with Module._replicate_for_data_parallel or deepcopy)."
            ]
        if planned < 2 or ran >= 2:
            return []
        head = (
            f"The parallel step ran one forward of the module where the split calls for {planned} replicas "
            f"(chunks {list(self.plan.chunk_sizes)}): nothing ran in parallel, so a match would say nothing."
        )
        if lost is not None:
            return [f"{head} {lost}"]
        return [
            f"{head} A wrapper that calls the module on the whole batch (as "
            "torch.nn.DataParallel does when it finds no CUDA device) does this; dpverify runs "
            "wrappers inside dpverify.virtual_devices, where torch's primitives are virtual, so "
            "one that still does not split the batch decides not to."
        ]

    def serial_notes(self, ran: int) -> list[str]:
        """A note when the split itself calls for one replica (one device, or one row) and
        one ran: the step compared the wrapper's one-device path, nothing parallel."""
        if ran >= 2 or self.plan.n_replicas >= 2:
            return []
        rows = sum(self.plan.chunk_sizes)
        return [
            f"Nothing ran in parallel: {rows} row{'s' if rows != 1 else ''} on device_ids {list(self.device_ids)} "
            f"make one chunk, so one replica forward ran; this match checks only the wrapper's "
            "one-device path. Use at least two devices and two rows to check the parallel step."
        ]

    def outcome(
        self,
        check: str,
        rows: Sequence[TensorComparison],
        *,
        contrasts: Sequence[TensorComparison] = (),
        notes: Sequence[str] = (),
        failures: Sequence[str] = (),
        scale: float | None = None,
        step: StepResult | None = None,
        replicas: int | None = None,
    ) -> StepComparison:
        """The comparison's report; its scenario is the split ``step`` (the parallel step)
        really ran, when given, and its ``replicas`` the replica forwards ``step`` recorded
        (or ``replicas``), with a note when that is one on a one-chunk split."""
        if replicas is None and step is not None:
            replicas = len(step.contributions)
        if replicas is not None:
            notes = [*notes, *self.serial_notes(replicas)]
        return step_comparison(
            check, self.scenario_of(step), self.tolerance, self.dtype, self.module, rows,
            contrasts=contrasts, notes=notes, failures=failures, scale=scale, replicas=replicas,
        )


def output_id(path: str) -> TensorId:
    """The id of the step's output at ``path`` (``output``, ``output['logits']``): its
    path is its kind, the text messages show."""
    return TensorId("output", path)


def compared_outputs(actual: StepResult, expected: StepResult) -> tuple[tuple[str, torch.Tensor], ...]:
    """The parallel step's outputs as compared with the single-device ones: as returned,
    or, when the wrapper returned one output per replica (a list of them, where the module
    returns one structure), those outputs concatenated along the split dimension."""
    paths = [path for path, _tensor in expected.outputs]
    if actual.gathered is not None and [p for p, _t in actual.outputs] != paths and [p for p, _t in actual.gathered] == paths:
        return actual.gathered
    return actual.outputs


def _per_replica_note(actual: StepResult, expected: StepResult) -> list[str]:
    if actual.gathered is None or compared_outputs(actual, expected) is not actual.gathered:
        return []
    return [
        f"The wrapper returned one output per replica ({len(actual.contributions)}); they were "
        "compared with the single-device output after concatenation along the split dimension."
    ]


def raise_unless_ok(result: StepComparison, msg: Msg) -> StepComparison:
    __tracebackhide__ = True
    if not result.ok:
        # rendered when read: dpverify check reads only the verdict of a mismatch it explains
        raise ParallelMismatch(lambda: render(result.message(), msg), result)
    return result


class _WatchGathers:
    """A wrapper's forward, noting where it gathered: the virtual ``Gather`` targets, or
    on real devices the device of the first output tensor (-1 for the host)."""

    def __init__(self, runner: Callable[..., Any], seen: list[int]) -> None:
        self.runner = runner
        self.seen = seen

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with observe_gathers() as gathers:
            output = self.runner(*args, **kwargs)
        if not gathers:
            first = first_batched(output)
            if first is not None and first.device.type == "cuda" and not isinstance(output, (list, tuple)):
                gathers.append(first.device.index)
        self.seen.extend(gathers)
        return output


def _gathered_elsewhere(check: Check, step: StepResult) -> list[str]:
    """A failure when the wrapper gathered its outputs on another device than
    ``output_device`` (its last gather in forward: the outputs it returned)."""
    if not step.gathered_on or step.gathered_on[-1] == check.output_device:
        return []
    return [
        f"The wrapper gathered its outputs on {_where(step.gathered_on[-1])}; output_device="
        f"{check.output_device} asks for {_where(check.output_device)}, where the loss is meant "
        "to run (on GPUs the outputs would sit on another device than requested)."
    ]


def _where(device: int) -> str:
    return "the host" if device == -1 else f"device {device}"


def _name(obj: object) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def _loss_of(loss_fn: LossFn, target: Any) -> Callable[[Any], torch.Tensor]:
    require_loss_fn(loss_fn)
    return lambda output: loss_fn(output, target)


def _target_on(target: Any, check: Check, dtype: torch.dtype | None) -> Any:
    if isinstance(target, torch.Tensor):
        cast = dtype if dtype is not None and target.is_floating_point() else None
        return target.detach().to(device=check.device, dtype=cast)
    return target


@dataclass(frozen=True)
class References:
    """The single-device step in the working dtype, and what anchors the tolerance: its
    float64 twin and, for float64 models, a float32 probe of the rounding and a float64 run
    from jittered parameters (None with explicit tolerances). For other dtypes ``settle``
    runs the working-dtype step from parameters one unit in the last place off, only when
    a tensor would otherwise fail: a second sample of the rounding (None for a module with
    divergence sources, whose mismatches are explained by them)."""

    expected: StepResult
    anchor: StepResult | None = None
    probe: StepResult | None = None
    jitter: StepResult | None = None
    settle: Callable[[], StepResult] | None = None
    #: the step run chunk by chunk (``_Split``) in the working dtype and in the other
    #: precision (float64, or float32 for a float64 model), each run on first need; None
    #: where no such sample is taken
    splits: tuple[Callable[[], StepResult | None], Callable[[], StepResult | None]] | None = None
    #: the steps, the tensors ``keyed`` picked from them and what the comparisons derived
    #: from those, for every check that shares the steps
    shared: SharedSteps = field(default_factory=lambda: SharedSteps(), repr=False, compare=False)
    #: comparisons of the parallel step's own tensors (``Check.against``'s ``reuse``),
    #: shared by the checks that share that step
    rows: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    #: the replay of DataParallel's algorithm (``dpverify.checks.replay``), run on first
    #: need; None where no replay is taken (explicit tolerances, a criterion wrapper)
    replay: Callable[[], Replay | None] | None = field(default=None, repr=False, compare=False)

    def split_sample(self, key: Key, dtype: torch.dtype) -> torch.Tensor | None:
        """The chunk-by-chunk step's tensor of ``key``, when its distance from the full-batch
        step is rounding: the same distance in the other precision must scale with the
        precision, below 2^-10 of it from float64 to float32 (a module whose result depends
        on the split, a chunk-mean loss, differs by as much in float64 as in float32);
        None otherwise, or when there is no such sample."""
        if self.splits is None or self.anchor is None:
            return None
        working, other = (run() for run in self.splits)
        if working is None or other is None:
            return None
        sample, twin = key(working), key(other)
        # the full-batch steps in the same two precisions
        other_full = self.probe if dtype == torch.float64 else self.anchor
        full, full_twin = key(self.expected), key(other_full) if other_full is not None else None
        if sample is None or twin is None or full is None or full_twin is None:
            return None
        if sample.shape != full.shape or twin.shape != full_twin.shape:
            return None
        distance = largest_abs(sample.double() - full.double())
        twin_distance = largest_abs(twin.double() - full_twin.double())
        near, far = (distance, twin_distance) if dtype == torch.float64 else (twin_distance, distance)
        return sample if near <= far * _SPLIT_SCALING else None

    def keyed(self, key: Key, step: str = "expected") -> torch.Tensor | None:
        """The tensor ``key`` picks from one of the steps (``expected``, ``anchor``,
        ``probe``, ``jitter``, or ``settled``: the second rounding sample, run on first
        need), picked once: the same object for every comparison."""
        picked = self.shared.picked
        slot = (key, step)
        if slot not in picked:
            if step == "settled":  # run once: ``settle`` keeps its step among the shared ones
                assert self.settle is not None
                source = self.settle()
            else:
                source = getattr(self, step)
            picked[slot] = key(source) if source is not None else None
        return picked[slot]


# How much smaller the float64 chunk-by-chunk distance from the full batch must be than the
# float32 one for it to count as rounding (it is about 2^-29 of it when it is).
_SPLIT_SCALING = 2.0**-10


class _Split:
    """The ``wrap`` of a step that runs the module alone, one chunk of the parallel split at
    a time: every batched tensor argument split along ``dim`` into ``sizes``, the outputs
    concatenated as DataParallel gathers them. What a correct parallel step computes
    kernel by kernel."""

    def __init__(self, sizes: Sequence[int], dim: int) -> None:
        self.sizes, self.dim = list(sizes), dim

    def __call__(self, module: nn.Module) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            outputs = []
            start = 0
            for size in self.sizes:
                def part(tensor: torch.Tensor, start: int = start, size: int = size) -> torch.Tensor:
                    return tensor.narrow(self.dim, start, size) if tensor.dim() > self.dim else tensor

                outputs.append(module(*map_tensors(args, part), **map_tensors(kwargs, part)))
                start += size
            return concatenate(outputs, self.dim)

        return run


def _require_finite_step(step: StepResult, stage: str, *, grads: bool = True) -> None:
    """Raises ``NonFiniteReference`` for the first of ``step``'s outputs, loss and (with
    ``grads``) gradients that holds NaN or inf."""
    for path, tensor in step.outputs:
        require_finite(output_id(path), tensor, stage)
    require_finite(TensorId("loss"), step.loss, stage)
    if grads:
        _require_finite_grads(step, stage)


def _require_finite_grads(step: StepResult, stage: str, names: Collection[str] | None = None) -> None:
    """``_require_finite_step`` for ``step``'s gradients (those of ``names``, or all)."""
    for name, grad in step.grads.items():
        if names is None or name in names:
            require_finite(TensorId("grad", name), grad, stage)


#: The steps whose gradients the gradient check's comparison proves finite (``compared``
#: in ``Check.references``): it reads each of them whole under the anchored rule.
_PROVEN_BY_COMPARISON = ("expected", "anchor")


def _split_of(check: Check) -> tuple[Any, ...]:
    """What a parallel step ran: the split, and the wrappers."""
    return (tuple(check.device_ids), check.output_device, check.dim, check.parallel, check.parallel_loss)


@dataclass
class SharedSteps:
    """The steps the checks of one module, batch, target and loss share, held by whoever
    groups those checks and passes it to each of them: the planner
    (``dpverify.planner.plan_checks``) makes one per batch, for every check on it on every
    device count. A check given none makes its own, so each call of a public assertion
    runs its steps anew.

    Whoever passes one to several checks promises they run on the same module, batch,
    target and loss, unchanged in between (the checks run on copies and change none of
    them). One device and dtype: a check on another device gets steps of its own
    (``for_check``).

    Attributes:
        steps: the single-device steps by kind (working dtype, float64 anchor, float32
            probe, jittered samples, the split run chunk by chunk).
        picked: the tensors ``References.keyed`` picked from them: the same objects for
            every comparison.
        derived: what the comparisons derived from those tensors (``compare_tensors``'s
            ``derived``).
        left: the gradient check's parallel step, left for the replica-sum check of the
            same split through the same wrappers, which takes it (``take``).
        evidence: exact mode's proofs (``Check.proven``), by split.
    """

    steps: dict[str, StepResult] = field(default_factory=dict)
    picked: dict[tuple[Key, str], torch.Tensor | None] = field(default_factory=dict)
    derived: Derived = field(default_factory=dict)
    left: tuple[tuple[Any, ...], StepResult, dict[Any, Any]] | None = None
    #: exact mode's evidence (``Check.proven``) by split (chunk sizes, dim)
    evidence: dict[tuple[tuple[int, ...], int], Evidence] = field(default_factory=dict)
    device: torch.device | None = None
    dtype: torch.dtype | None = None
    #: the replays of DataParallel's algorithm, by split (None: the replay raised)
    replays: dict[tuple[Any, ...], Replay | None] = field(default_factory=dict)
    #: the steps whose gradients are not yet proven finite, in the order they ran, with
    #: what a non-finite one is called: the gradient check's comparison proves them as it
    #: reads them (``_compare_proving``), and anyone else who takes such a step first
    #: proves them (``prove_finite``)
    unproven: dict[str, str] = field(default_factory=dict)

    def release(self) -> None:
        """Forgets every step held, as new ``SharedSteps`` hold none: whoever grouped the
        checks calls it after the last of them, so that a batch's steps (model-sized
        gradients, outputs, replays) do not outlive its checks. A check given these steps
        afterwards runs its own again."""
        fresh = SharedSteps()
        for name in ("steps", "picked", "derived", "left", "evidence", "device", "dtype", "replays", "unproven"):
            setattr(self, name, getattr(fresh, name))

    def prove_finite(self, names: Collection[str] | None = None) -> None:
        """Proves the unproven steps' gradients finite (those of ``names``, or all), in
        the order the steps ran: the first that is not raises ``NonFiniteReference``, the
        error each step's own check gave right after it ran.

        Raises:
            NonFiniteReference: a gradient holds NaN or inf.
        """
        for kind, stage in list(self.unproven.items()):
            _require_finite_grads(self.steps[kind], stage, names)
        if names is None:
            self.unproven.clear()

    def forget_split(self) -> None:
        """Forgets what only the checks of one split use, once the last of them ran (see
        ``release``): the replays of DataParallel's algorithm, the steps run chunk by chunk,
        and the references divided by a replica count (``Key.grad(name, replicas)``, the
        replica-sum check's average) with what the comparisons derived from them. The
        batch's own steps stay for its other splits; a check that needs a forgotten one
        again makes it again, the same."""
        self.replays.clear()
        for kind in [kind for kind in self.steps if kind.startswith("split ")]:
            del self.steps[kind]
            self.unproven.pop(kind, None)
        divided = [slot for slot in self.picked if slot[0].divisor != 1]
        gone = {id(self.picked.pop(slot)) for slot in divided}
        self.derived = {slot: held for slot, held in self.derived.items() if not gone & {id(t) for t in held[:4] if t is not None}}

    def for_check(self, check: Check) -> SharedSteps:
        """These steps, or new ones when ``check`` runs on another device or dtype than the
        checks before it."""
        if self.device is None:
            self.device, self.dtype = check.device, check.dtype
        if (self.device, self.dtype) != (check.device, check.dtype):
            return SharedSteps()
        return self

    def replay(
        self, check: Check, loss_in: Callable[[torch.dtype | None], Callable[[Any], torch.Tensor]],
        full: StepResult, twin_full: StepResult,
    ) -> Replay | None:
        """The replay of ``check``'s split, run once for every check of that split; None
        where it raised (a module that cannot be deep-copied or run chunk by chunk alone)."""
        split = (tuple(check.device_ids), check.output_device, check.dim)
        if split not in self.replays:
            try:
                self.replays[split] = replay_dataparallel(check, loss_in, full, twin_full)
            except Exception:  # no replay: the verdict stands as the tolerance gave it
                self.replays[split] = None
        return self.replays[split]

    def leave(self, check: Check, step: StepResult, rows: dict[Any, Any]) -> None:
        """Leaves ``check``'s parallel step for the next check that ``take``s it."""
        self.left = (_split_of(check), step, rows)

    def take(self, check: Check) -> tuple[StepResult | None, dict[Any, Any]]:
        """The parallel step left by a check of the same split through the same wrappers
        (and the comparisons made of its tensors), or None; none is left afterwards."""
        left, self.left = self.left, None
        if left is None or left[0] != _split_of(check):
            return None, {}
        return left[1], left[2]


def _steps(
    check: Check, loss_fn: LossFn, target: Any, shared: SharedSteps | None, *, take: bool,
) -> tuple[StepResult, References]:
    """The parallel step, recording every replica's contribution, and the references;
    ``shared`` as in ``grads_match``. The gradient check leaves its parallel step there for
    the replica-sum check, which takes it (``take``: ``SharedSteps.take``).

    Each replica's gradients are kept (a copy of every one) only where a replica-sum check
    may read them: this one (``take``), or one of the checks ``shared`` groups it with. A
    gradient check of its own (``shared`` None: ``assert_dp_grads_match``) leaves its step
    to nobody, so it records only what the tolerance needs of them, their magnitudes."""
    check.require_target(target)
    keep = take or shared is not None
    shared = SharedSteps() if shared is None else shared.for_check(check)
    left, left_rows = shared.take(check)  # a step left serves the next check only
    parallel, rows = (left, left_rows) if take else (None, {})
    if parallel is None:
        loss_raised: list[BaseException] = []
        try:
            parallel = check.run(
                _watched(check.parallel_loss_of(loss_fn, _target_on(target, check, None)), loss_raised),
                parallel=True, record_replicas=True if keep else "magnitudes",
                loss_argument="parallel_loss_fn" if check.parallel_loss is not None else "loss_fn",
            )
        except InvalidArgument:
            raise
        except Exception as error:
            problem = _ungatherable_output(check) if check.parallel_loss is None and isinstance(error, (TypeError, AttributeError, ValueError)) else None
            if problem is not None:
                raise InvalidArgument(problem) from error
            if loss_raised and check.parallel_loss is None:
                # raised applying loss_fn to the gathered output: the same on one device is no mismatch
                _raise_if_single_device_fails(check, loss_fn, target)
            raise
        if not take:
            shared.leave(check, parallel, rows)
    refs = check.references(
        lambda dtype: _loss_of(loss_fn, _target_on(target, check, dtype)), shared=shared, rows=rows, compared=not take,
    )
    return parallel, refs


def _watched(loss: Callable[[Any], torch.Tensor], raised: list[BaseException]) -> Callable[[Any], torch.Tensor]:
    """``loss``, recording in ``raised`` what it raises."""

    def watched(output: Any) -> torch.Tensor:
        try:
            return loss(output)
        except Exception as error:
            raised.append(error)
            raise

    return watched


def _raise_if_single_device_fails(check: Check, loss_fn: LossFn, target: Any) -> None:
    """After the parallel step raised in ``loss_fn``: when the single-device step raises too, nothing
    parallel is at fault. The loss, the target or the batch cannot be used as given (a loss
    for another output shape, a key the output lacks), which is a usage error, not a
    mismatch of the parallel step.

    Raises:
        InvalidArgument: the single-device step raised; its exception is the ``__cause__``.
    """
    try:
        check.run(_loss_of(loss_fn, _target_on(target, check, None)), parallel=False)
    except InvalidArgument:
        raise
    except Exception as error:
        if ONE_ROW_BATCHNORM in str(error):
            # train-mode BatchNorm on one row: the parallel error stands, and the registry
            # explains it by the module (dpverify.core.divergence)
            return
        raise InvalidArgument(
            f"the single-device step raised too, so this is no parallel mismatch: {describe_exception(error)}. "
            "loss_fn(output, target), the target or the inputs cannot be used as given; pass a loss_fn that "
            "takes this model's output and target (on the command line: --loss MODULE:FN, --output-key KEY "
            "or --inputs MODULE:FN)"
        ) from error


def assert_dp_grads_match(
    module: nn.Module,
    inputs: Any,
    target: Any,
    *,
    loss_fn: LossFn,
    device_ids: Sequence[int],
    output_device: int | None = None,
    parallel: Parallel | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    msg: Msg = None,
    forward_kwargs: Mapping[str, Any] | None = None,
    dim: int = 0,
    parallel_loss_fn: ParallelLoss | None = None,
    exact: bool = False,
) -> StepComparison:
    """Asserts one DataParallel step gives the single-device outputs, loss and gradients.

    The step (forward, ``loss_fn(output, target)``, backward) runs on deep copies of
    ``module``: through ``parallel`` and alone on the full batch, plus a float64 twin of the
    single-device step that anchors the tolerance (see ``Tolerance``). ``module`` and its
    gradients are left untouched.

    Args:
        module: the model to check.
        inputs: the batch tensor, or a tuple of positional forward arguments (``()`` for a
            keyword-only call, the batch in ``forward_kwargs``).
        target: the second argument of ``loss_fn``.
        loss_fn: ``loss_fn(output, target)`` returns a scalar mean loss.
        device_ids: DataParallel's devices (virtual ids when CUDA devices are missing).
        output_device: where outputs are gathered (default ``device_ids[0]``, -1 for host).
        parallel: the DataParallel implementation under test, called as
            ``parallel(module, device_ids=..., output_device=...)`` (plus ``dim=`` when
            ``dim`` is not 0); default ``dpverify.data_parallel``. A
            ``torch.nn.DataParallel`` subclass runs as it is, on virtual devices where
            the CUDA devices are missing; its replicas must really run (one forward on the
            whole batch where the split calls for two or more replicas is a failure).
        rtol: explicit relative tolerance (with ``atol``) instead of the anchored rule.
        atol: explicit absolute tolerance (with ``rtol``).
        msg: replaces the failure message, or a callable that rewrites it.
        forward_kwargs: keyword arguments of the forward call (scattered like ``inputs``).
        dim: the dimension the batch is split and gathered along (DataParallel's ``dim``).
        parallel_loss_fn: the parallel side's own loss, for wrappers that leave one output
            per replica (a model/criterion pair): called as ``parallel_loss_fn(criterion,
            device_ids=..., output_device=...)``, inside the virtual devices, with
            ``loss_fn`` as the criterion (wrapped in a module when it is a function), it
            returns ``loss(outputs, target)``. The single-device side keeps ``loss_fn``;
            per-replica outputs are compared after concatenation along ``dim``.
        exact: compare without tolerance, where the arithmetic is exact: the steps run on
            float64 copies of the module, inputs, target and ``forward_kwargs`` on a coarse
            dyadic grid (``dpverify.exact.case.ExactCase``); every operation of the
            single-device step, of the batch reversed and of the scatter's chunks is shown
            exact as it runs (``dpverify.exact.case.prove``), so a correct parallel step
            is bit-identical and one unit in the last place of one element is a mismatch.
            The report's notes carry the evidence. ``parallel`` and ``parallel_loss_fn``
            run on the copies (with ``parallel_loss_fn``, ``loss_fn`` on each chunk is
            proven exact too). Not with ``rtol``/``atol``.

    Returns:
        The comparison, for inspection (``str()`` summarises it).

    Raises:
        ParallelMismatch: an output, the loss or a gradient differs beyond tolerance.
        InvalidArgument: an argument cannot be used; the message says which and why. In
            exact mode, also an operation that cannot be shown exact (tanh, softmax, a
            mean over a count that is not a power of two, a model too deep or wide for
            float64's 53 bits): the message names it, where it ran and what to change.
    """
    __tracebackhide__ = True
    check = Check.create(
        module, inputs, device_ids=device_ids, output_device=output_device,
        parallel=parallel, rtol=rtol, atol=atol, forward_kwargs=forward_kwargs, dim=dim,
        parallel_loss_fn=parallel_loss_fn, exact=exact,
    )
    return raise_unless_ok(grads_match(check, loss_fn, target), msg)


def grads_match(check: Check, loss_fn: LossFn, target: Any, shared: SharedSteps | None = None) -> StepComparison:
    """``assert_dp_grads_match`` on a built ``check``, returning its comparison whatever
    it found; ``shared``: the steps of the checks grouped with it (``SharedSteps``)."""
    target = check.on_grid(target)
    proof = check.proven(loss_fn, target, shared)
    parallel_step, refs = _steps(check, loss_fn, target, shared, take=False)
    title = "DataParallel outputs and gradients must match the single-device step"
    rows = _compare_proving(check, parallel_step, refs)
    ran = len(parallel_step.contributions)
    lost = _lost_chunks(check, parallel_step, refs)
    failures = check.replica_failures(ran, lost=lost) + _gathered_elsewhere(check, parallel_step)
    failed = bool(failures) or not all(row.ok for row in rows)
    notes, scale = _diagnose(check, parallel_step, refs, loss_fn, target) if failed else ([], None)
    lost_note = [lost] if lost and failed and ran >= 2 else []
    notes = [*proof, *_per_replica_note(parallel_step, refs.expected), *lost_note, *_differing_rows(check, parallel_step, refs, rows), *notes]
    return check.outcome(title, rows, notes=notes, failures=failures, scale=scale, step=parallel_step)


def _compare_proving(check: Check, step: StepResult, refs: References) -> list[TensorComparison]:
    """``check.compare`` of ``step`` with the references, proving on the way the gradients
    the references left unproven (``SharedSteps.unproven``): the anchored rule reads every
    gradient of both whole and raises on the first that is not finite; a gradient it did
    not read (missing from the parallel step, of another shape) is proven here. Whatever
    the comparison raises, the unproven steps raise first, so the error is the one their
    own checks gave before the comparison began."""
    store = refs.shared
    try:
        rows = check.compare(step, refs)
    except Exception:
        _unproven_first(store)
        raise
    if store.unproven:
        unread = {row.id.name for row in rows if row.id.kind == "grad" and (row.problem is not None or row.absent)}
        if unread:
            store.prove_finite(unread)
        store.unproven.clear()
    return rows


def _unproven_first(store: SharedSteps) -> None:
    """Called while an exception is handled: raises what the unproven steps' own checks
    raised, as they raised it (not as an error during the handling of another); nothing
    when they are finite.

    Raises:
        NonFiniteReference: an unproven step's gradient holds NaN or inf.
    """
    try:
        store.prove_finite()
    except NonFiniteReference as first:
        raise first from None


# Rows of an output the mismatch message locates one by one, and elements of one it
# matches row against row (a distance matrix of the rows): beyond them, it says nothing.
_MOST_ROWS = 4096
_MOST_ELEMENTS = 1 << 24


def _lost_chunks(check: Check, step: StepResult, refs: References) -> str | None:
    """A sentence when the replica forwards received fewer rows than the batch holds (None
    otherwise): which of torch's chunks never ran, named by the rows of the single-device
    output that the parallel output holds, or else by the rows the forwards received."""
    received = list(step.replica_rows)
    planned = list(check.plan.chunk_sizes)
    batch = sum(planned)
    if not received or sum(received) >= batch:
        return None
    forwards = f"The replica forward{'s' if len(received) != 1 else ''} received {received} rows, {sum(received)} of {batch}"
    found = _rows_held(check, step, refs, sum(received))
    if found is None:
        return (
            f"{forwards}: {batch - sum(received)} rows never reached a replica (torch's scatter makes chunks "
            f"{planned}), so the wrapper dropped rows of the batch rather than calling the module on all of it."
        )
    missing = [row for row in range(batch) if row not in found]
    starts = [sum(planned[:i]) for i in range(len(planned))]
    dropped = [i for i, start in enumerate(starts) if all(row in missing for row in range(start, start + planned[i]))]
    covered = [row for i in dropped for row in range(starts[i], starts[i] + planned[i])]
    text = f"{forwards}; the parallel output holds the single-device {_row_ranges(sorted(found))}"
    if covered != missing:
        return f"{text}, so {_row_ranges(missing)} never reached a replica: the wrapper dropped them."
    last = dropped == list(range(len(planned) - len(dropped), len(planned)))
    which = ("the last chunk" if len(dropped) == 1 else f"the last {len(dropped)} chunks") if last else (
        "chunk " + ", ".join(map(str, dropped)) if len(dropped) == 1 else "chunks " + ", ".join(map(str, dropped))
    )
    return f"{text}, so {which} ({_row_ranges(missing)}) never ran: the wrapper dropped {'it' if len(dropped) == 1 else 'them'}."


def _rows_held(check: Check, step: StepResult, refs: References, count: int) -> list[int] | None:
    """Which rows of the single-device output the parallel output's ``count`` rows are
    (each the nearest, all distinct, each within a thousandth of the output's size), read
    from the first output that has those rows; None when no output tells."""
    expected = dict(refs.expected.outputs)
    batch = sum(check.plan.chunk_sizes)
    for path, got in compared_outputs(step, refs.expected):
        reference = expected.get(path)
        if reference is None or got.dim() == 0 or got.dim() != reference.dim() or not -got.dim() <= check.dim < got.dim():
            continue
        if got.size(check.dim) != count or reference.size(check.dim) != batch or reference.numel() > _MOST_ELEMENTS:
            continue
        nearest = _nearest_rows(got, reference, check.dim)
        if nearest is not None and len(set(nearest[0])) == count and nearest[1] <= 1e-3:
            return nearest[0]
    return None


def _nearest_rows(actual: torch.Tensor, expected: torch.Tensor, dim: int) -> tuple[list[int], float] | None:
    """For each row of ``actual`` along ``dim``, the nearest row of ``expected``, and the
    greatest of those distances relative to ``expected``'s largest entry; None when the
    rows have different sizes."""
    a, e = (t.detach().movedim(dim, 0).double().cpu() for t in (actual, expected))
    a, e = a.reshape(a.shape[0], -1), e.reshape(e.shape[0], -1)
    if a.shape[1] != e.shape[1]:
        return None
    nearest = torch.cdist(a, e).min(dim=1)
    return nearest.indices.tolist(), float(nearest.values.max()) / (float(e.abs().max()) or 1.0)


def _diagnose(
    check: Check, actual: StepResult, refs: References, loss_fn: LossFn, target: Any,
) -> tuple[list[str], float | None]:
    """Names the classic wrapper bugs when their signature is in the results; and the
    uniform factor between the gradients, when there is one."""
    expected = refs.expected
    references = dict(expected.outputs)
    notes = [
        text for path, got in compared_outputs(actual, expected)
        if (text := _reordered(path, got, references.get(path), check.dim))
    ]
    notes += _loss_averaging_trap(check, actual, refs, loss_fn, target)
    present = [g for g in expected.grads.values() if g is not None and bool(g.any())]
    if present and all(actual.grads.get(n) is None for n, g in expected.grads.items() if g is not None):
        notes.append(
            "No gradient reached the module's parameters in the parallel step: the wrapper "
            "ran copies that are not connected to them by autograd (for example "
            "copy.deepcopy per replica instead of torch's replicate, whose Broadcast sums "
            "replica gradients back into the parameters)."
        )
    rounding = max(1e-4, 4 * torch.finfo(check.dtype).eps)
    scale = uniform_scale(actual.grads, expected.grads, rounding)
    if scale is not None:
        notes.append(explain_scale(scale, check.plan.n_replicas, rounding))
    return notes, scale


def _differing_rows(check: Check, actual: StepResult, refs: References, rows: Sequence[TensorComparison]) -> list[str]:
    """Per mismatched output, a sentence naming its rows (along the split dimension) that
    differ and the replicas whose chunks they are, by the rows each replica forward really
    received (a wrapper that breaks some replicas only, such as one that loses their
    buffers, shows here as the rows of those replicas)."""
    failing = {row.id: row for row in rows if not row.ok and row.problem is None}
    notes = []
    for path, got in compared_outputs(actual, refs.expected):
        row = failing.get(output_id(path))
        reference = refs.keyed(Key.output(path), "expected" if check.tolerance.explicit else "anchor")
        if row is None or reference is None or got.shape != reference.shape or got.dim() == 0:
            continue
        dim = check.dim if -got.dim() <= check.dim < got.dim() else 0
        if got.size(dim) > _MOST_ROWS:
            continue
        bad = _rows_over(got, reference, row, check.tolerance, dim)
        if bad:
            notes.append(_rows_sentence(path, bad, got.size(dim), list(actual.replica_rows)))
    return notes


def _rows_over(got: torch.Tensor, reference: torch.Tensor, row: TensorComparison, tolerance: Tolerance, dim: int) -> list[int]:
    """The rows of ``got`` along ``dim`` farther from ``reference`` than ``row`` allows:
    an element beyond the elementwise allowance, or, for an error that fails the tensor's
    norm only (small, spread over the tensor), a row whose share of the difference's norm
    exceeds its share of the allowed norm. A row at a time, in float64: the temporaries
    stay the size of one row (an LM's logits are hundreds of megabytes in float64)."""
    got, reference = got.detach().movedim(dim, 0), reference.detach().movedim(dim, 0)
    count = got.size(0)
    over: list[int] = []
    norms: list[float] = []
    for i in range(count):
        mine = got[i].to(device="cpu", dtype=torch.float64)
        theirs = reference[i].to(device="cpu", dtype=torch.float64)
        if tolerance.explicit:
            assert tolerance.rtol is not None
            assert tolerance.atol is not None
            if not bool(torch.isclose(mine, theirs, rtol=tolerance.rtol, atol=tolerance.atol).all()):
                over.append(i)
            continue
        # not in place: a float64 output on the host is its own .to(float64)
        difference = (mine - theirs).abs_().nan_to_num_(nan=math.inf)
        if difference.numel() and float(difference.max()) > row.allowed:
            over.append(i)
        norms.append(float(torch.linalg.vector_norm(difference)) if difference.numel() else 0.0)
    if over or tolerance.explicit or row.norm_allowed <= 0:
        return over
    share = row.norm_allowed / math.sqrt(count)
    return [i for i, norm in enumerate(norms) if norm > share]


def _row_ranges(rows: Sequence[int]) -> str:
    """``row 4``, ``rows 2-4``, ``rows 0-1, 5``: row indices as runs."""
    runs: list[list[int]] = []
    for row in rows:
        if runs and row == runs[-1][1] + 1:
            runs[-1][1] = row
        else:
            runs.append([row, row])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:8]) + (", ..." if len(runs) > 8 else "")
    return ("row " if len(rows) == 1 else "rows ") + text


def _rows_sentence(path: str, bad: Sequence[int], count: int, chunks: Sequence[int]) -> str:
    """Which rows of ``path`` differ and, when the replicas' chunks (the rows each forward
    received, in device order) tile the rows, which replicas made them."""
    text = f"{path}: {_row_ranges(bad)} of {count} differ"
    if len(chunks) < 2 or sum(chunks) != count:
        return text + "."
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    wrong = sorted({next(r for r, start in enumerate(starts) if start <= row < start + chunks[r]) for row in bad})
    right = [r for r in range(len(chunks)) if r not in wrong]

    def replicas(group: Sequence[int]) -> str:
        return ("replica " if len(group) == 1 else "replicas ") + _row_ranges(group).split(" ", 1)[1]

    def rows_of(group: Sequence[int]) -> str:
        return _row_ranges([row for r in group for row in range(starts[r], starts[r] + chunks[r])])

    if right:
        own = "'s" if len(right) == 1 else "'"
        text += f": the chunk{'s' if len(wrong) > 1 else ''} of {replicas(wrong)} ({rows_of(wrong)})"
        text += f", while {replicas(right)}{own} {rows_of(right)} match"
    else:
        text += ": rows of every replica's chunk"
    text += f" (chunks of {list(chunks)} rows, as the replicas' forwards received them)."
    if right == [0]:
        text += (
            " Only the copies differ: replica 0 holds the module's own parameters and buffers, the others "
            "what the wrapper copied for them (their buffers, parameters or attributes are the likely cause)."
        )
    return text


def _reordered(path: str, actual: torch.Tensor, expected: torch.Tensor | None, dim: int = 0) -> str | None:
    """A sentence when ``actual``'s rows (along ``dim``) are ``expected``'s in another
    order (a gather that concatenates the replicas' outputs out of order)."""
    if expected is None or actual.shape != expected.shape or not -actual.dim() <= dim < actual.dim():
        return None
    if not 1 < actual.shape[dim] <= 4096:
        return None
    order, distance = _nearest_rows(actual, expected, dim) or ([], 0.0)
    if sorted(order) != list(range(len(order))) or order == sorted(order) or distance > 1e-4:
        return None
    return (
        f"The rows of {path} are the single-device rows in another order ({order}): the "
        "replicas' outputs were gathered out of order. torch concatenates them in "
        "device_ids order, whatever output_device is."
    )


def _loss_averaging_trap(check: Check, actual: StepResult, refs: References, loss_fn: LossFn, target: Any) -> list[str]:
    """A sentence when the parallel loss is the plain mean of the replicas' per-chunk
    losses (a criterion wrapper that averages what its replicas return) rather than the
    full-batch loss: the reference output and target, cut into the chunks the wrapper
    really made, give both candidates, and the parallel loss must sit on the mean of the
    chunk losses, well away from the full-batch loss."""
    sizes = list(actual.replica_rows)
    reference = refs.anchor or refs.expected
    if len(sizes) < 2 or reference.output is None:
        return []
    batch = sum(sizes)
    chunk_target = _target_on(target, check, reference.loss.dtype)
    losses = []
    start = 0
    try:
        with torch.no_grad():
            for size in sizes:
                def cut(tensor: torch.Tensor, start: int = start, size: int = size) -> torch.Tensor:
                    if tensor.dim() == 0 or tensor.size(check.dim) != batch:
                        return tensor
                    return tensor.narrow(check.dim, start, size)

                # a target laid out otherwise than the output is cut as it is: torch's size
                # warning would be about dpverify's cut, not the user's loss
                losses.append(float(quiet_size_warnings(_loss_of(loss_fn, map_tensors(chunk_target, cut)))(map_tensors(reference.output, cut))))
                start += size
    except Exception:  # a loss that cannot take one chunk: no diagnosis
        return []
    full, parallel = float(reference.loss), float(actual.loss)
    mean = sum(losses) / len(losses)
    # The parallel loss must be the mean of the chunk losses up to the rounding the loss
    # comparison allows, and the full-batch loss well beyond it.
    loss_terms = refs.anchor.loss_terms if refs.anchor is not None else None
    terms = Terms(loss_terms, loss_terms) if loss_terms else None
    allowed = check.against(TensorId("loss"), actual.loss, refs, Key.loss(), terms).allowed
    rounding = max(allowed, 64 * torch.finfo(actual.loss.dtype).eps * max(abs(full), abs(mean)))
    if abs(full - mean) <= 4 * rounding or abs(parallel - mean) > rounding:
        return []
    text = (
        f"The loss-averaging trap: the parallel loss ({parallel:.6g}) is the plain mean of the "
        f"{len(sizes)} replicas' per-chunk losses ({mean:.6g}), not the full-batch loss "
        f"({full:.6g}): each replica's loss got weight 1/{len(sizes)}."
    )
    if len(set(sizes)) > 1:
        weights = ", ".join(f"{size}/{batch}" for size in sizes)
        text += (
            f" The chunks are uneven ({sizes} rows), and their rows call for n_i/B = [{weights}]: "
            "weight each replica's mean loss by n_i/B (dpverify.chunk_weighted_loss), or sum "
            "the per-row losses and divide by the batch size."
        )
    else:
        text += (
            f" The chunks are equal ({sizes} rows), so the chunk losses are not per-row means "
            "(a sum loss): add the replicas' losses instead of averaging them."
        )
    return [text]


def _sum(contributions: Sequence[dict[str, torch.Tensor]], name: str, like: torch.Tensor | None) -> torch.Tensor | None:
    """The sum of the replicas' gradients of ``name``, in replica order, made in float64
    and given the dtype and device of ``like`` (the expected gradient) when there is one."""
    grads = [c[name] for c in contributions if name in c]
    if not grads:
        return None
    total = grads[0].to(torch.float64, copy=True)
    for g in grads[1:]:
        # In place, a float32 term is promoted element by element: the sum of the float64
        # copies, without making them.
        total += g.to(total.device) if g.layout == total.layout == torch.strided else g.to(total.device, torch.float64)
    return total if like is None else total.to(dtype=like.dtype, device=like.device)


def _replayed_sum(name: str, replicas: int = 1) -> Callable[[StepResult], torch.Tensor | None]:
    """What ``_sum`` makes of a step's replica gradients of ``name`` (a replay's, in the
    replay's dtype), divided by ``replicas``: the counterpart of the parallel step's sum
    (or average) in a replay."""

    def pick(step: StepResult) -> torch.Tensor | None:
        total = _sum([grads for _device, grads in step.contributions], name, step.grads.get(name))
        return total / max(replicas, 1) if total is not None and replicas != 1 else total

    return pick


def assert_grad_sum_equals_mean_loss_grad(
    module: nn.Module,
    inputs: Any,
    target: Any,
    *,
    loss_fn: LossFn,
    device_ids: Sequence[int],
    parallel: Parallel | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    msg: Msg = None,
    forward_kwargs: Mapping[str, Any] | None = None,
    dim: int = 0,
    parallel_loss_fn: ParallelLoss | None = None,
    exact: bool = False,
) -> StepComparison:
    """Asserts replica gradients sum to the full-batch mean-loss gradient.

    Each replica's own contribution to every parameter is captured with hooks on the
    replica's copies of the parameters. With a mean loss over the gathered batch, replica
    ``i`` contributes ``(1/B) * sum over its rows``, so the contributions must **sum** to
    the full-batch gradient, and the module's accumulated ``.grad`` must equal that sum.
    Their plain average is shown for contrast: it divides by the number of replicas a
    second time, and must not match whenever more than one replica ran.

    Args: as ``assert_dp_grads_match``.

    Raises:
        ParallelMismatch: the sum, or the accumulated gradient, differs from the full-batch
            gradient; the average matches where it should not; or no replica ran.
    """
    __tracebackhide__ = True
    check = Check.create(
        module, inputs, device_ids=device_ids, parallel=parallel, rtol=rtol, atol=atol,
        forward_kwargs=forward_kwargs, dim=dim, parallel_loss_fn=parallel_loss_fn, exact=exact,
    )
    return raise_unless_ok(grad_sum_matches(check, loss_fn, target), msg)


def grad_sum_matches(check: Check, loss_fn: LossFn, target: Any, shared: SharedSteps | None = None) -> StepComparison:
    """``assert_grad_sum_equals_mean_loss_grad`` on a built ``check``, returning its
    comparison whatever it found; ``shared``: the steps of the checks grouped with it,
    whose parallel step it takes when a gradient check of the same split left one."""
    target = check.on_grid(target)
    proof = check.proven(loss_fn, target, shared)
    parallel_step, refs = _steps(check, loss_fn, target, shared, take=True)
    title = "Replica gradients must sum to the full-batch mean-loss gradient"
    contributions = [grads for _device, grads in parallel_step.contributions]
    replicas = len(contributions)
    failures = check.replica_failures(len(parallel_step.contributions), lost=_lost_chunks(check, parallel_step, refs))
    rows: list[TensorComparison] = []
    contrasts: list[TensorComparison] = []
    averages_differ = False
    sums_match = True
    for name, grad in refs.expected.grads.items():
        total = _sum(contributions, name, grad)
        terms = parallel_step.terms(name)
        summed = check.against(TensorId("grads", name, variant="sum of replica"), total, refs, Key.grad(name), terms, pick=_replayed_sum(name))
        sums_match &= summed.ok
        rows.append(summed)
        rows.append(check.against(TensorId("grad", name, variant="accumulated"), parallel_step.grads.get(name), refs, Key.grad(name), terms, reuse=True))
        if total is None:
            continue
        average = total / max(replicas, 1)
        # The wrapper decides how many replicas run (torch's scatter can use fewer than the
        # devices; a balanced wrapper its own split): the average is the full gradient over
        # the number that ran.
        label = TensorId("grads", name, variant="average of replica", detail=f"= full / {replicas}")
        share = Terms(terms.largest / replicas, terms.norm / replicas) if terms is not None else None
        rows.append(check.against(label, average, refs, Key.grad(name, replicas), share, pick=_replayed_sum(name, replicas)))
        if replicas > 1:
            contrast = check.against(
                TensorId("grads", name, variant="average of replica", detail="vs full"), average, refs, Key.grad(name), terms, contrast=True
            )
            contrasts.append(contrast)
            averages_differ |= not contrast.ok  # mismatched > 0 fails it: read alone, the count costs a pass
    ran = f"{replicas} replica{'s' if replicas != 1 else ''} contributed"
    notes = [*proof, f"{ran} (chunks {list(parallel_step.replica_rows)}).", *_per_replica_note(parallel_step, refs.expected)]
    significant = any(g is not None and bool(g.any()) for g in refs.expected.grads.values())
    # Where the tolerance cannot tell the sum from the average (every gradient zero up to
    # rounding, or a dtype too coarse), the average matching says nothing. It points at
    # pre-divided replica gradients only when the sum does not match.
    if replicas > 1 and significant and not averages_differ and not sums_match:
        failures.append(
            f"The plain average of the {replicas} replica gradients matches the full-batch "
            "gradient and their sum does not: each replica's gradient is already full-size "
            "(its own chunk's mean rather than 1/B times its sum), and torch sums replica "
            f"gradients (ReduceAddCoalesced), which counts the batch {replicas} times."
        )
    if failures or not all(row.ok for row in rows):
        notes += _loss_averaging_trap(check, parallel_step, refs, loss_fn, target)
    return check.outcome(title, rows, contrasts=contrasts, notes=notes, failures=failures, step=parallel_step)
