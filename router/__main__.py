"""python -m router [--port 8010] [--redis-url URL] ...  (every flag also as env DAPO_*)."""

import sys


def main(argv: list[str] | None = None) -> None:
    from router.settings import RouterSettings
    from services.logs import configure_logging
    from services.settings import load_settings

    settings = load_settings(RouterSettings, sys.argv[1:] if argv is None else argv, prog="python -m router")
    configure_logging("router", settings)
    from router.app import build_app
    from services.web import serve

    serve(build_app(settings), settings)  # uvicorn handles the signals: it drains the calls in flight, then stops


if __name__ == "__main__":
    main()
