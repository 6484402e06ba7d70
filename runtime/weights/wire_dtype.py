"""The dtype a weight sync sends: the one the engines serve, not the trainer's fp32 master weights.

SGLang reports its ``--dtype`` in ``/get_server_info`` (``/server_info`` on 0.5.23), a ServerArgs
field: ``auto`` (the default), ``half``/``float16``, ``bfloat16``, ``float``/``float32``. Under ``auto`` SGLang
serves the checkpoint config's dtype (a float32 config in float16, Gemma's in bfloat16:
``_get_and_verify_dtype`` in ``srt/configs/model_config.py``); the trainer cannot read that config's
original dtype back (its own copy records the dtype it loaded in), so ``auto`` is taken as bfloat16,
what RL checkpoints (Qwen, Llama) ship in. A float16 server gets bfloat16 tensors and casts them on
load (SGLang's ``load_weights`` copies into its parameters): every bfloat16 value of a weight's range
is exact in float16. Sending the served dtype halves the bytes of an fp32 trainer's sync.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    # Types only: buckets.py counts bucket sizes with tensor_wire_bytes below.
    from rljob.runtime.weights.buckets import Bucket

log = logging.getLogger(__name__)

AUTO_DTYPE = torch.bfloat16  # see the module docstring
# SGLang's dtype names (its _STR_DTYPE_TO_TORCH_DTYPE and the --dtype choices), "auto" aside.
_NAMED: dict[str, torch.dtype] = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}


def served_dtype(info: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype a server says it serves (its server info's ``dtype``; ``auto``: AUTO_DTYPE); None
    when it does not say. ValueError naming the field for a name SGLang would not accept either."""
    name = info.get("dtype")
    if name is None:
        return None
    if not isinstance(name, str):
        raise ValueError(f"/get_server_info dtype: expected a string, got {name!r}")
    key = name.lower()
    if key == "auto":
        return AUTO_DTYPE
    if key not in _NAMED:
        raise ValueError(f"/get_server_info dtype: unknown dtype {name!r}; expected auto or one of {sorted(_NAMED)}")
    return _NAMED[key]


def common_dtype(dtypes: Iterable[torch.dtype | None]) -> torch.dtype | None:
    """One dtype for a sync every engine receives (one broadcast reaches them all): the first known
    one. Engines that serve another cast on load; a mixed pool is logged, since it costs precision."""
    known = [d for d in dtypes if d is not None]
    if len(set(known)) > 1:
        log.warning("engines serve different dtypes %s; weights are sent in %s and cast on load",
                    sorted({str(d) for d in known}), known[0])
    return known[0] if known else None


def wire_dtype_of(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``tensor`` travels in: ``dtype`` for floating-point tensors (None: its own)."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def as_wire(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` as it travels (see wire_dtype_of); the same tensor when no cast is needed."""
    return tensor.to(wire_dtype_of(tensor, dtype))


def tensor_wire_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Bytes of ``tensor`` in full as it travels in ``dtype`` (a sharded tensor's full size)."""
    return tensor.numel() * wire_dtype_of(tensor, dtype).itemsize


def wire_bytes(bucket: Bucket, dtype: torch.dtype | None) -> int:
    """Bytes of a bucket as it travels in ``dtype`` (a tied tensor once per name, as it is sent)."""
    return sum(tensor_wire_bytes(t, dtype) for _, t in bucket)


def cast_bucket(bucket: Bucket, dtype: torch.dtype | None) -> Bucket:
    """The bucket's floating-point tensors in ``dtype`` (None: unchanged). The names of a tied tensor
    keep sharing one converted tensor, so a cast bucket costs at most its own size again."""
    if dtype is None:
        return bucket
    converted: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}  # by memory, as buckets.py keys tied names
    out: Bucket = []
    for name, tensor in bucket:
        if wire_dtype_of(tensor, dtype) == tensor.dtype:
            out.append((name, tensor))
            continue
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in converted:
            converted[key] = as_wire(tensor, dtype)
        out.append((name, converted[key]))
    return out
