"""Alert actions: the operator checks a job's own alert conditions in Prometheus and acts on them."""
