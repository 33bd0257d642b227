"""Each model family's lmms-eval prompt for the benchmarks, keyed by the checkpoint's
``config.json`` ``model_type`` (the family's row in :data:`apbv.model.families.FAMILIES`
carries it: :class:`apbv.model.families.EvalPrompt`).

lmms-eval builds a video question in two places: the task's ``doc_to_text`` (the user text,
the same for every model: :attr:`apbv.eval.data.Sample.prompt` writes it byte for byte) and the
model's wrapper, which adds the system turn and puts the video before the text. So a family's
prompt is the system turn's text its wrapper sends, with the sample's text unchanged after the
video (:func:`eval_prompt`); the video's own placeholders are the adapter's (e.g. InternVL3's
``FrameN: <img>...</img>`` lines, :mod:`apbv.model.internvl.prompt`). VNBench is no lmms-eval
task: its text is VideoNIAH's, with the same wrapper around it.

The wrappers, as read in lmms-eval's source (EvolvingLMMs-Lab/lmms-eval):

- ``qwen2_5_vl`` (``lmms_eval/models/simple/qwen2_5_vl.py``): system "You are a helpful
  assistant." (its ``system_prompt`` default), then a user turn of the video and the text.
  Qwen2.5-VL's chat template writes that same system turn by default, so none is passed.
- ``qwen3_vl`` (``lmms_eval/models/simple/qwen3_vl.py``): the same system text, passed as a
  system turn (Qwen3-VL's chat template has no default one), then the video and the text.
- ``internvl`` (``lmms_eval/models/simple/internvl3.py``, modality video): the user text is
  ``Frame{i}: <image>\\n`` per frame, then the text, sent through the checkpoint's ``chat``,
  whose ``internvl2_5`` conversation template (InternVL's ``conversation.py``, named by the
  InternVL3 checkpoints) opens with its system message
  :data:`apbv.model.families.INTERNVL_SYSTEM`.
"""

from __future__ import annotations

from apbv.eval.data import Sample
from apbv.model.families import FAMILIES, INTERNVL_SYSTEM, QWEN_SYSTEM, EvalPrompt

__all__ = ["INTERNVL_SYSTEM", "QWEN_SYSTEM", "EvalPrompt", "eval_prompt", "family_prompt"]


def family_prompt(model_type: str) -> EvalPrompt:
    """The lmms-eval prompt of the family whose ``config.json`` says ``model_type``
    (:attr:`apbv.model.families.Family.eval_prompt`), or ValueError naming the supported
    types."""
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"no lmms-eval prompt for model_type {model_type!r}; supported: "
                         f"{', '.join(FAMILIES)}")
    return family.eval_prompt


def eval_prompt(model_type: str, sample: Sample) -> tuple[str | None, str]:
    """(system text, user text after the video) of ``sample`` for the family of
    ``model_type``, as its lmms-eval wrapper sends them."""
    return family_prompt(model_type).system, sample.prompt
