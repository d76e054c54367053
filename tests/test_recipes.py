"""The study recipes (recipes/*.sh): each runs end to end at a 1-step tiny-model size with its CPU
flags (two with their GPU flags too) and ends with the comparison table; every command they would
launch at full size parses (train.py's checks included)."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_train import digit_checkpoint, learnable_data  # noqa: E402

RECIPES = {"ladder.sh": 6, "proposed.sh": 4, "grpo-vs-dpo.sh": 6, "objectives.sh": 4}  # arms


def recipe(name, tmp_path, **env):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable, OUT=str(tmp_path / "runs"),
               **env)
    return subprocess.run(["bash", str(ROOT / "recipes" / name)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("size", ["cpu", "gpu"])
def test_every_command_of_a_recipe_parses(name, size, tmp_path):
    from run import config
    proc = recipe(name, tmp_path, SIZE=size, DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    commands = [line[2:] for line in proc.stdout.splitlines() if line.startswith("+ ")]
    runs = [c for c in commands if "--preset" in c]
    assert len(runs) == 3 * RECIPES[name]  # every arm, three seeds
    assert ("torchrun" in runs[0]) == (size == "gpu") and commands[-1].split()[1] == "run/runs.py"
    for command in runs:
        argv = shlex.split(command)
        config.parse_config(argv[argv.index("train.py") + 1:])  # a bad flag exits here


@pytest.mark.parametrize("size", ["cpu", "gpu"])
def test_the_sft_and_distillation_study_parses_and_trains_its_stages_first(size, tmp_path):
    """recipes/sft-opd.sh: its 4 arms x 3 seeds parse (the teacher and the warm starts as --teacher
    and --model), and the runs they start from, the teacher (on a CPU) and an SFT run a seed, are
    named first, not run, under DRY_RUN."""
    from run import config
    proc = recipe("sft-opd.sh", tmp_path, SIZE=size, DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    runs = [line[2:] for line in proc.stdout.splitlines() if line.startswith("+ ") and "--preset" in line]
    firsts = [line for line in proc.stdout.splitlines() if line.startswith("  (first) ")]
    assert len(runs) == 12 and len(firsts) == 3 + (size == "cpu") and not (tmp_path / "runs").exists()
    for command in runs:
        argv = shlex.split(command)
        args, _ = config.parse_config(argv[argv.index("train.py") + 1:])
        assert (args.teacher is not None) == (args.label in ("opd", "opd+dapo"))
        assert (args.label == "sft+dapo") == ("sft-s" in str(args.model))


def test_the_study_trains_a_teacher_only_for_its_own_opd_arms_and_resumes_a_stage(tmp_path):
    """Without an opd arm, or with a --teacher of the user's, no teacher run is started; a warm
    start that stopped midway (its config.json, no final/) is resumed, not started again."""
    (tmp_path / "runs" / "sft-s1").mkdir(parents=True)
    (tmp_path / "runs" / "sft-s1" / "config.json").write_text("{}")
    for env in ({"ARMS": "dapo sft+dapo"}, {"TEACHER": "some/teacher"}):
        proc = recipe("sft-opd.sh", tmp_path, DRY_RUN="1", SEEDS="1", **env)
        firsts = [line for line in proc.stdout.splitlines() if line.startswith("  (first) ")]
        assert proc.returncode == 0 and not any("teacher" in line for line in firsts), proc.stdout
        assert firsts == [f"  (first) {sys.executable} train.py --resume {tmp_path / 'runs' / 'sft-s1'}"]


def test_a_few_arms_of_a_recipe(tmp_path):
    """ARMS picks the presets (a grid that fits the time), the rest of the recipe unchanged."""
    proc = recipe("grpo-vs-dpo.sh", tmp_path, ARMS="grpo dpo", DRY_RUN="1")
    runs = [line for line in proc.stdout.splitlines() if "--preset" in line]
    assert proc.returncode == 0 and [r.split("--preset ")[1].split()[0] for r in runs] == \
        ["grpo"] * 3 + ["dpo"] * 3 and all("--mini-batches 4" in r for r in runs)
    empty = recipe("grpo-vs-dpo.sh", tmp_path, ARMS=" ", DRY_RUN="1")
    assert empty.returncode == 2 and "ARMS names no preset" in empty.stderr
    for jobs in ["0", "two", "-1"]:
        bad = recipe("grpo-vs-dpo.sh", tmp_path, JOBS=jobs, DRY_RUN="1")
        assert bad.returncode == 2 and "JOBS must be a whole number" in bad.stderr, jobs


@pytest.mark.slow
def test_runs_two_at_a_time_each_with_its_log(tmp_path):
    """JOBS=2: two runs at once, each writing DIR.log, then the same table; a failed run is
    named, the recipe exits non-zero and plots nothing."""
    model = digit_checkpoint(tmp_path / "model")
    data = learnable_data(tmp_path / "data.jsonl")
    tiny = (f"--model {model} --data {data} --eval-data {data} --eval-limit 4 --steps 1 "
            "--prompts-per-step 4 --samples 4 --max-new-tokens 4 --micro-batch-size 8 "
            "--template none --dtype float32 --eval-samples 2 --compile off")
    proc = recipe("grpo-vs-dpo.sh", tmp_path, ARMS="grpo dpo", SEEDS="0 1", JOBS="2",
                  EXTRA=tiny, LAUNCH=f"{sys.executable} {ROOT / 'train.py'}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    runs = tmp_path / "runs"
    for name in ["grpo-s0", "grpo-s1", "dpo-s0", "dpo-s1"]:
        assert (runs / name / "final").is_dir() and "step 1" in (runs / f"{name}.log").read_text()
    assert len((runs / "comparison.md").read_text().strip().splitlines()) == 2 + 2
    (tmp_path / "failing").mkdir()
    failing = recipe("grpo-vs-dpo.sh", tmp_path / "failing", ARMS="grpo", SEEDS="0 1", JOBS="2",
                     LAUNCH="false")
    assert failing.returncode == 1 and "grpo-s0" in failing.stderr and "grpo-s1" in failing.stderr
    assert "runs.py" not in failing.stdout


# The GPU sizes of grpo-vs-dpo (LoRA, XML format reward) and objectives (activation
# checkpointing, mini-batches) use every kind of GPU flag that ladder's and proposed's do; all of
# them parse (above), and these two run. (Two fewer runs: ~50 s of the suite.)
END_TO_END = [(name, "cpu") for name in sorted(RECIPES)] + [("grpo-vs-dpo.sh", "gpu"),
                                                            ("objectives.sh", "gpu")]


@pytest.mark.slow
@pytest.mark.parametrize("name, size", END_TO_END)
def test_a_recipe_runs_end_to_end_at_a_tiny_size(name, size, tmp_path):
    """Every arm, one seed, one step of a tiny model, with the recipe's own flags for the CPU
    or the GPU size (only the model, the data and the sizes overridden), then the table."""
    model = digit_checkpoint(tmp_path / "model")
    data = learnable_data(tmp_path / "data.jsonl")
    tiny = (f"--model {model} --data {data} --eval-data {data} --eval-limit 4 --steps 1 "
            "--prompts-per-step 4 --samples 4 --max-new-tokens 4 --micro-batch-size 8 "
            "--template none --dtype float32 --eval-samples 2 --compile off")
    proc = recipe(name, tmp_path, SIZE=size, SEEDS="0", EXTRA=tiny,
                  LAUNCH=f"{sys.executable} {ROOT / 'train.py'}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    table = (tmp_path / "runs" / "comparison.md").read_text()
    assert len(table.strip().splitlines()) == 2 + RECIPES[name] and "held-out at the end" in table
    assert (tmp_path / "runs" / "comparison.png").stat().st_size > 10_000
    for run in (tmp_path / "runs").iterdir():
        if run.is_dir():
            assert (run / "final").is_dir() and (run / "samples.jsonl").exists()
            assert not list(run.glob("checkpoint*.pt"))  # a finished run's resume files go
    # Run again: finished runs are kept, nothing is trained twice.
    again = recipe(name, tmp_path, SIZE=size, SEEDS="0", EXTRA=tiny,
                   LAUNCH=f"{sys.executable} {ROOT / 'train.py'}")
    assert again.returncode == 0 and "--preset" not in again.stdout


@pytest.mark.parametrize("study", ["grpo-vs-dpo", "objectives"])
def test_the_measurements_table_is_what_the_committed_logs_give(study):
    """The studies' logs are committed (assets/STUDY-cpu/): the table that `python run/runs.py`
    makes of them is MEASUREMENTS.md's, row for row."""
    from run import runs
    run_dirs = sorted((ROOT / "assets" / f"{study}-cpu").glob("*-s?"))
    assert len(run_dirs) == 3 * RECIPES[f"{study}.sh"]
    table = runs.summary_table([runs.load_run(str(d)) for d in run_dirs]).splitlines()
    measurements = (ROOT / "MEASUREMENTS.md").read_text()
    for row in table:
        assert row in measurements, row


