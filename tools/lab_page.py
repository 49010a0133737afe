"""Serve tutorial notebooks with JupyterLab on loopback and drive them from Playwright.

Used by the JupyterLab browser test (``tests/notebook/test_lab_browser.py``),
which also writes the tutorial screenshots in ``docs/images/``. JupyterLab runs
on a scratch copy of the notebooks (a run never saves into the repository),
without a token, on 127.0.0.1, with the app object exposed to the page so a
test can run every cell and read the outputs the way the front end holds them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from voila_page import REPO, free_port

# Quiet JupyterLab: no news or update checks (they pop up over the notebook), no autosave.
_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False,
    },
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    # Every cell in the page, not only those scrolled into view, so a test sees all outputs.
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


class LabError(RuntimeError):
    """JupyterLab did not start; the message carries the end of its log."""


@contextmanager
def serve_lab(notebooks: list[Path], scratch: Path, *,
              start_timeout: float = 90.0) -> Iterator[str]:
    """Copy ``notebooks`` into ``scratch``, run JupyterLab there and yield its base URL."""
    root = scratch / "root"
    root.mkdir(parents=True, exist_ok=True)
    for notebook in notebooks:
        shutil.copy(notebook, root / notebook.name)
    settings = scratch / "settings"
    for name, values in _SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values), encoding="utf-8")
    port = free_port()
    environment = dict(os.environ)
    environment.update({
        "JUPYTERLAB_SETTINGS_DIR": str(settings),
        "JUPYTERLAB_WORKSPACES_DIR": str(scratch / "workspaces"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    })
    log_path = scratch / "lab.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
             "--ServerApp.ip=127.0.0.1", "--IdentityProvider.token=", "--ServerApp.password=",
             f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
             "--ServerApp.disable_check_xsrf=True", "--ServerApp.allow_root=True"],
            cwd=root, env=environment, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _wait_for_port(port, process, log, log_path, start_timeout)
            yield f"http://127.0.0.1:{port}"
        finally:
            _stop(process)


def _stop(process: Any) -> None:
    """End JupyterLab and the kernels it started (its whole process group)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except ProcessLookupError:
        return  # it had already exited
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _wait_for_port(port: int, process: Any, log: Any, log_path: Path, timeout: float) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                log.flush()
                tail = log_path.read_text(errors="replace")[-3000:]
                raise LabError(f"jupyter lab did not start on port {port}:\n{tail}") from None
            time.sleep(0.3)  # polling a port that is not open yet: there is no event to wait on


# Runs in the page: record every progress text a LiveView shows, as it changes.
WATCH_PROGRESS = """() => {
  window.__ucProgress = [];
  const seen = (text) => { const list = window.__ucProgress;
    if (!list.length || list[list.length - 1] !== text) list.push(text); };
  new MutationObserver(() => {
    for (const node of document.querySelectorAll('.undercurrent-live-progress .uc-progress'))
      seen(node.textContent);
  }).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""

# Runs in the page: start the kernel if needed, run every cell, wait until done;
# returns the kernel's status then: 'idle', or 'dead' (it never goes idle again).
RUN_ALL = """async () => {
  const app = window.jupyterapp;
  const panel = app.shell.currentWidget;
  await panel.context.ready;
  await panel.sessionContext.ready;
  await app.commands.execute('notebook:run-all-cells');  // resolves when the cells ran
  const kernel = panel.sessionContext.session.kernel;
  while (kernel.status !== 'idle' && kernel.status !== 'dead') {
    await new Promise(resolve => kernel.statusChanged.connect(resolve));
  }
  return kernel.status;
}"""

# Runs in the page: what each code cell holds after the run.
CELL_OUTPUTS = """() => window.jupyterapp.shell.currentWidget.content.widgets
  .filter(cell => cell.model.type === 'code')
  .map(cell => ({count: cell.model.executionCount,
                 outputs: cell.model.outputs.toJSON().map(o => ({
                   type: o.output_type, name: o.ename || o.name || '',
                   mimes: Object.keys(o.data || {})}))}))"""

# Runs in the page: run code in the notebook's kernel, outside any cell; returns its stdout.
KERNEL_STDOUT = """async (code) => {
  const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
  const future = kernel.requestExecute({code, silent: false, store_history: false});
  let out = '';
  future.onIOPub = (msg) => {
    if (msg.header.msg_type === 'stream' && msg.content.name === 'stdout') out += msg.content.text;
  };
  await future.done;
  return out;
}"""

# Runs in the page: run the first code cell whose source contains the text again.
RERUN_CELL = """async (text) => {
  const app = window.jupyterapp;
  const panel = app.shell.currentWidget;
  const index = panel.content.widgets.findIndex(
    cell => cell.model.type === 'code' && cell.model.sharedModel.getSource().includes(text));
  if (index < 0) throw new Error('no code cell contains ' + text);
  panel.content.activeCellIndex = index;
  await app.commands.execute('notebook:run-cell');
  const kernel = panel.sessionContext.session.kernel;
  while (kernel.status !== 'idle') {
    await new Promise(resolve => kernel.statusChanged.connect(resolve));
  }
  return index;
}"""
