"""The gradient codecs and DDP bucket caps the probe accepts: names, params, bounds.

The probe implements these codecs (``torshmon.probe.codecs``) and the autotuner
searches over them (``torshmon.aggregator.core.tuner``); both read this one table, so
a request the tuner makes is one the probe accepts. Pure and torch-free: the
aggregator and the CLI import it without loading torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, TypeAlias

__all__ = [
    "CODEC_NAMES",
    "CODEC_SPECS",
    "MAX_BUCKET_CAP_MB",
    "MIB",
    "MIN_BUCKET_CAP_MB",
    "CodecSpec",
    "ConfigError",
    "ParamSpec",
    "ParamValue",
    "validate_bucket_cap_mb",
    "validate_codec",
]

ParamValue: TypeAlias = float | int

MIB: Final = 1024 * 1024
#: Bucket caps are sized in MiB, as DDP's ``bucket_cap_mb`` is.
MIN_BUCKET_CAP_MB: Final = 0.001
MAX_BUCKET_CAP_MB: Final = 4096.0


class ConfigError(ValueError):
    """A configuration that cannot be applied; the message names the field and what is allowed."""


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One codec parameter: integer or real, a lower bound, optional upper bound."""

    default: ParamValue
    integer: bool
    minimum: float
    minimum_inclusive: bool = True
    maximum: float | None = None

    def allowed(self) -> str:
        kind = "an integer" if self.integer else "a number"
        if self.maximum is None:
            return f"{kind} {'>=' if self.minimum_inclusive else '>'} {self.minimum:g}"
        low = "[" if self.minimum_inclusive else "("
        return f"{kind} in {low}{self.minimum:g}, {self.maximum:g}]"

    def check(self, codec: str, name: str, value: object) -> ParamValue:
        """The value normalised (int or float), or ConfigError naming the param."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(self._message(codec, name, value))
        if self.integer and not isinstance(value, int):
            raise ConfigError(self._message(codec, name, value))
        number: ParamValue = value if self.integer else float(value)
        above = number >= self.minimum if self.minimum_inclusive else number > self.minimum
        below = self.maximum is None or number <= self.maximum
        if not (above and below):  # also rejects NaN
            raise ConfigError(self._message(codec, name, value))
        return number

    def _message(self, codec: str, name: str, value: object) -> str:
        return f"codec {codec!r}: param {name!r} must be {self.allowed()}, got {value!r}"


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """A codec's name and its params (with defaults and bounds)."""

    name: str
    params: Mapping[str, ParamSpec] = field(default_factory=dict)

    def defaults(self) -> dict[str, ParamValue]:
        return {name: spec.default for name, spec in self.params.items()}


def _specs(*specs: CodecSpec) -> Mapping[str, CodecSpec]:
    return MappingProxyType({spec.name: spec for spec in specs})


#: Every codec, in the order they are listed to users (cheapest idea first).
CODEC_SPECS: Final = _specs(
    CodecSpec("none"),
    CodecSpec("fp16"),
    CodecSpec("bf16"),
    CodecSpec("powersgd", {"rank": ParamSpec(default=4, integer=True, minimum=1)}),
    CodecSpec(
        "topk",
        {
            "ratio": ParamSpec(
                default=0.01, integer=False, minimum=0.0, minimum_inclusive=False, maximum=1.0
            )
        },
    ),
    # Only 8-bit is implemented; the param exists so that a request for other
    # widths is answered with what is supported rather than "unknown param".
    CodecSpec("int8", {"bits": ParamSpec(default=8, integer=True, minimum=8, maximum=8)}),
)
CODEC_NAMES: Final = tuple(CODEC_SPECS)


def validate_codec(name: object, params: Mapping[str, object]) -> dict[str, ParamValue]:
    """Check a codec name and its params; the params normalised, defaults filled in.

    Raises ConfigError naming the bad name or param and what is allowed. Pure.
    """
    codec = CODEC_SPECS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise ConfigError(f"codec must be one of {', '.join(sorted(CODEC_SPECS))}; got {name!r}")
    unknown = sorted(str(key) for key in params if key not in codec.params)
    if unknown:
        allowed = ", ".join(sorted(codec.params)) or "none"
        raise ConfigError(
            f"codec {codec.name!r}: unknown param {unknown[0]!r}; allowed params: {allowed}"
        )
    return {
        key: spec.check(codec.name, key, params[key]) if key in params else spec.default
        for key, spec in codec.params.items()
    }


def validate_bucket_cap_mb(value: object, name: str = "bucket_cap_mb") -> float:
    """The cap as a float in MiB; ConfigError unless MIN_BUCKET_CAP_MB <= value <= MAX."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number of MiB, got {value!r}")
    cap = float(value)
    if not math.isfinite(cap) or cap < MIN_BUCKET_CAP_MB or cap > MAX_BUCKET_CAP_MB:
        raise ConfigError(
            f"{name} must be between {MIN_BUCKET_CAP_MB} and {MAX_BUCKET_CAP_MB} MiB, got {value!r}"
        )
    return cap
