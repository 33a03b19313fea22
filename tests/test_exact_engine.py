"""Exact mode's engine (dpverify.exact): grids, the per-operation proof, and its evidence.

The soundness test recomputes small networks' gradients in rational arithmetic
(``fractions.Fraction``) and requires every element torch computed in float64 under a
passing proof to equal the rational value: the proof claims no rounding happened, and the
rationals are the arithmetic without rounding.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dpverify import InvalidArgument
from dpverify.exact.case import (
    EXACT,
    ExactCase,
    prove,
    require_no_tolerance,
    require_power_of_two,
    ulps,
)
from dpverify.exact.grid import dyadic, dyadic_module, is_power_of_two, lowest_bit, precision
from dpverify.exact.proof import proving


def _grid(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return dyadic(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))


def _net(*layers: nn.Module, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return dyadic_module(nn.Sequential(*layers))


# --------------------------------------------------------------------------- grids


def test_lowest_bit_is_the_exponent_of_the_lowest_set_bit() -> None:
    assert lowest_bit(torch.tensor([0.75, 2.0, 0.0])) == -2
    assert lowest_bit(torch.tensor([3.0 * 2**-40])) == -40
    assert lowest_bit(torch.tensor([0.0, 0.0])) is None
    assert lowest_bit(torch.tensor([0.1], dtype=torch.float64)) == -55  # 0.1 is 3602879701896397 * 2**-55


def test_dyadic_keeps_few_bits_of_one_power_of_two_per_tensor() -> None:
    values = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    grid = dyadic(values, bits=4)
    assert grid.dtype == torch.float64
    step = 2.0 ** (torch.frexp(values.abs().max().double())[1].item() - 4)  # the largest is not a power of two
    assert torch.equal(grid / step, torch.round(grid / step))  # integers times one power of two
    assert float((grid / step).abs().max()) <= 16
    assert torch.equal(dyadic(grid, bits=4), grid)  # already on its grid
    tokens = torch.tensor([3, 1, 2])
    assert torch.equal(dyadic(tokens), tokens)
    assert dyadic(tokens).dtype == torch.int64


def test_power_of_two_and_precision() -> None:
    assert [is_power_of_two(v) for v in (1, 0.25, -8, 3, 0, 0.1)] == [True, True, True, False, False, False]
    assert [precision(d) for d in (torch.float64, torch.float32, torch.bfloat16)] == [53, 24, 8]


# --------------------------------------------------------------------------- soundness against rationals


def _rational(t: torch.Tensor) -> list[list[Fraction]]:
    return [[Fraction(float(v)) for v in row] for row in t.reshape(t.size(0), -1).tolist()]


def _matmul_t(a: list[list[Fraction]], w: list[list[Fraction]]) -> list[list[Fraction]]:
    """a @ w.T"""
    return [[sum((x * y for x, y in zip(row, wrow, strict=True)), Fraction(0)) for wrow in w] for row in a]


def _rational_grads(model: nn.Sequential, x: torch.Tensor, t: torch.Tensor) -> dict[str, list[list[Fraction]]]:
    """The gradients of mean((model(x) - t)**2) for a stack of Linear and ReLU, exactly."""
    linears = [m for m in model if isinstance(m, nn.Linear)]
    acts: list[list[list[Fraction]]] = [_rational(x)]
    pres: list[list[list[Fraction]]] = []
    h = acts[0]
    for i, layer in enumerate(linears):
        w, b = _rational(layer.weight.detach()), [Fraction(float(v)) for v in layer.bias.detach().tolist()]
        pre = [[v + b[j] for j, v in enumerate(row)] for row in _matmul_t(h, w)]
        pres.append(pre)
        h = pre if i == len(linears) - 1 else [[max(v, Fraction(0)) for v in row] for row in pre]
        acts.append(h)
    target = _rational(t)
    count = len(h) * len(h[0])
    delta = [[2 * (y - z) / count for y, z in zip(row, trow, strict=True)] for row, trow in zip(h, target, strict=True)]
    grads: dict[str, list[list[Fraction]]] = {}
    for i in range(len(linears) - 1, -1, -1):
        index = next(j for j, m in enumerate(model) if m is linears[i])
        below = acts[i]
        grads[f"{index}.weight"] = [[sum((delta[n][o] * below[n][k] for n in range(len(delta))), Fraction(0)) for k in range(len(below[0]))] for o in range(len(delta[0]))]
        grads[f"{index}.bias"] = [[sum((delta[n][o] for n in range(len(delta))), Fraction(0))] for o in range(len(delta[0]))]
        if i:
            w = _rational(linears[i].weight.detach())
            back = [[sum((d[o] * w[o][k] for o in range(len(d))), Fraction(0)) for k in range(len(w[0]))] for d in delta]
            delta = [[v if p > 0 else Fraction(0) for v, p in zip(row, prow, strict=True)] for row, prow in zip(back, pres[i - 1], strict=True)]
    return grads


@settings(max_examples=12, deadline=None)
@given(
    widths=st.tuples(st.lists(st.integers(1, 6), min_size=1, max_size=3), st.sampled_from([1, 2, 4])).map(lambda w: [*w[0], w[1]]),
    batch=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**16),
)
def test_a_proven_step_equals_rational_arithmetic(widths: list[int], batch: int, seed: int) -> None:
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers += [nn.Linear(widths[i], widths[i + 1]), nn.ReLU()]
    model = _net(*layers[:-1], seed=seed)
    x, t = _grid((batch, widths[0]), seed + 1), _grid((batch, widths[-1]), seed + 2)
    with proving(model) as prover:
        nn.functional.mse_loss(model(x), t).backward()
    assert prover.proof().operations > 0
    exact = _rational_grads(model, x, t)  # type: ignore[arg-type]
    for name, param in model.named_parameters():
        assert param.grad is not None
        assert _rational(param.grad.reshape(param.grad.size(0), -1)) == exact[name], name


# --------------------------------------------------------------------------- the exact set runs, the rest is refused


def test_the_exact_set_runs_forward_backward_and_sgd() -> None:
    conv = _net(
        nn.Conv2d(2, 4, 3, padding=1), nn.LeakyReLU(0.25), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3), nn.AvgPool2d(2),
        nn.Flatten(), nn.Linear(4, 2),
    )
    x, t = _grid((4, 2, 8, 8), 1), _grid((4, 2), 2)
    with proving(conv) as prover:
        nn.functional.l1_loss(conv(x), t).backward()
        prover.stage = "the optimizer step"
        torch.optim.SGD(conv.parameters(), lr=2**-3, momentum=0.5, weight_decay=2**-4).step()
    proof = prover.proof()
    assert proof.operations > 20
    assert proof.bits <= proof.precision
    assert "exact" in proof.describe()
    assert "53" in proof.describe()


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(8, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).sum(1)
        out: torch.Tensor = self.head(torch.cat([h, h + torch.relu(self.inner(h))], dim=1))
        return out


def test_embedding_residual_concatenation_and_a_sum_loss() -> None:
    model = dyadic_module(_Residual())
    tokens = torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(0))
    target = _grid((4, 2), 3)
    with proving(model):
        (model(tokens) - target).pow(2).sum().backward()


@pytest.mark.parametrize(
    ("model", "batch", "loss", "words"),
    [
        (lambda: _net(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), 4, nn.functional.mse_loss, ["aten.tanh", "module '1' (Tanh)", "outside the exact set"]),
        (lambda: _net(nn.Linear(4, 3)), 4, lambda y, t: nn.functional.cross_entropy(y, t.argmax(1)), ["_log_softmax", "outside the exact set"]),
        (lambda: _net(nn.Linear(4, 2)), 12, nn.functional.mse_loss, ["divides by 24", "not a power of two"]),
        (lambda: _net(nn.Linear(4, 4), nn.LeakyReLU(0.01), nn.Linear(4, 2)), 4, nn.functional.mse_loss, ["negative slope is 0.01", "module '1' (LeakyReLU)"]),
        (lambda: _net(nn.Conv2d(1, 1, 3), nn.AvgPool2d(3)), 4, lambda y, t: y.sum(), ["divides by 9"]),
        (lambda: _net(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2)), 4, nn.functional.mse_loss, ["random", "eval mode"]),
        (lambda: _net(*[m for _ in range(8) for m in (nn.Linear(4 if _ == 0 else 64, 64), nn.ReLU())], nn.Linear(64, 2)), 4, nn.functional.mse_loss, ["significand bits", "too deep or too wide"]),
    ],
    ids=["tanh", "cross-entropy", "mean-over-24", "leaky-slope", "avg-pool-9", "dropout", "too-deep"],
)
def test_refusals_name_the_operation_where_it_ran_and_the_fix(model, batch, loss, words) -> None:  # type: ignore[no-untyped-def]
    net = model()
    first = next(m for m in net.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))
    shape = (batch, first.in_features) if isinstance(first, nn.Linear) else (batch, 1, 6, 6)
    x, t = _grid(shape, 1), _grid((batch, 2), 2)
    with pytest.raises(InvalidArgument) as raised, proving(net):
        loss(net(x), t).backward()
    message = str(raised.value)
    assert message.startswith("exact=True: ")
    for word in words:
        assert word in message


def test_a_learning_rate_with_many_bits_is_refused_in_the_named_stage() -> None:
    model = _net(nn.Linear(4, 2))
    x, t = _grid((4, 4), 1), _grid((4, 2), 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = r"in the optimizer step of step 1 cannot be exact: it scales by alpha=-0\.1, a number with 52 significant bits"
    with proving(model) as prover:
        nn.functional.mse_loss(model(x), t).backward()
        prover.stage = "the optimizer step of step 1"
        with pytest.raises(InvalidArgument, match=expected):
            optimizer.step()


class _ExpBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        return grad * torch.exp(grad)


class _Odd(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ExpBackward.apply(x)  # type: ignore[no-any-return, no-untyped-call]


def test_a_backward_operation_is_named_by_the_module_whose_forward_made_it() -> None:
    model = dyadic_module(nn.Sequential(nn.Linear(4, 2), _Odd()))
    x, t = _grid((4, 4), 1), _grid((4, 2), 2)
    with pytest.raises(InvalidArgument, match=r"aten.exp in the backward of module '1' \(_Odd\)"), proving(model):
        nn.functional.mse_loss(model(x), t).backward()


# --------------------------------------------------------------------------- the evidence a helper reports


def test_prove_runs_the_full_batch_reversed_and_the_pieces() -> None:
    case = ExactCase.of(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), (torch.randn(16, 4),), torch.randn(16, 2))
    gathered = prove(case, nn.functional.mse_loss, pieces=[6, 5, 5])
    assert gathered.reversed_identical
    assert gathered.pieces_identical
    assert "[6, 5, 5]" in gathered.note()
    assert "Tolerance: none" in gathered.note()
    ranks = prove(case, nn.functional.mse_loss, pieces=[8, 8], gathered=False, weights=[0.5, 0.5])
    assert ranks.pieces_identical
    weighted = prove(case, nn.functional.mse_loss, pieces=[8, 4, 4], gathered=False, weights=[0.5, 0.25, 0.25])
    assert weighted.pieces_identical
    unweighted = prove(case, nn.functional.mse_loss, pieces=[8, 4, 4], gathered=False, weights=[0.25, 0.25, 0.25])
    assert unweighted.pieces_identical is False  # another number, exactly
    with pytest.raises(InvalidArgument, match="divides by 18"):
        prove(case, nn.functional.mse_loss, pieces=[9, 7], gathered=False, weights=[0.5, 0.5])


def test_exact_case_copies_and_leaves_the_callers_objects_alone() -> None:
    module, x = nn.Linear(3, 2), torch.randn(4, 3)
    before = [p.detach().clone() for p in module.parameters()]
    case = ExactCase.of(module, (x,), x[:, :2], {"scale": torch.ones(4)})
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    assert case.args[0].dtype == torch.float64
    assert case.kwargs["scale"].dtype == torch.float64
    assert all(p.dtype == torch.float64 for p in case.module.parameters())


def test_guards_name_their_argument() -> None:
    with pytest.raises(InvalidArgument, match="world_size=3: DDP divides every gradient by 3"):
        require_power_of_two(3, "world_size", "DDP")
    require_power_of_two(4, "world_size", "DDP")
    with pytest.raises(InvalidArgument, match=r"rtol=0\.1, atol=0\.0"):
        require_no_tolerance(0.1, 0.0)
    assert EXACT.describe(torch.float64).startswith("none")


def test_ulps_counts_units_in_the_last_place() -> None:
    expected = torch.tensor([1.0, 3.0, -0.5], dtype=torch.float64)
    moved = expected.clone()
    moved[1] = torch.nextafter(moved[1], torch.tensor(10.0, dtype=torch.float64))
    assert ulps(moved, expected) == 1.0
    assert ulps(expected, expected) == 0.0
