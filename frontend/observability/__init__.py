"""What the server shows of itself: /metrics, the dashboard, traces, per-tenant hits."""
