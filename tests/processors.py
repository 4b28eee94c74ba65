"""Real transformers processors for the tiny vision-language models of `tfcompat.tiny_models`, built offline.

A processor is the family's processor class around its image processor (the PIL backend where transformers has two:
without torchvision the torchvision one cannot load) and a tokenizer of the family's tokenizer class loaded from a
tokenizer file written here: a character vocabulary (no merges: each letter is one token) whose special tokens sit at
the ids the tiny config names (image placeholder, image start / end, ...). Sizes follow the tiny tower (32 x 32
images of 8 x 8 patches; `tfcompat.tiny_models`): the processor's size arguments are set, never the model's.
Nothing is downloaded; there is no chat template (none ships with transformers), so prompts are written with each
family's placeholder conventions (`Recipe.prompt`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import string
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from tfcompat.tiny_models import VOCAB, special_token_ids

# the letters of every prompt and the word separators of the byte-level and metaspace pre-tokenizers
_CHARACTERS = [*string.ascii_lowercase, "\u0120", "\u2581", " ", "\n", "\u010a"]
# the special tokens a tokenizer class may add for itself: kept inside the tiny vocab
_COMMON = ["<unk>", "<s>", "</s>", "<pad>", "<bos>", "<eos>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How to build one family's processor for its tiny model.

    tokens: special token -> the config attribute holding its id (None: any free id of the tiny vocab).
    extra: tokenizer attributes the processor reads (``tokenizer.image_token`` ...) -> their token.
    image: image processor arguments (sizes of the tiny tower). processor: processor arguments.
    prompt: the text that stands for one image in a prompt.
    tokenizer_class: a tokenizer class to load instead of the family's (None: the family's, by ``AutoTokenizer``).
    image_processor_class: where ``AutoImageProcessor`` does not know the family (InternVL on 4.x).
    images_required: the processor refuses text alone (PaliGemma): a text-only sample is its tokenizer's output.
    video: video processor arguments where the processor takes videos (its class by ``AutoVideoProcessor``, a
    torchvision one) and the family packs them: `samples` then adds text around a short video where torchvision is
    installed (the images alone without it); None: none.
    video_prompt: the text that stands for one video.
    video_required: the processor reads its video processor when built (MiniCPM-V 4.6): none builds without torchvision.
    call: processor call arguments (``return_mm_token_type_ids`` where the model needs them and the processor returns
    none by default: Cosmos3 Edge).
    """

    tokens: dict[str, str | None]
    prompt: str
    extra: dict[str, str] = dataclasses.field(default_factory=dict)
    image: dict[str, Any] = dataclasses.field(default_factory=dict)
    processor: dict[str, Any] = dataclasses.field(default_factory=dict)
    tokenizer_class: str | None = None
    image_processor_class: str | None = None
    images_required: bool = False
    video: dict[str, Any] | None = None
    video_prompt: str = ""
    video_required: bool = False
    call: dict[str, Any] = dataclasses.field(default_factory=dict)


_QWEN_TOKENS: dict[str, str | None] = {"<|image_pad|>": "image_token_id", "<|video_pad|>": "video_token_id",
                                       "<|vision_start|>": "vision_start_token_id",
                                       "<|vision_end|>": "vision_end_token_id"}
# Qwen-style towers take flattened patches: the 8 x 8 patches of the tiny tower, merged 2 x 2, at most 64 x 64 pixels
_QWEN_IMAGE = {"patch_size": 8, "merge_size": 2, "temporal_patch_size": 2,
               "size": {"shortest_edge": 16 * 16, "longest_edge": 64 * 64},  # 5.x
               "min_pixels": 16 * 16, "max_pixels": 64 * 64}  # 4.x
