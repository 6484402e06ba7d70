"""docs/install.md's RBAC table says exactly what the chart grants the operator (rendered by helm)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.test_chart import ROOT, find, helm, render

__all__ = ["helm"]  # the module-scoped fixture that builds or finds the helm CLI

INSTALL = ROOT / "docs" / "install.md"
# A row granted only under a chart value: `(only with `rbac.readSecrets=true`)` after the verbs.
_ONLY_WITH = re.compile(r"\(only with `([A-Za-z.]+)=true`\)")

Grants = set[tuple[str, str, str]]  # (API group, resource, verb)


def _operator_rules(helm: Path, sets: list[str]) -> Grants:
    """Every (group, resource, verb) of the ClusterRole bound to the operator's ServiceAccount."""
    objects = render(helm, sets=sets)
    binding = find(objects, "ClusterRoleBinding")
    role = find(objects, "ClusterRole", binding["roleRef"]["name"])
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def _doc_table() -> dict[str | None, Grants]:
    """The operator's RBAC table of docs/install.md, by the chart value a row needs (None: always)."""
    section = INSTALL.read_text().split("## RBAC", 1)[1].split("**Trainer.**", 1)[0]
    rows: dict[str | None, Grants] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("API group", "---") or set(cells[0]) <= {"-"}:
            continue
        group = "" if cells[0] == '""' else cells[0]
        needs = _ONLY_WITH.search(cells[2])
        verbs = _ONLY_WITH.sub("", cells[2])
        key = needs.group(1) if needs else None
        rows.setdefault(key, set()).update(
            (group, resource.strip(), verb.strip())
            for resource in cells[1].split(",")
            for verb in verbs.split(",")
            if verb.strip()
        )
    return rows


def test_install_doc_rbac_table_matches_the_chart(helm: Path) -> None:
    table = _doc_table()
    assert table.get(None), "docs/install.md has no operator RBAC table under ## RBAC"
    default = _operator_rules(helm, [])
    assert table[None] == default, (
        f"docs/install.md lists {sorted(table[None] - default)} that the chart does not grant, "
        f"and misses {sorted(default - table[None])}"
    )
    for value, extra in table.items():
        if value is None:
            continue
        assert _operator_rules(helm, [f"{value}=true"]) == default | extra, value
