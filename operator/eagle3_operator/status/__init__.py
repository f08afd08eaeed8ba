"""Status from observation: what the cluster and the target servers show → the `Eagle3Target` status.

Everything here is pure (the clock is an argument), so the rules that users and training jobs depend on
(when Ready is True, which reason explains a stall, when a transition time moves) are tested without a
cluster. The operator writes the result only when it differs from the status already stored.

Ready is strict: every desired replica is a ready endpoint of the current Deployment revision, each
answering /readyz and /v1/info with one fingerprint. Available is what a training job needs to start: at
least one endpoint serves the current generation's model (its pod runs the model-deciding server flags
the current spec renders, and all such endpoints agree on one fingerprint), so it stays True through a
scale-up, a rollout that keeps the model, or replicas that cannot be scheduled. Only such endpoints are
published ready, so a job never lands on a pod serving another model. Degraded says "something needs a
human" and Progressing says "wait, it is moving"; both carry the reason a user acts on.

The modules, in the order data flows through them:
- `observation`: the typed record of one target at one moment (pods, Deployment, probes, download).
- `observe`: reading the API's objects (pods and their container states, Jobs, Deployments) into it.
- `state`: the rules: which phase, conditions and failure an observation means.
- `reasons`: every condition reason, and the condition types each appears on.
- `conditions`: condition states, their stored form and transition times, and the events they announce.
- `document`: the status document as stored, and the patch that writes only what changed.
"""
