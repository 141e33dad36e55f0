"""ClusterFormats: which version of each wire format the cluster may write now, and its finalize.

  1. Every process announces its release and the formats it reads (proto/wire_versions.py): workers in their
     health answers, coordinator replicas in their etcd census records. One that announces none is the previous
     release.
  2. A format's active version is the newest that every known process reads (this coordinator, its pdserve
     workers in any state, the replicas on etcd): a new version stays off while any process lacks it and
     turns on by itself once none does. A pair of workers also never uses more than both ends read.
  3. Finalize (POST /v1/cluster/finalize): once every known process runs this release, the operator makes it the
     cluster's floor (stored in etcd when there is one): the new versions stay on whatever joins, and a worker
     of an older release is refused at registration (409), so the cluster cannot fall back across it.
"""

from __future__ import annotations

from coordinator.errors import ApiError
from coordinator.workers.instances import InstanceRegistry
from proto.wire_versions import FORMATS, RELEASE, THIS_PROCESS, WireVersions, release_key



class ClusterFormats:
    """The versions this coordinator writes on cluster-wide wires, from what every process announced."""

    def __init__(self, registry: InstanceRegistry, own: WireVersions = THIS_PROCESS, engine: str = "pdserve"):
        self.registry = registry
        self.workers_announce = engine == "pdserve"  # vLLM instances speak their own wires, announced nowhere
        self.own = own
        self.finalized = ""  # the release the cluster was finalized at ("": not finalized)
        self.replicas: dict[str, WireVersions] = {}  # the other coordinators on etcd, by name (set_replicas)
        self._active: dict[str, int] = {}
        self._computed_for = None  # what the active versions were computed from: a request does not rescan

    def processes(self) -> list[tuple[str, WireVersions]]:
        """Every process known, named: this coordinator, the replicas, the pdserve workers."""
        known = [("coordinator (this one)", self.own)]
        known += [(f"coordinator {name}", versions) for name, versions in sorted(self.replicas.items())]
        for role in ("prefill", "decode") if self.workers_announce else ():
            known += [(f"{role} {i.address}", i.versions) for i in self.registry.instances(role)]
        return known

    def active(self, name: str) -> int:
        """The version of format `name` to write now (recomputed only when a process came, went or announced
        other versions, or the replicas or the finalize changed)."""
        state = (self.registry.versions_seen, self.finalized, id(self.replicas))
        if state != self._computed_for:
            self._active, self._computed_for = self._compute(), state
        return self._active.get(name, 1)

    def set_replicas(self, replicas: dict[str, WireVersions]) -> None:
        """The other coordinator replicas' versions, as the etcd census last read them."""
        if replicas != self.replicas:
            self.replicas = replicas

    def version_with(self, name: str, peer: WireVersions) -> int:
        """The version to write to `peer`: the cluster's active one, no newer than what the peer reads."""
        return min(self.active(name), peer.range(name).newest)

    def _compute(self) -> dict[str, int]:
        own = self.own.formats
        if self.finalized and release_key(self.finalized) >= release_key(self.own.release):
            return {name: versions.newest for name, versions in own.items()}
        processes = self.processes()
        return {name: max(versions.oldest, min(v.range(name).newest for _, v in processes))
                for name, versions in own.items()}

    def behind(self) -> list[str]:
        """The processes that run an older release than this coordinator."""
        return [f"{who} (release {v.release})" for who, v in self.processes()
                if release_key(v.release) < release_key(self.own.release)]

    def may_join(self, versions: WireVersions) -> str | None:
        """Why a worker of `versions` may not join a finalized cluster; None when it may."""
        if self.finalized and release_key(versions.release) < release_key(self.finalized):
            return (f"the cluster was finalized at release {self.finalized}; a worker of release {versions.release} "
                    "cannot join it (upgrade the worker)")
        return None

    def finalize(self) -> str:
        """Make this release the cluster's floor; ApiError 409 naming the processes still behind."""
        behind = self.behind()
        if behind:
            raise ApiError(409, "cannot finalize release " + RELEASE + " while these run an older release: "
                           + ", ".join(behind), error_type="conflict_error")
        self.adopt_finalized(self.own.release)
        return self.finalized

    def adopt_finalized(self, release: str) -> None:
        """A finalize this coordinator made or read from etcd (never lowered)."""
        if release and release_key(release) > release_key(self.finalized or "0"):
            self.finalized = release

    def describe(self) -> dict:
        """GET /v1/cluster/formats: this release, the finalize, each format's active version, every process."""
        return {"release": self.own.release, "finalized": self.finalized or None,
                "active": {name: self.active(name) for name in FORMATS},
                "processes": [{"process": who, **versions.describe()} for who, versions in self.processes()]}
