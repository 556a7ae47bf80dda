"""The aggregator's HTTP surface: the JSON API, its OpenAPI document and the request guard."""
