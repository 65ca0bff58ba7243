"""``--objectives-file``: InferenceObjectives and InferenceModelRewrites without Kubernetes.

In pool mode (``--pool-name``) the EPP watches these objects in the pool's namespace
(epp/discovery/kubernetes.py), as GIE's EPP does. Every other endpoint source
(``--endpoints``, ``--endpoints-file``, ``--endpoint-selector``) has no CRDs to watch —
GIE's EPP then has no objectives at all — so this file supplies them: the same objects,
with the same fields as GIE v1.5.0's CRDs, as YAML::

    apiVersion: inference.networking.x-k8s.io/v1alpha2
    kind: InferenceObjective
    metadata: {name: critical}
    spec: {priority: 10}
    ---
    apiVersion: inference.networking.x-k8s.io/v1alpha2
    kind: InferenceModelRewrite
    metadata: {name: canary}
    spec:
      rules:
      - matches: [{model: {value: llama}}]
        targets: [{modelRewrite: llama-v2, weight: 90}, {modelRewrite: llama-v3, weight: 10}]

Each YAML document is one object, a list of objects, or a ``List`` (``kind: List`` or
``…List``, with ``items``: what ``kubectl get -o yaml`` prints). ``apiVersion``, ``kind``
and ``metadata.name`` are required; ``spec`` takes exactly the CRD's fields (an unknown
field is an error, where the API server would drop it silently); ``spec.poolRef`` may be
left out and is not checked (the file is this EPP's own); ``status`` is ignored. Names
are unique per kind. Rewrite precedence: ``metadata.creationTimestamp`` when given (a
missing one counts as the oldest possible), then the order in the file.

The file is read at startup (a bad file fails it, naming the file, the document and the
field) and polled for changes (mtime, size, inode) like the endpoints file: a change that
fails to parse is logged and the last good content stays in force.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from epp.datastore.objectives import (
    InvalidObject,
    ModelRewrite,
    Objective,
    ObjectiveStore,
    parse_object,
)
from epp.errors import ConfigError

log = logging.getLogger(__name__)


def _items(doc: Any, where: str) -> Iterator[tuple[Any, str]]:
    """The objects of one YAML document, each with where it is."""
    if doc is None:
        return
    if isinstance(doc, list):
        for i, item in enumerate(doc):
            yield item, f"{where}[{i}]"
        return
    if isinstance(doc, Mapping) and isinstance(doc.get("kind"), str) \
            and doc["kind"].endswith("List") and "items" in doc:
        items = doc.get("items") or []
        if not isinstance(items, list):
            raise ConfigError(f"{where}: items: expected a list of objects")
        for i, item in enumerate(items):
            yield item, f"{where}: items[{i}]"
        return
    yield doc, where


def parse_objectives_file(text: str, source: str) -> tuple[list[Objective], list[ModelRewrite]]:
    """Parse the file's text; ConfigError naming ``source``, the document and the field."""
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from e
    objectives: dict[str, Objective] = {}
    rewrites: dict[str, ModelRewrite] = {}
    for n, doc in enumerate(docs, start=1):
        for item, where in _items(doc, f"{source}: document {n}"):
            try:
                obj = parse_object(item, where, strict=True, require_pool_ref=False)
            except InvalidObject as e:
                raise ConfigError(str(e)) from None
            if isinstance(obj, Objective):
                if obj.name in objectives:
                    raise ConfigError(f"{where}: a second InferenceObjective named "
                                      f"{obj.name!r} (names are unique per kind)")
                objectives[obj.name] = obj
            else:
                if obj.name in rewrites:
                    raise ConfigError(f"{where}: a second InferenceModelRewrite named "
                                      f"{obj.name!r} (names are unique per kind)")
                rewrites[obj.name] = dataclasses.replace(obj, order=len(rewrites))
    return list(objectives.values()), list(rewrites.values())


def read_objectives_file(path: Path) -> tuple[list[Objective], list[ModelRewrite]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read objectives file: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: objectives file is not UTF-8 text: {e}") from e
    return parse_objectives_file(text, str(path))


class ObjectivesFileSource:
    """Loads the objectives file into the store and re-reads it when it changes.

    Lifecycle: :meth:`load_initial` (errors propagate: startup fails on a bad file), then
    :meth:`start_polling`; :meth:`stop`.
    """

    def __init__(self, path: Path, store: ObjectiveStore, poll_interval_s: float = 0.5) -> None:
        self.path = path
        self.store = store
        self.poll_interval_s = poll_interval_s
        self._stamp: tuple[int, int, int] | None = None
        self._task: asyncio.Task[None] | None = None
        self.last_error: str | None = None
        self.loads = 0  # successful (re)loads (observability, tests)

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _apply(self, content: tuple[list[Objective], list[ModelRewrite]]) -> None:
        objectives, rewrites = content
        self.store.replace(objectives, rewrites)
        self.loads += 1
        log.info("objectives file %s: %d InferenceObjective(s), %d InferenceModelRewrite(s)",
                 self.path, len(objectives), len(rewrites))

    def load_initial(self) -> None:
        """Read the file once; a ConfigError propagates."""
        self._stamp = self._file_stamp()
        self._apply(read_objectives_file(self.path))

    def reload_if_changed(self) -> bool:
        """Re-read the file if it changed; True when new content was applied."""
        stamp = self._file_stamp()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            content = read_objectives_file(self.path)
        except ConfigError as e:
            if str(e) != self.last_error:
                log.error("objectives file change ignored, keeping the last good content: %s",
                          e)
                self.last_error = str(e)
            return False
        if self.last_error is not None:
            log.info("objectives file %s is valid again", self.path)
        self.last_error = None
        self._apply(content)
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            self.reload_if_changed()

    def start_polling(self) -> None:
        """Start re-reading the file on change (after :meth:`load_initial`)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="objectives-file")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
