"""The door: who may call a route, admission control, per-tenant limits, middleware."""
