"""Which worker holds which replica, grouped by host: the map the averaging algorithms plan on.

Replicas go to workers in contiguous blocks, host after host (replica ``k`` to worker slot
``k * W // K`` of the ``W`` workers listed host-major), so a host's replicas are consecutive
indices: the subtrees of the fixed addition order (``pipeline.averaging.order``) that a host can
add up locally are then as large as they can be. Hosts and workers are sorted by name, so the
same cluster gives the same placement (IP addresses in numeric order).

>>> p = place({"10.0.0.2": ["tcp://10.0.0.2:9", "tcp://10.0.0.2:8"],
...            "10.0.0.1": ["tcp://10.0.0.1:7"]}, 4)
>>> p.replica_host, p.replica_worker[:2]
((0, 0, 1, 1), ('tcp://10.0.0.1:7', 'tcp://10.0.0.1:7'))
>>> p.replicas_on(1), p.n_hosts
((2, 3), 2)
"""
from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import NamedTuple


def _host_order(name: str) -> tuple:
    """IP addresses in numeric order (10.0.0.9 before 10.0.0.10), then other names."""
    try:
        return (0, int(ipaddress.ip_address(name)), "")
    except ValueError:
        return (1, 0, name)


class Placement(NamedTuple):
    """Replica ``k`` trains on ``replica_worker[k]``, on host ``replica_host[k]``.

    ``hosts[h]`` lists the host's workers that hold replicas (in order of their first replica);
    ``host_names[h]`` is the host's name (its IP address on a real cluster).
    """
    host_names: tuple
    hosts: tuple  # tuple of tuples of worker addresses
    replica_host: tuple
    replica_worker: tuple

    @property
    def n_hosts(self) -> int:
        return len(self.hosts)

    @property
    def n_replicas(self) -> int:
        return len(self.replica_host)

    def replicas_on(self, host: int) -> tuple:
        return tuple(k for k, h in enumerate(self.replica_host) if h == host)

    def replicas_per_host(self) -> tuple:
        return tuple(len(self.replicas_on(h)) for h in range(self.n_hosts))

    def host_worker(self, host: int) -> str:
        """The worker that holds a host's shared copies (that of its first replica)."""
        return self.replica_worker[self.replicas_on(host)[0]]

    def units(self) -> tuple:
        """The groups that shards are spread over: hosts, or on a single host its workers
        (each process reduces its own shard there)."""
        if self.n_hosts > 1:
            return self.hosts
        return tuple((w,) for w in self.hosts[0])


def place(workers_by_host: Mapping[str, Sequence[str]], replicas: int) -> Placement:
    """Place ``replicas`` replicas on the workers of ``{host name: [worker address, ...]}``."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    slots = [(host, worker) for host in sorted(workers_by_host, key=_host_order)
             for worker in sorted(workers_by_host[host])]
    if not slots:
        raise ValueError("cannot place replicas: the cluster has no workers")
    chosen = [slots[k * len(slots) // replicas] for k in range(replicas)]
    names = list(dict.fromkeys(host for host, _ in chosen))
    hosts = [tuple(dict.fromkeys(w for h, w in chosen if h == name)) for name in names]
    return Placement(tuple(names), tuple(hosts), tuple(names.index(h) for h, _ in chosen),
                     tuple(w for _, w in chosen))
