"""Kubernetes string formats as pydantic types, shared by the RLJob models and the CRD generator.

Each type carries `maxLength` and an RE2-compatible `pattern`, so one definition validates in
`rljob validate` (pydantic), in the API server (OpenAPI `pattern`/`maxLength` of the generated CRD)
and stays within CEL's cost budget. The rules are those Kubernetes applies itself
(k8s.io/apimachinery/pkg/util/validation, api/resource, distribution/reference), restated as regular
expressions; where Kubernetes checks a length per part (a label key's prefix and name) the pattern
bounds the part it can and `maxLength` the whole.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field, StringConstraints

# ------------------------------------------------------------------------------------------------
# Names (k8s.io/apimachinery/pkg/util/validation)

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL_PATTERN = rf"^{_LABEL}$"
DNS1123_SUBDOMAIN_PATTERN = rf"^{_LABEL}(\.{_LABEL})*$"
DNS1035_LABEL_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253

# A label key (qualified name): an optional DNS-subdomain prefix and '/', then a name of at most 63
# characters: alphanumerics, '-', '_' and '.', starting and ending alphanumeric.
_QUALIFIED_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
LABEL_KEY_PATTERN = rf"^({_LABEL}(\.{_LABEL})*/)?{_QUALIFIED_NAME}$"
LABEL_KEY_MAX = DNS1123_SUBDOMAIN_MAX + 1 + 63
# A label value: empty, or like a qualified name without prefix (at most 63 characters).
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
LABEL_VALUE_MAX = 63

# An environment variable name (C identifier plus '-' and '.', as the API server accepts them).
ENV_VAR_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
ENV_VAR_NAME_MAX = 256

# ------------------------------------------------------------------------------------------------
# Quantities (k8s.io/apimachinery/pkg/api/resource): <number><suffix>, suffix binary (Ki..Ei),
# decimal (n, u, m, k, M, G, T, P, E) or an exponent. A storage size is never negative.
_NUMBER = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
QUANTITY_PATTERN = rf"^\+?{_NUMBER}(([KMGTPE]i)|[numkMGTPE]|([eE][-+]?{_NUMBER}))?$"
QUANTITY_MAX = 64

# ------------------------------------------------------------------------------------------------
# Image references (github.com/distribution/reference): [domain[:port]/]path[:tag][@digest].
_DOMAIN_COMPONENT = r"([a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"{_DOMAIN_COMPONENT}(\.{_DOMAIN_COMPONENT})*(:[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(([._]|__|[-]+)[a-z0-9]+)*"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9A-Fa-f]{32,}"
IMAGE_PATTERN = rf"^({_DOMAIN}/)?{_PATH_COMPONENT}(/{_PATH_COMPONENT})*(:{_TAG})?(@{_DIGEST})?$"
IMAGE_MAX = 512

# ------------------------------------------------------------------------------------------------
# http(s) URLs: scheme, a host name / IPv4 / bracketed IPv6, an optional port, path, query, fragment.
HTTP_URL_PATTERN = (
    r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?)(:[0-9]{1,5})?"
    r"(/[^\s?#]*)?(\?[^\s#]*)?(#\S*)?$"
)
URL_MAX = 2048

# Free text the operator only passes on (paths, commands, arguments, env values, reasons).
PATH_MAX = 4096
TEXT_MAX = 4096
ARG_MAX = 4096
# A flag checked by CEL against a pattern: the cost estimate multiplies its length by every list above.
FLAG_MAX = 512

# Bound on every list and map the API server validates: CEL's cost estimate multiplies by it.
MAX_LIST = 64
MAX_MAP = 64


def _string(pattern: str | None, max_length: int, min_length: int = 0) -> Any:
    return StringConstraints(pattern=pattern, max_length=max_length, min_length=min_length or None)


DNS1123Label = Annotated[str, _string(DNS1123_LABEL_PATTERN, DNS1123_LABEL_MAX, 1)]
DNS1123Subdomain = Annotated[str, _string(DNS1123_SUBDOMAIN_PATTERN, DNS1123_SUBDOMAIN_MAX, 1)]
LabelKey = Annotated[str, _string(LABEL_KEY_PATTERN, LABEL_KEY_MAX, 1)]
LabelValue = Annotated[str, _string(LABEL_VALUE_PATTERN, LABEL_VALUE_MAX)]
EnvVarName = Annotated[str, _string(ENV_VAR_NAME_PATTERN, ENV_VAR_NAME_MAX, 1)]
Quantity = Annotated[str, _string(QUANTITY_PATTERN, QUANTITY_MAX, 1)]
ImageRef = Annotated[str, _string(IMAGE_PATTERN, IMAGE_MAX, 1)]
HttpUrl = Annotated[str, _string(HTTP_URL_PATTERN, URL_MAX, 1)]

# Addresses the operator must never send a request (and a credential) to, whatever a job names: the
# link-local ranges (169.254.0.0/16, fe80::/10), where clouds serve instance metadata and credentials,
# and the metadata services' other names and addresses (GCP's metadata.google.internal, AWS's IPv6
# fd00:ec2::254, Alibaba's 100.100.100.200). A host that is a bare number or hex (http://2852039166/ is
# 169.254.169.254 to getaddrinfo) is refused too. One RE2 pattern serves CEL and Python.
FORBIDDEN_HOST_PATTERN = (
    r"^https?://(169\.254\.[0-9.]*|\[[fF][eE][89aAbB][0-9A-Fa-f]:[0-9A-Fa-f:.]*\]|\[[fF][dD]00:[eE][cC]2::254\]"
    r"|100\.100\.100\.200|metadata|metadata\.google\.internal\.?|[0-9]+|0[xX][0-9A-Fa-fxX.]+|0[0-9]+\.[0-9.]*|[0-9.]*\.0[0-9]+[0-9.]*)(:[0-9]*)?([/?#].*)?$"
)
FORBIDDEN_HOST_MESSAGE = (
    "must not be a link-local or cloud-metadata address (169.254.0.0/16, fe80::/10, metadata.google.internal, "
    "fd00:ec2::254, 100.100.100.200, numeric host forms): the operator would send its request, and a token, there"
)
FRAGMENT_MESSAGE = "must not have a #fragment (it is never sent, and hides what the URL really reaches)"


def credential_target_problem(url: str) -> str | None:
    """Why the operator must not send a request with credentials to ``url`` (None: it may).

    Checked at admission (pydantic here, the same pattern as a CEL rule in the CRD) for every URL a job
    names that the operator itself calls."""
    if "#" in url:
        return FRAGMENT_MESSAGE
    if re.match(FORBIDDEN_HOST_PATTERN, url):
        return FORBIDDEN_HOST_MESSAGE
    return None
# An extended resource name such as nvidia.com/gpu: a qualified name whose prefix is a domain.
ResourceName = Annotated[str, _string(rf"^{_LABEL}(\.{_LABEL})+/{_QUALIFIED_NAME}$", LABEL_KEY_MAX, 1)]
FilePath = Annotated[str, _string(None, PATH_MAX, 1)]
Text = Annotated[str, _string(None, TEXT_MAX)]
Arg = Annotated[str, _string(None, ARG_MAX)]
Flag = Annotated[str, _string(None, FLAG_MAX)]


def label_map(description: str | None = None) -> Any:
    """A `dict[LabelKey, LabelValue]` field (node selectors): keys and values as Kubernetes checks labels."""
    return Field(default_factory=dict, max_length=MAX_MAP, description=description)


# ------------------------------------------------------------------------------------------------
# CEL rule helpers (x-kubernetes-validations of the generated CRD)


def cel_has(path: str) -> str:
    """CEL: every prefix of a dotted path under `self`/`oldSelf` is set (optional fields, any depth)."""
    root, *parts = path.split(".")
    return " && ".join(f"has({root}.{'.'.join(parts[: i + 1])})" for i in range(len(parts)))


def immutable_optional(path: str) -> tuple[str, str]:
    """CEL transition rule: an optional field under spec may not be added, removed or changed."""
    new, old = cel_has(f"self.{path}"), cel_has(f"oldSelf.{path}")
    return (f"({new}) == ({old}) && (!({new}) || self.{path} == oldSelf.{path})", path)


def rule(expr: str, message: str, field_path: str | None = None) -> dict[str, Any]:
    """One CRD validation rule; `field_path` (relative, e.g. `.trainer.gpusPerReplica`) is the field named."""
    out: dict[str, Any] = {"rule": expr, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out
