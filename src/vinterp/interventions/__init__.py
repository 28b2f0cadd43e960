"""Steering and capture as data: per-step row indices into per-site vector tables, applied
by the site ops already compiled into the model (no graph, no eager mode)."""
