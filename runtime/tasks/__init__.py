"""Tasks: tokenizers, the synthetic long-tail task, prompt streams, rewards and the built-in policy."""
