"""``single``: one replica, the baseline every other strategy is compared with."""
from __future__ import annotations

from pipeline.core.errors import UsageError
from pipeline.training.strategies.base import Live, Strategy, Submitted


class Single(Strategy):
    name = "single"
    mix = "never"

    @classmethod
    def check(cls, config) -> None:
        if config.train.replicas != 1:
            raise UsageError("train.replicas must be 1 for strategy single")

    def submit_round(self, rnd, live, shard):
        params, opt, metrics, _ = self.train_replicas(rnd, live.params, live.opts, shard)[0]
        return Submitted(Live([params], [opt], None), [metrics])
