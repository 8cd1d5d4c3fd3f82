"""Asynchronous video jobs (OpenAI's /v1/videos): kept in Redis, which every router
replica shares, so a job is found, run and downloaded whichever replica a client reaches,
and outlives the replica that took it."""
