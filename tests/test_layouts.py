"""Sharded layouts as data, the default layout of a model, and the strategies that draw them."""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dpverify import InvalidArgument
from dpverify.models.layouts import (
    FSDPLayout,
    PipelineLayout,
    ShardedScenario,
    TPLayout,
    default_layout,
    even_split_points,
    linear_pairs,
    microbatch_counts,
)
from dpverify.models.specs import ModelSpec
from dpverify.strategies import fsdp_layouts, pipeline_layouts, sharded_scenarios, tp_layouts


def test_a_sequential_spec_is_a_bare_sequential_of_linear_layers_and_activations() -> None:
    module = ModelSpec("sequential", features=3, hidden=4, outputs=2, depth=2, activation="tanh").build()
    assert isinstance(module, nn.Sequential)
    assert [type(m) for m in module] == [nn.Linear, nn.Tanh, nn.Linear, nn.Tanh, nn.Linear]
    assert module(torch.randn(5, 3)).shape == (5, 2)


def test_linear_pairs_pair_a_linear_with_the_next_one_across_elementwise_modules() -> None:
    module = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Identity(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    assert linear_pairs(module, 2) == [("0", "3")]  # pairs do not overlap: 5 is left alone
    assert linear_pairs(module, 3) == []  # 4 columns do not split over 3 ranks


def test_linear_pairs_stop_at_a_module_that_mixes_features_and_look_inside_nested_sequentials() -> None:
    block = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 4))
    module = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 4), block)
    assert linear_pairs(module, 2) == [("3.0", "3.2")]


def test_even_split_points_give_the_first_stages_one_child_more() -> None:
    assert even_split_points(5, 2) == (3,)
    assert even_split_points(5, 3) == (2, 4)
    assert even_split_points(4, 4) == (1, 2, 3)
    with pytest.raises(InvalidArgument, match="3 top-level children cannot make 4 pipeline stages"):
        even_split_points(3, 4)


def test_microbatch_counts_cut_the_batch_into_equal_pieces_largest_first() -> None:
    assert microbatch_counts(8) == [4, 2, 1]
    assert microbatch_counts(6) == [3, 2, 1]
    assert microbatch_counts(5) == [1]


def test_the_default_layout_of_each_backend_or_why_there_is_none() -> None:
    mlp = ModelSpec("sequential", hidden=4, depth=2).build()
    assert default_layout("fsdp", mlp, 2, 8) == FSDPLayout()
    assert default_layout("tp", mlp, 2, 8) == TPLayout((("0", "2"),))
    assert default_layout("pp", mlp, 2, 8) == PipelineLayout((3,), 4, "gpipe")
    assert "divisible by 3" in str(default_layout("tp", mlp, 3, 8))
    conv = nn.Conv1d(2, 2, 3)
    assert "this model is Conv1d" in str(default_layout("pp", conv, 2, 8))
    assert "3 top-level children cannot make 4 stages" in str(default_layout("pp", ModelSpec("sequential").build(), 4, 8))
    with pytest.raises(InvalidArgument, match="backend='ddp' is not one of"):
        default_layout("ddp", mlp, 2, 8)


def test_a_tp_layout_builds_the_plan_with_torchs_styles_or_the_ones_given() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    class MyRowwise(RowwiseParallel):
        pass

    layout = TPLayout((("0", "2"), ("4", "6")))
    plan = layout.plan()
    assert [type(style) for style in plan.values()] == [ColwiseParallel, RowwiseParallel] * 2
    assert list(plan) == ["0", "2", "4", "6"]
    assert type(layout.plan(rowwise=MyRowwise)["2"]) is MyRowwise


