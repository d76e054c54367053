# Shared by the recipes (sourced, not run): every arm x every seed, each in its own run
# directory, then the comparison table and plot. A recipe sets ARMS (presets), CPU_FLAGS and
# GPU_FLAGS, then calls run_study. Environment:
#   SIZE=cpu|gpu   which flags (default cpu)        SEEDS="0 1 2"   the seeds of every arm
#   ARMS="a b"     the presets to run (default: the recipe's own list)
#   OUT=DIR        where the runs go                EXTRA="..."      flags added to every run
#   PYTHON=python  the interpreter                  GPUS=8           torchrun's processes (gpu)
#   LAUNCH="..."   the training command (default: python train.py, or torchrun on gpu)
#   JOBS=2         runs at once, each at nproc/JOBS threads (OMP_NUM_THREADS if set), its output
#                  in DIR.log; the figures in MEASUREMENTS.md were measured with JOBS=2 on 2 cores
#   DRY_RUN=1      print the commands, run nothing
#   KEEP_CHECKPOINTS=1  keep a finished run's resume checkpoints (by default only final/ and
#                  the logs stay: the two checkpoints of a 135M run are 3.2 GB, a grid's ~60 GB)
# Re-running a recipe resumes: finished runs are kept, interrupted ones continue (--resume).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# An arm that is not a preset of its own: ARM_PRESET[arm] its preset, ARM_FLAGS[arm] flags added to
# its runs ({seed} stands for the run's seed).
declare -A ARM_PRESET=() ARM_FLAGS=()

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
    local jobs=${JOBS:-1} dirs=() failed=() arm seed dir command
    if ! [[ "$jobs" =~ ^[1-9][0-9]*$ ]]; then
        echo "JOBS must be a whole number of runs at once (1, 2, ...), got '$jobs'" >&2
        return 2
    fi
    local -A running=()  # pid -> run directory, while JOBS > 1
    local threads=${OMP_NUM_THREADS:-$(( $(nproc) / jobs > 0 ? $(nproc) / jobs : 1 ))}
    for arm in $ARMS; do
        for seed in ${SEEDS:-0 1 2}; do
            dir=$out/$arm-s$seed
            dirs+=("$dir")
            if [ -e "$dir/final/config.json" ]; then
                continue  # finished before
            elif [ -e "$dir/config.json" ]; then
                command="$launch --resume $dir"
            else
                command="$launch --preset ${ARM_PRESET[$arm]:-$arm} --seed $seed --out $dir $flags"
                command="$command ${ARM_FLAGS[$arm]:-} ${EXTRA:-}"
                command=${command//\{seed\}/$seed}
            fi
            wait_for_runs "$jobs"  # JOBS > 1: a free slot
            echo "+" $command  # one line: the flags as the shell splits them
            [ -n "${DRY_RUN:-}" ] && continue
            if [ "$jobs" -le 1 ]; then
                train_one "$dir" $command
                continue
            fi
            mkdir -p "$out"
            OMP_NUM_THREADS=$threads train_one "$dir" $command > "$dir.log" 2>&1 &
            running[$!]=$dir
        done
    done
    wait_for_runs 1  # every run has ended
    if [ ${#failed[@]} -gt 0 ]; then
        echo "failed (see DIR.log; run the recipe again to resume): ${failed[*]}" >&2
        return 1
    fi
    echo "+ $python run/runs.py ${dirs[*]}"
    [ -n "${DRY_RUN:-}" ] || $python run/runs.py "${dirs[@]}"
}

# Until fewer than $1 runs are running: run_study's `running` (pid -> run directory) loses each run
# that ends, and `failed` gains those that failed. `wait -n` can miss a run that bash reaped
# before it was called (it then names no pid, seen once in CI); `wait PID` still has its status.
wait_for_runs() {
    local pid status
    while [ ${#running[@]} -ge "$1" ]; do
        pid= status=0
        wait -n -p pid || status=$?
        if [ -z "$pid" ]; then
            for pid in "${!running[@]}"; do break; done  # any of them: each is waited in turn
            status=0
            wait "$pid" || status=$?
        fi
        [ "$status" -eq 0 ] || failed+=("${running[$pid]}")
        unset "running[$pid]"
    done
}

# One run, then its resume checkpoints go (a finished run keeps final/ and its logs).
train_one() {
    local dir=$1
    shift
    "$@" || return
    [ -n "${KEEP_CHECKPOINTS:-}" ] || rm -f "$dir/checkpoint.pt" "$dir/checkpoint-previous.pt"
}
