"""kiln's quantizer (calibration, SmoothQuant, AWQ, FP8, KV-cache scales): not built yet.

Engines are unquantized in this version; the build config accepts `quantization.algo: none`."""
