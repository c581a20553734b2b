"""``ipm``: Iterative Parameter Mixture. Each replica takes H local steps from the shared
parameters, the run's averaging algorithm (``--average``: a tree, or sharded/hierarchical across
hosts) takes their exact mean, and an optional outer optimizer steps on it (DiLoCo's outer
Nesterov momentum) next to replica 0, whose result the algorithm broadcasts. The replicas'
optimizer state is kept, reset or averaged at each mix (``average.optimizer_state``); both live
here, not in the graph or the averaging math.
"""
from __future__ import annotations

from pipeline.averaging import exact
from pipeline.training.strategies.base import Live, Strategy, Submitted

OPT_PREFIX = "opt/"  # optimizer-state entries ride in the averaged payload under this prefix


def pack(result) -> dict:
    """A train result's params plus its optimizer state under ``opt/`` (what "average" mixes).

    >>> import numpy as np
    >>> sorted(pack(({"W": np.ones(1)}, {"W/v": np.ones(1)}, {})))
    ['W', 'opt/W/v']
    """
    params, opt = result[0], result[1]
    return {**params, **{OPT_PREFIX + k: v for k, v in opt.items()}}


def unpack(mean: dict) -> tuple[dict, dict]:
    """Inverse of ``pack``: ``(params, optimizer_state)``."""
    params = {k: v for k, v in mean.items() if not k.startswith(OPT_PREFIX)}
    opt = {k[len(OPT_PREFIX):]: v for k, v in mean.items() if k.startswith(OPT_PREFIX)}
    return params, opt


def gain(previous: dict, mean: dict, metrics: list) -> float:
    """AdaScale's gain ratio for K replicas' displacements (Johnson et al. 2020, "AdaScale SGD"):
    ``E_k ||d_k||^2 / ||mean_k d_k||^2``, in [1, K]. 1 when the replicas moved alike (signal:
    their mean is as long as each), K when their moves are independent noise (the mean is
    sqrt(K) times shorter); so ``gain x mean`` restores single's progress per step where noise
    dominates without overshooting where the signal does.

    >>> import numpy as np
    >>> gain({"W": np.zeros(2)}, {"W": np.float64([0.5, 0])}, [{"delta_sq": 1.0}] * 2)
    2.0
    """
    k = len(metrics)
    spread = sum(m["delta_sq"] for m in metrics) / k
    moved = exact.squared_distance(mean, previous)
    if moved <= 0 or spread <= 0:
        return 1.0
    return float(min(max(spread / moved, 1.0), k))


def average_outer(previous: dict, mean: dict, momentum_buf: dict | None, lr: float,
                  momentum: float, with_opt: bool, metrics: list | None = None) -> tuple:
    """After the tree: split averaged optimizer state off and take the outer optimizer step on
    the replicas' mean (DiLoCo's outer Nesterov momentum; lr 1, momentum 0 is the mean itself).
    With the replicas' ``metrics`` the outer lr is multiplied by their ``gain``.

    Returns ``(params, optimizer_state or None, momentum_buffer or None)``.
    """
    params, opt = unpack(mean) if with_opt else (mean, None)
    if metrics:
        lr = lr * gain({k: previous[k] for k in params}, params, metrics)
    new, buf = exact.outer_step({k: previous[k] for k in params}, params, momentum_buf, lr,
                                    momentum)
    return new, opt, buf


