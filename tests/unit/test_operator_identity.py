"""The operator starts as a uid without a passwd entry (the chart's pod: uid 65532, no USER variable).

Found by running the chart's operator pod on a real node: it crash-looped with
`KeyError: 'getpwuid(): uid not found: 65532'` raised by kopf's peering identity
(`getpass.getuser()`), before any handler ran. kwok never starts a container, so no other test saw it.
"""

from __future__ import annotations

import getpass
import pwd

import pytest

from rljob.operator import __main__ as operator_main

UID = 65532


@pytest.fixture
def nameless_uid(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this process look like the chart's pod: no passwd entry for its uid, no user variables."""
    for var in ("LOGNAME", "USER", "LNAME", "USERNAME", "POD_ID"):
        monkeypatch.delenv(var, raising=False)

    def getpwuid(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", getpwuid)
    monkeypatch.setattr(operator_main.os, "getuid", lambda: UID)


def test_getuser_fails_for_a_uid_without_passwd_entry(nameless_uid: None) -> None:
    # The precondition of the bug: what kopf calls cannot name this user.
    with pytest.raises(KeyError, match="uid not found"):
        getpass.getuser()


def test_kopf_default_identity_crashes_there(nameless_uid: None) -> None:
    # kopf's own identity is what crashed the pod; if a kopf release fixes it, this test says so.
    from kopf._core.engines import peering

    with pytest.raises(KeyError, match="uid not found"):
        peering.detect_own_id(manual=False)


def test_operator_identity_uses_the_uid(nameless_uid: None) -> None:
    identity = operator_main.peering_identity()
    user, rest = identity.split("@", 1)
    assert user == f"uid-{UID}"
    host, stamp, suffix = rest.split("/")
    assert host and len(stamp) == 14 and stamp.isdigit() and len(suffix) == 3


def test_pod_id_wins(nameless_uid: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_ID", "rljob-operator-7d9f-abcde")
    assert operator_main.peering_identity() == "rljob-operator-7d9f-abcde"


def test_main_hands_kopf_an_identity(nameless_uid: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m rljob.operator` passes its own identity, so kopf never calls getpass.getuser()."""
    import kopf

    seen: dict[str, object] = {}
    monkeypatch.setattr(kopf, "run", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(operator_main.importlib, "import_module", lambda name: None)
    monkeypatch.setenv("RLJOB_RESYNC_SECONDS", "10")  # restored after the test (main exports it)
    monkeypatch.setenv("RLJOB_OPERATOR_METRICS_PORT", "0")
    monkeypatch.setenv("RLJOB_OPERATOR_METRICS_ADDR", "127.0.0.1")
    assert operator_main.main(["--metrics-port", "0"]) == 0
    assert str(seen["identity"]).startswith(f"uid-{UID}@")
