"""Train the tiny Qwen2.5-VL on synthetic needle videos: a checkpoint that actually watches.

``python -m apbv train-tiny --out DIR`` builds a Qwen2.5-VL-shaped model (the tiny widths of
:mod:`apbv.model.qwen2_5_vl.tiny`: 2 decoder layers of width 64, a 2-block vision tower; tied
embeddings
and the byte-level tokenizer of :mod:`apbv.synthetic.byte_tokenizer`, so about 0.2 M parameters)
and trains it with teacher forcing on the answer tokens of :mod:`apbv.synthetic.needles` questions
(retrieval, ordering, counting, and the standing questions presence and most recent flash), with
a curriculum over video lengths up to :attr:`TrainConfig.max_patches` temporal patches (about
8k prompt tokens). The loss is averaged per video, so every answer counts once however many
tokens it spells. ``--init DIR`` continues from a trained checkpoint instead of a random init
(:data:`FINE_TUNE`: fewer steps, a lower rate; ``training.json`` records the starting weights'
SHA-256). Prompts are built exactly as the engine builds them (the checkpoint's chat template,
context and query tokenized apart, apbv's M-RoPE positions), so what the model learns is what
the engine asks.

``--grow N`` appends N decoder layers (:mod:`apbv.synthetic.grow`; ``--old-lr-scale``).
The result loads through the same ``from_pretrained`` path as a released checkpoint, weights
in bfloat16, plus ``training.json``: the command, seed, steps, wall time, loss curve and
held-out accuracy (greedy, single-process exact attention) per kind, length and answer.
Training is seeded and deterministic on a given torch build and thread count (tooling, not
part of the request path).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from apbv.model.qwen2_5_vl.tiny import (
    CHAT_TEMPLATE,
    PREPROCESSOR_CONFIG,
    tiny_config,
    tokenizer_config,
    write_json,
)
from apbv.synthetic import byte_tokenizer as bt
from apbv.synthetic import grow, mix
from apbv.synthetic.batch import Encoded, collate
from apbv.synthetic.lookup import lookup_batch
from apbv.synthetic.needles import KINDS, make_sample, patches_for_tokens

FORMAT_VERSION = 1

LOOKUP_BATCH = 32
"""Text-only samples in a ``lookup`` step (4-5 letters each)."""
SEED_OFFSETS = {"train": 0, "heldout": 1_000_003}
"""Sample seeds are ``seed + offset``: training and held-out sets never share a sample."""


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 6000
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.0
    min_patches: int = 12
    """Shortest training video (temporal patches; 4 prompt tokens each)."""
    max_patches: int = 2048
    """Longest training video: about 8.3k prompt tokens."""
    curriculum: tuple[tuple[float, int], ...] = ((0.0, 64), (0.45, 256), (0.7, 1024),
                                                  (0.85, 2048))
    """(fraction of the steps, longest video from then on, in patches); lengths are drawn
    log-uniformly between ``min_patches`` and the current longest."""
    eval_tokens: tuple[int, ...] = (2048, 8192)
    """Prompt lengths of the held-out accuracy written beside the weights."""
    eval_samples: int = 20
    """Held-out samples per kind and length."""
    threads: int = 2
    batch_tokens: int = 2048
    """Short videos are batched (same kind and length) up to about this many video tokens."""
    max_batch: int = 8
    init: str | None = None
    """Checkpoint directory whose weights training starts from (None: seeded random init)."""
    mix: str = "needles"  # the step schedule (apbv.synthetic.mix.MIXES)
    grow: int = 0  # decoder layers appended to init's (apbv.synthetic.grow; 0: none)
    old_lr_scale: float = 1.0  # the rate of every weight but the grown layers' (0: frozen)
    probe_every: int = 0  # print grow.probe's held-out letter accuracy every this many steps

    def __post_init__(self) -> None:
        mix.schedule(self.mix)
        for name in ("steps", "min_patches", "max_patches", "threads", "eval_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 < self.lr < 1:
            raise ValueError(f"lr must be in (0, 1), got {self.lr!r}")
        if self.min_patches > self.max_patches:
            raise ValueError("min_patches must not exceed max_patches")
        if self.grow and (self.init is None or self.grow < 0):
            raise ValueError(f"grow must be a layer count >= 0 with init, got {self.grow!r}")
        if not 0 <= self.old_lr_scale <= 1 or (self.old_lr_scale < 1 and not self.grow):
            raise ValueError("old_lr_scale must be in [0, 1] (below 1 only with grow), got "
                             f"{self.old_lr_scale!r}")

    def longest(self, step: int) -> int:
        """Longest video (patches) at ``step``."""
        current = self.curriculum[0][1]
        for fraction, patches in self.curriculum:
            if step >= fraction * self.steps:
                current = patches
        return max(self.min_patches, min(current, self.max_patches))


FINE_TUNE = {"steps": 2400, "lr": 1e-3,
             "curriculum": ((0.0, 64), (0.15, 256), (0.4, 1024), (0.65, 2048))}
"""TrainConfig overrides of ``--init`` (continuing a trained checkpoint): fewer steps, a lower
rate, a third of the steps up to ``max_patches`` (and :data:`mix.FINE_TUNE_OVERRIDES`)."""


def trained_config():
    """The Qwen2.5-VL config of the trained tiny model: tiny widths, byte-level vocabulary."""
    from transformers import Qwen2_5_VLConfig

    base = tiny_config("tiny").to_dict()
    text, vision = dict(base["text_config"]), dict(base["vision_config"])
    ids = bt.SPECIAL_IDS
    text.update(vocab_size=bt.VOCAB_SIZE, bos_token_id=ids["<|endoftext|>"],
                eos_token_id=ids["<|im_end|>"], tie_word_embeddings=True)
    for key in ("model_type", "architectures", "dtype", "torch_dtype", "transformers_version"):
        text.pop(key, None)
        vision.pop(key, None)
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, dtype="bfloat16",
    )


def build_model(seed: int, init: str | None = None, extra: int = 0):
    """The model to train (fp32): small normal init, seeded, or ``init``'s weights (with
    ``extra`` decoder layers appended: :func:`apbv.synthetic.grow.grown`)."""
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    start = None if init is None else Qwen2_5_VLForConditionalGeneration.from_pretrained(
        init, local_files_only=True, dtype=torch.float32)
    torch.manual_seed(seed)  # the init's config (a grown checkpoint has more layers)
    model = Qwen2_5_VLForConditionalGeneration(
        trained_config() if start is None else start.config).float()
    if start is not None:  # the init's shapes and weights
        if extra:
            model = grow.grown(type(model), start, extra, seed)
        else:
            model.load_state_dict(start.state_dict())
    ids = bt.SPECIAL_IDS
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
        eos_token_id=list(bt.EOS_TOKEN_IDS))
    return model


def write_support_files(directory: Path) -> None:
    """Everything but the weights: tokenizer, chat template, processor config."""
    (directory / "tokenizer.json").write_text(bt.tokenizer_json(), encoding="utf-8")
    write_json(directory / "tokenizer_config.json", tokenizer_config(bt.SPECIAL_IDS))
    write_json(directory / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    write_json(directory / "preprocessor_config.json", PREPROCESSOR_CONFIG)


class Encoder:
    """Builds model inputs for a needle sample the way the engine builds its prompt."""

    def __init__(self, processor: Any, config: Any):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.video_token_id = config.video_token_id
        self.tokens_per_second = config.vision_config.tokens_per_second
        self.end_id = bt.SPECIAL_IDS["<|im_end|>"]

    def __call__(self, sample: Any, *, with_answer: bool = True,
                 threshold: float | None = None) -> Encoded:
        """``threshold``: prune as the engine does at ``video.static_threshold``."""
        from apbv.model.common.hf_compat import video_processor_kwargs
        from apbv.positions import mrope_positions
        from apbv.sequence import build_prompt
        from apbv.video.prune import keep_mask, signatures

        vp = self.processor.video_processor
        frames, kept = sample.frames, None
        t, side = frames.shape[0] // 2, frames.shape[-1] // 14  # (t, h, w) of the whole video
        if threshold:
            keep = keep_mask(signatures(frames, 2, (side // 2, side // 2)), threshold)
            kept = [i for i, k in enumerate(keep) if k]
            frames = frames[torch.tensor(keep).repeat_interleave(2)]
        out = vp(videos=[frames], do_resize=False, do_sample_frames=False,
                 return_tensors="pt", **video_processor_kwargs(vp))
        grid = out["video_grid_thw"]
        k, h, w = (int(x) for x in grid[0].tolist())
        assert (h, w) == (side, side) and k == (t if kept is None else len(kept)), grid
        context, query = build_prompt(self.processor, sample.question, k * h * w // 4)
        prompt = torch.cat([context, query])
        positions = mrope_positions(prompt, [(t, h, w)], [2.0 / sample.fps],
                                    video_token_id=self.video_token_id, spatial_merge_size=2,
                                    tokens_per_second=self.tokens_per_second, kept=[kept])
        answer = (self.tokenizer(sample.answer, add_special_tokens=False)["input_ids"]
                  + [self.end_id]) if with_answer else []
        ids = torch.cat([prompt, torch.tensor(answer, dtype=torch.long)])
        more = torch.arange(len(answer)) + int(positions.max()) + 1
        positions = torch.cat([positions, more.view(1, 1, -1).expand(3, 1, -1)], dim=2)
        labels = torch.full_like(ids, -100)
        if answer:  # logits at i predict token i + 1: labels are the ids, HF shifts them
            labels[len(prompt):] = ids[len(prompt):]
        return Encoded(ids.unsqueeze(0), labels.unsqueeze(0), positions,
                       out["pixel_values_videos"], grid, len(prompt))


def forward(model, enc: Encoded):
    return model(input_ids=enc.input_ids, pixel_values_videos=enc.pixels,
                 video_grid_thw=enc.grid, position_ids=enc.positions)


def answer_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the answer tokens, averaged per sample and then over the batch, so
    every video counts once however many tokens its answer has ("magenta" is 8, "red" 4).

    logits: (B, T, V); labels: (B, T), -100 outside the answer (logits at i predict i + 1).
    """
    targets = labels[:, 1:]
    per_token = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), targets, ignore_index=-100, reduction="none")
    counted = (targets != -100).sum(dim=1)
    assert bool((counted > 0).all()), "every sample has answer tokens"
    return (per_token.sum(dim=1) / counted).mean()


