"""The aggregator's pure core: detectors, live state, rules, alerts, the tuner.

Synchronous and deterministic given their inputs, an injected clock and RNG; no
sockets, SQL or threads. The I/O shell (``torshmon.aggregator.service``) feeds them.
"""
