"""train.py --fsdp (FSDP2) on the CPU with gloo: two ranks equal one process and DDP (also with
LoRA, activation checkpointing, compiled blocks and a Mixture-of-Experts model with routing
replay), SIGKILL then --resume equals never stopping, final/ loads in transformers, two "nodes"
through torchrun's c10d rendezvous equal one process, and the combinations that cannot work are
refused by name."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import free_port, needs_cpp_compiler
from test_train import (
    ROOT,
    assert_close_runs,
    assert_same_run,
    digit_checkpoint,
    digit_data,
    flags,
    kill_then_resume,
    metrics,
    run_train,
    torchrun,
)

pytestmark = pytest.mark.slow

UPDATE_METRICS = ("entropy", "clip_frac_low", "clip_frac_high", "approx_kl", "grad_norm", "reward",
                  "accuracy", "response_length", "groups_kept")


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    d = tmp_path_factory.mktemp("digits")
    return digit_checkpoint(d / "model"), digit_data(d / "train.jsonl")


@pytest.fixture(scope="module")
def moe_digits(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    return digit_checkpoint(d / "model", moe=True), digit_data(d / "train.jsonl")


def common_flags(model_dir, data_file, *extra):
    """2 steps at mu 2, 8 prompts (ranks keep unequal numbers of groups at seed 5)."""
    return ["--model", model_dir, "--data", data_file, "--steps", "2", "--dynamic-sampling",
            "--max-refills", "0", "--seed", "5", "--mini-batches", "2"] \
        + flags(prompts_per_step="8") + list(extra)


def assert_equal_runs(a, b, atol=1e-6):
    """The same weights (float tolerance: other reduction orders) and update metrics."""
    assert_close_runs(a, b, atol, keys=UPDATE_METRICS, rel=1e-4, metric_atol=1e-6)


@pytest.mark.parametrize("variant", [
    pytest.param([], id="full"), pytest.param(["--lora-rank", "4", "--lr", "1e-2"], id="lora"),
    pytest.param(["--activation-checkpointing"], id="activation-checkpointing"),
    pytest.param(["--compile", "auto"], id="compiled-blocks", marks=needs_cpp_compiler)])
def test_fsdp_two_ranks_equal_one_process(digits, tmp_path, variant):
    common = common_flags(*digits, *variant)
    run_train(common + ["--out", str(tmp_path / "one")])
    fsdp = run_train(common + ["--fsdp", "--out", str(tmp_path / "fsdp")], launcher=torchrun())
    assert ("blocks compiled" in fsdp.stdout) == ("auto" in variant)
    assert_equal_runs(tmp_path / "one", tmp_path / "fsdp")
    kept = [row["groups_kept_per_rank"] for row in metrics(tmp_path / "fsdp")]
    assert any(a != b for a, b in kept), kept  # uneven ranks: stand-ins, global mini-batches
    if not variant:  # and DDP, which the same step equals too
        run_train(common + ["--out", str(tmp_path / "ddp")], launcher=torchrun())
        assert_equal_runs(tmp_path / "one", tmp_path / "ddp")
        shards = [e for e in os.listdir(tmp_path / "fsdp") if e.startswith("shards-")]
        assert shards == ["shards-2"], shards  # sharded checkpoint, none left over


def test_fsdp_final_loads_in_transformers(digits, tmp_path):
    """final/ is one full checkpoint: transformers' model of it gives our model's logits."""
    from conftest import hf_model
    from run.checkpoints import load_model
    run_train(common_flags(*digits, "--steps", "1") + ["--fsdp", "--out", str(tmp_path / "run")],
              launcher=torchrun())
    final = str(tmp_path / "run" / "final")
    ids = torch.tensor([[2, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        ours, theirs = load_model(final)[0](ids), hf_model(final)(ids).logits
    assert (ours - theirs).abs().max() < 1e-4


def test_fsdp_resume_after_sigkill_equals_never_stopping(digits, tmp_path):
    """Killed after its second checkpoint, resumed from the sharded one: bit for bit the run that
    never stopped (gloo on the CPU is deterministic)."""
    common = ["--model", digits[0], "--data", digits[1], "--steps", "5", "--dynamic-sampling",
              "--max-refills", "1", "--checkpoint-every", "1", "--fsdp"] + flags(mini_batches="2")
    run_train(common + ["--out", str(tmp_path / "straight")], launcher=torchrun())
    kill_then_resume(common, tmp_path / "killed", launcher=torchrun())
    assert_same_run(tmp_path / "straight", tmp_path / "killed")
    assert sorted(e for e in os.listdir(tmp_path / "killed") if e.startswith("shards-")) \
        == ["shards-4", "shards-5"]  # the newest checkpoint's and the one before's
    run_train(["--resume", str(tmp_path / "killed"), "--steps", "6"], launcher=torchrun(1))
    assert len(metrics(tmp_path / "killed")) == 6  # the shards read back on another rank count


def test_one_rank_under_torchrun_runs_ddp_and_fsdp(digits, tmp_path):
    """`torchrun --nproc_per_node 1` starts a process group (the GPU check's NCCL run relies on
    it) and equals one plain process, with the DDP wrapper and with --fsdp."""
    common = common_flags(*digits, "--steps", "1")
    run_train(common + ["--out", str(tmp_path / "one")])
    for name, extra in (("ddp", []), ("fsdp", ["--fsdp"])):
        run_train(common + extra + ["--out", str(tmp_path / name)], launcher=torchrun(1))
        assert_equal_runs(tmp_path / "one", tmp_path / name)


def test_moe_with_routing_replay_under_ddp_and_fsdp_equals_one_process(moe_digits, tmp_path):
    """(Without --router-aux-coef: the load-balancing loss is a product of two means over the
    tokens of one forward, as transformers and Megatron compute it, so it depends on which rows
    share a micro-batch, and ranks hold other rows than one process does.)"""
    common = common_flags(*moe_digits, "--routing-replay")
    run_train(common + ["--out", str(tmp_path / "one")])
    for name, extra in (("ddp", []), ("fsdp", ["--fsdp"])):
        run_train(common + extra + ["--out", str(tmp_path / name)], launcher=torchrun())
        assert_equal_runs(tmp_path / "one", tmp_path / name, atol=1e-5)


def test_two_nodes_through_the_c10d_rendezvous_equal_one_process(digits, tmp_path):
    """`torchrun --nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT` on two machines is the same
    program: here two local "nodes" of one rank each meet at 127.0.0.1."""
    common = common_flags(*digits)
    run_train(common + ["--out", str(tmp_path / "one")])
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
         "--nproc_per_node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "test",
         "--rdzv-endpoint", f"127.0.0.1:{port}", str(ROOT / "train.py"), *common, "--fsdp",
         "--out", str(tmp_path / "nodes")], cwd=ROOT, env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert all(node.returncode == 0 for node in nodes), outputs[0][-2000:] + outputs[1][-2000:]
    assert_equal_runs(tmp_path / "one", tmp_path / "nodes")


def test_fsdp_needs_torchrun_and_resumes_only_as_written(digits, tmp_path):
    proc = run_train(common_flags(*digits) + ["--fsdp", "--out", str(tmp_path / "a")], check=False)
    assert proc.returncode != 0 and "--fsdp shards the model over torchrun's ranks" in proc.stderr
    run_train(common_flags(*digits, "--steps", "1") + ["--out", str(tmp_path / "plain")])
    proc = run_train(["--resume", str(tmp_path / "plain"), "--steps", "2", "--fsdp"],
                     launcher=torchrun(), check=False)
    assert proc.returncode != 0 and "written without --fsdp; resume it the same way" in proc.stderr


def test_held_out_evaluation_shared_by_two_ranks_equals_one_process(digits, tmp_path):
    """Every rank plays every world-th held-out problem, rank 0 gathers: eval.jsonl holds the
    numbers one process writes (greedy and sampled), before, during and after training."""
    common = common_flags(*digits, "--eval-data", digits[1], "--eval-limit", "7", "--eval-every", "1",
                          "--eval-samples", "2")
    run_train(common + ["--out", str(tmp_path / "one")])
    two = run_train(common + ["--out", str(tmp_path / "two")], launcher=torchrun())
    assert "held-out accuracy" in two.stdout and "problems over 2 ranks" in two.stdout
    one, two = ([json.loads(line) for line in (tmp_path / name / "eval.jsonl").read_text().splitlines()]
                for name in ("one", "two"))
    assert [row["step"] for row in one] == [row["step"] for row in two] == [0, 1, 2]
    for a, b in zip(one, two):
        assert a["n"] == b["n"] == 7
        for key in ("pass@1", "avg@k", "mean_length", "truncated"):
            assert a[key] == pytest.approx(b[key], abs=1e-9), (a["step"], key)


def test_two_ranks_read_the_data_once_and_both_stop_at_a_bad_row(digits, tmp_path):
    """Rank 0 alone reads and checks the data (launch.setup, distributed.from_rank0) and sends it;
    a bad row stops every rank with rank 0's message, none left waiting."""
    bad = digit_data(tmp_path / "bad.jsonl", n=5, extra={"prompt": "   ", "answer": "2", "id": "x"})
    proc = run_train(common_flags(digits[0], bad) + ["--out", str(tmp_path / "run")],
                     launcher=torchrun(), check=False, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.count("bad.jsonl: row 6") >= 2, proc.stderr  # both ranks, one message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
