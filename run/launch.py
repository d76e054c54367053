"""A run around its steps: setup (ranks, the model and its copies, the optimizer, the data, the
reward function, every flag checked against them), checkpoints and resume, the step's log lines,
the final save, and the sampler's refresh. train.py's loop calls these; the held-out evaluation
is run/evaluation.py's, the update's precision run/distributed.py's, the adaptive budget and the
harder variants variants/refills.py's.

    run = setup(args)                            # -> Run: the long-lived objects
    progress, carried = load_checkpoint(run)     # --resume
    save_checkpoint(run, progress)
    finish(run, progress)                        # the last evaluation, final/, a summary
"""

import argparse
import copy
import dataclasses
import importlib.util
import json
import os
import random
import resource
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from safetensors import SafetensorError

import data
import rewards
from engine.speed import compile_blocks, expandable_cuda_segments, keep_freed_memory, pack_linears
from model import Transformer
from rollout import line_break_ids, stop_token_ids
from run import checkpoints, config, evaluation, memory_plan, runs, sharding, tracking
from run.checkpoints import load_model, save_model
from run.distributed import from_rank0, gather, setup_distributed
from tasks import countdown, episodes
from variants import distill, quantize, sft
from variants.lora import add_lora

# ---- what a run holds ----------------------------------------------------------------------------

@dataclass
class Run:
    """The long-lived objects of a run (a step's data flows through Rollouts, not here)."""
    args: argparse.Namespace
    rank: int
    world: int
    model: torch.nn.Module      # the policy; under torchrun wrapped in DDP (forward and backward)
    policy: torch.nn.Module     # the same module unwrapped (parameters, head, saving)
    sampler: torch.nn.Module    # what rollouts run on: a bf16 copy where bf16 is fast, or policy
    reference: torch.nn.Module  # frozen copy for KL / GKL / DPO, or None (none, or --ref lora-off)
    tokenizer: object
    stop_ids: list
    step_separators: list       # token ids that end a line (Step-DPO's steps)
    optimizer: torch.optim.Optimizer
    source: object              # data.ArithmeticTask or a list of records
    stream: data.PromptStream   # this rank's slice of every batch
    heldout: list               # held-out records, or None
    bf16: bool                  # updates under bf16 autocast
    variant_rng: random.Random  # draws the adversarial variants
    run_lock: object            # rank 0's hold on the run directory (run.lock), else None
    tracker: tracking.Tracker = tracking.Tracker([], None, {})  # --report-to (rank 0), else none
    reward_function: object = None  # --reward's (or a task's own), else None: the rule reward
    reward_parts: tuple = ()        # the names of its parts, logged as reward_<name>
    teacher: torch.nn.Module = None  # --teacher's frozen model (variants/distill.py), else None


@dataclass(frozen=True)
class Progress:
    """What a checkpoint restores besides the weights, the optimizer and the random states."""
    step: int = 0                  # training steps done
    trained_steps: int = 0         # of them, those with an optimizer step: the schedule's clock
    updates: int = 0               # optimizer updates done (up to mu per step)
    train_seconds: float = 0.0     # across resumes: the time limit counts the whole run
    accuracy_ema: float = None     # training accuracy, moving average (the curriculum reads it)
    skipped_updates: int = 0       # non-finite losses or gradients, left out
    prompt_accuracy: dict = field(default_factory=dict)  # per prompt id, all ranks' samples
    carry: object = None           # this rank's surplus groups for the next step (Rollouts)


class StopRequest:
    """SIGTERM (a scheduler preempting the job) and SIGINT (Ctrl-C) ask the run to stop at the
    end of the step under way, with a checkpoint; the same signal again, REPEAT_SECONDS or more
    later, stops it at once (the last checkpoint stays whole: checkpoints are written aside, then
    renamed). A repeat sooner is the same request: under torchrun a scheduler that signals every
    process of the job reaches a rank twice, directly and forwarded by torchrun. `on_stop` is
    called last on a request, inside whatever runs: UserReward.stop, which ends a --reward call
    under way (one that hangs would hold back the step, and the checkpoint, for ever)."""
    REPEAT_SECONDS = 2.0

    def __init__(self, on_stop=None):
        self.signum, self.before, self.asked_at, self.on_stop = None, {}, None, on_stop
        if threading.current_thread() is threading.main_thread():  # (signals reach it alone)
            self.before = {signum: signal.signal(signum, self.ask)
                           for signum in (signal.SIGTERM, signal.SIGINT)}

    def __enter__(self):
        return self

    def __exit__(self, *exception):
        """The handlers from before (a caller in the same process, e.g. a test, keeps its own)."""
        for signum, handler in self.before.items():
            signal.signal(signum, handler)

    def ask(self, signum, frame):
        if self.signum == signum and time.monotonic() - self.asked_at < self.REPEAT_SECONDS:
            return  # the same request, forwarded
        if self.signum is not None:  # asked twice: the system's own end of the process
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum, self.asked_at = signum, time.monotonic()
        print(f"\n{signal.Signals(signum).name}: stopping at the end of this step, with a checkpoint "
              f"(the same signal again, {self.REPEAT_SECONDS:g} s or more later, stops at once)",
              file=sys.stderr, flush=True)
        if self.on_stop is not None:
            self.on_stop()  # (may raise, into the reward call it ends)


