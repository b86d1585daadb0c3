"""A stand-in kubelet for encoder pods: runs their container as a local process.

The test control plane has a Job controller but no scheduler and no kubelet, so the pods
of an encoder Job would stay Pending forever. This stand-in watches (polls) the pods a
label selector picks, runs each one's single container on this machine the way a kubelet
would start it, and reports the exit as the pod's phase, so the real Job controller sees
indexes complete or fail. It honours what the operator's Job manifest uses and nothing
more: ``env`` values and ``fieldRef`` to annotations, ``$(VAR)`` expansion in ``args``,
``configMap`` volumes (materialized in a temporary directory, paths under the mount
rewritten), ``terminationMessagePath`` (a local file, read into the terminated state's
``message`` as the kubelet does), and ``command: ["dcr"]`` (this interpreter's ``python -m dcr``).

``hold`` pauses pods a predicate picks until ``release``: tests use it to keep an
attempt's encoder running while they restart the operator. ``release(zombies=True)``
runs held pods even if they were deleted meanwhile, as an encoder on a partitioned node
keeps writing after its Job is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dcr_operator.errors import NotFound
from dcr_operator.kube import KubeClient, api_path

# As the kubelet expands args: ``$$`` is one ``$`` (never the start of a reference), and
# ``$(NAME)`` is NAME's value if the container has it, else left as written.
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_MESSAGE_BYTES = 4096  # what the kubelet keeps of a termination message
_ANNOTATION = re.compile(r"^metadata\.annotations\['([^']+)'\]$")


def expand(arg: str, env: dict[str, str]) -> str:
    """``arg`` after the kubelet's expansion of a container's args from its ``env``."""
    return _VAR.sub(lambda v: "$" if v[0] == "$$" else env.get(v[1], v[0]), arg)


class FakeKubelet:
    def __init__(self, kube: KubeClient, namespace: str, selector: str, workdir: Path) -> None:
        self.kube, self.namespace, self.selector, self.workdir = kube, namespace, selector, workdir
        self.started: dict[str, float] = {}  # pod name -> when its process started
        self.finished: dict[str, int] = {}  # pod name -> exit code
        self.logs: dict[str, str] = {}
        self.errors: list[str] = []
        self._hold: Callable[[dict[str, Any]], bool] | None = None
        self._released = threading.Event()
        self._zombies = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-kubelet", daemon=True)

    def __enter__(self) -> FakeKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._released.set()
        self._thread.join(timeout=10)

    def hold(self, predicate: Callable[[dict[str, Any]], bool]) -> None:
        self._released.clear()
        self._hold = predicate

    def release(self, *, zombies: bool = False) -> None:
        self._zombies = zombies
        self._hold = None
        self._released.set()

    # --- the loop --------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                pods = self.kube.get(api_path("", "v1", "pods", self.namespace),
                                     labelSelector=self.selector)["items"]
            except Exception as e:
                self.errors.append(f"list pods: {e}")
                pods = []
            for pod in pods:
                name = pod["metadata"]["name"]
                phase = (pod.get("status") or {}).get("phase")
                if name in self.started or phase in ("Succeeded", "Failed"):
                    continue
                if pod["metadata"].get("deletionTimestamp"):
                    continue
                self.started[name] = time.time()
                threading.Thread(target=self._run, args=(pod,), name=f"pod-{name}",
                                 daemon=True).start()
            time.sleep(0.1)

    def _run(self, pod: dict[str, Any]) -> None:
        try:
            self._start(pod)
        except Exception as e:  # a broken stand-in must show, not hang the test
            self.errors.append(f"{pod['metadata']['name']}: {type(e).__name__}: {e}")
            self._report(pod, 127)

    def _start(self, pod: dict[str, Any]) -> None:
        hold = self._hold
        if hold is not None and hold(pod):
            self._released.wait()
        name = pod["metadata"]["name"]
        try:
            self.kube.get(api_path("", "v1", "pods", self.namespace, name))
        except NotFound:
            if not self._zombies:
                return  # deleted while held: a real kubelet would never start it
        with tempfile.TemporaryDirectory(dir=self.workdir, prefix=f"{name}-") as tmp:
            argv = self._argv(pod, Path(tmp))
            env, message_file = self._termination_file(pod, Path(tmp))
            done = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                                  check=False, env=env)
            message = (message_file.read_bytes()[:_MESSAGE_BYTES].decode(errors="replace")
                       if message_file is not None and message_file.exists() else "")
        self.logs[name] = f"$ {' '.join(argv)}\n{done.stdout}{done.stderr}"
        self.finished[name] = done.returncode
        self._report(pod, done.returncode, message)

    @staticmethod
    def _termination_file(pod: dict[str, Any], tmp: Path
                          ) -> tuple[dict[str, str] | None, Path | None]:
        """The process environment and the local file standing in for the container's
        ``terminationMessagePath`` (an env value naming that path is pointed at it)."""
        (c,) = pod["spec"]["containers"]
        path = c.get("terminationMessagePath")
        if not path:
            return None, None
        local = tmp / "termination-log"
        named = {e["name"]: str(local) for e in c.get("env", []) if e.get("value") == path}
        return {**os.environ, **named}, local

    def _argv(self, pod: dict[str, Any], tmp: Path) -> list[str]:
        spec = pod["spec"]
        (c,) = spec["containers"]
        env: dict[str, str] = {}
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = e["value"]
            elif m := _ANNOTATION.match(e.get("valueFrom", {}).get("fieldRef", {})
                                        .get("fieldPath", "")):
                env[e["name"]] = pod["metadata"]["annotations"][m[1]]
        mounts: dict[str, Path] = {}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for m in c.get("volumeMounts", []):
            if "configMap" not in volumes[m["name"]]:
                continue  # e.g. the ServiceAccount token admission adds: not used here
            cm = volumes[m["name"]]["configMap"]["name"]
            data = self.kube.get(api_path("", "v1", "configmaps", self.namespace, cm))["data"]
            local = tmp / m["name"]
            local.mkdir()
            for key, text in data.items():
                (local / key).write_text(text)
            mounts[m["mountPath"]] = local

        def resolve(arg: str) -> str:
            arg = expand(arg, env)
            for mount, local in mounts.items():
                if arg.startswith(mount + "/"):
                    arg = str(local) + arg[len(mount):]
            return arg

        command = c.get("command", [])
        assert command == ["dcr"], f"the stand-in kubelet runs `dcr` only, not {command}"
        return [sys.executable, "-m", "dcr", *(resolve(a) for a in c.get("args", []))]

    def _report(self, pod: dict[str, Any], code: int, message: str = "") -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        c = pod["spec"]["containers"][0]
        status = {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [{
            "name": c["name"], "image": c["image"], "imageID": "", "ready": False,
            "restartCount": 0, "state": {"terminated": {
                "exitCode": code, "reason": "Completed" if code == 0 else "Error",
                "startedAt": now, "finishedAt": now,
                **({"message": message} if message else {})}}}]}
        with contextlib.suppress(NotFound):
            self.kube.merge_patch(api_path("", "v1", "pods", self.namespace,
                                           pod["metadata"]["name"], "status"),
                                  {"status": status})
