"""The service core: state, lifecycle and operations, with no HTTP in it (see ``app``)."""
