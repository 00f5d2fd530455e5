"""SamplingParams: vLLM's defaults, and a ValueError naming the field and the value for every bad one."""

from __future__ import annotations

import pytest

from vserve.core.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field", "shown"),
    [
        ({"n": 0}, "n", "0"),
        ({"temperature": -1}, "temperature", "-1"),
        ({"top_p": 0}, "top_p", "0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"top_k": -2}, "top_k", "-2"),
        ({"min_p": 2}, "min_p", "2"),
        ({"presence_penalty": 3}, "presence_penalty", "3"),
        ({"frequency_penalty": -3}, "frequency_penalty", "-3"),
        ({"repetition_penalty": 0}, "repetition_penalty", "0"),
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"max_tokens": -186}, "max_tokens", "-186"),
        ({"min_tokens": -1}, "min_tokens", "-1"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens", "min_tokens=5, max_tokens=3"),
        ({"logprobs": -1}, "logprobs", "-1"),
        ({"stop": [""]}, "stop", "['']"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "[-1]"),
        ({"logit_bias": {1: 200}}, "logit_bias", "200"),
    ],
    ids=lambda v: None if isinstance(v, dict) else str(v),
)
def test_an_invalid_value_raises_value_error_naming_field_and_value(kwargs, field, shown):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)

    msg = str(exc.value)
    assert msg.startswith(f"{field} "), msg
    assert f"got {shown}" in msg, msg


def test_max_tokens_message_is_the_documented_one():
    with pytest.raises(ValueError) as exc:
        SamplingParams(max_tokens=-186)

    assert str(exc.value) == "max_tokens must be >= 1, got -186"


def test_defaults_construct_with_vllm_values():
    sp = SamplingParams()

    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (sp.max_tokens, sp.min_tokens, sp.logprobs, sp.seed) == (16, 0, None, None)
    assert (sp.stop, sp.stop_token_ids, sp.logit_bias) == ([], [], None)
    assert sp.greedy is False


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_p": 1.0}, {"min_p": 0.0}, {"min_p": 1.0}, {"presence_penalty": -2}, {"presence_penalty": 2},
        {"frequency_penalty": -2}, {"frequency_penalty": 2}, {"repetition_penalty": 2},
        {"max_tokens": None}, {"max_tokens": 1}, {"min_tokens": 4, "max_tokens": 4}, {"logprobs": 0},
        {"logit_bias": {0: -100, 5: 100}}, {"temperature": 0}, {"stop_token_ids": [0]},
    ],
)
def test_boundary_values_are_accepted(kwargs):
    sp = SamplingParams(**kwargs)

    for name, value in kwargs.items():
        assert getattr(sp, name) == value


def test_top_k_minus_one_means_no_limit_and_is_stored_as_zero():
    assert SamplingParams(top_k=-1).top_k == 0


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]


def test_temperature_zero_is_greedy():
    assert SamplingParams(temperature=0).greedy is True


def test_token_ids_outside_the_vocabulary_are_rejected_for_that_vocabulary():
    with pytest.raises(ValueError) as exc:
        SamplingParams(stop_token_ids=[3, 100]).validate_for_vocab(100)

    assert str(exc.value) == "stop_token_ids has token ids outside the vocabulary (size 100): [100]"
    SamplingParams(stop_token_ids=[99], logit_bias={99: 1.0}).validate_for_vocab(100)
