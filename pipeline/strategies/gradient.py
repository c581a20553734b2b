"""``gradient``: synchronous distributed gradient. K replicas' gradients are averaged (weighted by
samples) in a tree and one ``update-`` task takes the optimizer step: step for step the same as
``single`` with batch K x B."""
from __future__ import annotations

from pipeline import tasks
from pipeline.strategies.base import Live, Strategy, Submitted


class Gradient(Strategy):
    name = "gradient"
    stages = ("load", "augment", "train", "average", "update", "evaluate")

    @classmethod
    def period_of(cls, config, per_epoch):
        return 1  # every step is a reduction

    def scatter(self, state):
        live = super().scatter(state)
        if state.opts[0] is not None:  # one optimizer state, shared like the params
            live = live._replace(opts=[live.opts[0]] * self.K)
        return live

    def submit_round(self, rnd, live, shard):
        g = self.graph
        outs = self.train_replicas(rnd, [live.params[0]] * self.K, [None] * self.K, shard,
                                   mode="gradient")
        mean = g.tree_mean(rnd.index, [o[0] for o in outs])
        params, opt = g.submit(tasks.update, live.params[0], live.opts[0], mean,
                               self.ctx.spec(rnd, 0), stage="update", coords=(rnd.index,),
                               fields=("params", "opt"), train=True)
        return Submitted(Live([params] * self.K, [opt] * self.K), [o[2] for o in outs])

    def bytes_averaged(self, rnd):
        return self.graph.payload_bytes * self.K
