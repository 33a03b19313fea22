"""Public assertion helpers: a parallel step against the single-device step."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dpverify.core.comparison import (
    Msg,
    StepComparison,
    TensorComparison,
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
from dpverify.core.divergence import divergence_sources
from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.core.scatter import ScatterPlan, plan_scatter
from dpverify.core.step import StepResult, as_inputs, batch_size_of, first_parameter_dtype, run_step
from dpverify.core.validation import require_callable, require_mapping, require_module_with_grads
from dpverify.core.virtual import data_parallel

__all__ = ["Check", "assert_dp_grads_match", "assert_grad_sum_equals_mean_loss_grad", "raise_unless_ok", "require_loss_fn"]

Parallel = Callable[..., Callable[..., Any]]
LossFn = Callable[[Any, Any], torch.Tensor]


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
    ) -> Check:
        require_module_with_grads(module, why="there is no gradient to compare")
        if parallel is not None:
            require_callable(
                parallel, "parallel",
                "a DataParallel-like class or function (module, device_ids=..., output_device=...) -> module",
            )
        ids = normalize_device_ids(device_ids)
        target = normalize_output_device(output_device, ids)
        args = as_inputs(inputs)
        batch_size_of(args)
        kwargs: dict[str, Any] = {}
        if forward_kwargs is not None:
            kwargs = dict(require_mapping(forward_kwargs, "forward_kwargs", "{'attention_mask': mask}"))
        # Real devices when they exist, for torch's DataParallel and a user's wrapper alike.
        real = cuda_device_count() > max(ids)
        device = torch.device("cuda", ids[0]) if real else torch.device("cpu")
        plan = plan_scatter(args, kwargs, ids)
        return cls(
            module=module,
            args=args,
            kwargs=kwargs,
            device_ids=ids,
            output_device=target,
            parallel=parallel or data_parallel,
            device=device,
            plan=plan,
            tolerance=Tolerance(rtol=rtol, atol=atol),
            dtype=first_parameter_dtype(module),
        )

    @property
    def scenario(self) -> str:
        where = "the host" if self.output_device == -1 else f"device {self.output_device}"
        wrapper = getattr(self.parallel, "__qualname__", type(self.parallel).__name__)
        return f"{self.plan.describe()}; outputs gathered on {where}; wrapper {wrapper}"

    def wrap(self, model: nn.Module) -> Callable[..., Any]:
        return self.parallel(model, device_ids=self.device_ids, output_device=self.output_device)

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
    ) -> StepResult:
        """One step: through the wrapper (``parallel``) or alone, in ``dtype``."""
        stage = "parallel" if parallel else "single-device"
        if dtype == torch.float64:
            stage = "float64 single-device"
        try:
            return run_step(
                self.module,
                self.args,
                loss_of_output,
                wrap=self.wrap if parallel else None,
                dtype=dtype,
                device=self.device,
                record_replicas=record_replicas,
                loss_argument=loss_argument,
                kwargs=self.kwargs,
                measure_terms=measure_terms,
                jitter=jitter,
            )
        except InvalidArgument:
            raise
        except Exception as error:
            error.add_note(f"dpverify: raised by the {stage} step. Scenario: {self.scenario}.")
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
        *, loss_key: tuple[Any, ...] | None = None,
    ) -> References:
        """The single-device step, plus what anchors the tolerance unless explicit
        tolerances were given: its float64 twin, and for float64 models a float32 probe and
        a jittered float64 run. ``loss_in(dtype)`` gives the loss for a run in ``dtype``
        (None: the working dtype).

        ``loss_key`` names the objects ``loss_in`` is built from (the loss function and the
        target). Given, these steps are shared with earlier and later checks of the same
        module, inputs and loss, unchanged since (``_ReferenceCache``): the checks of one
        split, and of one batch on several device counts, need them once.

        Raises:
            NonFiniteReference: the single-device or float64 step is not finite; nothing
                is compared then.
        """
        steps = _REFERENCES.steps_for(self, loss_key) if loss_key is not None else {}

        def step(kind: str, run: Callable[[], StepResult]) -> StepResult:
            # Stored only once it ran and proved finite: a failing step fails every check.
            if kind not in steps:
                steps[kind] = run()
            return steps[kind]

        def expected_step() -> StepResult:
            result = self.run(loss_in(None), parallel=False, loss_argument=loss_argument)
            _require_finite_step(result, "single-device")
            return result

        expected = step("expected", expected_step)
        if self.tolerance.explicit:
            return References(expected)

        def anchor_step() -> StepResult:
            result = self.run(
                loss_in(torch.float64), parallel=False, dtype=torch.float64, loss_argument=loss_argument,
                measure_terms=True,
            )
            _require_finite_step(result, "float64 single-device")
            return result

        anchor = step("anchor", anchor_step)
        if self.dtype == torch.float64:
            probe = step("probe", lambda: self.run(loss_in(torch.float32), parallel=False, dtype=torch.float32, loss_argument=loss_argument))
            jitter = step("jitter", lambda: self.run(
                loss_in(torch.float64), parallel=False, dtype=torch.float64, loss_argument=loss_argument,
                jitter=_JITTER,
            ))
            return References(expected, anchor, probe, jitter)

        def settle_step() -> StepResult:
            # Parameters one unit in the last place off: how far rounding alone moves this step.
            result = self.run(
                loss_in(None), parallel=False, loss_argument=loss_argument,
                jitter=torch.finfo(self.dtype).eps,
            )
            _require_finite_step(result, "jittered single-device")
            return result

        return References(expected, anchor, settle=lambda: step("settle", settle_step))

    def compare(self, actual: StepResult, refs: References, *, outputs: bool = True) -> list[TensorComparison]:
        """Outputs (when asked), the loss, and every parameter's gradient."""
        expected = refs.expected

        def row(name: str, got: torch.Tensor | None, key: Key, terms: Terms | None = None) -> TensorComparison:
            return self.against(name, got, refs, key, terms)

        rows: list[TensorComparison] = []
        if outputs:
            actual_outputs = dict(actual.outputs)
            for path, tensor in expected.outputs:
                if path not in actual_outputs:
                    rows.append(TensorComparison(path, tuple(tensor.shape), tensor.numel(), mismatched=tensor.numel(), problem="is missing from the parallel step's output"))
                    continue
                rows.append(row(path, actual_outputs[path], _output_key(path)))
        loss_terms = refs.anchor.loss_terms if refs.anchor is not None else None
        rows.append(row("loss", actual.loss, _loss_key, Terms(loss_terms, loss_terms) if loss_terms else None))
        for name in expected.grads:
            rows.append(row(f"grad {name!r}", actual.grads.get(name), _grad_key(name), actual.terms(name)))
        return rows

    def against(
        self, name: str, actual: torch.Tensor | None, refs: References, key: Key,
        terms: Terms | None = None, *, contrast: bool = False,
    ) -> TensorComparison:
        """Compares one parallel tensor with the references' tensor that ``key`` picks;
        ``terms`` is the magnitude of what the parallel step summed into it, if known. A
        ``contrast`` is expected to differ: it gets no second rounding sample."""
        def compare(jitter: StepResult | None) -> TensorComparison:
            return compare_tensors(
                name,
                actual,
                key(refs.expected),
                key(refs.anchor) if refs.anchor else None,
                self.tolerance,
                probe=key(refs.probe) if refs.probe else None,
                terms=terms,
                jitter=key(jitter) if jitter else None,
            )

        result = compare(refs.jitter)
        if result.ok or result.problem is not None or refs.settle is None or contrast:
            return result
        # A tensor that fails against one sample of the single-device rounding gets a
        # second sample before it is called a mismatch: ill-conditioned computations
        # round with heavy tails. Passing checks never pay for this step.
        return compare(refs.settled())

    def outcome(
        self,
        check: str,
        rows: Sequence[TensorComparison],
        *,
        contrasts: Sequence[TensorComparison] = (),
        notes: Sequence[str] = (),
        failures: Sequence[str] = (),
        scale: float | None = None,
    ) -> StepComparison:
        return step_comparison(
            check, self.scenario, self.tolerance, self.dtype, self.module, rows,
            contrasts=contrasts, notes=notes, failures=failures, scale=scale,
        )


