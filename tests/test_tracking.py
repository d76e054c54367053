"""--report-to: a tiny run logs to tensorboard and to an offline wandb run, read back with
tensorboard's own reader and from wandb's run file; the flag refused by name when wrong."""

import glob
import json
import os
import struct
import subprocess
import sys

import pytest

from run import tracking
from test_train import BASE, ROOT, metrics, run_train, tiny  # noqa: F401  (a fixture)

sys.path.insert(0, str(ROOT))


def wandb_records(path):
    """The protobuf records of a wandb run file (`run-ID.wandb`): a 7-byte header (":W&B", a
    magic number, a version), then LevelDB's log format: 32 KiB blocks of chunks, each a 7-byte
    header (checksum, length, type: 1 whole, 2 first, 3 middle, 4 last) and its bytes."""
    from wandb.proto import wandb_internal_pb2
    with open(path, "rb") as f:
        blob = f.read()
    assert blob[:4] == b":W&B", path
    records, pending, at, block = [], b"", 7, 32768
    while at + 7 <= len(blob):
        if block - at % block < 7:  # a block's tail too short for a header is padding
            at += block - at % block
            continue
        _, length, kind = struct.unpack("<IHB", blob[at:at + 7])
        if kind == 0 and length == 0:  # zeros: the end of what was written
            break
        pending += blob[at + 7:at + 7 + length]
        at += 7 + length
        if kind in (1, 4):  # a record is whole
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_dir):
    """{step: {name: value}} and the config, from every offline run under run_dir/wandb."""
    history, config = {}, {}
    for path in sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                history.setdefault(items.pop("_step"), {}).update(items)
            elif kind in ("run", "config"):  # the flags: wandb.init's, then any update
                updates = record.run.config.update if kind == "run" else record.config.update
                config.update({item.key: json.loads(item.value_json) for item in updates})
    return history, config


