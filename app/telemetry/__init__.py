"""What the service reports: ids, log lines, metrics, the observer (see ``app``)."""
