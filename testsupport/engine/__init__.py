"""The CPU engine the engine tests and bench/engine_e2e.py drive: a small model, the driver
process it runs in, and the engines started around it."""
