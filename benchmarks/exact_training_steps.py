"""How many optimizer steps exact mode's DataParallel training check sustains.

Every SGD step ``w - lr * g`` adds the digits of the learning rate times the gradient to
the weights, and the next forward multiplies those digits by the inputs' and adds the
layer's width: float64's 53 significand bits run out after a few steps. This runs
``assert_dp_training_matches(exact=True)`` with ``SGD(lr=2**-3)`` for up to ``--steps``
batches of 8 rows on 2 devices, on small models of the exact set (Linear layers of a
given width with ReLU between them, a Conv2d/MaxPool2d/AvgPool2d net) under the MSE, L1
and sum losses, and prints for each the steps that ran exact: the refusal names the step
where the digits stopped fitting ("pass at most k batches"). The built-in models
(``dpverify.models.builtin``) are listed with what refuses them.

Usage: python benchmarks/exact_training_steps.py [--steps 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import functools
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import dpverify
from dpverify.models.builtin import BUILTIN_MODELS, builtin_case

SGD = functools.partial(torch.optim.SGD, lr=2**-3)


def _sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).sum()


LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"mse": F.mse_loss, "l1": F.l1_loss, "sum": _sum}


def mlp(layers: int, width: int) -> nn.Module:
    """``layers`` Linear layers (4 -> width -> ... -> 2) with ReLU between them."""
    sizes = [4, *([width] * (layers - 1)), 2]
    parts: list[nn.Module] = []
    for i in range(layers):
        parts += [nn.Linear(sizes[i], sizes[i + 1])] + ([nn.ReLU()] if i < layers - 1 else [])
    return nn.Sequential(*parts)


def conv() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(4, 2))


def steps_exact(module: nn.Module, shape: tuple[int, ...], loss: Callable[..., torch.Tensor], steps: int, seed: int) -> tuple[int, str]:
    """The steps that ran exact (``steps`` when all did) and, if refused, the refusal's
    first words."""
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(8, *shape, generator=g), torch.randn(8, 2, generator=g)) for _ in range(steps)]
    try:
        dpverify.assert_dp_training_matches(module, batches, loss_fn=loss, optimizer=SGD, device_ids=[0, 1], exact=True)
    except dpverify.InvalidArgument as refusal:
        text = str(refusal)
        found = re.search(r"in step (\d+) of", text)
        ran = int(found.group(1)) - 1 if found else 0
        return ran, text.removeprefix("exact=True: ").split(":")[0]
    return steps, ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    print(f"SGD(lr=2**-3), batches of 8 rows on 2 devices, at most {options.steps} steps; steps that ran exact:")
    models: list[tuple[str, Callable[[], nn.Module], tuple[int, ...]]] = [
        (f"{layers} Linear, width {width}", functools.partial(mlp, layers, width), (4,))
        for layers in (1, 2, 3, 4) for width in (4, 16)
    ]
    models.append(("Conv2d/MaxPool2d/AvgPool2d/Linear", conv, (1, 4, 4)))
    for name, build, shape in models:
        cells = []
        for loss_name, loss in LOSSES.items():
            torch.manual_seed(options.seed)
            ran, why = steps_exact(build(), shape, loss, options.steps, options.seed)
            cells.append(f"{loss_name} {ran:>2}" + (f" ({why})" if why and ran < options.steps else ""))
        print(f"  {name:<36} " + "; ".join(cells))
    print("Built-in models (dpverify.models.builtin), what refuses them:")
    for model in BUILTIN_MODELS:
        case = builtin_case(model, batch=8, seed=options.seed)
        if case.loss_fn is None:
            print(f"  {model:<36} returns its loss: no loss_fn to check with")
            continue
        try:
            dpverify.assert_dp_training_matches(
                case.module, [(case.inputs, case.target)], loss_fn=case.loss_fn, optimizer=SGD, device_ids=[0, 1], exact=True,
            )
            print(f"  {model:<36} ran exact")
        except dpverify.InvalidArgument as refusal:
            print(f"  {model:<36} {str(refusal).removeprefix('exact=True: ').split(' is outside')[0].split(':')[0]}")


if __name__ == "__main__":
    main()
