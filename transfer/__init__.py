"""kvoffload's transfer layer: host pool, registered device KV caches, transfer worker (torch)."""