@pytest.mark.slow
def test_both_backends_hold_every_step_and_evaluation_under_metrics_jsonl_names(tiny, tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    model_dir, data_file = tiny
    out = tmp_path / "run"
    run_train(["--model", model_dir, "--data", data_file, "--eval-data", data_file, "--eval-limit",
               "4", "--eval-every", "1", "--steps", "2", "--out", str(out),
               "--report-to", "tensorboard,wandb"] + BASE,
              env_extra={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    rows = metrics(out)
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and [e["step"] for e in evals] == [0, 1, 2]

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    for name in ("accuracy", "reward", "response_length", "lr", "groups_kept", "entropy"):
        logged = [(e.step, e.value) for e in events.Scalars(name)]
        assert logged == [(r["step"], pytest.approx(r[name], rel=1e-6, abs=1e-9)) for r in rows], name
    assert [(e.step, e.value) for e in events.Scalars("eval/pass@1")] == \
        [(e["step"], pytest.approx(e["pass@1"])) for e in evals]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    tables = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("samples/text_summary")}
    assert sorted(tables) == [1, 2] and all(f"| {line['answer']} |" in tables[line["step"]]
                                            for line in samples)
    assert "lr: 0.001" in events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()

    history, config = wandb_history(out)
    assert config["lr"] == pytest.approx(1e-3) and config["samples"] == 4
    for row in rows:
        for name in ("accuracy", "reward", "response_length", "lr", "entropy"):
            assert history[row["step"]][name] == pytest.approx(row[name], rel=1e-6, abs=1e-9), name
        table = history[row["step"]]["samples/path"]  # the step's completions, a table file
        [path] = glob.glob(os.path.join(out, "wandb", "offline-run-*", "files", table))
        with open(path) as f:
            logged = json.load(f)
        assert logged["data"] == [[line[c] for c in logged["columns"]] for line in samples
                                  if line["step"] == row["step"]]
    for evaluation in evals:
        assert history[evaluation["step"]]["eval/pass@1"] == pytest.approx(evaluation["pass@1"])


@pytest.mark.slow
@pytest.mark.parametrize("value", ["mlflow", "", "tensorboard,mlflow"])
def test_report_to_is_checked_by_name(value):
    said = "use none, or one or more of tensorboard, wandb separated by commas"
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--report-to", value, "--steps", "1"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "--report-to" in proc.stderr and said in proc.stderr, proc.stderr


def test_report_to_reads_a_list():
    from run import tracking
    pytest.importorskip("tensorboard")
    assert tracking.parse_report_to("none") == []
    assert tracking.parse_report_to(" tensorboard, tensorboard,") == ["tensorboard"]


def test_a_missing_backend_names_its_pip_install(monkeypatch):
    import importlib.util

    from run import tracking
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "wandb" else real(name, *rest))
    with pytest.raises(ValueError, match="pip install wandb"):
        tracking.parse_report_to("wandb")


@pytest.mark.slow
def test_steps_run_again_after_a_kill_are_shown_once_in_tensorboard(tiny, tmp_path):
    """A run killed after step 3 was logged but with its checkpoint at step 2 (made here by
    putting the step-2 checkpoint back): --resume runs step 3 again, and tensorboard's reader
    shows each step once, the second step 3's value, as metrics.jsonl."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    model_dir, data_file = tiny
    out = tmp_path / "run"
    run_train(["--model", model_dir, "--data", data_file, "--steps", "3", "--checkpoint-every", "2",
               "--out", str(out), "--report-to", "tensorboard"] + BASE)
    os.replace(out / "checkpoint-previous.pt", out / "checkpoint.pt")  # back to step 2
    for path in (out / "final").iterdir():
        path.unlink()
    (out / "final").rmdir()
    with open(out / "metrics.jsonl") as f:
        killed_step_3 = json.loads(f.readlines()[2])
    run_train(["--resume", str(out)])
    rows = metrics(out)
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("entropy")]
    assert logged == [(r["step"], pytest.approx(r["entropy"], rel=1e-6)) for r in rows]
    assert [r["step"] for r in rows] == [1, 2, 3] and killed_step_3["step"] == 3


def test_wandb_without_a_login_is_refused_before_any_work(tmp_path, monkeypatch):
    """--report-to wandb online with no API key and no `wandb login` entry: refused by config.py
    in one line, naming the way out; offline needs no login."""
    pytest.importorskip("wandb")
    from run import config
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with pytest.raises(ValueError, match="wandb finds no login .* WANDB_MODE=offline"):
        tracking.parse_report_to("wandb")
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password abc\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert tracking.parse_report_to("wandb") == ["wandb"]
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert tracking.parse_report_to("wandb") == ["wandb"]
    monkeypatch.delenv("WANDB_MODE")
    with pytest.raises(SystemExit):
        config.parse_config(["--report-to", "wandb"])


def test_wandb_that_cannot_start_ends_in_one_line_and_leaves_nothing(tiny, tmp_path, monkeypatch):
    """wandb.init failing (no network: its CommError after its bounded wait) before the first
    step: one line, no traceback, and the new run's directory gone, so the same command starts
    afresh; the wait is bounded (init_timeout)."""
    wandb = pytest.importorskip("wandb")
    import train
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    asked = {}

    def no_network(**kwargs):
        asked.update(kwargs)
        raise wandb.errors.CommError("Run initialization has timed out after 60.0 sec.\nmore")
    monkeypatch.setattr(wandb, "init", no_network)
    model_dir, data_file = tiny
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        train.main(["--model", model_dir, "--data", data_file, "--steps", "1", "--out", str(out),
                    "--report-to", "wandb"] + BASE)
    message = str(stopped.value.code)
    assert message.startswith("train.py: --report-to wandb could not start (Run initialization has "
                              "timed out after 60.0 sec.)") and "\n" not in message
    assert "the same command starts afresh" in message and not out.exists()
    assert asked["settings"].init_timeout == tracking.WANDB_INIT_SECONDS
