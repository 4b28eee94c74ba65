"""GLM-4.6V (``config.model_type == "glm46v"``): the table of ``_glm_vl`` from 5.0, its first release.

``Glm46VModel`` builds its language model with ``AutoModel.from_config(config.text_config)``; the text
config's default ``model_type`` is ``glm4v_text``, so its text classes are GLM-4.1V's
(``Entry.text_module``). Its processor writes a video frame's timestamp as ``f"{seconds:.1f} seconds"``.
"""

from __future__ import annotations

from ._glm_vl import glm_vl_family

FAMILY = glm_vl_family(
    "glm46v", "Glm46V", "Glm46VConfig", first="5.0", first_why="first release (GLM-4.6V)",
    text_module_of=("glm4v", "Glm4v"), timestamp_tokens=3,
)
