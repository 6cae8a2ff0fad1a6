"""python -m buffer [--dataset ...] [--batch-size 8] ...  (every flag also as env DAPO_*)."""

import signal
import sys
import threading


def main(argv: list[str] | None = None) -> None:
    from buffer.settings import BufferSettings
    from services.logs import configure_logging
    from services.settings import load_settings

    settings = load_settings(BufferSettings, sys.argv[1:] if argv is None else argv, prog="python -m buffer")
    configure_logging("buffer", settings)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    from buffer.runner import run

    run(settings, stop)


if __name__ == "__main__":
    main()
