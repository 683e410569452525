"""The apiserver's validation of a pod's scheduling fields, for those the webhook moves into
the stash (a pure function). Mutating admission runs before validation, so the upper
apiserver validates only the upper view: a typo in a stashed field was admitted and
refused later by the lower apiserver, with the pod made Failed and made again by its
controller without end. Only rules the apiserver surely applies are here; what they miss
is still refused below, as before.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kubekit.fit import DOES_NOT_EXIST, EXISTS, GT, IN, LABEL_OPERATORS, LT, NODE_OPERATORS, NOT_IN

_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_NAME_RULE = "up to 63 letters, digits, '-', '_' or '.', starting and ending alphanumeric"
_INT32_MAX = 2**31 - 1
_SPREAD_WHEN = ("DoNotSchedule", "ScheduleAnyway")
_SPREAD_POLICIES = ("Honor", "Ignore")
_REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
_PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


class Invalid(ValueError):
    """A field the apiserver would refuse; the message names it, as the apiserver does."""


def check_scheduling_fields(fields: Mapping[str, Any], where: str = "spec") -> None:
    """Raises Invalid for the first of ``fields`` (nodeSelector, affinity,
    topologySpreadConstraints; of the right JSON types already, ``kubekit.shapes``) the
    apiserver would refuse in a pod."""
    for key, value in (fields.get("nodeSelector") or {}).items():
        _label_key(key, f"{where}.nodeSelector")
        if value and (len(value) > 63 or not _NAME.fullmatch(value)):
            raise Invalid(
                f"{where}.nodeSelector[{key}]: Invalid value: {value!r}: not a label value "
                f"({_NAME_RULE}, or empty)"
            )
    affinity = fields.get("affinity") or {}
    node = affinity.get("nodeAffinity") or {}
    at = f"{where}.affinity.nodeAffinity"
    if (required := node.get(_REQUIRED)) is not None:
        at_terms = f"{at}.{_REQUIRED}.nodeSelectorTerms"
        terms = required.get("nodeSelectorTerms") or []
        if not terms:
            raise Invalid(f"{at_terms}: Required value: at least one node selector term")
        for index, term in enumerate(terms):
            _node_term(term, f"{at_terms}[{index}]")
    for index, entry in enumerate(node.get(_PREFERRED) or []):
        _weight(entry.get("weight"), f"{at}.{_PREFERRED}[{index}].weight")
        _node_term(entry.get("preference") or {}, f"{at}.{_PREFERRED}[{index}].preference")
    for kind in ("podAffinity", "podAntiAffinity"):
        pods = affinity.get(kind) or {}
        at = f"{where}.affinity.{kind}"
        for index, term in enumerate(pods.get(_REQUIRED) or []):
            _pod_term(term, f"{at}.{_REQUIRED}[{index}]")
        for index, entry in enumerate(pods.get(_PREFERRED) or []):
            _weight(entry.get("weight"), f"{at}.{_PREFERRED}[{index}].weight")
            _pod_term(
                entry.get("podAffinityTerm") or {}, f"{at}.{_PREFERRED}[{index}].podAffinityTerm"
            )
    for index, constraint in enumerate(fields.get("topologySpreadConstraints") or []):
        _spread(constraint, f"{where}.topologySpreadConstraints[{index}]")


def _node_term(term: Mapping[str, Any], where: str) -> None:
    for index, expression in enumerate(term.get("matchExpressions") or []):
        _requirement(expression, NODE_OPERATORS, f"{where}.matchExpressions[{index}]")
    for index, field in enumerate(term.get("matchFields") or []):
        at = f"{where}.matchFields[{index}]"
        if field.get("key") != "metadata.name":
            raise Invalid(f"{at}.key: Invalid value: {field.get('key')!r}: only metadata.name")
        if field.get("operator") not in (IN, NOT_IN):
            raise Invalid(f"{at}.operator: Invalid value: {field.get('operator')!r}: In or NotIn")
        if len(field.get("values") or []) != 1:
            raise Invalid(f"{at}.values: Required value: exactly one for a node field selector")


def _pod_term(term: Mapping[str, Any], where: str) -> None:
    _topology_key(term.get("topologyKey"), f"{where}.topologyKey")
    for selector in ("labelSelector", "namespaceSelector"):
        expressions = (term.get(selector) or {}).get("matchExpressions") or []
        for index, expression in enumerate(expressions):
            _requirement(
                expression, LABEL_OPERATORS, f"{where}.{selector}.matchExpressions[{index}]"
            )


def _spread(constraint: Mapping[str, Any], where: str) -> None:
    skew = constraint.get("maxSkew")
    if not isinstance(skew, int) or not 0 < skew <= _INT32_MAX:
        raise Invalid(f"{where}.maxSkew: Invalid value: {skew!r}: must be greater than zero")
    # Only that it is there: a spread's key is not held to a label key's form.
    _present(constraint.get("topologyKey"), f"{where}.topologyKey")
    when = constraint.get("whenUnsatisfiable")
    if when not in _SPREAD_WHEN:
        raise Invalid(
            f"{where}.whenUnsatisfiable: Unsupported value: {when!r}: {' or '.join(_SPREAD_WHEN)}"
        )
    domains = constraint.get("minDomains")
    if domains is not None and not 0 < domains <= _INT32_MAX:
        raise Invalid(f"{where}.minDomains: Invalid value: {domains}: must be greater than zero")
    if domains is not None and when != "DoNotSchedule":
        raise Invalid(f"{where}.minDomains: Invalid value: {domains}: only with DoNotSchedule")
    for policy in ("nodeAffinityPolicy", "nodeTaintsPolicy"):
        value = constraint.get(policy)
        if value is not None and value not in _SPREAD_POLICIES:
            raise Invalid(
                f"{where}.{policy}: Unsupported value: {value!r}: {' or '.join(_SPREAD_POLICIES)}"
            )
    expressions = (constraint.get("labelSelector") or {}).get("matchExpressions") or []
    for index, expression in enumerate(expressions):
        _requirement(
            expression, LABEL_OPERATORS, f"{where}.labelSelector.matchExpressions[{index}]"
        )


def _requirement(expression: Mapping[str, Any], operators: frozenset[str], where: str) -> None:
    _label_key(expression.get("key") or "", f"{where}.key")
    operator, values = expression.get("operator"), expression.get("values") or []
    if operator not in operators:
        raise Invalid(f"{where}.operator: Invalid value: {operator!r}: not a selector operator")
    if operator in (IN, NOT_IN) and not values:
        raise Invalid(f"{where}.values: Required value: needed for {operator}")
    if operator in (EXISTS, DOES_NOT_EXIST) and values:
        raise Invalid(f"{where}.values: Forbidden: none for {operator}")
    # The value's integer is not the apiserver's to check: the scheduler takes a term whose
    # value does not parse for one that matches no node.
    if operator in (GT, LT) and len(values) != 1:
        raise Invalid(f"{where}.values: Required value: exactly one for {operator}")


def _weight(weight: Any, where: str) -> None:
    if not isinstance(weight, int) or not 1 <= weight <= 100:
        raise Invalid(f"{where}: Invalid value: {weight!r}: must be in the range 1-100")


def _present(key: Any, where: str) -> None:
    if not key:
        raise Invalid(f"{where}: Required value: can not be empty")


def _topology_key(key: Any, where: str) -> None:
    _present(key, where)
    _label_key(key, where)


def _label_key(key: str, where: str) -> None:
    """A qualified name: a name, after an optional DNS subdomain and '/'."""
    prefix, slash, name = key.rpartition("/")
    if (
        len(name) > 63
        or not _NAME.fullmatch(name)
        or (slash and (len(prefix) > 253 or not _SUBDOMAIN.fullmatch(prefix)))
    ):
        raise Invalid(
            f"{where}: Invalid value: {key!r}: not a label key ({_NAME_RULE}, after an "
            "optional DNS subdomain and '/')"
        )
