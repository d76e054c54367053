"""train.py's command line: its flags, how presets and a resumed run's config.json merge with
them, and the checks every value passes before any work starts.

    python train.py --help                  # every flag, grouped, with its default
    python train.py --preset grpo --lr 2e-6 # a preset from dapo.PRESETS, one flag overridden

Precedence: argparse defaults < the preset (`--preset`, default dapo; with no --model also
CPU_DEFAULTS) < explicit flags. On --resume: the run's config.json < explicit flags.
"""

import argparse
import math
import os
import shutil
import sys

import dapo
import data
import losses
import rewards
from engine.paged import EngineOptions
from engine.speedups import SpeedUps
from rollout import Sampling
from run import runs, tracking
from tasks import tools
from variants import objectives

# The offline default: the `dapo` preset scaled to a 2-core CPU and a 135M model. What differs from
# the paper's run, and why:
CPU_DEFAULTS = {
    "lr": 1e-5,            # 1e-6 is tuned for 7B-32B models and ~10k updates; 135M needs larger
    "warmup_steps": 2,     # a 20-step warm-up would be most of a 20-minute run
    "steps": 45,           # ~15 minutes of training on 2 cores (the time limit is a safety net)
    "lr_schedule": "cosine",  # at a constant 1e-5 held-out accuracy peaked at ~11 minutes and
                              # then drifted down (81% -> 68%); decaying the rate holds the gain
    "mini_batches": 4,     # clip-higher acts only with several updates a step; of 1, 2 and 4,
                           # 4 ended highest in the fewest minutes (MEASUREMENTS.md, "The default
                           # run"); the paper's 16 would be mini-batches of 4 samples
    "overlong_cache": 0.25,  # 16 of the 64-token budget (DAPO: 4,096 of 20,480, a fifth)
    "max_refills": 0,      # a refill is another whole rollout round; on a CPU it is cheaper to
                           # train on the informative groups found (fewer updates with fewer):
                           # refills gained per step, not per minute (MEASUREMENTS.md, "Tuning
                           # the default")
    "temperature": 0.8,    # at 1.0 this model is right ~3x less often than greedy: most groups
                           # would be all wrong and carry no signal
}

# The supervised warm start on the same CPU: a step is one batch of --prompts-per-step examples
# and one update (no rollout: a step takes a fraction of a second), at the RL run's rate.
CPU_SFT = {"lr": 1e-5, "warmup_steps": 2, "steps": 45, "lr_schedule": "cosine"}
CPU_PRESETS = ("dapo", "dapo-memory", "opd", "sft")  # without --model: the CPU's settings


def build_parser():
    """train.py's command line: one argument group per concern, every flag with its help."""
    p = argparse.ArgumentParser(prog="train.py", description="DAPO and relatives on math problems.",
                                usage="%(prog)s [--preset NAME] [--model M] [--data D] [FLAG ...] "
                                      "(all flags: --help)",
                                allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    run_flags(p.add_argument_group("run"))
    model_flags(p.add_argument_group("model"))
    data_flags(p.add_argument_group("data"))
    sampling_flags(p.add_argument_group("sampling"))
    reward_flags(p.add_argument_group("reward"))
    algorithm_flags(p.add_argument_group("algorithm"))
    optimisation_flags(p.add_argument_group("optimisation"))
    return p


def run_flags(g):
    g.add_argument("--preset", default="dapo", choices=sorted(dapo.PRESETS),
                   help="named flag set from dapo.PRESETS; explicit flags override it")
    g.add_argument("--out", default=None, help="run directory (never overwritten); default runs/<time>")
    g.add_argument("--resume", default=None, help="continue the run in this directory")
    g.add_argument("--seed", type=int, default=0, help="seed for data, sampling and init")
    g.add_argument("--steps", type=int, default=1000,
                   help="training steps: one rollout batch (refills included), then its updates")
    g.add_argument("--time-limit", type=float, default=None,
                   help="minutes of training (evaluation excluded); 0 = no limit (default: 20 on a "
                        "CPU, the offline default run's size; none on CUDA)")
    g.add_argument("--bench", action="store_true", help="time a few steps and exit")
    g.add_argument("--plan-only", type=float, nargs="?", const=0.0, default=None, metavar="GIB",
                   help="print the memory plan a rank (memory_plan.py: from config.json and the "
                        "flags, no weight read) and stop; GIB plans for a GPU of that size (default: "
                        "this machine's GPU, if any); the ranks are WORLD_SIZE's")
    g.add_argument("--no-memory-check", action="store_true",
                   help="start on a GPU even where the memory plan does not fit it")
    g.add_argument("--checkpoint-minutes", type=float, default=None,
                   help="minutes between checkpoints, 0 = not by time (one is also written at the "
                        "end; default: 5 on a CPU, 0 on CUDA, where a step takes minutes and a "
                        "checkpoint of a 1.5B model is 18.5 GB)")
    g.add_argument("--checkpoint-every", type=int, default=None,
                   help="also checkpoint every N steps, 0 = not by steps (default: 0 on a CPU, 10 "
                        "on CUDA)")
    g.add_argument("--log-samples", type=int, default=4,
                   help="completions written to samples.jsonl each step, with their rewards")
    g.add_argument("--report-to", default="none",
                   help="also log to tensorboard and/or wandb (comma-separated; wandb offline with "
                        "WANDB_MODE=offline), e.g. tensorboard,wandb; default none")
    g.add_argument("--label", default=None,
                   help="this run's name in comparisons, python run/runs.py (default: its preset)")

def model_flags(g):
    g.add_argument("--model", default=None,
                   help="checkpoint dir, .gguf file or hub id; default the bundled SmolLM2-135M-Instruct")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="bfloat16: rollouts from a bf16 copy, updates under autocast with fp32 "
                        "master weights (auto: bf16 on CUDA and on CPUs with native bf16)")
    g.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0 = full fine-tuning)")
    g.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA alpha")
    g.add_argument("--activation-checkpointing", nargs="?", const="on", default="auto",
                   choices=["auto", "on", "off"],
                   help="recompute each block in backward: a block's input kept, not its insides, "
                        "for one more forward (auto: on CUDA for models of 1B parameters or more)")
    g.add_argument("--quantize", default="none", choices=["none", "nf4"],
                   help="nf4: the frozen base of --lora-rank's adapters in 4-bit NormalFloat "
                        "(QLoRA); see the README")
    g.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard weights, gradients and AdamW state over the ranks "
                        "(FSDP2) instead of a full copy on each (DDP); see the README")
    g.add_argument("--teacher", default=None,
                   help="on-policy distillation (variants/distill.py): a model of the same tokenizer "
                        "(anything --model takes) whose log-probs of the student's tokens give each "
                        "token an advantage, log pi_teacher - log pi_student")
    g.add_argument("--teacher-coef", type=float, default=1.0,
                   help="--teacher: the weight of the teacher's term in each token's advantage")
    g.add_argument("--verifier-coef", type=float, default=1.0,
                   help="--teacher: the weight of the verifier's advantage beside it (0: the "
                        "teacher's alone, the opd preset)")
    g.add_argument("--ref", default="frozen", choices=["frozen", "lora-off"],
                   help="reference policy for KL/GKL/DPO: a frozen copy, or the LoRA base")
    g.add_argument("--router-aux-coef", type=float, default=0.0,
                   help="MoE: weight of the router's load-balancing loss (Switch Transformer, "
                        "as transformers computes it); 0 = off (it is still logged)")
    g.add_argument("--routing-replay", action=argparse.BooleanOptionalAction, default=False,
                   help="MoE: the update sends each token to the experts the sampler chose, so "
                        "the importance ratio compares one network, not two routings")

