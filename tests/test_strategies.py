"""The strategies: validation, shrinking, determinism, and specs a person can paste."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument as HypothesisInvalidArgument

import dpverify
from dpverify import strategies
from dpverify.strategies import (
    EXACT_BACKEND_KINDS,
    EXACT_KINDS,
    TOKEN_KINDS,
    DeviceList,
    LossSpec,
    ModelSpec,
    PipelineLayout,
    Scenario,
    ShardedScenario,
    TokenBatch,
    TokenScenario,
    TPLayout,
    batch_sizes,
    device_lists,
    dtypes,
    exact_scenarios,
    loss_specs,
    model_specs,
    scenarios,
    token_batches,
    token_scenarios,
)

NAMESPACE = {
    "ModelSpec": ModelSpec, "LossSpec": LossSpec, "DeviceList": DeviceList, "Scenario": Scenario,
    "TokenBatch": TokenBatch, "TokenScenario": TokenScenario, "torch": torch,
}


def test_every_public_strategy_is_exported_and_documented() -> None:
    page = (__import__("pathlib").Path(__file__).parent.parent / "docs" / "fuzzing.md").read_text()
    for name in strategies.__all__:
        obj = getattr(strategies, name)
        assert obj.__doc__ or isinstance(obj, tuple), name
        if callable(obj) and name[0].islower():
            assert f"`{name}(" in page, f"{name} is not documented in docs/fuzzing.md"
            assert "Shrinks" in (obj.__doc__ or ""), f"{name}'s docstring does not say how it shrinks"


@given(scenarios())
def test_scenarios_print_as_pasteable_specs(scenario: Scenario) -> None:
    assert eval(repr(scenario), NAMESPACE) == scenario
    assert pickle.loads(pickle.dumps(scenario)) == scenario


@given(scenarios())
def test_build_is_deterministic(scenario: Scenario) -> None:
    first, second = scenario.build(), scenario.build()
    for a, b in zip(first.module.state_dict().values(), second.module.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(first.inputs, second.inputs, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(first.target, second.target)
    assert first.inputs[0].shape[0] == scenario.batch_size
    assert next(first.module.parameters()).dtype == scenario.dtype


def test_build_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    Scenario(ModelSpec("mlp")).build()
    assert torch.equal(torch.get_rng_state(), before)


def test_shrinks_to_the_simplest_scenario() -> None:
    simplest = find(scenarios(), lambda s: True, settings=settings(database=None))
    assert simplest == Scenario(ModelSpec("linear", features=1, hidden=1, outputs=1), 1, DeviceList((0,)), LossSpec(), torch.float32, 0)


def test_shrinks_a_failure_to_one_linear_layer_and_the_fewest_devices() -> None:
    # the condition stands for "any uneven split fails": the minimal example is one Linear
    # layer, the smallest uneven batch and two devices
    found = find(
        scenarios(),
        lambda s: len(set(s.chunk_sizes)) > 1,
        settings=settings(database=None, max_examples=2000),
    )
    assert found.model.kind == "linear"
    assert len(found.devices.device_ids) == 2
    assert found.batch_size == 3


@given(st.integers(1, 6), st.data())
def test_batch_sizes_cover_the_interesting_splits(n: int, data: st.DataObject) -> None:
    size = data.draw(batch_sizes(n, max_size=16))
    assert 1 <= size <= 16


@pytest.mark.parametrize(
    ("predicate", "label"),
    [
        (lambda b: b < 4, "fewer rows than devices"),
        (lambda b: b % 4 == 0, "equal chunks"),
        (lambda b: b > 4 and b % 4 != 0, "uneven chunks"),
        (lambda b: len(dpverify.chunk_sizes(b, 4)) < 4 and b > 4, "fewer chunks than devices"),
    ],
)
def test_batch_sizes_reach_each_case(predicate: Any, label: str) -> None:
    assert predicate(find(batch_sizes(4), predicate, settings=settings(database=None))), label


@given(device_lists(min_devices=2, max_devices=4))
def test_device_lists_are_distinct_with_output_device_from_the_list(devices: DeviceList) -> None:
    assert 2 <= len(devices.device_ids) <= 4
    assert len(set(devices.device_ids)) == len(devices.device_ids)
    assert devices.output_device is None or devices.output_device in devices.device_ids
    assert devices.real == (torch.cuda.device_count() > max(devices.device_ids))


def test_device_lists_reach_reversed_orders() -> None:
    found = find(device_lists(min_devices=2), lambda d: list(d.device_ids) == sorted(d.device_ids, reverse=True) and d.output_device is not None)
    assert found.device_ids == (1, 0)


@given(loss_specs(), st.integers(1, 5), st.integers(2, 4))
def test_every_loss_gives_a_scalar_with_its_target(loss: LossSpec, batch: int, outputs: int) -> None:
    logits = torch.randn(batch, outputs, requires_grad=True)
    value = loss(logits, loss.target(batch, outputs))
    assert value.dim() == 0
    value.backward()


@given(model_specs())
def test_specs_declare_whether_they_are_exact(spec: ModelSpec) -> None:
    expected = not ((spec.kind == "batchnorm" and spec.train) or (spec.kind == "dropout" and spec.train) or spec.kind == "loss-head")
    assert spec.exact == expected
    found = dpverify.divergence_sources(spec.build())
    assert bool(found) == (not spec.batch_independent or not spec.deterministic)


def test_dtypes() -> None:
    assert find(dtypes(), lambda d: True) == torch.float32
    assert find(dtypes(bfloat16=True), lambda d: d == torch.bfloat16) == torch.bfloat16
    assert find(dtypes(float16=True), lambda d: d == torch.float16) == torch.float16


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: model_specs(kinds=["transformer"]), "kinds=\\['transformer'\\]"),
        (lambda: model_specs(kinds=[]), "kinds=\\[\\]"),
        (lambda: model_specs(kinds=["loss-head"], exact=True), "leaves nothing to draw"),
        (lambda: model_specs(max_hidden=0), "max_hidden=0 must be an int >= 1"),
        (lambda: batch_sizes(0), "n_devices=0 must be an int >= 1"),
        (lambda: batch_sizes(2, max_size=0), "max_size=0"),
        (lambda: device_lists(min_devices=3, max_devices=2), "max_devices=2 must be an int >= 3"),
        (lambda: loss_specs(names=["hinge"]), "names=\\['hinge'\\]"),
        (lambda: loss_specs(reductions=["none"]), "reductions=\\['none'\\]"),
        (lambda: scenarios(max_batch=0), "max_batch=0"),
    ],
)
def test_bad_arguments_fail_eagerly_naming_the_argument(make: Any, match: str) -> None:
    with pytest.raises(dpverify.InvalidArgument, match=match):
        make()


def test_one_invalid_argument_for_dpverify_and_hypothesis() -> None:
    # one class: what dpverify's helpers raise, what Hypothesis expects of a strategy, a ValueError
    assert issubclass(dpverify.InvalidArgument, HypothesisInvalidArgument)
    assert issubclass(dpverify.InvalidArgument, ValueError)
    # pytest.raises matches as ``except dpverify.InvalidArgument`` does (by isinstance)
    with pytest.raises(dpverify.InvalidArgument, match="max_batch=0 must be an int >= 1"):
        find(scenarios(max_batch=0), lambda scenario: True)


@pytest.mark.parametrize(
    ("strategy", "match"),
    [
        (batch_sizes(st.just(0)), "n_devices=0 must be an int >= 1"),
        (scenarios(models=st.just("linear")), "models='linear' is str; pass a ModelSpec"),
        (scenarios(dtype=st.just("float32")), "dtype='float32' is str; pass a torch.dtype"),
    ],
)
def test_bad_drawn_values_raise_dpverify_invalid_argument_under_given(strategy: st.SearchStrategy[Any], match: str) -> None:
    @given(strategy)
    @settings(max_examples=5, database=None)
    def test(value: Any) -> None:
        pass

    with pytest.raises(dpverify.InvalidArgument, match=match):
        test()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: model_specs(kinds=5), "kinds=5: choose a non-empty subset of"),
        (lambda: model_specs(kinds="linear"), "kinds='linear': choose a non-empty subset of"),
        (lambda: loss_specs(names="mse"), "names='mse': choose a non-empty subset of"),
        (lambda: loss_specs(reductions="mean"), "reductions='mean': choose from 'mean' and 'sum'"),
        (lambda: dtypes(bfloat16=1), "bfloat16=1 must be True or False"),
        (lambda: model_specs(exact="yes"), "exact='yes' must be True or False"),
        (lambda: scenarios(devices=(0, 1)), "devices=\\(0, 1\\) is tuple; pass a DeviceList"),
    ],
)
def test_wrongly_typed_arguments_are_invalid_arguments(make: Any, match: str) -> None:
    with pytest.raises(dpverify.InvalidArgument, match=match):
        make()


def test_spec_validation() -> None:
    with pytest.raises(dpverify.InvalidArgument, match="kind='resnet'"):
        ModelSpec("resnet")
    with pytest.raises(dpverify.InvalidArgument, match="reduction='none'"):
        LossSpec("mse", "none")
    with pytest.raises(dpverify.InvalidArgument, match="name='hinge'"):
        LossSpec("hinge")


# -- padded token batches -------------------------------------------------------------------


@given(st.integers(1, 4), st.booleans(), st.data())
def test_token_batches_build_padded_labels_and_every_chunk_counts_a_token(n: int, causal: bool, data: st.DataObject) -> None:
    batch = data.draw(token_batches(n, causal=causal))
    built = batch.build()
    ids, labels = built["input_ids"], built["labels"]
    assert ids.shape == labels.shape == (batch.rows, batch.seq_len)
    assert 1 <= batch.rows <= 8
    assert (2 if causal else 1) <= batch.seq_len <= 6
    real = batch.mask()
    assert real.sum(dim=1).tolist() == list(batch.lengths)
    assert torch.equal(labels == batch.ignore_index, ~real)  # padding, and only padding, is ignored
    assert torch.equal(ids == 0, ~real)  # pad id 0; real ids are 1 .. 63
    assert torch.equal(labels[real], ids[real])
    first = real.int().argmax(dim=1)  # where each row's real tokens start
    for row, length in enumerate(batch.lengths):
        if 0 < length < batch.seq_len:
            assert int(first[row]) == (0 if batch.padding_side == "right" else batch.seq_len - length)
    if batch.rows * batch.seq_len <= 62:
        assert len(set(ids[real].tolist())) == int(real.sum())  # no id repeats
    counts = [int((c != batch.ignore_index).sum()) for c in (labels[:, 1:] if causal else labels).chunk(n)]
    assert counts == batch.chunk_counts(n, causal)
    assert min(counts) > 0  # no replica's mean loss is 0/0


@pytest.mark.parametrize(
    ("strategy", "predicate", "label"),
    [
        (token_batches(2), lambda b: b.padding_side == "left" and 0 < min(b.lengths) < b.seq_len, "left padding"),
        (token_batches(2), lambda b: 0 in b.lengths, "a row of padding only"),
        (token_batches(2), lambda b: b.ignore_index == 0 and min(b.lengths) < b.seq_len, "ignore index 0"),
        (token_batches(2), lambda b: b.ignore_index == -1 and min(b.lengths) < b.seq_len, "ignore index -1"),
        (token_batches(2), lambda b: len(set(dpverify.chunk_sizes(b.rows, 2))) == 1 and len(set(b.chunk_counts(2))) > 1, "equal rows, unequal tokens"),
        (token_batches(2), lambda b: len(set(dpverify.chunk_sizes(b.rows, 2))) > 1 and len(set(b.chunk_counts(2))) == 1, "uneven rows, equal tokens"),
        (token_batches(3, causal=True), lambda b: len(set(dpverify.chunk_sizes(b.rows, 3))) > 1 and len(set(b.chunk_counts(3, True))) == 1, "causal, uneven rows, equal tokens"),
        (token_batches(2, causal=True), lambda b: b.padding_side == "left" and 1 in b.lengths, "a causal row of one real token"),
        (token_batches(2, empty_chunks=True), lambda b: 0 in b.chunk_counts(2), "a chunk without tokens"),
    ],
)
def test_token_batches_reach_each_case(strategy: st.SearchStrategy[TokenBatch], predicate: Any, label: str) -> None:
    assert predicate(find(strategy, predicate, settings=settings(database=None, max_examples=2000))), label


@given(st.data())
def test_token_batches_draw_only_what_is_asked(data: st.DataObject) -> None:
    batch = data.draw(token_batches(3, padding_sides=["left"], ignore_indices=[7], all_padding_rows=False, max_rows=4, max_seq_len=3))
    assert batch.padding_side == "left"
    assert batch.ignore_index == 7
    assert min(batch.lengths) >= 1
    assert batch.rows <= 4
    assert batch.seq_len <= 3
    assert 7 not in batch.build()["input_ids"][batch.mask()].tolist()  # a real id is never the ignore index


def test_token_batches_shrink_to_one_unpadded_row() -> None:
    assert find(token_batches(), lambda b: True) == TokenBatch((1,), 1)
    assert find(token_batches(causal=True), lambda b: True) == TokenBatch((2,), 2)
    # a failure needing padding shrinks to the least of it
    assert find(token_batches(2), lambda b: sum(b.lengths) < b.rows * b.seq_len, settings=settings(database=None)) == TokenBatch((1,), 2)


def test_token_scenarios_shrink_and_print_as_pasteable_specs() -> None:
    simplest = find(token_scenarios(), lambda s: True, settings=settings(database=None))
    assert simplest == TokenScenario(ModelSpec("lm-head", features=1, hidden=1, outputs=1), TokenBatch((1,), 1), DeviceList((0,)), torch.float32, 0)


@given(token_scenarios())
def test_token_scenarios_build_a_head_that_ignores_the_batchs_ignore_index(scenario: TokenScenario) -> None:
    assert eval(repr(scenario), NAMESPACE) == scenario
    assert pickle.loads(pickle.dumps(scenario)) == scenario
    first, second = scenario.build(), scenario.build()
    assert first.inputs == ()
    assert set(first.kwargs) == {"input_ids", "labels"}
    for a, b in zip(first.module.state_dict().values(), second.module.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert dpverify.core.items.ignore_indices_of(first.module) == (scenario.batch.ignore_index,)
    assert scenario.model.kind in TOKEN_KINDS
    assert scenario.model.returns_loss
    assert not scenario.model.exact
    loss = first.module(**first.kwargs)
    assert loss.dim() == 0
    assert torch.isfinite(loss)
    assert min(scenario.token_counts) > 0


def test_model_specs_draw_language_model_heads_only_when_asked() -> None:
    assert not set(TOKEN_KINDS) & set(dpverify.strategies.KINDS)
    assert find(model_specs(kinds=TOKEN_KINDS), lambda m: m.causal).kind == "causal-lm-head"
    # a Scenario of one calls it by keyword, right-padded, with the labels as target
    built = Scenario(ModelSpec("causal-lm-head"), 3).build()
    assert built.inputs == ()
    assert torch.equal(built.target, built.kwargs["labels"])
    assert torch.isfinite(built.module(**built.kwargs))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: token_batches(causal=True, max_seq_len=1), "max_seq_len=1 must be an int >= 2"),
        (lambda: token_batches(0), "n_devices=0 must be an int >= 1"),
        (lambda: token_batches(max_rows=0), "max_rows=0"),
        (lambda: token_batches(padding_sides=["top"]), "padding_sides=\\['top'\\]"),
        (lambda: token_batches(padding_sides="left"), "padding_sides='left'"),
        (lambda: token_batches(ignore_indices=[]), "ignore_indices=\\[\\]"),
        (lambda: token_batches(ignore_indices=-100), "ignore_indices=-100"),
        (lambda: token_batches(ignore_indices=[True]), "ignore_indices=\\[True\\]"),
        (lambda: token_batches(empty_chunks=1), "empty_chunks=1 must be True or False"),
        (lambda: token_scenarios(max_seq_len=1), "max_seq_len=1 must be an int >= 2"),
        (lambda: token_scenarios(padding_sides=["top"]), "padding_sides"),
        (lambda: model_specs(kinds=["lm-head"], exact=True), "leaves nothing to draw"),
        (lambda: TokenBatch((3,), 2), "lengths=\\(3,\\)"),
        (lambda: TokenBatch(()), "lengths=\\(\\)"),
        (lambda: TokenBatch(padding_side="middle"), "padding_side='middle'"),
        (lambda: TokenScenario(ModelSpec("linear")), "kind='linear' is not one of"),
    ],
)
def test_bad_token_arguments_fail_eagerly_naming_the_argument(make: Any, match: str) -> None:
    with pytest.raises(dpverify.InvalidArgument, match=match):
        make()


def test_a_drawn_model_that_is_no_language_model_head_is_an_invalid_argument() -> None:
    @given(token_scenarios(models=ModelSpec("linear")))
    @settings(max_examples=5, database=None)
    def test(value: Any) -> None:
        pass

    with pytest.raises(dpverify.InvalidArgument, match="models drew kind='linear'"):
        test()


# -- exact mode -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["dp", "ddp", "fsdp", "tp", "pp"])
def test_exact_scenarios_print_as_pasteable_specs_and_keep_to_powers_of_two(backend: str) -> None:
    namespace = {**NAMESPACE, **{name: getattr(strategies, name) for name in ("ShardedScenario", "FSDPLayout", "TPLayout", "PipelineLayout")}}

    @given(exact_scenarios(backend, world_sizes=(1, 2, 3, 4) if backend == "dp" else (2, 4), max_depth=2))
    def run(scenario: Scenario | ShardedScenario) -> None:
        assert eval(repr(scenario), namespace) == scenario
        assert pickle.loads(pickle.dumps(scenario)) == scenario
        plain = scenario.scenario if isinstance(scenario, ShardedScenario) else scenario
        model, rows, world = plain.model, plain.batch_size, len(plain.devices.device_ids)
        assert model.kind in EXACT_BACKEND_KINDS[backend]
        assert model.activation in ("relu", "leaky_relu")
        assert not model.train
        assert model.outputs in (1, 2, 4)
        assert plain.loss.name in ("mse", "l1")
        # a squared error of three Linear layers in a chain rounds
        assert plain.loss.name == "l1" or (model.depth == 1 and model.kind != "residual")
        if plain.loss.reduction == "mean":
            assert rows & (rows - 1) == 0  # the mean divides by rows x outputs
        if backend != "dp":
            assert plain.loss.reduction == "mean"
            assert world & (world - 1) == 0
        if backend in ("ddp", "fsdp"):
            assert rows % world == 0  # equal shards
        if isinstance(scenario, ShardedScenario):
            assert scenario.backend == backend
            if isinstance(scenario.layout, TPLayout):
                assert model.hidden % (world // scenario.layout.data_parallel) == 0
            if isinstance(scenario.layout, PipelineLayout):
                assert 2 * model.depth + 1 >= world
                assert rows % scenario.layout.n_microbatches == 0

    run()


@pytest.mark.parametrize(
    ("backend", "predicate", "label"),
    [
        ("dp", lambda s: len(set(s.chunk_sizes)) > 1, "uneven chunks"),
        ("dp", lambda s: s.model.kind == "conv-pool" and s.model.pooling == "max", "a convolution with max pooling"),
        ("dp", lambda s: s.model.kind == "concat" and s.model.activation == "leaky_relu", "concatenation with LeakyReLU"),
        ("dp", lambda s: s.model.kind == "embedding", "an embedding"),
        ("dp", lambda s: s.model.kind == "residual" and s.model.depth == 2, "two residual blocks (with an L1 loss)"),
        ("ddp", lambda s: len(s.devices.device_ids) == 4 and s.batch_size > 4, "4 ranks of several rows"),
        ("fsdp", lambda s: s.layout.shard_modules is not None, "a drawn FSDP2 layout"),
        ("tp", lambda s: s.layout.data_parallel == 2, "a 2-D mesh"),
        ("pp", lambda s: s.layout.schedule == "1f1b" and s.world_size == 4, "1F1B on 4 stages"),
    ],
)
def test_exact_scenarios_reach_each_case(backend: str, predicate: Any, label: str) -> None:
    strategy = exact_scenarios(backend, world_sizes=(1, 2, 3, 4) if backend == "dp" else (2, 4))
    assert predicate(find(strategy, predicate, settings=settings(database=None, max_examples=2000))), label


def test_exact_scenarios_shrink_to_one_linear_layer() -> None:
    simplest = find(exact_scenarios(), lambda s: True, settings=settings(database=None))
    assert simplest == Scenario(ModelSpec("linear", features=1, hidden=1, outputs=1, pooling="sum", train=False), 1, DeviceList((0,)), LossSpec(), torch.float32, 0)
    ranked = find(exact_scenarios("pp"), lambda s: True, settings=settings(database=None))
    assert ranked.scenario.model == ModelSpec("sequential", features=1, hidden=1, outputs=1, pooling="sum", train=False)
    assert (ranked.world_size, ranked.scenario.batch_size, ranked.scenario.seed) == (2, 1, 0)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: exact_scenarios("horovod"), "backend='horovod'"),
        (lambda: exact_scenarios("ddp", world_sizes=(3,)), "world_sizes=\\[3\\]: ddp divides every gradient by the world size"),
        (lambda: exact_scenarios("fsdp", world_sizes=(1,)), "world_sizes=1 must be an int >= 2"),
        (lambda: exact_scenarios("dp", world_sizes=[]), "world_sizes=\\[\\]"),
        (lambda: exact_scenarios("dp", world_sizes=2), "world_sizes=2"),
        (lambda: exact_scenarios(max_depth=3), "max_depth=3: exact arithmetic leaves room for at most 2"),
        (lambda: exact_scenarios(max_hidden=16), "max_hidden=16"),
        (lambda: exact_scenarios(max_batch=0), "max_batch=0 must be an int >= 1"),
        (lambda: exact_scenarios(kinds=["attention"]), "kinds=\\['attention'\\]: choose a non-empty subset of"),
        (lambda: exact_scenarios("tp", kinds=["linear"]), "kinds=\\['linear'\\]"),
        (lambda: exact_scenarios(losses=["cross_entropy"]), "losses=\\['cross_entropy'\\]"),
        (lambda: exact_scenarios("pp", world_sizes=(4,), max_depth=1), "max_depth=1: a pipeline needs a child per stage"),
        (lambda: exact_scenarios("pp", world_sizes=(4,), losses=["mse"]), "add 'l1' to losses"),
        (lambda: exact_scenarios(kinds=["residual"], losses=["mse"]), "a residual block between a stem and a head"),
        (lambda: exact_scenarios("tp", world_sizes=(8,)), "world_sizes=\\[8\\] with max_hidden=4: tensor parallelism shards"),
        (lambda: ModelSpec(activation="elu"), "activation='elu'"),
    ],
)
def test_bad_exact_arguments_fail_eagerly_naming_the_argument(make: Any, match: str) -> None:
    with pytest.raises(dpverify.InvalidArgument, match=match):
        make()


def test_model_specs_draw_the_exact_kinds_only_when_asked() -> None:
    assert not set(EXACT_KINDS) & set(strategies.KINDS)
    assert find(model_specs(kinds=EXACT_KINDS), lambda m: m.kind == "concat").kind == "concat"
    built = Scenario(ModelSpec("conv-pool", features=2, hidden=3, outputs=2, pooling="max"), 3).build()
    assert built.inputs[0].shape == (3, 2, 4, 4)
    assert built.module(*built.inputs).shape == (3, 2)
