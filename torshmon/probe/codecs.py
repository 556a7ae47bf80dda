"""Gradient-compression codecs for the probe's DDP comm hook.

A codec averages one flat gradient bucket across a process group and reports
what it cost (``CodecStats``). Codecs: ``none`` (plain all-reduce, bit-identical
to DDP's built-in reduction), ``fp16``, ``bf16``, ``powersgd`` (rank-r, error
feedback, warm start), ``topk`` (error feedback) and ``int8`` (per-bucket scale,
error feedback).

Threading: ``reduce`` is called on the autograd thread and never waits for
communication; the work after each collective runs in a future callback on the
backend's completion thread. Per-bucket state (error-feedback residuals,
PowerSGD's P/Q) is keyed by bucket index and must be dropped with ``reset()``
whenever DDP rebuilds its buckets. ``reset()`` and ``reduce()`` belong to the
same (autograd) thread; reductions already in flight finish with the state they
started with, so a reset in the middle of a backward pass is safe.

Wire bytes are the payload this rank contributes to its collective (for
``none``, the bucket itself): the traffic the algorithm generates from that
payload depends on the collective (a ring all-reduce sends about 2 x payload per
rank, a ring all-gather (world - 1) x payload), which is why ``topk`` and
``int8`` stop saving traffic over ``none`` as the world grows (see their classes).
"""

from __future__ import annotations

import abc
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

import torch
from torch.distributed import ProcessGroup

from torshmon.catalogue.codecs import CODEC_SPECS, ParamSpec, ParamValue, validate_codec

__all__ = [
    "CODECS",
    "Bf16Codec",
    "Codec",
    "CodecStats",
    "Fp16Codec",
    "Int8Codec",
    "NoneCodec",
    "PowerSGDCodec",
    "TopKCodec",
    "make_codec",
    "validate_codec",
]

ReduceFuture: TypeAlias = "torch.futures.Future[tuple[torch.Tensor, CodecStats]]"


@dataclass(frozen=True, slots=True)
class CodecStats:
    """What reducing one bucket cost on this rank.

    ``relative_error`` is ``||g - decode(encode(g))|| / ||g||`` for this rank's
    (error-feedback-corrected) input ``g``; None unless the caller asked for it.
    """

    raw_bytes: int
    wire_bytes: int
    compression_ratio: float
    encode_s: float
    decode_s: float
    relative_error: float | None


# -- the codec interface ------------------------------------------------------------------


class Codec(abc.ABC):
    """Averages flat gradient buckets across ``group``; one instance per hook.

    ``reduce`` is called on the autograd thread and never blocks on communication.
    Different bucket indices may be in flight at once; one bucket index is never
    reduced twice concurrently (DDP finishes a step before starting the next).
    """

    name: ClassVar[str]
    param_specs: ClassVar[Mapping[str, ParamSpec]] = {}

    def __init__(self, group: ProcessGroup, **params: object) -> None:
        self._params = validate_codec(self.name, params)
        self._group = group
        self._world = int(group.size())
        # DDP's built-in reduction multiplies by 1/world (not divides): every codec does too.
        self._scale = 1.0 / self._world

    @abc.abstractmethod
    def reduce(
        self, bucket_index: int, buffer: torch.Tensor, *, measure_error: bool
    ) -> ReduceFuture:
        """Average ``buffer`` across the group.

        The future's value is ``(averaged, stats)``, where ``averaged`` is ``buffer``
        itself, overwritten in place. Raises only for programming errors; a failed
        collective completes the future with its exception.
        """

    def reset(self) -> None:  # noqa: B027 - stateless codecs have nothing to forget
        """Forget per-bucket state; call when DDP rebuilds its buckets (autograd thread)."""

    @property
    def params(self) -> dict[str, ParamValue]:
        """The validated params, defaults included (a copy)."""
        return dict(self._params)


# -- small helpers ------------------------------------------------------------------------


