"""RLJob API models, shared by the runtime, the operator and the CRD generator (pydantic only)."""

from rljob.operator.api.load import RLJobConfigError, load_rljob, parse_rljob
from rljob.operator.api.spec import RLJob, RLJobSpec

__all__ = ["RLJob", "RLJobSpec", "RLJobConfigError", "load_rljob", "parse_rljob"]
