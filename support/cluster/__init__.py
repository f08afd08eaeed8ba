"""A real local Kubernetes control plane for tests: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok (simulated GPU nodes), built from Go modules by build-tools.sh and run on loopback.

Use it through the fixtures in tests/conftest.py (`cluster`: an `access.Cluster`; `namespace`: a fresh one per
test) or keep one running with `python -m support.cluster up|status|down`, which test runs then reuse.

What to expect of it:
- two schedulable nodes, gpu-0 and gpu-1, with 8 `nvidia.com/gpu` each (nodes.py);
- a scheduled pod turns Running and Ready at once (kwok ignores probes and images) with an IP from its node's
  podCIDR 127.1.N.0/24, so a server bound on this machine at that IP answers there; IPs are reused;
- Services get ClusterIPs in 127.2.0.0/16 but no endpoints (those controllers are off: the API rejects
  loopback endpoint addresses), so address pods by IP, never by Service;
- no kubelet: to simulate a crashing container, patch the pod's status subresource (kwok leaves Running pods
  alone);
- admin access is a static token (system:masters); `Cluster.write_service_account_kubeconfig` gives a
  ServiceAccount's identity, under RBAC.
"""