def data_flags(g):
    g.add_argument("--data", default="arithmetic",
                   help="gsm8k, math500, aime24, dapo-math-17k, arithmetic[:key=value,...], "
                        "memory[:key=value,...] (episodes.py) or a "
                        ".jsonl/.json/.parquet file")
    g.add_argument("--template", default=None, choices=list(data.TEMPLATES),
                   help="prompt template (default: none, the bare question, for arithmetic, "
                        "countdown and memory; dapo otherwise; no-system: none without the chat "
                        "template's default system turn)")
    g.add_argument("--eval-data", default=None,
                   help="held-out data (default: the arithmetic held-out split, or none)")
    g.add_argument("--eval-limit", type=int, default=200, help="held-out problems per evaluation")
    g.add_argument("--eval-every", type=int, default=5, help="steps between held-out "
                   "evaluations (0 = before and after only)")
    g.add_argument("--eval-samples", type=int, default=0,
                   help="also avg@k of this many samples per held-out problem (0 = greedy only)")
    g.add_argument("--eval-temperature", type=float, default=1.0, help="temperature of avg@k")
    g.add_argument("--eval-top-p", type=float, default=0.7, help="top-p of avg@k (DAPO: 0.7)")
    g.add_argument("--curriculum", type=float, default=0.75,
                   help="arithmetic: raise the difficulty when the training accuracy (moving "
                        "average) passes this (0 = never)")

def sampling_flags(g):
    g.add_argument("--prompts-per-step", type=int, default=8, help="prompts per step, all ranks")
    g.add_argument("--samples", type=int, default=8, help="G: completions per prompt")
    g.add_argument("--max-new-tokens", type=int, default=64, help="completion budget (L_max)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    g.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                   help="torch.compile the update's blocks and the sampler's decode step (auto: "
                        "the blocks on CUDA, and on a CPU where a C++ compiler is found, the decode "
                        "step eager: its compile outlasts what it saves in a run, on an H100 too; "
                        "on: both; off: all eager, the readable reference; a Mixture-of-Experts "
                        "model stays eager)")
    g.add_argument("--kv-budget", type=float, default=0.0,
                   help="GiB of KV-cache blocks the sampler may hold (0: every row at its longest, "
                        "within 90%% of a GPU's memory free when a rollout starts, or half a CPU "
                        "host's); rows beyond "
                        "it wait or are preempted and recomputed, the samples unchanged")
    g.add_argument("--max-rows", type=int, default=0,
                   help="most rows the sampler runs at once (0: all of a rank's rows)")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay the sampler's decode steps as CUDA graphs, one per bucket of rows "
                        "and blocks (cuda_graphs.py; default: on a GPU, unless an MoE, "
                        "--routing-replay, --compile on or --quantize nf4)")
    g.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=False,
                   help="DAPO eq. 11: drop groups whose answers are all right or all wrong, refill")
    g.add_argument("--max-refills", type=int, default=10, help="extra rollout rounds per step")
    g.add_argument("--keep-surplus", action=argparse.BooleanOptionalAction, default=False,
                   help="carry surplus informative groups into the next step, trained off-policy "
                        "(their sampler's log-probs are the old ones)")
    g.add_argument("--adversarial", action=argparse.BooleanOptionalAction, default=False,
                   help="re-ask signal-less prompts as harder / hinted variants")
    g.add_argument("--adaptive-budget", action=argparse.BooleanOptionalAction, default=False,
                   help="more samples for prompts near 50%% accuracy, same total")

