"""The transformers side of the project: Hugging Face models and caches for tests and demos."""