def test_the_sft_and_distillation_table_is_what_its_committed_logs_give():
    """assets/sft-opd-cpu/: the four arms' runs, 3 seeds each, give MEASUREMENTS.md's table, and
    the README's line says their mean held-out figures at the end."""
    from run import runs
    arms = ["dapo", "opd", "opd+dapo", "sft+dapo"]
    loaded = [runs.load_run(str(ROOT / "assets" / "sft-opd-cpu" / f"{arm}-s{seed}"))
              for arm in arms for seed in (0, 1, 2)]
    table = runs.summary_table(loaded).splitlines()
    assert [row.split(" | ")[:2] for row in table[2:]] == [[f"| {arm}", "3"] for arm in arms]
    for row in table:
        assert row in (ROOT / "MEASUREMENTS.md").read_text(), row
    line = next(l for l in (ROOT / "README.md").read_text().splitlines() if "sft-and-on-policy" in l and l.startswith("|"))
    ends = {arm: sum(r["eval"][-1]["pass@1"] for r in loaded if r["label"] == arm) / 3 for arm in arms}
    assert (f"OPD {ends['opd']:.0%}, OPD + DAPO {ends['opd+dapo']:.0%}, DAPO {ends['dapo']:.0%}, "
            f"SFT then DAPO {ends['sft+dapo']:.0%}") in line


