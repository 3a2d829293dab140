"""Policy slots: which trainable parameter set serves which workflow role.

Shared-Policy (SP) has one slot that every role uses; Isolated-Policy (IP) has one slot per distinct
role, in the order the roles are first named. Several calls of one role (three voters, three workers)
always share that role's slot. Nothing else in the library branches on SP vs IP: it only looks up the
mapping built here.
"""
from __future__ import annotations

from typing import Mapping, Sequence

__all__ = ["POLICIES", "role_to_slot", "num_slots", "slot_of", "check_mapping"]

POLICIES = ("shared", "isolated")
_ALIASES = {"sp": "shared", "ip": "isolated"}


def _policy(policy: str) -> str:
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a string, one of {POLICIES}; got {type(policy).__name__}")
    name = _ALIASES.get(policy.lower(), policy.lower())
    if name not in POLICIES:
        raise ValueError(
            f"unknown policy {policy!r}; valid choices: {', '.join(POLICIES)} (aliases: SP, IP)")
    return name


def _unique_roles(roles: Sequence[str]) -> list[str]:
    if isinstance(roles, str):
        raise TypeError(f"roles must be a sequence of role names, not the string {roles!r}")
    out: list[str] = []
    for r in roles:
        if not isinstance(r, str) or not r:
            raise ValueError(f"role names must be non-empty strings; got {r!r} in {list(roles)!r}")
        if r not in out:
            out.append(r)
    if not out:
        raise ValueError("roles is empty: a workflow needs at least one role")
    return out


def role_to_slot(roles: Sequence[str], policy: str) -> dict[str, int]:
    """Map each distinct role to its slot index.

    shared: every role -> 0. isolated: the i-th distinct role -> i (repeated names share a slot).
    """
    unique = _unique_roles(roles)
    if _policy(policy) == "shared":
        return {r: 0 for r in unique}
    return {r: i for i, r in enumerate(unique)}


def num_slots(roles: Sequence[str], policy: str) -> int:
    """Number of trainable parameter sets: 1 for shared, the number of distinct roles for isolated."""
    return max(role_to_slot(roles, policy).values()) + 1


def check_mapping(mapping: Mapping[str, int], roles: Sequence[str]) -> dict[str, int]:
    """Validate a role->slot mapping against the roles a workflow uses; returns a plain dict."""
    missing = [r for r in _unique_roles(roles) if r not in mapping]
    if missing:
        raise ValueError(
            f"role_to_slot has no slot for role(s) {missing}; it maps {sorted(mapping)}. "
            f"Build it with role_to_slot(workflow.roles, 'shared' | 'isolated').")
    out = {}
    for r, s in mapping.items():
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"slot of role {r!r} must be a non-negative int; got {s!r}")
        out[r] = s
    return out


def slot_of(role: str, mapping: Mapping[str, int]) -> int:
    """The slot of one role, with an error naming the known roles."""
    try:
        return mapping[role]
    except KeyError:
        raise KeyError(f"role {role!r} has no slot; known roles: {sorted(mapping)}") from None
