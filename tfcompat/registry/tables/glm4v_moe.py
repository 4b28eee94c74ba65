"""GLM-4.5V (``config.model_type == "glm4v_moe"``): the table of ``_glm_vl`` from 4.56, its first release.

Its MoE block routes every token on that token's own scores (sigmoid, group-limited top-k over the
``n_group`` expert groups of one token, no capacity, no batch statistic), on 4.56-4.57 through a
``ModuleList`` of expert MLPs, from 5.0 through the fused ``experts`` of ``@use_experts_implementation``;
so a packed row routes each token as its sequence alone does. The load-balancing loss (5.x, only with
``output_router_logits``) is a statistic of the whole batch, packed or padded alike.
"""

from __future__ import annotations

from ._glm_vl import glm_vl_family

FAMILY = glm_vl_family(
    "glm4v_moe", "Glm4vMoe", "Glm4vMoeConfig", first="4.56", first_why="first release (GLM-4.5V)",
    # 4 experts in 2 groups, top-2 from the best group, one shared expert; layer 0 dense, layer 1 MoE
    n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
    n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.0,
)
