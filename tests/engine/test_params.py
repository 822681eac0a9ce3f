"""SamplingParams and EngineConfig: defaults, validation on construction, normalisation, immutability."""

import dataclasses
import re

import pytest

from llmplug.engine.params import EngineConfig, SamplingParams

NAN = float("nan")


def raises_naming(field: str, value):
    """ValueError whose message names the field and its bad value, as ``field=value!r``."""
    return pytest.raises(ValueError, match=re.escape(f"{field}={value!r}"))


# ---- SamplingParams ------------------------------------------------------------------------------------------------
def test_sampling_defaults():
    p = SamplingParams()
    assert (p.max_new_tokens, p.min_new_tokens) == (16, 0)
    assert (p.temperature, p.do_sample, p.top_k, p.top_p, p.min_p) == (1.0, True, 0, 1.0, 0.0)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.stop_token_ids == () and p.stop == ()
    assert (p.ignore_eos, p.n, p.priority) == (False, 1, 0)
    assert not p.greedy


@pytest.mark.parametrize("field, value", [
    ("max_new_tokens", 0), ("max_new_tokens", -1), ("max_new_tokens", 1.5), ("max_new_tokens", True),
    ("max_new_tokens", "8"), ("max_new_tokens", None),
    ("min_new_tokens", -1), ("min_new_tokens", 1.5), ("min_new_tokens", True), ("min_new_tokens", 17),
    ("temperature", -1), ("temperature", -0.01), ("temperature", "1"), ("temperature", None), ("temperature", NAN),
    ("top_k", -1), ("top_k", 1.5), ("top_k", True), ("top_k", None), ("top_k", "3"),
    ("top_p", 0), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1), ("top_p", NAN), ("top_p", "0.9"),
    ("min_p", 1), ("min_p", 1.0), ("min_p", -0.1), ("min_p", NAN),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", NAN),
    ("frequency_penalty", 3), ("frequency_penalty", -2.5), ("frequency_penalty", NAN), ("frequency_penalty", "0"),
    ("presence_penalty", 2.01), ("presence_penalty", -3),
    ("seed", "x"), ("seed", 1.5), ("seed", True),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1, -1]), ("stop_token_ids", [1.5]), ("stop_token_ids", [True]),
    ("stop_token_ids", -1), ("stop_token_ids", "5"), ("stop_token_ids", [None]),
    ("stop", [""]), ("stop", ""), ("stop", ["ok", ""]), ("stop", [1]), ("stop", [b"x"]), ("stop", b"abc"),
    ("n", 0), ("n", -1), ("n", 1.5), ("n", True),
    ("priority", 1.5), ("priority", "0"), ("priority", None), ("priority", True),
])
def test_sampling_bad_value_raises_naming_field_and_value(field, value):
    with raises_naming(field, value):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("max_new_tokens, min_new_tokens", [(4, 5), (1, 2), (16, 100)])
def test_min_new_tokens_above_max_new_tokens_raises(max_new_tokens, min_new_tokens):
    with raises_naming("min_new_tokens", min_new_tokens):
        SamplingParams(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens)


@pytest.mark.parametrize("kwargs", [
    {"max_new_tokens": 1},
    {"max_new_tokens": 4, "min_new_tokens": 4},
    {"temperature": 0}, {"temperature": 0.0}, {"temperature": 2.5},
    {"top_k": 0}, {"top_k": 50},
    {"top_p": 1}, {"top_p": 1e-6},
    {"min_p": 0}, {"min_p": 0.999},
    {"repetition_penalty": 1e-3}, {"repetition_penalty": 2},
    {"frequency_penalty": -2}, {"frequency_penalty": 2}, {"presence_penalty": -2.0}, {"presence_penalty": 2.0},
    {"seed": 0}, {"seed": 2**40}, {"seed": None},
    {"stop_token_ids": [0]}, {"stop_token_ids": ()},
    {"stop": ("a", "bc")}, {"stop": []},
    {"n": 1}, {"n": 8},
    {"priority": -5},
    {"do_sample": False}, {"ignore_eos": True},
])
def test_sampling_boundary_values_are_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name not in ("stop_token_ids", "stop"):
            assert getattr(p, name) == value


@pytest.mark.parametrize("value, expected", [
    ("abc", ("abc",)), (["a", "b"], ("a", "b")), (("x",), ("x",)), (["\n\n"], ("\n\n",)), ([], ()),
])
def test_stop_is_normalised_to_a_tuple(value, expected):
    assert SamplingParams(stop=value).stop == expected


@pytest.mark.parametrize("value, expected", [
    (5, (5,)), (0, (0,)), ([1, 2], (1, 2)), ((3,), (3,)), (range(2), (0, 1)), ([], ()),
])
def test_stop_token_ids_are_normalised_to_a_tuple(value, expected):
    assert SamplingParams(stop_token_ids=value).stop_token_ids == expected


