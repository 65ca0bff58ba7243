"""``--objectives-file``: the file's forms, its errors (naming the file, the document and
the field), hot reload, and a bad reload keeping the last good content."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import yaml

from epp import keys
from epp.datastore.objectives import (
    ModelRewrite,
    Objective,
    ObjectiveStore,
    parse_object,
    selects_pool,
)
from epp.discovery.objectives_file import (
    ObjectivesFileSource,
    parse_objectives_file,
    read_objectives_file,
)
from epp.errors import ConfigError
from tests.polling import eventually

API = "apiVersion: inference.networking.x-k8s.io/v1alpha2"

FILE = f"""\
{API}
kind: InferenceObjective
metadata: {{name: critical}}
spec: {{priority: 10, poolRef: {{name: pool}}}}
---
{API}
kind: InferenceObjective
metadata: {{name: best-effort}}
spec: {{}}
---
{API}
kind: InferenceModelRewrite
metadata: {{name: canary}}
spec:
  rules:
  - matches: [{{model: {{value: llama}}}}]
    targets: [{{modelRewrite: llama-v2, weight: 100}}]
"""


def _write(path: Path, text: str) -> None:
    """Replace the file's content, making sure its stamp changes (mtime resolution)."""
    old = path.stat() if path.exists() else None
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    if old is not None:
        os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns + 1_000_000_000))


def test_documents_lists_and_kubectl_lists() -> None:
    objs, rws = parse_objectives_file(FILE, "f.yaml")
    assert [(o.name, o.priority) for o in objs] == [("critical", 10), ("best-effort", None)]
    assert [r.name for r in rws] == ["canary"]
    as_list = f"""\
- {{{API}, kind: InferenceObjective, metadata: {{name: a}}, spec: {{priority: 1}}}}
- {{{API}, kind: InferenceObjective, metadata: {{name: b}}, spec: {{priority: 2}}}}
"""
    objs, _ = parse_objectives_file(as_list, "f.yaml")
    assert [o.name for o in objs] == ["a", "b"]
    kubectl = f"""\
apiVersion: v1
kind: List
items:
- {API}
  kind: InferenceModelRewrite
  metadata: {{name: r1, namespace: default, creationTimestamp: "2025-01-01T00:00:01Z",
             resourceVersion: "7", uid: x}}
  spec: {{poolRef: {{name: pool}}, rules: [{{targets: [{{modelRewrite: t1}}]}}]}}
  status: {{conditions: []}}
- {API}
  kind: InferenceModelRewrite
  metadata: {{name: r0, creationTimestamp: "2025-01-01T00:00:00Z"}}
  spec: {{rules: [{{targets: [{{modelRewrite: t0}}]}}]}}
"""
    _, rws = parse_objectives_file(kubectl, "f.yaml")
    store = ObjectiveStore()
    store.replace_rewrites(rws)
    assert store.rewrite("any") == ("t0", "r0")  # the older one wins, whatever the order
    assert parse_objectives_file("", "f.yaml") == ([], [])
    assert parse_objectives_file("---\n---\n", "f.yaml") == ([], [])


def test_without_timestamps_file_order_is_age_order() -> None:
    text = "\n---\n".join(
        f"{API}\nkind: InferenceModelRewrite\nmetadata: {{name: {n}}}\n"
        f"spec: {{rules: [{{targets: [{{modelRewrite: {n}-target}}]}}]}}" for n in ("z", "a"))
    _, rws = parse_objectives_file(text, "f.yaml")
    assert [(r.name, r.order) for r in rws] == [("z", 0), ("a", 1)]
    store = ObjectiveStore()
    store.replace_rewrites(rws)
    assert store.rewrite("m") == ("z-target", "z")


