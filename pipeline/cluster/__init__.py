"""The cluster: connecting (``connection``: a scheduler address, TLS; ``embedded``: the local
cluster), what each worker offers (``resources``: resources, ranks), the BLAS kernel (``blas``),
the watchdog that retires stalled workers (``watchdog``, ``assignments``), the worker preload
(``worker_setup``), Bokeh's validation switch per thread for dashboards in this process
(``bokeh_validation``) and the emulated multi-host harness (``emulated``).

Front: ``connect``, ``describe``, ``has_resource`` and the rest of ``pipeline.cluster.connection``.
"""
from pipeline.core.exports import lazy

__all__ = ("logger", "Roles", "security_from", "scheduler_address", "default_workers",
           "local_gpus", "connect", "RANK", "rank_resource", "worker_ranks", "worker_resources",
           "has_resource", "require_resource", "gpu_report", "check_gpu_workers",
           "require_workers", "describe")
__getattr__ = lazy(__name__, "pipeline.cluster.connection", __all__)
