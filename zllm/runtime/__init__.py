"""The serving runtime outside the process folders: the supervisor, the frontend's engine
client, stats merging, messaging, process and progress helpers, tenants."""
