"""Helpers that the tests, the benchmarks and the demo share, and nothing else uses: a local Kubernetes
control plane (`support.cluster`), the target server and the operator as real processes, a kubelet for the
test node, Eagle3Target objects and the CRD, requests to a server under test, the vLLM stand-in and the
trainers' reference rows. Not shipped in any image."""
