"""kiln's quantizer: calibration on text (calibrate.py, datasets.py), the algorithms (int8 / int4
weight-only, AWQ, SmoothQuant W8A8, W4A8, FP8, GPTQ rounding, KV-cache scales; algorithms.py),
quantizing weights into the engine's formats (formats.py), and what a build cost in accuracy
(evaluate.py, report.py). The build runs them in builder/quantization.py."""
