"""A small Llama reference LM for testing compressed KV caches: data prep, training, pass-key format."""
