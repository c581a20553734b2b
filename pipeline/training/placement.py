"""Where an attempt's replicas live: each replica's worker, its share of that worker's threads and
how a task of it is held there, computed from the workers the cluster has then (``place``): once
per attempt, and again at a round boundary where the training workers changed
(``pipeline.training.elastic``); read by the graph builder (``pipeline.training.graph``) as a
value.

Placement decides where tasks run, never what they compute: the bits are the same wherever the
replicas are (the BLAS thread count each caps itself at is its share, the same for every replica
of a worker, so K replicas as threads of one K-thread worker round as K one-thread workers do).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pipeline.averaging.algorithms import Plan
    from pipeline.core.config import Config


class Placement(NamedTuple):
    """One attempt's placement of its replicas."""
    homes: tuple  # replica k -> the worker address it lives on, or None: anywhere
    threads: tuple  # replica k -> threads of its tasks (0: the worker's, decided in the task)
    ranks: dict  # worker address -> its RANK-i resource, where the training workers have ranks
    pin_unsafe: bool  # some worker lacks the train resources: resource-bound tasks are held to
    #                   their home by its rank, not by a soft pin (see ``pinned``)
    augment_anywhere: bool  # every worker offers the augment resources: augment- tasks may
    #                         run on their replica's worker

    def home(self, replica: int) -> str | None:
        return self.homes[replica]

    def pinned(self, replica: int, resources: dict | None = None) -> dict:
        """``submit`` arguments of a task of replica k that asks for ``resources``: a soft
        preference for its home, so a lost worker's replica moves on. A soft pin lets
        distributed fall back to any worker, resources notwithstanding (work stealing hands the
        task to an idle thief, ``WorkStealing._get_thief``; ``decide_worker`` once the pinned
        worker is gone), and a worker without the resource then fails on it (``KeyError:
        'TRAIN'``, seen in CI beside a loader). So where some worker lacks the train resources
        a resource-bound task is held by its home's ``RANK-i`` instead (a restarted worker keeps
        it), and left to the resources alone where the workers advertise no ranks.

        >>> p = Placement(("a", "b"), (1, 1), {"b": "RANK-1"}, True, True)
        >>> p.pinned(0), p.pinned(1, {"TRAIN": 1}), p.pinned(0, {"TRAIN": 1})
        ({'resources': None, 'workers': ['a'], 'allow_other_workers': True}, {'resources': {'TRAIN': 1, 'RANK-1': 1}}, {'resources': {'TRAIN': 1}})
        """
        home = self.homes[replica]
        if home is None:
            return {"resources": resources}
        if not resources or not self.pin_unsafe:
            return {"resources": resources, "workers": [home], "allow_other_workers": True}
        rank = self.ranks.get(home)
        return {"resources": {**resources, rank: 1} if rank else resources}

    def augment_where(self, replica: int) -> dict:
        """``submit`` arguments placing replica k's augment- task on its train worker where
        every worker may augment (a soft pin: a lost worker costs placement only); else none."""
        home = self.homes[replica] if self.augment_anywhere else None
        return {"workers": [home], "allow_other_workers": True} if home is not None else {}

    def smallest_share(self) -> int:
        """The threads an evaluate- task gets: any training worker may run one, so the smallest
        replica's share (0 where replicas are not placed)."""
        return min(self.threads) if all(self.threads) else 0


def thread_shares(homes: tuple, nthreads: dict) -> tuple:
    """Each replica's threads: its worker's threads over the replicas placed on that worker (at
    least 1); 0 where not placed.

    >>> thread_shares(("a", "a"), {"a": 2}), thread_shares(("a",), {"a": 2})
    ((1, 1), (2,))
    >>> thread_shares(("a", "b", "a"), {"a": 4, "b": 1}), thread_shares((None,), {})
    ((2, 1, 2), (0,))
    """
    return tuple(0 if h is None else max(1, nthreads.get(h, 1) // homes.count(h)) for h in homes)


def place(client, config: Config, plan: Plan, train_resources: dict | None,
          augment_resources: dict | None) -> Placement:
    """The placement of ``config.train.replicas`` replicas on the workers ``client`` sees now:
    where the averaging plan put them, else with ``cluster.pin_replicas`` replica k on worker
    k mod W of the W workers offering the train resources (by rank where they advertise
    ``RANK-i``, else by worker name), as a rank stays on its GPU; else anywhere."""
    from pipeline.cluster.resources import staying
    info = staying(client.scheduler_info(n_workers=-1)["workers"])  # not the ones retiring
    workers, ranks = _train_workers(client, info, train_resources)
    k = config.train.replicas
    if plan.placement is not None:
        homes = tuple(plan.placement.replica_worker[r] for r in range(k))
    elif config.cluster.pin_replicas and workers:
        homes = tuple(workers[r % len(workers)] for r in range(k))
    else:
        homes = (None,) * k
    nthreads = {a: int(w.get("nthreads") or 1) for a, w in info.items()}
    return Placement(homes, thread_shares(homes, nthreads), ranks,
                     not _everywhere(client, train_resources),
                     _everywhere(client, augment_resources))


def _train_workers(client, info: dict, resources: dict | None) -> tuple[list, dict]:
    """``(addresses, ranks)``: the workers offering ``resources`` in rank order where each
    advertises a ``RANK-i`` (``ranks``: address -> that resource), else by worker name."""
    from pipeline.averaging.algorithms import workers_by_host
    from pipeline.cluster import resources as offers
    able = {a for hosts in workers_by_host(client, resources).values() for a in hosts}
    by_rank = offers.worker_ranks({a: dict(info[a].get("resources") or {})
                                   for a in able if a in info})
    if by_rank and set(by_rank.values()) == able:
        return list(by_rank.values()), {a: offers.rank_resource(r) for r, a in by_rank.items()}
    by_name = sorted(info.items(), key=lambda w: str(w[1]["name"]))
    return [a for a, _ in by_name if a in able], {}


def _everywhere(client, resources: dict | None) -> bool:
    """Whether every worker offers ``resources`` (a soft pin of a task asking for them cannot
    then land on a worker without them; see ``Placement.pinned``)."""
    from pipeline.averaging.algorithms import workers_by_host
    if not resources:
        return True
    def offering(need):
        return sum(len(workers) for workers in workers_by_host(client, need).values())
    return offering(resources) >= offering(None)