def reward_flags(g):
    g.add_argument("--tools", default="", metavar="NAMES",
                   help="tools the model may call in an episode, comma-separated: calculator "
                        "(<calc>...</calc>), python (<python>...</python>, sandboxed); their "
                        "output is never trained on (tools.py)")
    g.add_argument("--unsandboxed-python", action="store_true",
                   help="let --tools python run where bubblewrap cannot isolate it: the model's "
                        "code can then read your files and this process's environment")
    g.add_argument("--reward", default="", metavar="FILE.py:FUNCTION",
                   help="your own reward in place of the rule reward: function(reply, row) -> "
                        "float or (float, {part: float}), row the data row with all its fields; "
                        "also MODULE:FUNCTION (README: your own task)")
    g.add_argument("--reward-timeout", type=float, default=rewards.TIME_LIMIT, metavar="SECONDS",
                   help="--reward's time limit a call: a reply not scored by then scores as wrong, "
                        "counted in reward_error (0: none)")
    g.add_argument("--correct-reward", type=float, default=1.0,
                   help="reward of a right answer (with --reward: the score that counts as right)")
    g.add_argument("--wrong-reward", type=float, default=-1.0, help="reward of a wrong answer")
    g.add_argument("--format-reward", default="none", choices=["none", *rewards.FORMAT_STYLES],
                   help="add --format-weight for this format (xml: the GSM8K recipe's terms)")
    g.add_argument("--format-weight", type=float, default=0.5, help="weight of the format terms")
    g.add_argument("--overlong-penalty", action=argparse.BooleanOptionalAction, default=False,
                   help="DAPO eq. 13 soft overlong punishment")
    g.add_argument("--overlong-cache", type=float, default=0.2,
                   help="L_cache of eq. 13: a fraction of --max-new-tokens if < 1, else tokens")
    g.add_argument("--overlong-filter", action=argparse.BooleanOptionalAction, default=False,
                   help="truncated completions get zero loss weight")
    g.add_argument("--ppl-penalty", default="off", choices=["off", "replace", "beside"],
                   help="soft perplexity penalty in place of the overlong punishment (which "
                        "it turns off), or beside it (which it turns on)")
    g.add_argument("--ppl-threshold", type=float, default=math.log(4.0), help="mean NLL (nats)")
    g.add_argument("--ppl-window", type=float, default=math.log(4.0), help="mean NLL window")
    g.add_argument("--efficiency-weight", type=float, default=0.0,
                   help="balanced reasoning: bonus for short correct answers")

def correction_flags(g):
    """The rollout correction: weights for the sampler-trainer gap, their batch mean, rejection."""
    g.add_argument("--tis-cap", type=float, default=0.0,
                   help="rollout correction: weight tokens by min(pi_old / pi_sampler, C) "
                        "(0 = off; README: the objectives)")
    g.add_argument("--tis-level", default="token", choices=["token", "sequence"],
                   help="rollout correction: a ratio per token, or one per sequence (their product)")
    g.add_argument("--tis-mode", default="truncate", choices=["truncate", "mask"],
                   help="rollout correction: cut the ratio at C (TIS), or mask tokens whose ratio "
                        "is outside [--tis-floor, C] (MIS, IcePop)")
    g.add_argument("--tis-floor", type=float, default=0.0,
                   help="rollout correction, --tis-mode mask: the lower bound of the kept ratios")
    g.add_argument("--tis-normalize", action="store_true",
                   help="rollout correction: divide the weights by their mean over the step's "
                        "loss tokens (replies, at --tis-level sequence) on all ranks, so that "
                        "they average 1 (verl's rollout_is_batch_normalize)")
    g.add_argument("--tis-reject", default="", metavar="RULE",
                   help="rollout correction by rejection (verl's rollout_rs): take out of the loss "
                        "the tokens (token_kN) or replies (seq_sum_kN, seq_mean_kN, seq_max_kN) "
                        "whose divergence k1, k2 or k3 between pi_old and the sampler passes "
                        "--tis-reject-bound ('' = off)")
    g.add_argument("--tis-reject-bound", type=float, default=0.0,
                   help="--tis-reject's bound U: k2, k3 kept while <= U; k1: ratios in [1/U, U]")


