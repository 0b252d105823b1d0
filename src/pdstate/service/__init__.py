"""A worker as a service: configuration, HTTP API, status, the server and the probe."""
