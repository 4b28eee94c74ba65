"""Every causal-LM type the installed transformers ships (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), as a tiny model.

Rule: `tfcompat.patch(model)` either refuses with a typed error (the type passes as "refused", the reason recorded)
or the packed row equals stock per sequence per token, forward and backward (fp32, relative 1e-5; eager and sdpa
as stock references); patched and wrong fails. With kept modules (`checkpoint_keep`) under gradient checkpointing,
the gradients are full recompute's, or the patch refuses them. A type whose tiny model cannot be built or run is an
xfail that names why (never silent). `test_stock_zoo` validates the zoo itself without tfcompat.

`python -m tests.every_type_report` prints the counts per release. The sweeps (marker ``sweep``) run whole in
`nox -s matrix`; CI runs the sdpa reference (``ci_sweep``) on its newest release only.
"""

from __future__ import annotations

import pytest

from tests.every_type import check, kept_check, stock_check
from tfcompat.tiny_models import model_types

pytestmark = [pytest.mark.broad, pytest.mark.sweep, pytest.mark.usefixtures("one_thread")]
TYPES = model_types("causal_lm")


def _record(request: pytest.FixtureRequest, outcome) -> None:
    request.node.user_properties.append(("outcome", f"{outcome.status}: {outcome.reason}"))
    if outcome.status == "skipped":
        pytest.skip(f"{outcome.model_type}: {outcome.reason}")
    if outcome.status == "unbuildable":
        pytest.xfail(f"{outcome.model_type}: tiny model cannot be built or run: {outcome.reason}")


@pytest.mark.parametrize("impl", ["eager", pytest.param("sdpa", marks=pytest.mark.ci_sweep)])
@pytest.mark.parametrize("model_type", TYPES)
def test_patched_packed_equals_stock_or_is_refused(request, model_type, impl):
    outcome = check(model_type, impl)
    _record(request, outcome)
    assert outcome.status in ("pass", "refused"), outcome.reason


@pytest.mark.parametrize("model_type", TYPES)
def test_stock_zoo(request, model_type):
    outcome = stock_check(model_type)
    _record(request, outcome)
    assert outcome.status == "pass", outcome.reason


@pytest.mark.parametrize("model_type", TYPES)
def test_kept_modules_give_full_recompute_gradients_or_are_refused(request, model_type):
    """`checkpoint_keep` (`("attention", "mlp")` and `{"attention": 1.0, "mlp_in": 1.0}`, each where the patch
    takes it) under non-reentrant checkpointing in train mode: full recompute's gradients, or refused at patch()."""
    outcome = kept_check(model_type)
    _record(request, outcome)
    assert outcome.status in ("pass", "refused"), outcome.reason
