"""kiln: an ahead-of-time LLM engine builder (checkpoint + YAML -> engine -> Triton repository)."""

__version__ = "0.6.0"  # the one place; pyproject.toml reads it
