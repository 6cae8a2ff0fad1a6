"""The rollout service: replicas that turn PromptTasks into scored, version-tagged groups (`python -m rollout`).

Its modules, by role:

    __main__.py         the entry point: settings, signals, then runner.run (heavy imports only after --help)
    runner.py           builds the engine, the replica's parts and its loop; runs them until stopped
    replica.py          the parts both loops hold, and the Loop interface (step, close)
    chunked_loop.py     engine calls of prompts_per_call prompts, weights between calls (HF; vLLM with --no-stream)
    continuous_loop.py  continuous batching: prompts join as room frees up, weights load in flight (vLLM)
    membership.py       the heartbeat and the weights served (snapshots, broadcast rounds)
    publisher.py        scoring, publishing with the acknowledgement, the reward-outage hold, dead letters
    evaluator.py        the held-out evaluation during training
    evaluate.py         avg@k / pass@k of an engine's weights (also `dapo-mesh eval`)
    engines/            the Engine protocols and their implementations (HF, vLLM chunked, vLLM continuous)
    weight_receiver.py  the replica's side of the learner's weight broadcast
    reward_client.py    the reward server's client
    settings.py, metrics.py
"""
