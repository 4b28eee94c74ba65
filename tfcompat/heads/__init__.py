"""PPO forward heads: per-token log-probabilities of the taken tokens and the entropy of the policy.

The plain computation materializes the ``(T, V)`` logits in float32 and keeps several ``(T, V)`` tensors
alive for backward; at ``T = 8192`` tokens and a 152k vocabulary that is tens of GiB. Backends ``"torch"`` and
``"triton"`` compute the same two values in tiles of about ``chunk_size * V`` logits and keep only ``(T,)`` row
statistics for backward, where they recompute each tile's logits (reference: backend ``"logits"`` below,
i.e. ``log_softmax`` + ``gather`` and ``-(p * log p).sum(-1)`` on the full logits, differentiated by
autograd; the recompute scheme follows Liger-Kernel's fused linear cross-entropy and Apple's Cut Cross
Entropy). With ``keep_logits=True`` they keep the forward's ``(T, V)`` logits for backward instead (one lm-head
matmul of four less, for ``T * V`` logits of memory). Both run the lm-head matmuls through cuBLAS on 128-aligned
tiles; ``"torch"`` does the softmax, entropy and gradient arithmetic of a tile in float32 torch ops, ``"triton"``
in two Triton kernels that read each tile once. ``"auto"`` is ``"triton"`` on CUDA when Triton is installed,
else ``"torch"``. This module is the API, its validation and the reference; `_tiles` holds what both chunked
backends share, `_torch` and `_triton` (imported when first used) one backend each.

Conventions shared by all backends:

- the lm-head matmul runs in the input dtype; its output is upcast to float32 when divided by the
  temperature, and everything after (softmax, logprobs, entropy) is float32, outputs included;
- positions whose label is ``IGNORE_INDEX`` (-100) get logprob 0 and entropy 0 and contribute no gradient;
- the temperature (a float or one value per token) divides the logits and is a constant: no gradient
  flows to it;
- what a model applies to its lm head's output before sampling (``logit_scale`` s, then final-logit ``softcap``
  c: ``c * tanh(s * x / c)``, as gemma2/3, granite, cohere do; `model_logprobs` reads both from the model)
  runs in float32 on the upcast logits, before the temperature divides them, as verl divides the model's
  logits by the temperature.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F

from ..errors import InvalidInputError
from ._check import deferred
from ._final_logits import FinalLogits, final_logits
from ._fused_loss import FusedLossFunction, TokenLoss, default_rows, token_total
from ._tiles import IGNORE_INDEX
from ._torch import _TORCH_CHUNK_SIZE, _ChunkedLogprobsEntropy

__all__ = ["IGNORE_INDEX", "BACKENDS", "FinalLogits", "FusedLoss", "LogprobsEntropy", "final_logits", "fused_loss",
           "logprobs_entropy", "model_fused_loss",
           "model_logprobs"]

BACKENDS = ("auto", "torch", "triton", "logits")


class LogprobsEntropy(NamedTuple):
    """Per-token results, float32, shaped like ``labels``: ``(T,)`` or ``(B, L)``.

    logprobs: ``log softmax(z)[label]`` with ``z = (hidden @ W.T + bias) / temperature``; 0 where ignored.
    entropy: ``-sum_v p_v log p_v`` of ``p = softmax(z)``; 0 where ignored.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor


