"""`make bench`: run every benchmark and print one table (and its JSON)."""

from bench import learner, queue, reward, rollout
from bench.common import print_table

if __name__ == "__main__":
    print_table(queue.run() + reward.run() + learner.run() + rollout.run())
