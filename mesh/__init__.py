"""The orchestrator: everything that sits on top of the services and may import them all.

    cli.py          the `dapo-mesh` command line (also `python -m mesh`)
    config.py       MeshConfig and the preset files (configs/*.toml)
    commands.py     a config -> each service's command line (pure)
    supervisor.py   processes: spawn, restart policy, stop; the embedded Redis
    recorder.py     the learner's ledger and the held-out evaluations -> metrics.jsonl, curves.png
    local.py        `dapo-mesh up`: the parts above together, with the live view (live.py)
    layout.py       the files of a run directory
    audit.py        `dapo-mesh audit`: every dispatched prompt accounted for
    curves.py       metrics.jsonl -> curves.png

The services never import this package; services imports no service and nothing here.
"""
