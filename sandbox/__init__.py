"""The sandbox service: untrusted programs (a model's code, an agent's tool call) run isolated, with limits."""
