"""python -m sandbox [--port 8006] [--workers 2] ...  (every flag also as env DAPO_*)."""

import sys


def main(argv: list[str] | None = None) -> None:
    from sandbox.settings import SandboxSettings
    from services.logs import configure_logging
    from services.settings import load_settings

    settings = load_settings(SandboxSettings, sys.argv[1:] if argv is None else argv, prog="python -m sandbox")
    configure_logging("sandbox", settings)
    from sandbox.app import build_app
    from services.web import serve

    serve(build_app(settings), settings)  # uvicorn handles the signals: it drains the runs in flight, then stops


if __name__ == "__main__":
    main()