@torch.no_grad()
def answers_greedily(model, enc: Encoded) -> bool:
    """Whether greedy decoding yields exactly the answer tokens and then <|im_end|>: one
    teacher-forced forward, the argmax at every answer position equal to the next token
    (which is what greedy decoding from the prompt would produce, token by token)."""
    logits = forward(model, enc).logits[0]
    targets = enc.input_ids[0, enc.prompt_len:]
    return bool((logits[enc.prompt_len - 1:-1].argmax(-1) == targets).all())


def heldout_accuracy(model, encoder: Encoder, cfg: TrainConfig, progress=None
                     ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, list[int]]]]:
    """({kind: {tokens: accuracy}}, {kind: {answer: [right, count]}} over every length) of
    greedy answers on held-out samples (single process, full causal attention)."""
    model.eval()
    result: dict[str, dict[str, float]] = {}
    by_answer: dict[str, dict[str, list[int]]] = {}
    for kind in KINDS:
        result[kind] = {}
        by_answer[kind] = {}
        for tokens in cfg.eval_tokens:
            patches = patches_for_tokens(tokens)
            right = 0
            for i in range(cfg.eval_samples):
                sample = make_sample(kind, patches=patches, index=i,
                                     seed=cfg.seed + SEED_OFFSETS["heldout"])
                ok = answers_greedily(model, encoder(sample))
                right += ok
                cell = by_answer[kind].setdefault(sample.answer, [0, 0])
                cell[0] += ok
                cell[1] += 1
            result[kind][str(tokens)] = right / cfg.eval_samples
            if progress:
                print(f"held-out {kind} @ {tokens} tokens: {result[kind][str(tokens)]:.2f}",
                      file=progress, flush=True)
    return result, by_answer


