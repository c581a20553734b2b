"""``mixture``: K independent replicas, averaged once after the last round (Parameter Mixture)."""
from __future__ import annotations

from pipeline.training.strategies.base import Live, Strategy, Submitted


class Mixture(Strategy):
    name = "mixture"
    mix = "last"

    def submit_round(self, rnd, live, shard):
        outs = self.train_replicas(rnd, live.params, live.opts, shard)
        params = [o.params for o in outs]
        if rnd.mix:
            params = self.graph.allreduce(rnd.index, params)
        return Submitted(Live(params, [o.opt for o in outs]), [o.metrics for o in outs])

    def model(self, rnd, live):
        """Mid-run, the replicas' average: what stopping here would give."""
        if rnd.mix or self.K == 1:
            return live.params[0]
        return self.graph.mean(rnd.index, live.params)

    def bytes_averaged(self, rnd):
        return self.graph.payload_bytes * self.K if rnd.mix else 0
