"""InternVL3: the adapter, the prompt rules and the tiny checkpoint writer."""
