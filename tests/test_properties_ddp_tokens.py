"""Token-level properties under real DDP on gloo ranks, on padded batches drawn here (lengths
from 0 to the sequence length, all-padding rows, either padding side, another ignore
index): DDP's plain average of rank means is the trap exactly when the ranks hold different
numbers of real tokens; the default token-weighted step always matches one device; and in
accumulation, dividing each micro-batch's mean by the number of micro-batches is the trap
exactly when the micro-batches hold different numbers of tokens.

Each rank and micro-batch keeps at least one real token: a mean over none is NaN on one
device too, and nothing can be compared.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ddp_tokens import VOCAB, TinyLM, micro_mean_over_k, token_loss

from dpverify.core.errors import ParallelMismatch
from dpverify.ddp.checks import assert_ddp_accumulation_matches, assert_ddp_grads_match
from dpverify.ddp.rank import ddp_step


@st.composite
def padded_batches(draw: st.DrawFn, *, pieces: int, rows_per_piece: int) -> tuple[torch.Tensor, torch.Tensor, int, list[int]]:
    """input_ids and labels whose rows have 0 to ``length`` real tokens (padding on either
    side, the padded labels set to the ignore index), ``pieces`` consecutive groups of
    ``rows_per_piece`` rows each holding at least one real token; and the ignore index and
    the real tokens per piece."""
    length = draw(st.integers(2, 7))
    ignore = draw(st.sampled_from([-100, -1, VOCAB]))
    left = draw(st.booleans())
    rows = pieces * rows_per_piece
    lengths = draw(st.lists(st.integers(0, length), min_size=rows, max_size=rows))
    for piece in range(pieces):
        group = lengths[piece * rows_per_piece : (piece + 1) * rows_per_piece]
        if not any(group):
            lengths[piece * rows_per_piece] = draw(st.integers(1, length))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=generator)
    labels = torch.randint(0, VOCAB, (rows, length), generator=generator)
    for row, real in enumerate(lengths):
        pad = slice(0, length - real) if left else slice(real, length)
        labels[row, pad] = ignore
    counts = [sum(lengths[p * rows_per_piece : (p + 1) * rows_per_piece]) for p in range(pieces)]
    return ids, labels, ignore, counts


SETTINGS = settings(max_examples=12, deadline=None)


@SETTINGS
@given(world=st.sampled_from([2, 3]), data=st.data())
def test_plain_ddp_is_the_trap_exactly_when_ranks_hold_different_numbers_of_tokens(ddp_pools: Any, world: int, data: st.DataObject) -> None:
    ids, labels, ignore, counts = data.draw(padded_batches(pieces=world, rows_per_piece=2))
    loss = functools.partial(token_loss, ignore_index=ignore)
    common: dict[str, Any] = {"loss_fn": loss, "world_size": world, "pool": ddp_pools(world), "forward_kwargs": {"input_ids": ids}}
    # the default step weights each rank by t_r * W / T: right whatever the counts
    assert assert_ddp_grads_match(TinyLM(), (), labels, **common).ok
    if len(set(counts)) > 1:
        with pytest.raises(ParallelMismatch, match="loss-averaging trap") as caught:
            assert_ddp_grads_match(TinyLM(), (), labels, step=ddp_step, **common)
        text = str(caught.value)
        assert f"{counts}" in text
        # the bias measured is the bias the token counts predict
        measured = re.search(r"\(bias ([-+][0-9.e+-]+);", text)
        predicted = re.search(r"the token counts predict ([-+][0-9.e+-]+)\)", text)
        assert measured is not None, text
        assert predicted is not None, text
        assert float(measured.group(1)) == pytest.approx(float(predicted.group(1)), rel=2e-2, abs=1e-6)
    else:
        assert assert_ddp_grads_match(TinyLM(), (), labels, step=ddp_step, **common).ok


@SETTINGS
@given(data=st.data())
def test_accumulation_over_k_is_the_trap_exactly_when_micro_batches_hold_different_numbers_of_tokens(ddp_pools: Any, data: st.DataObject) -> None:
    # 2 ranks x 2 micro-batches of one row each: pieces are the micro-batches, in rank order
    ids, labels, ignore, counts = data.draw(padded_batches(pieces=4, rows_per_piece=1))
    loss = functools.partial(token_loss, ignore_index=ignore)
    common: dict[str, Any] = {"loss_fn": loss, "world_size": 2, "micro_batches": 2, "pool": ddp_pools(2), "forward_kwargs": {"input_ids": ids}}
    assert assert_ddp_accumulation_matches(TinyLM(), (), labels, **common).ok
    if len(set(counts)) > 1:
        with pytest.raises(ParallelMismatch, match="dividing each micro-batch's mean loss by the number of micro-batches"):
            assert_ddp_accumulation_matches(TinyLM(), (), labels, step=micro_mean_over_k, **common)
    else:
        assert assert_ddp_accumulation_matches(TinyLM(), (), labels, step=micro_mean_over_k, **common).ok
