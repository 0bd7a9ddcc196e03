"""HTTP routes: the engine API, the admin API, health."""
