"""What torshmon's processes agree on, in one torch-free place.

``codecs``: the gradient codecs (names, params, defaults, bounds) and the DDP
bucket-cap bounds the probe accepts and the autotuner searches. The probe and
the aggregator import it rather than copy it.
"""