def interrupted_before_steps(args):
    """Ctrl-C while loading or in the step-0 evaluation: one line, exit status 130, nothing half
    written. -> the SystemExit to raise"""
    made = args.out and os.path.exists(os.path.join(args.out, "config.json"))
    print("\ntrain.py: interrupted (Ctrl-C) before the training steps: nothing trained since the "
          "last checkpoint" + (f"; `python train.py --resume {args.out}` goes on" if made else ""),
          file=sys.stderr)
    return SystemExit(130)


# ---- setup ---------------------------------------------------------------------------------------

def check_before_loading(args, writes, world):
    """What fails before any loading: a bad --out (checked again once the model loaded), a run
    directory another process holds (--resume), ranks that do not divide --prompts-per-step,
    --cuda-graphs off a GPU.
    -> the run directory's lock when resuming, else None"""
    if writes and not args.resume:
        try:
            runs.check_new(args.out)
        except runs.RunError as error:
            sys.exit(f"train.py: {error}")
    run_lock = claim_run_directory(args) if writes and args.resume else None
    if args.prompts_per_step % world:
        sys.exit(f"train.py: --prompts-per-step {args.prompts_per_step} must be a multiple of the "
                 f"{world} ranks")
    if getattr(args, "cuda_graphs", False) and args.device.type != "cuda":
        sys.exit(f"train.py: --cuda-graphs replays decode steps on a GPU; this run is on "
                 f"{args.device.type}")
    return run_lock


def load_configs(args):
    """--model's config.json and tokenizer, and --teacher's checked against them: the data and the
    memory plan are read before any weight, and a mismatch is refused before one loads.
    -> (model config, tokenizer, teacher config or None)"""
    try:
        model_config, tokenizer = checkpoints.load_config(args.model), checkpoints.load_tokenizer(args.model)
    except (OSError, ValueError) as e:
        sys.exit(f"train.py: --model: {e}")
    refuse_mismatches(args, model_config)
    try:
        teacher_config = distill.check_teacher(args.teacher, args.model, tokenizer) if args.teacher else None
    except (OSError, ValueError) as e:
        sys.exit(f"train.py: --teacher: {runs.first_line(e)}")
    return model_config, tokenizer, teacher_config


def setup(args):
    """The model, its copies, the optimizer and the data of a run -> Run."""
    keep_freed_memory()
    expandable_cuda_segments()  # before CUDA's first allocation (setup_distributed's)
    rank, world, device = setup_distributed()
    config.on_device(args, device)
    args.out = args.resume or args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    writes = rank == 0 and not args.bench
    run_lock = check_before_loading(args, writes, world)
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    model_config, tokenizer, teacher_config = load_configs(args)
    if getattr(args, "cuda_graphs", False) and model_config.num_experts:
        sys.exit("train.py: --cuda-graphs: an MoE's decode step groups tokens by expert on the "
                 "host, which a CUDA graph cannot replay")
    if args.template is None:
        args.template = data.default_template(args.data)
    try:  # every row is checked before any training, on rank 0, which sends the records to all
        source, heldout = from_rank0(lambda: load_data(args, tokenizer, model_config.max_seq_len), rank, world)
    except data.DataError as e:
        sys.exit(f"train.py: --data: {e}")
    try:  # --reward's function, called once on a data row before any weight loads
        reward_function, reward_parts = task_reward_function(args, source)
    except ValueError as e:
        sys.exit(f"train.py: {e}")
    capacity = memory_plan.device_capacity(device)  # a GPU's: a run that cannot fit stops here
    bf16 = config.uses_bf16(args, device.type == "cuda")
    if capacity or args.kv_budget:
        longest_prompt = data.longest_prompt(source, tokenizer, args.template)  # None: in turns
        memory_plan.refuse_small_kv_budget(args, model_config, longest_prompt, bf16)  # (named before the plan)
        if capacity:
            memory_plan.check_before_loading(args, model_config, longest_prompt, world, capacity, rank)
    try:
        model, policy, sampler, reference = (sharded_policy if args.fsdp else whole_policy)(
            args, model_config, bf16)
    except (OSError, ValueError) as e:
        sys.exit(f"train.py: --model: {e}")
    try:
        teacher = distill.load_teacher(args.teacher, device, bf16 and device.type == "cuda") \
            if teacher_config else None
    except (OSError, ValueError) as e:
        sys.exit(f"train.py: --teacher: {runs.first_line(e)}")
    if writes and not args.resume:  # a new run: once its model and data passed their checks
        run_lock = claim_run_directory(args)
    if config.compiles_update(args, policy):
        compile_blocks(policy)  # after sharding, as FSDP2 asks; the sampler copy stays eager
    trainable = [p for p in policy.parameters() if p.requires_grad]
    return Run(
        args=args, rank=rank, world=world, policy=policy, tokenizer=tokenizer, model=model,
        sampler=sampler, reference=reference,
        # Every reply of the memory task is one line (episodes.py): its sampler stops at a break.
        stop_ids=stop_token_ids(tokenizer) + (line_break_ids(tokenizer)
                                              if isinstance(source, episodes.MemoryTask) else []),
        step_separators=line_break_ids(tokenizer)
        if args.algo == "dpo" and args.dpo_pairs == "step" else [],
        optimizer=torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay,
                                    betas=(0.9, 0.999), fused=True),  # one kernel for all tensors
        source=source, heldout=heldout, bf16=bf16, run_lock=run_lock,
        stream=data.PromptStream(source, args.prompts_per_step, seed=args.seed, rank=rank, world_size=world),
        variant_rng=random.Random(f"{args.seed}:adversarial:{rank}"),
        reward_function=reward_function, reward_parts=tuple(reward_parts), teacher=teacher)


