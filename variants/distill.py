"""On-policy distillation (OPD; Agarwal et al. 2023, GKD, arXiv 2306.13649; Thinking Machines,
"On-Policy Distillation", 2025): the student samples, a teacher scores the student's own tokens,
and each token's advantage is the teacher's log-prob less the student's, the sample estimate of
the negative reverse KL, KL(pi_S || pi_T) = E_{y ~ pi_S}[log pi_S(y) - log pi_T(y)]. A dense reward
where the verifier's is one number a reply; added to the verifier's advantage with a weight, as
prime-rl blends them, or alone.

    python train.py --preset opd --teacher runs/NAME/final     # the teacher's term alone
    python train.py --teacher runs/NAME/final --teacher-coef 0.5   # beside DAPO's advantage

    A_i,t = c_v * A_i + c_T * (log pi_T(y_i,t | x_i, y_i,<t) - log pi_S(y_i,t | x_i, y_i,<t))

A_i: the verifier's advantage (eq. 9, or the --adv-estimator's; c_v --verifier-coef, 0 in the opd
preset), c_T --teacher-coef. pi_S is pi_old, the student's log-probs in step 3's scoring pass,
and pi_T the teacher's in the same pass at the same temperature: a teacher identical to the student
gives every token an advantage of 0. The term is a per-token reward of its own token only (no
sum over the tokens after it: Thinking Machines' discount of 0), so the loss is the run's
objective (clipped or the plain policy gradient) with the same divisors.
"""

from dataclasses import replace

import torch

from run import checkpoints
from run.distributed import all_reduce


def check_teacher(teacher, student, student_tokenizer):
    """The teacher's config, read before any weight, once its tokenizer is the student's (the
    same ids for the same text, the same special tokens); ValueError naming both otherwise."""
    config = checkpoints.load_config(teacher)  # (first: "no config.json" says what is missing)
    teacher_tokenizer = checkpoints.load_tokenizer(teacher)
    ours, theirs = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=str)[:3]
        raise ValueError(f"the teacher {teacher} and the student {student or 'bundled SmolLM2-135M'} "
                         f"tokenize differently ({len(theirs)} and {len(ours)} entries; e.g. "
                         f"{differ}): the teacher must score the student's own token ids")
    if config.vocab_size < len(ours):
        raise ValueError(f"the teacher {teacher}'s head has {config.vocab_size} rows for a "
                         f"vocabulary of {len(ours)}")
    return config


def load_teacher(teacher, device, bf16_on_cuda):
    """The frozen teacher, in bf16 on a GPU where the run is in bf16 (memory_plan.py counts it so),
    else in fp32."""
    dtype = torch.bfloat16 if bf16_on_cuda else torch.float32
    model, _ = checkpoints.load_model(teacher, dtype=dtype, device=device)
    return model.eval().requires_grad_(False)


def teacher_advantages(student, teacher, verifier, teacher_coef, verifier_coef):
    """A_t = verifier_coef * A + teacher_coef * (teacher_t - student_t) for one reply: student and
    teacher its tokens' log-probs (T,), verifier its advantage (a number, or (T,) REINFORCE++'s).
    -> (T,) float64"""
    student = torch.as_tensor(student, dtype=torch.float64)
    teacher = torch.as_tensor(teacher, dtype=torch.float64)
    return verifier_coef * torch.as_tensor(verifier, dtype=torch.float64) + teacher_coef * (teacher - student)


def with_teacher(run, batch, scored_logprobs):
    """Step 4 with --teacher: every row's advantage per token (the module's equation), and its
    mean log pi_S - log pi_T logged as the reward part "teacher_kl". scored_logprobs: train.py's
    (run, batch, rows, model=) scoring pass. Without a teacher: the batch as it is."""
    if run.teacher is None:
        return batch
    args, rows = run.args, list(range(len(batch.tokens)))
    teacher = scored_logprobs(run, batch, rows, model=run.teacher)
    advantages = [teacher_advantages(old, t, a, args.teacher_coef, args.verifier_coef).tolist()
                  for old, t, a in zip(batch.old_logprobs, teacher, batch.advantages)]
    kl = [float((torch.tensor(old, dtype=torch.float64) - torch.tensor(t, dtype=torch.float64)).mean())
          if t else 0.0 for old, t in zip(batch.old_logprobs, teacher)]
    return replace(batch, advantages=advantages,
                   reward_parts=[{**parts, "teacher_kl": k} for parts, k in zip(batch.reward_parts, kl)])


def logged(run, batch):
    """The step's teacher_kl for metrics.jsonl: the mean of log pi_S - log pi_T over the kept
    tokens of every rank (with_teacher's parts); {} without a teacher."""
    if run.teacher is None:
        return {}
    total = all_reduce(torch.tensor([sum(p["teacher_kl"] * len(t) for p, t in zip(batch.reward_parts, batch.tokens)),
                                     float(sum(len(t) for t in batch.tokens))], dtype=torch.float64))
    return {"teacher_kl": float(total[0] / total[1].clamp(min=1))}
