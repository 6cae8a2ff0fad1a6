"""A consumer process that reads entries and never acknowledges them (the test then SIGKILLs it).

python tests/integration/hold_pending.py REDIS_URL STREAM GROUP CONSUMER COUNT
"""

import sys
import time

from services.schemas import ScoredGroup
from services.streams import StreamConsumer, connect

url, stream, group, name, count = sys.argv[1:6]
consumer = StreamConsumer(connect(url), stream, group, name, ScoredGroup)
held: list[str] = []
while len(held) < int(count):
    held += [d.entry_id for d in consumer.read(count=int(count) - len(held), block_ms=500)]
print("HELD " + " ".join(held), flush=True)
time.sleep(600)
