"""kiln's quantizer: accuracy evaluation now (evaluate.py, `kiln eval`); calibration,
SmoothQuant, AWQ, FP8 and KV-cache scales come with the quantization work.

Engines are unquantized in this version; the build config accepts `quantization.algo: none`."""
