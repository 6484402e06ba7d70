"""RLJob YAML parsing: the quickstart is valid; every bad field is named in the error."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rljob.api import RLJobConfigError, load_rljob, parse_rljob
from rljob.runtime.cli import main

QUICKSTART = Path(__file__).resolve().parents[2] / "docs" / "examples" / "quickstart.yaml"


def quickstart() -> dict:
    return yaml.safe_load(QUICKSTART.read_text())


def test_quickstart_is_valid():
    job = load_rljob(QUICKSTART)
    assert job.spec.rollout.strategy == "april"
    assert job.spec.rollout.partial.over_sampling == 2.0
    assert job.spec.algorithm.off_policy.mode == "tis"


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        (("spec", "rollout", "rolloutBatchSize"), 0, "spec.rollout.rolloutBatchSize"),
        (("spec", "rollout", "rolloutBatchSize"), "eight", "spec.rollout.rolloutBatchSize"),
        (("spec", "rollout", "partial", "overSampling"), 0.5, "spec.rollout.partial.overSampling"),
        (("spec", "rollout", "strategy"), "fast", "spec.rollout.strategy"),
        (("spec", "algorithm", "offPolicy", "mode"), "ignore", "spec.algorithm.offPolicy.mode"),
        (("spec", "rollout", "partial", "maxStaleness"), -1, "spec.rollout.partial.maxStaleness"),
        (("spec", "rollout", "samplesPerPrompts"), 4, "spec.rollout.samplesPerPrompts"),
        (("spec", "trainer", "steps"), -3, "spec.trainer.steps"),
        (("kind",), "Job", "kind"),
    ],
)
def test_bad_field_is_named(path, value, named):
    doc = quickstart()
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(RLJobConfigError) as err:
        parse_rljob(doc, "job.yaml")
    assert f"job.yaml: {named}:" in str(err.value)
    assert len(str(err.value).splitlines()) == 1, "one problem, one line"


def test_unknown_field_says_so():
    doc = quickstart()
    doc["spec"]["rollout"]["partial"]["overSample"] = 2
    with pytest.raises(RLJobConfigError, match=r"spec.rollout.partial.overSample: unknown field"):
        parse_rljob(doc, "job.yaml")


def test_evaluation_on_jsonl_data_needs_a_held_out_file():
    doc = quickstart()
    doc["spec"]["data"] = {"jsonl": "train.jsonl"}
    doc["spec"]["evaluation"] = {"everySteps": 5}
    with pytest.raises(RLJobConfigError, match="spec: evaluation.jsonl or evaluation.parquet is required"):
        parse_rljob(doc, "job.yaml")
    doc["spec"]["evaluation"]["jsonl"] = "held-out.jsonl"
    assert parse_rljob(doc, "job.yaml").spec.evaluation.jsonl == "held-out.jsonl"


def test_two_model_sources_rejected():
    doc = quickstart()
    doc["spec"]["model"]["path"] = "/models/x"
    with pytest.raises(RLJobConfigError, match="spec.model: exactly one of builtin, path, huggingFace"):
        parse_rljob(doc, "job.yaml")


def test_cli_reports_config_error_without_traceback(tmp_path, capsys):
    doc = quickstart()
    doc["spec"]["rollout"]["rolloutBatchSize"] = -1
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    assert main(["validate", str(bad)]) == 2
    out = capsys.readouterr().out
    assert "spec.rollout.rolloutBatchSize" in out and "Traceback" not in out


def test_cli_missing_file(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read file" in capsys.readouterr().out


def test_metrics_carry_the_namespace_of_the_rljob_the_trainer_reports_to() -> None:
    """The autotuner selects on rljob_namespace: a trainer started for an RLJob (RLJOB_NAMESPACE, as the
    status reporter uses it) must export that namespace even when its job file names none."""
    from rljob.api import parse_rljob
    from rljob.runtime.job_parts import metrics_namespace

    job = parse_rljob({"apiVersion": "rljob.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "j"},
                       "spec": {"model": {"builtin": "tiny-arith"}, "data": {"synthetic": {}}}})
    assert metrics_namespace(job, {"RLJOB_NAMESPACE": "team-a"}) == "team-a"
    assert metrics_namespace(job, {}) == ""
    job.metadata.namespace = "ml"
    assert metrics_namespace(job, {}) == "ml"
