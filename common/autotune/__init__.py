"""The autotune control law (`controller`, pure), its Prometheus reads (`prometheus`, `queries`) and one
decision tick (`tick`). The operator runs it per RLJob from a kopf timer; `rljob run` runs it locally."""