def algorithm_flags(g):
    g.add_argument("--algo", default="pg", choices=["pg", "dpo", "sft"],
                   help="policy gradient, DPO, or supervised fine-tuning on the data's completions "
                        "(variants/sft.py)")
    g.add_argument("--adv-estimator", default="grpo", choices=list(dapo.ADVANTAGE_ESTIMATORS),
                   help="advantage estimator (reinforce_pp: REINFORCE++, one per token)")
    g.add_argument("--gamma", type=float, default=1.0,
                   help="reinforce_pp: the discount of its token returns, in (0, 1] (1: summed to "
                        "the end, the paper's; verl's algorithm.gamma)")
    g.add_argument("--reward-kl-coef", type=float, default=1e-4,
                   help="REINFORCE++: beta of the KL to the reference in each token's reward")
    g.add_argument("--loss-agg", default="token-mean", choices=list(losses.AGGREGATIONS),
                   help="loss aggregation")
    g.add_argument("--objective", default="clip", choices=list(objectives.OBJECTIVES),
                   help="the policy-gradient surrogate: DAPO's clipped ratio, or GSPO, CISPO, "
                        "GMPO, SAPO; --preset NAME sets its paper's clip range and aggregation "
                        "too (README: the objectives)")
    g.add_argument("--eps-low", type=float, default=0.2,
                   help="lower clip range (GMPO: in log space; CISPO: 1 = no lower bound)")
    g.add_argument("--eps-high", type=float, default=0.28,
                   help="upper clip range (clip-higher; GMPO: in log space)")
    g.add_argument("--clip-c", type=float, default=None, help="dual-clip constant (None = off)")
    g.add_argument("--sapo-tau-pos", type=float, default=1.0,
                   help="SAPO: the gate's temperature where the advantage is positive")
    g.add_argument("--sapo-tau-neg", type=float, default=1.05,
                   help="SAPO: the gate's temperature where it is not")
    correction_flags(g)
    g.add_argument("--high-entropy-fraction", type=float, default=1.0,
                   help="the 80/20 rule: the policy gradient only on this top fraction of the "
                        "mini-batch's tokens by entropy (1 = every token; the paper: 0.2)")
    g.add_argument("--cov-fraction", type=float, default=2e-4,
                   help="Clip-Cov / KL-Cov: the fraction of the mini-batch's tokens chosen by "
                        "the covariance of log-prob and advantage")
    g.add_argument("--clip-cov-low", type=float, default=1.0, help="Clip-Cov: covariance floor")
    g.add_argument("--clip-cov-high", type=float, default=5.0, help="Clip-Cov: covariance ceiling")
    g.add_argument("--kl-cov-coef", type=float, default=1.0,
                   help="KL-Cov: the weight of |log pi - log pi_old| on the chosen tokens")
    g.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus")
    g.add_argument("--kl", default="none", choices=["none", "k1", "k2", "k3", "gkl"],
                   help="regulariser toward the reference")
    g.add_argument("--kl-coef", type=float, default=0.0, help="its weight")
    g.add_argument("--gkl-alpha", type=float, default=1.0, help="GKL: weight of the KL part")
    g.add_argument("--gkl-beta", type=float, default=1.0, help="GKL: weight of the wMSE part")
    g.add_argument("--gkl-gamma", type=float, default=1.0, help="GKL: weight smoothing power")
    g.add_argument("--gkl-temperature", type=float, default=1.0, help="GKL: KL temperature")
    g.add_argument("--gkl-weight-temperature", type=float, default=1.0,
                   help="GKL: weight temperature")
    g.add_argument("--dpo-beta", type=float, default=0.1, help="DPO beta")
    g.add_argument("--dpo-pairs", default="full", choices=["full", "step"],
                   help="DPO on whole completions, or Step-DPO on the first differing line")

def optimisation_flags(g):
    g.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    g.add_argument("--warmup-steps", type=int, default=20, help="linear warm-up, in training steps")
    g.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine"],
                   help="after warm-up: constant (DAPO), or cosine decay to 10%% at --steps")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm")
    g.add_argument("--mini-batches", type=int, default=1,
                   help="mu: a full batch's optimizer updates per step (the paper: 16), each on "
                        "1/mu of it; a batch short of groups makes fewer; 1 = on-policy, ratio 1")
    g.add_argument("--micro-batch-size", type=int, default=16, help="sequences per backward pass")
    g.add_argument("--micro-batch-tokens", type=int, default=0,
                   help="also at most this many padded positions (rows x the longest prompt + the "
                        "longest reply among them) per forward of the update and the scoring "
                        "passes, longest rows first; prompts longer than it less --max-new-tokens "
                        "are refused at load (0: rows only)")