_IDEFICS3 = Recipe(
    tokens={"<image>": "image_token_id", "<fake_token_around_image>": None, "<global-img>": None,
            "<end_of_utterance>": None, **{f"<row_{r}_col_{c}>": None for r in (1, 2) for c in (1, 2)}},
    prompt="<image>",
    # one 32 x 32 tile (4 tokens after the 2 x 2 pixel shuffle), split into 2 x 2 tiles plus the global one when larger
    image={"size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32}},
    processor={"image_seq_len": 4}, tokenizer_class="PreTrainedTokenizerFast",
)

RECIPES: dict[str, Recipe] = {
    "qwen2_5_vl": Recipe(tokens=_QWEN_TOKENS, prompt="<|vision_start|><|image_pad|><|vision_end|>", image=_QWEN_IMAGE),
    "qwen3_vl": Recipe(tokens=_QWEN_TOKENS, prompt="<|vision_start|><|image_pad|><|vision_end|>", image=_QWEN_IMAGE),
    "glm4v": Recipe(
        tokens={"<|image|>": "image_token_id", "<|video|>": "video_token_id",
                "<|begin_of_image|>": "image_start_token_id", "<|end_of_image|>": "image_end_token_id",
                "<|begin_of_video|>": "video_start_token_id", "<|end_of_video|>": "video_end_token_id"},
        prompt="<|begin_of_image|><|image|><|end_of_image|>", image=_QWEN_IMAGE,
        tokenizer_class="PreTrainedTokenizerFast"),
    "llava_onevision": Recipe(
        tokens={"<image>": "image_token_index", "<video>": "video_token_index"}, prompt="<image>",
        image={"size": {"height": 32, "width": 32}, "image_grid_pinpoints": [[32, 32]]},
        processor={"num_image_tokens": 16, "vision_feature_select_strategy": "full"},
        video={"size": {"height": 32, "width": 32}, "do_sample_frames": False}, video_prompt="<video>"),
    "llava_next": Recipe(
        tokens={"<image>": "image_token_index"}, prompt="<image>",
        image={"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32},
               "image_grid_pinpoints": [[32, 32]]},
        processor={"patch_size": 8, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}),
    "internvl": Recipe(
        tokens={"<IMG_CONTEXT>": "image_token_id", "<img>": None, "</img>": None, "<video>": None},
        extra={"context_image_token": "<IMG_CONTEXT>", "start_image_token": "<img>", "end_image_token": "</img>",
               "video_token": "<video>"},
        prompt="<IMG_CONTEXT>",
        # 32 x 32 tiles, the image cropped into up to 4 of them plus its thumbnail; 4 tokens a tile
        image={"size": {"height": 32, "width": 32}, "crop_to_patches": True, "max_patches": 4},
        processor={"image_seq_length": 4}, image_processor_class="GotOcr2ImageProcessor",
        video={"size": {"height": 32, "width": 32}, "do_sample_frames": False}, video_prompt="<video>"),
    "gemma3": Recipe(
        tokens={"<image_soft_token>": "image_token_index", "<start_of_image>": "boi_token_index",
                "<end_of_image>": "eoi_token_index"},
        extra={"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"},
        prompt="<start_of_image>", image={"size": {"height": 32, "width": 32}},
        processor={"image_seq_length": 4}),
    "mistral3": Recipe(
        tokens={"[IMG]": "image_token_index", "[IMG_BREAK]": None, "[IMG_END]": None}, prompt="[IMG]",
        image={"patch_size": 8, "size": {"longest_edge": 32}},  # the tiny tower's rotary table: 4 x 4 patches
        processor={"patch_size": 8, "spatial_merge_size": 2}, tokenizer_class="PreTrainedTokenizerFast"),
    "qwen2_vl": Recipe(tokens=_QWEN_TOKENS, prompt="<|vision_start|><|image_pad|><|vision_end|>", image=_QWEN_IMAGE),
    "qwen3_5": Recipe(tokens=_QWEN_TOKENS, prompt="<|vision_start|><|image_pad|><|vision_end|>", image=_QWEN_IMAGE),
    "llava": Recipe(
        tokens={"<image>": "image_token_index"}, prompt="<image>",
        image={"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}},
        processor={"patch_size": 8, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}),
    "paligemma": Recipe(
        tokens={"<image>": "image_token_index"}, extra={"image_token": "<image>"}, prompt="<image>",
        image={"size": {"height": 32, "width": 32}, "image_seq_length": 16}, images_required=True,
        tokenizer_class="GemmaTokenizerFast"),  # 4.x checks the class; 5.x names GemmaTokenizer so too
    "aya_vision": Recipe(
        tokens={"<|IMG_PATCH|>": "image_token_index", "<image>": None, "<|START_OF_IMG|>": None,
                "<|END_OF_IMG|>": None, "<|IMG_LINE_BREAK|>": None, "TILE": None, "TILE_GLOBAL": None},
        prompt="<image>",
        # 32 x 32 tiles of 8 x 8 patches, pixel-shuffled 2 x 2: 4 tokens a tile
        image={"size": {"height": 32, "width": 32}, "crop_to_patches": True, "max_patches": 4},
        processor={"patch_size": 8, "img_size": 32, "downsample_factor": 2},
        image_processor_class="GotOcr2ImageProcessor"),
    "idefics3": _IDEFICS3,
    "smolvlm": _IDEFICS3,
    "gemma4": Recipe(
        tokens={"<|image|>": "image_token_id", "<|image>": "boi_token_id", "<image|>": "eoi_token_id",
                "<|video|>": "video_token_id", "<|audio|>": "audio_token_id", "<|audio>": "boa_token_id",
                "<audio|>": "eoa_token_index"},
        # the processor refuses any input while the tokenizer names no audio start / end (its condition's precedence)
        extra={"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
               "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}, prompt="<|image|>",
        # 8 x 8 patches pooled 3 x 3; 70 soft tokens at most, the fewest the image processor takes
        image={"patch_size": 8, "pooling_kernel_size": 3, "max_soft_tokens": 70},
        video={"patch_size": 8, "pooling_kernel_size": 3, "max_soft_tokens": 70, "do_sample_frames": False},
        video_prompt="<|video|>"),
    "deepseek_vl": Recipe(
        tokens={"<image_placeholder>": "image_token_id"}, extra={"image_token": "<image_placeholder>"},
        prompt="<image_placeholder>", image={"size": {"height": 32, "width": 32}, "min_size": 8},
        processor={"num_image_tokens": 16}),
    "janus": Recipe(
        tokens={"<image_placeholder>": "image_token_id", "<begin_of_image>": None, "<end_of_image>": None},
        extra={"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>", "eoi_token": "<end_of_image>"},
        prompt="<image_placeholder>", image={"size": {"height": 32, "width": 32}, "min_size": 8},
        processor={"num_image_tokens": 16}, image_processor_class="JanusImageProcessor"),  # 4.53 maps it as "J"
    "ovis2": Recipe(
        tokens={"<IMG_ATOM>": "image_token_id", "<image>": None, "<IMG_START>": "visual_indicator_token_ids[0]",
                "<IMG_GRID>": "visual_indicator_token_ids[1]", "<IMG_COL>": "visual_indicator_token_ids[2]",
                "<IMG_ROW>": "visual_indicator_token_ids[3]", "<IMG_END>": "visual_indicator_token_ids[4]"},
        prompt="<image>",
        # 32 x 32 tiles of 8 x 8 patches (the tiny visual tokenizer's hidden stride 1): 16 tokens a tile, up to 4
        image={"size": {"height": 32, "width": 32}, "crop_to_patches": True, "max_patches": 4},
        processor={"image_seq_length": 16}, tokenizer_class="PreTrainedTokenizerFast"),  # 4.57 maps no tokenizer
    "paddleocr_vl": Recipe(
        tokens=_QWEN_TOKENS, prompt="<|vision_start|><|image_pad|><|vision_end|>",
        extra={"image_token": "<|image_pad|>"},
        image={"patch_size": 8, "merge_size": 2, "temporal_patch_size": 1,
               "size": {"shortest_edge": 16 * 16, "longest_edge": 64 * 64}}),
    "cosmos3_edge": Recipe(
        tokens=_QWEN_TOKENS, prompt="<|vision_start|><|image_pad|><|vision_end|>",
        image={**_QWEN_IMAGE, "temporal_patch_size": 1},  # one frame a patch
        video={**_QWEN_IMAGE, "temporal_patch_size": 1, "do_sample_frames": False, "return_metadata": True},
        call={"return_mm_token_type_ids": True}, video_prompt="<|vision_start|><|video_pad|><|vision_end|>"),
    "minicpmv4_6": Recipe(
        tokens={"<|image_pad|>": "image_token_id", "<|video_pad|>": "video_token_id", "<image>": None,
                "</image>": None, "<slice>": None, "</slice>": None, "<image_id>": None, "</image_id>": None},
        extra={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "image_start_token": "<image>",
               "image_end_token": "</image>", "slice_start_token": "<slice>", "slice_end_token": "</slice>",
               "image_id_start_token": "<image_id>", "image_id_end_token": "</image_id>"},
        prompt="<|image_pad|>",
        # 32 x 32 slices of 8 x 8 patches, 4 x 4 merged ("16x"): one token a slice, up to 4 slices and the overview
        image={"patch_size": 8, "scale_resolution": 32, "max_slice_nums": 4},
        video={"patch_size": 8, "scale_resolution": 32, "max_slice_nums": 1, "do_sample_frames": False},
        video_prompt="<|video_pad|>", video_required=True, tokenizer_class="PreTrainedTokenizerFast"),
    # torchvision-only image processors on 5.x (`needs_torchvision` in tests/test_processors.py):
    "lfm2_vl": Recipe(
        tokens={"<image>": "image_token_id", "<|image_start|>": None, "<|image_end|>": None,
                "<|img_thumbnail|>": None, **{f"<|img_row_{r}_col_{c}|>": None for r in (1, 2) for c in (1, 2)}},
        prompt="<image>",
        # 32 x 32 tiles of 8 x 8 patches (the tiny SigLIP2's), 2 x 2 pixel-unshuffled: 4-16 tokens an image or tile
        image={"encoder_patch_size": 8, "tile_size": 32, "downsample_factor": 2, "min_image_tokens": 1,
               "max_image_tokens": 16, "min_tiles": 2, "max_tiles": 4, "size": {"height": 32, "width": 32}},
        tokenizer_class="PreTrainedTokenizerFast"),
    "llama4": Recipe(
        # the prompt's <|image|> becomes the image's <|patch|> run: its tokens are the config's image_token_index
        tokens={"<|patch|>": "image_token_index", "<|image_start|>": None, "<|image_end|>": None,
                "<|image|>": None, "<|tile_x_separator|>": None, "<|tile_y_separator|>": None},
        prompt="<|image|>",
        # 32 x 32 tiles of 8 x 8 patches, pixel-shuffled by 0.5: 4 tokens a tile, up to 4 tiles and the global one
        image={"size": {"height": 32, "width": 32}, "max_patches": 4},
        processor={"patch_size": 8, "pixel_shuffle_ratio": 0.5}, tokenizer_class="PreTrainedTokenizerFast"),
    "kimi_k25": Recipe(
        tokens={"<|media_pad|>": "image_token_id", "<|kimi_k25_video_placeholder|>": "video_token_id",
                "<|media_begin|>": "vision_start_token_id", "<|media_end|>": "vision_end_token_id",
                "<|media_content|>": None},
        prompt="<|media_begin|>image<|media_content|><|media_pad|><|media_end|>",
        # 8 x 8 patches merged 2 x 2, at most 64 x 64 pixels
        image={"patch_size": 8, "merge_size": 2, "size": {"max_height": 64, "max_width": 64}, "max_patches": 64},
        video={"patch_size": 8, "merge_size": 2, "size": {"max_height": 32, "max_width": 32}, "max_patches": 16,
               "do_sample_frames": False, "return_metadata": True},
        video_prompt="<|kimi_k25_video_placeholder|>", tokenizer_class="PreTrainedTokenizerFast"),
    "cohere2_vision": Recipe(
        tokens={"<|IMG_PATCH|>": "image_token_id", "<|START_OF_IMG|>": None, "<|END_OF_IMG|>": None,
                "<|IMG_LINE_BREAK|>": None},
        extra={"image_token": "<|IMG_PATCH|>", "boi_token": "<|START_OF_IMG|>", "eoi_token": "<|END_OF_IMG|>",
               "img_line_break_token": "<|IMG_LINE_BREAK|>"},
        prompt="<|IMG_PATCH|>",
        # 32 x 32 tiles of 8 x 8 patches, pixel-shuffled 2 x 2: 2 x 2 tokens a tile (the processor's `patch_size`)
        image={"size": {"height": 32, "width": 32}, "max_patches": 4, "patch_size": 2},
        tokenizer_class="PreTrainedTokenizerFast"),
    "minimax_m3_vl": Recipe(
        tokens={"]<]image[>[": "image_token_index", "]<]video[>[": "video_token_index", "]<]start of image[>[": None,
                "]<]end of image[>[": None},
        prompt="]<]image[>[", image=_QWEN_IMAGE, tokenizer_class="PreTrainedTokenizerFast"),
    "perception_lm": Recipe(
        tokens={"<|image|>": "image_token_id", "<|video|>": "video_token_id"},
        extra={"image_token": "<|image|>", "video_token": "<|video|>"}, prompt="<|image|>",
        # the tiny PE ViT's 28 x 28 tiles of 14 x 14 patches, unpooled (`projector_pooling_ratio` 1): 4 tokens a tile
        image={"tile_size": 28, "max_num_tiles": 4, "size": {"height": 28, "width": 28}},
        processor={"patch_size": 14, "pooling_ratio": 1}, tokenizer_class="PreTrainedTokenizerFast",
        video={"size": {"height": 28, "width": 28}, "do_sample_frames": False}, video_prompt="<|video|>"),
}


def text(seed: int, n: int) -> str:
    """``n`` lowercase words of 1-4 letters, seeded: one token a letter, one a separator."""
    g = torch.Generator().manual_seed(seed)
    words = []
    for _ in range(n):
        k = int(torch.randint(1, 5, (1,), generator=g))
        words.append("".join(string.ascii_lowercase[int(i)] for i in torch.randint(26, (k,), generator=g)))
    return " ".join(words)


def image(height: int, width: int, seed: int) -> Any:
    """A random RGB ``PIL.Image`` of ``height x width``."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def token_id(config: Any, attr: str | None) -> int | None:
    """The id ``config`` names ``attr``, on the model config or its text config; None where neither names one (4.53's
    Qwen2.5-VL config names no vision start / end ids: the token then takes a free id)."""
    if attr is not None and attr.endswith("]"):  # "name[i]": the i-th of a list of ids (Ovis2's visual indicators)
        name, index = attr[:-1].split("[")
        ids = token_id(config, name)
        return None if ids is None else ids[int(index)]
    value = None if attr is None else getattr(config, attr, None)
    return value if value is not None or attr is None else getattr(config.get_text_config(), attr, None)


def _tokenizer_files(config: Any, recipe: Recipe, folder: str) -> None:
    """tokenizer.json (a character BPE without merges, the recipe's tokens at their config ids), its config, and the
    model's config.json (AutoTokenizer reads the family from it)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    named = {tok: token_id(config, attr) for tok, attr in recipe.tokens.items()}
    vocab = {tok: i for tok, i in named.items() if i is not None}
    taken = special_token_ids(config) | set(vocab.values())
    free = iter(i for i in range(VOCAB) if i not in taken)
    names = [t for t, i in named.items() if i is None] + _CHARACTERS + _COMMON
    vocab.update({tok: next(free) for tok in names if tok not in vocab})
    vocab.update({f"<filler_{i}>": i for i in free})  # every id below VOCAB taken: a class's own tokens land none above
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in recipe.tokens])
    tok.save(f"{folder}/tokenizer.json")
    settings: dict[str, Any] = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    if recipe.extra:
        settings["extra_special_tokens"] = recipe.extra
    if recipe.tokenizer_class is not None:
        settings["tokenizer_class"] = recipe.tokenizer_class
    with open(f"{folder}/tokenizer_config.json", "w") as f:
        json.dump(settings, f)
    with open(f"{folder}/preprocessor_config.json", "w") as f:
        # AutoImageProcessor picks the family's class from config.json where none is named
        json.dump({} if recipe.image_processor_class is None else
                  {"image_processor_type": recipe.image_processor_class}, f)
    if recipe.video is not None:  # AutoVideoProcessor picks the family's class from config.json too
        with open(f"{folder}/video_preprocessor_config.json", "w") as f:
            json.dump({}, f)
    config.save_pretrained(folder)


@contextlib.contextmanager
def _absent_parts_unchecked() -> Iterator[None]:
    """transformers 5.x checks each part of a processor by class, an absent one (None) too: a video processor without
    torchvision (the class is then a placeholder), the audio feature extractor of a processor built here for images
    (Gemma 4). The check is skipped for absent parts while a processor is built."""
    from transformers import processing_utils

    original = processing_utils.ProcessorMixin.check_argument_for_proper_class

    def check(self: Any, name: str, argument: Any) -> Any:
        return type(argument) if argument is None else original(self, name, argument)

    processing_utils.ProcessorMixin.check_argument_for_proper_class = check  # type: ignore[method-assign]
    try:
        yield
    finally:
        processing_utils.ProcessorMixin.check_argument_for_proper_class = original  # type: ignore[method-assign]


def build(model: torch.nn.Module) -> Any:
    """The family's processor for the tiny ``model`` (`RECIPES`), built offline."""
    import transformers
    from tokenizers import AddedToken
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    from transformers.utils import is_torchvision_available

    config: Any = model.config
    recipe = RECIPES[config.model_type]
    with tempfile.TemporaryDirectory() as folder:
        _tokenizer_files(config, recipe, folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        image_processor = AutoImageProcessor.from_pretrained(folder, **recipe.image)
        video_processor = (_video_processor(folder, recipe.video)
                           if recipe.video is not None and is_torchvision_available() else None)
    for key, value in recipe.image.items():  # 4.x image processors drop arguments they have no parameter for
        if not hasattr(image_processor, key):
            setattr(image_processor, key, value)
    # a class that rebuilds its vocabulary (5.x GemmaTokenizer) may keep some added tokens as plain words
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in recipe.tokens], special_tokens=True)
    for token, attr in recipe.tokens.items():
        if token_id(config, attr) is not None and tokenizer.convert_tokens_to_ids(token) != token_id(config, attr):
            raise AssertionError(f"{type(tokenizer).__name__} gives {token} id "
                                 f"{tokenizer.convert_tokens_to_ids(token)}, the config {token_id(config, attr)}")
    cls = getattr(transformers, PROCESSOR_MAPPING_NAMES[config.model_type])
    takes_videos = "video_processor" in inspect.signature(cls.__init__).parameters
    extra = {"video_processor": video_processor} if takes_videos else {}
    if "feature_extractor" in inspect.signature(cls.__init__).parameters:  # an audio tower's (Gemma 4): none here
        extra["feature_extractor"] = None
    with _absent_parts_unchecked():
        return cls(image_processor=image_processor, tokenizer=tokenizer, **extra, **recipe.processor)


def torchvision_classes(model_type: str) -> list[str]:
    """The classes of ``model_type``'s recipe that exist only with torchvision on the installed transformers: its image
    processor where the auto mapping names no PIL one (5.x: ``{"torchvision": ...}`` alone; 4.x maps a slow class
    first), and its video processor where the processor needs one to be built (`Recipe.video_required`; otherwise
    the recipe's video sample is left out without torchvision)."""
    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    recipe = RECIPES[model_type]
    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type)
    needed = []
    if recipe.image_processor_class is None and isinstance(names, dict) and "pil" not in names:
        needed.append(names["torchvision"])
    elif recipe.image_processor_class is None and isinstance(names, tuple):
        # 4.x without torchvision: the fast slot emptied, the slow one named after the fast class where none exists
        try:
            slow = names[0] and getattr(transformers, names[0])
        except (AttributeError, ValueError):
            slow = None
        if not slow:
            needed.append(f"{model_type}'s image processor (a fast class)")
    return needed + (["its video processor"] if recipe.video_required else [])


