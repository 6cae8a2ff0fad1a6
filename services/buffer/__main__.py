"""python -m services.buffer [--dataset ...] [--batch-size 8] ...  (every flag also as env DAPO_*)."""

import signal
import sys
import threading


def main(argv: list[str] | None = None) -> None:
    from services.buffer.settings import BufferSettings
    from services.common.logs import configure_logging
    from services.common.settings import load_settings

    settings = load_settings(BufferSettings, sys.argv[1:] if argv is None else argv, prog="python -m services.buffer")
    configure_logging("buffer", settings)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    from services.buffer.runner import run

    run(settings, stop)


if __name__ == "__main__":
    main()