def test_same_run_refuses_bad_input_in_one_line(tmp_path):
    """recipes/same-run.py: a checkout without train.py, or --steps below 1, is one clear line and
    an exit status, before any run starts."""
    for argv, message in (([str(tmp_path)], "no train.py there"),
                          ([str(ROOT), "--steps", "0"], "--steps must be >= 1")):
        proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "same-run.py"), *argv],
                              capture_output=True, text=True)
        assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr


def test_engine_host_times_both_checkouts_and_refuses_bad_input(tmp_path):
    """recipes/engine-host.py against this checkout at a tiny size: each checkout's host
    milliseconds a decode step, round by round; a checkout without engine/paged.py, or rows that are
    not a multiple of 16, is one clear line before any work."""
    script = [sys.executable, str(ROOT / "recipes" / "engine-host.py")]
    proc = subprocess.run(script + [str(ROOT), "--rows", "16", "--prompt", "5", "--new-tokens",
                                    "20", "--repeats", "2"], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("16 rows, prompts of 5, 20 new tokens, ")
    assert lines[1].split()[0] == "before" and lines[2].split()[0] == "this"
    assert all(len(line.split("[")[1].split(",")) == 2 for line in lines[1:3])  # 2 rounds each
    assert "before / this, round by round: median " in lines[3]
    for argv, message in (([str(tmp_path)], "no engine/paged.py there"),
                          ([str(ROOT), "--rows", "20"], "--rows: a multiple of 16, got 20"),
                          ([str(ROOT), "--new-tokens", "1"], "--new-tokens: at least 2, got 1")):
        proc = subprocess.run(script + argv, capture_output=True, text=True)
        assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr


def test_decode_profile_counts_a_steps_operations_and_refuses_bad_input():
    """recipes/decode-profile.py at the tiny shape (2 layers): the same count on the meta device as
    on the CPU (operations do not depend on the device); the products as counted by hand: each
    layer's q, k, v with their biases (addmm) and wo, gate, up, down (mm), the head once; one
    gather of the rows' blocks a layer; views (which launch nothing) left out; on the CPU a
    step's milliseconds too. Bad input is one clear line, a KV cache too large for the device
    before any allocation."""
    script = [sys.executable, str(ROOT / "recipes" / "decode-profile.py"), "--shape", "tiny",
              "--rows", "3", "--context", "20", "--steps", "2"]
    meta, cpu = (subprocess.run(script + ["--device", device], capture_output=True, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
                 for device in ("meta", "cpu"))
    assert meta.returncode == 0 and cpu.returncode == 0, meta.stderr[-2000:] + cpu.stderr[-2000:]
    lines = cpu.stdout.splitlines()
    assert lines[0].startswith("decode step, tiny shape, 3 rows x 20 positions cached, bf16, ")
    assert meta.stdout.splitlines()[1:3] == lines[1:3]
    total, in_layers, outside = map(int, re.fullmatch(
        r"  operations a step \(views left out\): (\d+); in the 2 layers (\d+) \(\S+ each\), "
        r"outside them (\d+)", lines[1]).groups())
    assert in_layers + outside == total
    kinds = {kind: int(n) for kind, n in (item.rsplit(" ", 1)
                                          for item in lines[2].removeprefix("  by kind: ").split(", "))}
    assert sum(kinds.values()) == total
    assert kinds["addmm.default"] == 3 * 2 and kinds["mm.default"] == 4 * 2 + 1
    assert kinds["index_select.default"] == 2
    assert not {"view.default", "transpose.int", "t.default", "expand.default",
                "_unsafe_view.default"} & set(kinds)
    assert lines[3].startswith("  eager: ") and lines[3].endswith(" ms a step")
    for argv, message in ((["--rows", "0"], "--rows: at least 1, got 0"),
                          (["--context", "-1"], "--context: at least 1, got -1"),
                          (["--device", "cpu", "--shape", "qwen2.5-0.5b", "--rows", "100000",
                            "--context", "100000"], "the KV cache needs 114459.2 GiB")):
        proc = subprocess.run(script + argv, capture_output=True, text=True)
        assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_decode_profile_times_the_step_with_its_blocks_compiled():
    """decode-profile.py --fused (the GPU check's profile part passes it on CUDA): the step timed
    again with each block and the draw compiled (cuda_graphs.CompiledBlocks): one graph for
    every layer, one for the draw."""
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "decode-profile.py"),
                           "--device", "cpu", "--shape", "tiny", "--rows", "2", "--context", "9",
                           "--steps", "1", "--fused"], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[3].startswith("  eager: ") and lines[4].startswith("  blocks and draw compiled: ")
    assert lines[4].endswith(" ms a step")
    assert int(lines[5].split()[4]) == 2  # one that both layers reuse (not one a layer), the draw