def raise_unless_ok(result: StepComparison, msg: Msg) -> StepComparison:
    __tracebackhide__ = True
    if not result.ok:
        raise ParallelMismatch(render(result.message(), msg), result)
    return result


def require_loss_fn(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` when callable: the contract of every helper's ``loss_fn``, DDP's too."""
    return require_callable(loss_fn, "loss_fn", "loss_fn(output, target) -> scalar, e.g. torch.nn.functional.mse_loss")


def _loss_of(loss_fn: LossFn, target: Any) -> Callable[[Any], torch.Tensor]:
    require_loss_fn(loss_fn)
    return lambda output: loss_fn(output, target)


def _target_on(target: Any, check: Check, dtype: torch.dtype | None) -> Any:
    if isinstance(target, torch.Tensor):
        cast = dtype if dtype is not None and target.is_floating_point() else None
        return target.detach().to(device=check.device, dtype=cast)
    return target


Key = Callable[[StepResult], "torch.Tensor | None"]


def _output_key(path: str) -> Key:
    return lambda step: dict(step.outputs).get(path)


def _grad_key(name: str, divisor: int = 1) -> Key:
    def key(step: StepResult) -> torch.Tensor | None:
        grad = step.grads.get(name)
        return grad / divisor if grad is not None and divisor != 1 else grad

    return key


def _loss_key(step: StepResult) -> torch.Tensor | None:
    return step.loss


@dataclass(frozen=True)
class References:
    """The single-device step in the working dtype, and what anchors the tolerance: its
    float64 twin and, for float64 models, a float32 probe of the rounding and a float64 run
    from jittered parameters (None with explicit tolerances). For other dtypes ``settle``
    runs the working-dtype step from parameters one unit in the last place off, only when
    a tensor would otherwise fail: a second sample of the rounding."""

    expected: StepResult
    anchor: StepResult | None = None
    probe: StepResult | None = None
    jitter: StepResult | None = None
    settle: Callable[[], StepResult] | None = None
    _settled: list[StepResult] = field(default_factory=list, repr=False, compare=False)

    def settled(self) -> StepResult:
        """The jittered single-device step (``settle``), run once, on first need."""
        assert self.settle is not None
        if not self._settled:
            self._settled.append(self.settle())
        return self._settled[0]


# Relative size of the parameter perturbation of a float64 model's jittered run: a few
# units of float64 roundoff, the size of the rounding a step makes in each parameter use.
_JITTER = 8 * torch.finfo(torch.float64).eps


def _require_finite_step(step: StepResult, stage: str) -> None:
    for path, tensor in step.outputs:
        require_finite(path, tensor, stage)
    require_finite("loss", step.loss, stage)
    for name, grad in step.grads.items():
        require_finite(f"grad {name!r}", grad, stage)


class _Same:
    """An object compared by identity, and held so that its id cannot be reused."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    __hash__ = None  # type: ignore[assignment]


_SCALARS = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)


def _tensor_state(tensor: torch.Tensor) -> tuple[Any, ...]:
    # The version counter sees in-place updates (optimizer steps, load_state_dict); the
    # content (a hash of the bits and the float64 sum: a few milliseconds for 1e7
    # elements) also sees writes through ``.data``, which bypass the counter.
    strided = tensor.layout == torch.strided and not tensor.is_meta
    content: Any = None
    if strided and tensor.numel():
        values = tensor.detach()
        values = torch.view_as_real(values) if values.is_complex() else values
        total = float(values.sum(dtype=torch.float64)) if values.is_floating_point() else None
        content = (int(torch.hash_tensor(values).view(torch.int64)), total)
    return (
        _Same(tensor), tensor._version, tensor.data_ptr() if strided else None, tuple(tensor.shape),
        tensor.stride() if strided else None, tensor.dtype, tensor.device, tensor.requires_grad, content,
    )


def _state(obj: Any, depth: int = 0) -> Any:
    """What a step reads of ``obj``: tensors by identity, version and content, scalars by
    value, containers item by item (a few levels deep), anything else by identity."""
    if isinstance(obj, torch.Tensor):
        return _tensor_state(obj)
    if isinstance(obj, _SCALARS):
        return (type(obj), obj)
    if depth < 4 and isinstance(obj, (tuple, list)):
        return (type(obj), tuple(_state(item, depth + 1) for item in obj))
    if depth < 4 and isinstance(obj, dict):
        return (type(obj), tuple((_state(key, depth + 1), _state(value, depth + 1)) for key, value in obj.items()))
    return _Same(obj)


def _module_state(module: nn.Module) -> tuple[Any, ...]:
    """Every submodule's attributes: parameters, buffers, children, hooks, the train flag
    and the hyperparameters a forward reads (``eps``, ``p``...). A module attribute that is
    a mutable object changed in place (a list appended to) is not seen. The root is not
    held (only its attributes): the cache must not keep it alive."""
    return tuple(
        (path, None if sub is module else _Same(sub), _state(vars(sub)))
        for path, sub in module.named_modules(remove_duplicate=False)
    )


@dataclass
class _Entry:
    module: weakref.ReferenceType[nn.Module]
    key: tuple[Any, ...]
    steps: dict[str, StepResult]


class _ReferenceCache:
    """The single-device steps of the last check, for the next check that needs the same.

    ``dpverify check`` runs two checks per split, and one batch on several device counts;
    their single-device steps (working dtype, float64 anchor, jittered sample) do not
    depend on the split, and are the same computation each time. A check reuses them only
    when the module, every forward argument, the loss function and the target are the same
    objects, unchanged since (versions, contents, attributes: ``_module_state``), on the
    same device with the same default dtype; anything else starts a new entry.

    One entry: consecutive checks are what share. It holds the module only weakly, so it
    never keeps a model, or its steps' gradients, alive after the caller lets go of it.
    """

    def __init__(self) -> None:
        self._entry: _Entry | None = None
        # Reentrant: the weakref callback may run inside steps_for, when a collection frees a module.
        self._lock = threading.RLock()

    def steps_for(self, check: Check, loss_key: tuple[Any, ...]) -> dict[str, StepResult]:
        """The steps stored for ``check``'s state (filled in by the caller as they run)."""
        key = (
            check.device, check.dtype, torch.get_default_dtype(), _module_state(check.module),
            _state(check.args), _state(check.kwargs), _state(loss_key),
        )
        with self._lock:
            entry = self._entry
            if entry is not None and entry.module() is check.module and entry.key == key:
                return entry.steps
            self._entry = _Entry(weakref.ref(check.module, self._forget), key, {})
            return self._entry.steps

    def clear(self) -> None:
        with self._lock:
            self._entry = None

    def _forget(self, module: weakref.ReferenceType[nn.Module]) -> None:
        # The module is gone: its steps can never be asked for again.
        with self._lock:
            if self._entry is not None and self._entry.module is module:
                self._entry = None


_REFERENCES = _ReferenceCache()


def _steps(check: Check, loss_fn: LossFn, target: Any, *, record_replicas: bool | str = "magnitudes") -> tuple[StepResult, References]:
    parallel = check.run(_loss_of(loss_fn, _target_on(target, check, None)), parallel=True, record_replicas=record_replicas)
    refs = check.references(lambda dtype: _loss_of(loss_fn, _target_on(target, check, dtype)), loss_key=(loss_fn, target))
    return parallel, refs


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
) -> StepComparison:
    """Asserts one DataParallel step gives the single-device outputs, loss and gradients.

    The step (forward, ``loss_fn(output, target)``, backward) runs on deep copies of
    ``module``: through ``parallel`` and alone on the full batch, plus a float64 twin of the
    single-device step that anchors the tolerance (see ``Tolerance``). ``module`` and its
    gradients are left untouched.

    Args:
        module: the model to check.
        inputs: the batch tensor, or a tuple of positional forward arguments.
        target: the second argument of ``loss_fn``.
        loss_fn: ``loss_fn(output, target)`` returns a scalar mean loss.
        device_ids: DataParallel's devices (virtual ids when CUDA devices are missing).
        output_device: where outputs are gathered (default ``device_ids[0]``, -1 for host).
        parallel: the DataParallel implementation under test, called as
            ``parallel(module, device_ids=..., output_device=...)``; default
            ``dpverify.data_parallel``.
        rtol: explicit relative tolerance (with ``atol``) instead of the anchored rule.
        atol: explicit absolute tolerance (with ``rtol``).
        msg: replaces the failure message, or a callable that rewrites it.
        forward_kwargs: keyword arguments of the forward call (scattered like ``inputs``).

    Returns:
        The comparison, for inspection (``str()`` summarises it).

    Raises:
        ParallelMismatch: an output, the loss or a gradient differs beyond tolerance.
        InvalidArgument: an argument cannot be used; the message says which and why.
    """
    __tracebackhide__ = True
    check = Check.create(
        module, inputs, device_ids=device_ids, output_device=output_device,
        parallel=parallel, rtol=rtol, atol=atol, forward_kwargs=forward_kwargs,
    )
    parallel_step, refs = _steps(check, loss_fn, target)
    title = "DataParallel outputs and gradients must match the single-device step"
    rows = check.compare(parallel_step, refs)
    failed = not all(row.ok for row in rows)
    notes, scale = _diagnose(check, parallel_step, refs.expected) if failed else ([], None)
    return raise_unless_ok(check.outcome(title, rows, notes=notes, scale=scale), msg)


def _diagnose(check: Check, actual: StepResult, expected: StepResult) -> tuple[list[str], float | None]:
    """Names the classic wrapper bugs when their signature is in the results; and the
    uniform factor between the gradients, when there is one."""
    notes = [text for path, got in actual.outputs if (text := _reordered(path, got, dict(expected.outputs).get(path)))]
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


def _reordered(path: str, actual: torch.Tensor, expected: torch.Tensor | None) -> str | None:
    """A sentence when ``actual``'s rows are ``expected``'s in another order (a gather that
    concatenates the replicas' outputs out of order)."""
    if expected is None or actual.shape != expected.shape or actual.dim() == 0 or not 1 < actual.shape[0] <= 4096:
        return None
    a = actual.detach().reshape(actual.shape[0], -1).double().cpu()
    e = expected.detach().reshape(expected.shape[0], -1).double().cpu()
    nearest = torch.cdist(a, e).min(dim=1)
    scale = float(e.abs().max()) or 1.0
    order = nearest.indices.tolist()
    if sorted(order) != list(range(len(order))) or order == sorted(order) or float(nearest.values.max()) > 1e-4 * scale:
        return None
    return (
        f"The rows of {path} are the single-device rows in another order ({order}): the "
        "replicas' outputs were gathered out of order. torch concatenates them in "
        "device_ids order, whatever output_device is."
    )


def _sum(contributions: Sequence[dict[str, torch.Tensor]], name: str) -> torch.Tensor | None:
    grads = [c[name].to(torch.float64) for c in contributions if name in c]
    if not grads:
        return None
    total = grads[0].clone()
    for g in grads[1:]:
        total += g.to(total.device)
    return total


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
        forward_kwargs=forward_kwargs,
    )
    parallel_step, refs = _steps(check, loss_fn, target, record_replicas=True)
    title = "Replica gradients must sum to the full-batch mean-loss gradient"
    contributions = [grads for _device, grads in parallel_step.contributions]
    replicas, planned = len(contributions), check.plan.n_replicas
    failures: list[str] = []
    if replicas == 0:
        failures.append(
            "No replica ran a forward of the module's copies: the wrapper never called the "
            "module (or a copy of it made with Module._replicate_for_data_parallel or deepcopy)."
        )
    rows: list[TensorComparison] = []
    contrasts: list[TensorComparison] = []
    averages_differ = False
    sums_match = True
    for name, grad in refs.expected.grads.items():
        total = _as(_sum(contributions, name), grad)
        terms = parallel_step.terms(name)
        summed = check.against(f"sum of replica grads {name!r}", total, refs, _grad_key(name), terms)
        sums_match &= summed.ok
        rows.append(summed)
        rows.append(check.against(f"accumulated grad {name!r}", parallel_step.grads.get(name), refs, _grad_key(name), terms))
        if total is None:
            continue
        average = total / max(replicas, 1)
        # torch's scatter decides how many replicas run: the average is the full gradient
        # over that number, which can be fewer than the devices.
        label = f"average of replica grads {name!r} = full / {planned}"
        share = Terms(terms.largest / planned, terms.norm / planned) if terms is not None else None
        rows.append(check.against(label, average, refs, _grad_key(name, planned), share))
        if replicas > 1:
            contrast = check.against(
                f"average of replica grads {name!r} vs full", average, refs, _grad_key(name), terms, contrast=True
            )
            contrasts.append(contrast)
            averages_differ |= contrast.mismatched > 0 or not contrast.ok
    notes = [f"{replicas} replicas contributed (torch's scatter runs {planned})."]
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
    return raise_unless_ok(check.outcome(title, rows, contrasts=contrasts, notes=notes, failures=failures), msg)


def _as(value: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    if value is None or like is None:
        return value
    return value.to(dtype=like.dtype, device=like.device)
