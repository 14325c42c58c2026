"""kiln's builder: config, checkpoint readers, compile passes, engine and Triton repo writers."""