def task_reward_function(args, source):
    """--reward's function, checked on the first training row; else the task's own (Countdown's)
    or None, the rule reward. -> (function or None, the names of its parts)"""
    first = source.sample(1, random.Random(0))[0] if hasattr(source, "sample") else source[0]
    if not args.reward:
        function = getattr(source, "reward_function", None)
        return function, sorted(rewards.user_score(function, "", first)[2]) if function else []
    return checked_reward_function(args.reward, first, args.data, args.reward_timeout)


def load_reward_function(spec: str):
    """The function `spec` names: FILE.py:FUNCTION (a path) or MODULE:FUNCTION (importable).
    ValueError with one line naming what is wrong, the module's own error included. A module
    that moves the working directory as it loads moves no path of the run: it is put back."""
    target, colon, name = str(spec).rpartition(":")
    if not colon or not target or not name.isidentifier():
        raise ValueError(f"--reward {spec!r}: expected FILE.py:FUNCTION or MODULE:FUNCTION")
    here = os.getcwd()
    try:
        if target.endswith(".py"):
            if not os.path.isfile(target):
                raise ValueError(f"--reward {spec}: {target}: no such file")
            found = importlib.util.spec_from_file_location(
                "reward_" + os.path.splitext(os.path.basename(target))[0], target)
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ValueError:
        raise
    except BaseException as error:  # a syntax error or a raise at import: its own words, one line
        raise ValueError(f"--reward {spec}: {target} failed to load: {type(error).__name__}: "
                         f"{error}") from None
    finally:
        os.chdir(here)
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"--reward {spec}: {target} has no function {name!r}")
    return function


def checked_reward_function(spec: str, record: dict, source: str, seconds: float = rewards.TIME_LIMIT):
    """--reward's function, loaded and called once on `record` (the first data row) with the
    reply "Answer: <its answer>", before any weight loads: a broken one is one line naming the
    function, the row and the exception. Each call is limited to `seconds` (--reward-timeout; 0:
    none). -> (the function as a UserReward, the names of its parts)"""
    function = UserReward(load_reward_function(spec), seconds)
    where = f"--reward {spec}: on row {record.get('row', 1)} of {source}"
    try:
        _, _, parts = rewards.user_score(function, f"Answer: {record.get('answer', '')}",
                                         record.get("fields", record))
    except (Exception, rewards.RewardInterrupt) as error:
        raise ValueError(f"{where}: {type(error).__name__}: {error}") from None
    clash = sorted(set(parts) & set(rewards.RULE_PARTS))
    if clash:
        raise ValueError(f"{where}: parts {clash} share names with the rule reward's terms "
                         f"({', '.join(rewards.RULE_PARTS)}): rename them")
    return function, sorted(parts)


