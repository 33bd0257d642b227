"""Model side of apbv: checkpoints and (later) the Qwen2.5-VL adapter.

Nothing heavy is imported here; import the submodules you need, e.g. ``apbv.model.tiny`` for
a tiny random Qwen2.5-VL checkpoint with the real tokenizer.
"""
