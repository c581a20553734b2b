"""The PyTorch side of benchmarks/peer.py: a plain training loop a user would write, run by the
Python of an environment that has torch (``--torch-python``), never imported by ours.

Same nets as pipeline/backends/chainer/models.py (cifar10-2015: 5x5 convs 32-32-64, 3x3/2 max
pools with ceil mode as Chainer's cover_all, spatial pyramid pooling of height 3, fc 4096 with
dropout 0.5; resnet20: He et al. 2016 sec. 4.2), the same initialisers (He normal for
convolutions, LeCun normal for fully connected layers, zero biases), Adam, per-channel
normalisation, and the CIFAR policy (zero-pad 4, random 32x32 crop, horizontal flip) drawn per
batch with NumPy. One process, ``torch.set_num_threads(threads)``. ``--channels-last``: the model
and every input batch in ``torch.channels_last`` memory format; ``--precision bf16``: forward and
loss under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (backward and Adam as autocast leaves
them: float32 weights and gradients), the recipe PyTorch documents for CPU mixed precision.

    python _peer_torch.py train DATA.npz --threads 2 --epochs 20    # curve as one JSON line
    python _peer_torch.py step --model resnet20 --steps 5           # bare steps, images/s
    python _peer_torch.py step --channels-last --precision bf16     # autocast, channels-last

Reads only the .npz that peer.py wrote (``allow_pickle=False``).
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def _init(module: nn.Module) -> None:
    if isinstance(module, nn.Conv2d):
        nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu")
    elif isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, 0.0, 1.0 / math.sqrt(module.in_features))
    if isinstance(module, (nn.Conv2d, nn.Linear)) and module.bias is not None:
        nn.init.zeros_(module.bias)


class Cifar2015(nn.Module):
    def __init__(self, n_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 32, 5, padding=2)
        self.conv3 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc4 = nn.Linear(64 * 21, 4096)
        self.fc5 = nn.Linear(4096, n_classes)
        self.apply(_init)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.conv1(x)), 3, 2, ceil_mode=True)
        h = F.max_pool2d(F.relu(self.conv2(h)), 3, 2, ceil_mode=True)
        h = F.relu(self.conv3(h))
        n = h.shape[0]
        h = torch.cat([F.adaptive_max_pool2d(h, b).reshape(n, -1) for b in (1, 2, 4)], 1)
        h = F.dropout(F.relu(self.fc4(h)), 0.5, self.training)
        return self.fc5(h)


class Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.proj = None
        if stride != 1 or cin != cout:
            self.proj = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, 0, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + (self.proj(x) if self.proj is not None else x))


class ResNet20(nn.Module):
    def __init__(self, n_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.stages = nn.Sequential(*[Basic(cin if i == 0 else cout, cout, stride if i == 0 else 1)
                                      for cin, cout, stride in ((16, 16, 1), (16, 32, 2),
                                                                (32, 64, 2)) for i in range(3)])
        self.fc = nn.Linear(64, n_classes)
        self.apply(_init)

    def forward(self, x):
        h = self.stages(F.relu(self.bn1(self.conv1(x))))
        return self.fc(h.mean((2, 3)))


MODELS = {"cifar10-2015": Cifar2015, "resnet20": ResNet20}


def pad_crop_flip(images: np.ndarray, rng: np.random.Generator, pad: int = 4) -> np.ndarray:
    """The CIFAR policy on a uint8 (n, 3, h, w) batch: zero pad, random crop, flip half."""
    n, _, h, w = images.shape
    padded = np.pad(images, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    dy, dx = rng.integers(0, 2 * pad + 1, n), rng.integers(0, 2 * pad + 1, n)
    rows = dy[:, None] + np.arange(h)
    cols = dx[:, None] + np.arange(w)
    out = padded[np.arange(n)[:, None, None, None], np.arange(3)[None, :, None, None],
                 rows[:, None, :, None], cols[:, None, None, :]]
    flip = rng.random(n) < 0.5
    out[flip] = out[flip, :, :, ::-1]
    return out


def normalize(images: np.ndarray, mean, std, layout=torch.contiguous_format) -> torch.Tensor:
    """(n, 3, h, w) uint8 -> float32 of the same shape, in ``layout``'s memory format."""
    x = torch.from_numpy(np.ascontiguousarray(images)).float()
    x = (x - torch.tensor(mean).view(1, -1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1)
    return x.contiguous(memory_format=layout)


class Recipe:
    """How a loop runs the net: its inputs' memory format and the autocast around the forward."""

    def __init__(self, channels_last: bool, precision: str):
        self.layout = torch.channels_last if channels_last else torch.contiguous_format
        self.bf16 = precision == "bf16"

    def prepare(self, model: nn.Module) -> nn.Module:
        return model.to(memory_format=self.layout)

    def autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16)