class UserReward:
    """--reward's function as the run calls it, `function(reply, row)`:
    - on its own deep copy of `row`: the replies of a prompt share one record, and a function that
      wrote into it would change what the next reply is scored on;
    - with the working directory put back after it, so that a function that calls os.chdir moves
      none of the run's relative paths (--out, --model, the logs). Put back rather than the run's
      paths made absolute: every relative path of the process keeps its meaning, not only those
      we resolve, and the run's messages show --out as it was typed;
    - limited to `seconds` a call (0: none): SIGALRM raises rewards.RewardTimeout inside it, which
      ends a Python loop, a time.sleep or a socket's wait; a C call that never returns to the
      interpreter is not interrupted, and a function that sets its own alarm (signal.alarm)
      replaces ours for that call. Only the main thread receives signals: off it, no limit.
    `stop()`, from a stop signal's handler (StopRequest), gives the call under way, and each one
    after it, STOP_GRACE seconds at most: a healthy reward's step ends as it would have; one that
    hangs past them ends in RewardStopped, and the later calls are not made (they score as errors),
    so that the step ends and the promised checkpoint comes."""
    STOP_GRACE = 10.0

    def __init__(self, function, seconds: float):
        self.function, self.seconds = function, float(seconds)
        self.__name__ = getattr(function, "__name__", repr(function))
        self.calling = False  # a call under way on the main thread
        self.stop_asked = False  # a stop signal came (StopRequest)
        self.stopped = False  # since then a call hung past STOP_GRACE: the later ones are not made
        self.said_thread = False

    def __call__(self, reply, row):
        if self.stopped:
            raise rewards.RewardStopped("not made: a call hung past a stop signal")
        here, row = os.getcwd(), copy.deepcopy(row)
        try:
            if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
                return self.timed(reply, row)
            if self.seconds and not self.said_thread:
                self.said_thread = True
                print(f"--reward {self.__name__} is called off the main thread, which alone receives "
                      "signals: no --reward-timeout there", file=sys.stderr, flush=True)
            return self.function(reply, row)
        finally:
            os.chdir(here)

    def limit(self):
        """This call's seconds (0: none): --reward-timeout, and STOP_GRACE once a stop was asked."""
        return min(filter(None, (self.seconds, self.STOP_GRACE if self.stop_asked else 0)), default=0)

    def timed(self, reply, row):
        """The call on the main thread, with SIGALRM set for `limit()` seconds (if any), then unset."""
        before = signal.signal(signal.SIGALRM, self.expire)
        self.calling = True  # (before the timer: an alarm in between must not be ignored)
        signal.setitimer(signal.ITIMER_REAL, self.limit())
        try:
            return self.function(reply, row)
        finally:
            self.calling = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL if before is None else before)

    def expire(self, signum, frame):
        if not self.calling:  # (the instant after the call returned, before the timer is off)
            return
        if self.stop_asked:  # hung while the run is stopping: make no more calls
            self.calling, self.stopped = False, True
            raise rewards.RewardStopped(f"no result within {self.STOP_GRACE:g} s of a stop signal (Ctrl-C "
                                        "or SIGTERM); the later calls are not made, so that the checkpoint comes")
        raise rewards.RewardTimeout(f"no result within --reward-timeout {self.seconds:g} s")

    def stop(self):
        """Called by a stop signal's handler, on the main thread inside whatever runs: the call
        under way, if any, has STOP_GRACE seconds left at most (its own limit if sooner)."""
        self.stop_asked = True
        if self.calling:
            left = signal.getitimer(signal.ITIMER_REAL)[0]
            signal.setitimer(signal.ITIMER_REAL, min(left or self.STOP_GRACE, self.STOP_GRACE))


def refuse_mismatches(args, model_config):
    """Flags that cannot act on this model or launch, refused by name before any work."""
    if (args.routing_replay or args.router_aux_coef) and not model_config.num_experts:
        sys.exit(f"train.py: --routing-replay and --router-aux-coef act on a Mixture-of-Experts "
                 f"model; {args.model or 'the bundled model'} ({model_config.model_type}) "
                 "has no experts")
    if (args.routing_replay or args.router_aux_coef) and args.algo == "dpo":
        sys.exit("train.py: --routing-replay and --router-aux-coef act on the policy-gradient "
                 "update (--algo pg), not on DPO")
    if args.compile == "on" and args.device.type == "cpu" and not config.cpp_compiler_found():
        sys.exit(f"train.py: --compile on: torch.compile writes C++ for a CPU and its compiler, "
                 f"{config.cpp_compiler()}, was not found ($CXX names another); install it or "
                 "leave --compile at auto")
    if args.fsdp and not dist.is_initialized():
        sys.exit("train.py: --fsdp shards the model over torchrun's ranks: launch with torchrun "
                 "(`torchrun --nproc_per_node N train.py --fsdp ...`, N = 1 works too)")


