"""`make test` runs on two pytest-xdist workers; the real node's tests must all run on one of them.

The real node is one per machine and a session holds it until it ends (`real_cluster`), so a second
worker that reached a real-node test would wait for the first worker's whole session. tests/conftest.py
puts every such test in one xdist group; this runs a small session the way `make test` does and checks
where the tests ran (it fails when the group is ignored, as with pytest 9.2 and xdist 3.8).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import os
import pytest


@pytest.mark.realnode
@pytest.mark.parametrize("i", range(6))
def test_on_the_node(i):
    print("RAN", "node", i, os.environ["PYTEST_XDIST_WORKER"])


@pytest.mark.parametrize("i", range(6))
def test_elsewhere(i):
    print("RAN", "plain", i, os.environ["PYTEST_XDIST_WORKER"])
"""


def test_real_node_tests_run_on_one_worker_and_the_rest_on_both(tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    (tmp_path / "test_probe.py").write_text(PROBE)
    (tmp_path / "conftest.py").write_text((REPO / "tests/conftest.py").read_text().replace("pytest_plugins", "_unused"))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-rA", "-q",
         "-o", "markers=realnode", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ran = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("RAN ")]
    node_workers = {worker for kind, _, worker in ran if kind == "node"}
    assert len([r for r in ran if r[0] == "node"]) == 6 and len(node_workers) == 1, ran
    assert {worker for kind, _, worker in ran} == {"gw0", "gw1"}, ran  # the others use both workers
