"""Each model family's lmms-eval prompt for the benchmarks, keyed by the checkpoint's
``config.json`` ``model_type`` (a family is listed here before its adapter exists).

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
  InternVL3 checkpoints) opens with its system message :data:`INTERNVL_SYSTEM`.
"""

from __future__ import annotations

from dataclasses import dataclass

from apbv.eval.data import Sample

QWEN_SYSTEM = "You are a helpful assistant."
"""The ``system_prompt`` default of lmms-eval's qwen2_5_vl and qwen3_vl wrappers."""
INTERNVL_SYSTEM = ("你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位"
                   "联合开发的多模态大语言模型。")
"""The ``system_message`` of InternVL's ``internvl2_5`` conversation template."""


@dataclass(frozen=True)
class FamilyPrompt:
    """What a family's lmms-eval wrapper adds around the task's text."""

    system: str | None
    """The system turn's text (None: the chat template's default turn is the wrapper's)."""
    wrapper: str
    """The lmms-eval model wrapper it follows (its file in lmms-eval)."""


FAMILY_PROMPTS = {
    "qwen2_5_vl": FamilyPrompt(None, "lmms_eval/models/simple/qwen2_5_vl.py"),
    "qwen3_vl": FamilyPrompt(QWEN_SYSTEM, "lmms_eval/models/simple/qwen3_vl.py"),
    "internvl": FamilyPrompt(INTERNVL_SYSTEM, "lmms_eval/models/simple/internvl3.py"),
}
"""``model_type`` -> the family's lmms-eval prompt."""


def family_prompt(model_type: str) -> FamilyPrompt:
    """The lmms-eval prompt of the family whose ``config.json`` says ``model_type``, or
    ValueError naming the supported types."""
    prompt = FAMILY_PROMPTS.get(model_type)
    if prompt is None:
        raise ValueError(f"no lmms-eval prompt for model_type {model_type!r}; supported: "
                         f"{', '.join(FAMILY_PROMPTS)}")
    return prompt


def eval_prompt(model_type: str, sample: Sample) -> tuple[str | None, str]:
    """(system text, user text after the video) of ``sample`` for the family of
    ``model_type``, as its lmms-eval wrapper sends them."""
    return family_prompt(model_type).system, sample.prompt