def _video_processor(folder: str, arguments: dict[str, Any]) -> Any:
    """The family's video processor (`AutoVideoProcessor` by the config.json in ``folder``) with ``arguments``."""
    from transformers import AutoVideoProcessor

    return AutoVideoProcessor.from_pretrained(folder, **arguments)


def video(frames: int, height: int, width: int, seed: int) -> Any:
    """Random RGB frames, a ``(frames, height, width, 3)`` uint8 numpy array (a decoded video)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (frames, height, width, 3), generator=g, dtype=torch.uint8).numpy()


def samples(processor: Any, model_type: str, seed: int = 0) -> list[Any]:
    """Three samples processed one at a time (``return_tensors='pt'``): text around a 37 x 53 image, text alone,
    text around a 64 x 48 image and text around the 37 x 53 one again; where the processor has a video processor
    (`build`: the recipe takes videos, torchvision is installed) a fourth, text around a two-frame 40 x 30 video."""
    recipe = RECIPES[model_type]
    prompt = recipe.prompt
    one = processor(text=[f"{text(seed, 3)} {prompt} {text(seed + 1, 2)}"], images=[image(37, 53, seed)],
                    return_tensors="pt", **recipe.call)
    alone = (processor.tokenizer if RECIPES[model_type].images_required else processor)(
        text=[text(seed + 2, 5)], return_tensors="pt", **({} if recipe.images_required else recipe.call))
    two = processor(text=[f"{text(seed + 3, 2)} {prompt} {text(seed + 4, 2)} {prompt} {text(seed + 5, 1)}"],
                    images=[image(64, 48, seed + 6), image(37, 53, seed + 7)], return_tensors="pt", **recipe.call)
    if getattr(processor, "video_processor", None) is None:
        return [one, alone, two]
    clip = processor(text=[f"{text(seed + 8, 2)} {recipe.video_prompt} {text(seed + 9, 3)}"],
                     videos=[video(2, 40, 30, seed + 10)], return_tensors="pt", **recipe.call)
    return [one, alone, two, clip]
