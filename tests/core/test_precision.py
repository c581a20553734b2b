"""train.precision: the pure verdict from a CPU's flags (fed, not read from this machine) and
the one line a run is refused with before any cluster starts."""
from __future__ import annotations

import pytest

from pipeline.core import precision
from pipeline.core.config import Config
from tests.helpers import assert_train_refused, no_cluster

# flags of a CPU without bf16 instructions (an AVX-512 Skylake server), and of one with them
SKYLAKE = {"fpu", "sse4_2", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
SAPPHIRE_RAPIDS = SKYLAKE | {"avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}


def test_bf16_support_names_what_the_cpu_lacks():
    assert precision.bf16_support(SAPPHIRE_RAPIDS) is None
    assert precision.bf16_support(SKYLAKE | {"avx512_bf16"}) is None  # Cooper Lake, Zen 4
    line = precision.bf16_support(SKYLAKE)
    assert "amx_bf16" in line and "avx512_bf16" in line and "\n" not in line


def test_cpu_flags_reads_the_first_processor(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\n"
                    "flags\t\t: fpu\n")
    assert precision.cpu_flags(str(info)) == {"fpu", "avx2", "amx_bf16"}
    assert precision.cpu_flags(str(tmp_path / "absent")) == set()


@pytest.mark.parametrize("device,kernels,backend,says", [
    ("gpu", "ours", "chainer", "CPU workers only for now (--device cpu)"),
    ("auto", "ours", "chainer", "CPU workers only for now (--device cpu)"),
    ("cpu", "chainer", "chainer", "our CPU kernels only for now (--cpu-kernels ours"),
])
def test_bf16_off_the_supported_path_says_what_is_supported(device, kernels, backend, says):
    line = precision.refusal("bf16", device, kernels, backend, SAPPHIRE_RAPIDS)
    assert says in line and "\n" not in line


def test_a_cpu_without_bf16_refuses_in_one_line():
    line = precision.refusal("bf16", "cpu", "ours", "chainer", SKYLAKE)
    assert line.startswith("--precision bf16: this CPU has neither amx_bf16 nor avx512_bf16")
    assert precision.refusal("fp32", "cpu", "ours", "chainer", SKYLAKE) is None
    assert precision.refusal("bf16", "cpu", "ours", "chainer", SAPPHIRE_RAPIDS) is None


def test_the_config_field_is_checked_and_recorded():
    config = Config()
    assert config.train.precision == "fp32"
    with pytest.raises(ValueError, match="train.precision"):
        config.replace(**{"train.precision": "fp16"}).validate()


def test_the_cli_refuses_bf16_on_a_cpu_without_it_before_a_cluster(capsys, tmp_path, monkeypatch,
                                                                    cifar_dir):
    import pipeline.cluster.connection
    monkeypatch.setattr(pipeline.cluster.connection, "connect", no_cluster)
    monkeypatch.setattr(precision, "cpu_flags", lambda path="/proc/cpuinfo": set(SKYLAKE))
    line = assert_train_refused(capsys, "--data", cifar_dir, "--precision", "bf16",
                                out=tmp_path / "out")
    assert "this CPU has neither amx_bf16 nor avx512_bf16" in line
    line = assert_train_refused(capsys, "--data", cifar_dir, "--precision", "bf16",
                                "--device", "gpu", out=tmp_path / "out")
    assert "CPU workers only for now" in line
