"""The operator's side of autotuning: the kopf timer that runs one tick per RLJob and writes
status.effectiveKnobs (`timer`), and its Prometheus metrics (`metrics`). The control law and the
queries live in rljob.common.autotune. See docs/autotune.md.
"""