def _norm(tensor: torch.Tensor) -> float:
    """Euclidean norm as a Python float, accumulated in at least fp32."""
    wide = torch.float32 if tensor.element_size() < 4 else None
    return float(torch.linalg.vector_norm(tensor, dtype=wide))


def _relative(error_norm: float, input_norm: float) -> float:
    return error_norm / input_norm if input_norm > 0 else 0.0


def _bytes_of(tensor: torch.Tensor) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _from_bytes(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a uint8 slice as ``dtype``, copying only if the slice is misaligned."""
    if data.storage_offset() % torch.empty((), dtype=dtype).element_size():
        data = data.clone()
    return data.view(dtype)


def _stats(
    raw: int, wire: int, encode_s: float, decode_s: float, error: float | None
) -> CodecStats:
    return CodecStats(raw, wire, wire / raw if raw else 1.0, encode_s, decode_s, error)


def _new_future(buffer: torch.Tensor) -> Any:
    """An unset future for values on ``buffer``'s device (CUDA needs the device named)."""
    if buffer.device.type == "cpu":
        return torch.futures.Future()
    return torch.futures.Future(devices=[buffer.device])


# -- none, fp16, bf16 ---------------------------------------------------------------------


class NoneCodec(Codec):
    """Plain all-reduce, bit-identical to DDP's built-in reduction and as cheap."""

    name = "none"

    def reduce(
        self, bucket_index: int, buffer: torch.Tensor, *, measure_error: bool
    ) -> ReduceFuture:
        start = time.perf_counter()
        buffer.mul_(self._scale)
        raw = _bytes_of(buffer)
        stats = _stats(raw, raw, time.perf_counter() - start, 0.0, 0.0 if measure_error else None)
        future = self._group.allreduce([buffer]).get_future()
        return future.then(lambda done: (done.value()[0], stats))


class _CastCodec(Codec):
    """All-reduce in a 16-bit float type: divide by the world first, so the sum cannot
    overflow where the average would not, then cast back into the bucket."""

    dtype: ClassVar[torch.dtype]

    def reduce(
        self, bucket_index: int, buffer: torch.Tensor, *, measure_error: bool
    ) -> ReduceFuture:
        start = time.perf_counter()
        buffer.mul_(self._scale)
        compressed = buffer.to(self.dtype)
        encode_s = time.perf_counter() - start
        error = None
        if measure_error:
            error = _relative(_norm(buffer - compressed.to(buffer.dtype)), _norm(buffer))
        raw, wire = _bytes_of(buffer), _bytes_of(compressed)

        def decode(done: Any) -> tuple[torch.Tensor, CodecStats]:
            done.value()
            began = time.perf_counter()
            buffer.copy_(compressed)
            return buffer, _stats(raw, wire, encode_s, time.perf_counter() - began, error)

        return self._group.allreduce([compressed]).get_future().then(decode)


class Fp16Codec(_CastCodec):
    """All-reduce in IEEE half precision (about 3 significant digits). An entry above
    65504 x world becomes inf, which a GradScaler then sees as an overflow step."""

    name = "fp16"
    dtype = torch.float16


class Bf16Codec(_CastCodec):
    """All-reduce in bfloat16 (fp32's range, about 2-3 significant digits)."""

    name = "bf16"
    dtype = torch.bfloat16


# -- error feedback and the all-gather codecs ---------------------------------------------


class _Residuals:
    """Error-feedback memory: one residual per bucket index, in the bucket's dtype.

    Touched only on the autograd thread (inside ``reduce``) and by ``clear``.
    """

    def __init__(self) -> None:
        self._by_bucket: dict[int, torch.Tensor] = {}

    def corrected(self, bucket_index: int, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer`` plus the bucket's residual, in the residual's own storage.

        The caller turns the returned tensor into the next residual in place. A
        residual of another shape, dtype or device (buckets rebuilt without a
        reset) is dropped.
        """
        residual = self._by_bucket.get(bucket_index)
        if (
            residual is None
            or residual.shape != buffer.shape
            or residual.dtype != buffer.dtype
            or residual.device != buffer.device
        ):
            residual = self._by_bucket[bucket_index] = buffer.clone()
            return residual
        return residual.add_(buffer)

    def clear(self) -> None:
        self._by_bucket.clear()


def _scrub(residual: torch.Tensor) -> None:
    # A non-finite gradient (an fp16 overflow step) already reaches the output as
    # NaN/inf; keeping it in the residual would poison every later step.
    torch.nan_to_num_(residual, nan=0.0, posinf=0.0, neginf=0.0)


class _GatherCodec(Codec):
    """Codecs whose payloads cannot be summed on the wire: all-gather every rank's
    payload, decode each, sum in rank order (identical on every rank), divide.

    Subclasses encode the corrected input in place into the residual and return
    the payload as bytes.
    """

    def __init__(self, group: ProcessGroup, **params: object) -> None:
        super().__init__(group, **params)
        self._residuals = _Residuals()

    @abc.abstractmethod
    def _encode(self, corrected: torch.Tensor) -> torch.Tensor:
        """Payload (uint8) for ``corrected``, which is left holding the residual."""

    @abc.abstractmethod
    def _decode_add(self, out: torch.Tensor, payload: torch.Tensor) -> None:
        """Add the decoded ``payload`` to ``out``."""

    def reset(self) -> None:
        """Forget every residual."""
        self._residuals.clear()

    def reduce(
        self, bucket_index: int, buffer: torch.Tensor, *, measure_error: bool
    ) -> ReduceFuture:
        start = time.perf_counter()
        corrected = self._residuals.corrected(bucket_index, buffer)
        paused = time.perf_counter()
        input_norm = _norm(corrected) if measure_error else 0.0
        resumed = time.perf_counter()
        payload = self._encode(corrected)
        error = _relative(_norm(corrected), input_norm) if measure_error else None
        _scrub(corrected)
        encode_s = (paused - start) + (time.perf_counter() - resumed)
        parts = [torch.empty_like(payload) for _ in range(self._world)]
        raw, wire = _bytes_of(buffer), _bytes_of(payload)

        def decode(done: Any) -> tuple[torch.Tensor, CodecStats]:
            done.value()
            began = time.perf_counter()
            buffer.zero_()
            for part in parts:
                self._decode_add(buffer, part)
            buffer.mul_(self._scale)
            return buffer, _stats(raw, wire, encode_s, time.perf_counter() - began, error)

        return self._group.allgather([parts], [payload]).get_future().then(decode)


class TopKCodec(_GatherCodec):
    """Send the ``ceil(ratio * n)`` largest-magnitude entries (values + int32 indices).

    Error feedback: the entries not sent are added to the next step's bucket. The
    payload is all-gathered, so per-rank traffic grows with the world: it beats a
    plain all-reduce only while ``ratio`` is well below ``1 / world`` (8-byte
    entries gathered from every rank versus 4-byte values reduced twice).
    """

    name = "topk"
    param_specs: ClassVar[Mapping[str, ParamSpec]] = CODEC_SPECS["topk"].params

    def _count(self, numel: int) -> int:
        # round() absorbs float noise such as 0.1 * 30 = 3.0000000000000004.
        return max(1, min(numel, math.ceil(round(float(self._params["ratio"]) * numel, 6))))

    def _encode(self, corrected: torch.Tensor) -> torch.Tensor:
        numel = corrected.numel()
        index_dtype = torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64
        indices = torch.topk(corrected.abs(), self._count(numel), sorted=False).indices
        values = corrected[indices]
        corrected[indices] = 0
        return torch.cat([_as_bytes(values), _as_bytes(indices.to(index_dtype))])

    def _decode_add(self, out: torch.Tensor, payload: torch.Tensor) -> None:
        numel = out.numel()
        index_dtype = torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64
        count = self._count(numel)
        split = count * out.element_size()
        values = _from_bytes(payload[:split], out.dtype)
        indices = _from_bytes(payload[split:], index_dtype)
        out.index_add_(0, indices, values)


class Int8Codec(_GatherCodec):
    """Symmetric 8-bit quantisation with one scale per bucket (max-abs / 127).

    Error feedback: the rounding error is added to the next step's bucket. Sums
    of int8 would overflow on the wire, so payloads are all-gathered: per-rank
    traffic is (world - 1) x n bytes against about 8 x n for an fp32 all-reduce,
    a saving only below 8 ranks.
    """

    name = "int8"
    param_specs: ClassVar[Mapping[str, ParamSpec]] = CODEC_SPECS["int8"].params

    def _encode(self, corrected: torch.Tensor) -> torch.Tensor:
        scale = corrected.abs().amax() / 127
        # An all-zero bucket has scale 0; a non-finite one keeps its NaN/inf scale so
        # the decoded average is NaN, as the plain all-reduce's would be.
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        quantised = torch.round(corrected / scale).clamp_(-127, 127).to(torch.int8)
        corrected.sub_(quantised.to(corrected.dtype) * scale)
        return torch.cat([_as_bytes(scale), _as_bytes(quantised)])

    def _decode_add(self, out: torch.Tensor, payload: torch.Tensor) -> None:
        split = out.element_size()
        scale = payload[:split].view(out.dtype)
        quantised = payload[split:].view(torch.int8)
        out.addcmul_(quantised.to(out.dtype), scale)


# -- PowerSGD -----------------------------------------------------------------------------


class _LaunchSequencer:
    """Makes multi-round reductions issue their collectives in one order on every rank.

    Gloo matches collectives across ranks by the order they were issued in the
    group. A multi-round reduction issues its later rounds from gloo's completion
    threads, where they would race with the next bucket's first round on the
    autograd thread, and rounds finish in a different order on each rank. The
    sequencer lets one reduction at a time issue collectives; the next is started,
    without blocking any thread, by whoever releases the current one. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: deque[Callable[[], None]] = deque()
        self._busy = False

    def admit(self, start: Callable[[], None]) -> None:
        """Run ``start`` now, or when every earlier reduction has released.

        ``start`` must not raise, and its reduction must call ``release`` exactly
        once, right after issuing its last collective (or on failure).
        """
        with self._lock:
            if self._busy:
                self._waiting.append(start)
                return
            self._busy = True
        start()

    def release(self) -> None:
        """The current reduction has issued its last collective: start the next."""
        with self._lock:
            if not self._waiting:
                self._busy = False
                return
            start = self._waiting.popleft()
        start()


def _matrix_shape(numel: int) -> tuple[int, int]:
    """(rows, cols) of the zero-padded near-square matrix a flat bucket is viewed as."""
    cols = math.isqrt(numel - 1) + 1 if numel > 1 else 1
    return -(-numel // cols), cols


def _orthonormalise(matrix: torch.Tensor) -> None:
    """Modified Gram-Schmidt on the columns of ``matrix``, in place.

    Hand-written rather than ``torch.linalg.qr`` because every rank must get
    bit-identical columns: these are plain vector ops on ~sqrt(n) elements,
    below torch's parallel grain, so the result does not depend on threading.
    A zero column stays zero (the epsilon avoids 0/0).
    """
    eps = torch.finfo(matrix.dtype).tiny
    for i in range(matrix.shape[1]):
        column = matrix[:, i]
        column.div_(torch.linalg.vector_norm(column) + eps)
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest.sub_(torch.outer(column, column @ rest))


@dataclass(slots=True)
class _PowerState:
    """One bucket's PowerSGD memory.

    ``matrix`` holds the error-feedback residual between steps (rows x cols,
    padding kept zero); ``q`` is the warm-started right factor, identical on
    every rank; ``generator`` draws the same fresh ``q`` on every rank.
    """

    numel: int
    rows: int
    cols: int
    rank: int
    matrix: torch.Tensor
    q: torch.Tensor
    generator: torch.Generator

    @classmethod
    def create(cls, bucket_index: int, buffer: torch.Tensor, rank: int) -> _PowerState:
        numel = int(buffer.numel())
        rows, cols = _matrix_shape(numel)
        generator = torch.Generator().manual_seed(_POWERSGD_SEED + bucket_index)
        matrix = torch.zeros(rows, cols, dtype=buffer.dtype, device=buffer.device)
        state = cls(numel, rows, cols, min(rank, rows), matrix, matrix.new_empty(0), generator)
        state.q = state.fresh_q()
        return state

    def fresh_q(self) -> torch.Tensor:
        q = torch.randn(self.cols, self.rank, generator=self.generator)
        return q.to(dtype=self.matrix.dtype, device=self.matrix.device)

    def matches(self, buffer: torch.Tensor) -> bool:
        return bool(
            self.numel == buffer.numel()
            and self.matrix.dtype == buffer.dtype
            and self.matrix.device == buffer.device
        )

    @property
    def compresses(self) -> bool:
        return self.rank * (self.rows + self.cols) < self.numel


_POWERSGD_SEED = 0x5EED


class _PowerSGDReduction:
    """One bucket's PowerSGD reduction: three stages chained on two all-reduces.

    ``start`` (P = M Q, all-reduce P) runs when the sequencer admits it; ``_on_p``
    (orthonormalise P, Q = M^T P, residual, all-reduce Q) and ``_on_q``
    (average = P Q^T / world) run in future callbacks. Stages never overlap.
    """

    def __init__(
        self,
        group: ProcessGroup,
        sequencer: _LaunchSequencer,
        scale: float,
        state: _PowerState,
        buffer: torch.Tensor,
        measure_error: bool,
    ) -> None:
        self._group = group
        self._sequencer = sequencer
        self._scale = scale
        self._state = state
        self._buffer = buffer
        self._measure_error = measure_error
        self.result = _new_future(buffer)
        self._released = False
        self._p = buffer.new_empty(0)
        self._input_norm = 0.0
        self._error: float | None = None
        self._encode_s = 0.0

    def start(self) -> None:
        try:
            began = time.perf_counter()
            state, flat = self._state, self._state.matrix.view(-1)
            flat[: state.numel].add_(self._buffer.view(-1))
            self._p = state.matrix @ state.q
            self._encode_s += time.perf_counter() - began
            if self._measure_error:
                self._input_norm = _norm(state.matrix)
            future = self._group.allreduce([self._p]).get_future()
        except BaseException as exc:
            self._fail(exc)
            return
        future.add_done_callback(self._guard(self._on_p))

    def _on_p(self, done: Any) -> None:
        done.value()
        began = time.perf_counter()
        state, p = self._state, self._p
        _orthonormalise(p)
        q_local = state.matrix.t() @ p
        # The residual is this rank's own compression error M - P P^T M; the ranks'
        # residuals sum to the same total as torch's (M - the averaged result), so the
        # training dynamics match, and it is the figure relative_error reports.
        state.matrix.sub_(p @ q_local.t())
        state.matrix.view(-1)[state.numel :].zero_()
        if self._measure_error:
            self._error = _relative(_norm(state.matrix), self._input_norm)
        _scrub(state.matrix)
        state.q.copy_(q_local)
        self._encode_s += time.perf_counter() - began
        future = self._group.allreduce([state.q]).get_future()
        self._release()
        future.add_done_callback(self._guard(self._on_q))

    def _on_q(self, done: Any) -> None:
        done.value()
        began = time.perf_counter()
        state = self._state
        state.q.mul_(self._scale)
        average = self._p @ state.q.t()
        self._buffer.view(-1).copy_(average.view(-1)[: state.numel])
        if not bool(torch.isfinite(state.q).all()) or bool((state.q.abs().amax(0) == 0).any()):
            # A zero or non-finite Q would stick through the warm start; Q is identical
            # on every rank, so every rank redraws the same one.
            state.q = state.fresh_q()
        raw = _bytes_of(self._buffer)
        wire = (state.rows + state.cols) * state.rank * self._buffer.element_size()
        stats = _stats(raw, wire, self._encode_s, time.perf_counter() - began, self._error)
        self.result.set_result((self._buffer, stats))

    def _guard(self, stage: Callable[[Any], None]) -> Callable[[Any], None]:
        def run(done: Any) -> None:
            try:
                stage(done)
            except BaseException as exc:
                self._fail(exc)

        return run

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._sequencer.release()

    def _fail(self, exc: BaseException) -> None:
        self._release()
        if not self.result.done():
            self.result.set_exception(exc)


class PowerSGDCodec(Codec):
    """Rank-r PowerSGD (Vogels et al. 2019) with error feedback and warm start.

    The hook only sees the flat bucket, so the bucket is viewed as one
    near-square matrix (zero-padded to rows x cols, rows ~ cols ~ sqrt(n)) rather
    than per-parameter matrices: a square shape minimises the factors' size
    r * (rows + cols) for a given n, and needs no knowledge of parameter shapes.
    It mixes parameters into one matrix with less low-rank structure than a
    weight gradient, which error feedback makes up for over steps. Buckets too
    small to save bytes (r * (rows + cols) >= n) are all-reduced uncompressed.

    The second all-reduce (Q) is issued from gloo's completion thread, so both
    rounds of every bucket go through a sequencer and all ranks issue them in one
    order whatever the bucket count (without it, two buckets' rounds interleave
    differently on two ranks and gloo aborts with "Received data size doesn't
    match expected size"). Another collective issued on the same group *during*
    backward (DDP's ``find_unused_parameters`` map) would race with the second
    round just the same: give the codec a group of its own in that case.
    """

    name = "powersgd"
    param_specs: ClassVar[Mapping[str, ParamSpec]] = CODEC_SPECS["powersgd"].params

    def __init__(self, group: ProcessGroup, **params: object) -> None:
        super().__init__(group, **params)
        self._rank = int(self._params["rank"])
        self._states: dict[int, _PowerState] = {}
        self._sequencer = _LaunchSequencer()

    def reset(self) -> None:
        """Forget every bucket's residual and Q (Q is redrawn from the seed)."""
        self._states.clear()

    def reduce(
        self, bucket_index: int, buffer: torch.Tensor, *, measure_error: bool
    ) -> ReduceFuture:
        state = self._states.get(bucket_index)
        if state is None or not state.matches(buffer):
            state = self._states[bucket_index] = _PowerState.create(
                bucket_index, buffer, self._rank
            )
        if not state.compresses:
            return self._reduce_uncompressed(buffer, measure_error)
        reduction = _PowerSGDReduction(
            self._group, self._sequencer, self._scale, state, buffer, measure_error
        )
        self._sequencer.admit(reduction.start)
        return reduction.result

    def _reduce_uncompressed(self, buffer: torch.Tensor, measure_error: bool) -> ReduceFuture:
        result = _new_future(buffer)
        raw = _bytes_of(buffer)

        def finish(done: Any) -> None:
            try:
                done.value()
                result.set_result(
                    (buffer, _stats(raw, raw, 0.0, 0.0, 0.0 if measure_error else None))
                )
            except BaseException as exc:
                result.set_exception(exc)

        def start() -> None:
            try:
                buffer.mul_(self._scale)
                future = self._group.allreduce([buffer]).get_future()
            except BaseException as exc:
                result.set_exception(exc)
                self._sequencer.release()
                return
            self._sequencer.release()
            future.add_done_callback(finish)

        self._sequencer.admit(start)
        return result


# -- registry -----------------------------------------------------------------------------

CODECS: dict[str, type[Codec]] = {
    codec.name: codec
    for codec in (NoneCodec, Fp16Codec, Bf16Codec, PowerSGDCodec, TopKCodec, Int8Codec)
}


def make_codec(name: str, group: ProcessGroup, params: Mapping[str, object]) -> Codec:
    """Build codec ``name`` on ``group``; ConfigError (naming the field) if invalid."""
    normalised = validate_codec(name, params)
    return CODECS[name](group, **normalised)
