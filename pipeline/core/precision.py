"""Which precision a run may ask for: a pure verdict from the CPU's flags and the run's settings.

bf16 runs the CPU convolutions' inputs as bfloat16 through oneDNN, which needs the CPU's bf16
instructions (AMX's ``amx_bf16`` or ``avx512_bf16``): without them oneDNN would emulate it
slower than float32. The flags are the verdict's input, so a test feeds those of any CPU.
"""
from __future__ import annotations

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo's names of the instructions bf16 needs


def cpu_flags(path: str = "/proc/cpuinfo") -> set:
    """The first processor's flags in ``path`` (empty where it cannot be read: not Linux)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def bf16_support(flags: set) -> str | None:
    """None where a CPU with ``flags`` runs bf16 convolutions, else what it lacks.

    >>> bf16_support({"avx512f", "amx_bf16", "amx_tile"}) is None
    True
    >>> bf16_support({"avx2", "avx512f"})
    'this CPU has neither amx_bf16 nor avx512_bf16 (/proc/cpuinfo flags)'
    """
    if any(flag in flags for flag in BF16_FLAGS):
        return None
    return f"this CPU has neither {' nor '.join(BF16_FLAGS)} (/proc/cpuinfo flags)"


def refusal(precision: str, device: str, cpu_kernels: str, backend: str,
            flags: set) -> str | None:
    """The one line ``--precision`` is refused with, or None: bf16 runs on CPU workers, with
    our kernels on Chainer, where the CPU has bf16 instructions.

    >>> refusal("fp32", "gpu", "chainer", "chainer", set()) is None
    True
    >>> refusal("bf16", "gpu", "ours", "chainer", {"amx_bf16"})
    '--precision bf16 runs on CPU workers only for now (--device cpu); GPUs train in fp32'
    """
    if precision == "fp32":
        return None
    if device != "cpu":
        return ("--precision bf16 runs on CPU workers only for now (--device cpu); GPUs train "
                "in fp32")
    if cpu_kernels != "ours" or backend != "chainer":
        return ("--precision bf16 runs on our CPU kernels only for now (--cpu-kernels ours, "
                "--backend chainer)")
    lacks = bf16_support(flags)
    return None if lacks is None else f"--precision bf16: {lacks}; use --precision fp32"


def bf16_kind(flags: set) -> str:
    """Which bf16 instructions a CPU with ``flags`` has: oneDNN's bf16 kernels (and so their
    bits) differ between AMX and AVX512-BF16 machines.

    >>> bf16_kind({"amx_bf16", "avx512_bf16"}), bf16_kind({"avx512_bf16"}), bf16_kind(set())
    ('amx_bf16', 'avx512_bf16', 'none')
    """
    return next((flag for flag in BF16_FLAGS if flag in flags), "none")


def workers_mismatch(flags_by_worker: dict) -> str | None:
    """One warning line where a bf16 run's workers differ in bf16 instructions, else None.

    >>> amx, avx = {"amx_bf16", "avx512_bf16"}, {"avx512_bf16"}
    >>> workers_mismatch({"tcp://a:1": amx, "tcp://b:2": amx}) is None
    True
    >>> print(workers_mismatch({"tcp://a:1": amx, "tcp://b:2": avx, "tcp://c:3": set()}))
    ... # doctest: +NORMALIZE_WHITESPACE
    warning: --precision bf16 on workers with different bf16 instructions (amx_bf16 on
    tcp://a:1; avx512_bf16 on tcp://b:2; none on tcp://c:3): results then depend on which
    worker ran which replica, and a worker without them emulates bf16 slowly
    (docs/reliability.md)
    """
    groups: dict = {}
    for worker, flags in sorted(flags_by_worker.items()):
        groups.setdefault(bf16_kind(flags), []).append(worker)
    if len(groups) < 2:
        return None
    kinds = "; ".join(f"{kind} on {', '.join(workers)}" for kind, workers in groups.items())
    return (f"warning: --precision bf16 on workers with different bf16 instructions ({kinds}): "
            "results then depend on which worker ran which replica, and a worker without them "
            "emulates bf16 slowly (docs/reliability.md)")
