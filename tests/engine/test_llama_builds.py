"""The bench compares KVScope with llama.cpp at its best on the machine: the builds tried, in order, and the one
kept are decided here from the CPU's flags and each build's probe, on any machine (building is the bench's)."""

from __future__ import annotations

import signal

from tests.benchmarks.llama_builds import Build, candidates, choose, cpu_flags, explicit, probe_words

SAPPHIRE_RAPIDS = {"fma", "f16c", "avx", "avx2", "bmi2", "avx512f", "avx512vbmi", "avx512_vnni", "avx512_bf16",
                   "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "sse4_2"}
HASWELL = {"fma", "f16c", "avx", "avx2", "bmi2", "sse4_2"}


def test_a_cpu_with_amx_tries_native_then_native_without_amx_then_x86_64_v3():
    builds = candidates(SAPPHIRE_RAPIDS, "x86_64")
    assert [b.name for b in builds] == ["native", "native, AMX off", "x86-64-v3"]
    native, no_amx, v3 = builds
    assert native.cmake_args == "-DGGML_NATIVE=ON"
    assert "-DGGML_NATIVE=OFF" in no_amx.cmake_args and "AMX" not in no_amx.cmake_args
    for option in ("GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX512_VBMI", "GGML_AVX_VNNI"):
        assert f"-D{option}=ON" in no_amx.cmake_args.split(), option
    assert "AVX512" not in v3.cmake_args and "-DGGML_AVX2=ON" in v3.cmake_args.split()


def test_without_amx_there_is_no_amx_free_variant_and_off_x86_only_native():
    assert [b.name for b in candidates(HASWELL, "x86_64")] == ["native", "x86-64-v3"]
    assert [b.name for b in candidates(set(), "aarch64")] == ["native"]


def test_a_build_names_only_the_instruction_sets_the_cpu_reports():
    assert explicit(HASWELL).split() == ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                                         "-DGGML_F16C=ON", "-DGGML_BMI2=ON"]


def test_the_first_build_whose_probe_passes_is_kept_and_each_passed_over_says_why():
    builds = candidates(SAPPHIRE_RAPIDS, "x86_64")
    faults = {"native": probe_words(-signal.SIGSEGV, "", ["F32", "BF16"]), "native, AMX off": None}
    best, notes = choose(builds, lambda b: faults.get(b.name, "not reached"))
    assert best.name == "native, AMX off"
    assert notes == ["native: the probe died with SIGSEGV after decoding F32, BF16"]
    best, notes = choose(builds, lambda b: None)
    assert best.name == "native" and notes == []
    best, notes = choose(builds, lambda b: "the probe failed (exit 1)")
    assert best is None and len(notes) == 3


def test_probe_words_tell_a_death_from_a_failure_from_success():
    assert probe_words(0, "") is None
    assert probe_words(-signal.SIGILL, "") == "the probe died with SIGILL before decoding any format"
    assert probe_words(2, "Traceback...\nValueError: bad gguf\n", ["F32"]) == \
        "the probe failed after decoding F32 (ValueError: bad gguf)"


def test_cpu_flags_are_read_from_the_first_processor_line():
    info = "processor\t: 0\nflags\t\t: fpu avx2 amx_tile\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert cpu_flags(info) == {"fpu", "avx2", "amx_tile"}
    assert Build("native, AMX off", "", "").folder.name == "native-AMX-off"
