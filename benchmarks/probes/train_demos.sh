#!/usr/bin/env bash
# Train both embedded demo models on one GPU at once: demo-scenes continues from the shipped weights (its
# VAE decoder sharpened, then more transformer steps), demo-scenes-video from scratch. The two tiny models
# leave the GPU mostly idle, so they run side by side; every phase has a wall-clock budget (the trainers cut
# their step counts to fit it), so the whole run takes about 8 minutes on one H200.
#
#   bash benchmarks/probes/train_demos.sh OUT            # GPU: OUT/demo_scenes, OUT/demo_scenes_video
#   SMOKE=1 bash benchmarks/probes/train_demos.sh OUT    # CPU, a few steps: checks the commands run
#   VIDEO_VARIANTS=1 bash benchmarks/probes/train_demos.sh OUT
#       # demo-scenes-video only, recipes side by side (OUT/video_<name>.tar.gz and .log each):
#       # VIDEO_RECIPES="name=flags;name=flags" (flags added to the trainer's defaults); by default the
#       # defaults, 6 blocks instead of 8, and the start drawn anywhere (--travel 0.6 1), which left the
#       # direction at chance (docs/notes/benchmarks-log.md has the recipes tried and their tables).
#   VIDEO_VAE_S / VIDEO_TRANSFORMER_S: the video budgets in seconds (default 30 / 400), for shorter runs.
#
# Each folder gets its model card (README.md, with the held-out table) and train.log; both tables are
# printed at the end, and both folders are packed into OUT/demos.tar.gz. Needs torch and diffusers; the
# repository is imported as `ditserve` through a link.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=$(mkdir -p "${1:?usage: train_demos.sh OUT}" && cd "$1" && pwd)
PKG=$(mktemp -d)
ln -s "$ROOT" "$PKG/ditserve"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false

if [[ "${SMOKE:-0}" == 1 ]]; then
    image=(--device cpu --decoder-steps 3 --steps 3 --batch-size 4 --vae-batch-size 4 --pool-size 64
           --eval-scenes 2 --eval-seeds 1)
    video=(--device cpu --vae-steps 3 --steps 3 --batch-size 2 --vae-batch-size 8 --pool-scale 0.002
           --eval-scenes 2 --eval-seeds 1)
else
    # Budgets (s): image decoder 60 + transformer 300; video VAE 30 + transformer 400 (its compile included); the rest is drawing,
    # encoding and the held-out evaluation (~30-60 s each), so the video run (~500 s) ends last, under 9 min.
    # The video trainers measure their pace after 20 warm-up steps (the first steps pay for cuDNN's algorithm
    # search), so they use their budgets. The video VAE trains frame by frame on batches of 128 frames,
    # fine-tuning its analytic start (analytic_init, read right 48/48 before any step; ~45 ms a step on an
    # H200). The video transformer (1.5 M parameters) took 42 ms a step at batch 128, a few hundred GFLOP
    # a step: launch-bound, so a batch of 512 sees four times the clips at a small cost in steps.
    image=(--device cuda --decoder-steps 4000 --vae-time-budget-s 60 --steps 20000 --time-budget-s 300
           --batch-size 512 --vae-batch-size 128 --lr 0.0002 --pool-size 49152 --eval-scenes 24 --eval-seeds 2)
    video=(--device cuda --vae-steps 20000 --vae-time-budget-s "${VIDEO_VAE_S:-30}" --steps 30000
           --time-budget-s "${VIDEO_TRANSFORMER_S:-400}" --compile
           --batch-size 512 --vae-batch-size 128 --vae-lr 0.003 --lr 0.0005 --eval-scenes 24 --eval-seeds 1)
fi

start=$SECONDS
if [[ "${VIDEO_VARIANTS:-0}" == 1 ]]; then
    # VIDEO_RECIPES="name=flags;name=flags" replaces the sweep below (its flags added to the common ones).
    common=""  # the trainer's defaults: sigma shift 6, edge-to-edge travel, 8 blocks, 5-frame clips
    recipes=${VIDEO_RECIPES:-"default=;l6=--num-layers 6;travel60=--travel 0.6 1"}
    declare -A recipe=()
    names=()
    IFS=';' read -ra parts <<< "$recipes"
    for part in "${parts[@]}"; do
        names+=("video_${part%%=*}")
        recipe["video_${part%%=*}"]="$common ${part#*=}"
    done
    pids=()
    for name in "${names[@]}"; do
        mkdir -p "$OUT/$name"
        # shellcheck disable=SC2086  # the recipe's flags split on purpose
        python3 -m ditserve.replica.models.train_demo_video --out "$OUT/$name" --seed 0 --caption-dropout 0.1 \
            "${video[@]}" ${recipe[$name]} > "$OUT/$name/train.log" 2>&1 &
        pids+=($!)
    done
    status=0
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    rm -rf "$PKG"
    for name in "${names[@]}"; do
        echo "== $name: ${recipe[$name]} ($((SECONDS - start)) s so far)"
        grep -E "VAE reconstructions|fit|caption|held-out|training captions|done in|compile|Error" "$OUT/$name/train.log" || true
        # One archive per recipe (a device run brings back a few files of a limited size).
        cp "$OUT/$name/train.log" "$OUT/$name.log"
        tar -C "$OUT" -czf "$OUT/$name.tar.gz" "$name" && rm -rf "${OUT:?}/$name"
    done
    echo "total $((SECONDS - start)) s; archives: $OUT/video_*.tar.gz"
    exit "$status"
fi
mkdir -p "$OUT/demo_scenes" "$OUT/demo_scenes_video"
python3 -m ditserve.replica.models.train_demo --out "$OUT/demo_scenes" \
    --init-from "$ROOT/replica/models/demo_scenes" --vae-steps 0 --seed 1 \
    --caption-dropout 0.1 --long-text-fraction 0.25 "${image[@]}" \
    > "$OUT/demo_scenes/train.log" 2>&1 &
image_pid=$!
python3 -m ditserve.replica.models.train_demo_video --out "$OUT/demo_scenes_video" --seed 0 \
    --caption-dropout 0.1 "${video[@]}" \
    > "$OUT/demo_scenes_video/train.log" 2>&1 &
video_pid=$!

status=0
wait "$image_pid" || { status=1; echo "demo-scenes training failed:"; tail -n 30 "$OUT/demo_scenes/train.log"; }
wait "$video_pid" || { status=1; echo "demo-scenes-video training failed:"; tail -n 30 "$OUT/demo_scenes_video/train.log"; }
rm -rf "$PKG"

for name in demo_scenes demo_scenes_video; do
    echo "== $name ($((SECONDS - start)) s so far)"
    grep -E "VAE reconstructions|cut to|held-out|training captions|done in" "$OUT/$name/train.log" || true
    if [[ -f "$OUT/$name/README.md" ]]; then
        sed -n '/^## Held-out/,/^Held-out captions/p' "$OUT/$name/README.md" | grep '^|' || true
    fi
done
# One archive of both folders: a device run's output folder brings back only shallow files.
tar -C "$OUT" -czf "$OUT/demos.tar.gz" demo_scenes demo_scenes_video
echo "total $((SECONDS - start)) s; archive: $OUT/demos.tar.gz"
exit "$status"
