"""Every parameter of every registered policy has declared bounds, enforced by the registry.

Parametrized over ``available_policies()`` and each policy's ``params_spec``, so a policy or a
parameter added later is held to the same contract: values just outside each bound, non-finite
numbers, bools, strings and ints too large for a float are refused with
``InvalidPolicyParamsError`` naming the policy, the parameter and the bound, on every way in
(``create_policy``, ``parse_policy_params``, the class itself, ``create_manager``,
``switch_policy``, which then changes nothing); the values at the bounds (just inside an open
one) are accepted, and a policy built there works.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from manager import InvalidPolicyParamsError, available_policies, create_manager, create_policy
from manager.policies import (
    LRUPolicy,
    ParamSpec,
    describe_policy_params,
    parse_policy_params,
    policy_class,
    policy_params_help,
    policy_params_spec,
    register_policy,
)
from manager.policies.registry import _REGISTRY
from tests.manager.harness import Pool, keys

POLICIES = available_policies()
SPECS = [(name, spec) for name in POLICIES for spec in policy_params_spec(name)]
SPEC_IDS = [f"{name}.{spec.name}" for name, spec in SPECS]


def edges(spec: ParamSpec) -> tuple[list[float], list[float]]:
    """``(accepted, refused)``: the bounds themselves or the nearest value inside an open one,
    and the nearest values outside each bound."""
    assert spec.low is not None
    assert spec.high is not None
    low, high = spec.low, spec.high
    if spec.kind == "int":
        return [int(low), int(high)], [int(low) - 1, int(high) + 1]
    inside_low = math.nextafter(low, math.inf) if spec.low_open else low
    inside_high = math.nextafter(high, -math.inf) if spec.high_open else high
    outside_low = low if spec.low_open else math.nextafter(low, -math.inf)
    outside_high = high if spec.high_open else math.nextafter(high, math.inf)
    return [inside_low, inside_high], [outside_low, outside_high]


def refusal(policy: str, spec: ParamSpec) -> str:
    """The start of every refusal of ``spec``'s values: policy, parameter, bound."""
    return re.escape(f"{policy}: {spec.name} must be {spec.accepted()}, got ")


