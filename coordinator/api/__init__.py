"""The API role: the HTTP surface, issuance, the result intake and its guards, the status page, /metrics and the
admin API. It never imports torch, the engine or another role: it meets them through the store (run/, store/)."""
