"""What the runtime and the operator both need, above the API models: the Kubernetes client, the
status reporter and the autotune control law with its Prometheus queries."""
