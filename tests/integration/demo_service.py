"""A minimal service built only from the shared helpers, to test them over real HTTP.

DAPO_AUTH_TOKEN=T python tests/integration/demo_service.py --port 8123
"""

import logging

from prometheus_client import CollectorRegistry, Counter

from services.logs import configure_logging
from services.settings import RedisSettings, ServiceSettings, load_settings
from services.web import Authorized, create_app, serve


class DemoSettings(ServiceSettings, RedisSettings):
    pass


settings = load_settings(DemoSettings, prog="demo_service")
configure_logging("demo", settings)
logging.getLogger("demo").info("settings: %s; url %s", settings.redacted(), settings.redis_url)  # masked
registry = CollectorRegistry()
hits = Counter("dapo_demo_hits", "Calls of /hit.", registry=registry)
app = create_app("demo", settings, registry, ready=lambda: (hits._value.get() > 0, "needs one /hit"))


@app.post("/hit")
def hit(_: Authorized) -> dict[str, int]:
    hits.inc()
    return {"hits": int(hits._value.get())}


serve(app, settings)
