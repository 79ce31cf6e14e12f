"""Runs tinyvllm's .metal kernels on the CPU: clang++ against our own metal_stdlib, fibers for MSL threads."""
from tinyvllm.kernels.emulator.harness import EmulatorError, Kernel, Library, compile_file, compile_source, runtime, take_error

__all__ = ["EmulatorError", "Kernel", "Library", "compile_file", "compile_source", "runtime", "take_error"]
