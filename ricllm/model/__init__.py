"""Model files (GGUF, HF folders), the tokenizer, and the Llama-family transformer."""