def adapted(args, policy):
    """The policy as the flags train it, in place: packed products for the sampler (speed.py),
    activation checkpointing, LoRA's adapters, an NF4 base."""
    pack_linears(policy)  # the sampler's products on packed weights, where faster
    policy.train()
    policy.gradient_checkpointing = config.checkpoints_activations(
        args, sum(p.numel() for p in policy.parameters()), args.device.type == "cuda")
    if args.lora_rank:
        add_lora(policy, rank=args.lora_rank, alpha=args.lora_alpha)
    if args.quantize == "nf4":
        try:
            quantize.quantize_lora_bases(policy)
        except ValueError as e:
            sys.exit(f"train.py: {e}")
    return policy


def whole_policy(args, model_config, bf16):
    """Every rank loads the whole model -> (the module the update runs through: the DDP wrapper
    under torchrun, else the policy; the policy; the sampler; the reference or None).
    Rollouts run on a bf16 copy where bf16 is fast, refreshed after every step."""
    policy = adapted(args, load_model(args.model, dtype=torch.float32, device=args.device)[0])
    sampler = copy.deepcopy(policy).to(torch.bfloat16).eval() if bf16 and not args.lora_rank else policy
    frozen = config.needs_reference(args) and args.ref == "frozen"
    reference = copy.deepcopy(policy).eval().requires_grad_(False) if frozen else None
    model = torch.nn.parallel.DistributedDataParallel(
        policy, device_ids=[args.device.index] if args.device.type == "cuda" else None) \
        if dist.is_initialized() else policy
    return model, policy, sampler, reference


def sharded_policy(args, model_config, bf16):
    """--fsdp: the policy built on the meta device and sharded before any weight exists, rank 0
    alone reading the checkpoint (sharding.load_sharded); the sampler's whole copy and a frozen
    reference built from the shards -> (policy, policy, sampler, reference or None)."""
    device, bf16_on_cuda = args.device, bf16 and args.device.type == "cuda"
    with torch.device("meta"):
        skeleton = adapted(args, Transformer(model_config))
    sampler = copy.deepcopy(skeleton)  # (on the meta device until rank 0's whole copy is gone)
    frozen = config.needs_reference(args) and args.ref == "frozen"
    reference = copy.deepcopy(skeleton) if frozen else None

    def read_whole():  # rank 0: the whole model on the host, LoRA's adapters drawn as without FSDP
        whole = load_model(args.model, dtype=torch.float32, device="cpu")[0]
        return add_lora(whole, rank=args.lora_rank, alpha=args.lora_alpha) if args.lora_rank else whole
    policy = sharding.load_sharded(skeleton, read_whole, device, bf16_on_cuda)
    if reference is not None:  # the same shards, copied rank by rank
        reference = sharding.shard(reference, bf16_on_cuda).to_empty(device=device)
        with torch.no_grad():
            for r, p in zip(reference.parameters(), policy.parameters()):
                r.copy_(p)
        reference.eval().requires_grad_(False)
    sampler = sampler.to_empty(device=device).to(torch.bfloat16 if bf16 else torch.float32).eval()
    sampler.tie_weights()  # (to_empty gives the tied embedding and head separate tensors)
    sharding.copy_trainable(sampler, policy, frozen_too=True)
    return policy, policy, sampler, reference


def claim_run_directory(args):
    """Rank 0's hold on the run directory (runs.lock), so that no second process writes it; a new
    run's directory is created in the same step as the check that it is new. -> the lock"""
    try:
        if not args.resume:
            runs.create(args.out)
        return runs.lock(args.out)
    except runs.RunError as error:
        sys.exit(f"train.py: {error}")


def load_data(args, tokenizer, context):
    """-> (training source: ArithmeticTask or records, held-out records or None), all checked.
    A prompt must leave room for --max-new-tokens in the model's context and, for training, in
    --micro-batch-tokens where given (so that every row fits a micro-batch alone)."""
    room, within = context, f"the model's context of {context}"
    if 0 < args.micro_batch_tokens < context:
        room, within = args.micro_batch_tokens, f"--micro-batch-tokens {args.micro_batch_tokens}"
    max_prompt, max_train_prompt = context - args.max_new_tokens, room - args.max_new_tokens
    if max_train_prompt < 1:
        raise data.DataError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt "
                             f"in {within}")
    heldout = None
    if str(args.data).startswith(("arithmetic", "memory", "countdown")):
        task = {"memory": episodes.MemoryTask, "countdown": countdown.CountdownTask}.get(
            str(args.data).split(":")[0], data.ArithmeticTask)
        source = task.from_spec(args.data)
        if args.eval_data is None:
            heldout = source.heldout(args.eval_limit)
    elif args.algo == "sft":  # prompts with the completions to learn, each fitting a row whole
        source = sft.load_examples(args.data, args.template, tokenizer, stop_token_ids(tokenizer), room)
    else:
        source = data.load_records(args.data, tokenizer=tokenizer, template=args.template,
                                   max_prompt_tokens=max_train_prompt,
                                   limit_from=f"{within} less --max-new-tokens {args.max_new_tokens}")
    if args.eval_data:
        heldout = data.load_records(args.eval_data, split="test", limit=args.eval_limit,
                                    tokenizer=tokenizer, template=args.template,
                                    max_prompt_tokens=max_prompt)
    tools = config.tool_names(args)
    for records, limit in [(source, max_train_prompt), (heldout, max_prompt)] if tools else []:
        if isinstance(records, list):  # the first prompt says how to call each tool: it must fit
            data.validate_records([episodes.with_tools(r, tools) for r in records], args.data,
                                  tokenizer, limit, args.template, f"with --tools {args.tools}")
    return source, heldout


