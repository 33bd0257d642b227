"""Qwen2.5-VL: the adapter, the prompt rules and the tiny checkpoint writer."""
