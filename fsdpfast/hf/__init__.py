"""The Hugging Face folder's rules: reading its config.json, and which config files an output gets."""
