"""Train and evaluate tasks on a CUDA GPU with CuPy: same results as on the CPU, host values out.

Skipped where CuPy or a GPU is missing; run on a GPU machine with ``pytest -m gpu``.
"""
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
try:
    cupy.cuda.runtime.getDeviceCount()
except Exception:  # CuPy installed, no usable device
    pytest.skip("no CUDA device", allow_module_level=True)

from pipeline import tasks  # noqa: E402
from pipeline.cifar import synthetic_batch  # noqa: E402

pytestmark = pytest.mark.gpu


def _spec(model, device, steps=2):
    return tasks.StepSpec(model, 10, "momentum", 0.9, 0.0, (0.01,) * steps, 16, "steps", "keep",
                          0, 0, 0, device)


@pytest.mark.parametrize("model", ["small-cnn", "resnet20", "cifar10-2015"])
def test_train_task_on_gpu_matches_cpu(model):
    images, labels = synthetic_batch(0, "train", 0, 32)
    params = tasks.init_params(model, 10, seed=0)
    shard = tasks.Shard(images, labels)
    cpu = tasks.train(params, None, shard, _spec(model, "@numpy"))
    gpu = tasks.train(params, None, shard, _spec(model, "@cupy:0"))
    assert all(type(v) is np.ndarray for v in gpu.payload.values())  # host values out
    for key, value in cpu.payload.items():
        np.testing.assert_allclose(gpu.payload[key], value, rtol=1e-3, atol=1e-4, err_msg=key)
    assert gpu.metrics["n"] == 32 and gpu.metrics["finite"]


def test_evaluate_on_gpu_matches_cpu():
    images, labels = synthetic_batch(0, "test", 0, 64)
    params = tasks.init_params("resnet20", 10, seed=0)
    cpu = tasks.evaluate(params, images, labels, tasks.EvalSpec("resnet20", 10, True, "@numpy"))
    gpu = tasks.evaluate(params, images, labels, tasks.EvalSpec("resnet20", 10, True, "@cupy:0"))
    assert gpu["correct"] == cpu["correct"]
    assert gpu["loss_sum"] == pytest.approx(cpu["loss_sum"], rel=1e-4)
