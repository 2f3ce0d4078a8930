"""The serving runtime outside the process folders: what a launch resolves, the supervisor, the
frontend's engine client, stats merging, messaging and process helpers."""
