"""Local test infrastructure: a real Kubernetes control plane (localkube), helm and Prometheus."""