def accuracy(model, images, labels, mean, std, recipe: Recipe, batch: int = 500) -> float:
    model.eval()
    right = 0
    with torch.no_grad(), recipe.autocast():
        for lo in range(0, len(images), batch):
            logits = model(normalize(images[lo:lo + batch], mean, std, recipe.layout))
            right += int((logits.argmax(1).numpy() == labels[lo:lo + batch]).sum())
    model.train()
    return right / len(images)


def train(a) -> dict:
    with np.load(a.data, allow_pickle=False) as z:
        x, y, xt, yt = z["x_train"], z["y_train"].astype(np.int64), z["x_test"], z["y_test"]
        mean, std = z["mean"].tolist(), z["std"].tolist()
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    recipe = Recipe(a.channels_last, a.precision)
    model = recipe.prepare(MODELS[a.model](int(max(y.max(), yt.max())) + 1))
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    start, curve, steps = time.perf_counter(), [], len(x) // a.batch_size
    for epoch in range(1, a.epochs + 1):
        order = rng.permutation(len(x))
        for s in range(steps):
            idx = order[s * a.batch_size:(s + 1) * a.batch_size]
            batch = normalize(pad_crop_flip(x[idx], rng), mean, std, recipe.layout)
            with recipe.autocast():
                loss = F.cross_entropy(model(batch), torch.from_numpy(y[idx]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        acc = accuracy(model, xt, yt, mean, std, recipe)
        curve.append([epoch, round(acc, 4), round(time.perf_counter() - start, 2)])
        print(f"torch {a.threads}t epoch {epoch} test_acc {acc:.4f} "
              f"{curve[-1][2]:.1f} s", flush=True)
    return {"curve": curve, "images_per_epoch": steps * a.batch_size}


def step(a) -> dict:
    """Bare training steps on one fixed batch: images/s by the wall and this thread's CPU clock."""
    torch.manual_seed(a.seed)
    recipe = Recipe(a.channels_last, a.precision)
    model = recipe.prepare(MODELS[a.model](10))
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    rng = np.random.default_rng(a.seed)
    x = torch.from_numpy(rng.standard_normal((a.batch_size, 3, 32, 32), np.float32))
    x = x.contiguous(memory_format=recipe.layout)
    t = torch.from_numpy(rng.integers(0, 10, a.batch_size))

    def one():
        with recipe.autocast():
            loss = F.cross_entropy(model(x), t)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    one(), one()  # warm-up: allocator and one-time dispatch
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(a.steps):
        one()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    n = a.steps * a.batch_size
    return {"wall_img_s": n / wall, "cpu_img_s": n / cpu}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["train", "step"])
    p.add_argument("data", nargs="?")
    p.add_argument("--model", default="cifar10-2015", choices=sorted(MODELS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--channels-last", action="store_true",
                   help="model and inputs in torch.channels_last memory format")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: forward and loss under torch.autocast('cpu', torch.bfloat16)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.set_num_interop_threads(1)
    out = train(a) if a.mode == "train" else step(a)
    print(json.dumps({"torch": torch.__version__, "threads": a.threads,
                      "channels_last": a.channels_last, "precision": a.precision, **out}),
          flush=True)


if __name__ == "__main__":
    main()
