"""Shared by the GPU test files: skip without a usable CUDA device, with the one-line reason.

Where ``PIPELINE_REQUIRE_GPU=1`` (scripts/gpu/remote.sh sets it on the GPU machine) a missing
device is an error instead, so a GPU run that would skip everything cannot pass silently.
"""
from __future__ import annotations

import os

import pytest


def require_cuda() -> None:
    """Call at module level: skips the module (or raises under PIPELINE_REQUIRE_GPU=1)."""
    try:
        from pipeline.backends.chainer.compat import cuda_status
        reason = cuda_status(check_device=True)
    except Exception as exc:  # pragma: no cover - compat itself broken
        reason = f"pipeline.backends.chainer.compat failed: {exc}"
    if reason is None:
        return
    if os.environ.get("PIPELINE_REQUIRE_GPU") == "1":
        raise RuntimeError(f"PIPELINE_REQUIRE_GPU=1 but {reason}")
    pytest.skip(reason, allow_module_level=True)
