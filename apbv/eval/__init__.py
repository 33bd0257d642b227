"""The evaluation harness: LongVideoBench and VNBench from local files, on the engine.

- :mod:`apbv.eval.data`: the benchmarks' own annotation formats and their prompts;
- :mod:`apbv.eval.parse`: the deterministic option-letter parser;
- :mod:`apbv.eval.score`: accuracies (VNBench's 4-try rule) and the lmms-eval-style results;
- :mod:`apbv.eval.harness`: the resumable multi-rank loop (``python -m apbv eval``);
- :mod:`apbv.eval.settings`: the run's settings, stored with the output and checked on resume;
- :mod:`apbv.eval.store`: the JSONL of finished samples and the output lock;
- :mod:`apbv.eval.report`: the progress lines and the terminal summary;
- small synthetic datasets in both formats (``python -m apbv make-eval-fixtures``) are made
  in :mod:`apbv.synthetic.eval_fixtures` (synthetic data imports the formats, not the reverse).

Nothing heavy is imported here; import the submodule you need.
"""
