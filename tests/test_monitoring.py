"""The monitoring a team deploys (monitoring/): the alerting rules load in promtool and fire on
the series they are written for, and a real Prometheus scraping a served model under load
loads every rule (each evaluates without error) and answers every query of the Grafana
dashboard with series for that model. Skipped, with the reason, where Prometheus is not
installed (Debian's `prometheus` package; ./dev test installs it where it can)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread
from ports import free_port

pytestmark = pytest.mark.timeout(150)

MONITORING = Path(__file__).resolve().parent.parent / "monitoring"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
MODEL = "linear"


def _need(tool: str) -> None:
    if not Path(tool).exists():
        pytest.skip(f"{Path(tool).name} is not installed (Debian: apt-get install prometheus)")


def _dashboard_targets() -> list[tuple[str, str]]:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"]
            for target in panel.get("targets", [])]


def test_rules_load_and_fire_on_what_they_watch():
    _need(PROMTOOL)
    check = subprocess.run([PROMTOOL, "check", "rules", "alerts.yml"], cwd=MONITORING,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS: 6 rules found" in check.stdout, check.stdout + check.stderr
    tests = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=MONITORING,
                           capture_output=True, text=True, timeout=60)
    assert tests.returncode == 0 and "SUCCESS" in tests.stdout, tests.stdout + tests.stderr


def test_dashboard_says_what_its_percentiles_need():
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    assert "--metrics-config histogram_latencies=true" in dashboard["description"]
    histogram_panels = [p for p in dashboard["panels"]
                        if any("_histogram_ms_bucket" in t["expr"] for t in p.get("targets", []))]
    assert histogram_panels and all("histogram_latencies=true" in p["description"] for p in histogram_panels)



def _get(url: str, params: dict | None = None) -> dict:
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _load(port: int, stop: threading.Event) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    x = httpclient.InferInput("INPUT0", [2, 16], "FP32")
    x.set_data_from_numpy(np.ones((2, 16), np.float32))
    deadline = time.monotonic() + 120
    while not stop.is_set() and time.monotonic() < deadline:
        client.infer(MODEL, [x])
        time.sleep(0.005)


def test_prometheus_scrapes_the_dashboard_and_the_rules(model_repo: Path, tmp_path: Path):
    _need(PROMETHEUS)
    server = start_in_thread(EngineOptions(model_repository=model_repo, model_control_mode="explicit",
                                           load_models=[MODEL], histogram_latencies=True),
                             host="127.0.0.1", http_port=0, metrics_port=0, grpc_port=None)
    stop = threading.Event()
    loaders = [threading.Thread(target=_load, args=(server.http_port, stop), daemon=True) for _ in range(2)]
    for t in loaders:
        t.start()
    web = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - {MONITORING / "alerts.yml"}
scrape_configs:
  - job_name: triton
    static_configs:
      - targets: ["127.0.0.1:{server.metrics_port}"]
""")
    log = open(tmp_path / "prometheus.log", "wb")
    prometheus = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{web}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{web}/api/v1"
    try:
        deadline = time.monotonic() + 60

        def wait_for(what: str, check):
            while True:
                assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
                try:
                    got = check()
                except OSError:          # not listening yet
                    got = None
                if got:
                    return got
                assert time.monotonic() < deadline, f"{what} within 60 s"
                time.sleep(0.5)

        wait_for("the scrape of our metrics endpoint", lambda: [
            s for s in _get(f"{api}/query", {"query": 'up{job="triton"} == 1'})["data"]["result"]])
        exported = urllib.request.urlopen(
            f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()

        # every dashboard query answers series for the model (after a few scrapes: rates)
        for title, expr in _dashboard_targets():
            query = expr.replace("$model", MODEL).replace("$__rate_interval", "5s")
            names = set(re.findall(r"\bnv_[a-z_]+", query))
            if "$model" not in expr:
                missing = [n for n in names if f"\n{n}" not in exported and not exported.startswith(n)]
                if missing:     # a host gauge this server has nothing for (no GPU here)
                    assert missing == ["nv_gpu_utilization"], (title, missing)
                    continue
            result = wait_for(f"series for panel {title!r} ({query})", lambda: [
                s for s in _get(f"{api}/query", {"query": query})["data"]["result"]
                if s["value"][1] not in ("NaN",)])
            if "$model" in expr:
                assert {s["metric"].get("model") for s in result} == {MODEL}, (title, result)
        rate = _get(f"{api}/query", {"query": f'sum(rate(nv_inference_request_success{{model="{MODEL}"}}[5s]))'})
        assert float(rate["data"]["result"][0]["value"][1]) > 0
        values = _get(f"{api}/label/model/values", {"match[]": "nv_inference_count"})["data"]
        assert MODEL in values                                # the dashboard's model variable

        # every alerting rule is loaded and evaluates without error
        def evaluated():
            groups = _get(f"{api}/rules")["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            done = [r for r in rules if not r.get("lastEvaluation", "").startswith("0001")]
            return rules if rules and len(done) == len(rules) else None
        rules = wait_for("every rule evaluated", evaluated)
        assert sorted(r["name"] for r in rules) == sorted(re.findall(
            r"alert: (\w+)", (MONITORING / "alerts.yml").read_text()))
        assert [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
        # a healthy model under light load fires nothing
        firing = [a for a in _get(f"{api}/alerts")["data"]["alerts"] if a["state"] == "firing"]
        assert firing == []
    finally:
        stop.set()
        prometheus.terminate()
        try:
            prometheus.wait(20)
        except subprocess.TimeoutExpired:
            prometheus.kill()
        log.close()
        for t in loaders:
            t.join(10)
        server.close()
