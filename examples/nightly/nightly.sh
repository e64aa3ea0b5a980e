#!/usr/bin/env bash
# Nightly draft refresh: new chat logs in, a better draft out (or the current one kept), served τ checked.
#
#   LOG_SOURCE=/var/log/chat-service  examples/nightly/nightly.sh
#
# 1. copies the day's new log files from $LOG_SOURCE (if set) into examples/nightly/logs/;
# 2. runs the pipeline (regenerate answers only the new records; promote replaces deploy/smollm2/current only when
#    the new draft is better, keeping the old one as previous);
# 3. when it promoted, runs $RELOAD_CMD (if set): whatever makes the serving fleet load deploy/smollm2/current;
# 4. with $VLLM_URL set, checks the served τ over 5 minutes against what the draft was validated at (exit 4 when
#    it fell more than 10%).
# Exit codes: 0 done, 1 a stage failed (one line on stderr says why), 4 served τ fell. Rerun after a failure:
# finished stages are skipped and an interrupted one resumes.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=examples/nightly

if [ -n "${LOG_SOURCE:-}" ]; then
    mkdir -p "$here/logs"
    find "$LOG_SOURCE" -maxdepth 1 -name '*.jsonl' -newer "$here/logs" -exec cp -n {} "$here/logs/" \; || true
    touch "$here/logs"
fi

tiny-speculators pipeline --config "$here/nightly.yaml"

promoted=$(python3 -c 'import json; print(json.load(open("runs/nightly/summary.json")).get("promotion", {}).get("promoted", False))')
if [ "$promoted" = "True" ] && [ -n "${RELOAD_CMD:-}" ]; then
    echo "nightly: promoted; reloading the fleet: $RELOAD_CMD"
    bash -c "$RELOAD_CMD"
fi

if [ -n "${VLLM_URL:-}" ]; then
    tiny-speculators monitor --endpoint "$VLLM_URL" --draft deploy/smollm2/current --out runs/nightly/monitor \
        --interval 300 --windows 1 --tolerance 0.1
fi
