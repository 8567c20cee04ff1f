"""Watching a serving engine: its token stream, its /metrics page, its KV-cache events and the prefix tree
they build."""
