"""The shared base of the ranked checks (``dpverify.ranked``): the shard validator, the
keyword groups, the explanation of a uniform factor, the identities of compared tensors, and
the pieces a batch is cut into.
None of these tests starts a rank."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import dpverify
from dpverify.core.comparison import TensorId, Tolerance, compare_tensors, explain_scale
from dpverify.core.errors import InvalidArgument
from dpverify.ranked.check import (
    DDP_RANKS,
    FSDP_RANKS,
    TP_GROUPS,
    callable_name,
    grads_only,
    relative_gap,
    same_up_to_rounding,
    shard_sizes,
)
from dpverify.ranked.items import cut_pieces, measure_losses
from dpverify.ranked.options import ARGS, RankedKeywords, accepted, documented


def test_one_shard_validator_serves_ranks_that_need_rows_ranks_that_may_have_none_and_groups() -> None:
    assert shard_sizes(None, 5, 2) == (3, 2)
    assert shard_sizes([4, 1], 5, 2, DDP_RANKS) == (4, 1)
    assert shard_sizes([5, 0], 5, 2, FSDP_RANKS) == (5, 0)
    with pytest.raises(InvalidArgument, match=r"contains 0; every rank needs an int >= 1 rows \(a rank without rows"):
        shard_sizes([5, 0], 5, 2, DDP_RANKS)
    with pytest.raises(InvalidArgument, match=r"has 2 entries for data_parallel=1; pass one row count per data-parallel group \(each group"):
        shard_sizes([4, 4], 8, 1, TP_GROUPS)
    with pytest.raises(InvalidArgument, match=r"cannot give each of 4 ranks a row"):
        shard_sizes(None, 3, 4)
    with pytest.raises(InvalidArgument, match=r"the batch has 1 rows for data_parallel=2 groups"):
        shard_sizes(None, 1, 2, TP_GROUPS)
    with pytest.raises(InvalidArgument, match=r"sums to 5 but the batch has 6 rows"):
        shard_sizes([4, 1], 6, 2)


def test_a_keyword_outside_the_group_is_a_type_error() -> None:
    def helper(**options: object) -> None:
        accepted(helper, options, RankedKeywords, without=("msg",))

    helper(pool=None, rtol=1e-3, atol=1e-3)
    with pytest.raises(TypeError, match=r"helper\(\) got an unexpected keyword argument 'shard'"):
        helper(shard=[1])
    with pytest.raises(TypeError, match="unexpected keyword argument 'msg'"):
        helper(msg="no")
    with pytest.raises(TypeError, match="unexpected keyword argument 'step'"):
        dpverify.assert_ddp_buffers_match(torch.nn.BatchNorm1d(2), torch.randn(4, 2), torch.randn(4, 2), loss_fn=F.mse_loss, world_size=2, step=print)  # type: ignore[call-arg]


def test_the_shared_args_are_written_into_each_docstring_once() -> None:
    def helper() -> None:
        """Does nothing.

        Args:
            <shared: pool, msg>
        """

    text = documented(helper).__doc__ or ""
    assert "<shared" not in text
    assert "    pool: the ranks to use" in text
    assert "    msg: replaces the failure message" in text
    for public in (dpverify.assert_ddp_grads_match, dpverify.assert_fsdp_grads_match, dpverify.assert_tensor_parallel_grads_match, dpverify.assert_pipeline_grads_match):
        doc = " ".join((public.__doc__ or "").split())
        assert "<shared" not in doc
        assert " ".join(f"rtol: {ARGS['rtol']}".split()) in doc


def test_one_scale_explainer_words_summed_replicas_and_averaged_ranks() -> None:
    assert "(1/4, one over the number of replicas used): the replica gradients were averaged" in explain_scale(0.25, 4)
    assert "summed over replicas twice" in explain_scale(4.0, 4)
    assert explain_scale(1.7, 4) == "Every parallel gradient is 1.7 times the single-device gradient."
    ranks = explain_scale(2.0, 2, averager="DDP", shard_size=2)
    assert ranks.startswith("Every rank's gradient is 2 times the single-device full-batch gradient (2, the world size)")
    assert "; or (2, the rows per rank)" in ranks
    summed = explain_scale(0.5, 2, averager="FSDP2's reduce-scatter", reduction="sum")
    assert "loss_fn is a sum-reduction loss" in summed
    assert "FSDP2's reduce-scatter divides" in summed
    assert "(3, the number of micro-batches)" in explain_scale(3.0, 2, averager="DDP", micro_batches=3)
    groups = explain_scale(2.0, 2, averager="FSDP2 over 'dp'", size="number of data-parallel groups")
    assert "(2, the number of data-parallel groups): the ranks' gradients were summed but not divided by the number of data-parallel groups. FSDP2 over 'dp' averages" in groups


def test_contrasts_are_picked_by_the_kind_of_their_identity() -> None:
    tolerance = Tolerance()
    t = torch.ones(2)
    grad = compare_tensors(TensorId("grad", "w", rank=1, variant="plain ddp_step"), t, t, t.double(), tolerance)
    output = compare_tensors(TensorId("output[0:2]", rank=1, variant="plain ddp_step"), t, t, t.double(), tolerance)
    assert grad.name == "rank 1 plain ddp_step grad 'w'"
    assert output.name == "rank 1 plain ddp_step output[0:2]"
    assert grads_only([grad, output]) == [grad]


def test_gradient_measures() -> None:
    a = {"w": torch.tensor([1.0, 2.0]), "b": None}
    assert relative_gap({"w": torch.tensor([1.0, 3.0])}, a) == pytest.approx(0.5)
    assert same_up_to_rounding({"w": torch.tensor([1.0, 2.0 + 1e-6]), "b": None}, a)
    assert not same_up_to_rounding({"w": torch.tensor([1.0, 2.1]), "b": None}, a)
    assert callable_name(functools.partial(torch.optim.SGD, lr=0.1)) == "SGD(lr=0.1)"


def test_pieces_are_cut_as_the_ranks_cut_them_and_measured_in_float64() -> None:
    x, y = torch.arange(10.0).reshape(5, 2), torch.arange(5.0).reshape(5, 1)
    pieces = cut_pieces((x,), {"mask": torch.ones(5)}, y, [3, 2, 0], 2)
    assert [[p.bounds for p in rank] for rank in pieces] == [[(0, 3, 0, 2), (0, 3, 2, 3)], [(3, 5, 0, 1), (3, 5, 1, 2)], [(5, 5, 0, 0)]]
    assert torch.equal(pieces[0][1].args[0], x[2:3])
    assert torch.equal(pieces[1][0].target, y[3:4])
    assert torch.equal(pieces[1][1].kwargs["mask"], torch.ones(1))
    assert pieces[2][0].rows == 0
    linear = torch.nn.Linear(2, 1, bias=False)
    losses, full = measure_losses(linear, (x,), {}, y, F.mse_loss, cut_pieces((x,), {}, y, [3, 2], 1), 5)
    assert full == pytest.approx(F.mse_loss(linear.double()(x.double()), y.double()).item())
    per_row = [(linear.double()(x.double()[i]) - y.double()[i]).square().item() for i in range(5)]
    assert [loss for (loss,) in losses] == pytest.approx([sum(per_row[:3]) / 3, sum(per_row[3:]) / 2])
