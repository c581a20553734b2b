"""Model definitions by name: Chainer Chains that map (N, 3, H, W) float32 to (N, classes) logits.

Every model runs at any input size of at least 16 x 16 (CIFAR's 32, image folders' --image-size):
spatial pyramid pooling (cifar10-2015), global average pooling (resnet20) or average pooling to a
fixed grid (4 x 4 in small-cnn, the 32 x 32 input of wide-mlp) make the classifier's input
independent of it, so a model's
parameters are the same at every size and 32 x 32 runs exactly as before.

Models hold no training logic. Randomness is explicit: initial weights come from the RandomState
given to the constructor (Chainer initializers take one), dropout masks from a numpy Generator
passed to the call, so a replica never touches NumPy's global RNG.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from pipeline.backends.chainer import cpu_kernels as K
from pipeline.backends.chainer.compat import F, L, chainer
from pipeline.core.rng import counter_uniform

I = chainer.initializers


def _dropout(x, ratio: float, rng: np.random.Generator | None):
    """Dropout whose mask is computed on x's device from one key drawn from ``rng`` (train mode).

    The key is the only host draw; ``counter_uniform`` gives NumPy and CuPy the same mask bits,
    so a GPU replica neither draws 400 k numbers on the host nor copies a mask up each step.
    """
    if not chainer.config.train or ratio == 0:
        return x
    if rng is None:
        raise ValueError("dropout in train mode needs an explicit rng")
    xp = chainer.backend.get_array_module(x)
    u = counter_uniform(xp, int(rng.integers(1 << 63)), x.shape)
    mask = (u >= np.float32(ratio)).astype(np.float32) * np.float32(1 / (1 - ratio))
    return F.dropout(x, ratio, mask=mask)


class Cifar2015(chainer.Chain):
    """The CIFAR-10 net of mitmul's chainer-cifar10 (github.com/mitmul/chainer-cifar10,
    ``models/Cifar10.py``, 2015) ported to Chainer 7, with spatial pyramid pooling (He et al.,
    "Spatial Pyramid Pooling in Deep Convolutional Networks", 2014).

    conv 5x5 32-32-64 with 3x3/2 max-pools, spatial pyramid pooling (height 3: 64 x (1+4+16) =
    1344 features), fc 4096 with dropout 0.5, fc classes. 5.6 M parameters, 22 MB in float32.
    """

    def __init__(self, n_classes: int = 10, rng: np.random.RandomState | None = None):
        super().__init__()
        he = dict(initialW=I.HeNormal(rng=rng))
        with self.init_scope():
            self.conv1 = K.Convolution2D(3, 32, 5, stride=1, pad=2, **he)
            self.conv2 = K.Convolution2D(32, 32, 5, stride=1, pad=2, **he)
            self.conv3 = K.Convolution2D(32, 64, 5, stride=1, pad=2, **he)
            self.fc4 = L.Linear(1344, 4096, initialW=I.LeCunNormal(rng=rng))
            self.fc5 = L.Linear(4096, n_classes, initialW=I.LeCunNormal(rng=rng))

    def forward(self, x, rng: np.random.Generator | None = None):
        h = K.max_pooling_2d(F.relu(self.conv1(x)), 3, stride=2)
        h = K.max_pooling_2d(F.relu(self.conv2(h)), 3, stride=2)
        h = F.relu(self.conv3(h))
        h = K.spatial_pyramid_pooling_2d(h, 3, pooling="max")
        h = _dropout(F.relu(self.fc4(h)), 0.5, rng)
        return self.fc5(h)


class SmallCNN(chainer.Chain):
    """A small fast net for CPU tests and demos: three 3x3 convs (16-32-32) with pooling to 4 x 4,
    one fc.

    No BatchNorm and no dropout, so a step depends only on the data and the weights: the tests
    that compare strategies step for step use it. 15 k parameters.
    """

    def __init__(self, n_classes: int = 10, rng: np.random.RandomState | None = None):
        super().__init__()
        he = dict(initialW=I.HeNormal(rng=rng))
        with self.init_scope():
            self.conv1 = K.Convolution2D(3, 16, 3, pad=1, **he)
            self.conv2 = K.Convolution2D(16, 32, 3, pad=1, **he)
            self.conv3 = K.Convolution2D(32, 32, 3, pad=1, **he)
            self.fc = L.Linear(32 * 4 * 4, n_classes, initialW=I.LeCunNormal(rng=rng))

    def forward(self, x, rng: np.random.Generator | None = None):
        h = K.max_pooling_2d(F.relu(self.conv1(x)), 2)  # 16 x 16 (of a 32 x 32 input)
        h = K.max_pooling_2d(F.relu(self.conv2(h)), 2)  # 8 x 8
        return self.fc(_average_to(F.relu(self.conv3(h)), 4))  # 4 x 4 at any input size


def _average_to(h, side: int):
    """Average pooling of (N, C, H, W) to (N, C, side, side): one pooling op when H and W are
    multiples of ``side`` (at 32 x 32 inputs exactly the original 2 x 2 pooling), else adaptive
    bins as in PyTorch's AdaptiveAvgPool2d (bin i spans floor(i*H/side) .. ceil((i+1)*H/side))."""
    height, width = h.shape[2:]
    if height % side == 0 and width % side == 0:
        k = (height // side, width // side)
        return h if k == (1, 1) else K.average_pooling_2d(h, k)
    rows = [(i * height // side, -(-(i + 1) * height // side)) for i in range(side)]
    cols = [(j * width // side, -(-(j + 1) * width // side)) for j in range(side)]
    cells = [F.mean(h[:, :, r0:r1, c0:c1], axis=(2, 3)) for r0, r1 in rows for c0, c1 in cols]
    return F.reshape(F.stack(cells, axis=2), (h.shape[0], h.shape[1], side, side))


class _Basic(chainer.Chain):
    """ResNet basic block: conv-BN-ReLU-conv-BN plus a 1x1 projection shortcut when shapes change."""

    def __init__(self, cin: int, cout: int, stride: int, rng):
        super().__init__()
        he = dict(initialW=I.HeNormal(rng=rng), nobias=True)
        with self.init_scope():
            self.conv1 = K.Convolution2D(cin, cout, 3, stride, 1, **he)
            self.bn1 = K.BatchNormalization(cout)
            self.conv2 = K.Convolution2D(cout, cout, 3, 1, 1, **he)
            self.bn2 = K.BatchNormalization(cout)
            if stride != 1 or cin != cout:
                self.proj = K.Convolution2D(cin, cout, 1, stride, 0, **he)
                self.bnp = K.BatchNormalization(cout)

    def forward(self, x):
        h = self.bn1(self.conv1(x), relu=True)  # F.relu(bn1(...)) in its passes: the same bits
        h = self.bn2(self.conv2(h))
        shortcut = self.bnp(self.proj(x)) if hasattr(self, "proj") else x
        return K.add_relu(h, shortcut)  # F.relu(h + shortcut)


class ResNet20(chainer.Chain):
    """The classic CIFAR ResNet-20 (He et al. 2016, sec. 4.2): 3 stages x 3 basic blocks, 16-32-64
    channels, BatchNorm, global average pooling. 0.27 M parameters."""

    def __init__(self, n_classes: int = 10, rng: np.random.RandomState | None = None,
                 blocks: int = 3):
        super().__init__()
        with self.init_scope():
            self.conv1 = K.Convolution2D(3, 16, 3, 1, 1, nobias=True, initialW=I.HeNormal(rng=rng))
            self.bn1 = K.BatchNormalization(16)
            self.stages = chainer.ChainList(*[
                _Basic(cin if i == 0 else cout, cout, stride if i == 0 else 1, rng)
                for cin, cout, stride in ((16, 16, 1), (16, 32, 2), (32, 64, 2))
                for i in range(blocks)])
            self.fc = L.Linear(64, n_classes, initialW=I.LeCunNormal(rng=rng))

    def forward(self, x, rng: np.random.Generator | None = None):
        h = self.bn1(self.conv1(x), relu=True)
        for block in self.stages:
            h = block(h)
        return self.fc(F.mean(h, axis=(2, 3)))


class WideMLP(chainer.Chain):
    """A 100 MB state for communication experiments: 3072-3712-3712-classes, ReLU, 25.2 M
    parameters, 100.9 MB in float32 (ChainerMN's ResNet-50 benchmark averages 102.2 MB). About 150 MFLOP
    per image forward and backward, so its rounds on a CPU are short next to moving 100 MB
    between hosts (benchmarks/scale_out.py)."""

    def __init__(self, n_classes: int = 10, rng: np.random.RandomState | None = None,
                 width: int = 3712):
        super().__init__()
        with self.init_scope():
            self.fc1 = L.Linear(3 * 32 * 32, width, initialW=I.HeNormal(rng=rng))
            self.fc2 = L.Linear(width, width, initialW=I.HeNormal(rng=rng))
            self.fc3 = L.Linear(width, n_classes, initialW=I.LeCunNormal(rng=rng))

    def forward(self, x, rng: np.random.Generator | None = None):
        h = F.relu(self.fc1(_average_to(x, 32)))  # 32 x 32 at any input size
        return self.fc3(F.relu(self.fc2(h)))


MODELS: dict[str, Callable[..., chainer.Chain]] = {
    "cifar10-2015": Cifar2015,
    "resnet20": ResNet20,
    "small-cnn": SmallCNN,
    "wide-mlp": WideMLP,
}


def check_model_name(name: str) -> str:
    if name not in MODELS:
        raise ValueError(f"model.name must be one of {sorted(MODELS)}, got {name!r}")
    return name


class _Blank:
    """An ``rng`` for Chainer's initializers that draws nothing: zeros of the shape asked for."""

    def normal(self, loc=0.0, scale=1.0, size=None):
        return np.zeros(size, np.float32)

    def uniform(self, low=0.0, high=1.0, size=None):
        return np.zeros(size, np.float32)


def build_model(name: str, n_classes: int = 10, seed: int | None = None,
                blank: bool = False) -> chainer.Chain:
    """A fresh model. ``seed`` fixes its initial weights (the run's 'init' stream); None draws
    them from a throwaway generator. ``blank``: zeros, nothing drawn, for a Link whose every
    weight is loaded right after (cifar10-2015's 5.6 M draws took 0.26 s on the driver at the
    end of every run, and 0.1-0.14 s in each worker's first train- task).

    >>> a, b = build_model("small-cnn", seed=1), build_model("small-cnn", seed=1)
    >>> bool((a.conv1.W.array == b.conv1.W.array).all())
    True
    >>> float(abs(build_model("small-cnn", blank=True).conv1.W.array).max())
    0.0
    """
    from pipeline.core.rng import legacy_state_for
    check_model_name(name)
    rng = _Blank() if blank else legacy_state_for(seed if seed is not None else 0, "init")
    model = MODELS[name](n_classes=n_classes, rng=rng)
    # Lazily initialised parameters would draw later from the global RNG: materialise them now.
    with chainer.using_config("train", False), chainer.no_backprop_mode():
        model(np.zeros((1, 3, 32, 32), np.float32))
    return model


def count_parameters(model: chainer.Link) -> int:
    return int(sum(p.size for p in model.params()))