def exercise(policy: str, params: dict[str, object], capacity: int) -> None:
    """Build ``policy`` and run a short life through it: inserts, touches, a finished chain,
    evictions of all and of some, a rebuild; every answer must be coherent."""
    p = create_policy(policy, capacity, params)
    for rnd in range(3):
        batch = keys(rnd * 100, rnd * 100 + capacity)
        held = list(p.coldest_first())
        if held:
            assert p.evict(len(held)) is not None
        p.insert(batch)
        p.touch(batch[: max(1, capacity // 2)])
        p.request_finished(batch)
        assert len(p) == capacity
        victims = p.evict(1, lambda k: True)
        assert victims is not None
        assert len(victims) == 1
        assert victims[0] not in p
        assert p.evict(capacity + 1) is None  # more than held: nothing changes
        assert len(p) == capacity - 1
    again = create_policy(policy, capacity, params)
    assert again.rebuild(p.coldest_first()) == len(p)


def test_every_numeric_parameter_has_finite_bounds() -> None:
    for name in POLICIES:
        for spec in policy_params_spec(name):
            if spec.kind != "choice":
                assert spec.low is not None
                assert spec.high is not None
                assert math.isfinite(spec.low)
                assert math.isfinite(spec.high), (name, spec.name)
            # Declared once: the defaults the policy reports are the declared ones.
            assert policy_class(name).parse_params({})[spec.name] == spec.default


def test_the_declared_bounds() -> None:
    """The values docs/api.md's table and the help texts promise."""
    got = {
        (name, spec.name): spec.accepted() for name in POLICIES for spec in policy_params_spec(name)
    }
    assert got == {
        ("lfu", "history_factor"): "a number in [0, 16]",
        ("prefix_lrfu", "half_life"): "a number in (0, 1000]",
        ("prefix_lrfu", "ghost_factor"): "a number in (0, 16]",
        ("prefix_lrfu", "watch_factor"): "a number in (0, 1000]",
        ("s3fifo", "small_ratio"): "a number in (0, 1)",
        ("slru", "protected_ratio"): "a number in (0, 1)",
    }


def test_the_api_document_lists_every_parameter_with_its_bounds() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \(.*?\) \| (\S+, \S+) \| (\S+) \|$", doc, re.M)
    documented = {(policy, name): (accepted, default) for policy, name, accepted, default in rows}
    declared = {
        (policy, spec.name): (spec.accepted().split(" in ", 1)[1], f"{spec.default:g}")
        for policy, spec in SPECS
    }
    assert documented == declared


@pytest.mark.parametrize(("policy", "spec"), SPECS, ids=SPEC_IDS)
def test_values_just_outside_each_bound_are_refused(policy: str, spec: ParamSpec) -> None:
    _, refused = edges(spec)
    for value in refused:
        with pytest.raises(InvalidPolicyParamsError, match=refusal(policy, spec)):
            create_policy(policy, 8, {spec.name: value})


@pytest.mark.parametrize(("policy", "spec"), SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize(
    "value",
    [
        math.inf,
        -math.inf,
        math.nan,
        1e308,
        1e30,
        -1e308,
        10**400,  # int: too large for a float, refused without OverflowError
        -(10**400),
        True,
        False,
        "1",
        None,
        [0.5],
        {"value": 0.5},
    ],
    ids=repr,
)
def test_non_finite_huge_and_mistyped_values_are_refused(
    policy: str, spec: ParamSpec, value: object
) -> None:
    with pytest.raises(InvalidPolicyParamsError, match=refusal(policy, spec)) as info:
        parse_policy_params(policy, {spec.name: value})
    assert len(str(info.value)) < 200  # a huge value is cut, the message stays one line
    with pytest.raises(InvalidPolicyParamsError, match=refusal(policy, spec)):
        create_policy(policy, 8, {spec.name: value})
    with pytest.raises(InvalidPolicyParamsError, match=refusal(policy, spec)):
        policy_class(policy)(8, {spec.name: value})  # the class itself checks too
    with pytest.raises(InvalidPolicyParamsError, match=refusal(policy, spec)):
        create_manager(8, policy, policy_params={spec.name: value})


def test_the_message_names_policy_parameter_bound_and_value() -> None:
    with pytest.raises(InvalidPolicyParamsError) as info:
        create_policy("lfu", 8, {"history_factor": 1e308})
    assert str(info.value) == "lfu: history_factor must be a number in [0, 16], got 1e+308"
    with pytest.raises(InvalidPolicyParamsError) as info:
        create_policy("s3fifo", 8, {"small_ratio": 1})
    assert str(info.value) == "s3fifo: small_ratio must be a number in (0, 1), got 1"


@pytest.mark.parametrize(("policy", "spec"), SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("capacity", [1, 8, 1 << 20])
def test_values_at_the_bounds_are_accepted_and_the_policy_works(
    policy: str, spec: ParamSpec, capacity: int
) -> None:
    accepted, _ = edges(spec)
    for value in accepted:
        parsed = parse_policy_params(policy, {spec.name: value})
        assert parsed[spec.name] == value
        assert parse_policy_params(policy, parsed) == parsed  # idempotent
        if capacity <= 8:
            exercise(policy, {spec.name: value}, capacity)
        else:  # a large pool is only built: sizes derived from the bound stay finite
            assert len(create_policy(policy, capacity, {spec.name: value})) == 0


@pytest.mark.parametrize("policy", [name for name in POLICIES if policy_params_spec(name)])
def test_every_parameter_at_its_bound_together_works(policy: str) -> None:
    """All of a policy's parameters at their low ends at once, then at their high ends."""
    specs = policy_params_spec(policy)
    for end in (0, 1):
        params: dict[str, object] = {s.name: edges(s)[0][end] for s in specs}
        exercise(policy, params, 8)


@pytest.mark.parametrize(("policy", "spec"), SPECS, ids=SPEC_IDS)
def test_a_refused_switch_changes_nothing(policy: str, spec: ParamSpec) -> None:
    pool = Pool(8, "lru")
    pool.store(keys(0, 4))
    before = pool.m.policy
    _, refused = edges(spec)
    for value in [*refused, math.inf, math.nan, 1e308]:
        with pytest.raises(InvalidPolicyParamsError, match=refusal(policy, spec)):
            pool.m.switch_policy(policy, {spec.name: value})
    assert pool.m.policy == before
    assert pool.m.lookup(keys(0, 4), pool.request()).hit_prefix == 4


@pytest.mark.parametrize("policy", POLICIES)
def test_unknown_parameters_are_refused_naming_what_is_accepted(policy: str) -> None:
    with pytest.raises(InvalidPolicyParamsError, match=re.escape(policy)) as info:
        create_policy(policy, 8, {"no_such_parameter": 1})
    for spec in policy_params_spec(policy):
        assert spec.accepted() in str(info.value)


def any_value() -> st.SearchStrategy[object]:
    return st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(),
        st.integers(min_value=-(10**400), max_value=10**400),
        st.booleans(),
        st.text(max_size=8),
        st.none(),
    )


@pytest.mark.parametrize(("policy", "spec"), SPECS, ids=SPEC_IDS)
@settings(max_examples=60, deadline=None)
@given(value=any_value())
def test_a_value_is_accepted_exactly_when_it_is_in_bounds(
    policy: str, spec: ParamSpec, value: object
) -> None:
    assert spec.low is not None
    assert spec.high is not None
    in_bounds = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and (spec.kind != "int" or isinstance(value, int))
        and (value > spec.low if spec.low_open else value >= spec.low)
        and (value < spec.high if spec.high_open else value <= spec.high)
    )
    if in_bounds:
        assert parse_policy_params(policy, {spec.name: value})[spec.name] == value
        exercise(policy, {spec.name: value}, 4)
    else:
        with pytest.raises(InvalidPolicyParamsError, match=refusal(policy, spec)):
            create_policy(policy, 4, {spec.name: value})


# ---------------------------------------------------------------------- declaring parameters


def test_the_registry_describes_every_parameter() -> None:
    (history,) = describe_policy_params("lfu")
    assert history == {
        "name": "history_factor",
        "type": "float",
        "default": 2.0,
        "min": 0.0,
        "max": 16.0,
        "min_exclusive": False,
        "max_exclusive": False,
        "accepted": "a number in [0, 16]",
        "doc": history["doc"],
    }
    assert describe_policy_params("lru") == []
    assert "lfu: history_factor (a number in [0, 16], default 2)" in policy_params_help()


@pytest.fixture
def scratch_registry() -> Iterator[None]:
    """Whatever a test registers is gone afterwards."""
    before = dict(_REGISTRY)
    yield
    _REGISTRY.clear()
    _REGISTRY.update(before)


@pytest.mark.usefixtures("scratch_registry")
def test_a_policy_cannot_bypass_the_declared_checks() -> None:
    loose = type(
        "Loose",
        (LRUPolicy,),
        {"name": "loose", "parse_params": classmethod(lambda cls, params: dict(params))},
    )
    with pytest.raises(TypeError, match="params_spec"):
        register_policy(loose)
    assert "loose" not in available_policies()
    twice = type(
        "Twice",
        (LRUPolicy,),
        {
            "name": "twice",
            "params_spec": (
                ParamSpec(name="x", kind="float", default=1.0, low=0, high=2, doc="x"),
                ParamSpec(name="x", kind="float", default=1.0, low=0, high=2, doc="x"),
            ),
        },
    )
    with pytest.raises(ValueError, match="twice"):
        register_policy(twice)
    assert "twice" not in available_policies()


@pytest.mark.usefixtures("scratch_registry")
def test_a_new_policy_gets_its_declared_bounds_enforced() -> None:
    spec = ParamSpec(name="depth", kind="int", default=2, low=1, high=8, doc="depth")
    mode = ParamSpec(name="mode", kind="choice", default="a", choices=("a", "b"), doc="mode")
    register_policy(type("Deep", (LRUPolicy,), {"name": "deep", "params_spec": (spec, mode)}))
    assert parse_policy_params("deep", {}) == {"depth": 2, "mode": "a"}
    assert parse_policy_params("deep", {"depth": 8, "mode": "b"}) == {"depth": 8, "mode": "b"}
    for bad in ({"depth": 9}, {"depth": 0}, {"depth": 2.0}, {"depth": True}, {"mode": "c"}):
        with pytest.raises(InvalidPolicyParamsError, match=r"^deep: (depth|mode) must be "):
            create_policy("deep", 4, bad)
    with pytest.raises(InvalidPolicyParamsError, match=r"an integer in \[1, 8\], got 9"):
        create_policy("deep", 4, {"depth": 9})
    with pytest.raises(InvalidPolicyParamsError, match="one of 'a', 'b', got 'c'"):
        create_policy("deep", 4, {"mode": "c"})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "float", "default": 1.0, "low": 0.0, "high": math.inf},  # unbounded above
        {"kind": "float", "default": 1.0, "low": None, "high": 2.0},  # no lower bound
        {"kind": "float", "default": 1.0, "low": 0.0, "high": math.nan},
        {"kind": "float", "default": 3.0, "low": 0.0, "high": 2.0},  # default outside
        {"kind": "float", "default": 0.0, "low": 0.0, "high": 2.0, "low_open": True},
        {"kind": "int", "default": 1, "low": 2.0, "high": 1.0},  # low > high
        {"kind": "choice", "default": "a", "choices": ()},
        {"kind": "choice", "default": "z", "choices": ("a",)},
    ],
)
def test_a_spec_without_sane_bounds_cannot_be_declared(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="x"):
        ParamSpec(name="x", doc="x", **kwargs)  # type: ignore[arg-type]
