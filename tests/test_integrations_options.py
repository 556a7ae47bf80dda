"""The integrations check attach's keywords when they are built, not when training begins:
a typo is a one-line TypeError naming it and the settings there are (no training runs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from torshmon.probe.settings import ProbeSettings
from torshmon.settings import SettingsError, field_specs

KNOWN = ", ".join(sorted(spec.name for spec in field_specs(ProbeSettings)))


def _huggingface(**options: Any) -> Any:
    from torshmon.integrations.huggingface import TorshmonCallback

    return TorshmonCallback(**options)


def _lightning(**options: Any) -> Any:
    from torshmon.integrations.lightning import TorshmonCallback

    return TorshmonCallback(**options)


def _accelerate(**options: Any) -> Any:
    from accelerate import Accelerator

    from torshmon.integrations.accelerate import watch

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    return watch(accelerator, model, **options)


BUILDERS: dict[str, Callable[..., Any]] = {
    "huggingface": _huggingface,
    "lightning": _lightning,
    "accelerate": _accelerate,
}


@pytest.mark.parametrize("framework", list(BUILDERS))
def test_an_unknown_option_is_refused_when_the_integration_is_built(framework: str) -> None:
    with pytest.raises(TypeError) as refused:
        BUILDERS[framework](fast_lanee=True)
    assert str(refused.value) == f"unknown probe setting 'fast_lanee'; known: {KNOWN}"


@pytest.mark.parametrize("framework", list(BUILDERS))
def test_an_option_of_the_wrong_type_or_out_of_range_is_refused_when_built(
    framework: str,
) -> None:
    with pytest.raises(TypeError) as wrong_type:
        BUILDERS[framework](fast_lane="off")
    assert str(wrong_type.value) == "fast_lane must be true or false, got 'off'"
    with pytest.raises(SettingsError) as out_of_range:
        BUILDERS[framework](sync_every=0)
    assert str(out_of_range.value) == "sync_every must be >= 1, got 0"


@pytest.mark.parametrize("framework", ["huggingface", "lightning"])
def test_a_callback_with_good_options_is_built_without_attaching(framework: str) -> None:
    callback = BUILDERS[framework](fast_lane=False, sync_every=4)
    assert callback.monitor is None  # attached when training begins
    assert callback._options == {"fast_lane": False, "sync_every": 4}
