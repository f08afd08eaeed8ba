"""A real local Kubernetes control plane for tests: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok (simulated GPU nodes), built from Go modules by build-tools.sh and run on loopback.

Use it through the `cluster` pytest fixture (tests/conftest.py) or `python -m tests.cluster up|down|status`.
"""
