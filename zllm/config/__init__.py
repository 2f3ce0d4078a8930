"""Configuration: engine and server options, their flags, and the checks on them (tenants'
rules included)."""
