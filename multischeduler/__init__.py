"""kubestrata multischeduler (entry point: `kubestrata multischeduler`): an HTTPS
kube-scheduler extender for the upper cluster.

- `POST /filter`: asks the fit estimator of every candidate virtual node at once, under
  one deadline (`--estimator-timeout`), whether one real node of its lower cluster fits
  the pod, holding that room for it; of the clusters that fit, only the one ranked first
  (below) passes and keeps its room. A cluster without room fails as unresolvable with
  its reason (`vk-lower-1: 0/3 nodes are available: 3 Insufficient cpu`); an estimator
  that fails or is late fails its own node only (`--on-estimator-error fail`) or lets it
  pass (`ignore`); one late 3 times in a row is not asked for 5 s. Ordinary nodes pass
  untouched.
- `POST /prioritize`: 0..10 per candidate from filter's answers (`--score best-fit` or
  `least-allocated`, averaged with the pod's preferred node affinity); ordinary nodes
  get the best virtual node's score, so the extender never ranks them below the cluster
  filter chose. Called only while the scheduler has several candidates left.
- `POST /bind`, for a configuration that names it (`bindVerb: bind`, with
  `--on-estimator-error ignore`): holds room on a cluster filter let through unchecked or
  refuses, creates the Binding, then gives back the room the other clusters held. The
  configuration below leaves binding to the scheduler: the chosen cluster's estimator
  turns the room filter held into the pod on its way down when it sees the binding.
- The three verbs above answer only a caller with a client certificate signed by
  `--client-ca-file` (and named in `--client-name`, when given): the scheduler's, from its
  extender tlsConfig `certFile` and `keyFile`. Anyone else gets 403.
- `GET /healthz` (probes; served once the Node, Namespace and ResourceQuota caches are
  filled), `GET /metrics` (Prometheus text: `kubestrata_extender_filter_seconds` and
  counters).

The same process is the namespace scheduler: it places the quota slices of namespaces
with a ResourceQuota over the lower clusters (multischeduler.slicing, docs/slices.md),
and filter lets their pods only onto the clusters holding their slices.

Virtual nodes are the upper Nodes labelled `kubestrata.io/virtual-node=true`; their estimator is at
the `kubestrata.io/estimator-address` annotation (gRPC over TLS, a bearer token). The
upper kube-scheduler's KubeSchedulerConfiguration calls it with (manifests/
multischeduler/scheduler-config.yaml)::

    extenders:
    - urlPrefix: https://HOST:PORT
      filterVerb: filter
      prioritizeVerb: prioritize
      weight: 5
      enableHTTPS: true
      nodeCacheCapable: true
      ignorable: false
      httpTimeout: 5s
      tlsConfig: {caFile: ..., certFile: ..., keyFile: ...}
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    from multischeduler.main import main as serve

    return serve(argv)