def _lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train(cfg: TrainConfig, out_dir: str | os.PathLike[str], *, overwrite: bool = False,
          command: str | None = None, progress=sys.stderr) -> Path:
    """Train, evaluate on held-out samples and write the checkpoint to ``out_dir``."""
    from transformers import AutoProcessor

    from apbv.model.common.tower import set_vision_attention

    out = Path(out_dir).expanduser().absolute()
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        raise ValueError(f"{out} exists and is not an empty directory (pass --overwrite)")
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        write_support_files(tmp)
        processor = AutoProcessor.from_pretrained(tmp, local_files_only=True)
        init_sha256, init_record = None, {}
        if cfg.init is not None:
            weights = Path(cfg.init) / "model.safetensors"
            if not weights.is_file():
                raise ValueError(f"--init {cfg.init!r} holds no model.safetensors")
            init_sha256 = hashlib.sha256(weights.read_bytes()).hexdigest()
            if (Path(cfg.init) / "training.json").is_file():  # its figures, beside the new
                init_record = json.loads((Path(cfg.init) / "training.json").read_text())
        model = build_model(cfg.seed, cfg.init, cfg.grow)
        set_vision_attention(model, "grouped")
        encoder = Encoder(processor, model.config)
        groups = grow.param_groups(model, cfg.grow, cfg.old_lr_scale)
        params = [p for g in groups for p in g["params"]]
        optim = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  betas=(0.9, 0.98))
        gen = torch.Generator().manual_seed(cfg.seed)
        losses: list[tuple[int, int, float]] = []
        steps_mix = mix.schedule(cfg.mix)
        start = time.perf_counter()
        model.train()
        window: list[float] = []
        for step in range(cfg.steps):
            entry = steps_mix[step % len(steps_mix)]
            longest = mix.longest_for(entry, cfg.longest(step))
            u = float(torch.rand((), generator=gen))
            patches = round(math.exp(math.log(cfg.min_patches)
                                     + u * (math.log(longest) - math.log(cfg.min_patches))))
            patches = max(patches, cfg.min_patches)
            batch = max(1, min(cfg.max_batch, cfg.batch_tokens // (4 * patches)))
            for group in optim.param_groups:
                group["lr"] = _lr_at(cfg, step) * group["scale"]
            if entry == mix.LOOKUP:  # text only; its own seeded draw per step
                batch_enc = lookup_batch(processor.tokenizer, random.Random(
                    cfg.seed * 1_000_003 + step), LOOKUP_BATCH, bt.SPECIAL_IDS["<|endoftext|>"])
            else:
                batch_enc = collate([encoder(t.sample, threshold=t.threshold) for t in (
                    mix.make_task(entry, patches=patches, index=step * cfg.max_batch + j,
                                  seed=cfg.seed + SEED_OFFSETS["train"]) for j in range(batch))])
            loss = answer_loss(forward(model, batch_enc).logits, batch_enc.labels)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            window.append(float(loss.detach()))
            if (step + 1) % 25 == 0 or step + 1 == cfg.steps:
                mean = sum(window) / len(window)
                losses.append((step + 1, longest, round(mean, 4)))
                window = []
                if progress:
                    elapsed = time.perf_counter() - start
                    print(f"step {step + 1}/{cfg.steps}  loss {mean:.4f}  longest {longest} "
                          f"patches  {elapsed:.0f}s", file=progress, flush=True)
            if progress and cfg.probe_every and (step + 1) % cfg.probe_every == 0:
                grow.print_probe(step + 1, grow.probe(lambda t: answers_greedily(
                    model, encoder(t.sample)), cfg.seed + SEED_OFFSETS["heldout"],
                    form=mix.answer_form(cfg.mix)), progress)
        train_s = time.perf_counter() - start
        model.eval()
        model = model.to(torch.bfloat16).float()  # evaluate exactly the weights shipped
        accuracy, by_answer = heldout_accuracy(model, encoder, cfg, progress)
        mix_accuracy = {} if cfg.mix == "needles" else mix.heldout_accuracy(
            lambda t: answers_greedily(model, encoder(t.sample, threshold=t.threshold)),
            cfg.eval_samples, cfg.seed + SEED_OFFSETS["heldout"], cfg.max_patches, progress,
            mix.answer_form(cfg.mix))
        model.to(torch.bfloat16).save_pretrained(tmp)
        write_json(tmp / "training.json", {
            "generator": "apbv.synthetic.train_tiny", "format_version": FORMAT_VERSION,
            "command": command, "config": asdict(cfg), "torch": torch.__version__,
            "init_weights_sha256": init_sha256,
            "init_heldout_accuracy": init_record.get("heldout_accuracy"),
            "train_seconds": round(train_s, 1), "threads": cfg.threads,
            "parameters": sum(p.numel() for p in model.parameters()),
            "loss_every_25_steps": losses, "heldout_accuracy": accuracy,
            "heldout_right_of_count_per_answer": by_answer,
            "mix": {"schedule": steps_mix, "length_caps": mix.LENGTH_CAPS,
                    "pruned_thresholds": mix.TRAIN_THRESHOLDS},
            "heldout_mix_accuracy": mix_accuracy,
            "heldout": {"seed": cfg.seed + SEED_OFFSETS["heldout"],
                        "samples_per_cell": cfg.eval_samples,
                        "decoding": "greedy, single process, full causal attention"},
        })
        for path in tmp.iterdir():
            os.chmod(path, 0o644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        return out
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

