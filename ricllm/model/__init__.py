"""A model's files (GGUF, HF folders): its shape, its tokenizer, its weights and their formats.

What runs the weights (the torch and native networks) is execution: ``ricllm.engine.runtime``.
"""
