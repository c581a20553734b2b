"""The framework seam: what a task asks of a deep-learning framework, and the registry of backends.

Tasks (``pipeline.training.tasks``) speak only this interface, with host NumPy state dicts in and out and
neutral device names (``"cpu"``, ``"gpu"``: the worker's one GPU). Chainer is the one backend
today (``pipeline.backends.chainer.backend``); another framework is one module implementing ``Backend``
plus its line in ``BACKENDS``.
"""
from __future__ import annotations

import importlib
from typing import Any, ContextManager, NamedTuple, Protocol

import numpy as np

State = dict  # dict[str, np.ndarray], keyed by the framework's parameter paths ("conv1/W")

DEVICES = ("cpu", "gpu")
BACKENDS = {"chainer": "pipeline.backends.chainer.backend"}  # name -> module exposing BACKEND


class ModelRef(NamedTuple):
    """A model the registry does not name: the user's factory (or one of the framework's own
    architectures) with its keyword arguments, checked on the driver and shipped to the tasks.

    ``factory`` travels with the task (cloudpickle: a class from ``__main__`` or from a module
    outside site-packages by value, an installed package's by reference); ``token`` identifies
    the built model in a worker's per-thread cache, so a factory pickled by value is built once
    per thread and not once per task. ``path`` is what ``config.json`` records
    (``"pkg.module:factory"``), ``args`` the keyword arguments as JSON text, ``size`` the
    (H, W) the model was checked at (lazily sized parameters are materialised there)."""
    path: str
    factory: Any
    args: str  # JSON object: keyword arguments of the factory
    size: tuple  # (H, W) of the data's images
    takes_n_classes: bool  # the factory accepts n_classes=
    token: str  # hash of (path, args, size, pickled factory)
    global_rng: bool = True  # may draw from Chainer's / NumPy's global RNG (F.dropout, initializers)


class OptimizerRef(NamedTuple):
    """The user's optimizer: a factory checked on the driver and called in every task that
    steps (``train(config, optimizer=...)``). It takes no argument and returns an optimizer the
    task sets up on the replica's model, or takes the model and returns an optimizer set up on
    it, hooks added (``takes_link``). ``factory`` travels like ``ModelRef.factory``; ``path`` is
    what ``config.json`` records in ``train.optimizer``; ``lr`` the learning rate (Adam's alpha)
    the factory gave it, the base of the run's schedule (``train.lr``), None when it has none."""
    path: str
    factory: Any
    takes_link: bool
    lr: float | None


def model_label(model) -> str:
    """The name a log line or a title gives a model: its registry name or its import path.

    >>> model_label("small-cnn")
    'small-cnn'
    """
    return model if isinstance(model, str) else model.path


class StepStats(NamedTuple):
    """What a run of local steps reports: summed loss, correct predictions, images, finiteness."""
    loss_sum: float
    correct: int
    n: int
    finite: bool


