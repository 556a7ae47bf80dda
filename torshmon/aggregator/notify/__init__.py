"""Notification: targets, delivery with retries, Slack and Alertmanager payloads, OTLP."""
