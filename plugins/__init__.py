"""kiln's C++ kernels ("plugins"): sources, the compiler driver and the torch op wrappers.

Nothing here imports from the packages above it (builder, runtime, quantize)."""
