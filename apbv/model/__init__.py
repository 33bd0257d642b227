"""Model side of apbv: checkpoint checks, the family registry and the adapters.

The adapter contract is written in :mod:`apbv.model.adapter`; :func:`apbv.model.families.
load_adapter` picks the family from ``config.json``'s ``model_type``. Nothing heavy is imported
here; import the submodules you need, e.g. ``apbv.model.qwen2_5_vl.tiny`` for a tiny random
Qwen2.5-VL
checkpoint with the real tokenizer.
"""
