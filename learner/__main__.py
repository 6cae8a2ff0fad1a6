"""python -m learner [--model-dir DIR] [--zero-stage 0] ...  (every flag also as env DAPO_*)."""

import os
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> None:
    from learner.settings import LearnerSettings
    from services.logs import configure_logging
    from services.settings import load_settings

    args = sys.argv[1:] if argv is None else argv
    settings = load_settings(LearnerSettings, args, prog="python -m learner")
    if settings.ranks > 1 and "RANK" not in os.environ:  # become the torchrun agent of `ranks` learner processes
        launcher = [
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={settings.ranks}",
            "--max-restarts=0",
        ]  # a rank that dies stops all: the supervisor restarts the learner
        os.execv(sys.executable, [sys.executable, *launcher, "-m", "learner", *args])
    configure_logging("learner", settings)
    stop = threading.Event()  # SIGTERM / Ctrl-C: finish the batch, checkpoint, acknowledge, exit
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    from learner.parallel import exit_rank, shutdown
    from learner.runner import run

    try:
        run(settings, stop)
    finally:
        shutdown()
    exit_rank()


if __name__ == "__main__":
    main()
