"""The sampler's machinery beside `rollout.py`: the paged KV engine and the speed-ups applied to it
from outside.

- `paged.py`: the paged KV engine (block pool, queue of rows, prefill shared by a prompt's samples,
  preemption), the design of vLLM and nano-vllm; `rollout.generate` runs it.
- `speedups.py`: `SpeedUps`, the speed-ups a caller hands `rollout.generate` (engine=
  EngineOptions(speed=SpeedUps(...))): which decode step, which cache, which products.
- `speed.py`: the CPU speed-ups (oneDNN products on packed weights, kept rows, compiled blocks).
- `cuda_graphs.py`, `flex_decode.py`: a GPU's decode steps as CUDA graphs; attention that reads
  the KV pool in place through FlexAttention.
- `chunked_logprobs.py`: token log-probs without the (B, T, V) logits, for `model.token_logprobs`.

rollout.py imports paged.py alone (and model.py its log-prob kernel): the rest is applied from
outside. Read it when the sampler's speed or memory is the question.
"""
