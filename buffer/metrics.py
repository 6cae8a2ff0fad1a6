"""Prometheus metrics of the buffer (dapo_buffer_*)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class BufferMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = r = registry
        self.dispatched = Counter("dapo_buffer_prompts_dispatched", "Prompts published.", registry=r)
        self.in_flight = Gauge(
            "dapo_buffer_prompts_in_flight", "Prompts dispatched, group not yet received.", registry=r
        )
        self.received = Counter("dapo_buffer_groups_received", "Scored groups received.", registry=r)
        self.kept = Counter("dapo_buffer_groups_kept", "Groups kept for a batch.", registry=r)
        self.samples_generated = Counter(
            "dapo_buffer_samples_generated",
            "Samples generated for the groups received (down-sampled ones included): over samples_trained, the "
            "generated samples per trained sample.",
            registry=r,
        )
        self.samples_trained = Counter(
            "dapo_buffer_samples_trained", "Samples in the batches published to the learner.", registry=r
        )
        self.filtered = Counter("dapo_buffer_groups_filtered", "Groups dropped, by reason.", ["reason"], registry=r)
        self.pass_rate = Histogram(
            "dapo_buffer_pass_rate",
            "Fraction of correct samples per received group.",
            registry=r,
            buckets=(0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0),
        )
        self.version_lag = Histogram(
            "dapo_buffer_version_lag",
            "Policy versions behind the learner, kept groups.",
            registry=r,
            buckets=(0, 1, 2, 3, 4, 6, 8, 16),
        )
        self.batches = Counter("dapo_buffer_batches_published", "TrainBatches published.", registry=r)
        self.fill_seconds = Histogram(
            "dapo_buffer_batch_fill_seconds",
            "Seconds between two published batches.",
            registry=r,
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.going_on_cost = Gauge(
            "dapo_buffer_going_on_cost",
            "sampling_give_up_by = cost: samples drawn after an agreeing first round per sample it let train, per task "
            "(decayed); above dapo_buffer_drawn_per_kept, the task's agreeing first rounds are given up.",
            ["task"],
            registry=r,
        )
        self.drawn_per_kept = Gauge(
            "dapo_buffer_drawn_per_kept",
            "sampling_give_up_by = cost: samples drawn per sample of a group with both outcomes, over every group "
            "sampled in rounds (decayed): what a trained sample costs the run.",
            registry=r,
        )
        self.keep_ratio = Gauge("dapo_buffer_keep_ratio", "Kept / received over the last 256 groups.", registry=r)
        self.carry = Gauge("dapo_buffer_carry_groups", "Kept groups waiting for the next batch.", registry=r)
        self.paused = Gauge("dapo_buffer_paused", "1 while dispatch is paused (degenerate pass rate).", registry=r)
        self.stream_depth = Gauge(
            "dapo_buffer_stream_depth",
            "Entries in a stream (XLEN: acknowledged history included).",
            ["stream"],
            registry=r,
        )
        self.backlog = Gauge(
            "dapo_buffer_backlog",
            "Entries a group has not finished: not yet delivered (lag) + pending. What the "
            "autoscaling and the backlog alert follow.",
            ["stream", "group"],
            registry=r,
        )
        self.epoch = Gauge("dapo_buffer_epoch", "Dataset epoch of the dispatch cursor.", registry=r)
        self.leader = Gauge("dapo_buffer_leader", "1 while this buffer holds the lease; 0: standing by.", registry=r)
        self.stand_downs = Counter(
            "dapo_buffer_stand_downs", "Times this buffer found its lease taken or run out and stood down.", registry=r
        )
        self._per_task(r)

    def _per_task(self, r: CollectorRegistry) -> None:
        """Per task (a prompt's data source) and the curriculum's (buffer/curriculum.py)."""
        self.task_dispatched = Counter(
            "dapo_buffer_task_dispatched", "Prompts published, by task.", ["task"], registry=r
        )
        self.task_groups = Counter(
            "dapo_buffer_task_groups",
            "Received groups by task and outcome: keep, all_correct, all_wrong, no_variance (stale and duplicate "
            "groups are in dapo_buffer_groups_filtered).",
            ["task", "outcome"],
            registry=r,
        )
        self.skipped = Counter(
            "dapo_buffer_curriculum_skipped",
            "Prompts the curriculum skipped (predicted to give a filtered group), by task.",
            ["task"],
            registry=r,
        )
        self.predicted = Counter(
            "dapo_buffer_curriculum_predicted_filtered",
            "Sum over received groups with a prediction of the predicted probability that their samples all agree, "
            "by basis: prompt (its own history) or class (a first group, from its class's); beside "
            "dapo_buffer_curriculum_observed_filtered: the predictor's calibration.",
            ["basis"],
            registry=r,
        )
        self.observed = Counter(
            "dapo_buffer_curriculum_observed_filtered",
            "Received groups with a prediction whose samples all agreed, by basis (prompt, class).",
            ["basis"],
            registry=r,
        )
        self.predicted_groups = Counter(
            "dapo_buffer_curriculum_predicted_groups",
            "Received groups with a prediction, by basis (prompt, class).",
            ["basis"],
            registry=r,
        )
        self.bands = Gauge(
            "dapo_buffer_prompts_by_band",
            "Training prompts by difficulty band of their decayed pass rate (unseen, unsolved <5%, hard <35%, "
            "medium <65%, easy <95%, solved).",
            ["band"],
            registry=r,
        )

    def stand_down(self) -> None:
        """A standby reports no state of the mesh: the leader does (dashboards and autoscaling take the max)."""
        self.leader.set(0)
        for gauge in (self.carry, self.in_flight, self.paused):
            gauge.set(0)
        for labelled in (self.stream_depth, self.backlog, self.bands):
            labelled.clear()
