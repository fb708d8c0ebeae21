"""The API role: the HTTP surface, sign-in, leasing, the result intake and its guards, the status page, /metrics
and the admin API, one module per phase (docs/architecture.md, "Inside api/"). It never imports torch, the
engine or another role: it meets them through the store (run/, store/)."""
