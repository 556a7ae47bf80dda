"""The versioned wire schema spoken between the probe and the agent.

Every message is one frame on a Unix stream socket: a 4-byte big-endian length
followed by that many bytes of JSON. The JSON object carries a ``kind`` tag and
the schema version ``v``. The probe sends ``hello`` once per connection, then
``batch`` messages; the agent answers each batch with an ``ack`` naming its
sequence number once the batch is safely stored, and the probe resends every
unacknowledged batch after a reconnect (the agent de-duplicates by
``session`` + ``seq``).

The records are msgspec Structs: frozen, slotted, validated on decode, with
units in the field names. This module is the only place the schema is written.
Records that hold only values and other records are not tracked by the cycle
collector (``gc=False``): they can never form a cycle, and the aggregator keeps
thousands in flight, each of which would otherwise count towards (and, surviving
into the oldest generation, bring on) full collections over its whole heap.
``Command`` (arbitrary ``args``) and the replies that carry commands stay tracked.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec
from msgspec import Meta

T = TypeVar("T")

SCHEMA_VERSION: Final = 1
MAX_FRAME_BYTES: Final = 4 * 1024 * 1024
FRAME_HEADER: Final = struct.Struct("!I")

#: Upper bounds (seconds) of the collective duration histogram buckets; the last
#: count of ``CollectiveStat.duration_hist`` is the overflow (+Inf) bucket.
DURATION_BUCKETS_S: Final[tuple[float, ...]] = (
    1e-5,
    5e-5,
    1e-4,
    5e-4,
    1e-3,
    5e-3,
    1e-2,
    5e-2,
    0.1,
    0.5,
    1.0,
    5.0,
    10.0,
    60.0,
)

#: Upper bounds (seconds) of ``torshmon_step_duration_seconds``, 1 ms to 60 s: the agent
#: and the aggregator both export it, so they must bucket alike to aggregate.
STEP_DURATION_BUCKETS_S: Final[tuple[float, ...]] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


# Bounds every value must respect so that it fits the SQL history (BIGINT, VARCHAR(n))
# on every backend: a value outside them is rejected at decode, naming the field.
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Rank = Annotated[int, Meta(ge=0, le=2**31 - 1)]
NAME_MAX_CHARS = 200
TEXT_MAX_CHARS = 4000
Name = Annotated[str, Meta(max_length=NAME_MAX_CHARS)]
Label = Annotated[str, Meta(max_length=64)]
Text = Annotated[str, Meta(max_length=TEXT_MAX_CHARS)]


class WireError(ValueError):
    """A frame or message that does not follow the schema; the text names what is wrong."""


class CollectiveStat(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Collectives of one (op, process group, dtype) within one step.

    ``size_bytes`` is the nccl-tests message size S summed over calls (for
    all_gather the gathered output, for reduce_scatter and all_to_all the input);
    bandwidths are the nccl-tests algorithm and bus bandwidths over the summed time.
    Times and bandwidths are None, and the histogram all zeros, for calls nothing timed
    (DDP's bucket all-reduces as gloo's Flight Recorder records them: bytes, no time);
    such calls never share a record with timed ones.
    """

    op: Label
    pg: Label
    dtype: Label
    count: Count
    size_bytes: Count
    duration_s: float | None = None
    max_duration_s: float | None = None
    algbw_bytes_per_s: float | None = None
    busbw_bytes_per_s: float | None = None
    duration_hist: list[int]


