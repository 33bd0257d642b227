"""A byte-level tokenizer with Qwen2.5-VL's chat special tokens, for small trained checkpoints.

Ids ``0 .. 21`` are Qwen2.5-VL's 22 added tokens in their real order (``<|endoftext|>`` = 0,
``<|im_start|>`` = 1, ``<|im_end|>`` = 2, ..., ``<|video_pad|>`` = 13), ids ``22 .. 277`` are
the 256 bytes (GPT-2's byte-to-unicode alphabet, no merges), so every text round-trips and a
word of ``k`` bytes is ``k`` tokens. The files load through the stock ``AutoProcessor`` and
chat template exactly like the real Qwen2.5 tokenizer; a checkpoint using it sets its config's
special ids from :data:`SPECIAL_IDS`. With a vocabulary of :data:`VOCAB_SIZE` rows instead of
151936, the embedding of a 64-wide model is 37 KB instead of 19 MB.
"""

from __future__ import annotations

from apbv.model.common.qwen_bpe import ADDED_TOKENS, finish_byte_level

NUM_SPECIAL = len(ADDED_TOKENS)
BYTE_OFFSET = NUM_SPECIAL
"""Id of byte 0; byte ``b`` is id ``BYTE_OFFSET + b``."""
VOCAB_SIZE = 288
"""Rows of the embedding: 22 special + 256 byte ids, padded to a multiple of 32."""

SPECIAL_IDS: dict[str, int] = {content: i for i, (_, content, _) in enumerate(ADDED_TOKENS)}
"""Special-token text -> id in this tokenizer."""
EOS_TOKEN_IDS = (SPECIAL_IDS["<|im_end|>"], SPECIAL_IDS["<|endoftext|>"])


def tokenizer_json() -> str:
    """The serialised fast tokenizer (``tokenizer.json``)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: BYTE_OFFSET + b for b in range(256)}
    vocab.update(SPECIAL_IDS)  # in the model's vocabulary, so adding them keeps these ids
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=[], dropout=None, unk_token=None,
                              fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                       trim_offsets=False, use_regex=False)
    return finish_byte_level(tokenizer, SPECIAL_IDS)
