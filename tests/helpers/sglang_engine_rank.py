"""One engine rank of a weight-update group, joined through SGLang's OWN ``init_custom_process_group``
(read from a release's wheel at run time, see sglang_release.py), as SGLang's model runner calls it.

Run: ``python -m tests.helpers.sglang_engine_rank VERSION ADDRESS PORT RANK WORLD GROUP NUMEL``.
It joins, receives one float32 broadcast of NUMEL elements from rank 0, waits until every engine rank
has received (``all_received``), destroys the group as SGLang's ``destroy_weights_update_group`` does,
and prints the tensor as a JSON list.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from packaging.version import Version

from tests.helpers.sglang_release import PINNED, free_names, function_source

COMMON = "sglang/srt/utils/common.py"
# The torch each release's CUDA image ships: the pinned image pins torch 2.8.0 (sglang_protocol.md §13).
IMAGE_TORCH = {PINNED: "2.8.0"}


class _TorchAsShipped(types.ModuleType):
    """This process's torch, reporting the version of the release's image.

    0.5.5.post3 picks the helper's keyword by ``str(torch.__version__) >= "2.6"``, a string comparison
    that is false from torch 2.10 on ("2.13" < "2.6"): on this torch it would pass ``pg_options``,
    which the helper no longer takes. In its image (torch 2.8.0) it passes ``backend_options``; so
    does the function run here.
    """

    def __init__(self, version: str) -> None:
        super().__init__("torch")
        self.__version__ = version

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def module_globals(version: str, function: str) -> dict[str, Any]:
    """The module-level names the function reads, as its module ``sglang.srt.utils.common`` defines them."""
    available: dict[str, Any] = {
        "torch": _TorchAsShipped(IMAGE_TORCH.get(version, torch.__version__)),
        # 0.5.23: torch_release = pkg_version.parse(torch.__version__).release
        "torch_release": Version(torch.__version__).release,
    }
    missing = free_names(function) - set(available)
    if missing:
        raise LookupError(f"sglang {version}'s init_custom_process_group reads {sorted(missing)}: provide them here")
    return {name: available[name] for name in free_names(function)}


def sglang_init_custom_process_group(version: str) -> Callable[..., dist.ProcessGroup]:
    """SGLang's function of that release, executed from its own source."""
    function = function_source(version, COMMON, "init_custom_process_group")
    namespace = module_globals(version, function)
    exec(compile(function, f"sglang-{version}/{COMMON}", "exec"), namespace)
    return namespace["init_custom_process_group"]  # type: ignore[no-any-return]


def all_received(store: dist.Store, group: str, rank: int, world: int, timeout_s: float) -> None:
    """Say this engine rank has received, then wait until every engine rank (1..world-1) has.

    An engine rank leaves only after that. gloo forms a group pair by pair, and a rank's side of a
    pair is done as soon as its connection is written, so a rank that received its broadcast may
    leave while a slower peer is still connecting; that peer then reads the closed connection and
    its connectFullMesh fails ("Connection closed by peer"). A real engine never leaves after one
    broadcast; the tests' ranks, which do, agree on when to leave here.
    """
    store.set(f"{group}/received/{rank}", "1")
    store.wait([f"{group}/received/{peer}" for peer in range(1, world)], timedelta(seconds=timeout_s))


def main(argv: list[str]) -> None:
    """Join as SGLang's model runner does, receive one broadcast, print it."""
    version, address, port, rank, world, group, numel = argv
    timeout = timedelta(seconds=60)  # each wait: the group, the store, the peers' receipts
    init = sglang_init_custom_process_group(version)
    # model_runner.init_weights_update_group: rank = rank_offset + tp_rank, init_method tcp://addr:port
    pg = init(backend="gloo", init_method=f"tcp://{address}:{port}", world_size=int(world), rank=int(rank),
              group_name=group, timeout=timeout)
    tensor = torch.empty(int(numel), dtype=torch.float32)
    dist.broadcast(tensor, src=0, group=pg)  # as update_weights_from_distributed receives
    store = dist.TCPStore(address, int(port), is_master=False, timeout=timeout)
    all_received(store, group, int(rank), int(world), timeout.total_seconds())
    dist.destroy_process_group(pg)
    print(json.dumps(tensor.tolist()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
