"""Wire contracts: every type round-trips through the codec; inconsistent messages are rejected by name."""

from __future__ import annotations

import math

import msgpack
import pytest
from pydantic import ValidationError

from services.schemas import MESSAGE_TYPES, PromptTask, Sample, Score, ScoredGroup, TrainBatch
from services.selfcheck import example_group, example_messages
from services.streams import DecodeError, decode, encode


def test_every_message_type_has_an_example() -> None:
    assert {type(m).__name__ for m in example_messages()} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", example_messages(), ids=lambda m: type(m).__name__)
def test_codec_round_trip_is_exact(msg) -> None:
    fields = encode(msg)
    assert fields[b"type"] == type(msg).__name__.encode()
    back = decode(fields, type(msg))
    assert back == msg
    assert back.model_dump() == msg.model_dump()


def test_floats_survive_bit_exact() -> None:
    g = example_group(3, n_samples=2, n_tokens=64)
    back = decode(encode(g), ScoredGroup)
    for a, b in zip(g.samples, back.samples, strict=True):
        assert [x.hex() for x in a.logprobs] == [x.hex() for x in b.logprobs]


def _sample(**kw) -> dict:
    base = dict(
        response_token_ids=[1, 2, 3],
        response_text="x",
        logprobs=[-0.1, -0.2, -0.3],
        finish_reason="stop",
        policy_version=0,
    )
    return base | kw


def test_logprob_count_must_match_tokens() -> None:
    with pytest.raises(ValidationError, match="logprobs: 2 log-probs for 3 response tokens"):
        Sample(**_sample(logprobs=[-0.1, -0.2]))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_logprobs_must_be_finite(bad: float) -> None:
    with pytest.raises(ValidationError, match=r"logprobs\n  Value error, log-probs must be finite: .* at index 1"):
        Sample(**_sample(logprobs=[-0.1, bad, -0.3]))


def test_truncated_follows_finish_reason() -> None:
    assert Sample(**_sample(finish_reason="length")).truncated
    assert not Sample(**_sample(finish_reason="stop")).truncated


@pytest.mark.parametrize("field", ["reward", "overlong_penalty"])
def test_nan_rewards_rejected(field: str) -> None:
    kw = {"reward": 1.0, "acc": True, "overlong_penalty": 0.0} | {field: math.nan}
    with pytest.raises(ValidationError, match=field):
        Score(**kw)


def test_empty_group_rejected() -> None:
    g = example_group(0)
    with pytest.raises(ValidationError, match="samples"):
        ScoredGroup(task=g.task, samples=[], scores=[], replica_id="r")


def test_group_scores_must_match_samples() -> None:
    g = example_group(0, n_samples=4)
    with pytest.raises(ValidationError, match="scores: 3 scores for 4 samples"):
        ScoredGroup(task=g.task, samples=g.samples, scores=g.scores[:3], replica_id="r")


def test_group_size_must_match_task() -> None:
    g = example_group(0, n_samples=4)
    with pytest.raises(ValidationError, match="task.n_samples is 4"):
        ScoredGroup(task=g.task, samples=g.samples[:2], scores=g.scores[:2], replica_id="r")


def test_prompt_task_needs_a_prompt() -> None:
    with pytest.raises(ValidationError, match="prompt"):
        PromptTask(task_id="t", prompt_id="p", ground_truth="1", verifier="v", data_source="d", n_samples=2)
    assert (
        PromptTask(
            task_id="t",
            prompt_id="p",
            prompt_token_ids=[5],
            ground_truth="1",
            verifier="v",
            data_source="d",
            n_samples=2,
        ).prompt
        is None
    )


def test_train_batch_version_range_is_checked() -> None:
    groups = [example_group(0, version=3), example_group(1, version=5)]
    batch = TrainBatch.assemble(7, groups)
    assert (batch.min_version, batch.max_version) == (3, 5)
    with pytest.raises(ValidationError, match="min_version/max_version: declared 4..5"):
        TrainBatch(batch_id=7, groups=groups, min_version=4, max_version=5)


def test_train_batch_rejects_duplicate_groups() -> None:
    g = example_group(0)
    with pytest.raises(ValidationError, match="same group"):
        TrainBatch.assemble(0, [g, g])


def test_unknown_fields_rejected() -> None:
    body = example_group(0).task.model_dump() | {"surprise": 1}
    with pytest.raises(ValidationError, match="surprise"):
        PromptTask.model_validate(body)


# --- decode errors name the problem


def test_decode_wrong_type() -> None:
    with pytest.raises(DecodeError, match="reads ScoredGroup") as e:
        decode(encode(example_group(0).task), ScoredGroup)
    assert e.value.kind == "wrong_type"


def test_decode_garbage() -> None:
    with pytest.raises(DecodeError, match="not valid msgpack") as e:
        decode({b"type": b"PromptTask", b"data": b"\xc1\xc1"}, PromptTask)
    assert e.value.kind == "not_msgpack"


def test_decode_missing_fields() -> None:
    with pytest.raises(DecodeError, match="lacks") as e:
        decode({b"x": b"y"}, PromptTask)
    assert e.value.kind == "malformed"


