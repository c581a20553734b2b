"""What every strategy provides to the driver's loop, and the context it builds tasks from.

The loop asks a strategy, per round: ``submit_round`` (the round's tasks, given the state
futures after the previous round: a value the loop hands back each round, never kept on the
strategy), ``model`` (the future of the weights a user would get if the run stopped here) and,
at checkpoints, ``gather``/``scatter`` between futures and a host ``HostState``. Strategies
build tasks only through the ``RoundGraph`` they are given (one per attempt: a replay gets a
fresh one with a fresh key token), so they import no dask.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from pipeline.core.state import HostState
from pipeline.core.schedule import Round, learning_rate
from pipeline.training.strategies.policy import Policy
from pipeline.training.tasks import EvalSpec, StepSpec

if TYPE_CHECKING:
    from pipeline.training.graph import RoundGraph, Trained


class Context(NamedTuple):
    """What a strategy needs to know about the run besides the graph."""
    config: Any  # pipeline.core.config.Config
    replicas: int  # K
    n_train: int  # training images
    per_epoch: int  # global steps per epoch (K x B images each)
    n_classes: int
    device: str  # neutral device name of train tasks: cpu | gpu
    plan: tuple = ()  # the run's rounds (a resumed, extended run keeps its finished ones)
    model: Any = None  # what tasks build: a registry name or a backends.ModelRef (None: the
    #                    config's model.name)
    optimizer: Any = None  # the user's backends.OptimizerRef (None: train.optimizer by name)

    @property
    def model_spec(self):
        return self.config.model.name if self.model is None else self.model

    @property
    def warmup_steps(self) -> int:
        return int(round(self.config.train.warmup_epochs * self.per_epoch))

    @property
    def total_steps(self) -> int:
        """Global steps in ``train.epochs`` epochs: the horizon of a decaying learning rate."""
        return int(round(self.config.train.epochs * self.per_epoch))

    def lrs(self, rnd: Round) -> tuple:
        t = self.config.train
        return tuple(learning_rate(t.lr, self.replicas, t.lr_scaling, self.warmup_steps, s,
                                   t.lr_decay, self.total_steps)
                     for s in range(rnd.global_step, rnd.global_step + rnd.steps))

    def spec(self, rnd: Round, replica: int, mode: str = "steps") -> StepSpec:
        t = self.config.train
        optimizer = t.optimizer if self.optimizer is None else self.optimizer
        return StepSpec(self.model_spec, self.n_classes, optimizer, t.momentum,
                        t.weight_decay, self.lrs(rnd), t.batch_size, mode, self.config.seed,
                        rnd.index, replica, self.device, beta1=t.beta1, beta2=t.beta2,
                        eps=t.adam_eps, cpu_kernels=self.config.model.cpu_kernels,
                        optimizer_args=t.optimizer_args, grad_clip=t.grad_clip,
                        displacement=bool(self.config.average.adaptive_outer),
                        backend=self.config.model.backend, precision=t.precision)

    def eval_spec(self) -> EvalSpec:
        return EvalSpec(self.model_spec, self.n_classes, self.config.train.tta,
                        self.device, cpu_kernels=self.config.model.cpu_kernels,
                        backend=self.config.model.backend,
                        precision=self.config.train.precision)


class Live(NamedTuple):
    """Futures of the state between rounds: per-replica params and optimizer state, and the
    strategy's own extra state (ipm: the outer momentum)."""
    params: list
    opts: list
    outer: Any = None  # the strategy's own (ipm: a future of the outer momentum, or None)


class Submitted(NamedTuple):
    """What submitting a round gives the loop."""
    live: Any  # the state after the round (the strategy's own kind of futures)
    metrics: list  # futures of one metric dict per update (replica) of the round
    records: tuple = ()  # host records of the round the strategy logs once it is collected