def test_normalised_params_are_hashable_and_compare_equal():
    a = SamplingParams(stop="x", stop_token_ids=[1, 2])
    b = SamplingParams(stop=("x",), stop_token_ids=(1, 2))
    assert a == b and hash(a) == hash(b)
    assert a != SamplingParams(stop="y", stop_token_ids=[1, 2])


@pytest.mark.parametrize("kwargs, greedy", [
    ({}, False),
    ({"temperature": 0}, True),
    ({"temperature": 0.0}, True),
    ({"do_sample": False}, True),
    ({"do_sample": False, "temperature": 0.7}, True),
    ({"temperature": 1e-4}, False),
    ({"temperature": 0.7, "top_k": 1}, False),
])
def test_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).greedy is greedy


def test_sampling_params_are_frozen():
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.stop = ("x",)
    assert p.temperature == 1.0 and p.stop == ()


def test_replace_validates_again():
    p = SamplingParams(max_new_tokens=8, stop="a")
    q = dataclasses.replace(p, temperature=0)
    assert q.greedy and q.max_new_tokens == 8 and q.stop == ("a",) and not p.greedy
    with raises_naming("top_p", 0):
        dataclasses.replace(p, top_p=0)
    with raises_naming("min_new_tokens", 9):
        dataclasses.replace(p, min_new_tokens=9)


@pytest.mark.parametrize("field, value", [
    ("stop_token_ids", None), ("stop_token_ids", 1.5), ("stop", None), ("stop", 5),
])
def test_non_iterable_stop_values_raise_value_error(field, value):
    with raises_naming(field, value):
        SamplingParams(**{field: value})


def test_stop_token_ids_from_an_iterator_are_kept():
    assert SamplingParams(stop_token_ids=iter([1, 2])).stop_token_ids == (1, 2)


# ---- EngineConfig --------------------------------------------------------------------------------------------------
def test_engine_config_defaults():
    c = EngineConfig()
    assert (c.max_num_seqs, c.max_num_batched_tokens) == (256, 4096)
    assert (c.policy, c.preemption_mode) == ("fcfs", "recompute")
    assert (c.watermark, c.swap_space_gb) == (0.01, 4.0)
    assert c.enable_prefix_caching is True
    assert (c.slo_ttft_s, c.slo_tpot_s) == (1.0, 0.1)


@pytest.mark.parametrize("field, value", [
    ("max_num_seqs", 0), ("max_num_seqs", -1), ("max_num_seqs", 1.5), ("max_num_seqs", True),
    ("max_num_batched_tokens", 8), ("max_num_batched_tokens", 15), ("max_num_batched_tokens", 0),
    ("max_num_batched_tokens", 16.0), ("max_num_batched_tokens", True),
    ("policy", "lifo"), ("policy", "FCFS"), ("policy", ""), ("policy", None),
    ("watermark", 0.6), ("watermark", 0.5), ("watermark", -0.1), ("watermark", "0.1"), ("watermark", NAN),
    ("preemption_mode", "x"), ("preemption_mode", "Swap"), ("preemption_mode", None),
    ("swap_space_gb", -1), ("swap_space_gb", "4"), ("swap_space_gb", NAN),
    ("enable_prefix_caching", "yes"), ("enable_prefix_caching", 1), ("enable_prefix_caching", None),
    ("slo_ttft_s", 0), ("slo_ttft_s", -1.0), ("slo_ttft_s", "1"), ("slo_ttft_s", NAN),
    ("slo_tpot_s", 0), ("slo_tpot_s", -0.5), ("slo_tpot_s", None),
])
def test_engine_config_bad_value_raises_naming_field_and_value(field, value):
    with raises_naming(field, value):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("field, value", [("policy", "lifo"), ("preemption_mode", "x")])
def test_engine_config_choice_errors_list_the_choices(field, value):
    with pytest.raises(ValueError) as info:
        EngineConfig(**{field: value})
    choices = ("fcfs", "priority") if field == "policy" else ("recompute", "swap")
    assert all(repr(c) in str(info.value) for c in choices)


@pytest.mark.parametrize("kwargs", [
    {"max_num_seqs": 1}, {"max_num_batched_tokens": 16},
    {"policy": "fcfs"}, {"policy": "priority"},
    {"watermark": 0}, {"watermark": 0.0}, {"watermark": 0.49},
    {"preemption_mode": "recompute"}, {"preemption_mode": "swap"},
    {"swap_space_gb": 0}, {"swap_space_gb": 0.5},
    {"enable_prefix_caching": False},
    {"slo_ttft_s": 1e-3}, {"slo_tpot_s": 5},
])
def test_engine_config_boundary_values_are_accepted(kwargs):
    c = EngineConfig(**kwargs)
    for name, value in kwargs.items():
        assert getattr(c, name) == value


def test_engine_config_is_frozen_and_replace_validates_again():
    c = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_num_seqs = 1
    assert c.max_num_seqs == 256
    assert dataclasses.replace(c, policy="priority").policy == "priority"
    with raises_naming("watermark", 0.6):
        dataclasses.replace(c, watermark=0.6)
    assert hash(c) == hash(EngineConfig())
