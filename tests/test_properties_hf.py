"""The property suite on real model families: shrunk configurations of a grouped-query
decoder (Llama), a mixture of experts (Mixtral) and Qwen2, any of them tied, drawn by
``dpverify.strategies.hf_configs``, pass every backend under their own plans, keep the
structure they were drawn with, and a plan with one Linear split the other way fails."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpverify.hf import build_model
from dpverify.hf.check import HF_BACKENDS, check_hf_config
from dpverify.hf.plans import TransformersStyle, hf_tp_plan
from dpverify.strategies import HF_FAMILIES, hf_configs

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

pytestmark = [pytest.mark.deep, pytest.mark.filterwarnings("ignore")]

#: each example runs ranked checks on a model of up to a few million parameters
SLOW = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SLOW
@given(hf_configs())
def test_the_drawn_families_keep_their_structure(config: Any) -> None:
    assert config.model_type in HF_FAMILIES
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert config.num_key_value_heads % 2 == 0
    assert config.num_hidden_layers >= 2
    if config.model_type == "mixtral":
        assert config.num_local_experts > config.num_experts_per_tok >= 2


@SLOW
@given(hf_configs(), st.sampled_from(HF_BACKENDS))
def test_a_shrunk_family_matches_one_device_under_each_backend_with_its_own_plans(config: Any, backend: str) -> None:
    report = check_hf_config(config, backend=backend, shrunk=False)
    assert report.ok, str(report) + "\n" + "\n".join(outcome.detail for outcome in report.outcomes)


@SLOW
@given(hf_configs(), st.data())
def test_one_linear_of_the_plan_split_the_other_way_fails(config: Any, data: st.DataObject) -> None:
    plan = hf_tp_plan(build_model(config), 2)
    swappable = sorted(
        name for name, style in plan.items()
        if isinstance(style, TransformersStyle) and dict(style.entries).get("") in ("colwise", "rowwise")
    )
    name = data.draw(st.sampled_from(swappable), label="module")
    entries = plan[name].entries
    other = "rowwise" if dict(entries)[""] == "colwise" else "colwise"
    plan[name] = TransformersStyle(tuple((key, other) for key, _style in entries))
    report = check_hf_config(config, backend="tp", tp_plan=plan, shrunk=False)
    assert not report.ok, f"{name} split {other} passed"
