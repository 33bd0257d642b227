"""What the model families share: the transformers decoder wrapper and version drift, the
attention hook, and the Qwen-style vision tower with its fused parts, and the Qwen2.5 tokenizer
the tiny checkpoints write."""
