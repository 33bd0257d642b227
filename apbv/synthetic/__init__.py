"""Synthetic data made here, not downloaded: test videos (:mod:`~apbv.synthetic.videos`), needle
videos with questions and answers (:mod:`~apbv.synthetic.needles`), and the tiny model's training
on them (:mod:`~apbv.synthetic.train_tiny`) with its byte-level tokenizer
(:mod:`~apbv.synthetic.byte_tokenizer`)."""
