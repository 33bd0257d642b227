"""Point references to the model modules at their places in the family folders.

    python scripts/follow_model_moves.py            # rewrite the files, list what changed
    python scripts/follow_model_moves.py --check    # list only; exit 1 if anything is left

``apbv/model/`` has a folder per family (``qwen2_5_vl/``, ``internvl/``, ``qwen3_vl/``: each
``adapter.py``, ``prompt.py``, ``tiny.py``) beside ``common/``. Code written against the flat
layout (``apbv.model.tiny``, ``apbv.model.internvl_prompt``, ``model/tower.py``...) is
rewritten: dotted module names and ``model/<name>.py`` paths in the git-tracked text files,
``from apbv.model import <module>`` lines, and the names that moved between modules
(``QwenRules`` out of ``front``, ``QwenStreamPrompt`` out of ``stream_prompt``,
``write_tiny_family`` and ``TINY_FAMILIES`` out of ``tiny_families``). Running it again
changes nothing. Long lines are left for ``ruff check`` to list.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

MOVES = {
    "hf_compat": "common.hf_compat", "hf_decoder": "common.hf_decoder", "hook": "common.hook",
    "patch_embed": "common.patch_embed", "tower": "common.tower",
    "vision_attention": "common.vision_attention", "vision_blocks": "common.vision_blocks",
    "qwen_bpe": "common.qwen_bpe",
    "qwen2_5_vl": "qwen2_5_vl.adapter", "tiny": "qwen2_5_vl.tiny",
    "internvl": "internvl.adapter", "internvl_prompt": "internvl.prompt",
    "tiny_internvl": "internvl.tiny",
    "qwen3_vl": "qwen3_vl.adapter", "qwen3_vl_prompt": "qwen3_vl.prompt",
    "tiny_qwen3_vl": "qwen3_vl.tiny",
    "tiny_families": "families",
}
"""Old module under ``apbv.model`` -> its new one."""
PACKAGES = ("qwen2_5_vl", "internvl", "qwen3_vl")
"""Old module names that are now the family folders' packages: ``apbv.model.internvl`` alone
is the package; ``apbv.model.internvl.InternVL`` and ``from apbv.model.internvl import load``
meant the adapter."""
FOLDER_PARTS = r"(?:adapter|prompt|tiny)\b"
_MODULES = "|".join(sorted((m for m in MOVES if m not in PACKAGES), key=len, reverse=True))
_PACKAGES = "|".join(PACKAGES)
DOTTED = re.compile(rf"(?<![\w.])apbv\.model\.({_MODULES})(?!\w)")
IN_PACKAGE = re.compile(rf"(?<![\w.])apbv\.model\.({_PACKAGES})(?=\.(?!{FOLDER_PARTS})\w)")
FROM_FOLDER = re.compile(rf"^(\s*from apbv\.model\.(?:{_PACKAGES}))( import (?!{FOLDER_PARTS}"
                         r"(?: as \w+)?\s*$))", re.M)
PATH = re.compile(rf"(?<![\w/])model/({'|'.join(MOVES)})\.py\b")
FROM_PACKAGE = re.compile(r"^(\s*)from apbv\.model import ([\w, ]+)$", re.M)
MOVED_NAMES = [
    (re.compile(r"^(\s*)from apbv\.model\.front import QwenRules$", re.M),
     r"\1from apbv.model.qwen2_5_vl.prompt import QwenRules"),
    (re.compile(r"^(\s*)from apbv\.model\.stream_prompt import (.*)\bQwenStreamPrompt\b(.*)$",
                re.M), None),
]
SUFFIXES = (".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".yml", ".yaml", ".html", ".json")
SELF = "scripts/follow_model_moves.py"


def _from_package(m: re.Match[str]) -> str:
    """``from apbv.model import a, b`` -> one import per module, from its new package."""
    indent, names = m.group(1), [n.strip() for n in m.group(2).split(",")]
    lines = []
    for name in names:
        new = MOVES.get(name)
        if new is None:
            lines.append(f"{indent}from apbv.model import {name}")
            continue
        package, _, module = f"apbv.model.{new}".rpartition(".")
        alias = "" if module == name else f" as {name}"
        lines.append(f"{indent}from {package} import {module}{alias}")
    return "\n".join(lines)


def _stream_prompt(m: re.Match[str]) -> str:
    """``QwenStreamPrompt`` out of a ``from apbv.model.stream_prompt import`` line."""
    indent = m.group(1)
    rest = [n.strip() for n in (m.group(2) + m.group(3)).split(",") if n.strip()]
    out = [f"{indent}from apbv.model.qwen2_5_vl.prompt import QwenStreamPrompt"]
    if rest:
        out.insert(0, f"{indent}from apbv.model.stream_prompt import {', '.join(rest)}")
    return "\n".join(out)


def follow(text: str) -> str:
    text = FROM_FOLDER.sub(r"\1.adapter\2", text)
    text = FROM_PACKAGE.sub(_from_package, text)
    text = DOTTED.sub(lambda m: "apbv.model." + MOVES[m.group(1)], text)
    text = IN_PACKAGE.sub(lambda m: f"apbv.model.{m.group(1)}.adapter", text)
    text = PATH.sub(lambda m: "model/" + MOVES[m.group(1)].replace(".", "/") + ".py", text)
    text = MOVED_NAMES[0][0].sub(str(MOVED_NAMES[0][1]), text)
    return MOVED_NAMES[1][0].sub(_stream_prompt, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="list only, write nothing")
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                           check=True).stdout.split()
    changed = []
    for name in files:
        path = root / name
        if name == SELF or not name.endswith(SUFFIXES) or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        new = follow(text)
        if new != text:
            changed.append(name)
            if not args.check:
                path.write_text(new)
    print("\n".join(changed))
    print(f"{len(changed)} file(s){' to change' if args.check else ' changed'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
