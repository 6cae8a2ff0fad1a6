"""python -m env_server [--port 8005] [--env-classes mypkg.envs:Maze] ...  (every flag also as env DAPO_*)."""

import sys


def main(argv: list[str] | None = None) -> None:
    from env_server.settings import EnvSettings
    from services.logs import configure_logging
    from services.settings import load_settings

    settings = load_settings(EnvSettings, sys.argv[1:] if argv is None else argv, prog="python -m env_server")
    configure_logging("env", settings)
    from env_server.runner import run

    run(settings)


if __name__ == "__main__":
    main()
