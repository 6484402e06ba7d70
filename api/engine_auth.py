"""The per-job engine API key: how the operator hands it to pods and how the runtime finds it.

The operator keeps one random key per RLJob in a Secret it owns; every pod that serves or calls the
engines (SGLang workers, the router, the trainer) reads it from that Secret into the environment
variable below, so the key never appears in a pod spec. SGLang and the router take it as
``--api-key $(RLJOB_ENGINE_API_KEY)`` (the kubelet expands the reference); the runtime's client sends
it as ``Authorization: Bearer <key>`` (docs/security.md).
"""

from __future__ import annotations

ENGINE_API_KEY_ENV = "RLJOB_ENGINE_API_KEY"
# The data key of the job's engine-key Secret.
ENGINE_API_KEY_SECRET_KEY = "api-key"
