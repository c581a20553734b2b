"""``gradient``: synchronous distributed gradient. K replicas' gradients are averaged (weighted by
samples) by the run's averaging algorithm and one ``update-`` task next to replica 0 takes the
optimizer step, whose parameters the algorithm broadcasts: step for step the same as ``single``
with batch K x B."""
from __future__ import annotations

from pipeline.training import tasks
from pipeline.training.strategies.base import Live, Strategy, Submitted


class Gradient(Strategy):
    name = "gradient"
    stages = ("load", "augment", "train", "average", "update", "evaluate")

    @classmethod
    def period_of(cls, config, per_epoch):
        return 1  # every step is a reduction

    def shared_opts(self):
        """One optimizer state, the update- task's, for every replica."""
        return True

    def scatter(self, state):
        live = super().scatter(state)
        if state.opts[0] is not None:  # one optimizer state, read by replica 0's update only
            live = live._replace(opts=[self.graph.scatter(state.opts[0], replica=0)] * self.K)
        return live

    def submit_round(self, rnd, live, shard):
        g = self.graph
        outs = self.train_replicas(rnd, [live.params[0]] * self.K, [None] * self.K, shard,
                                   mode="gradient")
        mean = g.mean(rnd.index, [o.params for o in outs])
        params, opt = g.submit(tasks.update, live.params[0], live.opts[0], mean,
                               self.ctx.spec(rnd, 0), stage="update", coords=(rnd.index,),
                               fields=("params", "opt"), train=True, pin=0)
        return Submitted(Live(g.broadcast(rnd.index, params), [opt] * self.K),
                         [o.metrics for o in outs])

    def bytes_averaged(self, rnd):
        return self.graph.payload_bytes * self.K
