"""Credentials never follow an address a job chooses (operator/autotune/credentials.py), admission refuses
link-local, metadata and fragment URLs naming the field (api/), and a reply's body never reaches a
status or Event (common/autotune/prometheus.py, against a real HTTP server on loopback)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from rljob.api.load import RLJobConfigError, parse_rljob
from rljob.api.spec import AutotunePrometheusSpec, SecretKeyRef
from rljob.common.autotune.prometheus import PrometheusClient, PrometheusQueryError, PrometheusUnavailable
from rljob.operator.autotune.credentials import (
    PrometheusNotAllowed,
    PrometheusSettings,
    PrometheusTarget,
    on_allow_list,
    prometheus_target,
)

CHART = PrometheusSettings(address="http://prometheus.monitoring:9090", token_file="/var/run/token",
                           allowed=("http://thanos.monitoring:9090", "https://prom.example.com/team-a", "http://127.0.0.1:*"))
REF = SecretKeyRef(name="prom-token", key="token")


def _spec(address: str | None = None, ref: SecretKeyRef | None = None) -> AutotunePrometheusSpec:
    return AutotunePrometheusSpec(address=address, bearer_token_secret_ref=ref)


def test_the_chart_token_goes_only_to_the_chart_address() -> None:
    assert prometheus_target(_spec(), CHART) == PrometheusTarget(CHART.address or "", chart_token=True)
    assert prometheus_target(_spec(CHART.address + "/"), CHART).chart_token  # the same address, written out
    # The job's own Secret replaces the chart's token, even at the chart's address.
    assert prometheus_target(_spec(ref=REF), CHART) == PrometheusTarget(CHART.address or "", secret=REF)
    # A job's own address: never the chart's token; its own Secret's or none.
    assert prometheus_target(_spec("http://thanos.monitoring:9090"), CHART) == PrometheusTarget("http://thanos.monitoring:9090")
    target = prometheus_target(_spec("https://prom.example.com/team-a/api", REF), CHART)
    assert target == PrometheusTarget("https://prom.example.com/team-a/api", secret=REF)


@pytest.mark.parametrize("address", [
    "http://evil.example.com:9090",
    "http://thanos.monitoring:90901",  # a prefix never ends mid-port ...
    "https://prom.example.com.evil.io/team-a",  # ... or mid-host
    "https://prom.example.com/team-b",
    "http://127.0.0.1.evil.com:9090",
])
def test_a_job_address_off_the_allow_list_is_refused_with_a_fixed_message(address: str) -> None:
    with pytest.raises(PrometheusNotAllowed) as info:
        prometheus_target(_spec(address, REF), CHART)
    assert "spec.autotune.prometheus.address" in str(info.value) and "allowedAddresses" in str(info.value)


def test_no_address_anywhere_is_refused() -> None:
    with pytest.raises(PrometheusNotAllowed):
        prometheus_target(_spec(), PrometheusSettings())


def test_allow_list_entries() -> None:
    assert on_allow_list("http://127.0.0.1:40123", ("http://127.0.0.1:*",))
    assert not on_allow_list("http://127.0.0.1:x/", ("http://127.0.0.1:*",))
    assert not on_allow_list("http://127.0.0.10:40123", ("http://127.0.0.1:*",))
    assert not on_allow_list("http://anything:1", ())
    assert PrometheusSettings.from_env({"RLJOB_PROMETHEUS_ALLOWED_ADDRESSES": " http://a:1 ,,http://b:2"}).allowed == (
        "http://a:1", "http://b:2")


@pytest.mark.parametrize(("address", "says"), [
    ("http://169.254.169.254/latest/meta-data/#", "#fragment"),
    ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ("http://[fe80::a9fe:a9fe]/", "link-local"),
    ("http://metadata.google.internal/computeMetadata/v1/", "cloud-metadata"),
    ("http://2852039166/", "numeric host"),
    ("http://prometheus.monitoring:9090/#frag", "#fragment"),
])
def test_admission_refuses_link_local_metadata_and_fragments_naming_the_field(address: str, says: str) -> None:
    doc = {"apiVersion": "rljob.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "demo"},
           "spec": {"model": {"huggingFace": "x/y"}, "data": {"synthetic": {}},
                    "autotune": {"mode": "Recommend", "prometheus": {"address": address}}}}
    with pytest.raises(RLJobConfigError) as info:
        parse_rljob(doc, "job.yaml")
    assert "autotune.prometheus.address" in str(info.value) and says in str(info.value), str(info.value)


SECRET_BODY = "AKIA-very-secret-instance-credentials"


@pytest.fixture
async def echo_server() -> AsyncIterator[str]:
    """Answers what a metadata service or any other non-Prometheus would: text, HTML, JSON of its own."""

    async def text(_r: web.Request) -> web.Response:
        return web.Response(text=SECRET_BODY)

    async def error(_r: web.Request) -> web.Response:
        return web.Response(status=500, text=SECRET_BODY)

    async def json_error(_r: web.Request) -> web.Response:
        return web.json_response({"status": "error", "errorType": SECRET_BODY, "error": SECRET_BODY}, status=400)

    async def bad_data(_r: web.Request) -> web.Response:
        return web.json_response({"status": "error", "errorType": "bad_data", "error": SECRET_BODY}, status=400)

    app = web.Application()
    for path, handler in (("/text", text), ("/error", error), ("/json", json_error), ("/bad", bad_data)):
        app.router.add_get(path + "/api/v1/query", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}"
    await runner.cleanup()


async def test_reply_bodies_are_never_echoed(echo_server: str) -> None:
    cases = {"/text": (PrometheusUnavailable, "HTTP 200 without JSON"), "/error": (PrometheusUnavailable, "HTTP 500"),
             "/json": (PrometheusQueryError, "not a Prometheus query reply"), "/bad": (PrometheusQueryError, "bad_data")}
    for path, (error, says) in cases.items():
        async with PrometheusClient(echo_server + path, timeout_s=5) as client:
            with pytest.raises(error) as info:
                await client.query("up")
        assert says in str(info.value) and SECRET_BODY not in str(info.value), (path, str(info.value))