def describe(run):
    """What this run is, in a few lines (every flag is in config.json)."""
    args = run.args
    params = sum(p.numel() for p in run.policy.parameters()) / 1e6
    precision = "bf16 rollouts and autocast updates, fp32 weights" if run.bf16 else "float32"
    cpu = " with the CPU defaults" if args.model is None and args.preset in config.CPU_PRESETS else ""
    surrogate = f"SAPO gate {args.sapo_tau_pos}/{args.sapo_tau_neg}" if args.objective == "sapo" else \
        ("" if args.objective == "clip" else args.objective.upper() + " ") + f"clip {args.eps_low}/{args.eps_high}"
    method = {"pg": f"{args.algo} {args.adv_estimator}, {args.loss_agg}, {surrogate}",
              "dpo": f"DPO ({args.dpo_pairs} pairs), beta {args.dpo_beta}",
              "sft": "SFT, the completions' mean negative log-likelihood"}[args.algo]
    if args.teacher:
        method += (f", teacher {args.teacher} x {args.teacher_coef:g} (verifier's advantage x "
                   f"{args.verifier_coef:g})")
    return "\n".join([
        f"model     {args.model or 'bundled SmolLM2-135M-Instruct'}: {params:.0f}M parameters, "
        f"{precision}" + (f", LoRA rank {args.lora_rank}" if args.lora_rank else "")
        + (f", base in {args.quantize.upper()}" if args.quantize != "none" else "")
        + (", update's blocks compiled" if run.policy.compiled_layers else "")
        + (", activations recomputed in backward" if run.policy.gradient_checkpointing else ""),
        f"data      {args.data} (template {args.template}), held-out: "
        f"{len(run.heldout) if run.heldout else 'none'}" + (f", tools: {args.tools}" if args.tools else ""),
        f"reward    {answer_format(run)}",
        f"method    preset {args.preset}{cpu}: {method}, dynamic sampling "
        f"{'on' if args.dynamic_sampling else 'off'}",
        (f"each step {args.prompts_per_step} examples" if args.algo == "sft" else
         f"each step {args.prompts_per_step} prompts x {args.samples} samples of <= {args.max_new_tokens} tokens")
        + f", up to {args.mini_batches} update(s), lr {args.lr:g} ({args.lr_schedule})",
        f"length    {args.steps} steps" + (f" or {args.time_limit:g} training minutes" if args.time_limit else ""),
        f"run       {args.out} (every flag: config.json)"])


def answer_format(run):
    """What the reward reads in a reply, in words (the header; metrics.Watch's warnings)."""
    args = run.args
    if args.reward:
        return f"what {args.reward} scores (your function)"
    if run.reward_function is countdown.reward:
        return 'an "Answer: <expression>" line on the given numbers (tasks/countdown.py)'
    return ('an "Answer: X" line or a \\boxed{X} with the right answer (tasks/verify.py)'
            + (f", in the {args.format_reward} format" if args.format_reward != "none" else ""))


def logged_rows(run):
    """metrics.jsonl's rows so far (on a --resume, those up to the checkpoint)."""
    return runs.read_lines(os.path.join(run.args.out, "metrics.jsonl"))


def open_run_directory(run, progress):
    """config.json (on resume too: the flags given then, e.g. more --steps, hold for the next
    resume); on resume, the log lines written after the checkpoint go (the steps after it run
    again), the step-0 evaluation too if no checkpoint was written yet."""
    args = run.args
    runs.write_config(args.out, {k: v for k, v in vars(args).items()
                                 if k not in ("device", "resume", "bench")})
    runs.trim_log(os.path.join(args.out, "metrics.jsonl"), progress.step)
    runs.trim_log(os.path.join(args.out, "samples.jsonl"), progress.step)
    runs.trim_log(os.path.join(args.out, "eval.jsonl"), progress.step if progress.step else -1)


