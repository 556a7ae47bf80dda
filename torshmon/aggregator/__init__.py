"""The central aggregator: ingest, live series, detection, rules, notification."""
