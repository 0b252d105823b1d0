"""A worker as a service: the server (pdstate serve), the probe and the preflight (pdstate check)."""
