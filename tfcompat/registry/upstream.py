"""Bugs of a stock model, in a range of transformers releases, that leave packing no correct stock model to match.

A derived family is exact when its stock forward computes each sequence's tokens from that sequence alone. Where a
release's stock code mixes tokens of one row (a routing score applied to another token's input), the stock model
run on one sequence and on a packed row differ before tfcompat changes anything, so the derived entry would be
"wrong" against its own oracle. Where a release's stock model cannot be built from its published config, or its
stock forward crashes on the inputs its processor gives, there is no stock model to pack. Each such bug is declared
here, per modeling module (and model type, where only one of the module's models has it) and release range (read
from the source of every release, never guessed); `tfcompat.registry.lookup` refuses the type on those releases at
`resolve()` / `patch()` naming the bug, and the tests check that the stock model does show the bug there.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from .versions import VersionRange

__all__ = ["UPSTREAM_BUGS", "UpstreamBug", "bug_in"]


@dataclass(frozen=True)
class UpstreamBug:
    """name: a short id; modules: the modeling modules whose models have the bug (a text model's, and those of the
    models around it as their language model, whose configs build it); versions: the releases that ship it;
    what: the bug, as the refusal's ``why``; fix: what the user can do; model_types: the types (``config.model_type``)
    whose models have it, where the modules' other models do not (empty: every type of the modules); needs: another
    distribution and its releases the bug needs besides transformers' (None: transformers' alone)."""

    name: str
    modules: tuple[str, ...]
    versions: VersionRange
    what: str
    fix: str
    model_types: tuple[str, ...] = ()
    needs: tuple[str, VersionRange] | None = None


UPSTREAM_BUGS: tuple[UpstreamBug, ...] = (
    UpstreamBug(
        "llama4_moe_scores_misaligned", ("transformers.models.llama4.modeling_llama4",), VersionRange("4.54", "4.56"),
        what="Llama4TextMoe.forward scales the expert-major copies of the tokens (hidden_states.repeat(E, 1)) by the "
        "token-major router scores (router_scores.reshape(-1, 1), no transpose): each token's expert input is "
        "scaled by other tokens' scores, so a token's output depends on the rest of its row (4.56 transposes)",
        fix="use transformers 4.53 or >= 4.56 for Llama 4"),
    UpstreamBug(
        "llama4_pad_token_id_on_composite", ("transformers.models.llama4.modeling_llama4",), VersionRange("5.0", "5.2"),
        what="Llama4ForConditionalGeneration.__init__ reads config.pad_token_id, which 5.x composite configs no longer "
        "hold (Llama4Config declares none; a published config names it in text_config only): the model does not "
        "build from its config (AttributeError; transformers#43525, fixed in 5.2); built with one set by hand, its "
        "forward with images still raises (it reads get_image_features(...).pooler_output, and the vision model "
        "returns a BaseModelOutput without one; 5.2 returns BaseModelOutputWithPooling)",
        fix="use transformers 4.53, 4.56-4.57 or >= 5.2 for Llama 4", model_types=("llama4",)),
    UpstreamBug(
        "llama4_output_image_outputs", ("transformers.models.llama4.modeling_llama4",), VersionRange("5.24", "5.25"),
        what="Llama4ForConditionalGeneration.forward builds its output with image_outputs=outputs.image_outputs, "
        "where outputs is the language model's MoeCausalLMOutputWithPast, which has no such field: every forward "
        "raises AttributeError, with or without images, return_dict or not (5.25 fixes it)",
        fix="use transformers 4.53, 4.56-4.57, 5.2-5.23 or 5.25 for Llama 4", model_types=("llama4",)),
    UpstreamBug(
        "bool_config_field_typed_int", tuple(f"transformers.models.{m}.modeling_{m}" for m in (
            "aya_vision", "big_bird", "chameleon", "cohere2", "cohere2_vision", "ernie4_5", "ernie4_5_moe",
            "ernie4_5_vl_moe", "falcon_h1", "mbart", "mvp", "olmo", "olmo2", "olmo3", "olmoe", "paddleocr_vl",
            "phimoe")),
        VersionRange("5.4", "5.5"),
        what="the config class (or its text config's) annotates a bool field as int (Cohere2Config.use_cache: int = "
        "True, Olmo2Config.tie_word_embeddings: int = False, Ernie4_5_MoeConfig.use_bias, ...), and huggingface_hub's "
        "strict validation (>= 1.9) rejects a bool for an int: the config builds neither from its class defaults nor "
        "from a published config.json, so the stock model does not exist (StrictDataclassFieldValidationError; "
        "transformers#45007 annotates them bool in 5.5)",
        fix="use transformers 5.3 or >= 5.5, or huggingface_hub < 1.9 with transformers 5.4",
        needs=("huggingface_hub", VersionRange("1.9"))),
    UpstreamBug(
        "smolvlm_image_blocks_of_patch_size", ("transformers.models.smolvlm.modeling_smolvlm",),
        VersionRange("5.20.1", "5.21"),
        what="SmolVLMModel.inputs_merger cuts the image features into blocks of vision_config.patch_size rows (a "
        "patch's side in pixels) instead of an image's token count: the stock forward raises (view / 'not divisible "
        "by patch_size') wherever an image's token count is not a multiple of the patch size (SmolVLM2-2.2B: 81 "
        "tokens, patch 14), so there is no stock model to match (5.20.0 and 5.21 take the count from the features)",
        fix="use transformers <= 5.20.0 or >= 5.21 for SmolVLM", model_types=("smolvlm",)),
    UpstreamBug(
        "doge_dynamic_mask_skipped_by_sdpa", ("transformers.models.doge.modeling_doge",), VersionRange("5.0", "5.18"),
        what="DogeModel adds its dynamic mask onto the causal mask it builds, but under sdpa (and the other "
        "implementations that may skip a mask) create_causal_mask returns None for a row without padding, so the "
        "attention runs causal without the dynamic mask, while eager, a padded batch and a packed row (whose mask is "
        "materialized) apply it: the stock model of one sequence has two answers (5.18 passes "
        "allow_is_causal_skip=False)",
        fix="use transformers 4.54-4.57 or >= 5.18 for Doge"),
)


def bug_in(module: str, version: str, model_type: str | None = None) -> UpstreamBug | None:
    """The declared bug of ``module`` on ``version`` (of the model type ``model_type``: a bug of some of the module's
    types counts for those only), or None."""
    return next((b for b in UPSTREAM_BUGS if module in b.modules and version in b.versions
                 and (not b.model_types or model_type in b.model_types) and _needs_installed(b)), None)


def _needs_installed(bug: UpstreamBug) -> bool:
    if bug.needs is None:
        return True
    name, releases = bug.needs
    try:
        return metadata.version(name) in releases
    except metadata.PackageNotFoundError:
        return False
