"""The ``apbv`` command's subcommands, one module each, in the order ``apbv --help`` lists them.

Every module has ``register(subparsers)``, which adds its subcommand(s) and sets ``run`` as
their default, and ``run(args) -> int`` (the exit status). Registering imports nothing heavy
(torch, transformers, ray, fastapi): ``run`` imports what it needs, so ``--help`` is quick.
"""

COMMANDS = (
    "generate", "demo", "plan", "tools", "eval", "eval_merge", "attention_demo", "watch",
    "batch", "serve",
)
"""The modules of :mod:`apbv.cli` that register subcommands, in help order (``tools``: the
make-* tools and train-tiny; ``eval`` also registers make-eval-fixtures)."""
