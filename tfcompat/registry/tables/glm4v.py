"""GLM-4V (GLM-4.1V-Thinking), ``config.model_type == "glm4v"``: the table of ``_glm_vl``."""

from __future__ import annotations

from ._glm_vl import glm_vl_family

FAMILY = glm_vl_family("glm4v", "Glm4v", "Glm4vConfig")
