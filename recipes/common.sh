# Shared by the recipes (sourced, not run): every arm x every seed, each in its own run
# directory, then the comparison table and plot. A recipe sets ARMS (presets), CPU_FLAGS and
# GPU_FLAGS, then calls run_study. Environment:
#   SIZE=cpu|gpu   which flags (default cpu)        SEEDS="0 1 2"   the seeds of every arm
#   ARMS="a b"     the presets to run (default: the recipe's own list)
#   OUT=DIR        where the runs go                EXTRA="..."      flags added to every run
#   PYTHON=python  the interpreter                  GPUS=8           torchrun's processes (gpu)
#   LAUNCH="..."   the training command (default: python train.py, or torchrun on gpu)
#   DRY_RUN=1      print the commands, run nothing
#   KEEP_CHECKPOINTS=1  keep a finished run's resume checkpoints (by default only final/ and
#                  the logs stay: the two checkpoints of a 135M run are 3.2 GB, a grid's ~60 GB)
# Re-running a recipe resumes: finished runs are kept, interrupted ones continue (--resume).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

run_study() {
    local name=$1 size=${SIZE:-cpu} python=${PYTHON:-python}
    local out=${OUT:-runs/$name-$size} flags launch
    if [ "$size" = cpu ]; then
        flags=$CPU_FLAGS
        launch=${LAUNCH:-$python train.py}
    elif [ "$size" = gpu ]; then
        flags=$GPU_FLAGS
        launch=${LAUNCH:-torchrun --nproc_per_node ${GPUS:-8} train.py}
    else
        echo "SIZE must be cpu or gpu, got $size" >&2
        return 2
    fi
    if [ -z "$(echo $ARMS)" ]; then
        echo "ARMS names no preset" >&2
        return 2
    fi
    local dirs=() arm seed dir command
    for arm in $ARMS; do
        for seed in ${SEEDS:-0 1 2}; do
            dir=$out/$arm-s$seed
            dirs+=("$dir")
            if [ -e "$dir/final/config.json" ]; then
                continue  # finished before
            elif [ -e "$dir/config.json" ]; then
                command="$launch --resume $dir"
            else
                command="$launch --preset $arm --seed $seed --out $dir $flags ${EXTRA:-}"
            fi
            echo "+" $command  # one line: the flags as the shell splits them
            [ -n "${DRY_RUN:-}" ] && continue
            $command
            [ -n "${KEEP_CHECKPOINTS:-}" ] || rm -f "$dir/checkpoint.pt" "$dir/checkpoint-previous.pt"
        done
    done
    echo "+ $python train.py --plot ${dirs[*]}"
    [ -n "${DRY_RUN:-}" ] || $python train.py --plot "${dirs[@]}"
}
