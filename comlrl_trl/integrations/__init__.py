"""Integrations with experiment trackers."""
