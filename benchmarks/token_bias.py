"""The loss-averaging trap at the token level, measured on tiny Hugging Face models.

Builds GPT-2 (causal LM) and BERT (masked LM) from small configs (nothing is downloaded),
and for batches of 8 rows on 4 virtual devices (equal chunks of 2 rows) measures, with
``dpverify.check_forward_loss_average``:

- padded labels (-100 on each row's tail; GPT-2) or masked labels (BERT, -100 where no
  token is masked): ``loss.mean()`` of the replicas' token means against the full batch,
  the bias the token counts predict, and whether weighting by the token counts is exact;
- no padding: the rows are the items, equal chunks, no bias beyond rounding;
- the trainers' DataParallel recipe for a loss normalised by ``num_items_in_batch``
  (each replica divides its summed loss by ``count // 4``, then ``loss.mean()``): biased by
  ``count / (4 * (count // 4))`` unless 4 divides the count.

Usage: python benchmarks/token_bias.py [--seed 0]
"""

from __future__ import annotations

import argparse
import importlib
import warnings
from collections.abc import Sequence
from typing import Any

import torch

import dpverify

VOCAB = 64
ROWS = 8
LENGTH = 12
DEVICES = [0, 1, 2, 3]


def _models(seed: int) -> dict[str, Any]:
    transformers: Any = importlib.import_module("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0,
    )).eval()
    torch.manual_seed(seed)
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32,
    )).eval()
    return {"gpt2": gpt2, "bert": bert}


def _batches(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=generator)
    padded = ids.clone()
    real = torch.randint(2, LENGTH + 1, (ROWS,), generator=generator)
    for row, n in enumerate(real.tolist()):
        padded[row, n:] = -100
    masked = torch.full_like(ids, -100)
    chosen = torch.rand(ids.shape, generator=generator) < 0.3
    masked[chosen] = ids[chosen]
    return {"ids": ids, "padded": padded, "masked": masked}


def _trainer(count: int, devices: int = len(DEVICES)) -> Any:
    def per_call(n: int) -> dict[str, torch.Tensor]:
        value = torch.tensor(count)
        if n > 1:
            value = (value // n).unsqueeze(0).expand(n, -1)
        return {"num_items_in_batch": value}

    return per_call


def _row(name: str, report: dpverify.LossAverageReport) -> str:
    if report.normalizer:
        items = f"{report.normalizer} of {int(report.normalizer_full or 0)}"
        counts, exact = [int(c) for c in report.normalizer_given], "n/a"
    else:
        items, counts = report.items, list(report.counts)
        exact = "yes" if report.weighted_is_exact else "no"
    return (
        f"| {name} | {items} | {counts} | {report.loss_bias:+.3g} | {report.predicted_bias:+.3g} | "
        f"{report.loss_noise:.1g} | {'yes' if report.is_biased else 'no'} | {exact} |"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    models, batch = _models(args.seed), _batches(args.seed)
    ids = batch["ids"]
    print("| model, labels | items | per replica | loss.mean() bias | predicted | noise | biased | t_i/T exact |")
    print("|---|---|---|---:|---:|---:|---|---|")
    gpt2, bert = models["gpt2"], models["bert"]
    cases = [
        ("GPT-2, padded labels", gpt2, {"input_ids": ids, "labels": batch["padded"]}, None),
        ("GPT-2, no padding", gpt2, {"input_ids": ids, "labels": ids}, None),
        ("BERT MLM, 30% masked", bert, {"input_ids": ids, "labels": batch["masked"]}, None),
    ]
    count = int((batch["padded"][:, 1:] != -100).sum())  # the causal head skips each row's first label
    cases.append(("GPT-2, padded, trainer's num_items_in_batch", gpt2, {"input_ids": ids, "labels": batch["padded"]}, _trainer(count)))
    for name, model, kwargs, per_call in cases:
        report = dpverify.check_forward_loss_average(model, (), device_ids=DEVICES, forward_kwargs=kwargs, per_call_kwargs=per_call)
        print(_row(name, report))


if __name__ == "__main__":
    main()
