"""RLJob API models, shared by the runtime, the operator and the CRD generator (pydantic only)."""

from rljob.api.load import RLJobConfigError, load_rljob, parse_rljob
from rljob.api.spec import RLJob, RLJobSpec

__all__ = ["RLJob", "RLJobSpec", "RLJobConfigError", "load_rljob", "parse_rljob"]
