"""Feature slices of the router's HTTP API."""
