"""`make bench`: run every benchmark and print one table (and its JSON)."""

from bench import (
    curriculum,
    episodes,
    gateway,
    learner,
    lora,
    mesh,
    placement,
    queue,
    ranks,
    recording,
    reward,
    rollout,
    sandbox,
    weight_sync,
)
from bench.common import print_table

if __name__ == "__main__":
    print_table(
        queue.run()
        + curriculum.run()
        + reward.run()
        + learner.run()
        + ranks.run()
        + placement.run()
        + rollout.run()
        + rollout.dtype_rows()
        + rollout.inflight_rows()
        + episodes.run()
        + gateway.run()
        + weight_sync.run()
        + lora.run()
        + mesh.run()
        + sandbox.run()
        + recording.run()
    )
