"""A second framework in a few lines: the test that a backend is its module plus one line in
``pipeline.backends.BACKENDS``. One model, ``toy-linear``: softmax regression on each image's
per-channel means, NumPy only, momentum SGD; nothing of Chainer's."""
from __future__ import annotations

import contextlib

import numpy as np

from pipeline.backends import StepStats
from pipeline.core import npz
from pipeline.core.errors import UsageError
from pipeline.core.rng import rng_for

MODELS = ("toy-linear",)


def _features(images: np.ndarray) -> np.ndarray:
    """(N, 3, H, W) uint8 -> (N, 3) float64 channel means in [0, 1]."""
    return images.reshape(len(images), images.shape[1], -1).mean(axis=2) / 255.0


def _proba(params: dict, x: np.ndarray) -> np.ndarray:
    logits = x @ params["W"].astype(np.float64) + params["b"].astype(np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    e = np.exp(logits)
    return e / e.sum(axis=1, keepdims=True)


def _loss_grad(params: dict, images, labels) -> tuple[float, int, dict]:
    x = _features(images)
    p = _proba(params, x)
    n = len(labels)
    loss = float(-np.log(np.clip(p[np.arange(n), labels], 1e-12, None)).sum())
    correct = int((p.argmax(axis=1) == labels).sum())
    d = p.copy()
    d[np.arange(n), labels] -= 1
    return loss, correct, {"W": (x.T @ d / n).astype(np.float32),
                           "b": (d.sum(axis=0) / n).astype(np.float32)}


def _slots(velocity: dict) -> dict:
    """Optimizer state as every backend keys it: "<param>/<slot>" (checkpoints check them)."""
    return {f"{k}/v": v for k, v in velocity.items()}


class ToyBackend:
    name = "toy"

    def model_names(self):
        return MODELS

    def check_model(self, model):
        if model not in MODELS:
            raise ValueError(f"model.name must be one of {MODELS}, got {model!r}")
        return model

    def resolve_model(self, name, args, factory, size, n_classes, train=None):
        if factory is not None:
            raise UsageError("the toy backend builds no user models")
        return self.check_model(name)

    def gpu_report(self):
        return "the toy backend runs on CPUs only", ""

    def check_optimizer(self, train):
        if train.optimizer != "momentum":
            raise UsageError(f"the toy backend has momentum SGD only, not {train.optimizer}")

    def init_params(self, model, n_classes, seed):
        rng = rng_for(seed, "init")
        return {"W": rng.normal(0, 0.01, (3, n_classes)).astype(np.float32),
                "b": np.zeros(n_classes, np.float32)}

    def to_model(self, model, n_classes, params):
        return dict(params)  # the toy's "model object" is its state dict

    def load_weights(self, model, n_classes, path):
        expected = {k: npz.Spec(v.shape, v.dtype)
                    for k, v in self.init_params(model, n_classes, 0).items()}
        return npz.read(path, expected)

    def train_steps(self, params, opt_state, images, labels, spec, rng):
        params = {k: v.copy() for k, v in params.items()}
        velocity = {k: (opt_state or {}).get(f"{k}/v", np.zeros_like(v)) for k, v in params.items()}
        loss_sum = correct = n = 0
        for step, lr in enumerate(spec.lrs):
            lo = step * spec.batch_size
            x, y = images[lo:lo + spec.batch_size], labels[lo:lo + spec.batch_size]
            loss, right, grads = _loss_grad(params, x, y)
            for k in params:
                velocity[k] = (spec.momentum * velocity[k] - lr * grads[k]).astype(np.float32)
                params[k] = params[k] + velocity[k]
            loss_sum, correct, n = loss_sum + loss, correct + right, n + len(y)
        finite = all(np.isfinite(v).all() for v in params.values())
        return params, _slots(velocity), StepStats(loss_sum, correct, n, finite)

    def gradient(self, params, images, labels, spec, rng):
        loss, correct, grads = _loss_grad(params, images, labels)
        return grads, StepStats(loss, correct, len(labels), True)

    def apply_gradient(self, params, opt_state, gradient, spec):
        velocity = {k: (opt_state or {}).get(f"{k}/v", np.zeros_like(v)) for k, v in params.items()}
        velocity = {k: (spec.momentum * velocity[k] - spec.lrs[0] * gradient[k])
                    .astype(np.float32) for k in params}
        return {k: params[k] + velocity[k] for k in params}, _slots(velocity)

    def predict(self, params, images, spec):
        return _proba(params, _features(images)).astype(np.float32)

    @contextlib.contextmanager
    def using_threads(self, threads, spec):
        yield threads


BACKEND = ToyBackend()
