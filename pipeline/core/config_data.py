"""The config sections of what is trained: ``data`` (the source and how images are read),
``augment`` (the training images' augmentation) and ``model``. Each field is described once
(``pipeline.core.fields.opt``); ``pipeline.core.config.Config`` holds them."""
from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline.core.fields import check, check_types, in_range, is_json_object, opt

CPU_KERNELS = ("ours", "chainer")
CACHE_MODES = ("auto", "on", "off")
DATASETS = ("cifar10", "cifar100")
# What a run's data was, as config.json records it, is one of pipeline.data.datasets.KINDS (the
# readers' own list, checked there: core cannot import data); here only its form.
KIND_FORM = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")
LABEL_KINDS = ("fine", "coarse")
MAX_CLASSES = 100_000  # model.n_classes' bound, and every reader's and data.json's
MAX_IMAGE_SIZE = 1024  # pixels a side: data.image_size's bound, and arrays' and data.json's


@dataclass(frozen=True)
class DataConfig:
    source: str = opt(
        "synthetic", "training data: synthetic (5,000 train / 1,000 test images made on the "
        "fly), synthetic:N:M (N train / M test images), cifar10, cifar10-binary or cifar100 (the "
        "official archive in the cache), a CIFAR directory or tarball, an image folder "
        "(root/<class>/<image>, optional train/ and val/) or a file list (path label)",
        flag="--data", metavar="SOURCE")
    cache_dir: str | None = opt(None, "where downloads go (also $DASK_CHAINER_CACHE)",
                                none="~/.cache/dask-chainer-pipeline")
    download: bool = opt(False, "fetch the official CIFAR archive (MD5-checked) into the cache "
                         "when it is missing", flag="--download")
    dataset: str = opt("cifar10", "which CIFAR a directory holds or a download fetches (python "
                       "format); config.json records what the data was (cifar10, cifar100, "
                       "synthetic, image-folder, file-list or arrays)", choices=DATASETS)
    label_kind: str = opt("fine", "CIFAR-100 only: fine (100 classes) or coarse (20) labels",
                          choices=LABEL_KINDS)
    image_size: int | None = opt(
        None, "image folders/lists: side of the square images the model sees, 16 to 1024 (CIFAR "
        "is always 32)", flag="--image-size", metavar="PIXELS", unit="pixels",
        none="the readers' default (pipeline.data.images.DEFAULT_SIZE)")
    val_fraction: float = opt(0.1, "image folders/lists without val/: share of each class held "
                              "out for val by a seeded split (data.split_seed)",
                              flag="--val-fraction", metavar="F")
    val_source: str | None = opt(None, "image folders/lists: a folder or file list to use as the "
                                 "val split", flag="--val-data", metavar="SOURCE",
                                 none="val/, else the --val-fraction held out")
    image_root: str | None = opt(None, "file lists: where relative paths start",
                                 flag="--image-root", metavar="DIR", none="the list's directory")
    split_seed: int = opt(0, "seed of the held-out val split (a property of the data, not the "
                          "run)")
    cache: str = opt("auto", "keep decoded training images on the workers (auto: when they take "
                     "at most a quarter of the smallest worker's memory; otherwise each round "
                     "decodes its shard again)", flag="--cache", metavar="MODE",
                     choices=CACHE_MODES)
    max_pixels: int = opt(1 << 26, "images with more pixels (width x height) are refused",
                          unit="pixels")
    decode_chunk: int = opt(128, "images per scan- / decode- task", unit="images")

    def validate(self) -> None:
        check_types(self, "data.")
        check(bool(self.source), "data.source", "must not be empty", self.source)
        check(self.image_size is None or 16 <= self.image_size <= MAX_IMAGE_SIZE,
               "data.image_size", f"must be in [16, {MAX_IMAGE_SIZE}] pixels", self.image_size)
        check(0 < self.val_fraction < 1, "data.val_fraction", "must be in (0, 1)",
               self.val_fraction)
        check(self.split_seed >= 0, "data.split_seed", "must be >= 0", self.split_seed)
        check(self.cache in CACHE_MODES, "data.cache", "must be auto, on or off",
               self.cache)
        check(self.max_pixels >= 1, "data.max_pixels", "must be >= 1", self.max_pixels)
        check(self.decode_chunk >= 1, "data.decode_chunk", "must be >= 1", self.decode_chunk)
        check(bool(KIND_FORM.fullmatch(self.dataset)), "data.dataset", "must be cifar10 or "
              "cifar100 (or, as config.json records it, the kind of data a run had: "
              "pipeline.data.datasets.KINDS)", self.dataset)
        check(self.label_kind in LABEL_KINDS, "data.label_kind", "must be fine or coarse",
               self.label_kind)


