"""The MLflow UI in a real browser (headless Chromium) for a real `rayapp bench` sweep.

One 1-vs-2-node sweep is made once; then the UI is opened in Chromium twice, served by `rayapp ui`
and by a plain `mlflow server` on the same SQLite store, and each time a child run's page must draw
its per-epoch metric charts and the sweep's parent run must show its scaling.png artifact.
Screenshots of every page checked are kept under $RAYAPP_TEST_ARTIFACTS (else pytest's tmp dir).

Chromium is Debian's /usr/bin/chromium driven by Playwright (its own browser downloads are never
used). Without it the tests skip, except under CI (the CI script installs it), where they fail."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import JOBS, LEAN_MLFLOW_SERVER_ENV, mlflow_client, run_rayapp

from rayapp.launch.cluster import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEBIAN_CHROMIUM = (
    "/usr/bin/chromium"  # apt-get install chromium; else whichever chromium is on PATH
)
CHROMIUM = (
    DEBIAN_CHROMIUM
    if os.path.exists(DEBIAN_CHROMIUM)
    else (shutil.which("chromium") or DEBIAN_CHROMIUM)
)
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1280, "height": 800}
EPOCHS = 2
CHARTS = ("loss", "epoch_time_s", "samples_per_s")  # logged once per epoch by every rayapp run
BENCH_PLOT = "scaling.png"
PAGE_TIMEOUT_MS = 60_000  # first paint of the UI's JavaScript on a busy 2-core machine
CARD = '[data-testid="experiment-view-compare-runs-card"]'
SECTION = '[data-testid="experiment-view-compare-runs-section-header"]'


@dataclass(frozen=True)
class Sweep:
    directory: Path
    db: Path
    experiment_id: str
    parent_id: str
    child_id: str
    child_name: str
    child_metrics: frozenset[str]
    plot_size: tuple[int, int]  # scaling.png's width and height, from its PNG header


@pytest.fixture(scope="module")
def chromium():
    """Debian's Chromium and Playwright, or a skip (outside CI) / a failure (in CI) saying what is
    missing."""
    missing = []
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"{CHROMIUM} (apt-get install --no-install-recommends chromium)")
    if importlib.util.find_spec("playwright") is None:
        missing.append("the playwright package (pip install -e '.[test]')")
    if missing:
        reason = "browser test needs " + " and ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(reason + "; CI must provide it (.ci/run installs chromium)", pytrace=False)
        pytest.skip(reason)
    return CHROMIUM


@pytest.fixture(scope="module")
def sweep(chromium, tmp_path_factory, warm_cluster) -> Sweep:
    """One real `rayapp bench` sweep (parent run, a child run per cluster size) in a fresh store."""
    directory = tmp_path_factory.mktemp("ui-sweep")
    result = run_rayapp(
        "bench",
        str(JOBS / "seed_linear.yaml"),
        "--nodes",
        "1,2",
        "--epochs",
        str(EPOCHS),
        cwd=directory,
        env=warm_cluster,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]

    client = mlflow_client(directory)
    experiment = client.get_experiment_by_name("rayapp")
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("rayapp.sweep") == "true"]
    children = {
        int(r.data.params["nodes"]): r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    }
    assert sorted(children) == [1, 2]
    child = children[2]
    assert set(CHARTS) <= set(child.data.metrics)
    plot = Path(client.download_artifacts(parent.info.run_id, BENCH_PLOT, str(directory)))
    header = plot.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return Sweep(
        directory=directory,
        db=directory / "mlflow.db",
        experiment_id=experiment.experiment_id,
        parent_id=parent.info.run_id,
        child_id=child.info.run_id,
        child_name=child.info.run_name,
        child_metrics=frozenset(child.data.metrics),
        plot_size=struct.unpack(">II", header[16:24]),
    )


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    """Where the screenshots go: $RAYAPP_TEST_ARTIFACTS/ui_browser, else a pytest tmp dir."""
    root = os.environ.get("RAYAPP_TEST_ARTIFACTS")
    if root:
        directory = Path(root) / "ui_browser"
        directory.mkdir(parents=True, exist_ok=True)
        return directory
    return tmp_path_factory.mktemp("ui-browser-screenshots")


def serve(command: list[str], port: int, log: Path, env: dict[str, str]) -> subprocess.Popen:
    """A UI server as a child in its own session, once it answers /health on 127.0.0.1:port."""
    full_env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    full_env.update(env)
    with open(log, "ab") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:
            pass
        if process.poll() is not None:
            break
        time.sleep(0.5)  # polling interval, not an assertion
    stop(process)
    raise AssertionError(
        f"{' '.join(command)} did not answer on port {port}; log:\n{log.read_text()[-3000:]}"
    )


def stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(
            process.pid, signal.SIGKILL
        )  # its own session: the server, its workers and job runner
    except ProcessLookupError:
        pass
    process.wait(timeout=30)


def test_rayapp_ui_in_chromium(sweep, shots, capsys):
    port = free_port()
    process = serve(
        [
            sys.executable,
            "-m",
            "rayapp",
            "ui",
            "--tracking-uri",
            f"sqlite:///{sweep.db}",
            "--port",
            str(port),
        ],
        port,
        sweep.directory / f"rayapp-ui-{port}.log",
        LEAN_MLFLOW_SERVER_ENV,
    )
    try:
        # the plain run URL, as a user following a link gets it: MLflow 3 opens it in its GenAI view
        check_ui(f"http://127.0.0.1:{port}/", sweep, shots / "rayapp-ui", workflow=None)
    finally:
        stop(process)
    report(capsys, shots)


def test_mlflow_server_in_chromium(sweep, shots, capsys):
    port = free_port()
    mlflow = Path(sys.executable).with_name("mlflow")
    command = [str(mlflow)] if mlflow.exists() else [sys.executable, "-m", "mlflow"]
    # The runs' artifact URIs are file:// paths on this machine; the server reads them directly,
    # so no --artifacts-destination is needed to serve scaling.png.
    process = serve(
        [
            *command,
            "server",
            "--backend-store-uri",
            f"sqlite:///{sweep.db}",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        port,
        sweep.directory / f"mlflow-server-{port}.log",
        LEAN_MLFLOW_SERVER_ENV,
    )
    try:
        # MLflow 3's "Model training" view of the same pages, which is the one meant for these runs
        check_ui(
            f"http://127.0.0.1:{port}/", sweep, shots / "mlflow-server", workflow="machine_learning"
        )
    finally:
        stop(process)
    report(capsys, shots)


def report(capsys, shots: Path) -> None:
    with capsys.disabled():
        print(f"\nUI screenshots: {shots}")


def check_ui(base: str, sweep: Sweep, prefix: Path, workflow: str | None) -> None:
    """Open the child run's charts and the parent's plot in a fresh headless Chromium profile."""
    from playwright.sync_api import sync_playwright

    blocked: list[str] = []

    def loopback_only(route) -> None:
        if urlsplit(route.request.url).hostname in ("127.0.0.1", "localhost"):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    query = f"?workflowType={workflow}" if workflow else ""
    runs = f"{base}#/experiments/{sweep.experiment_id}/runs"
    profile = tempfile.mkdtemp(prefix="rayapp-chromium-")
    try:
        with sync_playwright() as playwright:
            context = playwright.chromium.launch_persistent_context(
                profile,
                executable_path=CHROMIUM,
                args=CHROMIUM_ARGS,
                headless=True,
                viewport=VIEWPORT,
            )
            try:
                context.set_default_timeout(PAGE_TIMEOUT_MS)
                context.route("**/*", loopback_only)
                # MLflow 3.17 opens its Assistant side panel on a first visit, over a third of
                # the page
                context.add_init_script(
                    "window.localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', "
                    "'true')"
                )
                page = context.new_page()
                try:
                    check_child_charts(
                        page,
                        f"{runs}/{sweep.child_id}{query}",
                        sweep,
                        Path(f"{prefix}-child-run-metrics.png"),
                    )
                    check_system_charts(page, sweep, Path(f"{prefix}-child-run-system-metrics.png"))
                    check_parent_plot(
                        page,
                        f"{runs}/{sweep.parent_id}{query}",
                        sweep,
                        Path(f"{prefix}-bench-parent-{BENCH_PLOT}"),
                    )
                except Exception:
                    page.screenshot(path=f"{prefix}-FAILED.png")  # what the page showed instead
                    raise
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert not blocked, f"the UI tried to reach beyond loopback: {blocked}"


# Every metric chart card on the page: its title, the vertices of its line, and its text (legend).
CHART_CARDS_JS = """selector => Array.from(document.querySelectorAll(selector)).map(card => {
    const title = card.querySelector('h4');
    const line = card.querySelector('.js-line');
    const path = line ? (line.getAttribute('d') || '') : '';
    return {title: title ? title.getAttribute('title') : null,
            points: (path.match(/[ML]/g) || []).length, text: card.innerText};
})"""


def wait_until(
    page, predicate_js: str, arg, what: str, state_js: str | None = None, state_arg=None
) -> None:
    """page.wait_for_function with a failure that says what the page showed instead."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(predicate_js, arg=arg, timeout=PAGE_TIMEOUT_MS)
    except PlaywrightTimeout:
        state = page.evaluate(state_js, state_arg) if state_js else None
        body = page.inner_text("body")[-1500:]
        raise AssertionError(
            f"{what} within {PAGE_TIMEOUT_MS / 1000:.0f} s at {page.url}\n"
            f"state: {state}\npage text: {body}"
        ) from None


