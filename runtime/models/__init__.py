"""Hugging Face causal LMs: where a job's model comes from, how it is loaded, exported and built for tests."""
