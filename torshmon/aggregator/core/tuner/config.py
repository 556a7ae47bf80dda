"""Codec choices and trial configs: what the tuner can set, validated against the catalogue."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import msgspec

from torshmon.catalogue.codecs import (
    MIB,
    ConfigError,
    validate_bucket_cap_mb,
    validate_codec,
)

if TYPE_CHECKING:
    from torshmon.wire import AppliedConfig


#: Knobs a user can pin: the bucket caps (both), or the codec with its params.
KNOBS: Final = ("bucket_cap_mb", "codec")
#: Per-step relative error bounds by codec; a codec missing here has no bound. The
#: error-feedback codecs (PowerSGD, top-k) have none by default: their per-step error is
#: that of a projection (below 1 by construction) of the gradient plus the residual
#: carried over, large by design and no sign of harm (what is not sent now is sent
#: later). On the demo's MLP (batch 64, so gradients of rank <= 64) PowerSGD rank 4
#: measured 0.997 while training normally, so a bound such as 0.9 banned PowerSGD
#: outright, and only on the trials whose window happened to hold a sampled step. The
#: loss guard is what protects training from them; a user can still set a bound.
DEFAULT_MAX_RELATIVE_ERROR: Final[Mapping[str, float]] = {
    "fp16": 0.1,
    "bf16": 0.1,
    "int8": 0.1,
}


class TunerError(ValueError):
    """A tuner setting, search space or saved state that cannot be used; names the value."""


# -- configs --------------------------------------------------------------------------------


def _normalise_codec(codec: object, params: Mapping[str, object]) -> dict[str, float | int]:
    """The codec's params with defaults filled in; TunerError names a bad name or param."""
    try:
        return validate_codec(codec, params)
    except ConfigError as exc:
        raise TunerError(str(exc)) from None


def check_cap(value: object, name: str) -> float:
    try:
        return validate_bucket_cap_mb(value, name)
    except ConfigError as exc:
        raise TunerError(str(exc)) from None


def _fmt_mb(value: float) -> str:
    return f"{value:.3g}"


@dataclass(frozen=True, slots=True)
class CodecChoice:
    """One codec with fixed params, a value of the search space's codec dimension.

    Params are normalised on construction (defaults filled in, as the probe reports
    them); TunerError names a bad codec or param.
    """

    codec: str
    params: Mapping[str, float | int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", _normalise_codec(self.codec, self.params))

    def __hash__(self) -> int:
        return hash(self.label)

    @property
    def label(self) -> str:
        """``fp16``, ``powersgd(rank=4)``: unique within a space."""
        if not self.params or self.codec == "int8":
            return self.codec
        inner = ",".join(f"{k}={v:g}" for k, v in sorted(self.params.items()))
        return f"{self.codec}({inner})"


#: The default codec dimension: PowerSGD ranks and top-k ratios as separate choices.
DEFAULT_CODECS: Final[tuple[CodecChoice, ...]] = (
    CodecChoice("none"),
    CodecChoice("fp16"),
    CodecChoice("bf16"),
    CodecChoice("powersgd", {"rank": 1}),
    CodecChoice("powersgd", {"rank": 2}),
    CodecChoice("powersgd", {"rank": 4}),
    CodecChoice("powersgd", {"rank": 8}),
    CodecChoice("topk", {"ratio": 0.001}),
    CodecChoice("topk", {"ratio": 0.01}),
    CodecChoice("int8"),
)


@dataclass(frozen=True, slots=True)
class TrialConfig:
    """A complete communication config: both DDP bucket caps (MiB) and the codec.

    Validated on construction (TunerError names the bad field). ``args()`` gives the
    probe's ``request_config`` keyword arguments, every field set, so applying it does
    not depend on what the job ran before.
    """

    bucket_cap_mb: float
    first_bucket_cap_mb: float
    codec: str = "none"
    codec_params: Mapping[str, float | int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "bucket_cap_mb", check_cap(self.bucket_cap_mb, "bucket_cap_mb"))
        first = check_cap(self.first_bucket_cap_mb, "first_bucket_cap_mb")
        object.__setattr__(self, "first_bucket_cap_mb", first)
        object.__setattr__(self, "codec_params", _normalise_codec(self.codec, self.codec_params))

    @classmethod
    def from_applied(cls, applied: AppliedConfig) -> TrialConfig:
        """The config a job reported applying (``wire.AppliedConfig``; caps in bytes)."""
        return cls(
            bucket_cap_mb=applied.bucket_cap_bytes / MIB,
            first_bucket_cap_mb=applied.first_bucket_cap_bytes / MIB,
            codec=applied.codec,
            codec_params=dict(applied.codec_params),
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrialConfig:
        """Inverse of ``to_dict``; TunerError names a missing or bad field."""
        try:
            return msgspec.convert(dict(data), cls)
        except msgspec.ValidationError as exc:
            raise TunerError(f"invalid config {dict(data)!r}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (the SQL ``config`` columns)."""
        return {
            "bucket_cap_mb": self.bucket_cap_mb,
            "first_bucket_cap_mb": self.first_bucket_cap_mb,
            "codec": self.codec,
            "codec_params": dict(self.codec_params),
        }

    def args(self) -> dict[str, object]:
        """``request_config`` keyword arguments (a config command's ``args``)."""
        return self.to_dict()

    @property
    def choice(self) -> CodecChoice:
        return CodecChoice(self.codec, self.codec_params)

    def key(self) -> tuple[float, float, str, tuple[tuple[str, float], ...]]:
        """Identity for "already measured": equal keys are the same config."""
        params = tuple(sorted((k, float(v)) for k, v in self.codec_params.items()))
        return (self.bucket_cap_mb, self.first_bucket_cap_mb, self.codec, params)

    def __hash__(self) -> int:
        return hash(self.key())

    @property
    def bucket_label(self) -> str:
        """``4 MB``, or ``25 MB (first 1)`` when the first bucket's cap differs."""
        text = f"{_fmt_mb(self.bucket_cap_mb)} MB"
        if self.first_bucket_cap_mb != self.bucket_cap_mb:
            text += f" (first {_fmt_mb(self.first_bucket_cap_mb)})"
        return text

    def describe(self) -> str:
        """``fp16, bucket 4 MB``."""
        return f"{self.choice.label}, bucket {self.bucket_label}"
