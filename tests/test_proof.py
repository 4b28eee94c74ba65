"""The patch-time proof of derived types (`tfcompat.hf.proof`): refuses a wrong packed path at ``patch()``, proves
right ones, caches, can be skipped, and leaves the user's model and the process as they were."""

from __future__ import annotations

import pytest
import torch

import tfcompat
from tfcompat import PatchedModelError, PatchError
from tfcompat.hf import attention as hf_attention
from tfcompat.hf import patching
from tfcompat.hf import proof as hf_proof
from tfcompat.tiny_models import TinyModelError, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def empty_cache(monkeypatch):
    monkeypatch.setattr(hf_proof, "_CACHE", {})
    monkeypatch.delenv(hf_proof.ENV, raising=False)


@pytest.fixture
def windowless(monkeypatch):
    """A deliberately wrong derived patch: the packed core attends without the sliding window it is given (as
    phimoe's patch did where the window lived in the mask function only), and no guard notices."""
    real = hf_attention.varlen_attention
    monkeypatch.setattr(hf_attention, "varlen_attention", lambda *a, window=None, **k: real(*a, window=None, **k))


def _mistral() -> torch.nn.Module:
    model = tiny_model("mistral", attn_implementation="sdpa")
    assert model.config.sliding_window == 8  # the window cuts into the proof's 12-token sequence
    return model


def _packed_vs_stock(model: torch.nn.Module) -> float:
    seqs = [torch.randint(0, 200, (1, n), generator=torch.Generator().manual_seed(n)) for n in (7, 12)]
    with torch.no_grad():
        want = torch.cat([model(input_ids=s).logits[0] for s in seqs])
        with tfcompat.patch(model, prove=False):
            got = model(**tfcompat.pack(model, [{"input_ids": s} for s in seqs]).model_inputs).logits[0]
    return float((got - want).abs().max())


def test_a_wrong_derived_patch_is_refused_at_patch_time(windowless):
    model = _mistral()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PatchError, match=r"mistral fails its patch-time proof(.|\n)*packed differs from stock per "
                       r"sequence by (.|\n)*fix: .*prove=False"):
        tfcompat.patch(model)
    # nothing of the user's model changed, and no attention key is left registered by the refused patch
    assert not tfcompat.is_patched(model)
    assert model.config._attn_implementation == "sdpa"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert "forward" not in vars(model) and "forward" not in vars(model.model)


def test_the_broken_patch_is_really_wrong_and_prove_false_skips_the_proof(windowless):
    """Non-vacuity of the test above: the windowless packed path differs from stock on the user's model, and
    ``prove=False`` patches it without a word."""
    assert _packed_vs_stock(_mistral()) > 1e-3


def test_the_right_patch_gives_the_same_answer():
    """Control of the non-vacuity test: unbroken, the same comparison agrees."""
    assert _packed_vs_stock(_mistral()) < 1e-5


@pytest.mark.parametrize("model_type,kind", [("mistral", "causal_lm"), ("qwen3_moe", "causal_lm"),
                                             ("llava", "image_text_to_text")])
def test_derived_types_are_proven_on_their_own_config(monkeypatch, model_type, kind):
    asked = []
    real = hf_proof.sample_examples
    monkeypatch.setattr(hf_proof, "sample_examples", lambda *a, images: asked.append(images) or real(*a, images=images))
    model = tiny_model(model_type, kind, attn_implementation="sdpa")
    rng = torch.random.get_rng_state()
    with tfcompat.patch(model) as handle:
        assert handle.proof is not None and handle.proof.status == "proven" and handle.proof.config == "own"
        assert handle.proof.max_rel_diff <= hf_proof.TOLERANCE
        assert "proven at patch time on a shrunk copy of this config" in handle.explain()
    assert torch.equal(torch.random.get_rng_state(), rng)  # the copy's seeding is not the user's
    assert asked == [kind == "image_text_to_text"]  # a vision-language model is proven with images


def test_a_written_family_is_not_proven_here():
    """The written families are proven by their own tests and the doctor's self-check, not at patch time."""
    model = tiny_model("llama", attn_implementation="sdpa")
    with tfcompat.patch(model) as handle:
        assert handle.proof is None


def test_the_second_patch_of_the_same_config_is_a_cache_hit(monkeypatch):
    calls = []
    real = hf_proof._outcome
    monkeypatch.setattr(hf_proof, "_outcome", lambda *a: calls.append(a) or real(*a))
    first = _mistral()
    with tfcompat.patch(first) as handle:
        assert handle.proof.seconds > 0
    with tfcompat.patch(_mistral()) as handle:  # another instance of the same config
        assert handle.proof.status == "proven" and handle.proof.seconds == 0.0
    assert len(calls) == 1
    other = tiny_model("mistral", attn_implementation="sdpa")
    other.config.sliding_window = 4  # another semantic: proven anew
    with tfcompat.patch(other):
        pass
    assert len(calls) == 2


def test_a_cached_refusal_is_raised_again(windowless):
    with pytest.raises(PatchError, match="patch-time proof"):
        tfcompat.patch(_mistral())
    with pytest.raises(PatchError, match="patch-time proof"):
        tfcompat.patch(_mistral())


