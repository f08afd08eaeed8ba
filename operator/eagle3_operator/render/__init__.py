"""Pure rendering of an Eagle3Target's children (Deployment, Service, PodDisruptionBudget, NetworkPolicy,
PodMonitor, and the hydration Job of a Hugging Face source).

Every function here maps (name, namespace, typed spec) to plain manifest dicts and makes no API call, so the
handlers can server-side apply the result as a whole and tests can check it without a cluster. Applying the
full desired object every time is what repairs drift: a field the operator owns always comes back.

One module per part: `names` (child names, labels, owner references), `server_image` (which image a target
keeps), `model_source` (where each source puts the model), `server_command` (the server's command line),
`pod_parts` (what server and download pods share), `deployment` (the server pods and their disruption
budget), `hydration` (the Hub download Job), `network` (Service, PodMonitor, NetworkPolicy) and `children`
(everything a target owns, digest-stamped).
"""