def test_a_run_stopped_before_its_first_step_is_no_zero_in_the_means():
    """runs.py's table skips a run with no step in every column, peak memory too: the mean is the
    other runs', not pulled towards 0 MiB."""
    from run import runs
    step = {"step": 1, "tokens_per_second_rollout": 100.0, "tokens_per_second_update": 50.0,
            "peak_memory_mib": 900.0}
    done = {"label": "a", "eval": [{"step": 1, "pass@1": 0.5}], "metrics": [step]}
    stopped = {"label": "a", "eval": [], "metrics": []}
    row = runs.summary_table([done, stopped]).splitlines()[-1]
    assert row == "| a | 2 | 50.0% | 50.0% | 1 | 100 | 50 | 900 |", row


def test_gpu_check_keeps_every_finished_part_when_cut_off(tmp_path):
    """recipes/gpu-check.sh on the CPU (DEVICE=cpu, a tiny model): the tests, sampler and engine
    parts end and their figures are in results.md at once; the update part is cut at an
    artificial 1-second limit and says so; then the whole run is killed from outside during the
    next part, as a GPU lease ending would kill it, and results.md still holds every outcome."""
    import signal
    import time

    from transformers import AutoTokenizer
    model = digit_checkpoint(tmp_path / "model", context=128)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = "{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}<s> "
    tokenizer.save_pretrained(model)  # bench.py's prompts go through the chat template
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable, OUT=str(out), DEVICE="cpu",
               MODEL_DIR=model, ROWS="4", NEW_TOKENS="4", ENGINE_TOKENS="8", REPEATS="1",
               LIMIT_UPDATE="1")
    run = subprocess.Popen(["bash", str(ROOT / "recipes" / "gpu-check.sh")], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    results, deadline = out / "results.md", time.monotonic() + 300
    try:
        while "## update:" not in (results.read_text() if results.exists() else ""):
            assert run.poll() is None and time.monotonic() < deadline, "update part never ended"
            time.sleep(0.5)
    finally:
        os.killpg(run.pid, signal.SIGKILL)  # the lease ends, mid-part
        run.wait()
    text = results.read_text()
    assert "device: cpu" in text and "## model: " + model + " given" in text
    assert "## tests: ok" in text.split("## sampler: ")[0]  # first: they say what broke
    sampler = text.split("## sampler: ")[1].split("## engine")[0]
    assert sampler.startswith("ok, ") and "ours eager" in sampler and "transformers eager" in sampler
    assert " tok/s " in sampler and "matmul-only bound" in sampler
    engine = text.split("## engine: ")[1].split("## update")[0]
    assert engine.startswith("ok, ") and "paged, no budget" in engine and "lengths: median" in engine
    assert "## update: cut off at its limit of 1 s" in text
    assert "## nccl" not in text and (out / "sampler.log").exists()


@pytest.mark.slow
def test_gpu_check_train_part_runs_two_steps_and_keeps_their_seconds(tmp_path):
    """The check's train part (PARTS="train profile blocks") on the CPU at a tiny size: torchrun,
    two steps, each step's seconds and peak memory in results.md; its profile part, a decode
    step's operations and milliseconds at each row count; its blocks part, whose tests skip."""
    model = digit_checkpoint(tmp_path / "model", context=128)
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable, OUT=str(out), DEVICE="cpu",
               MODEL_DIR=model, PARTS="train profile blocks", TRAIN_PROMPTS="4", TRAIN_SAMPLES="4",
               TRAIN_TOKENS="4", ROWS="2 4")
    subprocess.run(["bash", str(ROOT / "recipes" / "gpu-check.sh")], env=env, check=True,
                   capture_output=True, timeout=300)
    text = (out / "results.md").read_text()
    assert "## sampler: skipped (PARTS=train profile blocks)" in text and "## nccl: skipped" in text
    profile = text.split("## profile: ")[1].split("## blocks")[0]
    assert profile.startswith("ok, ") and profile.count("operations a step") == 2, profile
    assert profile.count("by kind: ") == 2 and profile.count(" ms a step") == 2
    train = text.split("## train: ")[1].split("## profile")[0]
    assert train.startswith("ok, ") and "step 1: rollout" in train and "step 2: rollout" in train
    assert "update" in train and "peak" in train
    blocks = text.split("## blocks: ")[1].split("## compiled")[0]
    assert blocks.startswith("ok, ") and "2 skipped" in blocks, blocks  # the two families


