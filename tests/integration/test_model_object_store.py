"""model.uri from a real S3-compatible store (SeaweedFS on loopback, signed requests): the cluster's
download step run as the operator writes it, `rljob run`'s cached copy (downloaded once, again when the
bucket changes), and the errors that name spec.model.uri. Every copy is loaded and compared with the
uploaded tiny model."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rljob.api import parse_rljob
from rljob.api.spec import ModelSpec, RLJobSpec
from rljob.operator.builders import JobRef, build_children
from rljob.operator.builders.pods import pod_templates
from rljob.operator.builders.storage import DOWNLOAD_CONTAINER, OBJECT_FETCH_DIR
from rljob.runtime.models.errors import ModelSourceError
from rljob.runtime.models.loading import load_causal_lm
from rljob.runtime.models.object_source import local_copy_dir
from rljob.runtime.object_store import ObjectStore, ObjectStoreError, ObjectUri, StoreSettings
from rljob.runtime.runner import JobRunner, RunOptions
from rljob.runtime.tasks.policy import policy_dir
from tests.helpers.object_store import S3Server
from tests.integration.test_runner_resume import job_doc, tiny_policy

EXAMPLE = Path(__file__).resolve().parents[2] / "charts/rljob-operator/examples/cpu-only.yaml"


def upload_model(s3: S3Server, model: Path, folder: str) -> str:
    """Put the model folder under s3://BUCKET/models/<folder> (as `aws s3 cp --recursive` would); its URI."""
    store = ObjectStore(ObjectUri.parse(f"s3://{s3.bucket}/models"), StoreSettings(endpoint=s3.endpoint))
    store.upload_folder(model, folder)
    return f"s3://{s3.bucket}/models/{folder}"


def job_on_uploaded_model(s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          folder: str) -> tuple[Path, str, dict]:
    """A one-step job whose model is a tiny model uploaded to models/<folder>, the rljob cache in
    tmp_path: (the model's local folder, its URI, the job document)."""
    monkeypatch.setenv("RLJOB_CACHE", str(tmp_path / "cache"))
    original = tiny_policy(tmp_path / "model")
    uri = upload_model(s3, original, folder)
    doc = job_doc(original, tmp_path / "ckpt", steps=1, every=1)
    doc["spec"]["model"] = {"uri": uri, "s3": {"endpoint": s3.endpoint}}
    return original, uri, doc


def assert_same_weights(directory: Path, original: Path) -> None:
    loaded = load_causal_lm(directory, field="spec.model.uri").state_dict()
    expected = load_causal_lm(original).state_dict()
    assert loaded.keys() == expected.keys() and loaded
    for key, value in expected.items():
        torch.testing.assert_close(loaded[key], value)
    assert sorted(p.name for p in directory.iterdir()) == sorted(p.name for p in original.iterdir())