def test_layouts_and_sharded_scenarios_print_as_they_are_built_and_pickle() -> None:
    scenario = ShardedScenario(layout=PipelineLayout((2,), 2, "1f1b"))
    from dpverify.models.layouts import FSDPLayout as FSDPLayout_  # noqa: F401  (the repr's names)
    from dpverify.models.specs import DeviceList, LossSpec, Scenario  # noqa: F401

    assert eval(repr(scenario), {**globals(), **locals(), "torch": torch}) == scenario
    assert pickle.loads(pickle.dumps(scenario)) == scenario
    assert scenario.backend == "pp"
    assert scenario.world_size == 2


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_drawn_fsdp_layouts_name_modules_with_parameters(data: st.DataObject) -> None:
    module = ModelSpec("sequential", depth=2).build()
    layout = data.draw(fsdp_layouts(module))
    owners = {name for name, sub in module.named_modules() if any(True for _ in sub.parameters())}
    assert layout.shard_modules is None or set(layout.shard_modules) <= owners


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_drawn_tp_plans_pair_linear_layers_without_overlap_on_a_mesh_that_divides_the_world(data: st.DataObject) -> None:
    module = ModelSpec("sequential", hidden=4, depth=3).build()
    layout = data.draw(tp_layouts(module, 4, data_parallel=(1, 2)))
    used = [path for pair in layout.pairs for path in pair]
    assert len(used) == len(set(used)) > 0
    for first, second in layout.pairs:
        assert isinstance(module.get_submodule(first), nn.Linear)
        assert int(second) > int(first)
    assert layout.data_parallel in (1, 2)


def test_tp_layouts_refuse_what_cannot_be_sharded() -> None:
    with pytest.raises(InvalidArgument, match="none divides world_size=3"):
        tp_layouts(nn.Linear(2, 2), 3, data_parallel=(2,))


@settings(max_examples=30, deadline=None)
@given(data=st.data(), children=st.integers(2, 7), world=st.integers(1, 2), batch=st.integers(1, 9))
def test_drawn_pipelines_give_every_stage_a_child_and_equal_microbatches(data: st.DataObject, children: int, world: int, batch: int) -> None:
    layout = data.draw(pipeline_layouts(children, world, batch))
    assert layout.split_points is not None
    bounds = [0, *layout.split_points, children]
    assert all(a < b for a, b in itertools.pairwise(bounds))
    assert batch % layout.n_microbatches == 0
    if layout.schedule == "1f1b":  # torch's Schedule1F1B needs a microbatch per stage
        assert layout.n_microbatches >= world


def test_pipeline_layouts_refuse_a_1f1b_only_draw_that_no_batch_split_allows() -> None:
    with pytest.raises(InvalidArgument, match="1F1B needs at least 2 equal microbatches, which a batch of 1 row cannot give"):
        pipeline_layouts(3, 2, 1, schedules=("1f1b",))


@pytest.mark.parametrize("backend", ["fsdp", "tp", "pp"])
def test_sharded_scenarios_draw_what_their_backend_can_lay_out(backend: str) -> None:
    seen: list[ShardedScenario] = []

    @settings(max_examples=25, deadline=None, database=None)
    @given(sharded_scenarios(backend, world_sizes=(2, 4)))
    def draw(scenario: ShardedScenario) -> None:
        seen.append(scenario)
        module = scenario.build().module
        assert scenario.backend == backend
        if backend == "fsdp":
            assert scenario.scenario.batch_size >= scenario.world_size
        if isinstance(scenario.layout, TPLayout):
            tp_size = scenario.world_size // scenario.layout.data_parallel
            assert all(module.get_submodule(first).out_features % tp_size == 0 for first, _ in scenario.layout.pairs)
        if isinstance(scenario.layout, PipelineLayout):
            assert len(module) >= scenario.world_size
            assert scenario.scenario.batch_size % scenario.layout.n_microbatches == 0

    draw()
    assert {s.world_size for s in seen} == {2, 4}


def test_sharded_scenarios_refuse_bad_arguments() -> None:
    with pytest.raises(InvalidArgument, match="backend='ddp' is not one of"):
        sharded_scenarios("ddp")
    with pytest.raises(InvalidArgument, match="world_sizes"):
        sharded_scenarios("tp", world_sizes=())
