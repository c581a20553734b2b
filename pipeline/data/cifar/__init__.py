"""The CIFAR file formats (``parse`` holds them all until they are split into modules)."""
from pipeline.data.cifar.parse import *  # noqa: F401,F403
from pipeline.data.cifar.parse import _py10_batch  # noqa: F401
