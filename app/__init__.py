"""kvoffload's HTTP face: app factory, routes, settings, CLI. Knows manager/ and transfer/."""
