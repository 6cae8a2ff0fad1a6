"""python -m rollout [--engine vllm|hf] [--model-dir DIR] ...  (every flag also as env DAPO_*)."""

import signal
import sys
import threading


def main(argv: list[str] | None = None) -> None:
    from rollout.settings import RolloutSettings
    from services.logs import configure_logging
    from services.settings import load_settings

    settings = load_settings(RolloutSettings, sys.argv[1:] if argv is None else argv, prog="python -m rollout")
    configure_logging("rollout", settings)
    stop = threading.Event()  # SIGTERM / Ctrl-C: finish the engine call, publish, exit
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    from rollout.runner import run

    run(settings, stop)


if __name__ == "__main__":
    main()
