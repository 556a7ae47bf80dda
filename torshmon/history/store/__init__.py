"""The store: every statement the daemons run on the history, built from the models.

``state`` is the aggregator's own state (alerts, findings, commands, tuning, the
API's listings, retention, evidence) behind ``HistoryStore``, ``rows`` the records
it writes; ``evidence`` lists the evidence captured on alert (for the API and the
report); ``ingest`` the per-request statements and bulk inserts of ingest. Not here:
the read-only user queries (``torshmon.history.query``, run as the reader role), and
migrations.
"""

from torshmon.history.store.evidence import evidence_of, list_evidence
from torshmon.history.store.rows import (
    EvidenceCaptureRow,
    EvidenceFileRow,
    RunningJob,
    TuningSessionRow,
    TuningTrialRow,
)
from torshmon.history.store.state import LISTING_ORDER, FilterError, HistoryStore, Listing, Row

__all__ = [
    "LISTING_ORDER",
    "EvidenceCaptureRow",
    "EvidenceFileRow",
    "FilterError",
    "HistoryStore",
    "Listing",
    "Row",
    "RunningJob",
    "TuningSessionRow",
    "TuningTrialRow",
    "evidence_of",
    "list_evidence",
]
