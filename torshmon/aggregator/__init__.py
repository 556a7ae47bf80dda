"""The central aggregator: ingest, live series, detection, rules, notification, tuning.

``core/`` is the pure logic (detectors, live state, rules and alerts, the tuner),
``notify/`` the delivery of alerts, ``http/`` the JSON API; ``service.py`` is the one
module that wires them to sockets, SQL and the clock (see docs/architecture.md).
"""
