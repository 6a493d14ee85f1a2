"""`verispec serve`: an OpenAI-compatible HTTP server over a continuously batched speculative decoder."""