@pytest.fixture
def s3_keys(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The store's keys in the environment, as the operator passes them from model.s3.credentialsSecret;
    the endpoint only through model.s3.endpoint."""
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    return s3_server


def test_the_operators_download_step_fetches_a_folder_the_model_loads_from(s3_keys: S3Server, tmp_path: Path) -> None:
    original = tiny_policy(tmp_path / "model")
    uri = upload_model(s3_keys, original, "step-run")
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"] = {"uri": uri, "s3": {"endpoint": s3_keys.endpoint, "credentialsSecret": "s3-keys"}}
    children = build_children(JobRef("tiny", "team-a", "uid-1"), RLJobSpec.model_validate(doc["spec"]), active=True)
    steps = [c for pod in pod_templates(children) for c in pod.get("initContainers", []) if c["name"] == DOWNLOAD_CONTAINER]
    assert len(steps) == 2, "the trainer pod and the cpu pool's pod each fetch the model"
    step = steps[0]
    # The step as the kubelet runs it, with its emptyDir moved under tmp_path and this interpreter as `python`.
    fetch_dir = tmp_path / "model-volume"
    fetch_dir.mkdir()
    assert step["command"][0] == "python"
    argv = [sys.executable, *step["command"][1:], *(a.replace(OBJECT_FETCH_DIR, str(fetch_dir)) for a in step["args"])]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({"AWS_ACCESS_KEY_ID": s3_keys.access_key, "AWS_SECRET_ACCESS_KEY": s3_keys.secret_key})
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    trainer = next(c for pod in pod_templates(children) for c in pod["containers"] if c["name"] == "trainer")
    (main_mount,) = [m for m in trainer["volumeMounts"] if m["name"] == "model"]
    assert_same_weights(fetch_dir / main_mount["subPath"], original)

    # A folder that holds no model: the step fails with one line that names the field and says what to do.
    argv[argv.index(uri)] = f"s3://{s3_keys.bucket}/models/missing"
    failed = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert failed.returncode == 1
    assert failed.stderr.strip().splitlines()[-1].startswith(f"spec.model.uri: s3://{s3_keys.bucket}/models/missing holds no objects")


async def test_rljob_run_loads_a_cached_copy_and_refreshes_it_when_the_bucket_changes(
    s3_keys: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    original, uri, doc = job_on_uploaded_model(s3_keys, tmp_path, monkeypatch, "local-run")
    runner = JobRunner(parse_rljob(doc), RunOptions(output_dir=tmp_path / "out"))
    try:
        await runner.setup()
        copy = local_copy_dir(uri, tmp_path / "cache")
        assert runner.policy.directory == copy
        await runner.run_step()  # the copy trains like any model folder
        assert runner.step == 1
    finally:
        await runner.close()
    assert_same_weights(copy, original)

    # Again with the bucket unchanged: nothing is downloaded (the weights file is the same file).
    spec = ModelSpec.model_validate(doc["spec"]["model"])
    weights = copy / "model.safetensors"
    before = weights.stat()
    with caplog.at_level(logging.INFO, logger="rljob.runtime.models.object_source"):
        assert policy_dir(spec) == (copy, "spec.model.uri")
    assert "is current" in caplog.text and "downloading" not in caplog.text
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    # A new config.json in the bucket: the next run downloads the folder again.
    config = original / "config.json"
    config.write_text(config.read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 2, "rljob_note": 1'))
    upload_model(s3_keys, original, "local-run")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rljob.runtime.models.object_source"):
        policy_dir(spec)
    assert "downloading" in caplog.text
    assert '"rljob_note": 1' in (copy / "config.json").read_text()


def test_folders_that_hold_no_model_and_stores_that_cannot_answer_name_spec_model_uri(
    s3_keys: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLJOB_CACHE", str(tmp_path / "cache"))
    endpoint = {"endpoint": s3_keys.endpoint}
    with pytest.raises(ModelSourceError, match=r"spec\.model\.uri: s3://.*/models/none holds no objects; upload"):
        policy_dir(ModelSpec(uri=f"s3://{s3_keys.bucket}/models/none", s3=endpoint))
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "weights.bin").write_bytes(b"\x00" * 10)
    uri = upload_model(s3_keys, stray, "no-config")
    with pytest.raises(ModelSourceError, match=r"spec\.model\.uri: .*no-config has no config\.json.*weights\.bin"):
        policy_dir(ModelSpec(uri=uri, s3=endpoint))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-key")
    with pytest.raises(ModelSourceError, match=r"model\.uri: could not list .*model\.s3\.credentialsSecret") as err:
        policy_dir(ModelSpec(uri=uri, s3=endpoint))
    assert isinstance(err.value.__cause__, ObjectStoreError)


def test_rljob_validate_reads_config_and_tokenizer_without_the_weights(
    s3_keys: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original, uri, doc = job_on_uploaded_model(s3_keys, tmp_path, monkeypatch, "validate")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    done = subprocess.run([sys.executable, "-m", "rljob.runtime.cli", "validate", str(job)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "data ok" in done.stdout
    meta = local_copy_dir(uri, tmp_path / "cache", weights=False)
    assert list(original.glob("*.safetensors")), "no weight file uploaded: the check below would prove nothing"
    assert (meta / "config.json").is_file() and not list(meta.glob("*.safetensors"))
    assert not local_copy_dir(uri, tmp_path / "cache").exists(), "validate downloaded the weights"
