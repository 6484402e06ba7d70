"""The dtype a weight sync sends (runtime/weights/wire_dtype.py), against SGLang's own `--dtype` choices."""

from __future__ import annotations

import re

import pytest
import torch

from rljob.runtime.weights.disk import write_snapshot
from rljob.runtime.weights.wire_dtype import AUTO_DTYPE, cast_bucket, common_dtype, served_dtype, wire_bytes
from tests.helpers.releases import SGLANG_RELEASES
from tests.helpers.sglang_release import read_source

_DTYPE_FLAG_FILES = {"0.5.5.post3": "sglang/srt/server_args.py", "0.5.23": "sglang/srt/arg_groups/fields/model.py"}


@pytest.mark.parametrize("version", SGLANG_RELEASES)
def test_every_dtype_sglang_accepts_is_understood(version: str):
    source = read_source(version, _DTYPE_FLAG_FILES[version])
    found = re.search(r'choices=\[("auto", "half"[^\]]*)\]', source)
    assert found, f"sglang {version}: no --dtype choices in {_DTYPE_FLAG_FILES[version]}"
    choices = [c.strip().strip('"') for c in found.group(1).split(",")]
    assert "auto" in choices
    for choice in choices:
        assert isinstance(served_dtype({"dtype": choice}), torch.dtype), choice


def test_the_names_map_to_what_sglang_serves():
    assert served_dtype({"dtype": "auto"}) is AUTO_DTYPE is torch.bfloat16
    assert served_dtype({"dtype": "half"}) == served_dtype({"dtype": "float16"}) == torch.float16
    assert served_dtype({"dtype": "float"}) == torch.float32
    assert served_dtype({}) is None
    with pytest.raises(ValueError, match="dtype: unknown dtype 'fp8'"):
        served_dtype({"dtype": "fp8"})


def test_one_dtype_for_a_mixed_pool_is_the_first_known():
    assert common_dtype([None, torch.bfloat16, torch.float32]) == torch.bfloat16
    assert common_dtype([None, None]) is None


def test_a_cast_bucket_keeps_tied_names_on_one_tensor_and_leaves_integers_alone():
    embed = torch.randn(4, 2)
    bucket = [("embed", embed), ("head", embed.detach()), ("ids", torch.arange(3))]
    cast = cast_bucket(bucket, torch.bfloat16)
    assert [t.dtype for _, t in cast] == [torch.bfloat16, torch.bfloat16, torch.int64]
    assert cast[0][1] is cast[1][1]
    assert wire_bytes(bucket, torch.bfloat16) == 8 * 2 * 2 + 3 * 8
    assert cast_bucket(bucket, None) is bucket


def test_a_disk_snapshot_is_written_in_the_served_dtype(tmp_path):
    from safetensors import safe_open

    bucket = [("w", torch.randn(8, 8)), ("b", torch.randn(8))]
    written = write_snapshot(tmp_path / "v1", [bucket], lambda _p: None, torch.bfloat16)
    assert written == (64 + 8) * 2
    with safe_open(str(tmp_path / "v1" / "model-00001.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert torch.equal(f.get_tensor("w"), bucket[0][1].to(torch.bfloat16))
