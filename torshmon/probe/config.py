"""The communication configuration the probe applies to a running DDP job.

A ``CommConfig`` is the DDP bucket cap and the gradient codec with its
parameters, plus a version. Rank 0 validates a requested change before any
rank sees it; ranks then agree on it by broadcast (see ``reconfig.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from torshmon.catalogue.codecs import (
    MAX_BUCKET_CAP_MB,
    MIB,
    MIN_BUCKET_CAP_MB,
    ConfigError,
    validate_bucket_cap_mb,
    validate_codec,
)

__all__ = [
    "MAX_BUCKET_CAP_MB",
    "MIB",
    "MIN_BUCKET_CAP_MB",
    "CommConfig",
    "ConfigError",
    "next_config",
    "validate_bucket_cap_mb",
]


@dataclass(frozen=True, slots=True)
class CommConfig:
    """Bucket caps (MiB) and codec of a DDP job; ``version`` 0 is what the job started with.

    ``first_bucket_cap_mb`` is DDP's cap for the bucket of the last-computed
    gradients: torch's default is 1 MiB under a 25 MiB cap, while
    ``DDP(bucket_cap_mb=X)`` uses X for both. The bucket layout is a function of
    the two caps alone, whatever configs came before.
    """

    version: int
    bucket_cap_mb: float
    first_bucket_cap_mb: float
    codec: str = "none"
    codec_params: Mapping[str, float | int] = field(default_factory=dict)

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * MIB)

    @property
    def first_bucket_cap_bytes(self) -> int:
        return int(self.first_bucket_cap_mb * MIB)

    def same_buckets(self, other: CommConfig) -> bool:
        return (self.bucket_cap_mb, self.first_bucket_cap_mb) == (
            other.bucket_cap_mb,
            other.first_bucket_cap_mb,
        )

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "version": self.version,
                "bucket_cap_mb": self.bucket_cap_mb,
                "first_bucket_cap_mb": self.first_bucket_cap_mb,
                "codec": self.codec,
                "codec_params": dict(self.codec_params),
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> CommConfig:
        raw = json.loads(data)
        return cls(
            version=int(raw["version"]),
            bucket_cap_mb=float(raw["bucket_cap_mb"]),
            first_bucket_cap_mb=float(raw["first_bucket_cap_mb"]),
            codec=str(raw["codec"]),
            codec_params=dict(raw["codec_params"]),
        )


def next_config(
    current: CommConfig,
    *,
    bucket_cap_mb: object = None,
    first_bucket_cap_mb: object = None,
    codec: object = None,
    codec_params: Mapping[str, object] | None = None,
) -> CommConfig:
    """The validated successor of ``current`` with the given fields changed.

    A new ``bucket_cap_mb`` without ``first_bucket_cap_mb`` sets both, as
    ``DDP(bucket_cap_mb=...)`` does. A new codec without ``codec_params`` gets
    that codec's defaults; the same codec with ``codec_params`` gets those
    params. Raises ConfigError naming the offending field; nothing changes then.
    """
    cap = current.bucket_cap_mb if bucket_cap_mb is None else validate_bucket_cap_mb(bucket_cap_mb)
    if first_bucket_cap_mb is not None:
        first = validate_bucket_cap_mb(first_bucket_cap_mb, "first_bucket_cap_mb")
    else:
        first = current.first_bucket_cap_mb if bucket_cap_mb is None else cap
    if codec is None:
        name = current.codec
        params: Mapping[str, object] = (
            current.codec_params if codec_params is None else codec_params
        )
    elif not isinstance(codec, str):
        raise ConfigError(f"codec must be a codec name, got {codec!r}")
    else:
        name, params = codec, codec_params or {}
    normalised = validate_codec(name, params)
    return replace(
        current,
        version=current.version + 1,
        bucket_cap_mb=cap,
        first_bucket_cap_mb=first,
        codec=name,
        codec_params=normalised,
    )
