"""The causal language model a Hugging Face configuration describes, a token batch for it,
and the loss transformers computes on it.

Everything is built with ``from_config`` (random weights, nothing downloaded), seeded, in
float64 by default (the dtype dpverify's references are anchored in).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dpverify.core.errors import InvalidArgument
from dpverify.hf.base import require_config, require_transformers
from dpverify.hf.shrink import SEQ_LEN

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["IGNORE_INDEX", "TokenBatch", "build_model", "dropout_fields", "lm_loss", "token_batch"]

#: The label transformers' losses skip (padding, and whatever a caller masks).
IGNORE_INDEX = -100


class TokenBatch(NamedTuple):
    """A padded batch of token ids, as a causal language model takes it.

    Attributes:
        input_ids: ``(batch, seq_len)`` token ids; padded positions hold the pad token.
        attention_mask: ``(batch, seq_len)``, 1 on tokens and 0 on padding (on the right).
        labels: ``input_ids`` with ``IGNORE_INDEX`` at the padded positions.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor


def build_model(config: PretrainedConfig, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)``, seeded, in ``dtype``, in train mode.

    Experts (mixture-of-experts layers) run transformers' ``"eager"`` implementation, a loop
    over the experts: its grouped matrix product takes no float64. ``use_cache`` is off: a
    training step keeps no key-value cache (and the hybrid models whose layers are all
    state-space or linear attention, Bamba's default, fail to make one). ``config`` is
    copied first (``from_config`` writes the dtype and the implementations into the one it
    gets).
    The configuration is used as given otherwise: a dropout probability it sets stays (dpverify's
    checks explain the mismatches dropout causes; ``dropout_fields`` lists them). The
    global random state is left as it was.

    Args:
        config: a transformers configuration, e.g. ``shrink(load_config("llama"))``.
        seed: seeds the random initial weights.
        dtype: the parameters' dtype.

    Raises:
        InvalidArgument: ``config`` is not a configuration, ``dtype`` not a floating dtype,
            or ``seed`` not an int.
    """
    config = require_config(config, "build_model")
    transformers = require_transformers("build_model")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidArgument(f"build_model: dtype must be a floating torch.dtype (e.g. torch.float64), got {dtype!r}")
    _require_int("build_model", "seed", seed, least=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = copy.deepcopy(config)
        config.use_cache = False
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation="eager")
    return model.train()  # type: ignore[no-any-return]


def dropout_fields(config: PretrainedConfig) -> dict[str, float]:
    """The configuration's non-zero dropout probabilities, by field (``attention_dropout``).

    A model with one of them set differs from step to step in train mode.
    """
    config = require_config(config, "dropout_fields")
    return {
        name: float(value)
        for name, value in sorted(config.to_dict().items())
        if ("dropout" in name or "pdrop" in name)
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and value > 0
    }


def token_batch(config: PretrainedConfig, *, batch_size: int, seq_len: int = SEQ_LEN, seed: int = 0) -> TokenBatch:
    """Random token ids for ``config``'s vocabulary, right-padded to rows of different lengths.

    Row ``i`` has ``seq_len - i % (seq_len // 2)`` tokens (the first row is full, the next
    ones one token shorter each), then padding: the pad token id (0 when the configuration
    has none in its vocabulary), attention mask 0 and label ``IGNORE_INDEX``.

    Args:
        config: the configuration whose ``vocab_size`` the ids are drawn from.
        batch_size: the number of rows.
        seq_len: the tokens per row, padding included.
        seed: seeds the ids (a private generator: the global random state is untouched).

    Raises:
        InvalidArgument: ``batch_size`` < 1, ``seq_len`` < 2, or the configuration has no
            positive ``vocab_size``.
    """
    config = require_config(config, "token_batch")
    _require_int("token_batch", "batch_size", batch_size, least=1)
    _require_int("token_batch", "seq_len", seq_len, least=2)
    _require_int("token_batch", "seed", seed, least=0)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise InvalidArgument(f"token_batch: the configuration's vocab_size is {vocab!r}; it needs a positive vocabulary size")
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)
    lengths = torch.tensor([seq_len - i % (seq_len // 2) for i in range(batch_size)])
    mask = torch.arange(seq_len) < lengths[:, None]
    pad = getattr(config, "pad_token_id", None)
    pad = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
    input_ids = input_ids.masked_fill(~mask, pad)
    labels = input_ids.masked_fill(~mask, IGNORE_INDEX)
    return TokenBatch(input_ids, mask.long(), labels)


def lm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """The causal language-model loss transformers computes: the mean cross-entropy of each
    position's logits against the next token's label, ``IGNORE_INDEX`` labels skipped.

    One difference: transformers' loss (``ForCausalLMLoss``) casts the logits to float32,
    float64 ones too; this one keeps float32 and float64 (and upcasts float16 and bfloat16
    to float32 as transformers does), so a float64 reference stays float64.

    Args:
        output: the model's output (its ``logits``) or the logits, ``(batch, seq, vocab)``.
        labels: ``(batch, seq)`` token ids, ``IGNORE_INDEX`` where no loss is wanted.
    """
    logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != labels.shape:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise InvalidArgument(f"lm_loss: output's logits must be (batch, seq, vocab) matching labels {tuple(labels.shape)}, got {shape}")
    shifted = logits[:, :-1].flatten(0, 1)
    targets = labels[:, 1:].flatten()
    return F.cross_entropy(shifted.float() if shifted.dtype in (torch.float16, torch.bfloat16) else shifted, targets, ignore_index=IGNORE_INDEX)


def _require_int(what: str, argument: str, value: object, *, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise InvalidArgument(f"{what}: {argument} must be an int >= {least}, got {value!r}")
