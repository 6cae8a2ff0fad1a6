"""The router: one OpenAI-compatible endpoint in front of every replica's gateway (docs/services/gateway.md).

python -m router --port 8010 --redis-url redis://...      # or: dapo-mesh router; `dapo-mesh up` starts one

settings.py   RouterSettings (DAPO_*)
replicas.py   the replicas serving a gateway, read from their heartbeats in Redis
app.py        the HTTP proxy: a new session placed, every later call sent to its session's replica
"""