@pytest.mark.parametrize(("text", "message"), [
    ("{", "f.yaml: not valid YAML"),
    ("just a string", "f.yaml: document 1: expected a mapping (an API object)"),
    (f"{API}\nkind: InferencePool\nmetadata: {{name: p}}\n", "f.yaml: document 1: kind"),
    (f"{FILE}---\n{API}\nkind: InferenceObjective\nmetadata: {{name: x}}\nspec: {{priority: h}}\n",
     "f.yaml: document 4 (InferenceObjective 'x'): spec.priority"),
    (f"{FILE}---\n{API}\nkind: InferenceObjective\nmetadata: {{name: critical}}\n",
     "f.yaml: document 4: a second InferenceObjective named 'critical'"),
    (f"- {{{API}, kind: InferenceObjective, metadata: {{name: a}}, spec: {{priorty: 1}}}}\n",
     "f.yaml: document 1[0] (InferenceObjective 'a'): spec: unknown field(s) ['priorty']"),
    ("kind: List\nitems: {a: 1}\n", "f.yaml: document 1: items: expected a list"),
], ids=["yaml", "not an object", "kind", "bad field", "duplicate", "typo", "list items"])
def test_errors_name_file_document_and_field(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_objectives_file(text, "f.yaml")
    assert message in str(e.value), str(e.value)


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read objectives file"):
        read_objectives_file(tmp_path / "missing.yaml")
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_objectives_file(binary)


def test_bad_file_fails_the_initial_load(tmp_path: Path) -> None:
    path = tmp_path / "objectives.yaml"
    path.write_text(f"{API}\nkind: InferenceObjective\nmetadata: {{name: x}}\n"
                    "spec: {priority: 1.5}\n")
    source = ObjectivesFileSource(path, ObjectiveStore())
    with pytest.raises(ConfigError, match=f"{path}: document 1 .*spec.priority"):
        source.load_initial()


async def test_hot_reload_and_bad_reload_keeps_last_good(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "objectives.yaml"
    path.write_text(FILE)
    store = ObjectiveStore()
    source = ObjectivesFileSource(path, store, poll_interval_s=0.01)
    source.load_initial()
    assert store.priority("critical") == 10 and store.rewrite("llama") == ("llama-v2", "canary")
    source.start_polling()
    try:
        # A change is applied.
        _write(path, FILE.replace("priority: 10", "priority: 7"))
        await eventually(lambda: store.priority("critical") == 7)
        # A broken change is logged and ignored: the last good content stays.
        loads = source.loads
        with caplog.at_level(logging.ERROR, logger="epp.discovery.objectives_file"):
            _write(path, FILE.replace("weight: 100", "weight: 0"))
            await eventually(lambda: source.last_error is not None)
        assert "keeping the last good content" in caplog.text
        assert f"{path}: document 3 (InferenceModelRewrite 'canary')" in caplog.text
        assert "weight" in caplog.text
        assert store.priority("critical") == 7 and store.rewrite("llama") is not None
        assert source.loads == loads
        # Fixed again: applied; a deleted file keeps the last content too.
        _write(path, f"{API}\nkind: InferenceObjective\nmetadata: {{name: only}}\n"
                     "spec: {priority: -3}\n")
        await eventually(lambda: store.priority("only") == -3)
        assert source.last_error is None
        assert store.priority("critical") == 0 and store.rewrite("llama") is None
        assert [o for o in store.objectives()] == [Objective("only", -3)]
        path.unlink()
        await eventually(lambda: source.last_error is not None)
        assert store.objectives() == [Objective("only", -3)]
        assert not any(isinstance(r, ModelRewrite) for r in store.rewrites())
    finally:
        await source.stop()
    await source.stop()  # idempotent


def test_the_shipped_example() -> None:
    """config/objectives/objectives.yaml loads, and works as Kubernetes objects of the
    pool deploy/kubernetes/ creates."""
    path = Path(__file__).resolve().parents[3] / "config/objectives/objectives.yaml"
    objs, rws = read_objectives_file(path)
    store = ObjectiveStore()
    store.replace(objs, rws)
    assert store.priority("critical") == 10 and store.priority("batch") == -5
    assert store.rewrite("llama-2") == ("llama-v1", "aliases")
    hit = store.rule_for("llama")
    assert hit is not None and hit[1] == "llama-canary"
    assert {t.model_rewrite: t.weight for t in hit[0].targets} == {"llama-v1": 90,
                                                                    "llama-v2": 10}
    for doc in yaml.safe_load_all(path.read_text()):
        parsed = parse_object(doc, str(path), strict=True)  # poolRef present: cluster-ready
        assert selects_pool(parsed.pool_ref, "vllm-pool", keys.K8S_POOL_GROUP)
