"""python -m reward_server [--port 8001] [--workers 2] ...  (every flag also as env DAPO_*)."""

import sys


def main(argv: list[str] | None = None) -> None:
    from reward_server.settings import RewardSettings
    from services.logs import configure_logging
    from services.settings import load_settings

    settings = load_settings(RewardSettings, sys.argv[1:] if argv is None else argv, prog="python -m reward_server")
    configure_logging("reward", settings)
    from reward_server.runner import run

    run(settings)


if __name__ == "__main__":
    main()