def open_tracking(run, progress):
    """--report-to's backends for rank 0 (on resume, from the step after the checkpoint). One that
    cannot start (no network, a login refused) ends the run in one line before any step; a new
    run's directory, which holds nothing trained yet, goes with it, so the same command starts
    afresh."""
    args = run.args
    try:
        return tracking.Tracker(tracking.parse_report_to(args.report_to), args.out,
                                {k: v for k, v in vars(args).items() if k not in ("device", "bench")},
                                rerun_from=(progress.step + 1 if progress.step else 0) if args.resume else None)
    except Exception as error:  # (wandb's errors are its own classes)
        if not args.resume:
            shutil.rmtree(args.out, ignore_errors=True)
        after = f"python train.py --resume {args.out} goes on" if args.resume else \
            f"{args.out} was removed (nothing was trained): the same command starts afresh"
        sys.exit(f"train.py: --report-to {args.report_to} could not start ({runs.first_line(error)}); {after}; "
                 "WANDB_MODE=offline logs without a network")


def refresh_sampler(run):
    if run.sampler is not run.policy:
        sharding.copy_trainable(run.sampler, run.policy)


# ---- checkpoints ---------------------------------------------------------------------------------

def save_checkpoint(run, progress):
    """checkpoint.pt, written whole before it replaces the last one, which stays as
    checkpoint-previous.pt. Each rank's own state (RNGs, data position, carried groups) is
    gathered; rank 0 writes."""
    per_rank = gather({"rng": runs.rng_state(), "variant_rng": run.variant_rng.getstate(),
                       "data": run.stream.state_dict(),
                       "carry": dataclasses.asdict(progress.carry) if progress.carry else None},
                      run.world)
    weights = {"model": run.policy.state_dict(), "optimizer": run.optimizer.state_dict()} \
        if not run.args.fsdp else {"shards": sharding.save_shards(run.args.out, progress.step,
                                                                  run.policy, run.optimizer)}
    if run.rank == 0:
        try:
            runs.save_checkpoint(run.args.out, {
                **weights, "per_rank": per_rank, "progress": {
                    f.name: getattr(progress, f.name) for f in dataclasses.fields(progress)
                    if f.name != "carry"}})
        except runs.RunError as error:  # a full disk: said in a line, the last checkpoint whole
            sys.exit(f"train.py: {error}")
        if run.args.fsdp:
            sharding.drop_shards(run.args.out, keep=runs.checkpoint_values(run.args.out, "shards"))


def load_checkpoint(run):
    """The run's state at its last checkpoint -> (Progress, this rank's carried groups as the
    fields of a Rollouts, or None); a fresh Progress if there is no checkpoint yet."""
    try:
        state = runs.load_checkpoint(run.args.out)
    except runs.RunError as error:
        sys.exit(f"train.py: --resume: {error}")
    if state is None:  # killed before its first checkpoint: start over
        return Progress(), None
    if "progress" not in state:
        sys.exit(f"train.py: --resume: {run.args.out} was written by an older train.py; start anew")
    if ("shards" in state) != run.args.fsdp:
        sys.exit(f"train.py: --resume: {run.args.out} was written "
                 f"{'with' if 'shards' in state else 'without'} --fsdp; resume it the same way")
    if run.args.fsdp:
        sharding.load_shards(run.args.out, state["shards"], run.policy, run.optimizer)
    else:
        run.policy.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
    # A run resumed on more ranks than it had: new ranks take rank 0's data position and RNGs,
    # no carried groups, and their own fresh variant RNG (on fewer ranks, the missing ranks'
    # carried groups are dropped: they were surplus).
    per_rank = state["per_rank"]
    mine = per_rank[run.rank] if run.rank < len(per_rank) else \
        {**per_rank[0], "carry": None, "variant_rng": None}
    runs.set_rng_state(mine["rng"])
    run.stream.load_state_dict(mine["data"])
    if mine["variant_rng"] is not None:
        run.variant_rng.setstate(runs.as_random_state(mine["variant_rng"]))
    refresh_sampler(run)
    # (A checkpoint from before trained_steps was kept: its schedule counted every step.)
    return Progress(**{"trained_steps": state["progress"]["step"], **state["progress"]}), mine["carry"]


# ---- held-out evaluation and the end of a run ----------------------------------------------------