class Strategy(Policy):
    """Base class: K replicas of local steps, what they share after a round set by ``mix``.
    What it asks of a config before any cluster (check, recipe, plan) is its ``Policy``
    (``policy.py``); this class builds the rounds."""

    def __init__(self, context: Context, graph: RoundGraph,
                 log: Callable[[str], None] | None = None):
        self.ctx, self.graph, self.log = context, graph, log or (lambda message: None)
        self.K = context.replicas

    def period(self) -> int:
        return self.period_of(self.ctx.config, self.ctx.per_epoch)

    def rounds(self) -> list[Round]:
        return self.plan(self.ctx.config, self.ctx.n_train)[0]

    # ---- state --------------------------------------------------------------------------
    def restart(self, anchor: HostState, shard, out, replay: bool) -> None:
        """Called before an attempt starts from ``anchor`` (the start, a resume, or a ``replay``
        after lost work); ``shard(round, i)`` gives shard futures, ``out`` is the RunDir."""

    def initial_state(self, params: dict) -> HostState:
        return HostState(-1, [params] * self.K, [None] * self.K, None)

    def shared(self) -> bool:
        """Whether every replica starts a round from the same parameters."""
        return self.mix == "every"

    def shared_opts(self) -> bool:
        """Whether every replica also starts a round from one optimizer state."""
        return False

    def scatter(self, state: HostState) -> Live:
        """Host state -> futures with no lineage (a fresh root for the rounds that follow)."""
        g = self.graph
        if self.shared() or state.round < 0:  # one copy per host, by the averaging algorithm
            params = g.scatter_shared(state.params[0], state.round + 1)
        else:
            params = [g.scatter(p, replica=k) for k, p in enumerate(state.params)]
        opts = [g.scatter(o, replica=k) if o is not None else None
                for k, o in enumerate(state.opts)]
        outer = g.scatter(state.outer) if state.outer is not None else None
        return Live(params, opts, outer)

    def reroot(self, state: HostState, live) -> Live:
        """At an anchor (``state`` was just gathered from ``live``): the live state to go on
        from, with no lineage before the anchor, so the workers forget the rounds before it
        (docs/reliability.md). Here: ``state`` scattered back as a fresh root."""
        return self.scatter(state)

    def gather(self, round_index: int, live: Live) -> HostState:
        """The host state of ``live``. What the replicas share (``shared``: the params,
        ``shared_opts``: the optimizer state) is fetched once and handed to each, as one future
        would be: where the averaging algorithm left a copy next to each replica (``gather``)
        the copies are the same bits and stay where they are."""
        def one_for_all(values, shared):
            return values[:1] if shared else values
        params, opts, outer = self.graph.gather([one_for_all(live.params, self.shared()),
                                                 one_for_all(live.opts, self.shared_opts()),
                                                 live.outer])
        return HostState(round_index, params * self.K if self.shared() else params,
                         opts * self.K if self.shared_opts() else opts, outer)

    def final_params(self, state: HostState) -> dict:
        """The model's weights in a host state (replica 0's params: the shared ones)."""
        return dict(state.params[0])

    # ---- a round ------------------------------------------------------------------------
    def train_replicas(self, rnd: Round, params: list, opts: list, shard,
                       mode="steps") -> list[Trained]:
        """The K train- tasks of a round: the futures of each replica's (``Trained``)."""
        return [self.graph.submit_train(rnd, k, params[k], opts[k], shard(rnd.index, k),
                                        self.ctx.spec(rnd, k, mode)) for k in range(self.K)]

    def submit_round(self, rnd: Round, live: Live, shard) -> Submitted:
        """Submit round ``rnd`` from ``live``; ``shard(round, i)`` gives the future of the
        i-th shard of a round (submitted on demand)."""
        raise NotImplementedError

    def model(self, rnd: Round, live: Live):
        """Future of the weights after ``rnd`` (what stopping here would give)."""
        return live.params[0]

    def model_copies(self, rnd: Round, live: Live) -> list:
        """Futures of ``model``'s weights, one per replica where the strategy keeps a copy next
        to each (the evaluation reads the one on its worker), else the one future."""
        return [self.model(rnd, live)]

    def bytes_averaged(self, rnd: Round) -> int:
        """Bytes of replica state that entered the round's average (0 when none)."""
        return 0

    def round_fields(self, rnd: Round, metrics: list, records: tuple = ()) -> dict:
        """Extra fields of the round's line in metrics.jsonl, from its updates' ``metrics`` and
        the ``records`` its ``Submitted`` carried."""
        return {}

    def collected(self, rnd: Round, records: tuple = ()) -> None:
        """Called once the round's line is written, with its ``records`` (async logs its
        updates here)."""