class Backend(Protocol):
    """Per-task operations on host state dicts; ``spec`` is a ``tasks.StepSpec``/``EvalSpec``.

    The driver's side (the loop, ``load_model``, ``evaluate``) asks it for the model too, so
    nothing outside the backend imports the framework's models or state code."""

    def model_names(self) -> tuple[str, ...]:
        """The models the backend builds by name (its registry)."""

    def resolve_model(self, name: str, args: str, factory: Any, size: tuple,
                      n_classes: int, train: Any = None,
                      optimizer: "OptimizerRef | None" = None) -> "str | ModelRef":
        """The model a run trains: a registry name as it is, else a ``ModelRef`` for ``factory``
        (a callable, or an import path ``"pkg.module:factory"`` the user named: imported here)
        or for one of the framework's own architectures, checked by one dry forward of a tiny
        batch at ``size`` and, with ``train`` (the config's train section), one training step
        with its optimizer (``optimizer``: the user's); UsageError (one line) naming what
        failed, also for ``args`` given to a built-in model. ``name`` from a config file alone is never imported."""

    def resolve_optimizer(self, factory: Any, train: Any) -> OptimizerRef:
        """The user's optimizer (a callable, or an import path the user named: imported here),
        checked by one update of a small model; UsageError (one line) naming what failed, also
        for ``train`` (the config's train section) settings that only an optimizer by name
        takes (weight decay, clipping, its arguments: hooks and arguments of the factory)."""

    def gpu_report(self) -> tuple[str | None, str]:
        """On a worker: (None, one line on the framework's CUDA stack), or (why it cannot use
        the GPU there, "")."""

    def check_optimizer(self, train: Any) -> None:
        """UsageError (one line) when ``train`` (the config's train section) names an optimizer
        the framework lacks, or arguments it does not take; before any cluster starts."""

    def check_model(self, model: "str | ModelRef") -> "str | ModelRef":
        """``model`` if the backend builds it, else ValueError naming the field and the choices."""

    def to_model(self, model: str, n_classes: int, params: State) -> Any:
        """The framework's model object (a Chainer Link) holding ``params``, on the host."""

    def load_weights(self, model: str, n_classes: int, path: str) -> State:
        """The state dict in the weights file ``path`` (a ``model.npz``), checked against the
        model's names, shapes and dtypes before any data is read: ``npz.Mismatch`` when they
        differ, ``DataError`` when it is not a readable file."""

    def init_params(self, model: str, n_classes: int, seed: int) -> State:
        """The initial weights every replica starts from (drawn from the run's "init" stream)."""

    def train_steps(self, params: State, opt_state: State | None, images: np.ndarray,
                    labels: np.ndarray, spec: Any, rng: np.random.Generator
                    ) -> tuple[State, State, StepStats]:
        """``len(spec.lrs)`` optimizer steps of ``spec.batch_size`` images (uint8 NCHW) each;
        ``opt_state`` None starts a fresh optimizer. Returns new params, optimizer state, stats.
        Optimizer state is keyed ``"<param>/<slot>"`` (float, the parameter's shape) or is an
        integer counter (``"t"``, ``"<param>/t"``): checkpoints and averages rely on it."""

    def gradient(self, params: State, images: np.ndarray, labels: np.ndarray, spec: Any,
                 rng: np.random.Generator) -> tuple[State, StepStats]:
        """The mean-loss gradient of every trainable parameter on the whole batch, plus the
        persistent statistics (BatchNorm) as this forward pass updated them."""

    def apply_gradient(self, params: State, opt_state: State | None, gradient: State,
                       spec: Any) -> tuple[State, State]:
        """One optimizer step with ``gradient``; its non-trainable float entries replace the
        params' (BatchNorm statistics). Returns new params and optimizer state."""

    def predict(self, params: State, images: np.ndarray, spec: Any) -> np.ndarray:
        """(N, 3, H, W) uint8 -> (N, classes) float32 softmax probabilities."""

    def export_onnx(self, params: State, spec: Any, side: int, metadata: dict) -> bytes:
        """The serialized ONNX model of ``spec.model`` holding ``params`` on ``side`` x ``side``
        images: input ``pixels`` float32 (N, 3, side, side), 0-255, normalised with
        ``spec.mean``/``spec.std`` inside; outputs ``probabilities`` and ``logits`` (N,
        classes); ``metadata`` (string values) in its metadata_props. UsageError (one line)
        naming a function with no ONNX form."""

    def using_threads(self, threads: int, spec: Any) -> ContextManager[int]:
        """A block in which the task's work runs on ``threads`` cores (its share of its
        worker's), split as the framework does it best; the BLAS/OpenMP pools go through
        ``pipeline.core.threads.limit_blas_threads``. Yields ``threads``."""


def get_backend(name: str = "chainer") -> Backend:
    """The backend registered as ``name`` (``model.backend``; imported on first use, so pure
    callers stay light)."""
    if name not in BACKENDS:
        raise ValueError(f"model.backend must be one of {sorted(BACKENDS)}, got {name!r}")
    return importlib.import_module(BACKENDS[name]).BACKEND


def check_device(device: str) -> str:
    """A neutral device name, checked.

    >>> check_device("gpu")
    'gpu'
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    return device
