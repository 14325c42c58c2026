"""kiln: an ahead-of-time LLM engine builder (checkpoint + YAML -> engine -> Triton repository)."""

__version__ = "0.1.0"