def parse_config(argv=None):
    """Defaults < preset < explicit flags; on --resume, the run's config.json < explicit flags.
    Without any flag: the CPU-scaled dapo preset. Every value is checked before any work."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    explicit = {a.dest for a in parser._actions for opt in a.option_strings
                if any(x == opt or x.startswith(opt + "=") for x in argv)}
    if args.resume:
        if "preset" in explicit:
            parser.error("--preset with --resume: a resumed run keeps its own flags (config.json); "
                         "change single flags instead")
        saved = read_saved_config(args.resume, parser)
        refuse_changed_model(args, explicit, saved, parser)
    else:
        saved = dict(dapo.PRESETS[args.preset])
        if args.model is None and args.preset in CPU_PRESETS:
            saved.update(CPU_DEFAULTS if args.preset != "sft" else CPU_SFT)  # the offline runs
    for key, value in saved.items():
        if key not in explicit:
            setattr(args, key, value)
    if args.objective != "clip" and "clip_c" not in explicit:
        args.clip_c = None  # a preset's dual-clip belongs to the clipped ratio it replaces
    if args.ppl_penalty != "off":  # in place of the overlong punishment, or beside it
        beside = args.ppl_penalty == "beside"
        if "overlong_penalty" in explicit and args.overlong_penalty != beside:
            parser.error(f"--ppl-penalty {args.ppl_penalty} turns the overlong penalty "
                         f"{'on' if beside else 'off'}; leave --overlong-penalty out")
        args.overlong_penalty = beside
    refuse_inert_flags(args, explicit, parser)
    check_config(args, parser)
    return args, explicit


# What only a step that samples and scores acts on: an SFT step reads neither (it learns given
# completions), so any of these given with --algo sft is refused rather than ignored.
# (--correct-reward is not among them: it is the held-out judge's threshold for a --reward's score.)
RL_ONLY = ("samples", "temperature", "top_p", "kl", "kl_coef", "ref", "eps_low", "eps_high", "clip_c",
           "objective", "adv_estimator", "loss_agg", "dynamic_sampling", "max_refills", "keep_surplus",
           "adversarial", "curriculum", "adaptive_budget", "overlong_penalty", "overlong_filter",
           "overlong_cache", "ppl_penalty", "ppl_threshold", "ppl_window", "format_reward",
           "format_weight", "efficiency_weight", "wrong_reward", "tis_cap", "tis_reject", "tis_level",
           "tis_mode", "tis_floor", "tis_normalize", "high_entropy_fraction", "entropy_coef",
           "router_aux_coef", "routing_replay", "dpo_beta", "dpo_pairs", "log_samples")


def refuse_inert_flags(args, explicit, parser):
    """A flag given explicitly that the rest of the configuration would ignore is refused by name."""
    for key in RL_ONLY if args.algo == "sft" else ():
        if key in explicit:
            parser.error(f"--{key.replace('_', '-')} acts in a step that samples and scores its "
                         "replies; --algo sft learns given completions (no samples, rewards or ratios)")
    acts = {"cov_fraction": ("--objective clip-cov or kl-cov", args.objective in objectives.CHOOSING),
            "clip_cov_low": ("--objective clip-cov", args.objective == "clip-cov"),
            "clip_cov_high": ("--objective clip-cov", args.objective == "clip-cov"),
            "kl_cov_coef": ("--objective kl-cov", args.objective == "kl-cov"),
            "sapo_tau_pos": ("--objective sapo", args.objective == "sapo"),
            "sapo_tau_neg": ("--objective sapo", args.objective == "sapo"),
            "reward_kl_coef": ("--adv-estimator reinforce_pp", args.adv_estimator == "reinforce_pp"),
            "gamma": ("--adv-estimator reinforce_pp", args.adv_estimator == "reinforce_pp"),
            "reward_timeout": ("--reward", bool(args.reward)),  # (a task's own reward is ours)
            "teacher_coef": ("--teacher", bool(args.teacher)),
            "verifier_coef": ("--teacher", bool(args.teacher)),
            # the clip range: the clipped objectives' (KL-Cov and SAPO have none)
            "eps_low": ("a clipped --objective", args.objective not in ("kl-cov", "sapo")),
            "eps_high": ("a clipped --objective", args.objective not in ("kl-cov", "sapo"))}
    for key, (needs, active) in acts.items():
        if key in explicit and not active:
            parser.error(f"--{key.replace('_', '-')} acts only with {needs}")


# What the checkpoint's weights are of: a resumed run cannot change them.
MODEL_FLAGS = ("model", "lora_rank", "lora_alpha", "quantize")


def refuse_changed_model(args, explicit, saved, parser):
    for key in MODEL_FLAGS:
        if key in explicit and key in saved and getattr(args, key) != saved[key]:
            flag = f"--{key.replace('_', '-')}"
            parser.error(f"{flag} {getattr(args, key)} on --resume: the run's checkpoint holds "
                         f"{flag} {saved[key]} (its config.json); start a new run to change it "
                         f"(from this one's weights: --model {args.resume}/final)")


def read_saved_config(run_dir, parser):
    try:
        saved = runs.read_config(run_dir)
    except runs.RunError as error:
        parser.error(f"--resume: {error}")
    known = {a.dest for a in parser._actions}
    return {k: v for k, v in saved.items() if k in known and k not in ("resume", "bench")}


# Every numeric flag: what it must be (checked after the preset and config.json are merged in).
POSITIVE_INTS = ["steps", "eval_limit", "prompts_per_step", "max_new_tokens", "mini_batches",
                 "micro_batch_size"]
NONNEGATIVE_INTS = ["seed", "checkpoint_every", "lora_rank", "eval_every", "max_refills", "max_rows",
                    "micro_batch_tokens",
                    "warmup_steps", "eval_samples", "log_samples"]
POSITIVE_FLOATS = ["lora_alpha", "temperature", "overlong_cache", "eval_temperature",
                   "ppl_window", "gkl_gamma", "gkl_temperature", "gkl_weight_temperature",
                   "dpo_beta", "lr", "grad_clip", "sapo_tau_pos", "sapo_tau_neg", "cov_fraction"]
NONNEGATIVE_FLOATS = ["teacher_coef", "verifier_coef", "time_limit", "checkpoint_minutes", "format_weight", "ppl_threshold", "efficiency_weight",
                      "eps_high", "entropy_coef", "kl_coef", "gkl_alpha", "gkl_beta",
                      "weight_decay", "tis_cap", "tis_floor", "tis_reject_bound", "router_aux_coef",
                      "kl_cov_coef", "reward_kl_coef", "kv_budget", "plan_only", "reward_timeout"]
OTHER_FLOATS = ["gamma", "correct_reward", "wrong_reward", "eps_low", "clip_c", "top_p", "eval_top_p",
                "curriculum", "high_entropy_fraction", "clip_cov_low", "clip_cov_high"]


def check_config(args, parser):
    """Every value, whether from a flag, a preset or a resumed run's config.json: first its type
    (and choices), then its range, then the combinations that would silently do nothing."""
    def fail(key, rule):
        parser.error(f"--{key.replace('_', '-')} must be {rule}, got {getattr(args, key)!r}")

    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if action.choices is not None and value not in action.choices and \
                not (value is None and action.default is None):  # e.g. --template: set later
            fail(action.dest, f"one of {', '.join(map(str, action.choices))}")
        if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)) \
                and not isinstance(value, bool) and not (value is None and action.default is None):
            fail(action.dest, "true or false")  # (None: auto, e.g. --cuda-graphs)
    for key in POSITIVE_INTS + NONNEGATIVE_INTS + ["samples"]:
        value, low = getattr(args, key), 0 if key in NONNEGATIVE_INTS else 1
        if value is None and key == "checkpoint_every":  # set by on_device
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            fail(key, f"an integer >= {low}")
    for key in POSITIVE_FLOATS + NONNEGATIVE_FLOATS + OTHER_FLOATS:
        value = getattr(args, key)
        if not (value is None and key in ("clip_c", "time_limit", "plan_only", "checkpoint_minutes")) and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
            fail(key, "a finite number")
    for key in POSITIVE_FLOATS:
        if getattr(args, key) <= 0:
            fail(key, "> 0")
    for key in NONNEGATIVE_FLOATS:
        if (getattr(args, key) or 0) < 0:
            fail(key, ">= 0")
    for key, ok, rule in range_rules(args):
        if not ok:
            fail(key, rule)
    try:
        tracking.parse_report_to(args.report_to)
    except ValueError as error:
        parser.error(f"--report-to {error}")
    refuse_combinations(args, parser)


def refuse_combinations(args, parser):
    """The combinations of values that would silently do nothing, or something else than asked."""
    refills = args.dynamic_sampling and args.max_refills > 0
    for key in ("adversarial", "keep_surplus"):  # both act in refill rounds only
        if getattr(args, key) and not refills:
            parser.error(f"--{key.replace('_', '-')} acts in refill rounds: it needs "
                         f"--dynamic-sampling and --max-refills >= 1 (got {args.max_refills})")
    if args.top_p < 1 and (args.tis_cap or args.tis_reject or args.keep_surplus):
        parser.error(f"--top-p {args.top_p:g} samples from a truncated distribution, while the "
                     "sampler's log-probs, which --tis-cap, --tis-reject and --keep-surplus read as "
                     "the behaviour policy's, are of the whole one: use --top-p 1 with them")
    if args.algo == "dpo" and (args.tis_cap or args.tis_reject or args.high_entropy_fraction < 1):
        parser.error("--tis-cap, --tis-reject and --high-entropy-fraction weight policy-gradient "
                     "tokens; --algo dpo has none")
    if args.high_entropy_fraction < 1 and args.objective in objectives.SEQUENCE_LEVEL:
        parser.error(f"--high-entropy-fraction chooses tokens; --objective {args.objective} gives "
                     "each token of a sequence the gradient of the whole sequence's ratio")
    if not args.tis_cap and (args.tis_level, args.tis_mode, args.tis_floor) != ("token", "truncate", 0):
        parser.error("--tis-level, --tis-mode and --tis-floor shape the rollout correction: they "
                     "need --tis-cap C > 0")
    if args.tis_normalize and not args.tis_cap:
        parser.error("--tis-normalize divides the rollout correction's weights by their mean: it "
                     "needs --tis-cap C > 0")
    check_rejection(args, parser)
    check_tools(args, parser)
    if args.cuda_graphs and (args.routing_replay or args.compile == "on" or args.quantize != "none"):
        parser.error("--cuda-graphs replays the eager decode step: not with --routing-replay "
                     "(recorded on the host), --compile on (one or the other) or --quantize nf4 "
                     "(it copies a host table each step)")
    if args.tis_floor and args.tis_mode != "mask":
        parser.error(f"--tis-floor {args.tis_floor:g} bounds the kept ratios of --tis-mode mask; "
                     "--tis-mode truncate has no floor")
    if args.objective != "clip" and (args.clip_c is not None or args.algo == "dpo"):
        parser.error(f"--objective {args.objective} replaces the clipped ratio of --algo pg: "
                     "leave --clip-c (dual-clip) unset and --algo at pg")
    if args.algo == "dpo" and str(args.data).startswith("memory"):
        parser.error("--algo dpo pairs single completions; the memory task's episodes have "
                     "several turns: use a policy-gradient preset (dapo-memory)")
    if args.adv_estimator == "reinforce_pp" and (args.objective in objectives.SEQUENCE_LEVEL
                                                 or args.algo == "dpo"):
        parser.error(f"--adv-estimator reinforce_pp gives each token its own advantage; "
                     f"{'--algo dpo' if args.algo == 'dpo' else '--objective ' + args.objective} "
                     "takes one per sequence")
    refuse_sft_and_teacher_combinations(args, parser)
    if args.ref == "lora-off" and args.lora_rank == 0 and needs_reference(args):
        parser.error("--ref lora-off needs --lora-rank > 0")
    if args.quantize != "none" and args.lora_rank == 0:
        parser.error(f"--quantize {args.quantize} freezes the base in 4 bits: it needs "
                     "--lora-rank > 0 (the adapters are what trains)")
    if args.quantize != "none" and args.fsdp:
        parser.error(f"--quantize {args.quantize} with --fsdp: FSDP shards parameters and a "
                     "quantised base is buffers; use one or the other")


def refuse_sft_and_teacher_combinations(args, parser):
    """What an SFT step cannot learn from, and what a --teacher cannot score for."""
    if args.algo == "sft" and str(args.data).startswith(("memory", "countdown")):
        parser.error(f"--algo sft learns given completions; {args.data}'s answer is not a reply to "
                     "learn (episodes in turns, an expression to find): use a file of completions")
    if not args.teacher and args.verifier_coef == 0:
        parser.error("the opd preset (--verifier-coef 0) learns from a teacher's log-probs alone: "
                     "give --teacher MODEL")
    if args.teacher and args.objective in objectives.SEQUENCE_LEVEL:
        parser.error(f"--teacher gives each token its own advantage; --objective {args.objective} "
                     "takes one per sequence")
    if args.teacher and args.algo != "pg":
        parser.error(f"--teacher scores the policy's own samples for a policy-gradient update; "
                     f"--algo {args.algo} has none: use --algo pg (the opd preset, or any pg preset)")


def needs_reference(args):
    """Whether the run compares the policy with a reference policy."""
    return args.kl != "none" or args.algo == "dpo" or (
        args.adv_estimator == "reinforce_pp" and args.reward_kl_coef > 0)


def range_rules(args):
    """(flag, holds, what it must be) for the flags whose range is not just > 0 or >= 0."""
    eps_low_top = {"gmpo": math.inf, "cispo": 1.0, "clip-cov": 1.0}.get(args.objective)  # GMPO: log space
    return [("eps_low", 0 <= args.eps_low < 1 if eps_low_top is None else 0 <= args.eps_low <= eps_low_top,
             "in [0, 1)" if eps_low_top is None else f"in [0, {eps_low_top:g}]"),
            ("clip_c", args.clip_c is None or args.clip_c > 1, "> 1 (dual-clip) or unset"),
            ("top_p", 0 < args.top_p <= 1, "in (0, 1]"),
            ("eval_top_p", 0 < args.eval_top_p <= 1, "in (0, 1]"),
            ("curriculum", 0 <= args.curriculum <= 1, "in [0, 1] (0 = off)"),
            ("tis_cap", args.tis_cap == 0 or args.tis_cap >= 1, "0 (off) or >= 1"),
            ("tis_floor", args.tis_floor <= 1, "in [0, 1]"),
            ("high_entropy_fraction", 0 < args.high_entropy_fraction <= 1, "in (0, 1] (1 = off)"),
            ("cov_fraction", args.cov_fraction <= 1, "in (0, 1]"),
            ("clip_cov_high", args.clip_cov_high > args.clip_cov_low, "> --clip-cov-low"),
            ("correct_reward", args.correct_reward > args.wrong_reward, "> --wrong-reward"),
            ("samples", args.samples >= 2, "at least 2 (a group needs two answers to compare)"),
            ("gamma", 0 < args.gamma <= 1, "in (0, 1]"),
            ("overlong_cache", args.overlong_cache < 1 or (
                args.overlong_cache == int(args.overlong_cache)
                and args.overlong_cache <= args.max_new_tokens),
             "a fraction < 1 of --max-new-tokens, or a whole number of tokens <= it"),
            ("mini_batches", args.mini_batches <= args.prompts_per_step * args.samples,
             "<= the samples of a step (--prompts-per-step x --samples)")]


def overlong_cache_tokens(args):
    """L_cache of eq. 13 in tokens: --overlong-cache as a fraction of the budget, or tokens."""
    if args.overlong_cache < 1:
        return max(1, round(args.overlong_cache * args.max_new_tokens))
    return int(args.overlong_cache)


def on_device(args, device):
    """args.device, and the defaults that depend on it: a CPU run (the offline default, sized for
    minutes) stops after 20 training minutes and checkpoints every 5; a CUDA run (hours, minutes a
    step, checkpoints of many GB) has no time limit and checkpoints every 10 steps."""
    args.device = device
    cpu = device.type == "cpu"
    if args.time_limit is None:
        args.time_limit = 20.0 if cpu else 0.0
    if args.checkpoint_minutes is None:
        args.checkpoint_minutes = 5.0 if cpu else 0.0
    if args.checkpoint_every is None:
        args.checkpoint_every = 0 if cpu else 10


def checkpoints_activations(args, parameters: int, cuda: bool) -> bool:
    """--activation-checkpointing for a model of `parameters` on CUDA or not (a run's
    config.json from before the choice holds True or False)."""
    choice = args.activation_checkpointing
    if choice == "auto":
        return cuda and parameters >= 1e9
    return choice in (True, "on")


def uses_bf16(args, cuda: bool) -> bool:
    """--dtype: bf16 rollouts and autocast updates, where asked or (auto) where bf16 is fast."""
    from run.checkpoints import cpu_has_bf16
    return args.dtype == "bfloat16" or (args.dtype == "auto" and (cuda or cpu_has_bf16()))


def compile_choice(args):
    """--compile as SpeedUps' `compile` (engine/speedups.py): None (auto, its own choice), True or False.
    Runs configured before the flag existed mean auto."""
    return {"auto": None, "on": True, "off": False}[getattr(args, "compile", "auto")]


def graphs_choice(args, cuda: bool | None = None) -> bool:
    """--cuda-graphs as SpeedUps' `cuda_graphs` for a run on CUDA or not (None: on
    args.device): as asked, or (auto: the flag unset, or a resumed run's config.json without it)
    on CUDA unless --routing-replay, --compile on or --quantize nf4 (its dequantisation copies a
    host table each step, which a capture refuses); an MoE's step stays eager in
    speedups.step_function. On by default since measured: about 4x the eager decode on RL's long
    tail (MEASUREMENTS.md, "On a GPU")."""
    choice = getattr(args, "cuda_graphs", False)
    if choice is not None:
        return choice
    cuda = args.device.type == "cuda" if cuda is None else cuda
    return (cuda and not args.routing_replay and compile_choice(args) is not True
            and getattr(args, "quantize", "none") == "none")


def compiles_update(args, model) -> bool:
    """--compile for the update's forward and backward (speed.compile_blocks): on unless off, as
    it wins on both devices (MEASUREMENTS.md, "The update"), where it can run (a CPU needs a C++
    compiler); a Mixture-of-Experts model stays eager."""
    if getattr(args, "compile", "auto") == "off" or model.config.num_experts:
        return False
    return args.device.type == "cuda" or cpp_compiler_found()


def cpp_compiler() -> str:
    """The C++ compiler torch.compile calls for a CPU: $CXX, else clang++ on macOS, g++ elsewhere."""
    return os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")


def cpp_compiler_found() -> bool:
    return shutil.which(cpp_compiler()) is not None


def check_rejection(args, parser):
    """--tis-reject RULE and its bound: a rule losses.rollout_rejection knows, and a bound it can
    keep anything under."""
    rule, bound = args.tis_reject, args.tis_reject_bound
    if not rule:
        if bound:
            parser.error(f"--tis-reject-bound {bound:g} bounds --tis-reject RULE, which is off")
        return
    if rule == "seq_max_k1":
        parser.error("--tis-reject seq_max_k1: k1 = -log rho is signed, so its maximum over a "
                     "reply bounds one side only; use seq_mean_k1, seq_sum_k1 or token_k1")
    if rule not in losses.REJECTION_RULES:
        parser.error(f"--tis-reject {rule!r}: expected one of {', '.join(losses.REJECTION_RULES)}")
    lowest = 1 if rule.endswith("k1") else 0
    if not bound > lowest:
        parser.error(f"--tis-reject {rule} needs --tis-reject-bound > {lowest}"
                     + (" (k1 keeps ratios in [1/U, U])" if lowest else "") + f", got {bound:g}")


def reads_old_logprobs(args):
    """Whether pi_old is read before the update (REINFORCE++'s KL in the reward, the rollout
    correction's batch mean and rejection, --teacher's advantage): then step 3 scores it even at
    one update a step."""
    return (args.adv_estimator == "reinforce_pp" and args.reward_kl_coef > 0) \
        or args.tis_normalize or bool(args.tis_reject) or bool(getattr(args, "teacher", None))


def objective_settings(args, chosen=None):
    """objectives.OBJECTIVES[args.objective]'s own keyword arguments under these flags; the
    objectives in objectives.CHOOSING take `chosen` too (token_choice.chosen_tokens'
    "covariance")."""
    if args.objective == "sapo":
        return {"tau_pos": args.sapo_tau_pos, "tau_neg": args.sapo_tau_neg}
    settings = {"kl_coef": args.kl_cov_coef} if args.objective == "kl-cov" else \
        {"eps_low": args.eps_low, "eps_high": args.eps_high}
    if args.objective == "clip":
        settings["clip_c"] = args.clip_c
    if args.objective in objectives.CHOOSING:  # Clip-Cov, KL-Cov
        settings["chosen"] = chosen
    return settings


def tool_names(args):
    """--tools as a tuple of names (tools.TAGS' keys)."""
    return tuple(name.strip() for name in str(args.tools or "").split(",") if name.strip())


def check_tools(args, parser):
    """--tools: names tools.py knows, a sandbox where python is asked, a task of one turn."""
    names = tool_names(args)
    unknown = [name for name in names if name not in tools.TAGS]
    if unknown:
        parser.error(f"--tools {args.tools}: unknown {', '.join(unknown)}; expected "
                     f"{', '.join(tools.TAGS)}")
    if "python" in names and not tools.can_sandbox():
        parser.error("--tools python: this platform has no resource limits (Python's resource "
                     "module) to sandbox it; use --tools calculator")
    if args.unsandboxed_python and "python" not in names:
        parser.error("--unsandboxed-python acts on --tools python, which this run does not use")
    if "python" in names and tools.isolation() is None and not args.unsandboxed_python:
        parser.error(f"--tools python: bubblewrap cannot isolate the tool on this machine "
                     f"({tools.isolation_problem()}; it needs bubblewrap 0.5 or later and user "
                     "namespaces, which some containers and Ubuntu's AppArmor refuse). Without it the "
                     "model's code could read your files and the trainer's environment (API keys); "
                     "--unsandboxed-python runs it anyway under an audit hook")
    if "python" in names and tools.isolation() is None:
        print("--tools python: NOT isolated (--unsandboxed-python): the model's code runs as you, "
              "under an audit hook only", file=sys.stderr, flush=True)
    if names and str(args.data).startswith("memory"):
        parser.error("--tools: the memory task's turns are pages; tools act in one-turn tasks")


def sampling_options(args, stop_ids, seed=0):
    """rollout.generate's keyword arguments under this run's flags (besides prompts and samples):
    its Sampling, its EngineOptions with the speed-ups the flags choose, record_routing."""
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_p=args.top_p, stop_token_ids=stop_ids, seed=seed)
    speed = SpeedUps(compile=compile_choice(args), cuda_graphs=graphs_choice(args))
    engine = EngineOptions(kv_budget=args.kv_budget or None, max_rows=args.max_rows or None,
                           speed=speed)
    return dict(sampling=sampling, engine=engine, record_routing=args.routing_replay)


def reward_options(args, completion):
    """rewards.math_reward's keyword arguments for one completion under this run's flags."""
    options = {"correct": args.correct_reward, "wrong": args.wrong_reward,
               **shaping_options(args, completion)}
    if args.format_reward != "none":
        options.update(format_style=args.format_reward, format_weight=args.format_weight)
    return options


def shaping_options(args, completion):
    """rewards.shaping's: the overlong punishment (change 4, eq. 13), the perplexity penalty."""
    options = {}
    if args.overlong_penalty:
        options.update(length=len(completion.tokens), max_len=args.max_new_tokens,
                       cache_len=overlong_cache_tokens(args))
    if args.ppl_penalty != "off":
        mean_nll = -sum(completion.logprobs) / max(1, len(completion.logprobs))
        options.update(mean_nll=mean_nll, ppl_threshold=args.ppl_threshold, ppl_window=args.ppl_window)
    return options
