"""The machine signature (pipeline/machine.py): the CPU's vector extension is part of a machine's
name, so figures from an AVX2-only and an AVX-512 "AMD EPYC" never share a results file."""
from __future__ import annotations

from pipeline.machine import cpu_words, signature, slug, widest_isa

EPYC = {"cpu_model": "AMD EPYC", "cpu_cores": 2, "gpu_model": "", "gpu_count": 0, "instance_type": ""}
XEON_H100 = {"cpu_model": "Intel(R) Xeon(R) Processor", "cpu_cores": 16, "gpu_model": "NVIDIA H100 80GB HBM3",
             "gpu_count": 1, "instance_type": ""}


def test_the_widest_extension_is_read_from_the_flags():
    assert widest_isa("fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_bf16".split()) == "avx512"
    assert widest_isa("fpu sse4_2 avx avx2 fma bmi2".split()) == "avx2"
    assert widest_isa("fpu sse4_2 avx".split()) == widest_isa([]) == ""


def test_this_machines_signature_has_the_extension_its_cpuinfo_lists():
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = next((line for line in f if line.startswith("flags")), "flags:").split(":", 1)[1].split()
    hardware = signature()
    assert hardware["cpu_isa"] == widest_isa(flags) and hardware["cpu_isa"] in slug(hardware)


def test_two_epycs_of_different_extensions_file_apart_and_old_rows_keep_their_name():
    avx2, avx512 = slug({**EPYC, "cpu_isa": "avx2"}), slug({**EPYC, "cpu_isa": "avx512"})
    assert (avx2, avx512) == ("amd-epyc-avx2-2c", "amd-epyc-avx512-2c")
    assert slug(EPYC) == "amd-epyc-2c"      # a row recorded before the signature had cpu_isa
    assert slug({**XEON_H100, "cpu_isa": "avx512"}) == "intel-xeon-processor-avx512-16c-1x-nvidia-h100-80gb-hbm3"
    assert slug({**EPYC, "cpu_isa": "avx2", "instance_type": "c7a.large"}) == "c7a.large"


def test_figures_are_labelled_with_the_extension():
    assert cpu_words({**EPYC, "cpu_isa": "avx512"}) == "AMD EPYC (AVX-512)"
    assert cpu_words({**EPYC, "cpu_isa": "avx2"}) == "AMD EPYC (AVX2)"
    assert cpu_words(EPYC) == "AMD EPYC"
