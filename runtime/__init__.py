"""kiln's runtime: the engine loader, the model definition and the Python API."""


def __getattr__(name):  # lazy: `import kiln.runtime` should not load torch until needed
    if name in ("LLM", "SamplingParams", "GenerationOutput", "StreamChunk"):
        from kiln.runtime import llm, sampling

        return getattr(llm, name, None) or getattr(sampling, name)
    raise AttributeError(name)