def test_prove_false_and_the_environment_skip_the_proof(monkeypatch, windowless):
    monkeypatch.setattr(hf_proof, "_outcome", lambda *a: pytest.fail("the proof ran"))
    with tfcompat.patch(_mistral(), prove=False) as handle:
        assert handle.proof is None
    monkeypatch.setenv(hf_proof.ENV, "0")
    with tfcompat.patch(_mistral()) as handle:
        assert handle.proof is None


def test_prove_true_overrides_the_environment(monkeypatch, windowless):
    monkeypatch.setenv(hf_proof.ENV, "0")
    with pytest.raises(PatchError, match="patch-time proof"):
        tfcompat.patch(_mistral(), prove=True)


def test_a_patched_model_error_in_the_proof_is_a_patch_error(monkeypatch):
    """Issue 29: a keyword the packed attention does not implement is refused at patch(), not raised in training."""
    def raising(original, r, *args, **kwargs):
        def forward(*a, **k):
            raise r.error(PatchedModelError, "MistralAttention passed mm_token_type_ids to the packed attention, "
                          "which does not implement it")
        return forward

    monkeypatch.setattr(patching, "_packed_text_forward", raising)
    model = _mistral()
    with pytest.raises(PatchError, match=r"fails its patch-time proof(.|\n)*the patched forward raised "
                       r"PatchedModelError: MistralAttention passed mm_token_type_ids"):
        tfcompat.patch(model)
    assert not tfcompat.is_patched(model)


def test_the_proof_leaves_no_attention_key_registered():
    hf_attention.register()  # a use of this test's own: the count goes back to it after the proof's copy
    try:
        count = dict(hf_attention._users)
        with tfcompat.patch(_mistral()):  # the user's model's use only: the copy's is released
            assert hf_attention._users == {**count, hf_attention.ATTENTION_KEY: count[hf_attention.ATTENTION_KEY] + 1}
        assert hf_attention._users == count
    finally:
        hf_attention.unregister()


def test_a_config_that_does_not_shrink_is_proven_on_the_default_config(monkeypatch):
    def refuse(config):
        raise TinyModelError("cannot build a tiny 'mistral': rejects the shrunk sizes")

    monkeypatch.setattr(hf_proof, "shrunk_config", refuse)
    with tfcompat.patch(_mistral()) as handle:
        assert handle.proof.status == "proven" and handle.proof.config == "default"
        assert "its own config does not shrink" in handle.proof.reason


def test_no_tiny_copy_builds_patches_unproven(monkeypatch):
    def refuse(*args, **kwargs):
        raise TinyModelError("cannot build a tiny 'mistral': MistralForCausalLM does not build from the tiny config")

    monkeypatch.setattr(hf_proof, "tiny_copy", refuse)
    with tfcompat.patch(_mistral()) as handle:
        assert handle.proof.status == "unproven" and "does not build from the tiny config" in handle.proof.reason
        assert "unproven at patch time" in handle.explain()


def test_llava_onevision1_5_is_refused_at_patch_time_or_runs():
    """Issue 29: on 5.25 its text attention passes mm_token_type_ids, which the packed attention does not implement:
    ``patch()`` refuses it (the proof's patched forward raised), where the forward used to raise in training."""
    from tfcompat.tiny_models import model_types, sample_examples

    if "llava_onevision1_5" not in model_types("image_text_to_text"):
        pytest.skip("this transformers ships no llava_onevision1_5 (new in 5.25)")
    model = tiny_model("llava_onevision1_5", "image_text_to_text", attn_implementation="sdpa")
    try:
        handle = tfcompat.patch(model)
    except PatchError as exc:
        assert hf_proof.REFUSAL in exc.what and "PatchedModelError" in exc.why, exc
        return
    with handle, torch.no_grad():
        model(**tfcompat.pack(model, sample_examples(model, (7, 12, 5), images=True)).model_inputs)


def _perturbed(monkeypatch, relative: float, by_precision: bool) -> None:
    """The packed core's output times ``1 + relative`` per element, with a random sign: ``relative`` as given (a patch
    wrong by a little), or scaled by the dtype's epsilon over float32's (rounding: it shrinks in float64)."""
    real = hf_attention.varlen_attention

    def varlen(*args, **kwargs):
        out = real(*args, **kwargs)
        size = relative * (torch.finfo(out.dtype).eps / torch.finfo(torch.float32).eps if by_precision else 1.0)
        noise = torch.rand(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype) * 2 - 1
        return out * (1 + size * noise)

    monkeypatch.setattr(hf_attention, "varlen_attention", varlen)


def test_a_near_miss_that_shrinks_in_float64_is_rounding(monkeypatch):
    """Rule (`tfcompat.hf.rounding`): float32 over the tolerance, float64 within it: proven, and said."""
    _perturbed(monkeypatch, 1e-4, by_precision=True)
    with tfcompat.patch(_mistral()) as handle:
        proof = handle.proof
    assert proof.status == "proven" and hf_proof.TOLERANCE < proof.max_rel_diff <= 1e-3
    assert "is rounding" in proof.reason and "in float64" in proof.reason


def test_a_near_miss_that_stays_in_float64_is_refused(monkeypatch):
    """Control of the rule: the same size of difference, not shrinking with the precision (a patch wrong by a
    little), is refused, naming both precisions."""
    _perturbed(monkeypatch, 1e-4, by_precision=False)
    with pytest.raises(PatchError, match=r"fails its patch-time proof(.|\n)*by \d\.\de-0[45] (.|\n)*in float64: not "
                       r"rounding"):
        tfcompat.patch(_mistral())
