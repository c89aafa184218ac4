"""SamplingParams refuses values no sampler can honour, naming the field."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from yaie.errors import InvalidRequestError
from yaie.sampling_params import FLOAT_FIELDS, GREEDY_TEMPERATURE, SamplingParams
from yaie.structured.spec import StructuredOutputs


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_float_field_must_be_finite(name: str, value: float) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{name: value})
    assert info.value.param == name


@pytest.mark.parametrize("bias", [math.nan, math.inf])
def test_logit_bias_values_must_be_finite(bias: float) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logit_bias={5: bias})
    assert info.value.param == "logit_bias"


def test_top_k_beyond_any_vocabulary_is_refused() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(top_k=10**400)
    assert info.value.param == "top_k"


@pytest.mark.parametrize("temperature", [1e-37, 1e-45, GREEDY_TEMPERATURE / 2])
def test_temperatures_below_the_floor_are_greedy(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, top_p=0.9)
    assert params.greedy and params.temperature == 0.0


def test_the_floor_itself_still_samples() -> None:
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


def test_ending_tokens_follow_ignore_eos() -> None:
    assert SamplingParams(stop_token_ids=[7]).ending_token_ids({2}) == {2, 7}
    assert SamplingParams(stop_token_ids=[7], ignore_eos=True).ending_token_ids({2}) == {7}


def test_stop_tokens_do_not_end_a_constrained_output() -> None:
    """The grammar spans the whole output and ends it itself, allowing EOS once it is complete."""
    constrained = SamplingParams(stop_token_ids=[7], structured_outputs=StructuredOutputs(regex="a+"))
    assert constrained.ending_token_ids({2}) == {2}
    assert replace(constrained, ignore_eos=True).ending_token_ids({2}) == set()
