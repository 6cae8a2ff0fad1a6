"""`make bench`: run every benchmark and print one table (and its JSON)."""

from bench import learner, mesh, queue, reward, rollout, weight_sync
from bench.common import print_table

if __name__ == "__main__":
    print_table(queue.run() + reward.run() + learner.run() + rollout.run() + weight_sync.run() + mesh.run())
