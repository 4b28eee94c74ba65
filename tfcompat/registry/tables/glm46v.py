"""GLM-4.6V (``config.model_type == "glm46v"``): the table of ``_glm_vl`` from 5.0, its first release.

``Glm46VModel`` builds its language model with ``AutoModel.from_config(config.text_config)``; the text
config's default ``model_type`` is ``glm4v_text``, so its text classes are GLM-4.1V's
(``Entry.text_module``); a ``glm4v_moe_text`` config (the MoE GLM-4.6V) builds GLM-4.5V's MoE text model,
whose text half comes from the ``glm4v_moe`` entry of the same release (``Family.text_variants``). Its
processor writes a video frame's timestamp as ``f"{seconds:.1f} seconds"``.
"""

from __future__ import annotations

from ._glm_vl import glm_vl_family

FAMILY = glm_vl_family(
    "glm46v", "Glm46V", "Glm46VConfig", first="5.0", first_why="first release (GLM-4.6V)",
    text_module_of=("glm4v", "Glm4v"), timestamp_tokens=3, text_variants=(("glm4v_moe_text", "glm4v_moe"),),
)