def logprobs_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    *,
    backend: str = "auto",
    chunk_size: int | None = None,
    lm_head_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    keep_logits: bool = False,
) -> LogprobsEntropy:
    """Log-probability of each label and entropy of each token's distribution under the lm head.

    hidden: ``(T, H)`` or ``(B, L, H)`` floating, the last hidden states.
    lm_head_weight: ``(V, H)``, same dtype and device as ``hidden``.
    labels: ``(T,)`` or ``(B, L)`` integer token ids in ``[0, V)``, or ``IGNORE_INDEX``.
    temperature: a float > 0, or a floating tensor shaped like ``labels`` with every entry > 0; constant.
    backend: ``"torch"`` or ``"triton"`` (chunked, never hold the ``(T, V)`` logits), ``"auto"`` (``"triton"``
      on CUDA when Triton is installed, else ``"torch"``) or ``"logits"`` (the reference).
    chunk_size: the size of a tile of the chunked backends, about ``chunk_size * V`` logits (rows and columns
      rounded up to aligned counts): float32 (a few copies) for ``"torch"`` (default 2048: about
      3 GiB at V = 152064; 1024 halves that for a few percent more time); in the input dtype
      for ``"triton"``, whose default tile is about ``T * H`` logits (the size of ``hidden``, at least 2**24; it
      also keeps a ``(T, H)`` float32 accumulator), so that its memory grows with T like the hidden states'.
    lm_head_bias: ``(V,)`` or None.
    softcap, logit_scale: the logits are ``c * tanh(s * x / c)`` with ``c = softcap`` (``s * x`` when None) and
      ``s = logit_scale``, ``x`` the lm head's output; both finite and > 0, constants.
    keep_logits: keep the forward's ``(T, V)`` logits in the input dtype (``2 * T * V`` bytes in bf16: 5.6 GiB at
      T = 19,679 and V = 152,064, 20 GiB at T = 70,703) for backward instead of recomputing them: backward is the
      gradient written over them and two whole-matrix matmuls, one lm-head matmul of four less than the
      recomputing backends (H200, bf16, V = 152,064: 0.70-0.78x the time of ``"triton"`` at 8k-70k tokens,
      bench/RESULTS.md section 12). One backward per forward (the gradient overwrites the kept logits; a second
      backward through the same graph raises). The reference (``"logits"``) keeps its float32 logits anyway.
    Returns `LogprobsEntropy`, each field float32 and shaped like ``labels``.

    Validation reads two flags of the labels (and a tensor temperature) on the host once per call; on CUDA after
    the head's work is queued, through a side stream (`tfcompat.heads._check`), so the GPU does not wait on it.
    Raises `InvalidInputError` on a bad shape (no tokens included), dtype, device, label, temperature, softcap,
    logit scale, backend, chunk size or keep_logits, and
    for backend ``"triton"`` without Triton installed or with tensors off CUDA (unless ``TRITON_INTERPRET=1``).
    """
    temperature, checked, finish = _validate(hidden, lm_head_weight, labels, temperature, backend, chunk_size,
                                             lm_head_bias)
    if not isinstance(keep_logits, bool):
        raise InvalidInputError("keep_logits must be a bool", why=f"got {keep_logits!r}",
                                fix="pass keep_logits=True to keep the forward's logits for backward")
    _check_positive("softcap", softcap, "pass the model's config.final_logit_softcapping, or None")
    _check_positive("logit_scale", logit_scale, "pass 1.0 for none")
    backend = _resolve_backend(backend, hidden)
    tokens, flat_labels, column = _flatten(hidden, checked, temperature)
    logprobs, entropy = _logprobs_entropy(tokens, lm_head_weight, lm_head_bias, flat_labels, column, backend,
                                          chunk_size, softcap, logit_scale, keep_logits)
    finish()
    return LogprobsEntropy(logprobs.view(labels.shape), entropy.view(labels.shape))


