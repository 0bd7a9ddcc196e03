"""The HTTP edge: apps, routes, schemas, middleware, the error table (see ``app``)."""