@dataclass(frozen=True)
class AugmentConfig:
    policy: str = opt("cifar", "augmentation of the training images (none: the images as "
                      "loaded; flip: random horizontal flips; cifar: pad, crop and flip; "
                      "cifar-cutout: and cutout; resized-crop: torchvision's RandomResizedCrop "
                      "and flip, for image folders)", flag="--augment", metavar="POLICY")
    chunk: int = opt(1000, "images per augment- seed chunk (global index ranges, not per worker)",
                     unit="images")
    resource: str = opt("CPU", "worker resource that augment- tasks ask for when a worker "
                        "advertises it")
    prefetch: int = opt(1, "rounds of augmentation computed ahead of training (memory: depth x "
                        "shard)", flag="--prefetch", metavar="N", unit="rounds")

    def validate(self) -> None:
        check_types(self, "augment.")
        check(self.chunk >= 1, "augment.chunk", "must be >= 1", self.chunk)
        check(self.prefetch >= 0, "augment.prefetch", "must be >= 0", self.prefetch)
        check(self.prefetch <= 100, "augment.prefetch", "must be <= 100 (rounds held ahead)",
               self.prefetch)


@dataclass(frozen=True)
class ModelConfig:
    name: str = opt("small-cnn", "the model (cifar10-2015: mitmul's 2015 CIFAR-10 net, 5.6 M "
                    "parameters; resnet20: He et al.'s CIFAR ResNet-20, 0.27 M; small-cnn: 15 k "
                    "parameters, fast on a CPU; wide-mlp: a 100.9 MB state for communication "
                    "experiments; resnet50, vgg16, googlenet: Chainer's ImageNet architectures, "
                    "random init, a fresh head), or your own: pkg.module:factory, a Link class "
                    "or a function returning a chainer.Link (README, 'Your own model'); config.json records it, and a resume or evaluate of the "
                    "run needs it named again", flag="--model", metavar="NAME")
    args: str = opt("{}", "keyword arguments of a pkg.module:factory model, a JSON object "
                    "(n_classes= is passed too when the factory names that parameter)",
                    flag="--model-args", metavar="JSON")
    init_weights: str | None = opt(None, "start from the weights in this .npz (a model.npz or "
                                   "Chainer's save_npz of the same model; read without "
                                   "unpickling, every name, shape and dtype checked)",
                                   flag="--init-weights", metavar="NPZ", none="the run seed's")
    n_classes: int = opt(10, "output units; taken from the data when it says otherwise")
    input_size: int = opt(0, "side of the square images the model was built at (a run records "
                          "the data's; 0: not recorded): evaluate and load_model rebuild a "
                          "model with lazily sized parameters there")
    backend: str = opt("chainer", "the framework that builds and trains the model: a name in "
                       "pipeline.backends.BACKENDS (a new framework is its package plus one "
                       "line there)", flag="--backend", metavar="NAME")
    cpu_kernels: str = opt("ours", "what runs convolution, pooling and BatchNorm on CPU workers "
                           "(ours: the NumPy kernels of pipeline.backends.chainer.cpu_kernels, "
                           "faster per step: docs/benchmarks.md; chainer: "
                           "Chainer's functions, which GPU workers always run)",
                           flag="--cpu-kernels", metavar="KIND", choices=CPU_KERNELS)

    def validate(self) -> None:
        check_types(self, "model.")
        in_range(self.n_classes, 2, MAX_CLASSES, "model.n_classes")
        in_range(self.input_size, 0, 1 << 16, "model.input_size")
        check(is_json_object(self.args), "model.args", "must be a JSON object", self.args)
        check(self.init_weights is None or self.init_weights != "", "model.init_weights",
               "must be a .npz path", self.init_weights)
        check(bool(KIND_FORM.fullmatch(self.backend)), "model.backend",
              "must be a backend's name (pipeline.backends.BACKENDS)", self.backend)
        check(self.cpu_kernels in CPU_KERNELS, "model.cpu_kernels",
               f"must be one of {CPU_KERNELS}", self.cpu_kernels)
