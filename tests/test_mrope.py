"""The installed M-RoPE index against each family's reference (`tfcompat.inputs.reference_rope`), on random layouts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tfcompat
from tfcompat.inputs.reference_rope import REFERENCES, Reference
from tfcompat.registry import installed_families
from tfcompat.registry.versions import installed_transformers
from tfcompat.selfcheck import tiny_model, vision_placeholder

FAMILIES = [k for k, f in installed_families().items() if f.reference_rope_index]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_model(request.param, "sdpa")


def reference(model) -> Reference:
    return REFERENCES[tfcompat.resolve(model.config.model_type).spec.reference_rope_index]


segment = st.one_of(
    st.tuples(st.just("text"), st.integers(1, 5)),
    st.tuples(st.just("image"), st.tuples(st.just(1), st.sampled_from([2, 4]), st.sampled_from([2, 4, 6]))),
    st.tuples(st.just("video"), st.tuples(st.integers(1, 3), st.sampled_from([2, 4]), st.sampled_from([2, 4]))),
)
row = st.tuples(st.lists(segment, min_size=1, max_size=5), st.sampled_from(["left", "right"]), st.integers(0, 3))


def build(config, rows, seconds):
    """Padded ``input_ids (B, L)``, ``attention_mask``, grids in order of appearance, seconds per video; a video's
    ``t`` counts temporal steps after the tower (times ``temporal_merge_size`` frames where the config has one)."""
    seqs, images, videos = [], [], []
    for segments, _, _ in rows:
        ids = []
        for kind, arg in segments:
            if kind == "text":
                ids += [7] * arg
                continue
            if kind == "video":  # frames: t merged steps of a tower that merges frames after it (ERNIE-4.5-VL)
                arg = (arg[0] * getattr(config.vision_config, "temporal_merge_size", 1), *arg[1:])
            ids += vision_placeholder(config, kind, arg)  # as the family's processor lays the item out
            (images if kind == "image" else videos).append(list(arg))
        seqs.append(ids)
    width = max(len(s) + pad for s, (_, _, pad) in zip(seqs, rows))
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for b, (ids, (_, side, _)) in enumerate(zip(seqs, rows)):
        span = slice(width - len(ids), width) if side == "left" else slice(0, len(ids))
        input_ids[b, span], mask[b, span] = torch.tensor(ids), 1
    grid = lambda g: torch.tensor(g) if g else None  # noqa: E731
    ts = torch.tensor(seconds[: len(videos)]) if videos and "tokens_per_second" in vars(config.vision_config) else None
    return input_ids, mask, grid(images), grid(videos), ts


class TestInstalledMatchesReference:
    """Rule: on attended tokens, the installed get_rope_index equals tfcompat's reference, up to the deviations
    its registry entry declares; anything else is a new transformers regression, named by version."""

    @settings(max_examples=25, deadline=None)
    @given(rows=st.lists(row, min_size=1, max_size=3),
           seconds=st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0]), min_size=15, max_size=15))
    def test_random_layouts(self, model, rows, seconds):
        entry = tfcompat.resolve(model.config.model_type).entry
        ids, mask, images, videos, ts = build(model.config, rows, seconds)
        if images is not None and "seconds_consumed_by_images" in entry.rope_index_deviations:
            ts = None  # this release would hand the videos' seconds to the images (and run out)
        if (videos is not None and "video_grid_unsplit" in entry.rope_index_deviations
                and bool((videos[:, 0] > 1).any())):
            with pytest.raises(tfcompat.InvalidInputError, match="impl='reference'"):  # refused, not a StopIteration
                tfcompat.rope_index(model, ids, image_grid_thw=images, video_grid_thw=videos, attention_mask=mask)
            return
        got = tfcompat.rope_index(model, ids, image_grid_thw=images, video_grid_thw=videos, attention_mask=mask,
                                  **({"second_per_grid_ts": ts} if ts is not None else {}))
        expected = reference(model).compute(model.config, ids, images, videos, ts, mask,
                                            deviations=entry.rope_index_deviations)
        keep = mask.bool()
        assert got.shape == (4, *ids.shape)
        assert torch.equal(got[0][keep], (mask.cumsum(-1) - 1)[keep])
        for b in range(ids.shape[0]):
            assert torch.equal(got[1:, b, keep[b]], expected[:, b, keep[b]]), (
                f"transformers {installed_transformers()} get_rope_index ({model.config.model_type}) disagrees with "
                f"the reference beyond its declared deviations {entry.rope_index_deviations} on row {b}: "
                f"{got[1:, b, keep[b]].tolist()} vs {expected[:, b, keep[b]].tolist()}"
            )


TRIGGERS = {
    # a 3-frame video of 1x1 merged patches at 0.5 s per grid step, then text
    "seconds_truncated": ([("text", 2), ("video", (3, 2, 2)), ("text", 2)], 0.5),
    "text_after_video_overlaps": ([("text", 2), ("video", (3, 2, 2)), ("text", 3)], 1.0),
    "vision_grid_flattened": ([("text", 2), ("video", (3, 2, 2)), ("text", 1)], 1.0),
    # the image takes the video's 2.0 s, the video finds none left
    "seconds_consumed_by_images": ([("image", (1, 2, 2)), ("video", (3, 2, 2)), ("text", 1)], 2.0),
    # Qwen3-VL: a 2-frame video whose first frame's run takes the whole grid
    "video_grid_unsplit": ([("text", 2), ("video", (2, 2, 2)), ("text", 1)], 1.0),
}


class TestDeclaredDeviationsAreReal:
    """Rule: every deviation a registry entry declares shows on the installed version; one fixed upstream fails
    here, naming the version, so the registry stays true."""

    def test_declared_deviations_reproduce(self, model):
        entry = tfcompat.resolve(model.config.model_type).entry
        known = reference(model).deviations
        assert set(entry.rope_index_deviations) <= known.keys()
        for name in entry.rope_index_deviations:
            segments, second = TRIGGERS[name]
            ids, mask, images, videos, ts = build(model.config, [(segments, "right", 0)], [second])
            try:
                if name == "video_grid_unsplit":  # tfcompat refuses it, so ask the installed index itself
                    owner = tfcompat.resolve(model.config.model_type).vision_modules(model, purpose="test").owner
                    types = tfcompat.resolve(model.config.model_type).spec.mm_token_types(model.config, ids)
                    owner.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=images, video_grid_thw=videos)
                    raise AssertionError(f"transformers {installed_transformers()} places multi-frame videos again: "
                                         f"drop 'video_grid_unsplit' from the registry entry {entry.versions}")
                got = tfcompat.rope_index(model, ids, image_grid_thw=images, video_grid_thw=videos,
                                          **({"second_per_grid_ts": ts} if ts is not None else {}))[1:]
            except (StopIteration, RuntimeError):  # ran out of seconds or grids: the deviation shows as a crash
                continue
            clean = reference(model).compute(model.config, ids, images, videos, ts)
            assert not torch.equal(got, clean), (
                f"transformers {installed_transformers()} no longer shows {name!r} ({known[name]}) for "
                f"{model.config.model_type}: drop it from the registry entry {entry.versions}"
            )

    def test_reference_impl_is_the_clean_one(self, model):
        segments, second = TRIGGERS["text_after_video_overlaps"]
        ids, _, images, videos, ts = build(model.config, [(segments, "right", 0)], [second])
        kwargs = {"second_per_grid_ts": ts} if ts is not None else {}
        ref = tfcompat.rope_index(model, ids, image_grid_thw=images, video_grid_thw=videos, impl="reference", **kwargs)
        assert torch.equal(ref[1:], reference(model).compute(model.config, ids, images, videos, ts))
        text_after = ref[1:, 0, -3:]
        assert int(text_after.min()) > int(ref[1:, 0, :-3].max())  # resumes after everything before it


@pytest.mark.parametrize("family",
                         [k for k, f in installed_families().items() if f.is_vision and not f.reference_rope_index])
def test_reference_impl_refused_without_a_reference(family):
    model = tiny_model(family, "sdpa")
    with pytest.raises(tfcompat.InvalidInputError, match=f"no reference M-RoPE index for {family}"):
        tfcompat.rope_index(model, torch.zeros(1, 4, dtype=torch.long), impl="reference")

