"""Real model families, shrunk, under every backend with their own plans: check_hf_config
and ``dpverify check --hf-config`` on the published configurations of Llama-3-8B,
Qwen2-7B, Qwen2.5-0.5B (tied embeddings), Mistral-7B (sliding window) and Mixtral-8x7B
(experts); a plan with one entry wrong is caught; what cannot be checked is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpverify import InvalidArgument, Verdict
from dpverify.cli.main import main
from dpverify.hf.check import HF_BACKENDS, check_hf_config

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

CONFIGS = Path(__file__).parent / "hf_configs"
PUBLISHED = ["Llama-3-8B", "Qwen2-7B", "Qwen2.5-0.5B", "Mistral-7B-v0.1", "Mixtral-8x7B-v0.1"]

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.mark.parametrize("name", PUBLISHED)
def test_a_published_configuration_passes_under_every_backend(name: str) -> None:
    report = check_hf_config(str(CONFIGS / f"{name}.json"), backend="all")
    assert [outcome.backend for outcome in report.outcomes] == list(HF_BACKENDS)
    assert all(outcome.verdict is Verdict.PASS for outcome in report.outcomes), str(report)
    # each backend compared tensors, on ranks that really sharded: the evidence is in the report
    for outcome in report.outcomes:
        assert outcome.report is not None
        assert outcome.report.tensors
    assert "held" in report.outcome("tp").detail or "sharded" in str(report.outcome("tp").report)


def test_check_hf_config_on_the_command_line_passes_llama_3_8b(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--hf-config", str(CONFIGS / "Llama-3-8B.json"), "--backend", "tp", "--no-color"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "LlamaConfig shrunk to" in out
    assert "kv heads" in out
    assert "OK: llama under tp" in out


def test_a_plan_with_one_entry_wrong_fails_naming_the_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "my_plans.py").write_text(
        "from dpverify.hf.plans import hf_tp_plan\n\n\n"
        "def wrong_head(model):\n"
        "    plan = hf_tp_plan(model, 2)\n"
        "    plan['lm_head'] = 'colwise'  # the logits stay split over the vocabulary\n"
        "    return plan\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["check", "--hf-config", "llama", "--backend", "tp", "--tp-plan", "my_plans:wrong_head", "--no-color"])
    out = " ".join(capsys.readouterr().out.split())  # as one line: rich wraps at 100 columns
    assert code == 1, out
    assert "module 'lm_head' (transformers 'colwise') handed on [4, 16, 128]" in out
    assert "FAILED: llama under tp" in out


def test_what_cannot_be_shrunk_is_a_usage_error_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    # multi-query attention: one key-value head cannot be divided over two ranks
    assert main(["check", "--hf-config", "deepseek_v4", "--backend", "tp"]) == 2
    assert "num_key_value_heads" in capsys.readouterr().err


def test_the_hf_options_are_refused_where_they_do_not_apply(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--model", "mlp", "--tp-plan", "hf"]) == 2
    assert "--tp-plan applies to --hf-config only" in capsys.readouterr().err
    assert main(["check", "--hf-config", "llama", "--model", "mlp"]) == 2
    assert "leave out --model" in capsys.readouterr().err
    assert main(["check", "--hf-config", "llama", "--devices", "2", "4"]) == 2
    assert "give one count" in capsys.readouterr().err


def test_check_hf_config_refuses_an_unknown_backend() -> None:
    with pytest.raises(InvalidArgument, match="backend=\\['dp', 'xla'\\]: pass 'all' or some of"):
        check_hf_config("llama", backend=["dp", "xla"])


def test_a_family_that_draws_randomness_is_checked_in_eval_mode_and_says_so() -> None:
    # Seed-OSS sets attention and residual dropout: each replica would draw its own masks
    report = check_hf_config("seed_oss", backend="dp")
    assert report.ok, str(report)
    assert report.notes == ("checked in eval mode: attention_dropout=0.1, residual_dropout=0.1 draw differently on each rank",)


def test_ddp_finds_the_unused_parameters_of_a_sparse_attention_indexer() -> None:
    # DeepSeek-V3.2's indexer only selects tokens: no gradient reaches it, and DDP without
    # find_unused_parameters never reduces the buckets that hold it
    report = check_hf_config("deepseek_v32", backend="ddp")
    assert report.ok, str(report)
    assert report.notes[0].startswith("DDP with find_unused_parameters=True: ")
    assert "self_attn.indexer" in report.notes[0]
    assert "find_unused_parameters=True" in str(report.outcome("ddp").report)  # the scenario DDP ran


def test_a_model_over_the_budget_is_refused_naming_max_params(capsys: pytest.CaptureFixture[str]) -> None:
    # Qwen2-7B's seven query heads per key-value head over four ranks (four key-value heads,
    # 28 query heads), with the four layers of four stages: wider than the default budget
    config = str(CONFIGS / "Qwen2-7B.json")
    assert main(["check", "--hf-config", config, "--backend", "tp", "--tp", "4", "--pp", "4"]) == 2
    assert "over max_params=2,000,000" in capsys.readouterr().err


@pytest.mark.deep
def test_four_ranks_and_four_stages_pass_with_a_wider_budget(capsys: pytest.CaptureFixture[str]) -> None:
    config = str(CONFIGS / "Qwen2-7B.json")
    for backend in ("tp", "pp"):
        code = main(["check", "--hf-config", config, "--backend", backend, "--tp", "4", "--pp", "4", "--max-params", "5000000", "--no-color"])
        assert code == 0, capsys.readouterr().out
