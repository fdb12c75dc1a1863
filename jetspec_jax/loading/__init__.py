"""Checkpoint loaders: local Hugging Face directories and GGUF files, driven by rule tables."""
