"""Seeded, vectorized image augmentation on uint8 NCHW batches (NumPy or CuPy); imports neither dask nor chainer.

    >>> import numpy as np, augment
    >>> images = np.zeros((4, 3, 32, 32), np.uint8)
    >>> out = augment.get_policy("cifar")(images, np.random.default_rng(0))
    >>> out.shape, out.dtype.name
    ((4, 3, 32, 32), 'uint8')
"""
from augment.ops import (CIFAR10_MEAN, CIFAR10_STD, MODES, brightness_contrast, center_crop,
                         check_images, cutout, flip, normalize, pad_crop, pad_crop_flip,
                         resized_crop, shift_flip, translate)
from augment.policy import (POLICIES, BrightnessContrast, Compose, Cutout, Flip, PadCrop, Params,
                            RandomResizedCrop, Translate, concat_params, get_policy,
                            sample_for_positions, take_params)
from augment.tta import TTA_SHIFTS, tta_average, tta_views
from augment.xp import array_module, to_host

__all__ = [
    "CIFAR10_MEAN", "CIFAR10_STD", "MODES", "brightness_contrast", "center_crop", "check_images",
    "cutout", "flip", "normalize", "pad_crop", "pad_crop_flip", "resized_crop", "shift_flip",
    "translate",
    "POLICIES", "BrightnessContrast", "Compose", "Cutout", "Flip", "PadCrop", "Params",
    "RandomResizedCrop", "Translate",
    "concat_params", "get_policy", "sample_for_positions", "take_params",
    "TTA_SHIFTS", "tta_average", "tta_views", "array_module", "to_host",
]
