"""Qwen3-VL: the adapter, the prompt rules and the tiny checkpoint writer."""