def test_sampler_ab_packs_every_projection_of_each_checkout(tiny_ckpt):
    """recipes/sampler-ab.py imports each checkout's model.py on its own, whose Attention and MLP
    are not the classes speed.pack_linears looks for: given the model alone, pack_linears packs
    the head only (how the recipe measured until it passed each checkout's classes)."""
    import importlib.util

    import torch

    import model
    from engine import speed
    from engine.speed import PackedLinear
    spec = importlib.util.spec_from_file_location("sampler_ab", ROOT / "recipes" / "sampler-ab.py")
    sampler_ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sampler_ab)
    modules = sampler_ab.import_checkout(str(ROOT))
    tiny = modules["checkpoints"].load_model(tiny_ckpt("llama3"), dtype=torch.float32)[0]
    linears = [m for m in sampler_ab.pack_checkout(tiny, modules["model"]).modules()
               if isinstance(m, torch.nn.Linear)]
    assert len(linears) > 1 and all(type(m) is PackedLinear for m in linears)
    assert (speed.Attention, speed.MLP) == (model.Attention, model.MLP)  # put back after



def figures_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("figures", ROOT / "recipes" / "figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    return figures


def test_the_step_picture_is_read_from_train_step(tmp_path):
    """recipes/figures.py step reads the README's picture from train.py itself: train_step's five
    numbered calls in order, each file:function with the DAPO equation its docstring names, the
    dapo preset's path through refills' one queue and eq. 11's filter, the options off it (DPO,
    REINFORCE++) marked so; and it draws the picture."""
    figures = figures_module()
    steps = figures.step_tree(figures.preset_flags())
    assert [(s.number, s.call.module, s.call.name) for s in steps] == [
        ("1-2", "train.py", "collect_rollouts"), ("3", "train.py", "with_old_logprobs"),
        ("4", "train.py", "with_advantages"), ("5", "train.py", "update"),
        ("6", "run/metrics.py", "step_metrics")]

    def walk(call):
        yield call
        for inner in call.calls:
            yield from walk(inner)
    calls = {s.number: {(c.module, c.name): c for c in walk(s.call)} for s in steps}
    assert not calls["1-2"][("variants/refills.py", "rounds_in_one_queue")].off_path
    assert calls["1-2"][("dapo.py", "keep_groups")].equation == "eq. 11"
    assert calls["5"][("variants/reference.py", "dpo_update")].off_path
    assert calls["4"][("train.py", "reinforce_pp_advantages")].off_path
    assert calls["5"][("losses.py", "policy_loss")].equation == "eq. 10"
    figures.draw_step(steps, str(tmp_path / "step.png"))
    assert (tmp_path / "step.png").stat().st_size > 10_000


def test_the_curve_is_drawn_from_a_runs_logs(tmp_path):
    """recipes/figures.py curve draws a run directory's metrics.jsonl and eval.jsonl (a torn last
    line skipped, as a crash leaves it); a directory without them is one line naming it."""
    import json
    figures = figures_module()
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "accuracy": 0.1 * s, "train_seconds": 30.0 * s, "level": 1} for s in range(1, 5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "acc')
    evals = [{"step": 0, "pass@1": 0.2, "train_seconds": 0.0}, {"step": 4, "pass@1": 0.6, "train_seconds": 120.0}]
    (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    figures.draw_curve(str(run), str(tmp_path / "curve.png"))
    assert (tmp_path / "curve.png").stat().st_size > 10_000
    with pytest.raises(SystemExit, match="needs metrics.jsonl and eval.jsonl"):
        figures.draw_curve(str(tmp_path), str(tmp_path / "none.png"))
