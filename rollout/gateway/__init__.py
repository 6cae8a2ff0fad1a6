"""The OpenAI-compatible gateway of a replica: any agent rolls out with the training policy through sessions whose
every call is captured token by token and published as an episode (docs/services/gateway.md).

    schemas.py    the OpenAI requests accepted, the error shape
    sessions.py   a session: calls captured, continued token-exactly or in a new segment, its final episode
    core.py       the state between the HTTP handlers and the replica's loop: seats, calls, groups published
    app.py        the HTTP API (FastAPI), served from a thread of the replica
    metrics.py    dapo_gateway_*
"""