def screenshot(page, path: Path) -> None:
    page.screenshot(path=str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, f"bad screenshot {path}"


def check_child_charts(page, url: str, sweep: Sweep, shot: Path) -> None:
    """The run page's Model metrics tab draws one chart per metric key, with one point per epoch."""
    page.goto(url)
    page.get_by_text(sweep.child_name, exact=True).first.wait_for()
    page.get_by_role("tab", name="Model metrics").click()
    page.locator(SECTION).first.wait_for()
    # the section counts a chart per metric the run logged; only the ones in view are drawn,
    # so narrow the grid to the charts checked here with the page's own search box (a regex)
    # system/<node>/... metrics have their own tab, checked below
    model_metrics = [key for key in sweep.child_metrics if not key.startswith("system/")]
    wait_until(
        page,
        "([selector, count]) => (document.querySelector(selector) || {}).innerText"
        "?.includes(`(${count})`)",
        [SECTION, len(model_metrics)],
        f"the Model metrics section did not count {len(model_metrics)} charts",
    )
    page.get_by_placeholder("Search metric charts").fill(f"^({'|'.join(CHARTS)})$")
    expected = [[key, f"{sweep.child_name} ({key})"] for key in CHARTS]
    wait_until(
        page,
        f"""([selector, expected, epochs]) => {{
            const cards = ({CHART_CARDS_JS})(selector);
            return cards.length === expected.length && expected.every(([key, legend]) =>
                cards.some(card => card.title === key && card.points === epochs
                    && card.text.includes(legend)));
        }}""",
        [CARD, expected, EPOCHS],
        f"charts {list(CHARTS)} with {EPOCHS} points each did not appear",
        CHART_CARDS_JS,
        CARD,
    )
    screenshot(page, shot)


def check_system_charts(page, sweep: Sweep, shot: Path) -> None:
    """The same run's System metrics tab has a section per node, each counting that node's
    metrics."""
    per_node: dict[str, int] = {}
    for key in sweep.child_metrics:
        if key.startswith("system/"):
            node = key.split("/")[1]
            per_node[f"system/{node}"] = per_node.get(f"system/{node}", 0) + 1
    assert len(per_node) == 2, (
        f"a 2-node run should hold system metrics of 2 nodes: {sorted(per_node)}"
    )
    page.get_by_role("tab", name="System metrics").click()
    headers_js = "selector => Array.from(document.querySelectorAll(selector)).map(h => h.innerText)"
    wait_until(
        page,
        f"""([selector, expected]) => {{
                    const headers = ({headers_js})(selector);
                    return Object.entries(expected).every(([section, count]) => headers.some(
                        text => text.startsWith(section + "\\n") && text.includes(`(${{count}})`)));
                }}""",
        [SECTION, per_node],
        f"the System metrics tab did not show sections {per_node}",
        headers_js,
        SECTION,
    )
    screenshot(page, shot)


def check_parent_plot(page, url: str, sweep: Sweep, shot: Path) -> None:
    """The bench parent's Artifacts tab lists the comparison files and previews scaling.png."""
    page.goto(url)
    page.get_by_role("tab", name="Artifacts").click()
    nodes = '[data-testid="artifact-tree-node"]'
    names_js = (
        "selector => Array.from(document.querySelectorAll(selector)).map(node => "
        "node.innerText.trim())"
    )
    expected = [BENCH_PLOT, "time_breakdown.png", "scaling.csv", "scaling.md", "scaling.json"]
    wait_until(
        page,
        f"([selector, expected]) => {{ const names = ({names_js})(selector);"
        " return expected.every(name => names.includes(name)); }",
        [nodes, expected],
        f"the artifact tree did not list {expected}",
        names_js,
        nodes,
    )
    page.locator(nodes).filter(has_text=BENCH_PLOT).first.click()
    image = f'img[alt="{BENCH_PLOT}"]'
    wait_until(
        page,
        "selector => { const img = document.querySelector(selector);"
        " return !!img && img.complete && img.naturalWidth > 0; }",
        image,
        f"the {BENCH_PLOT} preview did not load",
        "selector => Array.from(document.querySelectorAll('img'))"
        ".map(i => [i.alt, i.naturalWidth])",
        None,
    )
    size = page.evaluate(
        "selector => { const img = document.querySelector(selector);"
        " return [img.naturalWidth, img.naturalHeight]; }",
        image,
    )
    assert tuple(size) == sweep.plot_size, (
        f"{BENCH_PLOT} shown at {size}, the file is {sweep.plot_size}"
    )
    screenshot(page, shot)
