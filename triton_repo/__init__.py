"""Triton model repository templates, the tritonserver launcher and the client."""
