"""python -m learner [--model-dir DIR] [--zero-stage 0] ...  (every flag also as env DAPO_*)."""

import signal
import sys
import threading


def main(argv: list[str] | None = None) -> None:
    from learner.settings import LearnerSettings
    from services.common.logs import configure_logging
    from services.common.settings import load_settings

    settings = load_settings(LearnerSettings, sys.argv[1:] if argv is None else argv, prog="python -m learner")
    configure_logging("learner", settings)
    stop = threading.Event()  # SIGTERM / Ctrl-C: finish the batch, checkpoint, acknowledge, exit
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    from learner.runner import run

    run(settings, stop)


if __name__ == "__main__":
    main()