class BucketStat(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One DDP gradient bucket reduced by the probe's comm hook in one step.

    ``wire_bytes`` is what this rank sent for it; ``compression_ratio`` is
    ``wire_bytes / size_bytes`` (1.0 uncompressed). ``relative_error`` is
    ||g - decode(encode(g))|| / ||g|| of this rank's input, on sampled steps only.
    """

    index: Count
    size_bytes: Count
    parameters: Count
    duration_s: float
    codec: Label = "none"
    wire_bytes: Count = 0
    compression_ratio: float = 1.0
    encode_s: float = 0.0
    decode_s: float = 0.0
    relative_error: float | None = None


class AppliedConfig(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A communication config all ranks applied, from ``effective_step`` on."""

    version: Count
    bucket_cap_bytes: Count
    first_bucket_cap_bytes: Count
    codec: Label
    codec_params: dict[str, float | int]
    effective_step: Count


class ConfigRejection(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A requested config that no rank applied, and why."""

    version: Count
    reason: Text


class DdpStats(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """DDP's own logging data (``_get_ddp_logging_data``), sampled every few steps."""

    bucket_cap_bytes: Count
    bucket_sizes_bytes: list[Count]
    num_buckets_reduced: Count
    avg_forward_compute_s: float
    avg_backward_compute_s: float
    avg_backward_comm_s: float
    avg_backward_compute_comm_overlap_s: float


class StepRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One training step of one rank.

    ``comm_wait_s`` is communication the step waited for (blocking collectives
    plus DDP bucket reduction not hidden behind backward compute);
    ``compute_s`` is ``duration_s - comm_wait_s``. Phase splits are ``None``
    where they cannot be measured (no DDP module attached). The time from the
    previous step's end to this step's start, outside ``duration_s``, is split in
    three: ``eval_s`` (forward passes of the job's modules outside any step, an
    evaluation: from the first one's start to the last one's end),
    ``between_steps_comm_s`` (collectives outside those, e.g. a trainer's logging
    all_gathers) and ``input_wait_s`` (the rest: the data loader); all three
    ``None`` for the first step. JSON has no NaN: a
    NaN or infinite loss is sent as ``loss=None, loss_nonfinite=True``.
    ``config_version`` is the communication config the step ran with;
    ``applied_config`` is set on the step at whose end a new one was applied.
    """

    step: Count
    end_unix_ns: Int64
    duration_s: float
    comm_wait_s: float
    compute_s: float
    communication_time_ratio: float
    comm_busy_s: float
    forward_s: float | None = None
    backward_s: float | None = None
    optimizer_s: float | None = None
    input_wait_s: float | None = None
    eval_s: float | None = None
    between_steps_comm_s: float | None = None
    #: seconds of the step's compute the training thread was ready to run and waited for
    #: a CPU (Linux's run-queue delay, outside its communication waits): the node's
    #: other work, not the rank's own; None where the kernel does not say
    cpu_wait_s: float | None = None
    #: seconds all the process's threads together were ready to run and waited for a
    #: CPU during the step (run-queue delay summed over threads, its communication
    #: threads' included): how much a busy node held the step back; None where the
    #: kernel does not say
    process_cpu_wait_s: float | None = None
    batch_size: Count | None = None
    samples_per_s: float | None = None
    loss: float | None = None
    loss_nonfinite: bool = False
    collectives: list[CollectiveStat] = []
    buckets: list[BucketStat] = []
    ddp: DdpStats | None = None
    config_version: Count = 0
    applied_config: AppliedConfig | None = None
    config_rejections: list[ConfigRejection] = []
    #: CUDA caching allocator at the step's end (``torch.cuda.memory_allocated``,
    #: ``memory_reserved``, ``max_memory_allocated``: the peak since the process
    #: started or the job last reset it), bytes; None off CUDA
    gpu_memory_allocated_bytes: Count | None = None
    gpu_memory_reserved_bytes: Count | None = None
    gpu_memory_peak_bytes: Count | None = None
    #: which clock timed the step's collectives, and on NCCL its duration and comm wait:
    #: ``host`` (gloo; or NCCL where a device timing could not be read) or ``device``
    #: (NCCL: CUDA events on the training stream / NCCL's own Work timing)
    collective_clock: Label = "host"


class CollectiveFailures(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Collectives of one (op, process group) on this rank that raised instead of
    completing (a timeout, a peer that went away, a NCCL error), counted since attach.

    ``count`` is cumulative, so a lost batch loses no failure; ``last_error`` is the
    newest failure's exception as ``Type: message`` (cut to fit), raised at
    ``last_unix_ns``.
    """

    op: Label
    pg: Label
    count: Count
    last_error: Text
    last_unix_ns: Int64


class InflightOp(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A collective this rank entered and has not finished (the oldest per group).

    ``seq`` counts collectives per process group (point-to-point ops per group and
    peer), so the same number on different ranks is the same collective.
    """

    pg: Label
    seq: Count
    op: Label
    size_bytes: Count
    start_unix_ns: Int64
    age_s: float
    peer: Rank | None = None


class ProcessGroupMembers(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A process group this rank belongs to: ``pg`` is the label ``InflightOp`` uses
    (``default`` for the world group, else torch's group name, the same on every member);
    ``ranks`` its members' global ranks in group-rank order; ``desc`` torch's group
    description (e.g. DeviceMesh's ``mesh_dp``), "" where it has none."""

    pg: Label
    ranks: list[Rank]
    desc: Label = ""


class LinkPeerResult(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One pair of a link check as one rank timed it: ``size_bytes`` sent each way to
    and received from ``peer`` at once, in ``duration_s`` (after both were ready).
    ``cpu_wait_s``: how long this rank's threads waited for a CPU meanwhile (summed over
    threads; None: not measured, or a probe before it)."""

    peer: Rank
    size_bytes: Count
    duration_s: float
    cpu_wait_s: float | None = None


class LinkCheckResult(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What one rank measured in link check ``id``, run by every rank at ``step``.

    ``peers`` holds one entry per peer (a round-robin tournament of rank pairs on the
    probe's side gloo group); ``duration_s`` is how long the whole check held this
    rank at the step boundary. ``host``: what this rank shares with the ranks of its
    host (its address; ``torshmon.probe.linkcheck.host_key``); pairs of one host are
    not its NIC's. Empty from probes before it: every rank on a host of its own.
    """

    id: Label
    job: Name
    rank: Rank
    step: Count
    duration_s: float
    peers: list[LinkPeerResult] = []
    host: Label = ""


#: The largest evidence file a probe sends, gzip-compressed (a frame is at most
#: ``MAX_FRAME_BYTES`` and JSON carries bytes as base64, 4/3 of their size).
EVIDENCE_FILE_MAX_BYTES: Final = 2 * 1024 * 1024


class EvidenceFile(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One file of evidence capture ``id`` taken on this rank, or why it is missing.

    ``name``: ``flight_recorder.json`` (torch.distributed's Flight Recorder dump, JSON)
    or ``profiler_trace.json`` (torch.profiler's Chrome trace). ``data_gzip``: the
    file, gzip-compressed, at most ``EVIDENCE_FILE_MAX_BYTES``; empty with ``error``
    saying why when the file could not be taken or was over the cap. ``size_bytes``:
    the uncompressed size (0 when missing).
    """

    id: Label
    name: Label
    size_bytes: Count = 0
    data_gzip: Annotated[bytes, Meta(max_length=EVIDENCE_FILE_MAX_BYTES)] = b""
    error: Text = ""
    created_unix_ns: Int64 = 0


class Hello(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag="hello", tag_field="kind"):
    """First frame on every connection: who is speaking."""

    v: int
    session: Label
    job: Name
    rank: Rank
    world_size: Annotated[int, Meta(ge=1, le=2**31 - 1)]
    local_rank: Rank
    node: Name
    pid: Count
    backend: Label
    torch_version: Label
    probe_version: Label
    #: The launch this rank belongs to, the same on every rank of it (torchrun's run id,
    #: ``$TORSHMON_RUN_ID``, or one rank 0 made at attach); "" from older probes.
    run_id: Label = ""
    #: When this rank attached (Unix ns, the probe's clock): where its run begins; 0
    #: from older probes.
    attached_unix_ns: Int64 = 0


class Closing(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A rank's monitoring ended: its job called ``close()`` (``reason`` "close"), or its
    process exited (``reason`` "exit": close() run at interpreter exit). A rank that
    closed waits in no collective and holds none up.

    ``collectives``: those run after the rank's last step (a final evaluation, gathers),
    aggregated as a step's are; they belong to no step that ended, so they are filed
    under ``step``, the number the next step would have had, at ``end_unix_ns``.
    """

    step: Count
    end_unix_ns: Int64
    reason: Label = "close"
    collectives: list[CollectiveStat] = []


class Batch(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag="batch", tag_field="kind"):
    """Step records of one rank since the previous batch, plus its in-flight ops.

    ``dropped_records_total`` counts, since attach, step records the probe had to
    drop (no agent, or a slow one); it is cumulative so a lost batch loses no count.
    A batch with no steps is a heartbeat; it still carries ``inflight``, which is
    how a rank stuck inside a collective is seen. ``link_checks`` are this rank's
    results of link checks run since the previous batch. ``groups``: the process groups
    this rank belongs to, with their members; sent when they change, in the first batch
    of each connection, while an op has been in flight for a second or more, and every
    30 s, so an aggregator that restarted learns them again (empty: unchanged).
    ``collective_failures``: per (op, group), the collectives that raised since attach
    (cumulative); sent in every batch once one has, so the newest count always arrives.
    ``urgent``: the probe's fast lane is open (a step out of line with the rank's recent
    ones); the agent forwards it without waiting to gather more. ``evidence``: files of an
    evidence capture (at most one per batch, so a frame stays under its limit).
    ``closing``: set in the rank's last batch, when its monitoring ends (``Closing``).
    """

    v: int
    session: Label
    seq: Count
    job: Name
    rank: Rank
    sent_unix_ns: Int64
    dropped_records_total: Count
    steps: list[StepRecord] = []
    inflight: list[InflightOp] = []
    command_acks: list[CommandAck] = []
    link_checks: list[LinkCheckResult] = []
    urgent: bool = False
    groups: list[ProcessGroupMembers] = []
    evidence: list[EvidenceFile] = []
    collective_failures: list[CollectiveFailures] = []
    closing: Closing | None = None


class Ack(msgspec.Struct, frozen=True, kw_only=True, tag="ack", tag_field="kind"):
    """The agent's answer to a batch: stored, up to and including ``seq``; for a
    job's rank 0 it also carries the commands relayed from the aggregator."""

    v: int
    seq: int
    commands: list[Command] = []


ProbeMessage = Hello | Batch


# -- agent to aggregator ------------------------------------------------------------------
#
# The agent forwards over HTTP (POST /api/v1/ingest, gzip, bearer token). Each
# spool record is one unit of idempotency: the aggregator stores a record once
# per (agent_id, seq) and answers with the highest seq it has stored, plus any
# commands for jobs this agent serves.


class GpuSample(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One GPU of the node, read through NVML."""

    index: Count
    utilization_ratio: float
    memory_used_bytes: Count
    memory_total_bytes: Count
    #: NVML's UUID ("GPU-..."), as DCGM's exporter labels it; "" when unread
    uuid: Label = ""
    #: board power draw, watts; None where NVML does not report it
    power_watts: float | None = None
    #: GPU core temperature, degrees Celsius; None where NVML does not report it
    temperature_celsius: float | None = None
    #: NVML's bitmask of clock event (throttle) reasons active now; 0: none
    throttle_reasons: Count = 0
    #: uncorrected ECC errors since the driver loaded; None without ECC
    ecc_uncorrected_errors_total: Count | None = None
    #: Xid errors (NVML critical error events) the agent has seen since it started
    xid_errors_total: Count = 0
    #: the latest Xid code seen (e.g. 79: fallen off the bus); 0: none
    last_xid: Count = 0


class RankProcess(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A local training process the agent serves."""

    job: Name
    rank: Rank
    pid: Count
    rss_bytes: Count
    #: user + system CPU time of the process since it started
    cpu_s_total: float = 0.0
    #: the GPU (NVML index) the process computes on; None when unknown or none
    gpu: Count | None = None


class InterfaceSample(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One network interface of the node (loopback interfaces are never sampled)."""

    name: Name
    rx_bytes_total: Count
    tx_bytes_total: Count


class NodeSample(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The node at one instant. Byte counters are cumulative since boot; ratios are
    over the interval since the previous sample. The network totals are the sums
    over ``interfaces`` (loopback left out)."""

    ts_unix_ns: Int64
    node: Name
    cpu_utilization_ratio: float
    memory_utilization_ratio: float
    memory_used_bytes: Count
    io_wait_ratio: float
    net_rx_bytes_total: Count
    net_tx_bytes_total: Count
    disk_read_bytes_total: Count
    disk_write_bytes_total: Count
    gpus: list[GpuSample] = []
    ranks: list[RankProcess] = []
    interfaces: list[InterfaceSample] = []


class SpoolRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What the agent stores durably and forwards as one unit: probe messages and node
    samples received since the previous record. (Command acks travel in the probe's
    ``Batch``; the agent's own spool drops are on its ``/metrics``.)"""

    messages: list[ProbeMessage] = []
    node_samples: list[NodeSample] = []


class IngestRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    seq: Count
    record: SpoolRecord


class IngestBatch(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The body of one POST: records in increasing ``seq`` order."""

    v: int
    agent_id: Annotated[str, Meta(min_length=1, max_length=128)]
    node: Name
    records: list[IngestRecord]


class Command(msgspec.Struct, frozen=True, kw_only=True):
    """A command for one job, relayed by the agent to that job's rank-0 probe.

    ``kind`` "config": ``args`` are ``request_config`` keyword arguments.
    ``kind`` "link_check": every rank runs a pairwise link check at the same step;
    ``args`` may set ``size_bytes`` (sent each way per pair) and ``repeats`` (exchanges
    per pair, the fastest counts). Results come back as
    ``LinkCheckResult`` records, one per rank, with the command's id.
    ``kind`` "evidence": relayed by the agent to every rank of the job, not only rank 0
    (a hung job has no step at which to agree). Each rank dumps its Flight Recorder
    from the probe's own thread; ranks named in ``args["profile_ranks"]`` also record
    ``args["profile_steps"]`` steps under torch.profiler. Files come back as
    ``EvidenceFile`` records in the ranks' batches, with the command's id.
    """

    id: Label
    job: Name
    kind: Label
    args: dict[str, object] = {}
    #: The run it is for: the job's latest live run when it was made. The agent hands
    #: it to that run's rank 0 only, so a relaunch running beside an older launch of
    #: the same job name takes the commands ("": any run's rank 0; an evidence capture
    #: goes to every rank of the job whatever its run).
    run_id: Label = ""


#: What a probe may answer about a command.
AckStatus = Literal["accepted", "applied", "rejected"]


class CommandAck(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What became of a command: ``applied`` (with the config version and the step
    from which it applies; for a link check, no version and the step it ran at),
    ``accepted`` (queued for the next sync step), or ``rejected`` (with the reason)."""

    id: Label
    job: Name
    status: AckStatus
    reason: Text = ""
    version: Count | None = None
    effective_step: Count | None = None


class IngestReply(msgspec.Struct, frozen=True, kw_only=True):
    """The aggregator's answer: stored up to and including ``acked_seq``."""

    v: int
    acked_seq: int
    commands: list[Command] = []


_encoder = msgspec.json.Encoder()
_probe_decoder = msgspec.json.Decoder(ProbeMessage)
_ack_decoder = msgspec.json.Decoder(Ack)
_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def encode_json(message: msgspec.Struct) -> bytes:
    """Any schema record as JSON bytes."""
    return _encoder.encode(message)


def decode_json(payload: bytes, kind: type[T]) -> T:
    """Decode and validate one schema record of type ``kind`` (e.g. IngestBatch).

    Raises WireError naming the offending field (or invalid UTF-8, or nesting too deep for
    the decoder); checks ``v`` where the record has one.
    """
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        value: T = decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise WireError(f"invalid {kind.__name__}: {exc}") from exc
    except UnicodeDecodeError:
        raise WireError(f"invalid {kind.__name__}: a string is not valid UTF-8") from None
    except RecursionError:
        raise WireError(f"invalid {kind.__name__}: nested too deep") from None
    version = getattr(value, "v", SCHEMA_VERSION)
    _check_version(version)
    return value


def encode_frame(message: Hello | Batch | Ack) -> bytes:
    """Serialise one message as a length-prefixed frame.

    Raises WireError if the encoded message exceeds MAX_FRAME_BYTES.
    """
    payload = _encoder.encode(message)
    if len(payload) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES} byte limit")
    return FRAME_HEADER.pack(len(payload)) + payload


def frame_length(header: bytes) -> int:
    """Length announced by a frame header; WireError if it is over the limit."""
    (length,) = FRAME_HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise WireError(f"frame announces {length} bytes, over the {MAX_FRAME_BYTES} byte limit")
    return int(length)


def decode_probe_message(payload: bytes) -> ProbeMessage:
    """Decode and validate a probe frame's payload (``hello`` or ``batch``).

    Raises WireError naming the offending field, or the unsupported version.
    """
    try:
        message: ProbeMessage = _probe_decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise WireError(f"invalid probe message: {exc}") from exc
    _check_version(message.v)
    return message


def decode_ack(payload: bytes) -> Ack:
    """Decode and validate the agent's ``ack``; WireError if it is not one."""
    try:
        ack: Ack = _ack_decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise WireError(f"invalid ack: {exc}") from exc
    _check_version(ack.v)
    return ack


def _check_version(version: int) -> None:
    if version != SCHEMA_VERSION:
        raise WireError(
            f"unsupported schema version {version}; this side speaks version {SCHEMA_VERSION}"
        )