def _flatten(hidden: torch.Tensor, labels: torch.Tensor, temperature: float | torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden ``(T, H)``, labels ``(T,)`` int64 and the temperature as a ``(T, 1)`` float32 column, constant for
    autograd, from a validated call."""
    tokens = hidden.reshape(-1, hidden.shape[-1])  # (B, L, H) -> (T, H)
    column = torch.as_tensor(temperature, dtype=torch.float32, device=hidden.device).detach()
    return tokens, labels.reshape(-1).long(), column.reshape(-1, 1).expand(tokens.shape[0], 1)


def _chunked_transform(column: torch.Tensor, softcap: float | None, logit_scale: float
                       ) -> tuple[float | None, torch.Tensor]:
    """The chunked backends see ``z = g(pre * x) / tau'``, g = tanh with a softcap (``pre = s / c``, ``tau' = tau /
    c``), else the identity (no pre, ``tau' = tau / s``): their arithmetic is the plain one on g's output. Returns
    ``pre`` and the ``(T, 1)`` column ``tau'``."""
    pre = None if softcap is None else logit_scale / softcap
    return pre, column / (logit_scale if softcap is None else softcap)


def _logprobs_entropy(
    tokens: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
    column: torch.Tensor, backend: str, chunk_size: int | None, softcap: float | None, logit_scale: float,
    keep_logits: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logprobs_entropy` on `_flatten`'s tensors with a resolved backend: ``(T,)`` logprobs and entropy."""
    if backend == "logits":
        return _reference(tokens, weight, bias, labels, column, softcap, logit_scale)
    pre, column = _chunked_transform(column, softcap, logit_scale)
    if backend == "torch":
        return _ChunkedLogprobsEntropy.apply(tokens, weight, bias, labels, column, chunk_size or _TORCH_CHUNK_SIZE,
                                             pre, keep_logits)
    from ._triton import TritonLogprobsEntropy, _triton_tiles

    tile_rows, tile_columns = _triton_tiles(tokens.shape[0], tokens.shape[1], weight.shape[0], chunk_size)
    return TritonLogprobsEntropy.apply(tokens, weight, bias, labels, column, tile_rows, tile_columns, pre,
                                       keep_logits)


def model_logprobs(
    model: torch.nn.Module,
    labels: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    *,
    backend: str = "auto",
    chunk_size: int | None = None,
    keep_logits: bool = False,
    **inputs: Any,
) -> LogprobsEntropy:
    """`logprobs_entropy` of a causal LM instead of its logits: the backbone runs, the lm head never does.

    model: a ``*ForCausalLM`` / ``*ForConditionalGeneration`` (patched or not) whose forward computes its logits
    as ``self.lm_head(backbone(...))``, then possibly a logit scale and a final-logit softcap (cohere, granite,
    falcon_h1, gemma2/3, ...): both are read from that forward and the model's config (`final_logits`), so the
    log-probs are those of the model's own logits. labels: ``(B, L)`` next-token ids aligned with the input
    tokens (already shifted; under Ulysses, ``shard.labels``). backend, chunk_size, keep_logits: as in
    `logprobs_entropy`. inputs: what the model's forward takes.
    Raises `InvalidInputError` for a model whose forward does more to its logits (e.g. masks columns, runs a
    module on them) or has no single backbone: the chunked head could not reproduce them.
    """
    applied = final_logits(model)
    head = cast(torch.nn.Linear, model.lm_head)  # final_logits checked it is the output embeddings' nn.Linear
    out = cast(torch.nn.Module, getattr(model, applied.backbone))(**inputs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return logprobs_entropy(hidden, head.weight, labels, temperature, backend=backend, chunk_size=chunk_size,
                            lm_head_bias=head.bias, softcap=applied.softcap, logit_scale=applied.logit_scale,
                            keep_logits=keep_logits)


class FusedLoss(NamedTuple):
    """What `fused_loss` returns.

    loss: ``()`` float32, the sum of the per-token losses over the tokens with a label; differentiable with
      respect to the hidden states and the lm head (its gradients were computed in the forward).
    logprobs, entropy: float32, shaped like ``labels``, 0 where ignored: for metrics (ratios, clip fractions,
      KL); a gradient through them raises in backward.
    """

    loss: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor


def fused_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    token_loss: TokenLoss,
    *token_args: Any,
    temperature: float | torch.Tensor = 1.0,
    backend: str = "auto",
    chunk_size: int | None = None,
    lm_head_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    logit_scale: float = 1.0,
) -> FusedLoss:
    """A loss that sums per-token terms of the log-probabilities and entropy, with its gradients computed in the
    head's forward: three lm-head matmuls and no kept logits (`logprobs_entropy` needs four, or three with
    ``keep_logits=True`` and ``2 * T * V`` bytes kept until backward).

    ``loss = sum over tokens t with a label of token_loss(logprobs, entropy, *token_args)[t]``, where token_loss
    is called on blocks of tokens: ``logprobs``, ``entropy`` ``(R,)`` float32 (0 at ignored tokens, which the sum
    leaves out), each argument shaped like ``labels`` as the block's ``(R,)`` slice (flattened), any other
    argument (a number, a 0-d tensor) as given. It returns the block's ``(R,)`` per-token losses and must be
    elementwise: token t's term may read only token t's values (a PPO / GRPO clipped ratio, an entropy bonus, a
    per-token KL against reference log-probs, a mean's ``1 / count`` as a per-token weight). A term over several
    tokens (a sequence-level ratio, a mean inside token_loss) needs `logprobs_entropy`.

        adv, old, weight = advantages, old_logprobs, mask / mask.sum()   # each shaped like labels
        def ppo(logp, ent, adv, old, weight):
            ratio = torch.exp(logp - old)
            clipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
            return (clipped - 0.01 * ent) * weight
        out = fused_loss(hidden, lm_head.weight, labels, ppo, adv, old, weight, temperature=1.0)
        out.loss.backward()

    hidden, lm_head_weight, labels, temperature, backend, lm_head_bias, softcap, logit_scale: as in
    `logprobs_entropy`. chunk_size: tokens per block (default: the tokens split evenly into blocks of at most about
    2**30 logits and 16,384 tokens for ``"triton"``, 7,061 tokens at V = 152,064; at most 2048 for ``"torch"``);
    the block's ``(R, V)`` logits are the head's largest temporary.
    Under Ulysses sequence parallelism each rank sums its own shard's terms: normalize with the global count.

    Raises `InvalidInputError` as `logprobs_entropy` does, for a token_loss that is not callable or does not
    return one floating value per token, an argument that is neither shaped like labels nor a scalar, or one
    that requires grad (the loss's gradient flows to the hidden states and the lm head only: detach it).
    """
    temperature, checked, finish = _validate(hidden, lm_head_weight, labels, temperature, backend, chunk_size,
                                             lm_head_bias)
    if not callable(token_loss):
        raise InvalidInputError("token_loss must be callable", why=f"got {type(token_loss).__name__}",
                                fix="pass a function (logprobs, entropy, *token_args) -> per-token losses")
    _check_positive("softcap", softcap, "pass the model's config.final_logit_softcapping, or None")
    _check_positive("logit_scale", logit_scale, "pass 1.0 for none")
    per_token = tuple(_check_token_arg(i, arg, labels) for i, arg in enumerate(token_args))
    args = tuple(arg.reshape(-1) if sliced else arg for arg, sliced in zip(token_args, per_token, strict=True))
    backend = _resolve_backend(backend, hidden)
    tokens, flat_labels, column = _flatten(hidden, checked, temperature)
    trained = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                              for t in (hidden, lm_head_weight, lm_head_bias))
    if backend == "logits" or not trained:  # the reference (autograd), or no gradient to compute
        logprobs, entropy = _logprobs_entropy(tokens, lm_head_weight, lm_head_bias, flat_labels, column, backend,
                                              chunk_size, softcap, logit_scale, False)
        loss = token_total(token_loss, logprobs, entropy, args, flat_labels != IGNORE_INDEX)
        finish()
        return FusedLoss(loss, logprobs.view(labels.shape), entropy.view(labels.shape))
    pre, column = _chunked_transform(column, softcap, logit_scale)
    rows = default_rows(tokens.shape[0], lm_head_weight.shape[0], backend, chunk_size)
    loss, logprobs, entropy = FusedLossFunction.apply(
        tokens, lm_head_weight, lm_head_bias, flat_labels, column, rows, pre, backend, token_loss, args, per_token
    )
    finish()
    return FusedLoss(loss, logprobs.view(labels.shape), entropy.view(labels.shape))


def model_fused_loss(
    model: torch.nn.Module,
    labels: torch.Tensor,
    token_loss: TokenLoss,
    *token_args: Any,
    temperature: float | torch.Tensor = 1.0,
    backend: str = "auto",
    chunk_size: int | None = None,
    **inputs: Any,
) -> FusedLoss:
    """`fused_loss` of a causal LM, as `model_logprobs` is `logprobs_entropy` of one: the backbone runs on
    ``inputs``, the lm head never does; the model's logit scale and final-logit softcap are read from it."""
    applied = final_logits(model)
    head = cast(torch.nn.Linear, model.lm_head)
    out = cast(torch.nn.Module, getattr(model, applied.backbone))(**inputs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return fused_loss(hidden, head.weight, labels, token_loss, *token_args, temperature=temperature,
                      backend=backend, chunk_size=chunk_size, lm_head_bias=head.bias, softcap=applied.softcap,
                      logit_scale=applied.logit_scale)


def _check_token_arg(index: int, arg: Any, labels: torch.Tensor) -> bool:
    """Whether ``token_args[index]`` is per token (a tensor shaped like labels) rather than passed whole."""
    if isinstance(arg, torch.Tensor):
        if arg.requires_grad:
            raise InvalidInputError(
                f"token_args[{index}] requires grad", why="fused_loss sends the loss's gradient to the hidden "
                "states and the lm head only: a gradient to this argument would be lost",
                fix="pass it detached (e.g. advantages.detach()), or use logprobs_entropy for a loss that trains it",
            )
        if arg.shape == labels.shape and arg.device == labels.device:
            return True
        if arg.ndim == 0:
            return False
        raise InvalidInputError(
            f"token_args[{index}] must be shaped like labels or be a scalar",
            why=f"labels {tuple(labels.shape)} on {labels.device} vs token_args[{index}] {tuple(arg.shape)} on "
            f"{arg.device}",
            fix="pass one value per token, shaped like labels and on their device (the head slices it per block)",
        )
    if isinstance(arg, (bool, int, float)):
        return False
    raise InvalidInputError(
        f"token_args[{index}] must be a tensor shaped like labels or a number", why=f"got {type(arg).__name__}",
        fix="bind other values in token_loss itself (a closure or functools.partial)",
    )


# ------------------------------------------------------------------------------------------- validation


def _validate(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    backend: str,
    chunk_size: int | None,
    bias: torch.Tensor | None,
) -> tuple[float | torch.Tensor, torch.Tensor, Callable[[], None]]:
    """Check the contract of `logprobs_entropy`; returns the temperature (a float, or the tensor as given), the
    labels to compute on and ``finish``, which raises for a bad label or temperature: call it before returning.
    The values are read on the host (`_check.deferred`): off CUDA here, where a bad one raises at once; on CUDA
    when ``finish`` is called, the head's work queued by then, and the labels handed back have each bad one
    replaced by ``IGNORE_INDEX`` so that nothing indexes out of range before the error."""
    if backend not in BACKENDS:
        raise InvalidInputError(
            f"unknown logprobs/entropy backend {backend!r}", supported=", ".join(map(repr, BACKENDS)),
            fix='pass backend="auto", "torch" or "triton" (chunked) or backend="logits" (reference)',
        )
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise InvalidInputError(
            "chunk_size must be a positive int or None", why=f"got {chunk_size!r}", fix="pass e.g. chunk_size=1024"
        )
    if not (hidden.is_floating_point() and hidden.ndim in (2, 3)):
        raise InvalidInputError(
            "hidden must be a floating (T, H) or (B, L, H) tensor",
            why=f"got dtype {hidden.dtype} and shape {tuple(hidden.shape)}",
        )
    if hidden.shape[:-1].numel() == 0:
        raise InvalidInputError(
            "hidden must hold at least one token", why=f"got shape {tuple(hidden.shape)}",
            fix="leave empty rows out of the batch",
        )
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise InvalidInputError(
            "lm_head_weight must be (V, H) with the hidden size of hidden",
            why=f"hidden {tuple(hidden.shape)} vs lm_head_weight {tuple(weight.shape)}",
            fix="pass lm_head.weight, shaped (vocab_size, hidden_size)",
        )
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise InvalidInputError(
            "lm_head_weight must have the dtype and device of hidden",
            why=f"hidden {hidden.dtype} on {hidden.device} vs lm_head_weight {weight.dtype} on {weight.device}",
        )
    vocab = weight.shape[0]
    if bias is not None and (bias.shape != (vocab,) or bias.dtype != weight.dtype or bias.device != weight.device):
        raise InvalidInputError(
            "lm_head_bias must be (V,) with the dtype and device of lm_head_weight",
            why=f"lm_head_bias {tuple(bias.shape)} {bias.dtype} on {bias.device} vs "
            f"lm_head_weight {tuple(weight.shape)} {weight.dtype} on {weight.device}",
        )
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise InvalidInputError("labels must be integer token ids", why=f"got dtype {labels.dtype}")
    if labels.shape != hidden.shape[:-1] or labels.device != hidden.device:
        raise InvalidInputError(
            "labels must have one entry per token of hidden, on its device",
            why=f"hidden {tuple(hidden.shape)} on {hidden.device} vs labels {tuple(labels.shape)} on {labels.device}",
            fix="pass labels shaped hidden.shape[:-1], IGNORE_INDEX (-100) where no logprob is wanted",
        )
    bad_label = ((labels < 0) | (labels >= vocab)) & (labels != IGNORE_INDEX)
    if isinstance(temperature, torch.Tensor):
        _check_temperature_tensor(temperature, labels)
        bad_temperature = ~((temperature > 0) & temperature.isfinite())
    else:
        _check_temperature_float(temperature)
        bad_temperature = torch.zeros((), dtype=torch.bool, device=labels.device)
    read = deferred(torch.stack([bad_label.any(), bad_temperature.any()]))

    def finish() -> None:
        any_bad_label, any_bad_temperature = read()
        if any_bad_label:
            raise InvalidInputError(
                f"labels must be token ids in [0, {vocab}) or {IGNORE_INDEX}",
                why=f"got {labels[bad_label][:8].tolist()!r} among labels {tuple(labels.shape)}",
            )
        if any_bad_temperature and isinstance(temperature, torch.Tensor):  # a float was checked above
            raise InvalidInputError(
                "every per-token temperature must be finite and > 0",
                why=f"got {temperature[bad_temperature][:8].tolist()!r} among temperatures "
                    f"{tuple(temperature.shape)}",
            )

    if labels.device.type != "cuda":
        finish()
        return temperature, labels, finish
    # read once the head's work is queued (`_check`): until then the head runs on labels it can index safely
    return temperature, labels.long().masked_fill(bad_label, IGNORE_INDEX), finish


def _check_temperature_float(temperature: object) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise InvalidInputError(
            "temperature must be a float or a per-token tensor",
            why=f"got {type(temperature).__name__} {temperature!r}",
        )
    if not (math.isfinite(temperature) and temperature > 0):
        raise InvalidInputError("temperature must be finite and > 0", why=f"got {temperature!r}")


def _check_positive(name: str, value: object, fix: str) -> None:
    """``value`` is None (softcap only) or a finite float > 0."""
    if value is None and name == "softcap":
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise InvalidInputError(f"{name} must be a finite float > 0", why=f"got {value!r}", fix=fix)


def _check_temperature_tensor(temperature: torch.Tensor, labels: torch.Tensor) -> None:
    if not temperature.is_floating_point():
        raise InvalidInputError(
            "a temperature tensor must be floating", why=f"got dtype {temperature.dtype}",
            fix="pass temperature.float()",
        )
    if temperature.shape != labels.shape or temperature.device != labels.device:
        raise InvalidInputError(
            "a temperature tensor must hold one value per token, shaped like labels",
            why=f"temperature {tuple(temperature.shape)} on {temperature.device} vs "
            f"labels {tuple(labels.shape)} on {labels.device}",
            fix="pass a float for one temperature, or a tensor shaped like labels",
        )


def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_interpreted() -> bool:
    """Triton's interpreter (``TRITON_INTERPRET=1``) runs the kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _resolve_backend(backend: str, hidden: torch.Tensor) -> str:
    """The backend that runs: ``"auto"`` becomes ``"triton"`` or ``"torch"``; ``"triton"`` is checked usable."""
    if backend == "auto":
        return "triton" if hidden.is_cuda and _has_triton() else "torch"
    if backend == "triton":
        if not _has_triton():
            raise InvalidInputError(
                'backend="triton" needs the triton package', why="it is not installed",
                fix='pip install "tfcompat[triton]", or pass backend="auto" (falls back to "torch")',
            )
        if not (hidden.is_cuda or _triton_interpreted()):
            raise InvalidInputError(
                'backend="triton" runs on CUDA tensors', why=f"hidden is on {hidden.device}",
                fix='pass backend="auto" (picks "torch" off CUDA), or set TRITON_INTERPRET=1 to run the kernels '
                "on the CPU (slow; for tests)",
            )
    return backend


# -------------------------------------------------------------------------------------------- reference


def _scaled_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: torch.Tensor,
    softcap: float | None = None, logit_scale: float = 1.0,
) -> torch.Tensor:
    """``c * tanh(s * (hidden @ weight.T + bias) / c) / temperature`` in float32 (``s * x / temperature`` without
    a softcap c), as a model computes its logits (gemma2's softcap, granite's and cohere's scales).

    hidden ``(R, H)``, weight ``(C, H)``, bias ``(C,)`` or None, temperature ``(R, 1)`` float32.
    Returns ``(R, C)`` float32: the matmul runs in the input dtype, the rest on its float32 upcast.
    """
    logits = F.linear(hidden, weight, bias).float()
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits / temperature


def _reference(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
    temperature: torch.Tensor, softcap: float | None = None, logit_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend ``"logits"``: the full ``(T, V)`` float32 logits, differentiated by autograd.

    hidden ``(T, H)``, weight ``(V, H)``, bias ``(V,)`` or None, labels ``(T,)`` int64, temperature ``(T, 1)``.
    Returns logprobs ``(T,)`` and entropy ``(T,)``, float32.
    """
    logits = _scaled_logits(hidden, weight, bias, temperature, softcap, logit_scale)  # (T, V)
    logp = torch.log_softmax(logits, dim=-1)  # (T, V)
    valid = labels != IGNORE_INDEX
    logprobs = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (T,)
    entropy = -(logp.exp() * logp).sum(-1)  # (T,)
    return torch.where(valid, logprobs, 0.0), torch.where(valid, entropy, 0.0)
