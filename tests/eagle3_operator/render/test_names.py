"""Child names and labels: every child name fits the 63-character DNS label limit, short valid names are
kept, others get a stable hash, and selectors pick only one target's pods."""

import re

import pytest
from eagle3_operator.render.names import child_name, label_selector, selector_labels
from hypothesis import given, settings
from hypothesis import strategies as st

from support.rendering import (
    DNS_1035,
    LONG_NAME,
    children,
    make_spec,
)

LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def test_selectors_pick_only_this_targets_pods():
    rendered = children(make_spec())
    deployment, service = rendered["Deployment"], rendered["Service"]
    selector = selector_labels("tiny")
    assert deployment["spec"]["selector"]["matchLabels"] == selector
    assert service["spec"]["selector"] == selector
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= template_labels.items()
    assert selector_labels("tiny") != selector_labels("tiny2")
    assert label_selector("tiny") == "app.kubernetes.io/instance=tiny,app.kubernetes.io/name=eagle3-target"


@pytest.mark.parametrize("name", ["tiny", "x" * 63, "x" * 64, LONG_NAME, "8b-target", "llama-3.1-8b"])
def test_names_fit_the_63_character_limit(name):
    for child in children(
        make_spec(replicas=2, monitoring={"podMonitor": {"enabled": True}}), name=name
    ).values():
        assert DNS_1035.match(child["metadata"]["name"]), child["metadata"]["name"]
        assert len(child["metadata"]["name"]) <= 63
        for value in child["metadata"]["labels"].values():
            assert len(value) <= 63 and LABEL_VALUE.match(value)


def test_short_valid_names_are_kept_and_others_get_a_hash():
    assert child_name("tiny") == "tiny"
    assert child_name("x" * 63) == "x" * 63
    long = child_name(LONG_NAME)
    assert long.startswith("a-very-long-target-name") and len(long) <= 63
    dotted = child_name("llama-3.1-8b")  # '.' may not appear in a Service name
    assert dotted.startswith("llama-3-1-8b-") and dotted != child_name("llama-3-1-8b")
    assert child_name("8b").startswith("e3t-8b-")


def test_instance_label_is_the_target_name_whenever_it_can_be():
    assert selector_labels("llama-3.1-8b")["app.kubernetes.io/instance"] == "llama-3.1-8b"
    assert selector_labels("8b")["app.kubernetes.io/instance"] == "8b"
    too_long = selector_labels("x" * 64)["app.kubernetes.io/instance"]
    assert too_long == child_name("x" * 64) and len(too_long) <= 63
    assert selector_labels("x" * 64) != selector_labels("x" * 65)


@settings(deadline=None)  # no timing assertions: a loaded CI machine must not fail this
@given(st.from_regex(r"[a-z0-9]([-a-z0-9.]{0,120}[a-z0-9])?", fullmatch=True))
def test_any_resource_name_maps_to_a_valid_stable_service_name(name):
    service = child_name(name)
    assert DNS_1035.match(service) and len(service) <= 63
    assert service == child_name(name)


@settings(deadline=None)
@given(
    st.from_regex(r"[a-z][-a-z0-9]{60,80}[a-z0-9]", fullmatch=True),
    st.from_regex(r"[a-z][-a-z0-9]{60,80}[a-z0-9]", fullmatch=True),
)
def test_distinct_long_names_stay_distinct(first, second):
    if first != second:
        assert child_name(first) != child_name(second)
