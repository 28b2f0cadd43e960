"""Executing graphs inside a backend: site ops, per-request slices, saves."""