def log_step(run, progress, row, examples, bar, watch):
    """Rank 0 after a step: its row into metrics.jsonl (with the warnings of a silent run it
    completes, also said on the console), a few completions into samples.jsonl, the progress
    bar."""
    args, said = run.args, watch.check(row, examples)
    if said:
        row = {**row, "warnings": said}
        for text in said:
            bar.write(f"warning: {text}", file=sys.stderr)
    runs.append_log(run.args.out, "metrics.jsonl", row)
    for line in examples:
        runs.append_log(run.args.out, "samples.jsonl", line)
    run.tracker.log(row, row["step"])
    run.tracker.log_samples(examples, row["step"])
    bar.update(1)
    limit = f"/{args.time_limit:g}" if args.time_limit else ""
    now = f"loss {row['loss']:.3f}" if args.algo == "sft" else \
        f"acc {row['accuracy']:.2f} kept {row['groups_kept']}/{row['groups_sampled']} len {row['response_length']:.0f}"
    bar.set_postfix_str(f"{now} | {progress.train_seconds / 60:.1f}{limit} min")


def print_seconds(step, row):
    """train.py --bench: where a step's time went."""
    peak = ""  # (an SFT step logs none)
    if "peak_memory_mib_rollout" in row:
        peak = (f", peak {row['peak_memory_mib_rollout'] / 1024:.2f} GiB in the rollout, "
                f"{row['peak_memory_mib'] / 1024:.2f} GiB in the step")
    elif "peak_memory_mib" in row:
        peak = f", peak {row['peak_memory_mib'] / 1024:.2f} GiB"
    parts = [f"{name} {row['seconds_' + key]:.{digits}f} s" for key, name, digits in PARTS
             if "seconds_" + key in row]  # (an SFT step has its update alone)
    print(f"step {step}: {', '.join(parts)}" + peak, flush=True)


PARTS = [("rollout", "rollout", 1), ("scoring", "scoring", 1), ("update", "update", 1),
         ("refresh", "sampler refresh", 2)]


def finish(run, progress):
    """The held-out accuracy at the end (unless just measured), final/ (the trained weights), and
    a summary line. Every rank calls it (under FSDP they gather the weights together); rank 0
    writes."""
    args, evals = run.args, []
    if run.heldout:  # rank 0 reads what was measured; every rank evaluates its share if due
        evals = runs.read_lines(os.path.join(args.out, "eval.jsonl")) if run.rank == 0 else []
        if gather(not evals or evals[-1]["step"] != progress.step, run.world)[0]:
            evals.append({"step": progress.step, **evaluation.evaluate_and_log(run, progress)})
    final = sharding.gathered_model(run.policy, run.sampler, keep=run.rank == 0) \
        if run.args.fsdp else run.policy
    if run.rank != 0:
        return
    try:
        save_model(final, run.tokenizer, os.path.join(args.out, "final"))
    except (OSError, SafetensorError) as error:  # a full disk: final/ is written aside, renamed
        reason = getattr(error, "strerror", None) or str(error).splitlines()[0]
        sys.exit(f"train.py: {args.out}/final: could not write the model ({reason}); the checkpoint "
                 f"is whole: free some space and run python train.py --resume {args.out}")
    summary = {"out": args.out, "steps": progress.step, "updates": progress.updates,
               "train_minutes": round(progress.train_seconds / 60, 2),
               "skipped_updates": progress.skipped_updates}
    if evals:
        summary.update(heldout_before=evals[0]["pass@1"], heldout_after=evals[-1]["pass@1"])
    print(json.dumps(summary), flush=True)


def peak_memory_mib(args):
    """This step's peak of allocated GPU memory, or on the CPU the process's peak resident set
    so far (the system keeps no per-step peak there), in MiB."""
    if args.device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def row_advantage(advantage):
    """A row's advantage for the log: its own, or its tokens' mean (REINFORCE++)."""
    if isinstance(advantage, list):
        return sum(advantage) / len(advantage) if advantage else 0.0
    return advantage


def sample_lines(run, batch, step):
    """A few of the step's completions with their rewards and advantages, for samples.jsonl:
    what the model actually says as it learns. (When every group was dropped, the first round's,
    whose advantages are all 0.)"""
    starts = batch.group_starts()
    lines = []
    for i in range(min(run.args.log_samples, len(batch.tokens))):
        group = max(g for g, start in enumerate(starts) if start <= i)
        lines.append({"step": step, "turn": batch.turn[i] if batch.turn else 0,
                      "prompt": batch.records[group]["prompt"],
                      "answer": batch.records[group]["answer"],
                      "completion": run.tokenizer.decode(batch.tokens[i], skip_special_tokens=True),
                      "reward": batch.rewards[i],
                      "advantage": row_advantage(batch.advantages[i]) if batch.advantages else 0.0,
                      "truncated": batch.truncated[i], **batch.reward_parts[i]})
    return lines