def test_a_schema_1_sample_still_reads() -> None:
    """Schema 2 of Sample added the sampling parameters; a sample written before reads as sampled at 1.0."""
    body = example_group(0).samples[0].model_dump() | {"schema_version": 1}
    del body["temperature"], body["top_p"]
    old = decode({b"type": b"Sample", b"data": msgpack.packb(body)}, Sample)
    assert (old.schema_version, old.temperature, old.top_p) == (1, 1.0, 1.0)
    two = decode({b"type": b"Sample", b"data": msgpack.packb(body | {"schema_version": 2})}, Sample)
    assert two.version_runs is None and two.token_versions() == [two.policy_version] * len(two.response_token_ids)
    with pytest.raises(DecodeError, match="schema_version 5 is not 1, 2, 3 or 4"):
        decode({b"type": b"Sample", b"data": msgpack.packb(body | {"schema_version": 5})}, Sample)


def test_version_runs_give_every_token_its_version() -> None:
    """Schema 3: a sample that spans in-flight weight updates carries the version of every token as run-lengths."""
    s = example_group(0).samples[0]
    n = len(s.response_token_ids)
    spanning = s.model_copy(update={"policy_version": 3, "version_runs": [(3, 5), (4, n - 6), (6, 1)]})
    back = decode({b"type": b"Sample", b"data": msgpack.packb(spanning.model_dump())}, Sample)
    assert back.token_versions() == [3] * 5 + [4] * (n - 6) + [6]
    assert (back.policy_version, back.newest_version, back.n_versions) == (3, 6, 3)
    body = spanning.model_dump()
    for runs, why in [([(3, 5), (4, n - 5 - 2)], "do not cover"), ([(3, 5), (4, 0), (5, n - 5)], "do not cover"),
                      ([(2, 5), (4, n - 5)], "must increase from policy_version 3"),
                      ([(3, 5), (3, n - 5)], "must increase")]:  # fmt: skip
        with pytest.raises(DecodeError, match=why):
            decode({b"type": b"Sample", b"data": msgpack.packb(body | {"version_runs": runs})}, Sample)


def test_decode_future_schema_version() -> None:
    body = example_group(0).task.model_dump() | {"schema_version": 2}
    with pytest.raises(DecodeError, match="schema_version 2") as e:
        decode({b"type": b"PromptTask", b"data": msgpack.packb(body)}, PromptTask)
    assert e.value.kind == "schema_version"


def test_decode_invalid_names_field() -> None:
    body = example_group(0).model_dump()
    body["samples"][1]["logprobs"] = body["samples"][1]["logprobs"][:-4]  # one float32 fewer
    with pytest.raises(DecodeError, match=r"samples\.1: .*logprobs: 15 log-probs for 16 response tokens") as e:
        decode({b"type": b"ScoredGroup", b"data": msgpack.packb(body)}, ScoredGroup)
    assert e.value.kind == "invalid"


def test_decode_size_cap() -> None:
    fields = encode(example_group(0, n_tokens=256))
    with pytest.raises(DecodeError, match="limit is 1000") as e:
        decode(fields, ScoredGroup, max_bytes=1000)
    assert e.value.kind == "too_large"


def test_digests_see_content_not_ids() -> None:
    """A copy (through the codec, as a redelivery is) has the same digest; the same task sampled again, or a batch
    with the same id and other groups, another one."""
    g = example_group(1, n_tokens=8)
    assert decode(encode(g), ScoredGroup).digest() == g.digest()
    resampled = g.model_copy(update={"created_at": g.created_at + 1})
    assert resampled.group_id == g.group_id and resampled.digest() != g.digest()
    b = TrainBatch.assemble(7, [g, example_group(2)])
    assert decode(encode(b), TrainBatch).digest() == b.digest()
    assert TrainBatch.assemble(7, [g, example_group(3)]).digest() != b.digest()
    assert TrainBatch.assemble(8, b.groups).digest() == b.digest()  # the id is not part of it


def test_an_episode_sample_carries_its_turns_and_the_mask_follows() -> None:
    """Schema 4: an episode's response is model and environment turns; the mask is 1 on the model's tokens only.
    A sample without turns (schema 3 and before) is one model turn."""
    base = example_group(0, n_tokens=9).samples[0]
    assert base.turns is None and base.loss_mask() == [1] * 9
    three = decode({b"type": b"Sample", b"data": msgpack.packb(base.model_dump() | {"schema_version": 3})}, Sample)
    assert three.turns is None and three.loss_mask() == [1] * 9
    turns = [{"role": "model", "tokens": 3}, {"role": "env", "tokens": 2}, {"role": "model", "tokens": 4}]
    ep = Sample.model_validate(base.model_dump() | {"turns": turns})
    assert ep.loss_mask() == [1, 1, 1, 0, 0, 1, 1, 1, 1]
    assert decode({b"type": b"Sample", b"data": msgpack.packb(ep.model_dump())}, Sample) == ep
    with pytest.raises(ValueError, match="the turns must cover the response exactly"):
        Sample.model_validate(base.model_dump() | {"turns": turns[:2]})
    with pytest.raises(ValueError, match="role"):
        Sample.model_validate(base.model_dump() | {"turns": [{"role": "tool", "tokens": 9}]})