class IPM(Strategy):
    name = "ipm"
    mix = "every"
    # From this many replicas the recipe averages after every step (H = 1). On 5,000 real
    # images (cifar10-2015, batch 100, 20 epochs) K = 8 with H = 1 averaged 0.471 over epochs
    # 16-20 against 0.453 with H = 10 (cut to 6 by the epoch's end), single 0.527; K <= 4 keeps
    # H = 10 (K = 4 on 17,966 images: 0.6 points from single). docs/strategies.md, "K = 2 to 16".
    SYNC_FROM_K = 8

    @classmethod
    def recipe(cls, config) -> dict:
        """The scale-out recipe for K > 1 with Adam (docs/strategies.md): the replicas keep the
        learning rate of one model, reached by a linear warmup over the first epoch, and the
        optimizer state is averaged at each mix so the replicas' Adam moments stay those of one
        model. The outer step stays plain: K times the mean displacement (outer lr K) collapsed
        the cifar10-2015 net to chance in its first epoch.

        No lr scaling: on real CIFAR-10 (cifar10-2015 net, per-replica batch 100, H = 10) x sqrt(K)
        (Malladi et al. 2022) and x K (Goyal et al. 2017) both trailed the unscaled rate at every
        one of the first 4 epochs with K = 4; unscaled, K = 4 ends 20 epochs 0.6 points from
        ``single`` over the last 5 (docs/benchmarks.md). Each replica's Adam step is already
        normalised, and the mean of K local trajectories is a less noisy step of the same size,
        the local-SGD regime of Lin et al. 2018 in which the per-replica batch sets the rate.

        SGD and momentum get no defaults: Goyal et al.'s linear scaling (``--lr-scaling linear``)
        took small-cnn's README example from lr 0.01 to 0.04, next to the 0.05 at which it stays
        at chance. The warmup is a fixed epoch, not a share of the run, so ``--resume --epochs``
        to a longer run still equals that run.

        From ``SYNC_FROM_K`` replicas on, the round is one step (H = 1): at equal epochs K = 8
        takes 1/8 of single's steps, and each of them goes further as the exact mean of K
        steps from the same weights than as the mean of K 6-step trajectories that drifted
        apart; larger steps instead (x sqrt(K), an outer momentum) and a cosine decay each lost
        3-5 points at K = 8 (docs/strategies.md).
        """
        t = config.train
        if t.replicas == 1 or t.optimizer != "adam":
            return {}
        return {"train.lr_scaling": "none", "train.warmup_epochs": 1.0,
                "average.optimizer_state": "average",
                "average.mix_every": "1" if t.replicas >= cls.SYNC_FROM_K else "10"}

    def outer_lr(self, rnd) -> float:
        """The outer lr of a round: 1 -> ``average.outer_lr`` linearly over the outer warmup."""
        avg = self.ctx.config.average
        warm = avg.outer_warmup_epochs * self.ctx.per_epoch
        done = rnd.global_step + rnd.steps
        return avg.outer_lr if done >= warm else 1.0 + (avg.outer_lr - 1.0) * done / warm

    @property
    def opt_mode(self) -> str:
        return self.ctx.config.average.optimizer_state

    def _plain(self) -> bool:
        avg = self.ctx.config.average
        return avg.outer_lr == 1.0 and avg.outer_momentum == 0.0 and not avg.adaptive_outer

    def submit_round(self, rnd, live, shard):
        g, avg = self.graph, self.ctx.config.average
        opts = [None] * self.K if self.opt_mode == "reset" else live.opts
        outs = self.train_replicas(rnd, live.params, opts, shard)
        metrics = [o.metrics for o in outs]
        new_opts = [None] * self.K if self.opt_mode == "reset" else [o.opt for o in outs]
        if self.opt_mode != "average" and self._plain():
            params = g.allreduce(rnd.index, [o.params for o in outs])
            return Submitted(Live(params, new_opts, None), metrics)
        if self._plain():  # the mean of params and optimizer state is the next round's start
            return Submitted(self._unpacked(rnd, g.allreduce(rnd.index, [o.result for o in outs],
                                                             prepare=pack)), metrics)
        if self.opt_mode == "average":  # the whole train results: params and optimizer state
            mean = g.mean(rnd.index, [o.result for o in outs], prepare=pack)
        else:
            mean = g.mean(rnd.index, [o.params for o in outs])
        params, opt, outer = g.submit(average_outer, live.params[0], mean, live.outer,
                                      self.outer_lr(rnd), avg.outer_momentum,
                                      self.opt_mode == "average",
                                      metrics if avg.adaptive_outer else None, stage="average",
                                      coords=(rnd.index, "outer"),
                                      fields=("params", "opt", "momentum"), pin=0)
        if self.opt_mode == "average":
            new_opts = g.broadcast(rnd.index, opt, "opt")
        return Submitted(Live(g.broadcast(rnd.index, params), new_opts,
                              outer if not self._plain() else None), metrics)

    def _unpacked(self, rnd, means: list) -> Live:
        """``Live`` of the replicas' packed means (params and optimizer state, as ``pack``
        made them): each copy split once where it lies (``unpack``, next to the first replica
        that reads it). The plain outer step returns the mean's arrays as they are, so this is
        ``average_outer``'s result bit for bit without its task and broadcasts; where the
        algorithm left a copy on every worker (``gather``) no state crosses after the sums."""
        split = {}
        for k, mean in enumerate(means):
            if mean.key not in split:
                split[mean.key] = self.graph.submit(unpack, mean, stage="average",
                                                    coords=(rnd.index, "unpack", k),
                                                    fields=("params", "opt"), pin=k)
        parts = [split[m.key] for m in means]
        return Live([p[0] for p in parts], [p[1] for p in parts], None)

    def shared_opts(self):
        """An averaged optimizer state is the replicas' one state, like the params."""
        return self.opt_mode == "average"

    def model_copies(self, rnd, live):
        """Every replica starts the next round from the same mean: its copies, each on its
        replica's worker (one future K times where the algorithm leaves one)."""
        return list(live.params)

    def scatter(self, state):
        live = super().scatter(state)
        if self.shared_opts() and state.opts[0] is not None:  # one copy per host, like the params
            live = live._replace(opts=self.graph.scatter_shared(state.opts[0], state.round + 1,
                                                                "scatter-opt"))
        return live

    @classmethod
    def average_payload(cls, config, param_bytes):
        if config.train.replicas == 1:
            return 0
        return param_bytes * (2 if config.average.optimizer_state == "average" else 1)

    def bytes_averaged(self, rnd):
        per_replica = self.graph.payload_bytes * (2 if self.opt_mode == "average" else 1)
        return int(per_replica * self.K)
