"""Coordinators on etcd: several coordinators share one cluster's workers, health verdicts and leadership.

  etcd_store.py     EtcdStore: the etcd calls, awaitable, with etcd's reachability tracked
  leadership.py     Leadership: ACTIVE / STANDBY (active_standby) or REPLICA, by a leader key on a lease
  registry_sync.py  RegistrySync: registered workers written to etcd and read back into each registry
  shared_health.py  SharedHealth: one coordinator's unhealthy verdict heard by the others
  standby_gate.py   StandbyGate: a standby answers client requests 503 with Retry-After
  node.py           ClusterNode: the above for one coordinator, started and stopped with its app
"""
