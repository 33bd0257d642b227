"""How fast a tiny decoder learns the lookup of a multiple-choice answer's letter (text only).

    PYTHONPATH=. python benchmarks/letter_lookup.py                      # the shipped checkpoint
    PYTHONPATH=. python benchmarks/letter_lookup.py --grow 2             # two layers appended
    PYTHONPATH=. python benchmarks/letter_lookup.py --copy-steps 5000    # random lists first
    PYTHONPATH=. python benchmarks/letter_lookup.py --fresh --hidden 128 --heads 4 \\
        --kv-heads 4 --rope-theta 1e4 --out benchmarks/results/letter_lookup_wide

To answer a needle question with ``green (B)``, the tiny model must find the option line that
names what it saw and copy that line's letter. This isolates that second half, without video,
on :mod:`apbv.synthetic.lookup`'s samples (the harness's question, then every option named
with its letter; the loss on the letters only). It prints (and writes to ``--out``.md/.json)
the held-out accuracy of the first lookup of each sample, per needle kind (retrieval: colour
words, 4-5 options; counting: digits, 4; presence: yes/no, 2), every ``--every`` steps.
Chance is 1/4.5, 1/4 and 1/2. It trains the language model only, so a run answers "can this
shape learn the lookup, and how soon", before an hour of video training; ``--save DIR``
keeps the trained checkpoint. ``--copy-steps`` first trains on the same lookup over random
lists (:func:`apbv.synthetic.lookup.copy_sample`: 2-8 lines of random words, every word named
with its letter), the held-out rows still asking the harness's format.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apbv.synthetic.lookup import (  # noqa: E402
    HELDOUT_SEED,
    KINDS,
    copy_sample,
    lookup_sample,
    pad_samples,
)


def _model(args: argparse.Namespace) -> Any:
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from apbv.synthetic.train_tiny import build_model, trained_config

    if not args.fresh:
        return build_model(args.seed, args.model, args.grow)
    if args.hidden % args.heads or (args.hidden // args.heads) % 4:
        raise ValueError(f"--hidden {args.hidden} must split into --heads {args.heads} heads "
                         "of a multiple of 4 dimensions")
    config = trained_config()
    text = config.text_config
    head_dim = args.hidden // args.heads
    pairs = head_dim // 2
    section = [pairs - 2 * (3 * pairs // 8), 3 * pairs // 8, 3 * pairs // 8]  # Qwen's 2:3:3
    text.update(dict(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                     num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                     head_dim=head_dim, num_hidden_layers=args.layers,
                     layer_types=["full_attention"] * args.layers,
                     max_window_layers=args.layers,
                     rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta,
                                      "mrope_section": section}))
    config.vision_config.out_hidden_size = args.hidden
    torch.manual_seed(args.seed)
    return Qwen2_5_VLForConditionalGeneration(config).float()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="apbv/assets/needle-tiny",
                   help="checkpoint whose weights (and tokenizer) start the run")
    p.add_argument("--grow", type=int, default=0, help="decoder layers appended to --model's")
    p.add_argument("--old-lr-scale", type=float, default=1.0,
                   help="with --grow: the rate of the other weights, times the grown layers' "
                        "(0: frozen)")
    p.add_argument("--fresh", action="store_true",
                   help="random weights of the shape below instead of --model's")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rope-theta", type=float, default=1e6)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--copy-steps", type=int, default=0,
                   help="warm-up steps of random lists (copy_sample) before --steps")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--heldout", type=int, default=64, help="held-out samples per kind")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="write OUT.md and OUT.json")
    p.add_argument("--save", metavar="DIR",
                   help="write the trained checkpoint (bf16, as train-tiny writes one) to DIR")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "every", "heldout", "threads", "hidden", "heads",
                 "kv_heads", "layers"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.copy_steps < 0:
        raise ValueError(f"--copy-steps must be >= 0, got {args.copy_steps}")
    if args.grow < 0 or (args.grow and args.fresh):
        raise ValueError("--grow takes a layer count >= 0, and only without --fresh")

    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    model = _model(args)
    lm, head = model.model.language_model, model.lm_head
    params = [q for q in {id(q): q for q in [*lm.parameters(), *head.parameters()]}.values()
              if q.requires_grad]  # the head may be tied to the embeddings: each tensor once
    groups = [{"params": params, "scale": 1.0}]
    if args.grow:  # the grown layers at the full rate, the rest at --old-lr-scale times it
        from apbv.synthetic.grow import param_groups

        ids = {id(q) for q in params}
        groups = [{**g, "params": [q for q in g["params"] if id(q) in ids]}
                  for g in param_groups(model, args.grow, args.old_lr_scale)]
        params = [q for g in groups for q in g["params"]]
    optim = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98))
    rng = random.Random(args.seed)
    held_rng = random.Random(HELDOUT_SEED)
    heldout: dict[str, list[tuple[list[int], list[int], str]]] = {k: [] for k in KINDS}
    while min(len(v) for v in heldout.values()) < args.heldout:
        ids, labels, kind = lookup_sample(tokenizer, held_rng)
        if len(heldout[kind]) < args.heldout:
            heldout[kind].append((ids, labels, kind))
    pad = tokenizer.pad_token_id or 0

    def logits(ids: Any) -> Any:
        return head(lm(input_ids=ids).last_hidden_state)[:, :-1]

    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    window: list[float] = []
    print(f"{sum(q.numel() for q in params)} parameters trained; chance 0.22 / 0.25 / 0.50",
          flush=True)
    total = args.copy_steps + args.steps
    for step in range(total):
        rate = args.lr * min(1.0, (step + 1) / 30) * (
            0.1 + 0.45 * (1 + math.cos(math.pi * step / total)))
        for group in optim.param_groups:
            group["lr"] = rate * group["scale"]
        model.train()
        make = copy_sample if step < args.copy_steps else lookup_sample
        ids, labels = pad_samples([make(tokenizer, rng) for _ in range(args.batch)], pad)
        loss = torch.nn.functional.cross_entropy(logits(ids).transpose(1, 2), labels[:, 1:],
                                                 ignore_index=-100)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        window.append(float(loss.detach()))
        if (step + 1) % args.every and step + 1 != total:
            continue
        model.eval()
        row: dict[str, Any] = {"step": step + 1, "loss": round(sum(window) / len(window), 4)}
        window = []
        with torch.no_grad():
            for kind, samples in heldout.items():
                ids, labels = pad_samples(samples, pad)
                targets = labels[:, 1:]
                first = ((targets != -100).cumsum(1) == 1) & (targets != -100)
                right = (logits(ids).argmax(-1) == targets) & first
                row[kind] = round(float(right.sum() / first.sum()), 3)
        row["seconds"] = round(time.perf_counter() - start)
        rows.append(row)
        print("  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    if args.save:
        from apbv.synthetic.train_tiny import write_support_files

        Path(args.save).mkdir(parents=True, exist_ok=True)
        write_support_files(Path(args.save))
        model.to(torch.bfloat16).save_pretrained(args.save)
    if args.out:
        shape = ("--model " + args.model + (f" --grow {args.grow}" if args.grow else "")
                 if not args.fresh else
                 f"fresh: hidden {args.hidden}, {args.heads} heads ({args.kv_heads} kv), "
                 f"{args.layers} layers, rope_theta {args.rope_theta:g}")
        lines = [f"# Letter lookup, text only: {shape}", "",
                 f"`python benchmarks/letter_lookup.py {' '.join(argv or sys.argv[1:])}`; "
                 f"{args.batch} samples a step, lr {args.lr:g}, {args.threads} thread(s); "
                 f"held-out first-lookup accuracy, {args.heldout} per kind (chance 0.22 / "
                 "0.25 / 0.50).", "",
                 "| step | loss | retrieval | counting | presence | s |",
                 "|---|---|---|---|---|---|"]
        lines += [f"| {r['step']} | {r['loss']} | {r['retrieval']} | {r['counting']} | "
                  f"{r['presence']} | {r['seconds']} |" for r in rows]
        Path(args.out + ".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
        Path(args.out + ".json").write_text(json.dumps({"args": vars(args), "rows": rows},
                                                       indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
