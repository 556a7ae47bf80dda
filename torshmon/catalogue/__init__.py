"""What torshmon's processes agree on, in one torch-free place.

``codecs``: the gradient codecs (names, params, defaults, bounds) and the DDP
bucket-cap bounds the probe accepts and the autotuner searches. ``metrics``:
every exported metric's name, type, unit, HELP text and labels, per daemon.
The probe, the agent, the aggregator, the dashboards and the docs import these
rather than copy them.
"""
