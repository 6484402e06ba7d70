"""The weight-update group formed by this project's trainer rank 0 with engine ranks running SGLang's
OWN ``init_custom_process_group`` (read from each release's wheel at test time, never copied here):
gloo, two engine ranks in their own processes, one broadcast, bounded timeouts.

Also the layout the CPU server builds its ranks on (``collective.backend_store``) against the one
torch's helper builds for SGLang, so the CPU tests exercise the keys a real engine uses.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rljob.runtime.weight_group import create_group, join_group, open_store
from tests.helpers.sglang_engine_rank import all_received
from tests.helpers.sglang_release import NEWEST, PINNED, function_source

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60.0
NUMEL = 5


@pytest.mark.parametrize("version", [PINNED, NEWEST])
def test_trainer_rank_0_broadcasts_to_two_engine_ranks_running_sglangs_own_group_code(version: str, tmp_path: Path):
    function_source(version, "sglang/srt/utils/common.py", "init_custom_process_group")  # download before timing
    store = open_store("127.0.0.1", 0, 3, TIMEOUT_S)
    group = f"interop-{uuid.uuid4().hex[:8]}"
    engines = []
    for rank in (1, 2):
        log = open(tmp_path / f"rank{rank}.log", "w+")
        cmd = [sys.executable, "-m", "tests.helpers.sglang_engine_rank", version, "127.0.0.1", str(store.port),
               str(rank), "3", group, str(NUMEL)]
        engines.append((subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True), log))
    try:
        rank0 = create_group(store, group, 3, "gloo", TIMEOUT_S)
        sent = torch.arange(NUMEL, dtype=torch.float32) * 1.5
        rank0.broadcast(sent.clone())
        received = []
        for proc, log in engines:
            out, _ = proc.communicate(timeout=TIMEOUT_S * 2)
            log.seek(0)
            assert proc.returncode == 0, f"engine rank of sglang {version} failed:\n{log.read()[-3000:]}"
            received.append(json.loads(out.strip().splitlines()[-1]))
        rank0.close()
    finally:
        for proc, log in engines:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    assert received == [sent.tolist(), sent.tolist()]


def test_the_cpu_servers_ranks_meet_sglangs_ranks_in_one_group(tmp_path: Path):
    """Rank 0 (project), rank 1 SGLang's newest function in a subprocess, rank 2 the CPU server's own
    ``join_group`` in this process: one group, so the CPU server's keys are SGLang's."""
    function_source(NEWEST, "sglang/srt/utils/common.py", "init_custom_process_group")
    store = open_store("127.0.0.1", 0, 3, TIMEOUT_S)
    group = f"mixed-{uuid.uuid4().hex[:8]}"
    log = open(tmp_path / "rank1.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.sglang_engine_rank", NEWEST, "127.0.0.1",
                             str(store.port), "1", "3", group, str(NUMEL)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        mine: dict[str, torch.Tensor] = {}

        def cpu_server_rank() -> None:
            member = join_group("127.0.0.1", store.port, 2, 3, group, TIMEOUT_S)
            mine["t"] = torch.empty(NUMEL)
            member.broadcast(mine["t"])
            all_received(store, group, 2, 3, TIMEOUT_S)
            member.close()

        thread = threading.Thread(target=cpu_server_rank)
        thread.start()
        rank0 = create_group(store, group, 3, "gloo", TIMEOUT_S)
        sent = torch.linspace(-1, 1, NUMEL)
        rank0.broadcast(sent.clone())
        thread.join(TIMEOUT_S)
        out, _ = proc.communicate(timeout=TIMEOUT_S * 2)
        log.seek(0)
        assert proc.returncode == 0, log.read()[-3000:]
        rank0.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert json.loads(out.strip().splitlines()[-1]) == pytest.approx(sent.tolist())
    assert torch.equal(mine["t"], sent)


def test_the_pinned_release_picks_the_helpers_keyword_by_a_string_comparison():
    """0.5.5.post3 on the trainer's torch (2.10 or later) passes ``pg_options``, which torch's helper no
    longer takes: its function runs only under the torch of its image (2.8), which is why the engine
    ranks above run it as shipped and why the trainer never reuses it."""
    if str(torch.__version__) >= "2.6":
        pytest.skip(f"torch {torch.__version__}: the string comparison happens to hold on this torch")
    namespace: dict[str, object] = {"torch": torch}
    exec(function_source(PINNED, "sglang/srt/utils/common.py", "init_custom_process_group"), namespace)
    with pytest.raises(TypeError, match="pg_options"):
        namespace["init_custom_process_group"](backend="gloo", store=dist.HashStore(), world_size=2, rank=1,
                                               group_name=f"quirk-{uuid.uuid4().hex[:8]}")
